"""The goodput ledger: where a run's wall-clock time went, across every attempt (restarts, requeues, preemptions).

`<output_dir>/goodput.json` is rewritten by rank 0 at every logging record, every committed checkpoint and every end
of an attempt, so an attempt killed with -9 still counts up to its last write:

    {"wall_s": s, "goodput": productive / wall,
     "seconds": {"productive", "startup", "data_wait", "checkpoint", "eval", "lost_work", "between_attempts", "other"},
     "attempts": [{"start", "end", "exit_code", "first_step", "last_step", ...}]}

The categories add up to wall_s, the time from the first attempt's start to the latest attempt's last write:
- startup: an attempt's start (its process) to its first step;
- productive: the steps' own time (without data wait and saves), of steps that were kept;
- lost_work: the time of steps computed again after a restart (those after the checkpoint the next attempt resumed
  from);
- data_wait, checkpoint (the time saves held training), eval (evaluations, the end of the run's too);
- between_attempts: from an attempt's last write to the next attempt's start (a requeue's wait, a crash's tail);
- other: the rest (the final save and export, the shutdown).

Left out of wall_s ("not_counted"): the time from a clean end (exit 0, every step done) to a later start, and a re-run
of a finished run that trains nothing (it only re-exports): the user's pauses are not the run's time.

Each attempt keeps the cumulative step time at each checkpoint it committed, so the lost work of an attempt is known
whichever checkpoint the next one resumed from.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

LEDGER_FILE = "goodput.json"
CATEGORIES = ("productive", "startup", "data_wait", "checkpoint", "eval", "lost_work", "between_attempts", "other")


def process_start_time() -> float:
    """This process's start, as the epoch time (the attempt's start: imports and the launch count as startup)."""
    import psutil

    return psutil.Process(os.getpid()).create_time()


def new_attempt(start: float) -> dict:
    return {
        "start": start,
        "end": start,
        "exit_code": None,  # None: still running, or killed before it could say
        "first_step": None,
        "last_step": None,
        "first_step_at": None,  # when its first step began (the end of its startup)
        "step_s": 0.0,  # the steps' own time: wall time less data wait and saves
        "data_wait_s": 0.0,
        "checkpoint_s": 0.0,
        "eval_s": 0.0,
        "commits": [],  # [step, step_s so far] at each committed checkpoint
        "rolled_back_s": 0.0,  # step time undone by rollbacks to a checkpoint within the attempt (lost work)
    }


def _step_s_up_to(attempt: dict, step: int) -> float:
    """The attempt's step time up to `step` (a checkpoint the next attempt resumed from)."""
    first, last = attempt["first_step"], attempt["last_step"]
    if first is None or step <= first:
        return 0.0
    if last is None or step >= last:
        return attempt["step_s"]
    for committed, so_far in attempt["commits"]:
        if committed == step:
            return so_far
    return attempt["step_s"] * (step - first) / (last - first)  # a step it never committed: pro rata


def _reexport_only(attempt: dict, previous: dict | None) -> bool:
    """An attempt that trained nothing after a run that had ended cleanly: a re-run of a finished run (its export)."""
    trained = attempt["last_step"] is not None and attempt["last_step"] != attempt["first_step"]
    return previous is not None and previous["exit_code"] == 0 and not trained


def per_attempt(attempts: list) -> list:
    """Each attempt's seconds by category (its lost work judged by the attempt after it, the gap to that one its
    `between_attempts`), and what of it is not counted: {"seconds": {...}, "not_counted": s}."""
    rows = []
    # Each attempt's steps are kept up to the earliest step a later attempt resumed from: a resume from an older
    # checkpoint (a damaged one's fallback, --resume_from_checkpoint) makes the steps after it lost work, whichever
    # attempt trained them.
    kept_up_to = [None] * len(attempts)
    earliest = None
    for index in range(len(attempts) - 1, -1, -1):
        kept_up_to[index] = earliest
        first = attempts[index]["first_step"]
        if first is not None and (earliest is None or first < earliest):
            earliest = first
    for index, attempt in enumerate(attempts):
        previous = attempts[index - 1] if index else None
        following = attempts[index + 1] if index + 1 < len(attempts) else None
        seconds = dict.fromkeys(CATEGORIES, 0.0)
        gap = max(0.0, following["start"] - attempt["end"]) if following is not None else 0.0
        not_counted = gap if attempt["exit_code"] == 0 else 0.0
        seconds["between_attempts"] = gap - not_counted
        if _reexport_only(attempt, previous):
            rows.append({"seconds": seconds, "not_counted": not_counted + attempt["end"] - attempt["start"]})
            continue
        up_to = kept_up_to[index]
        kept = attempt["step_s"] if up_to is None else _step_s_up_to(attempt, up_to)
        seconds["productive"] = kept
        seconds["lost_work"] = attempt["step_s"] - kept + attempt["rolled_back_s"]
        seconds["startup"] = (attempt["first_step_at"] or attempt["end"]) - attempt["start"]
        for category in ("data_wait", "checkpoint", "eval"):
            seconds[category] = attempt[f"{category}_s"]
        span = (following["start"] if following is not None else attempt["end"]) - attempt["start"]
        seconds["other"] = span - not_counted - sum(seconds.values())
        rows.append({"seconds": seconds, "not_counted": not_counted})
    return rows


