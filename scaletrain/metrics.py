"""Where the numbers go: console, a JSONL file in the run folder (always), and wandb when asked.

A logging window accumulates this rank's loss sum; at the logging step one all-reduce turns it into the mean
over every real token of every global batch in the window, the same number however the batch is split.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"


@dataclass
class LogWindow:
    """Sums since the last logging step."""

    loss_sum: Any = 0.0  # this rank's summed token losses (a device tensor: no host sync per step)
    targets: int = 0  # global loss targets (identical on every rank)
    steps: int = 0
    seconds: float = 0.0
    data_seconds: float = 0.0
    grad_norm: Any = None  # the last step's, read only when the window is summarized

    def add(self, loss_sum, targets: int, seconds: float, data_seconds: float, grad_norm) -> None:
        self.loss_sum = self.loss_sum + loss_sum
        self.targets += targets
        self.steps += 1
        self.seconds += seconds
        self.data_seconds += data_seconds
        self.grad_norm = grad_norm

    def summarize(self, device) -> dict:
        """Reduce across ranks (a collective: every rank must call it at the same step)."""
        import torch
        import deepspeed.comm as ds_comm

        total = torch.as_tensor(self.loss_sum, dtype=torch.float64, device=device).reshape(1).clone()
        ds_comm.all_reduce(total)
        loss = total.item() / max(self.targets, 1)
        return {
            "loss": loss,
            "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
            "tokens_per_s": self.targets / self.seconds if self.seconds else 0.0,
            "step_time_s": self.seconds / max(self.steps, 1),
            "data_wait_s": self.data_seconds / max(self.steps, 1),
        }


def _secret_free(config: dict) -> dict:
    """Drop anything that looks like a credential before a config leaves the process."""
    markers = ("token", "key", "secret", "password")
    return {k: v for k, v in config.items() if not any(m in k.lower() for m in markers)}


def _keep_records_up_to(path: Path, step: int) -> None:
    """A resumed run repeats the steps after its checkpoint: drop their old records so each step appears once."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class MetricsLogger:
    def __init__(self, output_dir: str, is_main: bool, report_to: str, run_name: str, run_config: dict,
                 resume_step: int = 0, wandb_run_id: Optional[str] = None):
        self.is_main = is_main
        self.path = Path(output_dir) / METRICS_FILE
        self._file = None
        self._wandb = None
        self.wandb_run_id = wandb_run_id
        if not is_main:
            return
        _keep_records_up_to(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if report_to == "wandb":
            import wandb

            # resume="allow" with the saved id: a resumed run continues the same wandb run.
            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "scaletrain"),
                name=run_name,
                dir=output_dir,
                config=_secret_free(run_config),
                id=wandb_run_id,
                resume="allow" if wandb_run_id else None,
            )
            self.wandb_run_id = self._wandb.id

    def log(self, record: dict) -> None:
        """Write one record (rank 0 only; other ranks return at once)."""
        if not self.is_main:
            return
        record = {k: v for k, v in record.items() if v is not None}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        log.info("  ".join(_fmt(k, v) for k, v in record.items() if k != "time"))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key}={value:.3e}"
        return f"{key}={value:.4g}" if math.isfinite(value) else f"{key}={value}"
    return f"{key}={value}"
