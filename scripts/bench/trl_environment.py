"""The TRL side's environment for scripts/bench/compare_trl_dpo.py: whether the venv meets TRL's requirements, and
each side's child environment (offline, its threads, its caches; TRL's folder first on PYTHONPATH)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from scripts.launching import child_env


def unmet_requirements(metadata: str, version_of: Callable[[str], str | None]) -> list:
    """The unconditional Requires-Dist lines of a METADATA text that `version_of` (name -> installed version, None
    when absent) does not satisfy, each as 'requirement (installed: version)'. Extras and other platforms are not
    asked for."""
    from packaging.requirements import Requirement

    unmet = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = version_of(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req} (installed: {have or 'none'})")
    return unmet


def installed_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def trl_env(trl_dir: Path, threads: int, cache: Path) -> dict:
    """The TRL child's environment: TRL's folder first on PYTHONPATH, then child_env's (the repository, then the
    caller's PYTHONPATH); offline, OMP_NUM_THREADS."""
    env = run_env(threads, cache)
    env["PYTHONPATH"] = os.pathsep.join([str(trl_dir), env["PYTHONPATH"]])
    return env


def run_env(threads: int, cache: Path) -> dict:
    """Either side's environment: offline, the thread count, caches in the work folder."""
    return child_env(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(cache / "datasets"),
        SCALETRAIN_CACHE=str(cache / "scaletrain"),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=str(threads),
    )
