"""What the tests share besides fixtures and hooks (those are in conftest.py): launching train.py or a helper of
tests/helpers/ the way the tests do, checking a finished run, reading its metrics, acting at a given point of a run,
the tests' quick flags, and small disks.

Every launch goes through scripts/launching.py (the command line, the child's environment, the run), shared with
the benchmarks and the GPU check. What is the tests' own is here: DeepSpeed's launcher started as launch.py with a
timing patch (LAUNCH_WITHOUT_FINAL_COLLECTION), a cache folder per run, and a time limit.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from scaletrain.distributed.world import free_port  # noqa: F401 (the tests' rendezvous take it from here)
from scaletrain.observability.metrics import METRICS_FILE, read_records
from scripts.launching import BIN as VENV_BIN, REPO, Launcher, child_env, run  # noqa: F401 (VENV_BIN: the tests')

# DeepSpeed's compiled ops are cached per virtual environment under test: two checkouts (a CI clone and a working
# copy) sharing ~/.cache/torch_extensions would rebuild each other's ops, under each other's running processes.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
PROBE = REPO / "tests" / "helpers" / "probe_run.py"

# DeepSpeed's launch.py, run as `python -m deepspeed.launcher.launch` would, with two changes of timing only (the
# tests' option of scripts/launching.py's "launch.py" launcher; scripts/bench/test_launch.py times both against
# launch.py as shipped):
# - the garbage collector's objects frozen once its own exit handlers ran: the interpreter's last collection of what
#   torch and DeepSpeed hold took over a second per launch after the ranks had exited (train.py spares its ranks the
#   same way);
# - its monitor loop polls the ranks every 0.05 s instead of every second (`time.sleep(1)` is launch.py's only sleep):
#   it slept a whole second after the last rank had exited, and half a second on average before noticing it, ~1.5 s
#   of every launch of the suite. What it does when a rank exits (0 or not) is DeepSpeed's code, unchanged.
LAUNCH_POLL_PATCH = "_sleep = time.sleep; time.sleep = lambda seconds: _sleep(min(seconds, 0.05)); "
LAUNCH_WITHOUT_FINAL_COLLECTION = (
    "import atexit, gc, runpy, time; atexit.register(gc.freeze); "
    + LAUNCH_POLL_PATCH
    + "runpy.run_module('deepspeed.launcher.launch', run_name='__main__', alter_sys=True)"
)


def deepspeed_cmd(nprocs: int, script, args: list) -> list:
    """DeepSpeed's launcher for `nprocs` ranks on this host, as `deepspeed --num_gpus N script args` runs it, started
    as launch.py directly (scripts/launching.py's "launch.py", with the timing patch above). The tests of the
    documented commands (the README's, scaletrain.launcher's, the smoke script's) still go through the runner."""
    return Launcher("launch.py", nprocs, launch_code=LAUNCH_WITHOUT_FINAL_COLLECTION).command(script, args)


def launch(
    script: Path,
    args: list,
    launcher: str,
    cache: Path,
    *,
    nprocs: int = 1,
    timeout: int = 900,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run `script` with `args` under 'deepspeed' (deepspeed_cmd), 'torchrun' or 'python', from the test's working
    directory (its view of the checkout, tests/conftest.py), with the tests' environment (child_env: offline, caches
    under `cache`) and `env` over it; the finished process, its output captured. subprocess.TimeoutExpired past
    `timeout` seconds."""
    if launcher == "deepspeed":
        cmd = deepspeed_cmd(nprocs, script, args)
    else:
        cmd = Launcher(launcher, nprocs).command(script, args)
    return run(cmd, child_env(cache, **(env or {})), timeout=timeout, cwd=Path.cwd())


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )


# --- A run's metrics.jsonl, read by the pipeline's own reader (scaletrain.observability.read_records).


def read_metrics(run_dir: Path) -> list:
    """The records of a finished run's metrics.jsonl (whose last line is whole)."""
    records, torn = read_records(run_dir / METRICS_FILE)
    assert not torn, f"{run_dir / METRICS_FILE}: its last line is cut short"
    return records


def train_losses(run_dir: Path) -> list:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def logged_steps(run_dir: Path) -> list:
    """The steps of the training records in a running job's metrics.jsonl: complete lines only (rank 0 may be in
    the middle of writing one)."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    return [r["step"] for r in read_records(path)[0] if "loss" in r]


# --- Acting at a given point of a run: stop it there (SIGSTOP) instead of racing it. A test that waits for a state
# and then kills or signals a process would otherwise test whatever state a faster (or slower) machine is in by
# the time the signal lands; a stopped process cannot run ahead while the test checks the state it needs.


def _thread_states(pid: int) -> list:
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # a thread that has just ended
    return states


def freeze(*pids: int, timeout: float = 60) -> None:
    """SIGSTOP the processes; return once every thread of each has stopped (delivery is asynchronous)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while any(state not in "TtZX" for state in _thread_states(pid)):
            assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout}s"
            time.sleep(0.001)


def thaw(*pids: int) -> None:
    """SIGCONT: the processes continue, and handle the signals sent to them while they were stopped."""
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def signal_pending(pid: int, sig: int) -> bool:
    """Whether `sig` was sent to the process and waits for it to run (a stopped process gets it when continued)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    pending = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return bool(pending >> (sig - 1) & 1)


# MFU against a given peak: skips the CPU's 0.5 s matrix-product calibration in every launch (about 3 minutes of the
# suite). test_single_process_python_with_wandb_offline runs without it and checks the calibration.
GIVEN_PEAK = ["--peak_tflops", "0.2"]

# Small and fast: blocks of 64 tokens, 4 per micro-batch, no progress bar, no calibration.
FAST_FLAGS = [
    *GIVEN_PEAK,
    "--block_size",
    "64",
    "--per_device_train_batch_size",
    "4",
    "--per_device_eval_batch_size",
    "8",
    "--max_eval_samples",
    "32",
    "--logging_steps",
    "2",
    "--disable_tqdm",
]

# The parallel-layout tests (tensor, sequence, pipeline) compare 8 steps of a layout against one rank, with
# clipping that acts (the gradient norms are above it): conftest.py's layout_reference runs the one rank.
LAYOUT_STEPS, LAYOUT_CLIP = 8, 0.5


def layout_flags(run_dir: Path, config: str, *extra: str) -> list:
    return [
        "--config",
        f"ds_configs/{config}.json",
        "--output_dir",
        str(run_dir),
        "--max_steps",
        str(LAYOUT_STEPS),
        "--save_steps",
        "4",
        "--max_grad_norm",
        str(LAYOUT_CLIP),
        *FAST_FLAGS,
        "--logging_steps",
        "1",
        *extra,
    ]


def reference_output(reference: Path) -> tuple:
    """(stdout, stderr) of the layout_reference run."""
    return (reference.parent / "stdout.txt").read_text(), (reference.parent / "stderr.txt").read_text()


# --- Full disks.


@contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A real file system of `size` (tmpfs, e.g. "50m") mounted at `folder`, for full-disk tests. Without root it
    skips, saying so, unless SCALETRAIN_REQUIRE_ROOT=1 (CI runs as root and sets it): then a failure."""
    folder.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]).returncode
    ):
        why = "mounting a small file system (a full-disk test) needs root"
        if os.environ.get("SCALETRAIN_REQUIRE_ROOT") == "1":
            pytest.fail(f"{why}, and SCALETRAIN_REQUIRE_ROOT=1 says this machine has it")
        pytest.skip(why)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)])


