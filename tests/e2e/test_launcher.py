"""scaletrain.launcher, for real: a SIGTERM to the launcher (not the ranks) of a 2-rank gloo run saves and exits 85.

DeepSpeed's own `deepspeed` command dies at once on a SIGTERM and leaves the ranks running, never told (exit 143),
and its launch.py, when it is the one signalled, stops the ranks and exits 1 even when they saved: the train.py
tests fail with `deepspeed` in LAUNCHER's place. The other tests run DeepSpeed's real launcher over a stand-in rank
(tests/helpers/toy_rank.py: the pipeline's preemption flag and record, no model).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import GIVEN_PEAK, REPO, check_ok, free_port, logged_steps, read_metrics, child_env

pytestmark = pytest.mark.slow  # the stand-in rank tests too: DeepSpeed's launcher alone takes 15-20 s here
LAUNCHER = [sys.executable, "-m", "scaletrain.launcher"]  # the documented command: `deepspeed`'s arguments
STEPS = 64
TOY_RANK = REPO / "tests" / "helpers" / "toy_rank.py"


def flags(run_dir: Path) -> list:
    # No periodic save: the only checkpoint a run stopped early can have is its preemption save.
    return [
        "--config",
        "ds_configs/zero2.json",
        "--output_dir",
        str(run_dir),
        "--max_steps",
        str(STEPS),
        "--save_steps",
        "0",
        "--logging_steps",
        "1",
        "--block_size",
        "64",
        "--per_device_train_batch_size",
        "2",
        "--max_eval_samples",
        "8",
        "--disable_tqdm",
        *GIVEN_PEAK,
    ]


def start(run_dir: Path, cache: Path) -> subprocess.Popen:
    cmd = [*LAUNCHER, "--num_gpus", "2", "--master_port", str(free_port()), "train.py", *flags(run_dir)]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=child_env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int, timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout
    while len(logged_steps(run_dir)) < steps:
        assert proc.poll() is None, f"run ended early:\n{proc.stdout.read()[-4000:]}"
        assert time.monotonic() < deadline, "training did not get under way"
        time.sleep(0.05)
    return max(logged_steps(run_dir))


def committed_step(run_dir: Path) -> int:
    ckpts = run_dir / "checkpoints"
    tag = (ckpts / "latest").read_text().strip()
    return json.loads((ckpts / tag / "commit.json").read_text())["step"]


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """The run's output once it ended; any process left behind fails the test (and is killed)."""
    tree = psutil.Process(proc.pid).children(recursive=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        _, alive = psutil.wait_procs(tree, timeout=30)
        for p in alive:
            p.kill()
        proc.kill()
    assert not alive, f"left running after the launcher ended: {[p.pid for p in alive]}"
    return output


def check_saved_and_resumes(proc: subprocess.Popen, output: str, run_dir: Path, signalled_at: int, cache: Path):
    assert proc.returncode == 85, f"exit {proc.returncode}\n{output[-5000:]}"
    saved = committed_step(run_dir)
    assert signalled_at <= saved < STEPS, (signalled_at, saved)
    assert saved == max(logged_steps(run_dir)), "the checkpoint is not at the step the run reached"
    assert f"checkpoint committed at step {saved}" in output

    restarted = subprocess.run(
        [*LAUNCHER, "--num_gpus", "2", "--master_port", str(free_port()), "train.py", *flags(run_dir)],
        cwd=REPO,
        env=child_env(cache),
        capture_output=True,
        text=True,
        timeout=900,
    )
    check_ok(restarted)
    assert f"resumed from {run_dir / 'checkpoints' / f'step{saved}'} (step {saved}," in restarted.stdout
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, STEPS + 1)), steps  # every step once: the restart went on from the saved one


def test_sigterm_to_the_launcher_saves_and_exits_85_and_the_restart_resumes(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    proc = start(run_dir, cache_dir)
    signalled_at = wait_for_steps(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)  # the launcher only, as a scheduler that signals the job's main process
    sent = time.monotonic()
    output = finish(proc)
    assert proc.returncode == 85, f"exit {proc.returncode}\n{output[-5000:]}"
    assert time.monotonic() - sent < 120, "the save took far longer than a few steps"
    assert "launcher: SIGTERM: asking the ranks to save" in output
    check_saved_and_resumes(proc, output, run_dir, signalled_at, cache_dir)


def test_sigterm_to_every_process_of_the_launch_still_saves_and_exits_85(tmp_path, cache_dir):
    """Slurm's time limit and `scancel` signal every process of a job step: the launcher, DeepSpeed's runner (which
    dies of it), its launch.py (which stops the ranks and exits 1) and the ranks (which save)."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, cache_dir)
    signalled_at = wait_for_steps(proc, run_dir, 2)
    everyone = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(everyone) >= 4  # the launcher(s) (ours, DeepSpeed's runner, its launch.py) and two ranks
    for p in everyone:
        p.send_signal(signal.SIGTERM)
    output = finish(proc)
    check_saved_and_resumes(proc, output, run_dir, signalled_at, cache_dir)


def start_toy(cache: Path, **env: str) -> subprocess.Popen:
    cmd = [*LAUNCHER, "--num_gpus", "2", "--master_port", str(free_port()), str(TOY_RANK)]
    agree_dir = cache / "agree"
    agree_dir.mkdir()
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**child_env(cache), "TOY_AGREE_DIR": str(agree_dir), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def toy_ranks(proc: subprocess.Popen, timeout: float = 120) -> list:
    deadline = time.monotonic() + timeout
    while True:
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if str(TOY_RANK) in p.cmdline()]
        if len(ranks) == 2:
            return ranks
        assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)


@pytest.mark.parametrize("code", [0, 3])
def test_without_a_signal_the_ranks_exit_code_is_the_launchers(code, tmp_path):
    """A finished run (0) and a failed one (3, a non-finite stop) are not turned into a requeue, or into 1."""
    proc = start_toy(tmp_path, TOY_EXIT=str(code))
    output = finish(proc, timeout=120)
    assert proc.returncode == code, output[-3000:]


def test_a_signal_before_the_ranks_handler_is_installed_is_relayed_again(tmp_path):
    """A SIGTERM while the ranks still start up (their SIGUSR1 ignored until the flag is installed) neither kills
    them nor is lost: the relay repeats until they take it, save and exit 85."""
    proc = start_toy(tmp_path, TOY_STARTUP_S="3")
    toy_ranks(proc)
    proc.send_signal(signal.SIGTERM)
    output = finish(proc, timeout=120)
    assert proc.returncode == 85, output[-3000:]
    assert "rank 0 got SIGUSR1" in output and "rank 1 got SIGUSR1" in output, output[-3000:]


def test_ctrl_c_to_the_launcher_still_stops_the_run(tmp_path):
    """DeepSpeed's launcher runs in a session of its own: SIGINT is passed on, as a terminal would have sent it."""
    proc = start_toy(tmp_path, TOY_READY_DIR=str(tmp_path))
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{rank}").exists() for rank in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    output = finish(proc, timeout=120)
    assert proc.returncode not in (0, 85), output[-3000:]
    assert "KeyboardInterrupt" in output, output[-3000:]
