"""`python -m scaletrain.launcher`: the `deepspeed` command, same arguments, with a preemption path for signals sent to
the launcher, which DeepSpeed 0.19.8 lacks (a SIGTERM to `deepspeed` leaves the ranks running, never told; one to
launch.py SIGKILLs them 30 s later and exits 1 even when they saved). A SIGTERM or SIGUSR1 here is relayed to this
host's ranks as SIGUSR1, every RELAY_INTERVAL_S until the run ends so a rank still starting up gets it too; DeepSpeed's
launcher runs in a session of its own, ignoring SIGUSR1. A committed preemption save recorded by the ranks
(faults.PREEMPTION_RECORD_ENV) makes the exit code 85 whatever DeepSpeed reports. On a hang, a host whose ranks are all
frozen has nobody to SIGKILL them, so this launcher does, 20 s after the report ($SCALETRAIN_HANG_KILL_AFTER_S), and
exits 86. Details: docs/checkpoints.md#preemption and docs/checkpoints.md#hangs.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from scaletrain.errors import HANG_EXIT_CODE, SAVED_REQUEUE_EXIT_CODE
from scaletrain.train import HANG_NOTE_ENV, PREEMPTION_RECORD_ENV, RANK_PREEMPTION_SIGNAL, REPORT_FILE

log = logging.getLogger("scaletrain.launcher")
RELAY_INTERVAL_S = 5.0
HANG_CHECK_INTERVAL_S = 2.0
# After a rank reported a hang, the live ranks dump their stacks and exit within seconds (train/hang.py); what is
# left of this host's ranks this long after the report is frozen, and is SIGKILLed (SIGTERM would wait for it).
HANG_KILL_AFTER_ENV = "SCALETRAIN_HANG_KILL_AFTER_S"
DEFAULT_HANG_KILL_AFTER_S = 20.0
DEEPSPEED_LAUNCH_MODULE = "deepspeed.launcher.launch"  # the per-node process whose children are the ranks


def rank_processes(group: int) -> list:
    """The rank processes of the DeepSpeed launch in process group `group`: the children of its launch.py. Found by
    process group, not as the runner's descendants, because under Slurm the runner may be gone while the ranks run.
    """
    ranks = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if DEEPSPEED_LAUNCH_MODULE in (proc.info["cmdline"] or []) and os.getpgid(proc.pid) == group:
                ranks.extend(proc.children())
        except (psutil.Error, ProcessLookupError):
            continue  # ended while we looked
    return ranks


class SignalRelay:
    """Turns a preemption signal to this process into SIGUSR1 to the ranks, repeated until the run ends.

    The handlers only take note: the relay itself (a scan of the process table) runs in the wait loop.
    """

    def __init__(self):
        self.runner = None  # DeepSpeed's runner, once started
        self.requested = None  # the name of the first preemption signal received
        self._last_relay = None
        self._warned = False

    def install(self, *signals: int) -> None:
        for sig in signals:
            signal.signal(sig, self._interrupt if sig == signal.SIGINT else self._preempt)

    def _preempt(self, signum, frame) -> None:
        if self.requested is None:
            self.requested = signal.Signals(signum).name
            log.warning(
                "launcher: %s: asking the ranks to save at the next step boundary (exit %d once saved)",
                self.requested,
                SAVED_REQUEUE_EXIT_CODE,
            )

    def _interrupt(self, signum, frame) -> None:
        if self.runner is None:
            raise KeyboardInterrupt
        try:
            os.killpg(self.runner.pid, signal.SIGINT)  # what Ctrl-C in a terminal does to a launcher in the foreground
        except ProcessLookupError:
            pass

    def relay_if_due(self) -> None:
        """SIGUSR1 to every rank on this host, at once and then every RELAY_INTERVAL_S (a rank handles it as often
        as it comes; one still starting up ignores it until its handler is installed)."""
        now = time.monotonic()
        if self.requested is None or (self._last_relay is not None and now - self._last_relay < RELAY_INTERVAL_S):
            return
        self._last_relay = now
        ranks = rank_processes(self.runner.pid)
        if not ranks and not self._warned:
            self._warned = True
            log.warning(
                "launcher: no rank process of DeepSpeed's launch.py on this host yet (still starting, or a "
                "multi-node launch through ssh: start this launcher on every node with --no_ssh, as "
                "scripts/train.sbatch does); trying again every %.0fs",
                RELAY_INTERVAL_S,
            )
        for rank in ranks:
            try:
                rank.send_signal(RANK_PREEMPTION_SIGNAL)
            except psutil.NoSuchProcess:
                pass


class HangEnd:
    """Ends what is left of this host's ranks once some rank reported a hang (train/hang.py), even where every rank
    of this host is frozen and so cannot act: each rank names its hang folder in the note file at its start."""

    def __init__(self, note: Path, kill_after_s: float = DEFAULT_HANG_KILL_AFTER_S):
        self.note = note
        self.kill_after_s = kill_after_s
        self.reported_at: float | None = None  # when this launcher first saw the report
        self._last_check = 0.0

    def reported(self, now_or_never: bool = False) -> bool:
        """Whether a rank reported a hang (the file system is read at most every HANG_CHECK_INTERVAL_S, except
        `now_or_never`: the last look, once the run has ended)."""
        if self.reported_at is not None:
            return True
        now = time.monotonic()
        if (not now_or_never and now - self._last_check < HANG_CHECK_INTERVAL_S) or not self.note.exists():
            return False
        self._last_check = now
        if any((Path(folder) / REPORT_FILE).exists() for folder in set(self.note.read_text().split())):
            self.reported_at = now
        return self.reported_at is not None

    def kill_if_due(self, group: int) -> None:
        if not self.reported():
            return
        assert self.reported_at is not None  # reported() sets it
        if time.monotonic() - self.reported_at < self.kill_after_s:
            return
        for rank in rank_processes(group):
            try:
                rank.kill()
                log.warning("launcher: hang reported; rank process %d still here: killed (SIGKILL)", rank.pid)
            except psutil.NoSuchProcess:
                pass


def wait_for_run(runner: subprocess.Popen, relay: SignalRelay, hang: HangEnd | None = None) -> int:
    """The runner's exit status, once no process of its group is left (launch.py and the ranks outlive a runner
    that a SIGTERM to every process killed)."""
    while runner.poll() is None or _group_alive(runner.pid):
        relay.relay_if_due()
        if hang is not None:
            hang.kill_if_due(runner.pid)
        time.sleep(0.2)
    return runner.returncode if runner.returncode >= 0 else 128 - runner.returncode


def _group_alive(group: int) -> bool:
    try:
        os.waitpid(-1, os.WNOHANG)  # orphans of the group reparent to us where we are PID 1 (a container): reap them
    except ChildProcessError:
        pass
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def exit_code(runner_code: int, record: Path, hang: HangEnd | None = None) -> int:
    """85 when a rank recorded a committed preemption save; 86 when a rank reported a hang (the frozen ranks this
    launcher killed would otherwise make it -9); otherwise DeepSpeed's launcher's exit code."""
    saved = record.read_text().split("\n")[0] if record.exists() else ""
    if saved:
        log.warning("launcher: the ranks saved for preemption (%s); exit %d", saved, SAVED_REQUEUE_EXIT_CODE)
        return SAVED_REQUEUE_EXIT_CODE
    if runner_code != 0 and hang is not None and hang.reported(now_or_never=True):
        return HANG_EXIT_CODE
    return runner_code


def hang_kill_after_s(environ) -> float | None:
    """$SCALETRAIN_HANG_KILL_AFTER_S as seconds (the default when unset); None, after one line on stderr, when it is
    not a number of seconds."""
    raw = environ.get(HANG_KILL_AFTER_ENV, "").strip()
    if not raw:
        return DEFAULT_HANG_KILL_AFTER_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        print(
            f"scaletrain.launcher: error: {HANG_KILL_AFTER_ENV}={raw}: give the seconds (0 or more) to wait after a "
            f"hang report before SIGKILLing this host's frozen ranks, or unset it ({DEFAULT_HANG_KILL_AFTER_S:.0f})",
            file=sys.stderr,
        )
        return None
    return seconds


def main(argv: list) -> int:
    logging.basicConfig(format="[%(asctime)s] %(message)s", level=logging.INFO)
    kill_after_s = hang_kill_after_s(os.environ)
    if kill_after_s is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="scaletrain-launcher-") as folder:
        record = Path(folder) / "preempted"
        hang = HangEnd(Path(folder) / "hang-folders", kill_after_s)
        env = {**os.environ, PREEMPTION_RECORD_ENV: str(record), HANG_NOTE_ENV: str(hang.note)}
        relay = SignalRelay()
        relay.install(signal.SIGTERM, signal.SIGINT)  # reset to the default in the child when it execs
        # Slurm's `scancel --signal=USR1` reaches every process of the step, and its default action would kill
        # DeepSpeed's launchers: ignored here until the runner starts (it stays ignored across exec; ranks set theirs).
        signal.signal(RANK_PREEMPTION_SIGNAL, signal.SIG_IGN)
        relay.runner = subprocess.Popen(
            [sys.executable, "-u", "-m", "deepspeed.launcher.runner", *argv], env=env, start_new_session=True
        )
        relay.install(RANK_PREEMPTION_SIGNAL)
        return exit_code(wait_for_run(relay.runner, relay, hang), record, hang)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