@contextmanager
def memory_cgroup(name: str, limit_bytes: int) -> Iterator[Path]:
    """A real memory cgroup limited to `limit_bytes` (cgroup v1's memory controller, or v2 where the memory controller
    is there): its cgroup.procs, to write a pid into (its children stay in it). As for small_tmpfs, without root it
    skips, unless SCALETRAIN_REQUIRE_ROOT=1: then a failure. The group is removed afterwards."""
    candidates = [
        (Path("/sys/fs/cgroup/memory") / name, "memory.limit_in_bytes"),  # v1
        (Path("/sys/fs/cgroup") / name, "memory.max"),  # v2, unified at /sys/fs/cgroup
    ]
    group = None
    if os.geteuid() == 0:
        for folder, limit_file in candidates:
            try:
                folder.mkdir()
                (folder / limit_file).write_text(str(limit_bytes))
                group = folder
                break
            except OSError:
                if folder.is_dir():
                    folder.rmdir()
    if group is None:
        why = "a memory cgroup (a job's memory limit) needs root and a writable cgroup file system"
        if os.environ.get("SCALETRAIN_REQUIRE_ROOT") == "1":
            pytest.fail(f"{why}, and SCALETRAIN_REQUIRE_ROOT=1 says this machine has it")
        pytest.skip(why)
    try:
        yield group / "cgroup.procs"
    finally:
        for _ in range(50):  # the processes in it have exited; the kernel drops them from the group shortly after
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def fill_up(disk: Path) -> None:
    """Leave no byte free on `disk` (a small_tmpfs): the next write there fails with ENOSPC."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    assert shutil.disk_usage(disk).free == 0
