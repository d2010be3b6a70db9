"""Unwritable checkpoints, for real: a disk that fills during a save on 2 gloo ranks (issue 14 item 5)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import freeze, logged_steps, small_tmpfs, thaw
from tests.test_checkpoint import flags, latest_step, rank_processes, start, wait_for

PAGE = 4096  # tmpfs allocates whole pages: what a file takes from the free space


def pages(size: int) -> int:
    return math.ceil(size / PAGE) * PAGE


def fill(disk: Path, leave: int) -> None:
    """Write a file that leaves `leave` bytes (rounded up to a page) free on `disk`."""
    excess = (shutil.disk_usage(disk).free - leave) // PAGE * PAGE
    assert excess > 0, (shutil.disk_usage(disk).free, leave)
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * excess)
        f.flush()
        os.fsync(f.fileno())


def full_disk_flags(run_dir: Path) -> list:
    return flags("zero2", run_dir, max_steps=12) + ["--save_steps", "4", "--no-export_hf_at_end"]


def ended_on_every_rank(proc, ckpts: Path, message: str) -> str:
    """The launcher and both ranks end promptly with exit code 1 and `message` once (not per rank); returns the
    output. Nothing of a new checkpoint is left: no temporary folder, no step beyond the intact ones."""
    output, _ = proc.communicate(timeout=300)  # a rank left in a barrier would hold the launcher past this
    assert proc.returncode == 1, output[-4000:]
    assert output.count(message) == 1, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert not any(p.name.startswith(".tmp-") for p in ckpts.iterdir()), sorted(p.name for p in ckpts.iterdir())
    return output


@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_stops_every_rank_and_keeps_the_previous_checkpoint(tmp_path, cache_dir):
    """The space check before the step-8 save passes (the disk holds as many bytes as step 4's files), but tmpfs
    gives whole pages, so the write runs out in the middle: torch's writer raises (a RuntimeError) on one rank or
    both, and the commit may fail on rank 0 alone. Every rank must stop with one message naming step 4."""
    from scaletrain.checkpoint import verify

    with small_tmpfs(tmp_path / "disk", "80m") as disk:
        run_dir = disk / "run"
        ckpts = run_dir / "checkpoints"
        proc = start(full_disk_flags(run_dir), cache_dir)
        ranks = rank_processes(proc)
        wait_for(lambda: (ckpts / "latest").exists() and latest_step(run_dir) == 4, proc)
        freeze(*(rank.pid for rank in ranks))  # between the two saves
        assert max(logged_steps(run_dir)) < 8 and not (ckpts / ".tmp-step8").exists()
        commit = json.loads((ckpts / "step4" / "commit.json").read_text())
        needed = sum(commit["files"].values())  # what the space check asks for
        taken = sum(pages(p.stat().st_size) for p in (ckpts / "step4").iterdir())  # what the write takes
        assert taken - needed >= 3 * PAGE, (taken, needed)  # room for the check to pass and the write to fail
        fill(disk, leave=needed + PAGE)  # a page for the metrics lines of the steps up to 8
        thaw(*(rank.pid for rank in ranks))
        message = "train.py: error: checkpoint step8: "
        output = ended_on_every_rank(proc, ckpts, message)
        line = next(line for line in output.splitlines() if line.startswith(message))
        assert "no space left on device" in line and "not enough disk space" not in line, line
        assert f"the previous committed checkpoint {ckpts / 'step4'} is intact" in line, line
        assert verify(ckpts / "step4") is None and (ckpts / "latest").read_text().strip() == "step4"
        assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step4"]


@pytest.mark.slow
def test_a_disk_filled_before_the_first_save_stops_every_rank_before_writing(tmp_path, cache_dir):
    """No checkpoint yet, so no measured size: the first save checks its planned size (parameters x 16 bytes in
    fp32 under ZeRO-2) and, with too little room, stops every rank before writing anything."""
    with small_tmpfs(tmp_path / "disk", "80m") as disk:
        run_dir = disk / "run"
        ckpts = run_dir / "checkpoints"
        proc = start(full_disk_flags(run_dir), cache_dir)
        ranks = rank_processes(proc)
        wait_for(lambda: len(logged_steps(run_dir)) >= 1, proc)
        freeze(*(rank.pid for rank in ranks))  # training has started, the first save (step 4) has not
        assert max(logged_steps(run_dir)) < 4 and not ckpts.exists()
        fill(disk, leave=10 * 2**20)  # 10 MB: less than the tiny Llama's 27 MB checkpoint
        thaw(*(rank.pid for rank in ranks))
        message = (f"train.py: error: checkpoint step4: not enough disk space in {ckpts} (0.01 GB free, the first "
                   "checkpoint needs about ")
        output = ended_on_every_rank(proc, ckpts, message)
        assert "nothing was written, no checkpoint of this run was committed yet" in output, output[-3000:]
        assert not any(ckpts.iterdir())
