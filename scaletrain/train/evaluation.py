"""Evaluation on the validation sets: each set's mean loss and perplexity over every rank, and the callback that
evaluates (and generates --eval_prompts' samples) every --eval_steps steps during training."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from scaletrain.config import eval_metric_prefix
from scaletrain.data import EvalBatches, IGNORE_INDEX
from scaletrain.distributed import broadcast_from_main
from scaletrain.observability import MetricsLogger
from scaletrain.train.callbacks import Callback, Order, StepOutcome
from scaletrain.train.losses import token_loss_sum


def evaluate_sets(engine, sets: dict, evaluator=None) -> dict:
    """Each validation set's mean loss and perplexity: eval_loss for the unnamed set, eval_<name>_loss for each
    named one (--validation_file name=path,...), in the order given. `evaluator`: what evaluates instead of the token
    loss here (a PipelineStep, or a preference run's objective), through its `evaluate(engine, batches, prefix)`."""
    run_eval = evaluator.evaluate if evaluator else evaluate
    return {
        key: value
        for split, batches in sets.items()
        for key, value in run_eval(engine, batches, eval_metric_prefix(split)).items()
    }


def evaluate(engine, batches: EvalBatches, prefix: str = "eval_") -> dict:
    """Mean loss over a fixed set of validation blocks, across ranks, and its perplexity."""
    import deepspeed.comm as ds_comm
    import torch

    engine.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=engine.device)
    with torch.no_grad():
        for batch in batches:
            sums[0] += token_loss_sum(engine, batch).double()
            sums[1] += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    engine.train()
    ds_comm.all_reduce(sums)
    loss = (sums[0] / sums[1].clamp(min=1)).item()
    return {f"{prefix}loss": loss, f"{prefix}perplexity": math.exp(min(loss, 50.0))}


class PeriodicEvaluation(Callback):
    """Every --eval_steps steps (not at the last: the end of the run evaluates it): the validation sets' losses and
    --eval_prompts' generations, on every rank (collectives)."""

    order = Order.EVALUATION

    def __init__(
        self,
        eval_steps: int,
        metrics: MetricsLogger,
        evaluate: Callable[[], dict] | None = None,
        generate: Callable[[int], None] | None = None,
    ):
        self.eval_steps, self.metrics = eval_steps, metrics
        self.evaluate, self.generate = evaluate, generate

    def post_step(self, outcome: StepOutcome) -> None:
        # (not at a preemption: the signal's lead time is for the save)
        due = self.eval_steps and outcome.step % self.eval_steps == 0 and not outcome.last
        due = due and "stop" not in outcome.requests
        if due and (self.evaluate or self.generate):
            self.trainer.phase("evaluation", long=True)
            self.trainer.hold("evaluation", lambda: self._evaluate(outcome.step))

    def end_of_training(self, step: int) -> None:
        """The last step's evaluation, unless it has its records (a run resumed at its last step evaluated it):
        decided by rank 0, which holds the records, so that every rank enters the same collectives."""
        if not (self.evaluate or self.generate):
            return
        if not broadcast_from_main(self.metrics.evaluated(step)):
            self.trainer.hold("evaluation", lambda: self._evaluate(step))

    def _evaluate(self, step: int) -> None:
        if self.evaluate is not None:
            self.metrics.log({"step": step, **self.evaluate()})
        if self.generate is not None:
            self.generate(step)


class Scorer(Protocol):
    """Benchmark scores of the live model at a step (harness.LiveScores)."""

    def __call__(self, step: int) -> None: ...

    def scored(self, step: int) -> bool:
        """Whether `step` has its scores on disk (rank 0's view of the run folder)."""
        ...


class BenchmarkEvaluation(Callback):
    """--lm_eval_steps N: lm-evaluation-harness scores every N steps (0: none during training; not at the last step,
    which the end of training scores unless its scores are on disk), on every rank (collectives). Its time is the
    run's evaluation time: the step profile's "evaluation" phase, the goodput ledger's eval, and the hang watch's
    long allowance."""

    order = Order.BENCHMARKS

    def __init__(self, every: int, score: Scorer):
        self.every, self.score = every, score

    def end_of_training(self, step: int) -> None:
        if not broadcast_from_main(self.score.scored(step)):  # rank 0's view: every rank scores, or none
            self.trainer.hold("evaluation", lambda: self.score(step))

    def post_step(self, outcome: StepOutcome) -> None:
        due = self.every and outcome.step % self.every == 0 and not outcome.last and "stop" not in outcome.requests
        if due:
            self.trainer.phase("lm-eval", long=True)
            self.trainer.hold("evaluation", lambda: self.score(outcome.step))
