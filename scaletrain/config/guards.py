"""The run's guards: what a non-finite loss or a spike does, and when a stuck run is ended (the hang watch and the
process group's own timeout). Slices as in scaletrain/config/slices.py."""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config.slices import _flag
from scaletrain.config.values import _check_not_negative
from scaletrain.errors import UsageError

# The shortest --hang_timeout: heartbeats are written every tenth of it (at least every 0.5 s), and a step's own
# variation must not read as a hang.
MIN_HANG_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class NonFiniteArgs:
    """What a non-finite loss or gradient norm, or a loss spike, does to the run."""

    on_nonfinite: str = _flag(
        "skip",
        "A non-finite loss or gradient norm, or a loss spike: skip the update on every rank (and roll back "
        "after --max_consecutive_skips), or stop with a message.",
        choices=("skip", "stop"),
    )
    max_consecutive_skips: int = _flag(
        5,
        "After this many skipped updates in a row, roll back to the last committed checkpoint and continue "
        "past the offending samples (0: never roll back).",
    )
    loss_spike_factor: float = _flag(
        0.0,
        "Treat a step whose loss exceeds this multiple of the running mean loss like a non-finite one "
        "(0: off; e.g. 3).",
    )

    def validate(self) -> None:
        _check_not_negative(self, ("max_consecutive_skips",))
        if self.loss_spike_factor != 0 and self.loss_spike_factor <= 1:
            raise UsageError(
                f"--loss_spike_factor {self.loss_spike_factor}: must be above 1 (or 0 to turn it off)",
                "e.g. 3: a step with three times the running mean loss is skipped",
            )


@dataclass(frozen=True)
class HangArgs:
    """When a run that stopped making progress is ended, with the stuck ranks named; the process group's timeout."""

    hang_timeout: float = _flag(
        600.0,
        "Seconds without progress (a step, or a phase of one) before the run is declared hung: the ranks that can "
        "still run name the ranks that stopped and where each was, dump every rank's Python stacks to "
        "<output_dir>/hang/, and the job ends with exit code 86. Saves, evaluations and the first step may take "
        "up to --ddp_timeout - 60 s. 0: off. Must be below --ddp_timeout.",
    )
    ddp_timeout: float = _flag(
        1800.0,
        "The process group's timeout, seconds (Hugging Face's spelling and default): a collective waiting longer "
        "raises. DeepSpeed's own default would be 10 minutes.",
    )

    def validate(self) -> None:
        _check_not_negative(self, ("hang_timeout",))
        if self.ddp_timeout <= 0:
            raise UsageError(f"--ddp_timeout {self.ddp_timeout:g}: must be positive", "e.g. 1800 (30 minutes)")
        if self.hang_timeout and self.hang_timeout < MIN_HANG_TIMEOUT_S:
            raise UsageError(
                f"--hang_timeout {self.hang_timeout:g}: must be at least {MIN_HANG_TIMEOUT_S:g} seconds (or 0: off)",
                "pick a few times the longest step, e.g. 600",
            )
        if self.hang_timeout >= self.ddp_timeout:
            raise UsageError(
                f"--hang_timeout {self.hang_timeout:g}: must be below --ddp_timeout {self.ddp_timeout:g}, or the "
                "process group times out first and no rank is named",
                f"lower --hang_timeout, or raise --ddp_timeout above {self.hang_timeout:g}",
            )
