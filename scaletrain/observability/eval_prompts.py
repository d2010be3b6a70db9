"""--eval_prompts: at each evaluation, a greedy generation of a few prompts, into the metrics and wandb (file format:
docs/observability.md#logging-evaluation-and-generations); read in the pre-flight, so a bad file stops the run before
anything heavy. Every rank generates every prompt, because under ZeRO-3 each forward is a collective (`synced_gpus`
keeps a rank that hit EOS stepping); greedy decoding makes the texts equal, and rank 0 records them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.errors import UsageError
from scaletrain.observability.metrics import MetricsLogger
from scaletrain.parts import ParallelLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalPrompts:
    shown: tuple  # each prompt as the metrics show it (the rendered text)
    input_ids: tuple  # each prompt's token ids
    max_new_tokens: int


def load_eval_prompts(
    path: str | None, *, tokenizer, max_new_tokens: int, max_positions: int | None, layout: ParallelLayout | None = None
) -> EvalPrompts | None:
    """Read and tokenize --eval_prompts (UsageError naming the file and line on a mistake); None without it."""
    if not path:
        return None
    flag = f"--eval_prompts {path}"
    if layout is not None and layout.model_parallel > 1:
        raise UsageError(
            f"{flag}: generation is not supported with tensor, sequence or pipeline parallelism",
            "drop --eval_prompts, or evaluate the exported model with generate() after the run",
        )
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{flag}: no such file", 'give a JSONL file of {"prompt": ...} or {"messages": [...]}')
    texts, ids = [], []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        text, chat = _prompt_text(line, number=number, flag=flag, tokenizer=tokenizer, jsonl=file.suffix == ".jsonl")
        texts.append(text)
        # a rendered conversation carries the template's own special tokens; a plain prompt gets the tokenizer's
        ids.append(tuple(tokenizer(text, add_special_tokens=not chat)["input_ids"]))
    if not texts:
        raise UsageError(f"{flag}: the file holds no prompt", "one prompt per line")
    longest = max(len(i) for i in ids)
    if max_positions and longest + max_new_tokens > max_positions:
        raise UsageError(
            f"{flag}: a prompt of {longest} tokens plus --eval_max_new_tokens {max_new_tokens} exceeds "
            f"the model's {max_positions} positions",
            "shorten the prompt or lower --eval_max_new_tokens",
        )
    return EvalPrompts(tuple(texts), tuple(ids), max_new_tokens)


def _prompt_text(line: str, *, number: int, flag: str, tokenizer, jsonl: bool) -> tuple:
    """(the prompt's text, whether a chat template rendered it)."""
    if not jsonl:
        return line, False
    where = f"{flag}, line {number}"
    try:
        record = json.loads(line)
    except ValueError as err:
        raise UsageError(f"{where}: not valid JSON ({err})", "one JSON object per line") from err
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"], False
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(
                f"{where}: a conversation, and the tokenizer has no chat template",
                'give {"prompt": text} lines, or a tokenizer with a chat template',
            )
        try:
            return tokenizer.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True), True
        except Exception as err:  # the template's own check (roles, alternation)
            raise UsageError(
                f"{where}: the chat template refused the conversation ({err})", "fix the conversation's roles"
            ) from err
    raise UsageError(f'{where}: needs a "prompt" string or a "messages" list', 'e.g. {"prompt": "Hello"}')


def generate_samples(engine, *, prompts: EvalPrompts, tokenizer, eos_ids: list, synced: bool) -> list:
    """Greedy completions of every prompt, [{"prompt", "completion"}] (every rank takes part)."""
    import torch

    module = engine.module
    was_training = module.training
    module.eval()
    rows = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids or [0])[0]
    with torch.no_grad():
        for shown, ids in zip(prompts.shown, prompts.input_ids, strict=True):
            input_ids = torch.tensor([ids], device=engine.device)
            out = module.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=prompts.max_new_tokens,
                do_sample=False,
                synced_gpus=synced,
                eos_token_id=eos_ids or None,
                pad_token_id=pad,
            )
            completion = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
            rows.append({"prompt": shown, "completion": completion})
    if was_training:
        module.train()
    return rows


@dataclass
class PromptSamples:
    """--eval_prompts at a step: every rank generates (ZeRO-3 gathers in each forward: `synced` keeps the ranks'
    forwards in step); rank 0 records the text in the metrics."""

    engine: Any
    prompts: EvalPrompts
    tokenizer: Any
    eos_ids: list
    synced: bool
    metrics: MetricsLogger

    def __call__(self, step: int) -> None:
        rows = generate_samples(
            self.engine, prompts=self.prompts, tokenizer=self.tokenizer, eos_ids=self.eos_ids, synced=self.synced
        )
        self.metrics.log_generations(step, rows)
