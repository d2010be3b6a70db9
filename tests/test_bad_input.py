"""Bad input ends in one clear line (and at most one hint), exit code 2, no traceback, nothing written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.conftest import REPO, launch


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    if root.exists():
        for path in sorted(root.rglob("*")):
            h.update(str(path.relative_to(root)).encode())
            if path.is_file():
                h.update(path.read_bytes())
    return h.hexdigest()


def previous_run(out: Path) -> Path:
    out.mkdir()
    (out / "run_config.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    return out


def bad_json(tmp: Path) -> str:
    path = tmp / "broken.json"
    path.write_text('{"train_batch_size": "auto",')
    return str(path)


def scheduler_json(tmp: Path) -> str:
    raw = json.loads((REPO / "ds_configs/zero2.json").read_text())
    raw["scheduler"] = {"type": "WarmupLR", "params": {}}
    path = tmp / "with_scheduler.json"
    path.write_text(json.dumps(raw))
    return str(path)


def csv_without_text(tmp: Path) -> str:
    path = tmp / "numbers.csv"
    path.write_text("body,n\nhello world,1\nmore words,2\n")
    return str(path)


CASES = {
    # name: (extra flags, builder of extra flags needing tmp, text the error must contain)
    "missing config": (["--config", "ds_configs/zero9.json"], None, "--config ds_configs/zero9.json: no such file"),
    "invalid json": ([], lambda t: ["--config", bad_json(t)], "not valid JSON"),
    "unknown flag": (["--per_device_batch_size", "4"], None, "unknown flag --per_device_batch_size"),
    "missing model": (["--model_name_or_path", "./models/none"], None, "--model_name_or_path ./models/none"),
    "missing train file": (["--train_file", "data/none.jsonl"], None, "--train_file data/none.jsonl: no such file"),
    "block size too large": (["--block_size", "4096"], None, "--block_size 4096: above the model's maximum"),
    "scheduler section": ([], lambda t: ["--config", scheduler_json(t)], "\"scheduler\" section"),
    "missing text column": ([], lambda t: ["--train_file", csv_without_text(t)], "--text_column text: not a column"),
    "previous run": ([], None, "holds a previous run"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_touches_nothing(name, tmp_path, cache_dir):
    flags, make_flags, expected = CASES[name]
    out = previous_run(tmp_path / "out") if name == "previous run" else tmp_path / "out"
    before = tree_digest(out)
    args = ["--config", "ds_configs/zero2.json", "--output_dir", str(out), *flags]
    if make_flags:
        args += make_flags(tmp_path)
    proc = launch(REPO / "train.py", args, "python", cache_dir, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("train.py: error: "), proc.stderr
    assert expected in lines[0], lines
    assert tree_digest(out) == before


def test_error_is_printed_once_under_a_two_rank_launch(tmp_path, cache_dir):
    out = tmp_path / "out"
    proc = launch(REPO / "train.py", ["--config", "ds_configs/missing.json", "--output_dir", str(out)],
                  "deepspeed", cache_dir, nprocs=2, timeout=300)
    assert proc.returncode == 2
    text = proc.stdout + proc.stderr
    assert text.count("train.py: error: --config ds_configs/missing.json: no such file") == 1
    assert not out.exists()
