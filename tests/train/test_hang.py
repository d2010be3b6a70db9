"""Hangs end with a name (scaletrain/train/hang.py): the judgement of the heartbeats, and the watch's end in a process
of its own (the real watch thread, the test playing the other ranks). scaletrain.launcher's part and a real 2-rank
DeepSpeed run with one rank frozen by SIGSTOP are in tests/e2e/test_hang.py, the Slurm requeue-once in
tests/e2e/test_multinode.py; a slow rank that is not a hang is in tests/observability/test_straggler.py.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import REPO, fill_up, small_tmpfs

from scaletrain.errors import HANG_EXIT_CODE
from scaletrain.train.hang import (
    HEARTBEAT_DIR,
    REPORT_FILE,
    HangWatch,
    describe_hang,
    enable_flight_recorder,
    long_allowance,
    read_beats,
    suspects,
)

ALONE = REPO / "tests" / "helpers" / "hang_watch_alone.py"
NOW = 1_000_000.0


def beat(rank: int, step: int = 5, phase: str = "forward/backward", age: float = 0.0, finished: bool = False) -> dict:
    return {
        "rank": rank,
        "host": f"node{rank // 2}",
        "pid": 1000 + rank,
        "step": step,
        "phase": phase,
        "since": NOW - 30,
        "beat": NOW - age,
        "seq": 3,
        "finished": finished,
    }


# --- whom the heartbeats name --------------------------------------------------------------------------------------


def test_a_rank_whose_heartbeat_stopped_is_named_before_anything_else():
    beats = {0: beat(0), 1: beat(1, age=40), 2: beat(2, step=3), 3: beat(3)}
    named, why = suspects(beats, 4, NOW, timeout=30)
    assert named == [1] and "no heartbeat" in why


def test_a_finished_rank_is_not_a_hang_and_the_rank_behind_is_named():
    beats = {0: beat(0, age=100, finished=True), 1: beat(1, step=6), 2: beat(2, step=5), 3: beat(3, step=6)}
    assert suspects(beats, 4, NOW, timeout=30) == ([2], "behind the others' step 6")


def test_a_rank_in_another_phase_than_most_is_named_and_all_alike_are_all_named():
    beats = {r: beat(r, phase="step-boundary all-reduce") for r in range(4)}
    beats[3] = beat(3, phase="forward/backward")
    named, why = suspects(beats, 4, NOW, timeout=30)
    assert named == [3] and "step-boundary all-reduce" in why
    alike = {r: beat(r) for r in range(2)}
    assert suspects(alike, 2, NOW, timeout=30)[0] == [0, 1]


def test_a_rank_without_heartbeat_file_is_named_with_the_likely_cause():
    named, why = suspects({0: beat(0)}, 2, NOW, timeout=30)
    assert named == [1] and "--output_dir shared" in why


def test_a_damaged_or_stray_heartbeat_file_is_no_heartbeat_and_the_others_are_still_judged(tmp_path):
    folder = tmp_path / HEARTBEAT_DIR
    folder.mkdir()
    for rank in (0, 2):
        (folder / f"rank-{rank:05d}.json").write_text(json.dumps(beat(rank, age=40 if rank == 2 else 0)))
    damaged = {
        1: json.dumps(beat(1))[:25],  # torn (a disk error; the watch itself replaces its file whole)
        3: "[3]",  # valid JSON, not a heartbeat
        4: json.dumps({**beat(4), "beat": "yesterday"}),  # a field of the wrong type
        5: json.dumps({k: v for k, v in beat(5).items() if k != "finished"}),
    }
    for rank, text in damaged.items():
        (folder / f"rank-{rank:05d}.json").write_text(text)
    beats = read_beats(tmp_path)
    assert sorted(beats) == [0, 2]
    assert suspects(beats, 6, NOW, timeout=30) == ([2], "no heartbeat for 30s or more (frozen or gone)")


def test_the_report_gives_every_rank_where_it_was_and_since_when():
    beats = {0: beat(0), 1: beat(1, age=40)}
    line, text = describe_hang(beats, world_size=2, now=NOW, timeout=30, stuck_s=45)
    assert line.startswith("no progress for 45s; stopped: rank 1 (node0, pid 1001) at step 5, forward/backward")
    rows = text.splitlines()[2:]
    assert len(rows) == 2 and "last heartbeat 40s ago" in rows[1] and "last heartbeat 0s ago" in rows[0]


def test_long_phases_end_before_the_process_group_times_out():
    assert long_allowance(600, 1800) == 1740
    assert long_allowance(590, 600) == 590  # never shorter than --hang_timeout itself


def test_the_nccl_flight_recorder_is_turned_on_for_gpu_runs_only_and_the_users_settings_stay():
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}
    enable_flight_recorder("/runs/a", env, cuda=True)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"  # the user's
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/runs/a/hang/nccl_trace_rank_"
    cpu = {}
    enable_flight_recorder("/runs/a", cpu, cuda=False)
    assert cpu == {}


# --- the watch thread's end, in a process of its own ---------------------------------------------------------------


def write_beat(folder: Path, record: dict) -> None:
    (folder / HEARTBEAT_DIR).mkdir(parents=True, exist_ok=True)
    (folder / HEARTBEAT_DIR / f"rank-{record['rank']:05d}.json").write_text(json.dumps(record))


def alone(folder: Path, world: int, timeout: float, allowance: float, kind: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ALONE), str(folder), str(world), str(timeout), str(allowance), kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_full_disk_when_the_run_ends_costs_the_final_heartbeat_a_warning_not_a_traceback(tmp_path, caplog):
    """A run stopped by a full disk closes its hang watch on that disk: the final heartbeat cannot be written. That
    must not raise over the run's own error (CI saw a traceback after the clear message); the last beat stays."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        watch = HangWatch(disk, rank=0, world_size=1, timeout=60.0, long_allowance_s=600.0)
        watch.start()
        beats = disk / HEARTBEAT_DIR
        fill_up(disk)
        with caplog.at_level("WARNING", logger="scaletrain.train.hang"):
            watch.stop()
        assert "could not write the final heartbeat" in caplog.text and "No space left" in caplog.text
        assert [p.name for p in beats.iterdir()] == ["rank-00000.json"]  # no temporary file left behind
        assert json.loads((beats / "rank-00000.json").read_text())["finished"] is False


