"""scaletrain.launcher, for real: a SIGTERM to the launcher (not the ranks) of a 2-rank gloo run saves and exits 85.

DeepSpeed's own `deepspeed` command dies at once on a SIGTERM and leaves the ranks running, never told (exit 143),
and its launch.py, when it is the one signalled, stops the ranks and exits 1 even when they saved: these tests fail
with `deepspeed` in LAUNCHER's place.
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

from tests.conftest import REPO, check_ok, free_port, logged_steps, read_metrics, subprocess_env

pytestmark = pytest.mark.slow
LAUNCHER = [sys.executable, "-m", "scaletrain.launcher"]  # the documented command: `deepspeed`'s arguments
STEPS = 64


def flags(run_dir: Path) -> list:
    # No periodic save: the only checkpoint a run stopped early can have is its preemption save.
    return ["--config", "ds_configs/zero2.json", "--output_dir", str(run_dir), "--max_steps", str(STEPS),
            "--save_steps", "0", "--logging_steps", "1", "--block_size", "64", "--per_device_train_batch_size", "2",
            "--max_eval_samples", "8", "--disable_tqdm"]


def start(run_dir: Path, cache: Path) -> subprocess.Popen:
    cmd = [*LAUNCHER, "--num_gpus", "2", "--master_port", str(free_port()), "train.py", *flags(run_dir)]
    return subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


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
        [*LAUNCHER, "--num_gpus", "2", "--master_port", str(free_port()), "train.py", *flags(run_dir)], cwd=REPO,
        env=subprocess_env(cache), capture_output=True, text=True, timeout=900)
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
