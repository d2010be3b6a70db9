"""Where the numbers go: console, a JSONL file in the run folder (always), and wandb when asked.

A logging window accumulates this rank's loss sum; at the logging step one all-reduce turns it into the mean
over every real token of every global batch in the window, the same number however the batch is split.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

from scaletrain.errors import SAVED_REQUEUE_EXIT_CODE

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"


# pipeline: under pipeline parallelism, the 1F1B schedule up to the update (forwards, backwards and the
# stage-to-stage transfers interleave, so they are one phase; forward and backward stay 0 there).
PHASES = ("data_wait", "forward", "backward", "pipeline", "optimizer", "sync", "checkpoint", "evaluation")


class PhaseClock:
    """Splits a step into phases by laps. On a CPU that costs nothing; on a GPU a lap must synchronise (else it times
    the previous phase's kernels), which would serialise host and device and lose DeepSpeed's overlap of communication
    with compute, so only steps started with `measured=True` (the logged ones) are split. `synchronize` replaces
    torch.cuda.synchronize (tests count the calls)."""

    def __init__(self, device, synchronize: Callable[[], None] | None = None):
        self.on_gpu = device.type == "cuda"
        self._sync = lambda: None
        if self.on_gpu:
            import torch

            self._sync = synchronize or (lambda: torch.cuda.synchronize(device))
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.measured = True
        self._last = 0.0

    def start(self, measured: bool = True) -> None:
        self.measured = measured or not self.on_gpu
        if self.measured:
            self._sync()
        self.phases = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if not self.measured:
            return
        self._sync()
        now = time.perf_counter()
        self.phases[phase] += now - self._last
        self._last = now


@dataclass(frozen=True)
class ThroughputModel:
    """What turns tokens/s into TFLOP/s, MFU and HFU (scaletrain.observability.flops)."""

    flops_per_token: float
    hardware_flops_per_token: float
    peak_tflops: float | None  # per device; None when unknown (then no MFU)
    world_size: int


def memory_stats(device) -> dict:
    import psutil

    stats = {"cpu_rss_gb": psutil.Process().memory_info().rss / 2**30}
    if device.type == "cuda":
        import torch

        stats["gpu_allocated_gb"] = torch.cuda.memory_allocated(device) / 2**30
        stats["gpu_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return stats


def _secret_free(config: dict) -> dict:
    """Drop anything that looks like a credential before a config leaves the process."""
    markers = ("token", "key", "secret", "password")
    return {k: v for k, v in config.items() if not any(m in k.lower() for m in markers)}


@dataclass(frozen=True)
class RecordScan:
    """What a metrics.jsonl holds: its readable records, whether its last line was cut short, and the numbers of the
    unreadable lines before it (a file damaged before its end)."""

    records: list
    torn: bool
    damaged: tuple


def scan_records(path: Path) -> RecordScan:
    """Every line of a metrics.jsonl that is a record (a JSON object with an integer step), the others counted."""
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    records, bad = [], []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            bad.append(number)
    torn = bool(bad) and bad[-1] == len(lines)
    return RecordScan(records, torn, tuple(bad[:-1] if torn else bad))


def read_records(path: Path) -> tuple:
    """(records of a metrics.jsonl, whether its last line was torn), for the readers of a run (the plots, the export's
    model card, the scaling report). A last line cut short (a SIGKILL or a full disk in the middle of a write) is
    dropped; an unreadable line before it is left out with a warning naming it (a resume also sets such a file
    aside: _keep_records_up_to)."""
    scan = scan_records(path)
    if scan.damaged:
        log.warning("%s: left out line(s) %s, which are not metrics records", path, _line_numbers(scan.damaged))
    return scan.records, scan.torn


def _line_numbers(numbers: tuple) -> str:
    return ", ".join(map(str, numbers[:5])) + (" ..." if len(numbers) > 5 else "")


def _keep_records_up_to(path: Path, step: int) -> list:
    """A resumed run repeats the steps after its checkpoint: drop their old records so each step appears once.
    A side file never stops a run: a last line cut short is dropped, and a file damaged before its end is kept as
    it was beside the new one (metrics.jsonl.damaged-TIME), which holds its readable records. The records kept."""
    if not path.exists():
        return []
    scan = scan_records(path)
    if scan.torn:
        log.warning("%s: its last line was cut short (a kill or a full disk during a write); dropped it", path)
    if scan.damaged:
        aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(path, aside)
        log.warning(
            f"{path}: {len(scan.damaged)} line(s) before its end are not metrics records (line "
            f"{_line_numbers(scan.damaged)}); the file as it was is kept in {aside.name}, and training goes on with "
            f"its {len(scan.records)} readable records"
        )
    kept = [record for record in scan.records if record["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(record) + "\n" for record in kept))
    os.replace(tmp, path)
    return kept


def _is_evaluation(record: dict) -> bool:
    """An evaluation's losses, or --eval_prompts' generations."""
    return "generations" in record or any(key.startswith("eval_") for key in record)


@dataclass(frozen=True)
class RunIdentity:
    """What wandb is told of the run: its name and configuration, and the id of the wandb run a resume continues."""

    name: str
    config: dict
    wandb_run_id: str | None = None


class MetricsLogger:
    def __init__(
        self,
        output_dir: str,
        is_main: bool,
        sinks: tuple,
        identity: RunIdentity,
        resume_step: int = 0,
        write_files: bool = True,
    ):
        """`write_files` False (--dry_run): the console only."""
        run_name, run_config, wandb_run_id = identity.name, identity.config, identity.wandb_run_id
        self.is_main = is_main
        self.path = Path(output_dir) / METRICS_FILE
        self._file = None
        self._wandb = None
        self._tensorboard = None
        self.last_record: dict | None = None
        self.latest: dict = {}  # each key's newest value (the model card's final losses)
        self.wandb_run_id = wandb_run_id
        self._evaluated_steps: set = set()  # steps with an evaluation record, this attempt's and the kept ones
        if not is_main or not write_files:  # --dry_run writes nothing: console only
            return
        kept = _keep_records_up_to(self.path, resume_step)
        self._evaluated_steps = {record["step"] for record in kept if _is_evaluation(record)}
        self._file = open(self.path, "a", encoding="utf-8")
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run replaces the events of the steps it trains again.
            self._tensorboard = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=resume_step + 1)
        if "wandb" in sinks:
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

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the sinks: the wandb run id, so a resumed run continues the same wandb run."""
        return {"wandb_run_id": self.wandb_run_id}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: a resume's id is read before the sinks open (RunIdentity), and a rollback's checkpoint
        is of this wandb run already."""

    def log(self, record: dict) -> None:
        """Write one record (rank 0 only; other ranks return at once)."""
        if not self.is_main:
            return
        record = {k: v for k, v in record.items() if v is not None}
        self.last_record = record
        self.latest.update(record)
        if _is_evaluation(record):
            self._evaluated_steps.add(record["step"])
        self._append(record)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if self._tensorboard is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key, value, record["step"])
        log.info("  ".join(_fmt(k, v) for k, v in record.items() if k != "time"))

    def _append(self, record: dict) -> None:
        """One line of metrics.jsonl. A full disk ends the file for this attempt, said once: its last line may be
        torn, which a resume drops, and no later line follows it; the console, wandb and TensorBoard go on (the next
        save stops the run with a clear message if the disk stays full)."""
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:
            log.warning(
                "%s: could not write the record of step %s (%s); this attempt writes no more records there",
                self.path,
                record.get("step"),
                err,
            )
            self._close_file()

    def _close_file(self) -> None:
        file, self._file = self._file, None
        assert file is not None, "called with the file open"
        try:
            file.close()
        except OSError:  # what could not be flushed is said above; the file is closed all the same
            pass

    def summarize(self, values: dict) -> None:
        """Figures of the whole run (the goodput ledger's) in wandb's run summary; rank 0 only."""
        if self.is_main and self._wandb is not None:
            self._wandb.summary.update(values)

    def evaluated(self, step: int) -> bool:
        """Whether `step` has an evaluation record (rank 0's knowledge: the others hold no records)."""
        return step in self._evaluated_steps

    def log_generations(self, step: int, rows: list) -> None:
        """--eval_prompts: one metrics.jsonl record {"step", "generations": [{"prompt", "completion"}]}, a wandb
        table, and a console line per prompt (rank 0 only)."""
        if not self.is_main:
            return
        self._evaluated_steps.add(step)
        self._append({"step": step, "generations": rows})
        if self._wandb is not None:
            import wandb

            table = wandb.Table(
                columns=["step", "prompt", "completion"],
                data=[[step, row["prompt"], row["completion"]] for row in rows],
            )
            self._wandb.log({"generations": table}, step=step)
        for row in rows:
            log.info("step %d: %r -> %r", step, row["prompt"][-80:], row["completion"][:200])

    def rewind(self, step: int) -> None:
        """A rollback: the records after `step` are of steps that will be trained again (rank 0 rewrites the file;
        wandb and TensorBoard keep their points, the new ones are logged over them)."""
        if self._file is None:
            return
        self._file.close()
        _keep_records_up_to(self.path, step)
        self._file = open(self.path, "a", encoding="utf-8")

    def close(self, exit_code: int = 0) -> None:
        """`exit_code` is the run's: wandb shows a non-zero one as failed, and 85 (saved after a preemption
        signal) as preempted, so a crashed run no longer shows as finished."""
        if self._file is not None:
            self._close_file()
        if self._wandb is not None:
            if exit_code == SAVED_REQUEUE_EXIT_CODE:
                self._wandb.mark_preempting()
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key}={value:.3e}"
        return f"{key}={value:.4g}" if math.isfinite(value) else f"{key}={value}"
    return f"{key}={value}"


def describe_dry_run(record: dict) -> str:
    """The line a --dry_run ends with, from its one step's record."""
    memory = ", ".join(f"{k} {record[k]:.2f}" for k in ("gpu_peak_gb", "gpu_allocated_gb", "cpu_rss_gb") if k in record)
    return (
        f"dry run OK: one step in {record.get('step_time_s', 0):.2f}s (forward {record.get('forward_s', 0):.2f}s, "
        f"backward {record.get('backward_s', 0):.2f}s, optimizer {record.get('optimizer_s', 0):.2f}s); memory: "
        f"{memory}; nothing was saved"
    )
