"""Hangs end with a name: each rank's watch thread writes a heartbeat file (step, phase, since when) in the run folder
every tenth of --hang_timeout, through no collective, so a rank stuck in one cannot hide the others' and a process
frozen whole (SIGSTOP, a driver call holding the GIL) shows as a heartbeat that stopped. A rank whose loop makes no
progress for --hang_timeout declares the hang (long phases get until --ddp_timeout - 60 s, still before the process
group's own timeout); every live rank dumps its stacks and exits HANG_EXIT_CODE, and frozen ranks, deaf to SIGTERM, are
SIGKILLed by their host's live ranks a few seconds after those exit (so DeepSpeed's launcher records the live ranks'
code first), or by scaletrain.launcher where all of a host's ranks are frozen. Heartbeat ages compare hosts' wall
clocks: NTP keeps them milliseconds apart, far below any sensible --hang_timeout. Details: docs/checkpoints.md#hangs.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from scaletrain.config import HangArgs
from scaletrain.errors import HANG_EXIT_CODE
from scaletrain.parts import DistInfo

log = logging.getLogger(__name__)

HANG_DIR = "hang"
REPORT_FILE = "report.txt"
HEARTBEAT_DIR = "heartbeat"
LONG_PHASE_MARGIN_S = 60.0  # long phases end this much before the process group's timeout would
KILL_DELAY_S = 3.0  # a frozen rank on this host is SIGKILLed this long after the live ones exit
HANG_NOTE_ENV = "SCALETRAIN_HANG_NOTE"  # set by scaletrain.launcher: a file each rank writes its hang folder into


def beat_interval(timeout: float) -> float:
    """Seconds between heartbeats (and checks): a tenth of the timeout, within [0.5, 15]."""
    return min(15.0, max(0.5, timeout / 10))


def long_allowance(hang_timeout: float, ddp_timeout: float) -> float:
    """How long a phase known to be long may go without progress: until shortly before the process group's
    timeout, which would otherwise end the run first and name no rank."""
    return max(hang_timeout, ddp_timeout - LONG_PHASE_MARGIN_S)


def stacks_file(folder: Path, rank: int) -> Path:
    return folder / f"stacks-rank-{rank:05d}.txt"


BEAT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "rank": int,
    "step": int,
    "phase": str,
    "beat": (int, float),
    "since": (int, float),
    "finished": bool,
}


def read_beats(folder: Path) -> dict:
    """{rank: heartbeat dict} of every rank whose heartbeat file could be read. A file that is not a heartbeat (gone,
    damaged, a stray one: not JSON, or without a field of the right type) counts as no heartbeat: it cannot stop the
    watch from judging the others."""
    beats = {}
    for path in (folder / HEARTBEAT_DIR).glob("rank-*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced, gone or damaged
        if isinstance(beat, dict) and all(isinstance(beat.get(k), kind) for k, kind in BEAT_FIELDS.items()):
            beats[beat["rank"]] = beat
    return beats


def stopped_ranks(beats: dict, now: float, timeout: float) -> list:
    """The ranks whose heartbeat stopped `timeout` seconds ago or more: frozen, or gone without finishing."""
    return sorted(r for r, b in beats.items() if not b["finished"] and now - b["beat"] >= timeout)


def suspects(beats: dict, world_size: int, now: float, timeout: float) -> tuple:
    """(the ranks that stopped making progress, why), judged from the heartbeats: ranks whose heartbeat stopped;
    else ranks behind the others' step; else ranks in another phase than most; else every rank (all alive and
    waiting: a collective entered differently, which the stacks show)."""
    frozen = stopped_ranks(beats, now, timeout)
    if frozen:
        return frozen, f"no heartbeat for {timeout:.0f}s or more (frozen or gone)"
    missing = sorted(set(range(world_size)) - set(beats))
    if missing:
        return missing, "no heartbeat file at all (is --output_dir shared by every node?)"
    live = {r: b for r, b in beats.items() if not b["finished"]}
    if not live:
        return [], "every rank finished"
    newest = max(b["step"] for b in live.values())
    behind = sorted(r for r, b in live.items() if b["step"] < newest)
    if behind:
        return behind, f"behind the others' step {newest}"
    common, count = Counter(b["phase"] for b in live.values()).most_common(1)[0]
    odd = sorted(r for r, b in live.items() if b["phase"] != common)
    if odd and count > len(odd):
        return odd, f'not where the others are ("{common}")'
    return sorted(live), "every rank alive and waiting at the same place: see the stacks"


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))


def describe_hang(beats: dict, *, world_size: int, now: float, timeout: float, stuck_s: float) -> tuple:
    """(one line for the console, the text of report.txt)."""
    named, why = suspects(beats, world_size, now, timeout)
    rows = []
    for rank in range(world_size):
        b = beats.get(rank)
        if b is None:
            rows.append(f"rank {rank}: no heartbeat file")
            continue
        state = "finished" if b["finished"] else f"last heartbeat {now - b['beat']:.0f}s ago"
        rows.append(
            f"rank {rank} ({b['host']}, pid {b['pid']}): step {b['step']}, {b['phase']} since "
            f"{_clock(b['since'])} ({now - b['since']:.0f}s); {state}"
        )
    where = "; ".join(
        f"rank {r}"
        + (
            f" ({beats[r]['host']}, pid {beats[r]['pid']}) at step {beats[r]['step']}, {beats[r]['phase']}"
            f" since {_clock(beats[r]['since'])}"
            if r in beats
            else ""
        )
        for r in named[:8]
    )
    more = f" and {len(named) - 8} more" if len(named) > 8 else ""
    line = f"no progress for {stuck_s:.0f}s; stopped: {where}{more}: {why}"
    text = f"hang declared at {_clock(now)}: {line}\n\n" + "\n".join(rows) + "\n"
    return line, text


def dump_flight_recorder(folder: Path, rank: int) -> Path | None:
    """On a GPU: the NCCL flight recorder's trace of this rank (TORCH_NCCL_TRACE_BUFFER_SIZE set, as
    enable_flight_recorder does) into `folder`; None where there is none."""
    import torch
    import torch.distributed as torch_dist

    if not torch.cuda.is_available() or not torch_dist.is_initialized():
        return None
    try:
        trace = torch._C._distributed_c10d._dump_nccl_trace()  # type: ignore[attr-defined]  # CUDA builds only
    except (AttributeError, RuntimeError):
        return None
    path = folder / f"nccl-trace-rank-{rank:05d}.pkl"
    path.write_bytes(trace)
    return path


def enable_flight_recorder(output_dir: str, environ=os.environ, cuda: bool | None = None) -> None:
    """Before the process group exists, on a GPU: the NCCL flight recorder on (what the user set stays), its dump on
    a watchdog timeout into <output_dir>/hang/."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        return
    environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(output_dir).resolve() / HANG_DIR / "nccl_trace_rank_"))


