"""Shared helpers: launch the real pipeline in subprocesses (deepspeed launcher, torchrun, plain python)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

import pytest

from scaletrain.distributed.world import free_port  # the tests' launches take it from here too

REPO = Path(__file__).resolve().parent.parent
# DeepSpeed's compiled ops are cached per virtual environment under test: two checkouts (a CI clone and a working
# copy) sharing ~/.cache/torch_extensions would rebuild each other's ops, under each other's running processes.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
VENV_BIN = Path(sys.executable).parent
PROBE = REPO / "tests" / "helpers" / "probe_run.py"


def subprocess_env(tmp_cache: Path) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",  # nothing may be downloaded at run time
            "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(tmp_cache / "datasets"),
            "SCALETRAIN_CACHE": str(tmp_cache / "scaletrain"),  # token stores the runs prepare
            "WANDB_MODE": "offline",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(REPO),
        }
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID"):
        env.pop(var, None)
    return env


def pytest_collection_modifyitems(config, items) -> None:
    """The fast tests first, then the slow ones (each group in file order): the fast ones then run while DeepSpeed's
    ops build (`pytest_collection_finish`), and a quick failure shows before the long multi-rank runs."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)


_ops_build: dict = {}  # the build of DeepSpeed's ops: its process and the file its output goes to


def _start_ops_build() -> None:
    import tempfile

    output = tempfile.TemporaryFile(mode="w+")
    _ops_build["output"] = output
    _ops_build["process"] = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "build_ops.py")],
        cwd=REPO,
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
    )


def pytest_collection_finish(session) -> None:
    """Start building DeepSpeed's CPU ops in the background when a slow test is selected: the build (g++, minutes on
    a fresh machine, one core) then overlaps the fast tests, which run first and need no compiled op."""
    if any(item.get_closest_marker("slow") is not None for item in session.items):
        _start_ops_build()


def pytest_sessionfinish(session, exitstatus) -> None:
    process = _ops_build.get("process")
    if process is not None and process.poll() is None:  # a session that ended before any slow test ran
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def compiled_ops() -> None:
    """DeepSpeed's CPU ops (shm all-reduce, cpu_adam), built once per session (minutes on a fresh machine) before
    the first test that needs them, so that no test's time limit pays the build: started in the background once
    the session's tests are collected (`pytest_collection_finish`), waited for here.

    Every slow test gets it (`_slow_tests_get_compiled_ops`): multi-rank and offload runs are all marked slow. The
    fast tier (`-m "not slow"`: unit tests and single-rank runs, which need no compiled op) never waits for it. A
    failed build is an error of every test that needs the ops (pytest keeps a session fixture's failure), never a
    skip.
    """
    if "process" not in _ops_build:
        _start_ops_build()
    returncode = _ops_build["process"].wait(timeout=1800)
    _ops_build["output"].seek(0)
    output = _ops_build["output"].read()
    if returncode != 0:
        pytest.fail(f"scripts/build_ops.py failed (exit {returncode}):\n{output[-6000:]}", pytrace=False)


@pytest.fixture(autouse=True)
def _slow_tests_get_compiled_ops(request) -> None:
    if request.node.get_closest_marker("slow") is not None:
        request.getfixturevalue("compiled_ops")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_cache")


# DeepSpeed's launch.py, run as `python -m deepspeed.launcher.launch` would, with two changes of timing only:
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
    """DeepSpeed's launcher for `nprocs` ranks on this host, as `deepspeed --num_gpus N script args` runs it: its
    runner (bin/deepspeed) does no more on one node than start `deepspeed.launcher.launch` with the world encoded
    (and the working directory on PYTHONPATH, which subprocess_env sets), so the tests start launch.py directly and
    save an interpreter and an import of DeepSpeed per run (~3 s on 2 cores). The tests of the documented commands
    (the README's, scaletrain.launcher's, the smoke script's) still go through the runner."""
    import base64

    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(nprocs))}).encode()).decode()
    return [
        sys.executable,
        "-u",
        "-c",
        LAUNCH_WITHOUT_FINAL_COLLECTION,
        f"--world_info={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--log_level=info",
        str(script),
        *args,
    ]


def launch(
    script: Path,
    args: list,
    launcher: str,
    cache: Path,
    nprocs: int = 1,
    cwd: Path = REPO,
    timeout: int = 900,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run `script` with `args` under 'deepspeed', 'torchrun' or 'python'; return the finished process."""
    if launcher == "deepspeed":
        cmd = deepspeed_cmd(nprocs, script, args)
    elif launcher == "torchrun":
        cmd = [
            str(VENV_BIN / "torchrun"),
            "--nproc_per_node",
            str(nprocs),
            "--master_port",
            str(free_port()),
            str(script),
            *args,
        ]
    else:
        assert nprocs == 1
        cmd = [sys.executable, str(script), *args]
    return subprocess.run(
        cmd, cwd=cwd, env={**subprocess_env(cache), **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )


def read_metrics(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def logged_steps(run_dir: Path) -> list:
    """The steps of the training records in a running job's metrics.jsonl: complete lines only (rank 0 may be in
    the middle of writing one)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]
    return [r["step"] for r in map(json.loads, complete) if "loss" in r]


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
# clipping that acts (the gradient norms are above it).
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


@pytest.fixture(scope="session")
def layout_reference(tmp_path_factory, cache_dir) -> Path:
    """One rank, ZeRO-2, the layout tests' global batch (4 blocks) and seed: the run every layout must equal. Its
    output is kept beside it (reference_output()), for the tests that check what a plain run says."""
    run_dir = tmp_path_factory.mktemp("layouts") / "reference"
    proc = launch(REPO / "train.py", layout_flags(run_dir, "zero2"), "python", cache_dir)
    check_ok(proc)
    (run_dir.parent / "stdout.txt").write_text(proc.stdout)
    (run_dir.parent / "stderr.txt").write_text(proc.stderr)
    assert max(r["grad_norm"] for r in read_metrics(run_dir) if "grad_norm" in r) > LAYOUT_CLIP  # clipping acts
    return run_dir


def reference_output(reference: Path) -> tuple:
    """(stdout, stderr) of the layout_reference run."""
    return (reference.parent / "stdout.txt").read_text(), (reference.parent / "stderr.txt").read_text()


@pytest.fixture(scope="session")
def layout_reference_zero3(tmp_path_factory, cache_dir) -> Path:
    """The same under ZeRO-3, which builds the model inside deepspeed.zero.Init: other initial weights than a plain
    build, so ZeRO-3 layouts compare against this one."""
    run_dir = tmp_path_factory.mktemp("layouts") / "reference_zero3"
    check_ok(launch(REPO / "train.py", layout_flags(run_dir, "zero3"), "python", cache_dir))
    return run_dir


@contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A real file system of `size` (tmpfs, e.g. "50m") mounted at `folder`, for full-disk tests; skips without root."""
    folder.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]).returncode
    ):
        pytest.skip("mounting a small file system needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)])


def fill_up(disk: Path) -> None:
    """Leave no byte free on `disk` (a small_tmpfs): the next write there fails with ENOSPC."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    assert shutil.disk_usage(disk).free == 0
