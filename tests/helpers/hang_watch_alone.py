"""Test helper: one rank's HangWatch in a process whose training loop makes no progress (it sleeps), no DeepSpeed.

    python tests/helpers/hang_watch_alone.py FOLDER WORLD_SIZE TIMEOUT LONG_ALLOWANCE long|short

The watch is the real one (scaletrain/train/hang.py) as global rank 0 of WORLD_SIZE ranks; the test plays the other
ranks by writing their heartbeat files (or a report) into FOLDER. The process ends the way a hung rank does.
"""

import sys
import time
from pathlib import Path


def main() -> None:
    from scaletrain.train.hang import HangWatch

    folder, world, timeout, allowance, kind = sys.argv[1:6]
    watch = HangWatch(
        Path(folder),
        rank=0,
        world_size=int(world),
        timeout=float(timeout),
        long_allowance_s=float(allowance),
        on_hang=lambda: print("on_hang ran", flush=True),
    )
    watch.phase("a phase of the test", step=7, long=kind == "long")
    watch.start()
    print("watching", flush=True)
    time.sleep(600)  # no progress: the watch ends this process


if __name__ == "__main__":
    main()
