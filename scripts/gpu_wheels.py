"""The wheels to carry to an offline GPU machine for scripts/gpu_check.sh: the pinned packages its image
lacks, for the image's Python, fetched or built here where PyPI is reachable. The image keeps its own torch (never
reinstalled: it is the CUDA build the machine was made with) and every package it already has.

    python scripts/gpu_wheels.py [--out .whl] [--python_version 3.12] [--dry_run]

Then on the GPU machine, from the repository (the one command; no network needed):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \\
        && PYTHONPATH=/tmp/site bash scripts/gpu_check.sh

What is carried: deepspeed and datasets at requirements.txt's pins, and those of their requirements that the image
lacks, at the versions this checkout's tests ran with (this environment's). deepspeed publishes no wheel, so its
wheel is built here (pure Python: its ops are compiled on the GPU machine when first used, FusedAdam by the check's
`ops` row). About 6 MiB in all.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The GPU image's packages that the check needs (its full list is longer): never carried.
IMAGE_HAS = frozenset(
    {
        "torch",
        "transformers",
        "peft",
        "accelerate",
        "tokenizers",
        "safetensors",
        "huggingface-hub",
        "numpy",
        "pyarrow",
        "pandas",
        "fsspec",
        "filelock",
        "packaging",
        "psutil",
        "tqdm",
        "pyyaml",
        "jinja2",
        "einops",
        "msgpack",
        "ninja",
        "py-cpuinfo",
        "xxhash",
        "matplotlib",
        "tensorboard",
        "typing-extensions",
    }
)
PINNED = ("deepspeed", "datasets")  # at requirements.txt's versions
# Their requirements that the image lacks (deepspeed: pydantic and hjson; datasets: dill and multiprocess).
NEEDED = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "hjson", "dill", "multiprocess")
NO_WHEEL_ON_PYPI = ("deepspeed",)  # an sdist only: built into a wheel here
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pins(requirements: Path) -> dict:
    """{name: version} of the `name==version` lines of a requirements file."""
    found = {}
    for line in requirements.read_text().splitlines():
        match = re.match(r"^\s*([A-Za-z0-9_.-]+)==([^\s;#]+)", line)
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def to_carry(requirements: Path = REPO / "requirements.txt") -> dict:
    """{package: version} to carry: the pinned two, then their needs at this environment's versions."""
    pinned = pins(requirements)
    carry = {name: pinned[name] for name in PINNED}
    for name in NEEDED:
        carry[name] = importlib.metadata.version(name)
    overlap = sorted(set(carry) & IMAGE_HAS)
    assert not overlap, f"never carried (the image has them): {overlap}"
    return carry


def fetch(carry: dict, out: Path, python_version: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, version in carry.items():
        if name in NO_WHEEL_ON_PYPI:  # setup.py imports torch: build with this environment's, in no isolated env
            cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out)]
        else:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(out)]
            cmd += ["--python-version", python_version, "--implementation", "cp"]
            cmd += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        subprocess.run([*cmd, f"{name}=={version}"], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / ".whl", help="folder for the wheels (default .whl)")
    parser.add_argument("--python_version", default="3.12", help="the GPU image's Python (default 3.12)")
    parser.add_argument("--dry_run", action="store_true", help="print what would be carried, fetch nothing")
    args = parser.parse_args(argv)
    carry = to_carry()
    print("carry: " + ", ".join(f"{name}=={version}" for name, version in carry.items()))
    print("not carried (the image has them, torch never reinstalled): " + ", ".join(sorted(IMAGE_HAS)))
    if args.dry_run:
        return 0
    fetch(carry, args.out, args.python_version)
    wheels = sorted(args.out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.1f} MiB, in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
