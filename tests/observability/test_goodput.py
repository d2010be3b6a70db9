"""The goodput ledger: every second of a run across its attempts, in categories that add up."""

from __future__ import annotations

import json

import pytest

from tests.harness import fill_up, small_tmpfs

from scaletrain.observability.goodput import CATEGORIES, GoodputLedger, read_ledger, render_table


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_killed_attempt_and_its_resume_add_up_and_its_steps_after_the_last_commit_are_lost_work(tmp_path):
    clock = Clock(100.0)
    first = GoodputLedger(tmp_path, True, started=90.0, clock=clock)  # 10 s of startup before the first step
    first.begin(0)
    first.step_started()
    for step in range(1, 5):  # 4 steps of 3 s, 0.5 s of data wait each
        clock.now += 3.0
        first.step(step, 3.0, data_wait=0.5, checkpoint=0.0)
    first.committed(4)  # step time so far: 4 x 2.5 s
    clock.now += 2.0
    first.step(5, 3.0 + 2.0, data_wait=0.5, checkpoint=2.0)  # the save held step 5 for 2 s
    clock.now += 3.0
    first.step(6, 3.0, data_wait=0.5, checkpoint=0.0)
    first.write()  # a logging record at step 6, then kill -9: no end
    killed_at = clock.now

    clock.now += 30.0  # the requeue's wait
    second = GoodputLedger(tmp_path, True, started=clock.now, clock=clock)
    clock.now += 5.0
    second.begin(4)  # resumed from the checkpoint of step 4
    second.step_started()
    for step in range(5, 9):
        clock.now += 3.0
        second.step(step, 3.0, data_wait=0.5, checkpoint=0.0)
    clock.now += 1.0  # final save and export
    ledger = second.end(0)

    assert ledger == read_ledger(tmp_path)
    seconds = ledger["seconds"]
    assert set(seconds) == set(CATEGORIES)
    assert sum(seconds.values()) == pytest.approx(ledger["wall_s"], abs=1e-2)
    assert ledger["wall_s"] == pytest.approx(clock.now - 90.0)
    assert seconds["startup"] == pytest.approx(10.0 + 5.0)
    assert seconds["lost_work"] == pytest.approx(2 * 2.5)  # steps 5 and 6 of the first attempt, computed again
    assert seconds["productive"] == pytest.approx(4 * 2.5 + 4 * 2.5)
    assert seconds["checkpoint"] == pytest.approx(2.0)
    assert seconds["data_wait"] == pytest.approx(10 * 0.5)
    assert seconds["between_attempts"] == pytest.approx(30.0)
    assert ledger["goodput"] == pytest.approx(20.0 / ledger["wall_s"], abs=1e-4)
    attempts = ledger["attempts"]
    assert [a["exit_code"] for a in attempts] == [None, 0]
    assert attempts[0]["end"] == killed_at and [attempts[1]["first_step"], attempts[1]["last_step"]] == [4, 8]
    assert "goodput" in render_table(ledger) and "lost_work" in render_table(ledger)


def test_only_rank_0_writes_and_an_attempt_resumed_from_an_older_checkpoint_loses_more(tmp_path):
    clock = Clock(0.0)
    other_rank = GoodputLedger(tmp_path, False, started=0.0, clock=clock)
    other_rank.begin(0)
    assert other_rank.write() is None and read_ledger(tmp_path) is None
    first = GoodputLedger(tmp_path, True, started=0.0, clock=clock)
    first.begin(0)
    for step in range(1, 7):
        clock.now += 1.0
        first.step(step, 1.0, 0.0, 0.0)
        if step % 2 == 0:
            first.committed(step)
    first.end(1)
    clock.now += 1.0
    second = GoodputLedger(tmp_path, True, started=clock.now, clock=clock)
    second.begin(2)  # the newest checkpoints were damaged: back to step 2
    ledger = second.end(0)
    assert ledger["seconds"]["lost_work"] == pytest.approx(4.0) and ledger["seconds"]["productive"] == 2.0
    assert json.loads((tmp_path / "goodput.json").read_text())["attempts"][0]["commits"] == [
        [2, 2.0],
        [4, 4.0],
        [6, 6.0],
    ]


