"""What makes an exported model folder complete and publishable: a generation_config.json whose EOS ids include the chat
template's end-of-turn token (found by rendering a one-turn conversation; without it `generate()` runs past the end of a
turn), a model card, and the --push_to_hub upload. Rank 0 uploads after the run, outside any collective; a failed
attempt is retried because a repeated upload_folder resumes. The token is never printed or written.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import TypeGuard

from scaletrain.config import eval_loss_set
from scaletrain.errors import UsageError

log = logging.getLogger(__name__)
PROBE_REPLY = "scaletrain-probe-reply"  # an assistant turn whose rendering shows what the template puts after it
TOKEN_ENV = "HF_TOKEN"
# What a run folder holds besides the export (README, "What a run writes"): never uploaded.
RUN_FILES = (
    "checkpoints/**",
    "wandb/**",
    "tensorboard/**",
    "profile/**",
    "hang/**",
    "*.jsonl",
    "goodput.json",
    "micro_batch_probe.json",
    "*.png",
    "run_config.json",
    "ds_config.json",
    "config_sources.txt",
    "model_config.json",
    ".*",
    ".*/**",
)
CARD_FLAGS = (
    "model_name_or_path",
    "config_name",
    "dataset_name",
    "train_file",
    "data_path",
    "config",
    "block_size",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "max_steps",
    "num_train_epochs",
    "weight_decay",
    "seed",
    "world_size",
)


def end_of_turn_ids(tokenizer) -> list:
    """Token ids the chat template writes right after an assistant reply (empty without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE_REPLY}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:  # a template that needs other roles or keys: no end-of-turn token to add
        log.warning(
            "the chat template could not render a one-turn conversation (%s); generation_config.json "
            "lists only the tokenizer's EOS",
            err,
        )
        return []
    after = text.split(PROBE_REPLY, 1)[1] if PROBE_REPLY in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[:1] if ids and ids[0] in special else []


def reply_end_ids(tokenizer) -> list:
    """Every id that ends a reply: the tokenizer's EOS, then the chat template's end-of-turn token."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return eos + [i for i in end_of_turn_ids(tokenizer) if i not in eos]


def write_generation_config(out_dir, tokenizer, model_config) -> list:
    """generation_config.json with every id that ends a reply as EOS; returns those ids."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(model_config)
    eos = reply_end_ids(tokenizer)
    if eos:
        generation.eos_token_id = eos if len(eos) > 1 else eos[0]
    if tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None:
        generation.bos_token_id = tokenizer.bos_token_id
    generation.save_pretrained(out_dir)
    return eos


def write_model_card(out_dir, run_config: dict, final: dict) -> None:
    """README.md: base model, data, the run's key flags and its final losses (huggingface_hub's card format)."""
    from huggingface_hub import ModelCard, ModelCardData

    base = run_config.get("model_name_or_path")
    data = run_config.get("dataset_name")
    adapter = (Path(out_dir) / "adapter_config.json").exists()  # a LoRA adapter folder: peft loads it
    card_data = ModelCardData(
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        tags=["scaletrain", "deepspeed", *(["lora"] if adapter else [])],
        base_model=base if _on_hub(base) else None,
        datasets=[data] if _on_hub(data) else None,
    )
    flags = "\n".join(f"| `--{k}` | `{run_config[k]}` |" for k in CARD_FLAGS if run_config.get(k) not in (None, ""))
    results = "\n".join(f"| {name} | {value:.4f} |" for name, value in final_losses(final))
    body = "\n".join(
        [
            "---",
            card_data.to_yaml(),
            "---",
            "",
            f"# {Path(out_dir).resolve().name}",
            "",
            f"Trained with scaletrain (DeepSpeed) from `{base or run_config.get('config_name') or 'a config'}` on "
            f"`{data or run_config.get('train_file') or run_config.get('data_path') or 'the built-in sample data'}`"
            f" for {final.get('step', '?')} optimizer steps.",
            "",
            "## Training flags",
            "",
            "| flag | value |",
            "|---|---|",
            flags,
            "",
            *(["## Results", "", "| metric | value |", "|---|---|", results, ""] if results else []),
        ]
    )
    ModelCard(body).save(Path(out_dir) / "README.md")


