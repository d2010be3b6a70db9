"""Test helper: train.py with one rank's loss made non-finite (or spiked) at chosen data steps.

    SCALETRAIN_TEST_INJECT_NONFINITE="RANK:STEP,STEPxF,..." deepspeed tests/helpers/inject_nonfinite.py <train.py flags>

multiplies RANK's loss at those data steps (1-based: the batch a step trains on, so a rollback's data offset moves
past them) by NaN, or by F when given (a loss spike). The backward then sees the same bad loss, as it would with a
real bad batch. The pipeline holds no hook for this: the helper wraps scaletrain.train.step.token_loss_sum, and only
while scaletrain.train.step.optimizer_step runs, so an evaluation's loss is never touched; under pipeline parallelism it
wraps the pipe engine's loss function (pipeline.TokenLoss) while PipelineStep.step runs, which only
the last stage calls. Without the variable it is plain train.py.
"""

import inspect
import os
import sys


INJECT_ENV = "SCALETRAIN_TEST_INJECT_NONFINITE"


def parse_spec(spec: str) -> tuple:
    """The spec "RANK:STEP,STEPxF,..." as (rank, {data step (1-based): factor}), NaN where no factor is given."""
    target, _, steps = spec.partition(":")
    factors: dict = {}
    for item in steps.split(","):
        step, _, factor = item.partition("x")
        factors.setdefault(int(step), float(factor) if factor else float("nan"))
    return int(target), factors


def install(factors: dict) -> None:
    """Scale this process's summed micro-batch losses by factors[data step + 1] inside scaletrain.train.step's steps."""
    from scaletrain.train import step as steps

    step_fn, loss_fn = steps.optimizer_step, steps.token_loss_sum
    signature = inspect.signature(step_fn)
    current = {"factor": None}

    def optimizer_step(*args, **kwargs):
        data_step = signature.bind(*args, **kwargs).arguments["data_step"]
        current["factor"] = factors.get(data_step + 1)
        try:
            return step_fn(*args, **kwargs)
        finally:
            current["factor"] = None

    def token_loss_sum(engine, batch):
        summed = loss_fn(engine, batch)
        return summed if current["factor"] is None else summed * current["factor"]

    steps.optimizer_step, steps.token_loss_sum = optimizer_step, token_loss_sum
    _install_pipeline(factors, current)


def _install_pipeline(factors: dict, current: dict) -> None:
    from scaletrain.train import step as steps
    from scaletrain.distributed import pipeline

    pipeline_step, loss_call = steps.PipelineStep.step, pipeline.TokenLoss.__call__
    signature = inspect.signature(pipeline_step)

    def step(self, *args, **kwargs):
        data_step = signature.bind(self, *args, **kwargs).arguments["data_step"]
        current["factor"] = factors.get(data_step + 1)
        try:
            return pipeline_step(self, *args, **kwargs)
        finally:
            current["factor"] = None

    def scaled_loss(self, logits, targets):
        factor, before = current["factor"], self.loss_sum
        loss = loss_call(self, logits, targets)
        if factor is None:
            return loss
        self.loss_sum = before + (self.loss_sum - before) * factor  # the reported sum and the backward alike
        return loss * factor

    steps.PipelineStep.step, pipeline.TokenLoss.__call__ = step, scaled_loss


def main() -> int:
    import train
    from scaletrain.distributed.world import read_launch_env

    spec = os.environ.get(INJECT_ENV)
    if spec:
        rank, factors = parse_spec(spec)
        if read_launch_env().rank == rank:  # the rank train.py will have (the same launch variables)
            install(factors)
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
