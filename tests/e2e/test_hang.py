"""A hang ended end to end (scaletrain/train/hang.py's watch in the ranks, scaletrain.launcher around them):
the launcher's part, a host whose ranks are all frozen, and a real 2-rank DeepSpeed run with one rank frozen by
SIGSTOP, which ends named, with stacks and no process left, then resumes. The judgement of the heartbeats and the
watch's own end are in tests/train/test_hang.py; the Slurm requeue-once is in test_multinode.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import FAST_FLAGS, REPO, check_ok, child_env, deepspeed_cmd, freeze, launch, logged_steps

from scaletrain.errors import HANG_EXIT_CODE
from scaletrain.train.hang import HEARTBEAT_DIR, REPORT_FILE


# --- scaletrain.launcher: a host whose ranks are all frozen --------------------------------------------------------


def test_the_launcher_kills_what_is_left_of_its_ranks_once_a_report_is_there_and_exits_86(tmp_path):
    from scaletrain import launcher

    # A stand-in for DeepSpeed's launch.py (its command line names the module, as rank_processes looks for) with one
    # "rank" child, in a session of its own as the runner's.
    tree = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; subprocess.Popen(['sleep', '300']).wait()",
            launcher.DEEPSPEED_LAUNCH_MODULE,
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not launcher.rank_processes(tree.pid):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        (rank,) = launcher.rank_processes(tree.pid)
        note = tmp_path / "hang-folders"
        attempt = tmp_path / "run" / "hang" / "attempt"
        attempt.mkdir(parents=True)
        note.write_text(f"{attempt}\n")
        hang = launcher.HangEnd(note, kill_after_s=3600.0)
        assert not hang.reported(now_or_never=True)
        hang.kill_if_due(tree.pid)
        assert rank.is_running()  # no report: nothing is killed
        (attempt / REPORT_FILE).write_text("rank 1 stopped\n")
        assert hang.reported(now_or_never=True)
        hang.kill_if_due(tree.pid)
        assert rank.is_running()  # reported, but the delay has not passed
        hang.kill_after_s = 0.0
        hang.kill_if_due(tree.pid)
        assert hang.reported_at is not None
        rank.wait(timeout=10)  # gone (it ignored nothing: SIGKILL); psutil.TimeoutExpired otherwise
        tree.wait(timeout=10)
        assert launcher.exit_code(1, tmp_path / "no-preemption-record", hang) == HANG_EXIT_CODE
        assert launcher.exit_code(0, tmp_path / "no-preemption-record", hang) == 0  # a run that finished anyway
    finally:
        if tree.poll() is None:
            os.killpg(tree.pid, signal.SIGKILL)


@pytest.mark.parametrize("value", ["abc", "-1", "inf", "nan"])
def test_a_bad_hang_kill_delay_is_refused_before_anything_starts(value, monkeypatch, capsys):
    from scaletrain import launcher

    monkeypatch.setenv(launcher.HANG_KILL_AFTER_ENV, value)
    assert launcher.main(["--num_gpus", "1", "train.py"]) == 2  # DeepSpeed's runner would have started otherwise
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"scaletrain.launcher: error: SCALETRAIN_HANG_KILL_AFTER_S={value}: give the seconds")
    monkeypatch.setenv(launcher.HANG_KILL_AFTER_ENV, " 2.5 ")
    assert launcher.hang_kill_after_s(os.environ) == 2.5
    monkeypatch.delenv(launcher.HANG_KILL_AFTER_ENV)
    assert launcher.hang_kill_after_s(os.environ) == launcher.DEFAULT_HANG_KILL_AFTER_S


# --- a real run ---------------------------------------------------------------------------------------------------


def run_processes(run_dir: Path) -> list:
    """The processes still running whose command line names the run folder."""
    alive = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_dir) in part for part in proc.info["cmdline"] or []):
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


@pytest.mark.slow
def test_a_rank_frozen_with_sigstop_ends_the_job_named_with_stacks_and_no_process_left_then_it_resumes(
    tmp_path, cache_dir
):
    run_dir = tmp_path / "run"
    hang_timeout = 6
    flags = [
        "--config",
        "ds_configs/zero2.json",
        "--output_dir",
        str(run_dir),
        "--max_steps",
        "12",
        "--save_steps",
        "2",
        *FAST_FLAGS,
        "--logging_steps",
        "1",
        "--hang_timeout",
        str(hang_timeout),
        "--ddp_timeout",
        "120",
        "--no-export_hf_at_end",
    ]
    proc = subprocess.Popen(
        deepspeed_cmd(2, REPO / "train.py", flags),
        cwd=REPO,
        env=child_env(cache_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        # a checkpoint committed (an asynchronous save commits at a later step boundary) and training past it
        while not ((run_dir / "checkpoints" / "latest").exists() and [s for s in logged_steps(run_dir) if s >= 3]):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
            time.sleep(0.1)
        (attempt,) = (run_dir / "hang").iterdir()
        victim = json.loads((attempt / HEARTBEAT_DIR / "rank-00001.json").read_text())["pid"]
        freeze(victim)
        frozen_at = time.monotonic()
        output, _ = proc.communicate(timeout=hang_timeout + 120)
    finally:
        proc.kill()
    ended_after = time.monotonic() - frozen_at
    assert proc.returncode == HANG_EXIT_CODE, output[-4000:]
    assert ended_after < hang_timeout + 60, ended_after  # the bound
    assert "process group timeout 120s; hang watch: --hang_timeout 6s" in output  # the value torch holds
    line = re.search(r"train\.py: hang: (.*)", output).group(1)
    assert f"stopped: rank 1 ({socket.gethostname()}, pid {victim}) at step" in line, line
    assert "no heartbeat" in line and str(attempt / "stacks-rank-*.txt") in line
    stacks = (attempt / "stacks-rank-00000.txt").read_text()
    # rank 0 was waiting for rank 1 in a collective: a step's all_reduce (torch's, or the shared-memory kernel's), a
    # save's barrier, or the save's agreement (torch's all_reduce called by world.any_rank) when the freeze landed at a
    # save step (CI saw all three); which depends on where rank 1 stopped. DeepSpeed's comm.py or torch's c10d.
    collective = r'(comm|c10d)\.py", line \d+ in (all_reduce|barrier|all_gather\w*|reduce_scatter\w*|broadcast)\n'
    assert re.search(collective, stacks), stacks
    assert not (attempt / "stacks-rank-00001.txt").exists()  # a frozen rank writes nothing
    deadline = time.monotonic() + 10  # the launcher has reaped its children; nothing else may be left either
    while run_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not run_processes(run_dir)
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    ledger = json.loads((run_dir / "goodput.json").read_text())
    assert ledger["attempts"][-1]["exit_code"] == HANG_EXIT_CODE

    # The requeued job: resumes from the newest committed checkpoint; the hang's report stays for the user.
    check_ok(launch(REPO / "train.py", flags, "deepspeed", cache_dir, nprocs=2))
    assert (attempt / REPORT_FILE).exists()
    assert logged_steps(run_dir)[-1] == 12
    first, second = json.loads((run_dir / "goodput.json").read_text())["attempts"]
    assert second["exit_code"] == 0 and 2 <= second["first_step"] <= first["last_step"]  # resumed, not restarted
