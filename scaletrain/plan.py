"""The plan of a run: what the pre-flight decided (scaletrain/preflight.py resolve_run), handed to the composition
root (run.py, build.py), which gives each part only its slice of it. No wing imports this module: a wing's function
takes the config slices and named facts it reads, as keyword arguments."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.parts import DistInfo, ResumePoint

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from scaletrain.config import ResolvedDSConfig, RunConfig
    from scaletrain.data import ChatData
    from scaletrain.harness import HarnessTasks
    from scaletrain.model import RouterLoss
    from scaletrain.observability import EvalPrompts, ModelFlops, ModelShape


@dataclass(frozen=True)
class RunPlan:
    """What the pre-flight decided, handed to every later phase: the flags, the resolved DeepSpeed JSON, the launch
    with this run's layout, the model's config and tokenizer, the block size and the checkpoint to resume."""

    cfg: RunConfig
    ds: ResolvedDSConfig
    dist: DistInfo
    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    block_size: int
    n_params: int
    attn_implementation: str  # --attn_implementation, or transformers' choice for the model
    resume: ResumePoint | None = None
    model_facts: dict | None = None  # what a checkpoint must match to be resumed by this model
    flops: ModelFlops | None = None  # FLOPs per token of this model at this block size
    model_shape: ModelShape | None = None  # --plan: the memory planner's view of the model
    plan_calibration: tuple | None = None  # --plan_calibration: (the measured run, its model's shape)
    router_loss: RouterLoss | None = None  # a mixture-of-experts model's load-balancing loss
    eval_prompts: EvalPrompts | None = None  # --eval_prompts read and tokenized
    lm_eval_tasks: HarnessTasks | None = None  # --lm_eval_tasks looked up and built once
    chat: ChatData | None = None  # chat data: its template and loss mode (None: plain text)

    @property
    def resume_from(self) -> Path | None:
        return None if self.resume is None else self.resume.checkpoint

    @property
    def isolates_documents(self) -> bool:
        """Packed sequences kept apart by restarting position ids: --attention_isolation, chat examples, and
        padding-free preference pairs."""
        chat = self.chat
        return self.cfg.data.attention_isolation or (
            chat is not None and (chat.kind != "preference" or self.cfg.data.padding_free)
        )

    def replace(self, **changes) -> RunPlan:
        return dataclasses.replace(self, **changes)
