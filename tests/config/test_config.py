"""Flags: defaults, HF spellings, and one clear UsageError per bad value (no torch needed)."""

import json

import pytest

from scaletrain.config.slices import DEFAULT_MODEL_DIR, DEFAULT_TRAIN_FILE
from scaletrain.errors import UsageError
from scaletrain.config.cli import parse_run_config

ZERO3 = ["--config", "ds_configs/zero3.json"]


def test_defaults_point_at_the_builtin_model_and_sample_data(tmp_path):
    cfg = parse_run_config(ZERO3 + ["--output_dir", str(tmp_path / "run")])
    assert cfg.model.model_source == str(DEFAULT_MODEL_DIR)
    assert cfg.model.tokenizer_source == str(DEFAULT_MODEL_DIR)
    assert cfg.data.train_data_file == str(DEFAULT_TRAIN_FILE)
    assert cfg.data.uses_default_data
    assert not cfg.model.trust_remote_code


def test_deepspeed_alias_and_launcher_local_rank(tmp_path):
    cfg = parse_run_config(["--deepspeed", "ds_configs/zero2.json", "--local_rank=1", "--output_dir", str(tmp_path)])
    assert cfg.engine.config == "ds_configs/zero2.json"
    assert cfg.run.local_rank == 1
    assert cfg.source_of("config") == "command line" and "local_rank" not in cfg.explicit_flags


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["--learning_rat", "1e-3"], "--learning_rate"),  # did-you-mean
        (["--config", "ds_configs/nope.json"], "--config ds_configs/nope.json"),
        (["--model_name_or_path", "./missing-model"], "--model_name_or_path ./missing-model"),
        (["--config_name", "/no/such/config"], "--config_name /no/such/config"),
        (["--train_file", "missing.jsonl"], "--train_file missing.jsonl"),
        (["--train_file", "README.md"], "--train_file README.md"),
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
        (["--bf16", "--fp16"], "--bf16 and --fp16"),
        (["--warmup_ratio", "1.5"], "--warmup_ratio"),
        (["--lr_scheduler_type", "exotic"], "--lr_scheduler_type"),
        (["--max_steps", "0"], "--max_steps 0: give a positive number of steps"),
        (["--max_steps", "-5"], "--max_steps -5: give a positive number of steps"),
        (["--num_train_epochs", "0"], "--max_steps and --num_train_epochs"),
        (
            ["--model_name_or_path", "gpt2", "--config_name", "data/tiny-llama"],
            "--model_name_or_path and --config_name",
        ),
    ],
)
def test_bad_flags_name_the_culprit(argv, culprit, tmp_path):
    with pytest.raises(UsageError) as err:
        parse_run_config(ZERO3 + ["--output_dir", str(tmp_path / "run")] + argv)
    assert culprit in str(err.value)


def test_output_dir_with_a_previous_run_resumes_or_is_refused(tmp_path):
    (tmp_path / "run_config.json").write_text("{}")
    # the default --resume_from_checkpoint auto continues the same run in its folder
    assert parse_run_config(ZERO3 + ["--output_dir", str(tmp_path)]).checkpoint.resume_from_checkpoint == "auto"
    with pytest.raises(UsageError, match="--output_dir .* holds a previous run"):
        parse_run_config(ZERO3 + ["--output_dir", str(tmp_path), "--resume_from_checkpoint", "none"])
    assert parse_run_config(
        ZERO3 + ["--output_dir", str(tmp_path), "--resume_from_checkpoint", "none", "--overwrite_output_dir"]
    ).run.overwrite_output_dir
    (tmp_path / "run_config.json").write_text(json.dumps({"config_name": "elsewhere"}))
    with pytest.raises(UsageError, match="holds a different run"):
        parse_run_config(ZERO3 + ["--output_dir", str(tmp_path)])


def test_activation_checkpointing_is_an_alias_of_gradient_checkpointing(tmp_path):
    """transformers 5's name for it: --activation_checkpointing and its --no- form set --gradient_checkpointing."""
    out = ["--output_dir", str(tmp_path)]
    assert parse_run_config(ZERO3 + out + ["--activation_checkpointing"]).model.gradient_checkpointing
    cfg = parse_run_config(ZERO3 + out + ["--gradient_checkpointing", "--no-activation_checkpointing"])
    assert not cfg.model.gradient_checkpointing
    assert cfg.source_of("gradient_checkpointing") == "command line"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("activation_checkpointing: true\n")
    assert parse_run_config(ZERO3 + out + ["--recipe", str(recipe)]).model.gradient_checkpointing


@pytest.mark.parametrize(
    "name, ours", [("warmup_stable_decay", "wsd"), ("cosine_with_min_lr", "cosine"), ("constant", "constant")]
)
def test_hugging_face_schedule_names_that_are_ours_are_accepted(name, ours, tmp_path):
    out = ["--output_dir", str(tmp_path)]
    assert parse_run_config(ZERO3 + out + ["--lr_scheduler_type", name]).optim.lr_scheduler_type == ours
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"lr_scheduler_type: {name}\n")
    assert parse_run_config(ZERO3 + out + ["--recipe", str(recipe)]).optim.lr_scheduler_type == ours


@pytest.mark.parametrize(
    "argv, message, hint",
    [
        (["--lr_scheduler_type", "polynomial"], "a Hugging Face schedule that is not one of ours", "closest is linear"),
        (["--lr_scheduler_type", "cosine_with_restarts"], "not one of ours", "closest is cosine"),
        (["--lr_scheduler_type", "wsdd"], "not a schedule", "did you mean wsd?"),
        (["--lr_scheduler_type", "constant", "--warmup_steps", "5"], "constant has no warmup", "constant_with_warmup"),
    ],
)
def test_other_schedule_names_are_refused_with_the_closest_of_ours(argv, message, hint, tmp_path):
    with pytest.raises(UsageError) as err:
        parse_run_config(ZERO3 + ["--output_dir", str(tmp_path)] + argv)
    assert str(err.value).startswith(f"--lr_scheduler_type {argv[1]}") and message in str(err.value)
    assert hint in err.value.hint
