"""--lm_eval_tasks during a run: lm-evaluation-harness on the live model, every rank scoring its share of the
requests; rank 0 logs each task's metrics and writes lm-eval's JSON to <output_dir>/lm_eval/step<N>.json. The live
model as lm-eval's LM is built at the first evaluation and kept for the next ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.config import HarnessArgs
from scaletrain.harness.live_model import engine_lm
from scaletrain.harness.results import RESULTS_DIR
from scaletrain.harness.scoring import score
from scaletrain.harness.tasks import HarnessTasks


@dataclass
class LiveScores:
    """Scores the run's live module at a step (a collective: every rank calls it at the same step)."""

    module: Any
    _: KW_ONLY
    tokenizer: Any
    tasks: HarnessTasks
    args: HarnessArgs
    out_dir: Path
    data_rank: int  # this rank's share of the requests, among data_ranks data-parallel ranks
    data_ranks: int
    lockstep: bool  # ZeRO-3 over several ranks: every forward is a collective, so the ranks run them in step
    log: Callable[[dict], None]
    progress: Callable[[str], None] | None = None
    show_bars: bool = False
    _lm: Any = field(default=None, init=False)  # lm-eval's LM over the module, built at the first evaluation

    def __call__(self, step: int) -> None:
        if self._lm is None:
            self._lm = engine_lm(
                self.module,
                self.tokenizer,
                self.args.lm_eval_batch_size,
                rank=self.data_rank,
                world_size=self.data_ranks,
                lockstep=self.lockstep,
                progress=self.progress,
            )
        scores = score(
            self._lm,
            tasks=self.tasks,
            args=self.args,
            out_dir=self.out_dir,
            name=f"step{step}",
            step=step,
            show_bars=self.show_bars,
        )
        if scores is not None:
            self.log({"step": step, **scores.metrics})

    def scored(self, step: int) -> bool:
        """Whether `step` has lm-eval's results in the run folder (a run resumed at its last step scored it)."""
        return (self.out_dir / RESULTS_DIR / f"step{step}.json").is_file()

    def close(self) -> None:
        if self._lm is not None:
            self._lm.close()
            self._lm = None
