"""A torn last line in metrics.jsonl (a SIGKILL or a full disk in the middle of a write) is dropped with a warning on
resume; a file damaged before its end is set aside as it was, and the run goes on with its readable records (a side
file never stops a run); the readers (plots, reports) leave the damaged lines out and name them."""

from __future__ import annotations

import json

import pytest

from scaletrain.observability.metrics import MetricsLogger, RunIdentity, _keep_records_up_to, read_records
from tests.harness import FAST_FLAGS, REPO, check_ok, fill_up, launch, read_metrics, small_tmpfs

RECORDS = [{"step": s, "loss": 5.0 - s / 10} for s in (2, 4, 6)]


def write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_a_torn_last_line_is_dropped_and_the_rest_kept(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    write(path, RECORDS, tail='{"step": 8, "loss": 4.')  # cut mid-write: no closing brace, no newline
    assert read_records(path) == (RECORDS, True)
    _keep_records_up_to(path, 4)
    assert "its last line was cut short" in caplog.text
    assert [json.loads(line) for line in path.read_text().splitlines()] == RECORDS[:2]
    assert read_records(path) == (RECORDS[:2], False)


@pytest.mark.parametrize("bad", ['{"step": 4, "lo', "not json", '["a list"]', '{"loss": 1.0}'])
def test_a_reader_leaves_out_a_line_damaged_before_the_end_and_names_it(tmp_path, bad, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([json.dumps(RECORDS[0]), bad, json.dumps(RECORDS[2])]) + "\n")
    with caplog.at_level("WARNING", logger="scaletrain.observability.metrics"):
        assert read_records(path) == ([RECORDS[0], RECORDS[2]], False)
    assert "metrics.jsonl: left out line(s) 2, which are not metrics records" in caplog.text


def test_a_resume_sets_a_damaged_file_aside_and_keeps_its_readable_records(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    original = "\n".join([json.dumps(RECORDS[0]), "not json", json.dumps(RECORDS[1]), '["a list"]']) + "\n"
    path.write_text(original + json.dumps(RECORDS[2]) + "\n" + '{"step": 8, "lo')
    with caplog.at_level("WARNING", logger="scaletrain.observability.metrics"):
        kept = _keep_records_up_to(path, 4)
    assert kept == RECORDS[:2] and read_records(path) == (RECORDS[:2], False)
    (aside,) = tmp_path.glob("metrics.jsonl.damaged-*")
    assert aside.read_text().startswith(original)  # the file as it was, torn line included
    assert "2 line(s) before its end are not metrics records (line 2, 4)" in caplog.text
    assert f"kept in {aside.name}" in caplog.text and "its last line was cut short" in caplog.text


def test_a_full_disk_ends_the_file_for_the_attempt_said_once_and_logging_goes_on(tmp_path, caplog):
    """A record that cannot be written must not end the run with a traceback (the next save stops it clearly), and
    no record may follow a torn one (the resume would set the file aside as damaged before its end)."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        metrics = MetricsLogger(str(disk), True, (), RunIdentity("full-disk", {}))
        metrics.log(RECORDS[0])
        fill_up(disk)
        with caplog.at_level("WARNING", logger="scaletrain.observability.metrics"):
            later = [{**record, "note": "x" * 4096} for record in RECORDS[1:]]  # past the file's first page
            for record in later:
                metrics.log(record)
            metrics.log_generations(RECORDS[-1]["step"], [{"prompt": "a", "completion": "b"}])
            metrics.close(1)
        assert caplog.text.count("could not write the record of step 4") == 1 and "No space left" in caplog.text
        assert metrics.last_record == later[-1]  # the console and the other sinks still get every record
        assert read_records(disk / "metrics.jsonl")[0] == RECORDS[:1]


@pytest.mark.slow
def test_resume_after_a_torn_metrics_line_or_a_damaged_file_trains_on(tmp_path, cache_dir):
    out = tmp_path / "run"
    flags = [
        "--config",
        str(REPO / "ds_configs/zero2.json"),
        "--output_dir",
        str(out),
        *FAST_FLAGS,
        "--save_steps",
        "2",
    ]
    check_ok(launch(REPO / "train.py", [*flags, "--max_steps", "4"], "python", cache_dir))
    metrics = out / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 5, "loss": 3.')  # a kill in the middle of the next record
    resumed = launch(REPO / "train.py", [*flags, "--max_steps", "6"], "python", cache_dir)
    check_ok(resumed)
    assert "its last line was cut short" in resumed.stdout + resumed.stderr
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert steps == [2, 4, 6]  # every step once, the torn record gone

    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    before = metrics.read_text()
    again = launch(REPO / "train.py", [*flags, "--max_steps", "8"], "python", cache_dir)
    check_ok(again)
    output = again.stdout + again.stderr
    assert output.count("line(s) before its end are not metrics records (line 2)") == 1, output[-3000:]
    (aside,) = out.glob("metrics.jsonl.damaged-*")
    assert aside.read_text() == before and f"kept in {aside.name}" in output  # nothing lost
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [2, 4, 6, 8]


@pytest.mark.extended  # ~33 s
@pytest.mark.slow
def test_a_complete_run_started_again_logs_its_final_evaluation_once(tmp_path, cache_dir):
    """Started again, a complete run resumes at its last step and only re-exports: its final evaluation and
    generations, already in metrics.jsonl, are not run and logged a second time. The same flags with one step more
    do evaluate the new last step."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    out = tmp_path / "run"
    flags = [
        "--config",
        str(REPO / "ds_configs/zero2.json"),
        "--output_dir",
        str(out),
        *FAST_FLAGS,
        "--eval_steps",
        "2",
        "--eval_prompts",
        str(prompts),
        "--eval_max_new_tokens",
        "4",
    ]

    def steps_with(key: str) -> list:
        return [r["step"] for r in read_metrics(out) if key in r]

    for _ in range(2):
        check_ok(launch(REPO / "train.py", [*flags, "--max_steps", "4"], "python", cache_dir))
        assert steps_with("eval_loss") == [2, 4] and steps_with("generations") == [2, 4]
    check_ok(launch(REPO / "train.py", [*flags, "--max_steps", "5"], "python", cache_dir))
    assert steps_with("eval_loss") == [2, 4, 5] and steps_with("generations") == [2, 4, 5]