def totals(attempts: list) -> dict:
    """The ledger of `attempts` (oldest first): wall_s, goodput, seconds by category (adding up to wall_s), and the
    seconds left out of wall_s: the time from a clean end (exit 0) to a later start, the user's pause and not the
    run's, and re-runs of a finished run that only re-export it."""
    rows = per_attempt(attempts)
    seconds = {name: sum(row["seconds"][name] for row in rows) for name in CATEGORIES}
    wall = sum(seconds.values())
    return {
        "wall_s": round(wall, 3),
        "goodput": round(seconds["productive"] / wall, 4) if wall > 0 else 0.0,
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "not_counted_s": round(sum(row["not_counted"] for row in rows), 3),
    }


def read_ledger(output_dir) -> dict | None:
    path = Path(output_dir) / LEDGER_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _previous_attempts(output_dir) -> list:
    """The attempts of the ledger in `output_dir`; none (a fresh ledger, with a warning) where it cannot be read: a
    side file never stops a run."""
    try:
        ledger = read_ledger(output_dir)
        if ledger is not None and not isinstance(ledger, dict):
            raise ValueError("not a ledger")
        attempts = list(ledger["attempts"]) if ledger is not None else []
        for attempt in attempts:
            missing = set(new_attempt(0.0)) - set(attempt)
            if missing:
                raise ValueError(f"an attempt lacks {sorted(missing)}")
        return attempts
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning(
            "goodput: %s is unreadable (%s); this attempt starts a fresh ledger", Path(output_dir) / LEDGER_FILE, err
        )
        return []


def render_table(ledger: dict) -> str:
    """The ledger as a text table: each category's seconds and share of the wall-clock time."""
    wall = ledger["wall_s"] or 1.0
    rows = [f"goodput {ledger['goodput']:.1%} of {ledger['wall_s']:.0f} s over {len(ledger['attempts'])} attempt(s)"]
    rows += [f"  {name:<17} {value:>10.1f} s  {value / wall:6.1%}" for name, value in ledger["seconds"].items()]
    return "\n".join(rows)


class GoodputLedger:
    """This attempt's bookkeeping, appended to the attempts already in the ledger (rank 0 writes; the others only
    count, so every rank can call every method)."""

    def __init__(self, output_dir, is_main: bool, started: float | None = None, clock=time.time):
        self.path = Path(output_dir) / LEDGER_FILE
        self.is_main, self.clock = is_main, clock
        self._write_failed = False  # said once
        self.attempts = _previous_attempts(output_dir) if is_main else []
        self._lock = threading.Lock()  # the hang watch's thread ends the attempt while the loop may be writing
        self.attempt = new_attempt(process_start_time() if started is None else started)
        self.attempts.append(self.attempt)

    def begin(self, step: int) -> None:
        """Training starts (or resumes) after `step`."""
        self.attempt["first_step"] = self.attempt["last_step"] = step

    def step_started(self) -> None:
        if self.attempt["first_step_at"] is None:
            self.attempt["first_step_at"] = self.clock()

    def step(self, step: int, seconds: float, data_wait: float, checkpoint: float) -> None:
        """Book one step: its wall seconds, of which `data_wait` waiting for data and `checkpoint` a save's."""
        self.attempt["last_step"] = step
        self.attempt["step_s"] += max(0.0, seconds - data_wait - checkpoint)
        self.attempt["data_wait_s"] += data_wait
        self.attempt["checkpoint_s"] += checkpoint

    def rolled_back(self, step: int) -> None:
        """The run went back to its checkpoint of `step` (the non-finite guard's rollback): the step time since is
        lost work, and the steps from there are booked again."""
        kept = _step_s_up_to(self.attempt, step)
        self.attempt["rolled_back_s"] += self.attempt["step_s"] - kept
        self.attempt["step_s"] = kept
        self.attempt["commits"] = [c for c in self.attempt["commits"] if c[0] <= step]
        self.attempt["last_step"] = step

    def save_held(self, seconds: float) -> None:
        """A save that no step's time includes (the preemption's, right before the exit) held training so long."""
        self.attempt["checkpoint_s"] += seconds

    def evaluation(self, seconds: float) -> None:
        self.attempt["eval_s"] += seconds

    def committed(self, step: int, step_s: float | None = None) -> None:
        """A checkpoint of `step` is committed: remember the step time up to it (`step_s`, for a save written in the
        background and committed steps later: the step time when it was taken; default: so far), and write."""
        self.attempt["commits"].append([step, self.attempt["step_s"] if step_s is None else step_s])
        self.write()

    def end(self, exit_code: int, metrics=None) -> dict | None:
        """The attempt ends: write, log the table and put the figures in the metrics' summary (wandb) on rank 0;
        the ledger."""
        self.attempt["exit_code"] = exit_code
        ledger = self.write()
        if ledger is not None:
            log.info("%s", render_table(ledger))
            if metrics is not None:
                metrics.summarize(
                    {"goodput": ledger["goodput"], "wall_s": ledger["wall_s"]}
                    | {f"goodput_{name}_s": value for name, value in ledger["seconds"].items()}
                )
        return ledger

    def write(self) -> dict | None:
        """Rewrite goodput.json (rank 0), atomically; the ledger."""
        if not self.is_main:
            return None
        with self._lock:
            self.attempt["end"] = self.clock()
            ledger = {**totals(self.attempts), "attempts": self.attempts}
            self._write_file(json.dumps(ledger, indent=1))
        return ledger

    def _write_file(self, text: str) -> None:
        """goodput.json replaced whole, on disk before it replaces the last one (a crash leaves one or the other)."""
        tmp = self.path.with_name(f".{LEDGER_FILE}.tmp")
        try:
            with open(tmp, "w") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except OSError as err:  # a full disk: training goes on (a save says so, clearly); the last good file stays
            tmp.unlink(missing_ok=True)
            if not self._write_failed:
                log.warning("goodput: could not write %s (%s); it keeps its previous contents", self.path, err)
            self._write_failed = True
