"""Rank-aware logging: INFO from rank 0 only, WARNING and above from every rank, the rank in every line.

Call sites just use `logging.getLogger(__name__)`; they never test the rank themselves.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings


class _AcceleratorGuess(logging.Filter):
    """Drops DeepSpeed's warning that it found no GPU and chose the CPU, which every process (each rank, the checkpoint
    writer, a converter) prints again: the run's own first lines say the accelerator once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.rank == 0 or record.levelno >= logging.WARNING


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter("%(asctime)s [rank%(rank)d] %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # INFO is ours only: libraries that log through the root logger (distutils echoing DeepSpeed's compiler
    # probes, for one) are held to warnings, which still reach the same handler.
    root.setLevel(logging.WARNING)
    logging.getLogger("scaletrain").setLevel(level)
    logging.getLogger("DeepSpeed").addFilter(_AcceleratorGuess())  # DeepSpeed's logger, before its first import
    # bitsandbytes (imported by peft wherever it is installed) warns at import, on every rank, that an optional
    # faster CPU kernel package is missing; no run here computes 4-bit products on the CPU.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # Python warnings (libraries' included) go through the same handler, with the rank, under Python's default
    # filters (the first occurrence of each, deprecations hidden) on every rank: a warning that only one rank hits
    # (its data, its disk) is not hidden.
    logging.captureWarnings(True)
    # DeepSpeed still calls torch.distributed's old collective names; the warning is not ours to act on.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)


LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def set_log_level(name: str) -> None:
    """--log_level: how much of scaletrain's own output the console shows (warnings and errors always)."""
    logging.getLogger("scaletrain").setLevel(LEVELS[name])


def interactive() -> bool:
    """Whether the console is a terminal: progress bars redraw there; in a redirect (a Slurm log, a file) their
    carriage-return frames would pile up, so the log lines alone report progress."""
    return sys.stderr.isatty()


def silence_library_logs() -> None:
    """Quiet the libraries' INFO output after their import (they install their own handlers). A library not imported
    yet is not imported for this: datasets, which a run whose token store is ready never needs (about 1 s of every
    rank's start with pandas and pyarrow), reads the same settings from the environment when something imports it."""
    os.environ.setdefault("DATASETS_VERBOSITY", "warning")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")
    if "deepspeed" in sys.modules:  # never import DeepSpeed just to quiet it (data/prepare.py does not need it)
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
    quiet_bars = not interactive()  # a redirect: no carriage-return frames of the libraries' bars either
    if quiet_bars:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        import transformers

        transformers.logging.set_verbosity_warning()
        if quiet_bars:
            transformers.logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.logging.set_verbosity_warning()
        datasets.disable_progress_bars()
