"""Damaged and unwritable checkpoints, for real: checksums recorded at save and verified on load (issue 14 item 3),
and a disk that fills during a save on 2 gloo ranks (item 5)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path

import pytest

from tests.harness import REPO, check_ok, freeze, launch, logged_steps, small_tmpfs, thaw
from tests.checkpoint.test_checkpoint import flags, latest_step, rank_processes, start, step_losses, wait_for

STEPS, SAVE_EVERY = 16, 8  # one rank saves at steps 8 and 16; the 2-rank resumes continue to step 16


def per_rank_flags(ranks: int, run_dir: Path) -> list:
    """The global batch of 4 blocks on 1 or 2 ranks (the resharded resumes of tests/checkpoint/test_checkpoint.py)."""
    args = flags("zero2", run_dir, STEPS)
    args[args.index("--per_device_train_batch_size") + 1] = str(4 // ranks)
    return args


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory, cache_dir) -> Path:
    """An uninterrupted 1-rank run, committed at steps 8 and 16: the checkpoints to damage, and the losses a
    resume from step 8 on 2 ranks must give again."""
    run_dir = tmp_path_factory.mktemp("one_rank") / "run"
    check_ok(launch(REPO / "train.py", per_rank_flags(1, run_dir), "python", cache_dir))
    assert sorted(step_losses(run_dir)) == list(range(1, STEPS + 1))
    return run_dir


def damage_largest_file(ckpt: Path) -> Path:
    """What the issue did: random bytes written into the middle of the largest file, its size unchanged (so the
    sizes in commit.json still match)."""
    largest = max((p for p in ckpt.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    size = largest.stat().st_size
    with open(largest, "r+b") as f:
        f.seek(size // 2)
        f.write(random.Random(14).randbytes(4096))
    assert largest.stat().st_size == size
    return largest


@pytest.mark.slow
def test_a_damaged_checkpoint_falls_back_to_the_previous_one_on_every_rank(one_rank_run, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    shutil.copytree(one_rank_run, run_dir)
    ckpts = run_dir / "checkpoints"
    damaged = damage_largest_file(ckpts / f"step{STEPS}")

    proc = launch(REPO / "train.py", per_rank_flags(2, run_dir), "deepspeed", cache_dir, nprocs=2)
    check_ok(proc)
    output = proc.stdout + proc.stderr
    warning = f"checkpoint {ckpts / f'step{STEPS}'} is damaged: {damaged.name} does not match its sha256"
    assert output.count(warning) == 1, output[-4000:]  # one warning, from rank 0, naming the file
    assert f"falling back to {ckpts / f'step{SAVE_EVERY}'}" in output
    assert f"resumed from {ckpts / f'step{SAVE_EVERY}'} (step {SAVE_EVERY}," in proc.stdout
    # Marked, so that a later auto resume never picks it again; the run then committed a new step 16.
    assert (ckpts / f"damaged-step{STEPS}" / damaged.name).is_file()
    from scaletrain.checkpoint.commit import verify

    assert verify(ckpts / f"step{STEPS}") is None
    losses, expected = step_losses(run_dir), step_losses(one_rank_run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(SAVE_EVERY + 1, STEPS + 1):  # 2 ranks after 1: equal to the resharded resumes' 1e-4
        assert losses[step] == pytest.approx(expected[step], rel=1e-4), step


@pytest.mark.slow
def test_a_damaged_checkpoint_with_nothing_before_it_stops_every_rank(one_rank_run, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    shutil.copytree(one_rank_run, run_dir)
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / f"step{SAVE_EVERY}")
    damaged = damage_largest_file(ckpts / f"step{STEPS}")
    metrics = (run_dir / "metrics.jsonl").read_bytes()

    proc = launch(REPO / "train.py", per_rank_flags(2, run_dir), "deepspeed", cache_dir, nprocs=2)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    message = (
        f"train.py: error: checkpoint {ckpts / f'step{STEPS}'} is damaged: {damaged.name} does not match "
        "its sha256 in commit.json, and no earlier committed checkpoint is left to fall back to"
    )
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]  # once, not per rank
    assert "Traceback" not in proc.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics  # nothing overwritten
    assert (ckpts / f"step{STEPS}").is_dir() and not (ckpts / ".universal").exists()  # kept, and never converted


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
    from scaletrain.checkpoint.commit import verify

    with small_tmpfs(tmp_path / "disk", "80m") as disk:
        run_dir = disk / "run"
        ckpts = run_dir / "checkpoints"
        # Synchronous saves: the write fails inside the save (an asynchronous one's writer: test_async_save.py)
        proc = start(full_disk_flags(run_dir) + ["--no-async_save"], cache_dir)
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
        message = (
            f"train.py: error: checkpoint step4: not enough disk space in {ckpts} (0.01 GB free, the first "
            "checkpoint needs about "
        )
        output = ended_on_every_rank(proc, ckpts, message)
        assert "nothing was written, no checkpoint of this run was committed yet" in output, output[-3000:]
        assert not any(ckpts.iterdir())


@pytest.mark.slow
def test_every_file_of_a_committed_checkpoint_is_on_disk_before_its_commit(tmp_path, cache_dir):
    """Each rank, and the background writer, fsync the files they wrote and their folder before reporting them
    written: recorded by tests/helpers/fsync_audit (every process's fsyncs, the spawned writer's too) over a 2-rank
    run with a background save (step 2) and the end's synchronous one (step 4)."""
    from scaletrain.checkpoint.commit import COMMIT, TMP_PREFIX

    audit, run_dir = tmp_path / "fsyncs", tmp_path / "run"
    audit.mkdir()
    env = {
        "SCALETRAIN_TEST_FSYNC_AUDIT": str(audit),
        "PYTHONPATH": str(REPO / "tests" / "helpers" / "fsync_audit"),  # child_env puts the repository first
    }
    args = [*flags("zero2", run_dir, 4), "--save_steps", "2", "--async_save"]
    check_ok(launch(REPO / "train.py", args, "deepspeed", cache_dir, nprocs=2, env=env))
    synced = {line for record in audit.glob("*.txt") for line in record.read_text().splitlines()}
    for step in (2, 4):
        committed = run_dir / "checkpoints" / f"step{step}"
        tmp = committed.parent / f"{TMP_PREFIX}step{step}"
        files = [rel for rel in json.loads((committed / COMMIT).read_text())["files"] if rel != COMMIT]
        assert files and str(tmp) in synced, sorted(synced)[:5]
        missing = [rel for rel in files if str(tmp / rel) not in synced]
        assert not missing, f"step{step}: written but never fsynced before the commit: {missing}"


@pytest.mark.slow
def test_a_slow_deletion_of_old_checkpoints_never_holds_the_loop_into_a_hang_report(tmp_path, cache_dir):
    """--save_total_limit's deletions (8 s each here, tests/helpers/slow_prune.py) run beside training, never under a
    step's short allowance of the hang watch (5 s): the run ends 0 with no hang report, the old checkpoints gone."""
    run_dir = tmp_path / "run"
    args = [
        *flags("zero2", run_dir, 6),
        *["--save_steps", "2", "--save_total_limit", "1", "--hang_timeout", "5", "--async_save"],
    ]
    proc = launch(
        REPO / "tests" / "helpers" / "slow_prune.py", args, "python", cache_dir, env={"SCALETRAIN_TEST_SLOW_PRUNE": "8"}
    )
    check_ok(proc)
    from scaletrain.train import HANG_DIR, REPORT_FILE

    assert not list((run_dir / HANG_DIR).rglob(REPORT_FILE)), "a hang was reported"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*")) == ["step6"]
    assert proc.stdout.count("deleted checkpoint") == 2  # step2 and step4, each once the next one was committed
