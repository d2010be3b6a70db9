"""A publishable export: generation config with the chat template's end-of-turn token, the model card, and the Hub
upload (its pre-flight, retries and failure message)."""

from __future__ import annotations

import json

import httpx
import pytest
from huggingface_hub import ModelCard
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from scaletrain.config.slices import DEFAULT_MODEL_DIR
from scaletrain.errors import UsageError
from scaletrain.checkpoint.publish import (
    RUN_FILES,
    check_push_target,
    end_of_turn_ids,
    push_to_hub,
    write_generation_config,
    write_model_card,
)

# Two real templates' turn endings (shortened to what decides the end-of-turn token): Llama 3's and ChatML's (Qwen).
LLAMA3 = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_with(template: str | None, *special: str):
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("template, end", [(LLAMA3, "<|eot_id|>"), (CHATML, "<|im_end|>")])
def test_generation_config_ends_at_the_templates_end_of_turn_and_at_eos(tmp_path, template, end):
    specials = (
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        if end == "<|eot_id|>"
        else ("<|im_start|>", "<|im_end|>")
    )
    tokenizer = tokenizer_with(template, *specials)
    end_id = tokenizer.convert_tokens_to_ids(end)
    assert end_of_turn_ids(tokenizer) == [end_id]
    write_generation_config(tmp_path, tokenizer, AutoConfig.from_pretrained(DEFAULT_MODEL_DIR))
    saved = GenerationConfig.from_pretrained(tmp_path)
    assert saved.eos_token_id == [tokenizer.eos_token_id, end_id]


def test_without_a_template_the_generation_config_has_the_tokenizers_eos_only(tmp_path):
    tokenizer = tokenizer_with(None)
    assert end_of_turn_ids(tokenizer) == []
    write_generation_config(tmp_path, tokenizer, AutoConfig.from_pretrained(DEFAULT_MODEL_DIR))
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == tokenizer.eos_token_id


def test_model_card_names_base_model_data_flags_and_final_losses(tmp_path):
    run_config = {
        "model_name_or_path": "meta-llama/Llama-3.2-1B",
        "dataset_name": "HuggingFaceH4/ultrachat_200k",
        "learning_rate": 2e-5,
        "block_size": 4096,
        "max_steps": 300,
        "world_size": 16,
        "seed": 7,
    }
    write_model_card(tmp_path, run_config, {"step": 300, "loss": 1.23456, "eval_loss": 1.5})
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model == "meta-llama/Llama-3.2-1B"
    assert card.data.datasets == ["HuggingFaceH4/ultrachat_200k"]
    for text in (
        "`--learning_rate` | `2e-05`",
        "`--world_size` | `16`",
        "final training loss | 1.2346",
        "final evaluation loss | 1.5000",
        "for 300 optimizer steps",
    ):
        assert text in card.text, text
    # a local model folder is not a Hub id: no base_model claim in the metadata
    write_model_card(tmp_path, {"model_name_or_path": str(tmp_path)}, {})
    assert ModelCard.load(tmp_path / "README.md").data.base_model is None
    assert card.data.library_name == "transformers"
    (tmp_path / "adapter_config.json").write_text("{}")  # a LoRA adapter folder is loaded by peft
    write_model_card(tmp_path, run_config, {})
    adapter_card = ModelCard.load(tmp_path / "README.md").data
    assert adapter_card.library_name == "peft" and "lora" in adapter_card.tags


def test_push_target_is_checked_before_the_run(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no saved login either
    with pytest.raises(UsageError, match="not a repository id"):
        check_push_target("not a/valid id", True)
    with pytest.raises(UsageError, match="--no-export_hf_at_end"):
        check_push_target("me/model", False)
    with pytest.raises(UsageError, match="set HF_TOKEN"):
        check_push_target("me/model", True)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    check_push_target("me/model", True)
    check_push_target(None, False)  # no push asked for: nothing to check


class MockHub:
    """A mock of huggingface_hub.HfApi (the Hub cannot be reached from these machines): fails the first
    `failures` uploads with `error`, then returns a commit."""

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error, self.calls = failures, error, []

    def create_repo(self, repo_id, private, exist_ok):
        self.calls.append(("create_repo", repo_id, private, exist_ok))

    def upload_folder(self, repo_id, folder_path, ignore_patterns, commit_message):
        self.calls.append(("upload_folder", repo_id, folder_path, tuple(ignore_patterns)))
        if self.failures:
            self.failures -= 1
            raise self.error

        class Commit:
            commit_url = f"https://huggingface.co/{repo_id}/commit/abc"

        return Commit()


def test_a_transient_failure_is_retried_with_growing_pauses_and_the_run_files_stay_home(tmp_path):
    hub, pauses = MockHub(2, httpx.ConnectError("connection reset")), []
    url = push_to_hub(tmp_path, "me/model", private=True, api=hub, sleep=pauses.append)
    assert url == "https://huggingface.co/me/model/commit/abc"
    assert pauses == [10.0, 20.0]
    uploads = [c for c in hub.calls if c[0] == "upload_folder"]
    assert len(uploads) == 3 and uploads[0][3] == RUN_FILES
    assert ("create_repo", "me/model", True, True) in hub.calls
    run_files = ("checkpoints/**", "wandb/**", "hang/**", "*.jsonl", "run_config.json", "model_config.json")
    for kept_home in (*run_files, "goodput.json", "micro_batch_probe.json"):
        assert kept_home in RUN_FILES


def test_a_failure_retrying_cannot_help_is_raised_at_once_and_retries_stop_after_the_last_attempt(tmp_path):
    from huggingface_hub.errors import OfflineModeIsEnabled

    hub, pauses = MockHub(9, OfflineModeIsEnabled("offline")), []
    with pytest.raises(OfflineModeIsEnabled):
        push_to_hub(tmp_path, "me/model", api=hub, sleep=pauses.append)
    assert pauses == []
    hub, pauses = MockHub(9, httpx.ReadTimeout("slow")), []
    with pytest.raises(httpx.ReadTimeout):
        push_to_hub(tmp_path, "me/model", api=hub, sleep=pauses.append, attempts=3)
    assert pauses == [10.0, 20.0]


@pytest.mark.slow
def test_a_failed_push_after_the_run_exits_1_keeps_the_export_and_never_shows_the_token(
    tmp_path, offline, monkeypatch, capsys
):
    """A real run and a real upload attempt: HF_HUB_OFFLINE=1 makes huggingface_hub refuse (not retried)."""
    from tests.harness import FAST_FLAGS
    from train import main

    secret = "hf_publish_secret_5a7c"
    monkeypatch.setenv("HF_TOKEN", secret)
    out = tmp_path / "out"
    code = main(
        [
            "--config",
            "ds_configs/zero2.json",
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--push_to_hub",
            "me/tiny-model",
            "--no-save_at_end",
            *FAST_FLAGS,
        ]
    )
    captured = capsys.readouterr()
    assert code == 1, captured.err[-2000:]
    [line] = [x for x in captured.err.splitlines() if x.startswith("train.py: push failed")]
    assert "me/tiny-model" in line and f"hf upload me/tiny-model {out}" in line
    assert secret not in captured.out + captured.err
    assert (out / "model.safetensors").exists() and (out / "generation_config.json").exists()
    card = (out / "README.md").read_text()
    assert "final training loss" in card and "`--max_steps` | `2`" in card
    assert json.loads((out / "run_config.json").read_text())["push_to_hub"] == "me/tiny-model"
