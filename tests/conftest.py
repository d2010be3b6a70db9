"""Shared helpers: launch the real pipeline in subprocesses (deepspeed launcher, torchrun, plain python)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parent.parent
# DeepSpeed's compiled ops are cached per virtual environment under test: two checkouts (a CI clone and a working
# copy) sharing ~/.cache/torch_extensions would rebuild each other's ops, under each other's running processes.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
VENV_BIN = Path(sys.executable).parent
PROBE = REPO / "tests" / "helpers" / "probe_run.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(tmp_cache: Path) -> dict:
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",  # nothing may be downloaded at run time
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_cache / "datasets"),
        "SCALETRAIN_CACHE": str(tmp_cache / "scaletrain"),  # token stores the runs prepare
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
    })
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID"):
        env.pop(var, None)
    return env


def pytest_sessionstart(session) -> None:
    """Build DeepSpeed's CPU ops once, up front (minutes on a fresh machine), so no test's time limit pays it."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "build_ops.py")], cwd=REPO, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise pytest.UsageError(f"scripts/build_ops.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_cache")


def launch(script: Path, args: list, launcher: str, cache: Path, nprocs: int = 1, cwd: Path = REPO,
           timeout: int = 900, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run `script` with `args` under 'deepspeed', 'torchrun' or 'python'; return the finished process."""
    if launcher == "deepspeed":
        cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(free_port()),
               str(script), *args]
    elif launcher == "torchrun":
        cmd = [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(nprocs), "--master_port", str(free_port()),
               str(script), *args]
    else:
        assert nprocs == 1
        cmd = [sys.executable, str(script), *args]
    return subprocess.run(cmd, cwd=cwd, env={**subprocess_env(cache), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def read_metrics(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


# Small and fast: blocks of 64 tokens, 4 per micro-batch, no progress bar.
FAST_FLAGS = ["--block_size", "64", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
              "--max_eval_samples", "32", "--logging_steps", "2", "--disable_tqdm"]


@contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A real file system of `size` (tmpfs, e.g. "50m") mounted at `folder`, for full-disk tests; skips without root."""
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                            str(folder)]).returncode:
        pytest.skip("mounting a small file system needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)])
