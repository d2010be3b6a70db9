"""Benchmark scores during training with EleutherAI's lm-evaluation-harness (lm-eval's own `--tasks`, `--limit`,
`--batch_size` and `--num_fewshot`, prefixed): which tasks, how often, and how big. Slices as in
scaletrain/config/slices.py; the tasks themselves are looked up in the pre-flight (scaletrain/harness/tasks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config.slices import _flag
from scaletrain.errors import UsageError


@dataclass(frozen=True)
class HarnessArgs:
    """lm-evaluation-harness on the live model: every rank takes part, the requests split over them."""

    lm_eval_tasks: str | None = _flag(
        None,
        "lm-evaluation-harness tasks scored on the live model, comma-separated: task or group names (hellaswag, "
        "arc_easy, mmlu), or paths to task YAML files or folders of them (as lm_eval's --include_path takes them). "
        "Results: lm_eval/<task>/<metric> in metrics.jsonl and wandb, lm-eval's JSON in <output_dir>/lm_eval/.",
    )
    lm_eval_steps: int = _flag(0, "Score --lm_eval_tasks every N optimizer steps (0: at the end of the run only).")
    lm_eval_limit: int | None = _flag(
        None, "Items per task (lm_eval's --limit; the first N documents, split over the ranks). Default: all."
    )
    lm_eval_batch_size: int = _flag(8, "Requests per forward on each rank (lm_eval's --batch_size; an integer).")
    lm_eval_num_fewshot: int | None = _flag(
        None, "Few-shot examples per item (lm_eval's --num_fewshot). Default: each task's own (0 where it sets none)."
    )
    lm_eval_log_samples: bool = _flag(
        False,
        "Also write every item's request, responses and score to <output_dir>/lm_eval/step<N>_samples_<task>.jsonl "
        "(lm_eval's --log_samples; gathered to rank 0).",
    )

    @property
    def task_specs(self) -> tuple:
        return tuple(t.strip() for t in (self.lm_eval_tasks or "").split(",") if t.strip())

    def validate(self) -> None:
        if self.lm_eval_tasks is not None and not self.task_specs:
            raise UsageError(f"--lm_eval_tasks {self.lm_eval_tasks!r}: names no task", "e.g. --lm_eval_tasks arc_easy")
        if self.lm_eval_steps < 0:
            raise UsageError(f"--lm_eval_steps {self.lm_eval_steps}: must be 0 (the end only) or more")
        if self.lm_eval_limit is not None and self.lm_eval_limit < 1:
            raise UsageError(f"--lm_eval_limit {self.lm_eval_limit}: must be at least 1")
        if self.lm_eval_batch_size < 1:
            raise UsageError(f"--lm_eval_batch_size {self.lm_eval_batch_size}: must be at least 1")
        if self.lm_eval_num_fewshot is not None and self.lm_eval_num_fewshot < 0:
            raise UsageError(f"--lm_eval_num_fewshot {self.lm_eval_num_fewshot}: must be 0 or more")
        if not self.task_specs:
            for name in ("lm_eval_steps", "lm_eval_limit", "lm_eval_num_fewshot", "lm_eval_log_samples"):
                if getattr(self, name) not in (None, 0, False):
                    raise UsageError(f"--{name} needs --lm_eval_tasks", "name the tasks to score")
