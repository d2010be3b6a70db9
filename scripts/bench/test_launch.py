"""A test's launch of N ranks, timed from start to the launcher's exit: DeepSpeed's launch.py polling its ranks
every second (as DeepSpeed ships it) against every 0.05 s (as the tests run it, tests/conftest.py).

    python scripts/bench/test_launch.py --rounds 3 --nprocs 2

Each run is a zero2 run of 2 steps of the built-in sample with the tests' quick flags, started exactly as the tests'
`deepspeed_cmd` starts it (launch.py directly, the garbage collector frozen at its exit); the two variants alternate
within each round. The first run of all also prepares the token store; it is not timed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.bench.common import bench_parser  # noqa: E402
from tests.conftest import (  # noqa: E402
    FAST_FLAGS,
    LAUNCH_POLL_PATCH,
    LAUNCH_WITHOUT_FINAL_COLLECTION,
    deepspeed_cmd,
    subprocess_env,
)

VARIANTS = {
    "poll 1 s (as shipped)": LAUNCH_WITHOUT_FINAL_COLLECTION.replace(LAUNCH_POLL_PATCH, ""),
    "poll 0.05 s (the tests)": LAUNCH_WITHOUT_FINAL_COLLECTION,
}


def timed_launch(code: str, nprocs: int, work: Path) -> float:
    out = work / "run"
    shutil.rmtree(out, ignore_errors=True)
    args = ["--config", "ds_configs/zero2.json", "--output_dir", str(out), "--max_steps", "2", *FAST_FLAGS]
    cmd = deepspeed_cmd(nprocs, REPO / "train.py", args)
    cmd[cmd.index(LAUNCH_WITHOUT_FINAL_COLLECTION)] = code
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(work / "cache"), capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"a launch failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return elapsed


def main() -> int:
    args = bench_parser(__doc__, rounds=3, nprocs=2).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        timed_launch(LAUNCH_WITHOUT_FINAL_COLLECTION, args.nprocs, work)  # prepares the token store
        runs = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, code in VARIANTS.items():
                runs[name].append(timed_launch(code, args.nprocs, work))
    for name, seconds in runs.items():
        print(f"{name}: " + ", ".join(f"{s:.2f}" for s in seconds) + " s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