def test_a_rollback_within_an_attempt_turns_the_steps_since_the_checkpoint_into_lost_work(tmp_path):
    clock = Clock(0.0)
    ledger = GoodputLedger(tmp_path, True, started=0.0, clock=clock)
    ledger.begin(0)
    for step in range(1, 4):
        clock.now += 1.0
        ledger.step(step, 1.0, 0.0, 0.0)
        if step == 2:
            ledger.committed(2)
    ledger.rolled_back(2)  # step 3's update was non-finite too often: back to step 2
    for step in range(3, 5):
        clock.now += 1.0
        ledger.step(step, 1.0, 0.0, 0.0)
    result = ledger.end(0)
    assert result["seconds"]["lost_work"] == pytest.approx(1.0) and result["seconds"]["productive"] == pytest.approx(
        4.0
    )
    assert sum(result["seconds"].values()) == pytest.approx(result["wall_s"], abs=1e-2)


def test_the_report_prints_the_table_and_each_attempt_and_draws_them(tmp_path, capsys):
    import subprocess
    import sys

    from tests.harness import REPO

    clock = Clock(0.0)
    for attempt, (first, last) in enumerate([(0, 3), (2, 5)]):
        ledger = GoodputLedger(tmp_path, True, started=clock.now, clock=clock)
        clock.now += 2.0
        ledger.begin(first)
        ledger.step_started()
        for step in range(first + 1, last + 1):
            clock.now += 1.0
            ledger.step(step, 1.0, 0.25, 0.0)
            if step == 2:
                ledger.committed(2)
        if attempt == 0:
            ledger.write()  # killed: no end
            clock.now += 10.0
        else:
            ledger.end(0)
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "goodput_report.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "over 2 attempt(s)" in proc.stdout and "lost_work" in proc.stdout
    assert "steps 0 -> 3, running or killed" in proc.stdout and "steps 2 -> 5, exit 0" in proc.stdout
    assert (tmp_path / "goodput.png").stat().st_size > 1000
    missing = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "goodput_report.py"), str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
    )
    assert (
        missing.returncode == 2 and missing.stderr.count("\n") == 1 and "goodput.json: no such file" in missing.stderr
    )


def test_a_full_disk_keeps_the_last_ledger_warns_once_and_the_run_goes_on(tmp_path, caplog):
    """goodput.json is rewritten at every logging record: a full disk must not end the run with a traceback (the
    next save stops it with a clear message) nor leave a half-written ledger."""
    clock = Clock(0.0)
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        ledger = GoodputLedger(disk, True, started=0.0, clock=clock)
        ledger.begin(0)
        clock.now += 1.0
        ledger.step(1, 1.0, 0.0, 0.0)
        written = json.loads(json.dumps(ledger.write()))  # a copy: the ledger goes on changing
        fill_up(disk)
        clock.now += 1.0
        with caplog.at_level("WARNING", logger="scaletrain.observability.goodput"):
            ledger.step(2, 1.0, 0.0, 0.0)
            ledger.write()
            ended = ledger.end(1)
        assert caplog.text.count("could not write") == 1 and "No space left" in caplog.text
        assert ended["attempts"][0]["exit_code"] == 1 and ended["seconds"]["productive"] == pytest.approx(2.0)
        assert read_ledger(disk) == written  # the file as last written, whole
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "goodput.json"]


def _finished_run(tmp_path, clock: Clock) -> dict:
    ledger = GoodputLedger(tmp_path, True, started=clock.now, clock=clock)
    clock.now += 4.0
    ledger.begin(0)
    ledger.step_started()
    for step in range(1, 11):
        clock.now += 1.0
        ledger.step(step, 1.0, 0.0, 0.0)
    clock.now += 2.0
    return ledger.end(0)


@pytest.mark.parametrize("pause", [23.0, 86_400.0])
def test_the_pause_after_a_clean_end_and_a_rerun_that_only_reexports_leave_goodput_as_it_was(tmp_path, pause):
    clock = Clock(0.0)
    finished = _finished_run(tmp_path, clock)
    clock.now += pause  # the user comes back later and runs the same command: the run is complete
    rerun = GoodputLedger(tmp_path, True, started=clock.now, clock=clock)
    clock.now += 6.0
    rerun.begin(10)  # resumed at its last step: nothing to train, the export is written again
    ledger = rerun.end(0)
    assert (ledger["goodput"], ledger["wall_s"], ledger["seconds"]) == (
        finished["goodput"],
        finished["wall_s"],
        finished["seconds"],
    )
    assert ledger["not_counted_s"] == pytest.approx(pause + 6.0) and len(ledger["attempts"]) == 2


