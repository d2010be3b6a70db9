"""Rank-aware logging: INFO from rank 0 only, WARNING and above from every rank, the rank in every line.

Call sites just use `logging.getLogger(__name__)`; they never test the rank themselves.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings


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
    # bitsandbytes (imported by peft wherever it is installed) warns at import, on every rank, that an optional
    # faster CPU kernel package is missing; no run here computes 4-bit products on the CPU.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # Python warnings (libraries' included) go through the same handler, with the rank, under Python's default
    # filters (the first occurrence of each, deprecations hidden) on every rank: a warning that only one rank hits
    # (its data, its disk) is not hidden.
    logging.captureWarnings(True)
    # DeepSpeed still calls torch.distributed's old collective names; the warning is not ours to act on.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)


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
    if "transformers" in sys.modules:
        import transformers

        transformers.logging.set_verbosity_warning()
    if "datasets" in sys.modules:
        import datasets

        datasets.logging.set_verbosity_warning()
        datasets.disable_progress_bars()
