"""Bad input, what the run reads and writes: the model and its tokenizer, attention, the data files and their
columns, the output folder and checkpoints, the Hub push, and the evaluation's prompts, lm-eval tasks and validation
sets. Each case runs train.py's real `main` in-process and ends in one clear line (and at most one hint), exit code
2, no traceback, nothing written (every check happens before a process group, model or dataset is built).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.harness import REPO
from tests.helpers.bad_input import check_bad_input, text_file

TINY = REPO / "data" / "tiny-llama"


# A task whose dataset is on the Hub (under a name nobody has cached): offline, it cannot be loaded.
HUB_TASK = """task: hub_task
dataset_path: scaletrain-tests/never-cached
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: choices
doc_to_target: label
"""


# --- builders of bad inputs: each gets the test's tmp folder and returns extra flags -----------------------------


def tokenizer_without_eos(tmp: Path) -> list:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    tok.eos_token = None
    tok.save_pretrained(tmp / "no_eos")
    return ["--tokenizer_name", str(tmp / "no_eos")]


def remote_code_model(tmp: Path) -> list:
    folder = tmp / "custom_model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "my_custom_lm", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}})
    )
    return ["--config_name", str(folder)]


def huge_model(tmp: Path) -> list:
    """A Llama config whose checkpoint needs twice the free disk: the disk check must stop it."""
    free = shutil.disk_usage(tmp).free
    per_layer = 4 * 8192 * 8192 + 3 * 8192 * 28672
    layers = max(1, int(2 * free / 16 / per_layer) + 1)
    config = json.loads((TINY / "config.json").read_text())
    config.update(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=64,
        head_dim=128,
    )
    folder = tmp / "huge"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return ["--config_name", str(folder), "--tokenizer_name", str(TINY)]


def small_vocab_model(tmp: Path) -> list:
    config = json.loads((TINY / "config.json").read_text())
    config["vocab_size"] = 100
    folder = tmp / "small_vocab"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return ["--config_name", str(folder), "--tokenizer_name", str(TINY)]


def moe_model(tmp: Path) -> list:
    """A tiny Qwen2-MoE config: its decoder MLPs are expert blocks, which --tiled_mlp cannot tile."""
    config = {
        "model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 4096,
    }  # fmt: skip
    folder = tmp / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return ["--config_name", str(folder), "--tokenizer_name", str(TINY), "--tiled_mlp"]


def previous_run(tmp: Path, identity: dict) -> None:
    out = tmp / "out"
    out.mkdir()
    (out / "run_config.json").write_text(json.dumps(identity))
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')


CASES = {
    # name: (builder of extra flags given the tmp folder, the culprit: the flag or DeepSpeed JSON key the error line
    #        must name, text that line must contain)
    "unreachable hub dataset": (
        lambda t: ["--dataset_name", "someorg/no-such-dataset"],
        "--dataset_name",
        "--dataset_name someorg/no-such-dataset: cannot load it",
    ),
    "block size above max positions": (
        lambda t: ["--block_size", "4096"],
        "--block_size",
        "--block_size 4096: above the model's",
    ),
    "tokenizer without eos": (tokenizer_without_eos, "--tokenizer_name", "the tokenizer has no EOS token"),
    "tokenizer larger than vocab": (
        small_vocab_model,
        "--tokenizer_name",
        "4096 tokens, but the model's vocabulary has 100",
    ),
    "model needs remote code": (remote_code_model, "--config_name", "needs custom code"),
    "attention backend not installed": (
        lambda t: ["--attn_implementation", "flash_attention_2"],
        "--attn_implementation",
        "the package for FlashAttention2",
    ),
    "unknown attention backend": (
        lambda t: ["--attn_implementation", "nonsense"],
        "--attn_implementation",
        'attn_implementation="nonsense"` is not supported',
    ),
    "missing model folder": (
        lambda t: ["--model_name_or_path", "./models/none"],
        "--model_name_or_path",
        "--model_name_or_path ./models/none: no such file or folder",
    ),
    "missing train file": (
        lambda t: ["--train_file", "data/none.jsonl"],
        "--train_file",
        "--train_file data/none.jsonl: no such file",
    ),
    "unsupported data format": (
        lambda t: ["--train_file", str(text_file(t, "notes.md", "# hi"))],
        "--train_file",
        "unsupported file type .md",
    ),
    "empty train file": (
        lambda t: ["--train_file", str(text_file(t, "empty.jsonl", ""))],
        "--train_file",
        "holds no documents",
    ),
    "missing text column": (
        lambda t: ["--train_file", str(text_file(t, "c.csv", "body,n\nhello,1\n"))],
        "--text_column",
        "--text_column text: not a column",
    ),
    "non-text column": (
        lambda t: ["--train_file", str(text_file(t, "n.jsonl", '{"text": 5}\n'))],
        "--text_column",
        "--text_column text: holds int",
    ),
    "output holds a different run": (
        lambda t: previous_run(t, {"config_name": "other/model"}) or [],
        "--output_dir",
        "holds a different run (config_name: other/model -> None)",
    ),
    "output holds the same run": (
        lambda t: previous_run(t, {}) or ["--resume_from_checkpoint", "none"],
        "--output_dir",
        "holds a previous run of this model and data",
    ),
    "resume from a missing checkpoint": (
        lambda t: ["--resume_from_checkpoint", str(t / "nope")],
        "--resume_from_checkpoint",
        "no such folder",
    ),
    "disk smaller than a checkpoint": (huge_model, "--output_dir", "GB free on its disk, one checkpoint"),
    "tiled MLP on a mixture of experts": (
        moe_model,
        "--tiled_mlp",
        "model.layers.0.mlp is a Qwen2MoeSparseMoeBlock, which does not work token by token",
    ),
    "push to a malformed repository id": (
        lambda t: ["--push_to_hub", "not a/valid id"],
        "--push_to_hub",
        "not a repository id",
    ),
    "eval prompts file missing": (
        lambda t: ["--eval_prompts", str(t / "prompts.jsonl")],
        "--eval_prompts",
        "prompts.jsonl: no such file",
    ),
    "lm-eval task unknown": (
        lambda t: ["--lm_eval_tasks", "docstring_modul"],
        "--lm_eval_tasks",
        "'docstring_modul' is not a task, group or tag lm-eval knows",
    ),
    "lm-eval task YAML that does not parse": (
        lambda t: ["--lm_eval_tasks", str(text_file(t, "broken.yaml", "task: [unclosed\n"))],
        "--lm_eval_tasks",
        "task broken.yaml: ",
    ),
    "lm-eval task whose dataset is not cached offline": (
        lambda t: ["--lm_eval_tasks", str(text_file(t, "hub_task.yaml", HUB_TASK))],
        "--lm_eval_tasks",
        "task hub_task.yaml: ",
    ),
    "lm-eval cadence without tasks": (
        lambda t: ["--lm_eval_steps", "5"],
        "--lm_eval_steps",
        "--lm_eval_steps needs --lm_eval_tasks",
    ),
    "validation set without a name": (
        lambda t: [
            "--train_file",
            "data/sample/train.jsonl",
            "--validation_file",
            "a=data/sample/validation.jsonl,data/sample/validation.jsonl",
        ],
        "--validation_file",
        "has no set name, the others do",
    ),
    "validation set named twice": (
        lambda t: [
            "--train_file",
            "data/sample/train.jsonl",
            "--validation_file",
            "a=data/sample/validation.jsonl,a=data/sample/train.jsonl",
        ],
        "--validation_file",
        "the set a is named twice",
    ),
    "named validation file missing": (
        lambda t: ["--train_file", "data/sample/train.jsonl", "--validation_file", "code=data/none.jsonl"],
        "--validation_file",
        "--validation_file data/none.jsonl: no such file",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_touches_nothing(name, tmp_path, offline, capsys):
    check_bad_input(name, CASES[name], tmp_path, capsys)
