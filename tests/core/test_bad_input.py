"""Bad input ends in one clear line (and at most one hint), exit code 2, no traceback, nothing written.

The table of cases is split by theme: tests/core/test_bad_input_config.py (the DeepSpeed JSON and the training
flags) and tests/core/test_bad_input_model_data.py (model, data, output, evaluation), each running train.py's real
`main` in-process. Here: the check that the whole table covers enough flags and tells its cases apart, real
processes (one under a 2-rank launch), secrets kept out of a run's output, and a DeepSpeed internal that moved.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.core.test_bad_input_config import CASES as CONFIG_CASES
from tests.core.test_bad_input_model_data import CASES as MODEL_DATA_CASES
from tests.harness import REPO, launch
from tests.helpers.bad_input import ZERO2, assert_refused, names, text_file
from tests.helpers.bad_input import tree_digest  # noqa: F401 (other wings' tests import it from here)

CASES = {**CONFIG_CASES, **MODEL_DATA_CASES}  # the whole table


def test_table_covers_25_flags_and_keys_and_tells_every_case_apart():
    """The table exercises at least 25 different flags and DeepSpeed keys, each case's error names its own, and no
    case's expected text also fits another case's error (each case proves its own check, not a shared message)."""
    culprits = {culprit for _, culprit, _ in CASES.values()}
    assert len(culprits) >= 25, sorted(culprits)
    for culprit in culprits:  # a flag as typed, or a (dotted) key of the DeepSpeed JSON
        assert re.fullmatch(r"--[a-z0-9_]+|[a-z0-9_]+(\.[a-z0-9_]+)*", culprit), culprit
    for name, (_, _, expected) in CASES.items():
        fits = [other for other, (_, _, text) in CASES.items() if other != name and expected in text]
        assert not fits, f"{name}: {expected!r} also fits the error of {fits}"
    assert names("--config", "--config x.json: no such file") and not names("--config", "--config_name x: ...")
    assert not names("zero_optimization.offload_optimizer", 'zero_optimization.offload_optimizer.device "gpu"')


@pytest.mark.slow  # over 5 s: real processes (the fast tier stays under 3 minutes)
def test_real_process_exits_2_without_traceback(tmp_path, cache_dir):
    proc = launch(
        REPO / "train.py",
        [
            "--config",
            str(ZERO2),
            "--output_dir",
            str(tmp_path / "out"),
            "--train_file",
            str(text_file(tmp_path, "c.csv", "body\nhello\n")),
        ],
        "python",
        cache_dir,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[0] == "train.py: error: --text_column text: not a column of " + str(
        tmp_path / "c.csv"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a real process (~10 s)
def test_a_column_the_built_in_sample_lacks_exits_2_when_its_store_is_prepared(tmp_path, cache_dir):
    """The built-in sample is not read ahead in the pre-flight (that would import datasets at every start): a
    --text_column it lacks is refused by the store's preparation, in the same one line, before anything is built."""
    out = tmp_path / "out"
    args = ["--config", str(ZERO2), "--output_dir", str(out), "--text_column", "body"]
    proc = launch(REPO / "train.py", args, "python", cache_dir, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    sample = REPO / "data" / "sample" / "train.jsonl"
    assert proc.stderr.strip().splitlines()[0] == f"train.py: error: --text_column body: not a column of {sample}"
    assert not out.exists()


@pytest.mark.slow  # the ranks join the rendezvous to share the error (DeepSpeed's CPU ops, gloo): ~40 s loaded
def test_error_is_printed_once_under_a_two_rank_launch(tmp_path, cache_dir):
    out = tmp_path / "out"
    proc = launch(
        REPO / "train.py",
        ["--config", "ds_configs/missing.json", "--output_dir", str(out)],
        "deepspeed",
        cache_dir,
        nprocs=2,
        timeout=300,
    )
    assert proc.returncode == 2
    text = proc.stdout + proc.stderr
    assert text.count("train.py: error: --config ds_configs/missing.json: no such file") == 1
    assert "Traceback" not in text
    assert not out.exists()


@pytest.mark.slow  # over 10 s: a real run (the fast tier stays under 3 minutes)
def test_secrets_never_reach_logs_configs_or_metrics(tmp_path, cache_dir):
    """A run with credentials in its environment: none of them appears in its output or its run folder."""
    secrets = {"WANDB_API_KEY": "wandb-secret-3f9a1c", "HF_TOKEN": "hf_secret_77d2e0"}  # in the runs' environment
    run_dir = tmp_path / "run"
    from tests.harness import FAST_FLAGS

    proc = launch(
        REPO / "train.py",
        [
            "--config",
            str(ZERO2),
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "2",
            "--report_to",
            "wandb",
            "--print_config",
        ],
        "python",
        cache_dir,
        env=secrets,
    )
    assert proc.returncode == 0
    proc2 = launch(
        REPO / "train.py",
        ["--config", str(ZERO2), "--output_dir", str(run_dir), "--max_steps", "2", "--report_to", "wandb", *FAST_FLAGS],
        "python",
        cache_dir,
        env=secrets,
    )
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    for output in (proc.stdout, proc.stderr, proc2.stdout, proc2.stderr):
        assert not any(s in output for s in secrets.values())
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets.values()), path
    assert os.environ.get("WANDB_API_KEY") != secrets["WANDB_API_KEY"]


@pytest.mark.parametrize(
    "owner, name",
    [
        ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "_overflow_check_and_loss_scale_update"),
        ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),  # read by the DeepSpeed JSON's key check
    ],
)
def test_a_moved_deepspeed_hook_is_one_line_exit_2_before_anything_is_built(owner, name, tmp_path, offline, capsys):
    """An upgrade of DeepSpeed that moved an internal the pipeline hooks (here removed from the real module) is
    found by the pre-flight, as a usage-style error naming the internal, before any model is built."""
    import importlib

    module, _, cls = owner.partition(".DeepSpeed")
    target = getattr(importlib.import_module(module), "DeepSpeed" + cls) if cls else importlib.import_module(owner)
    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(target, name)
        assert_refused(
            name,
            ["--config", str(ZERO2), "--output_dir", str(tmp_path / "out")],
            tmp_path / "out",
            capsys,
            f"{owner}.{name}",
            "is missing, which scaletrain needs for",
            "pip install -r requirements.txt installs the DeepSpeed these hooks were checked against",
        )