@pytest.mark.slow  # over 5 s: real processes (the fast tier stays under 3 minutes)
def test_a_frozen_peer_is_named_stacks_are_dumped_it_is_killed_and_the_rank_exits_86(tmp_path):
    folder = tmp_path / "hang" / "attempt"
    frozen = subprocess.Popen(["sleep", "300"])  # the peer: a process of this host whose heartbeat stops
    write_beat(folder, {**beat(1), "host": socket.gethostname(), "pid": frozen.pid, "beat": time.time()})
    watch = alone(folder, 2, timeout=1.0, allowance=100.0, kind="long")  # a long phase: the frozen peer ends it
    try:
        out, err = watch.communicate(timeout=60)
        assert watch.returncode == HANG_EXIT_CODE, err
        assert frozen.wait(timeout=30) == -signal.SIGKILL  # a frozen rank ignores SIGTERM: SIGKILL, after the exit
    finally:
        frozen.kill()
    line = [x for x in err.splitlines() if x.startswith("train.py: hang:")]
    assert len(line) == 1, err
    assert f"stopped: rank 1 ({socket.gethostname()}, pid {frozen.pid}) at step 5" in line[0]
    assert "no heartbeat for 1s or more" in line[0] and f"exit {HANG_EXIT_CODE}" in line[0]
    assert "on_hang ran" in out
    stacks = (folder / "stacks-rank-00000.txt").read_text()
    assert stacks.startswith("rank 0 ") and "step 7, a phase of the test" in stacks
    assert "hang_watch_alone.py" in stacks and "in main" in stacks  # the main thread, where it was stuck
    report = (folder / REPORT_FILE).read_text()
    assert "rank 0 (" in report and f"pid {frozen.pid}" in report


@pytest.mark.parametrize("kind", ["short", pytest.param("long", marks=pytest.mark.slow)])  # long: ~7 s
def test_a_phase_known_to_be_long_gets_its_allowance_and_a_step_does_not(tmp_path, kind):
    folder = tmp_path / "attempt"
    watch = alone(folder, 1, timeout=1.0, allowance=4.0, kind=kind)
    _, err = watch.communicate(timeout=60)
    assert watch.returncode == HANG_EXIT_CODE, err
    stuck = float(re.search(r"no progress for (\d+)s", err).group(1))
    assert (stuck >= 4.0) if kind == "long" else (1.0 <= stuck < 4.0), err
    assert "every rank alive and waiting at the same place" in err


def test_another_ranks_report_makes_this_rank_dump_its_stacks_and_exit_without_a_second_message(tmp_path):
    folder = tmp_path / "attempt"
    write_beat(folder, {**beat(1), "beat": time.time() + 600})  # a peer alive throughout
    watch = alone(folder, 2, timeout=20.0, allowance=100.0, kind="short")
    assert watch.stdout.readline().strip() == "watching"
    (folder / "stacks-rank-00001.txt").write_text("rank 1's stacks\n")  # rank 1 declared, and dumped its own
    (folder / REPORT_FILE).write_text("declared by rank 1\n")
    _, err = watch.communicate(timeout=60)
    assert watch.returncode == HANG_EXIT_CODE
    assert "train.py: hang:" not in err  # the declaring rank says it, once
    assert "hang_watch_alone.py" in (folder / "stacks-rank-00000.txt").read_text()
