"""Launching a script of the repository (train.py, a benchmark, a test's helper) as a child process: the one place
that builds a launcher's command line and the child's environment, and runs it. The tests, the benchmarks and the
GPU check all start their runs through it:

    from scripts.launching import Launcher, child_env, run

    cmd = Launcher("deepspeed", nprocs=2).command("train.py", ["--config", "ds_configs/zero2.json"])
    proc = run(cmd, child_env(work / "cache"), timeout=900)  # stdout and stderr in proc, or in a log= file

Launchers (Launcher.kind):
- "deepspeed": DeepSpeed's runner (`deepspeed --num_gpus N script args`), as a module of this interpreter: found
  wherever deepspeed is importable (a venv, or a `pip install --target DIR` on PYTHONPATH, which puts no `deepspeed`
  script beside the interpreter).
- "launch.py": DeepSpeed's launch.py started directly for N ranks on this host, the world encoded as the runner
  encodes it. The runner does no more on one node than start launch.py (with the working directory on PYTHONPATH,
  which child_env sets), so this saves an interpreter and an import of DeepSpeed per run (~3 s on 2 cores): the
  tests' way. `launch_code` is the Python code that runs launch.py (the tests give theirs, which changes its
  timing only: tests/harness.py).
- "torchrun": the torchrun installed beside this interpreter.
- "python": this interpreter, one process.

Standard library only at the top level: the GPU check imports this on a machine whose packages are carried beside
the image (a `pip install --target` folder on PYTHONPATH), before anything else of the repository.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the scripts installed beside this interpreter (torchrun, deepspeed)
# DeepSpeed's runner as a module of this interpreter (no `deepspeed` script assumed beside it).
DEEPSPEED = (sys.executable, "-m", "deepspeed.launcher.runner")
# DeepSpeed's launch.py, run as `python -m deepspeed.launcher.launch` runs it.
LAUNCH_PY_CODE = "import runpy; runpy.run_module('deepspeed.launcher.launch', run_name='__main__', alter_sys=True)"
LAUNCHERS = ("deepspeed", "launch.py", "torchrun", "python")
# Nothing may be downloaded at run time.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# What a launcher (or srun) sets for its ranks: a run started from inside one (a test under a launcher, a check in a
# Slurm job step) must not take them for its own.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID")


def free_port() -> int:
    """A TCP port free on this host now (scaletrain.distributed.world's, imported when a launch needs one)."""
    from scaletrain.distributed.world import free_port as free  # torch's import, only when a launch needs it

    return free()


@dataclass(frozen=True)
class Launcher:
    """How a script is started: the launcher, its ranks on this host, and what the launcher itself is given."""

    kind: str = "python"  # one of LAUNCHERS
    nprocs: int = 1
    # --master_port: a port free now; False leaves the launcher's default (29500), which another job may hold
    pick_port: bool = True
    launcher_args: tuple = ()  # more flags for the launcher, before the script (e.g. "--hostfile", "hosts")
    launch_code: str = LAUNCH_PY_CODE  # "launch.py" only: the code that runs DeepSpeed's launch.py

    def __post_init__(self) -> None:
        if self.kind not in LAUNCHERS:
            raise ValueError(f"launcher {self.kind!r}: one of {', '.join(LAUNCHERS)}")
        if self.kind == "python" and self.nprocs != 1:
            raise ValueError(f"plain python starts one process, not {self.nprocs}")

    def command(self, script: str | Path, args: list) -> list:
        """The command line that runs `script` with `args` under this launcher."""
        port = [str(free_port())] if self.pick_port and self.kind != "python" else []
        if self.kind == "deepspeed":
            start = [*DEEPSPEED, "--num_gpus", str(self.nprocs), *(["--master_port", *port] if port else [])]
        elif self.kind == "launch.py":
            world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(self.nprocs))}).encode()).decode()
            start = [sys.executable, "-u", "-c", self.launch_code, f"--world_info={world}"]
            start += ["--master_addr=127.0.0.1", *([f"--master_port={port[0]}"] if port else []), "--log_level=info"]
        elif self.kind == "torchrun":
            start = [str(BIN / "torchrun"), "--nproc_per_node", str(self.nprocs)]
            start += ["--master_port", *port] if port else []
        else:
            start = [sys.executable]
        return [*start, *self.launcher_args, str(script), *args]


def child_env(cache: Path | None = None, **overrides: str) -> dict:
    """This process's environment for a child run from the repository: offline (OFFLINE), the repository first on
    PYTHONPATH and the caller's PYTHONPATH kept after it (packages carried beside an image's own, `pip install
    --target`); then `overrides`.

    With `cache`, a run of its own, as the tests and the comparisons start theirs: datasets' cache and the token
    stores under `cache` (datasets/, scaletrain/), wandb offline, the tokenizers single-threaded, and none of the
    RANK_VARIABLES of a launcher that started this process."""
    env = {**os.environ, **OFFLINE}
    if cache is not None:
        env.update(
            {
                "HF_DATASETS_CACHE": str(cache / "datasets"),
                "SCALETRAIN_CACHE": str(cache / "scaletrain"),  # the token stores the runs prepare
                "WANDB_MODE": "offline",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        for var in RANK_VARIABLES:
            env.pop(var, None)
    env.update(overrides)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *kept])
    return env


def run(
    cmd: list, env: dict, *, timeout: float | None = None, log: Path | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run `cmd` from `cwd` (the repository) with `env`; the finished process, its stdout and stderr as text, or both
    in the file `log` when given (then the process holds neither). subprocess.TimeoutExpired past `timeout` seconds
    (the process killed)."""
    if log is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with Path(log).open("w") as out:
        return subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