def final_losses(final: dict) -> list:
    """[(name, value)]: the final training loss, then each evaluation set's (eval_loss, or eval_<name>_loss for a
    named set)."""
    rows = [("final training loss", final["loss"])] if "loss" in final else []
    for key, value in final.items():
        name = eval_loss_set(key)
        if name is not None:
            rows.append((f"final evaluation loss ({name})" if name else "final evaluation loss", value))
    return rows


def complete_export(out_dir, *, tokenizer, model_config, run_config: dict, final: dict) -> None:
    """Beside an exported model (rank 0): generation_config.json, and the model card from the run's run_config.json
    and its final metrics."""
    eos = write_generation_config(out_dir, tokenizer, model_config)
    write_model_card(out_dir, run_config, final)
    log.info("wrote generation_config.json (EOS ids %s) and the model card README.md in %s", eos, out_dir)


def _on_hub(name: str | None) -> TypeGuard[str]:
    """A hub id (owner/name or name), not a local path."""
    return bool(name and not Path(name).exists() and not str(name).startswith((".", "/", "~")))


def hub_token() -> str | None:
    from huggingface_hub import get_token

    return os.environ.get(TOKEN_ENV) or get_token()


def check_push_target(repo_id: str | None, export_at_end: bool) -> None:
    """Pre-flight for --push_to_hub: a valid repository id, a token, and an export to push (exit 2 otherwise)."""
    if not repo_id:
        return
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise UsageError(
            f"--push_to_hub {repo_id}: not a repository id ({str(err).splitlines()[0]})",
            "give owner/name, e.g. my-org/llama-sft",
        ) from err
    if not export_at_end:
        raise UsageError(
            "--push_to_hub with --no-export_hf_at_end: there is no export to push", "drop --no-export_hf_at_end"
        )
    if not hub_token():
        raise UsageError(
            f"--push_to_hub {repo_id}: no Hugging Face token",
            f"set {TOKEN_ENV} in the environment (or run `hf auth login`) before the run",
        )


def transient(err: BaseException) -> bool:
    """Worth retrying: the network, a rate limit or a server error. Not: offline mode, a bad token, no permission,
    a bad request (retrying cannot help, and a wrong token must not be tried again and again)."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(err, OfflineModeIsEnabled):
        return False
    if isinstance(err, HfHubHTTPError):
        status = getattr(err.response, "status_code", None)
        return status is None or status == 429 or status >= 500
    return isinstance(err, (httpx.TransportError, ConnectionError, TimeoutError))


def push_to_hub(
    folder,
    repo_id: str,
    private: bool = False,
    attempts: int = 4,
    first_pause_s: float = 10.0,
    api=None,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Upload `folder` to `repo_id`; returns the commit URL. A transient failure is retried after a pause that
    doubles; a repeated upload resumes (see the module docstring). Raises the last error, or the first that retrying
    cannot help."""
    from huggingface_hub import HfApi

    api = api or HfApi(token=hub_token())
    ignore = list(RUN_FILES)  # the model folder only: the run's own files stay home
    pause = first_pause_s
    for attempt in range(1, attempts + 1):
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            commit = api.upload_folder(
                repo_id=repo_id,
                folder_path=str(folder),
                ignore_patterns=ignore,
                commit_message="Upload model trained with scaletrain",
            )
            url = getattr(commit, "commit_url", None) or str(commit)
            log.info("pushed %s to the Hub: %s", folder, url)
            return url
        except Exception as err:
            if attempt == attempts or not transient(err):
                raise
            log.warning(
                f"push to {repo_id} failed (attempt {attempt} of {attempts}: {type(err).__name__}); retrying in "
                f"{pause:.0f}s"
            )
            sleep(pause)
            pause *= 2
    raise AssertionError("unreachable")


def publish_export(folder: str, repo_id: str, private: bool) -> int:
    """--push_to_hub at the end of a run: the exit code. A failed push says how to push the complete export again
    by hand (the training itself succeeded; nothing is lost)."""
    try:
        push_to_hub(folder, repo_id, private=private)
    except Exception as err:
        excludes = " ".join(f"--exclude '{p}'" for p in RUN_FILES)
        print(
            f"train.py: push failed: --push_to_hub {repo_id}: {type(err).__name__}: {str(err).splitlines()[0]}; "
            f"the trained model in {folder} is complete; push it again with: hf upload {repo_id} {folder} {excludes}",
            file=sys.stderr,
        )
        return 1
    return 0
