"""Test helper: a stand-in rank for the launcher's tests, started by DeepSpeed's launcher like train.py, with the
pipeline's own preemption flag and record but no model (a real rank takes a minute to start on 2 cores).

TOY_EXIT=N: exit N at once. Otherwise: wait TOY_STARTUP_S seconds (as a rank building its model, before its
handler is installed), install the PreemptionFlag (and touch TOY_READY_DIR/rankN, if set), wait for a signal, wait
for every rank to have its signal too (TOY_AGREE_DIR: as real ranks agree through a collective before they save, so
none exits while another has not yet taken the signal), record the "save" and exit 85.
"""

import os
import sys
import time
from pathlib import Path


from scaletrain.errors import SAVED_REQUEUE_EXIT_CODE
from scaletrain.train.preemption import PreemptionFlag, record_preemption_saved


def agree_on_the_stop(agree_dir: Path, rank: str, world_size: int, timeout_s: float = 120) -> None:
    """Marks this rank's signal and waits (as a collective would) until every rank has marked its own."""
    (agree_dir / f"signalled{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(agree_dir.glob("signalled*"))) < world_size:
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: the other ranks never took the signal")
        time.sleep(0.05)


def main() -> int:
    rank = os.environ["RANK"]
    if "TOY_EXIT" in os.environ:
        time.sleep(1)  # long enough for launch.py to see it start
        return int(os.environ["TOY_EXIT"])
    time.sleep(float(os.environ.get("TOY_STARTUP_S", "0")))
    flag = PreemptionFlag()
    flag.install()
    if "TOY_READY_DIR" in os.environ:
        (Path(os.environ["TOY_READY_DIR"]) / f"rank{rank}").touch()
    while flag.signal_name is None:
        time.sleep(0.05)
    print(f"rank {rank} got {flag.signal_name}", flush=True)
    agree_on_the_stop(Path(os.environ["TOY_AGREE_DIR"]), rank, int(os.environ["WORLD_SIZE"]))
    record_preemption_saved(0)
    return SAVED_REQUEUE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