def test_a_gap_after_a_crash_still_counts_and_a_finished_run_extended_later_counts_its_new_steps(tmp_path):
    clock = Clock(0.0)
    _finished_run(tmp_path, clock)
    clock.now += 100.0  # a pause after the clean end: not counted
    extended = GoodputLedger(tmp_path, True, started=clock.now, clock=clock)
    clock.now += 4.0
    extended.begin(10)  # --max_steps raised: it trains on
    extended.step_started()
    for step in range(11, 16):
        clock.now += 1.0
        extended.step(step, 1.0, 0.0, 0.0)
    extended.write()  # then killed -9: no end
    clock.now += 50.0  # the requeue's wait after a crash: counted
    resumed = GoodputLedger(tmp_path, True, started=clock.now, clock=clock)
    clock.now += 4.0
    resumed.begin(15)
    ledger = resumed.end(0)
    assert ledger["seconds"]["productive"] == pytest.approx(15.0)
    assert ledger["seconds"]["between_attempts"] == pytest.approx(50.0)
    assert ledger["not_counted_s"] == pytest.approx(100.0)
    assert sum(ledger["seconds"].values()) == pytest.approx(ledger["wall_s"], abs=1e-2)
    assert ledger["wall_s"] == pytest.approx(clock.now - 100.0)


def _attempt(tmp_path, clock: Clock, first: int, last: int, commit: int | None = None, exit_code=None) -> None:
    ledger = GoodputLedger(tmp_path, True, started=clock.now, clock=clock)
    clock.now += 2.0
    ledger.begin(first)
    ledger.step_started()
    for step in range(first + 1, last + 1):
        clock.now += 1.0
        ledger.step(step, 1.0, 0.0, 0.0)
        if step == commit:
            ledger.committed(step)
    if exit_code is None:
        ledger.write()  # killed: no end
    else:
        ledger.end(exit_code)
    clock.now += 10.0


def test_a_resume_from_an_older_checkpoint_makes_every_later_step_lost_work_and_no_category_is_negative(tmp_path):
    clock = Clock(0.0)
    _attempt(tmp_path, clock, 0, 10, commit=4)  # steps 1-10, committed at 4 and (say) at 8 on another attempt
    _attempt(tmp_path, clock, 10, 16, commit=12)  # resumed at 10 (a checkpoint not in this ledger), steps 11-16
    _attempt(tmp_path, clock, 4, 9, exit_code=0)  # resumed at 4: the checkpoints after it were damaged
    ledger = read_ledger(tmp_path)
    seconds = ledger["seconds"]
    assert seconds["productive"] == pytest.approx(4.0 + 5.0)  # steps 1-4 of the first, 5-9 of the last
    assert seconds["lost_work"] == pytest.approx(6.0 + 6.0)  # steps 5-10 of the first, every step of the second
    assert min(seconds.values()) >= 0.0, seconds
    assert sum(seconds.values()) == pytest.approx(ledger["wall_s"], abs=1e-2)


@pytest.mark.parametrize("damage", ["{truncated", '{"attempts": [{"start": 1.0}]}', "[]", "\xff\xfe not text"], ids=str)
def test_an_unreadable_ledger_starts_a_fresh_one_with_a_warning(tmp_path, caplog, damage):
    (tmp_path / "goodput.json").write_bytes(damage.encode("latin-1"))
    with caplog.at_level("WARNING", logger="scaletrain.observability.goodput"):
        ledger = GoodputLedger(tmp_path, True, started=0.0, clock=Clock(5.0))
    assert "this attempt starts a fresh ledger" in caplog.text
    ledger.begin(0)
    assert len(ledger.end(0)["attempts"]) == 1 and len(read_ledger(tmp_path)["attempts"]) == 1


def test_two_threads_writing_the_ledger_never_leave_a_torn_file(tmp_path):
    """The hang watch's thread ends the attempt while the loop writes its records: one writer at a time."""
    import threading

    ledger = GoodputLedger(tmp_path, True, started=0.0)
    ledger.begin(0)
    torn = []

    def write_many():
        for _ in range(200):
            ledger.write()

    def read_many():
        for _ in range(400):
            try:
                json.loads((tmp_path / "goodput.json").read_text())
            except FileNotFoundError:
                pass
            except ValueError as err:
                torn.append(err)

    threads = [threading.Thread(target=write_many) for _ in range(2)] + [threading.Thread(target=read_many)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not torn and not (tmp_path / ".goodput.json.tmp").exists()
