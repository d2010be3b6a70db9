"""A test's launch of N ranks, timed from start to the launcher's exit, in variants that alternate within each round.

    python scripts/bench/test_launch.py --rounds 3 --nprocs 2                      # --compare poll
    python scripts/bench/test_launch.py --rounds 3 --nprocs 2 --compare async_save
    python scripts/bench/test_launch.py --rounds 3 --nprocs 2 --compare none --config ds_configs/zero2_offload.json

--compare poll: DeepSpeed's launch.py polling its ranks every second (as DeepSpeed ships it) against every 0.05 s (as
the tests run it, tests/harness.py). --compare async_save: --async_save (the default) against --no-async_save, with
periodic saves asked for (--save_steps 100) but none due: what the background writer process costs a short run.
--compare none: the launch alone (run from a checkout of another commit, it times that commit's code).

Each run is a run of 2 steps of the built-in sample with the tests' quick flags (--config, zero2 by default), started
exactly as the tests' `deepspeed_cmd` starts it (launch.py directly, the garbage collector frozen at its exit). The
first run of all also prepares the token store; it is not timed.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from scripts.bench.common import bench_parser
from scripts.launching import Launcher, child_env, run
from tests.harness import FAST_FLAGS, LAUNCH_POLL_PATCH, LAUNCH_WITHOUT_FINAL_COLLECTION

REPO = Path(__file__).resolve().parents[2]

SHIPPED_POLL = LAUNCH_WITHOUT_FINAL_COLLECTION.replace(LAUNCH_POLL_PATCH, "")
# --compare -> {variant: (the launcher's code, extra flags of train.py)}
COMPARISONS = {
    "poll": {
        "poll 1 s (as shipped)": (SHIPPED_POLL, []),
        "poll 0.05 s (the tests)": (LAUNCH_WITHOUT_FINAL_COLLECTION, []),
    },
    "async_save": {
        "--async_save": (LAUNCH_WITHOUT_FINAL_COLLECTION, ["--save_steps", "100", "--async_save"]),
        "--no-async_save": (LAUNCH_WITHOUT_FINAL_COLLECTION, ["--save_steps", "100", "--no-async_save"]),
    },
    "none": {"launch": (LAUNCH_WITHOUT_FINAL_COLLECTION, [])},
}


def timed_launch(code: str, extra: list, config: str, nprocs: int, work: Path) -> float:
    out = work / "run"
    shutil.rmtree(out, ignore_errors=True)
    args = ["--config", config, "--output_dir", str(out), "--max_steps", "2", *FAST_FLAGS, *extra]
    cmd = Launcher("launch.py", nprocs, launch_code=code).command(REPO / "train.py", args)
    started = time.perf_counter()
    proc = run(cmd, child_env(work / "cache"))
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"a launch failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return elapsed


def main() -> int:
    parser = bench_parser(__doc__, rounds=3, nprocs=2)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="poll", help="the variants (default poll)")
    parser.add_argument("--config", default="ds_configs/zero2.json", help="the DeepSpeed config of every run")
    args = parser.parse_args()
    variants = COMPARISONS[args.compare]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        timed_launch(LAUNCH_WITHOUT_FINAL_COLLECTION, [], args.config, args.nprocs, work)  # prepares the token store
        runs = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (code, extra) in variants.items():
                runs[name].append(timed_launch(code, extra, args.config, args.nprocs, work))
    for name, seconds in runs.items():
        print(f"{name}: " + ", ".join(f"{s:.2f}" for s in seconds) + " s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