def attempt_folder(output_dir: str) -> Path:
    """A new folder for this attempt's heartbeats (and report, if it hangs), chosen by global rank 0; earlier
    attempts' folders without a report are removed (a report stays for the user to read)."""
    root = Path(output_dir) / HANG_DIR
    if root.is_dir():
        for old in root.iterdir():
            if old.is_dir() and not (old / REPORT_FILE).exists():
                shutil.rmtree(old, ignore_errors=True)
    return root / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def start_hang_watch(
    args: HangArgs, output_dir: str, dist: DistInfo, on_hang: Callable[[], object] | None = None
) -> HangWatch | None:
    """Every rank (a collective): this attempt's hang folder chosen by global rank 0, this rank's watch started, and a
    barrier, so that every rank's first heartbeat exists before any rank reads them. None when --hang_timeout is 0."""
    from scaletrain.distributed import barrier, broadcast_from_main, process_group_timeout

    group_timeout = process_group_timeout()
    if dist.is_main:
        log.info(
            "process group timeout %s; hang watch: %s",
            "unknown" if group_timeout is None else f"{group_timeout:.0f}s",
            "off (--hang_timeout 0)"
            if not args.hang_timeout
            else f"--hang_timeout {args.hang_timeout:g}s (the first "
            f"step, saves, evaluations: {long_allowance(args.hang_timeout, args.ddp_timeout):.0f}s)",
        )
    if not args.hang_timeout:
        return None
    folder = broadcast_from_main(str(attempt_folder(output_dir)) if dist.is_main else None)
    allowance = long_allowance(args.hang_timeout, args.ddp_timeout)
    watch = HangWatch(
        Path(folder),
        rank=dist.rank,
        world_size=dist.world_size,
        timeout=args.hang_timeout,
        long_allowance_s=allowance,
        on_hang=on_hang,
    )
    watch.start()
    barrier()
    return watch


