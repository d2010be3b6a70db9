"""--print_config: every value resolved, with its source, printed; nothing built or written."""

import json

import pytest

from scaletrain.config.slices import DEFAULT_MODEL_DIR, DEFAULT_TRAIN_FILE, DEFAULT_VALIDATION_FILE
from tests.harness import REPO


def test_print_config_explains_every_value_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from train import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    code = main(
        [
            "--config",
            "ds_configs/zero3_offload.json",
            "--output_dir",
            str(out),
            "--print_config",
            "--per_device_train_batch_size",
            "3",
            "--gradient_accumulation_steps",
            "2",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert not out.exists()
    assert "per_device_train_batch_size = 3  <- --per_device_train_batch_size" in printed
    assert "learning_rate = 0.001  <- default" in printed
    assert "train_batch_size = 6  <- micro batch 3 x accumulation 2 x data-parallel size 1" in printed
    # the bucket rule, capped by the tiny model's parameter count
    assert (
        "zero_optimization.reduce_bucket_size = 1787008  <- 1000 us x 1.2 GB/s x 9 (cpu link, latency <= 10%) "
        "/ 4 bytes = 2700000, capped at the model (1787008)"
    ) in printed
    assert "precision fp32 (auto: no fast bf16" in printed
    # the values no concern decided, each as the JSON file has it
    assert "as written in ds_configs/zero3_offload.json:\n" in printed
    assert '  zero_optimization.offload_param.device = "cpu"\n' in printed
    resolved = json.loads(printed[printed.index("{") : printed.index("where the decided values came from")])
    assert resolved["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "auto" not in json.dumps(resolved)


@pytest.mark.parametrize(
    "flags, model, data",
    [
        ([], f"model = {DEFAULT_MODEL_DIR}  <- the built-in tiny Llama's config, random init: default", None),
        (
            ["--config_name", str(REPO / "data" / "tiny-llama"), "--train_file", str(DEFAULT_VALIDATION_FILE)],
            f"model = {REPO / 'data' / 'tiny-llama'}  <- its config, random init, --config_name",
            f"train data = {DEFAULT_VALIDATION_FILE}  <- --train_file",
        ),
    ],
)
def test_print_config_shows_what_the_run_reads_and_where_each_came_from(
    tmp_path, monkeypatch, capsys, flags, model, data
):
    """The built-in defaults are shown as what they resolve to (a model folder, the sample's files), not as None."""
    from train import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--output_dir", str(tmp_path / "out"), "--print_config", *flags]) == 0
    printed = capsys.readouterr().out
    inputs = printed[printed.index("  [inputs]") : printed.index("  [run]")]
    assert model in inputs
    assert f"tokenizer = {DEFAULT_MODEL_DIR}  <- the model's: default" in inputs
    assert (data or f"train data = {DEFAULT_TRAIN_FILE}  <- the built-in sample: default") in inputs
    if not flags:
        assert f"validation data = {DEFAULT_VALIDATION_FILE}  <- the built-in sample: default" in inputs


def test_help_starts_with_a_description_and_the_commands_most_runs_start_from(capsys):
    from scaletrain.config.cli import build_parser

    text = build_parser().format_help()
    assert text.index("The commands most runs start from") < text.index("--output_dir")
    for command in ("deepspeed train.py --config ds_configs/zero3.json\n", "--num_gpus 8", "sbatch", "--plan"):
        assert command in text[: text.index("The flags, by concern")], command