class HangWatch:
    """This rank's heartbeat and the thread that watches for a hang. The training loop calls phase() at each step
    and each phase of one (an assignment or two: nothing is written from the loop)."""

    def __init__(
        self,
        folder: Path,
        *,
        rank: int,
        world_size: int,
        timeout: float,
        long_allowance_s: float,
        on_hang: Callable[[], object] | None = None,
    ):
        self.folder, self.rank, self.world_size = Path(folder), rank, world_size
        self.timeout, self.long_allowance = timeout, long_allowance_s
        self.interval = beat_interval(timeout)
        self.on_hang = on_hang  # best effort, from the watch thread, before the exit (the goodput ledger's end)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.step, self._phase, self._long = 0, "first step", True
        self._since, self._progress = time.time(), time.monotonic()
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat_path = self.folder / HEARTBEAT_DIR / f"rank-{rank:05d}.json"

    def phase(self, name: str, step: int | None = None, long: bool = False) -> None:
        """The loop moved on: it is now in `name` (at `step`, the 1-based step in flight); `long`: a phase with the
        long allowance."""
        if step is not None:
            self.step = step
        self._phase, self._long = name, long
        self._since, self._progress = time.time(), time.monotonic()

    def start(self) -> None:
        """The first heartbeat (written before this returns: callers barrier after it, so every rank's exists),
        then the watch thread."""
        self._beat_path.parent.mkdir(parents=True, exist_ok=True)
        self._write_beat()
        note = os.environ.get(HANG_NOTE_ENV)
        if note:  # scaletrain.launcher ends what is left of this host's ranks once a report is here
            with open(note, "a") as record:
                record.write(f"{self.folder.resolve()}\n")
        self._thread = threading.Thread(target=self._watch, name="scaletrain-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The run ended here (finished, failed or preempted): the thread stops and the heartbeat says finished, so
        no other rank reads this one's silence as a hang."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
        try:
            self._write_beat(finished=True)
        except OSError as err:  # a full disk, often why the run ends: the run's own error stays the one said
            log.warning("hang watch: could not write the final heartbeat in %s: %s", self.folder, err)

    def _write_beat(self, finished: bool = False) -> None:
        self._seq += 1
        beat = {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "step": self.step,
            "phase": self._phase,
            "since": self._since,
            "beat": time.time(),
            "seq": self._seq,
            "finished": finished,
        }
        tmp = self._beat_path.with_name(f".{self._beat_path.name}.tmp")
        try:
            tmp.write_text(json.dumps(beat))
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self._beat_path)

    def _watch(self) -> None:
        warned = False
        while not self._stop.wait(self.interval):
            try:
                self._write_beat()
                if (self.folder / REPORT_FILE).exists():
                    self._end(None)  # another rank declared: dump and go
                stuck = time.monotonic() - self._progress
                if stuck < self.timeout:
                    continue
                beats, now = read_beats(self.folder), time.time()
                allowance = self.long_allowance if self._long else self.timeout
                if stopped_ranks(beats, now, self.timeout) or stuck >= allowance:
                    self._declare(beats, now, stuck)
            except Exception as err:  # the run folder unwritable a moment, a stray file: training goes on, said once
                if not warned:
                    warned = True
                    log.warning("hang watch: %s in %s: %s", type(err).__name__, self.folder, err)

    def _declare(self, beats: dict, now: float, stuck: float) -> None:
        line, text = describe_hang(beats, world_size=self.world_size, now=now, timeout=self.timeout, stuck_s=stuck)
        try:
            fd = os.open(self.folder / REPORT_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            fd, line = None, None  # another rank was first
        if fd is not None:
            with os.fdopen(fd, "w") as report:
                report.write(text)
        self._end(line)

    def _end(self, line: str | None) -> None:
        """Dump this rank's stacks (and NCCL trace), wait briefly for the other live ranks' stacks, say `line` (the
        declaring rank), SIGKILL the frozen ranks of this host after a delay, and exit HANG_EXIT_CODE."""
        with open(stacks_file(self.folder, self.rank), "w") as out:
            out.write(f"rank {self.rank} ({self.host}, pid {self.pid}): step {self.step}, {self._phase}\n\n")
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        trace = dump_flight_recorder(self.folder, self.rank)
        if self.on_hang is not None:
            try:
                self.on_hang()
            except Exception as err:  # the exit below matters more
                log.warning("hang watch: %s", err)
        deadline = time.monotonic() + 2 * self.interval + 5
        beats, frozen = {}, []
        while time.monotonic() < deadline:
            beats, now = read_beats(self.folder), time.time()
            frozen = stopped_ranks(beats, now, self.timeout)
            live = [r for r, b in beats.items() if not b["finished"] and r not in frozen]
            if all(stacks_file(self.folder, r).exists() for r in live):
                break
            time.sleep(0.2)
        if line is not None:
            nccl = f"; NCCL traces: {self.folder}/nccl-trace-rank-*.pkl" if trace else ""
            print(
                f"train.py: hang: {line}; stacks: {self.folder}/stacks-rank-*.txt{nccl}; report: "
                f"{self.folder / REPORT_FILE}; exit {HANG_EXIT_CODE}",
                file=sys.stderr,
                flush=True,
            )
        pids = [str(beats[r]["pid"]) for r in frozen if beats[r]["host"] == self.host]
        if pids:  # after this rank's exit, so that the launcher sees HANG_EXIT_CODE before a -9
            subprocess.Popen(
                ["/bin/sh", "-c", f"sleep {KILL_DELAY_S}; kill -9 {' '.join(pids)} 2>/dev/null"],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)
