"""A preemption's cost: the time from the signal to exit 85, with a background write in flight and without.

    python scripts/bench/preemption.py            # prints Markdown rows for BENCHMARKS.md and JSON lines

One rank started as srun starts one (`python train.py`), the model of scripts/bench/checkpoint.py widened to
--hidden / --layers, ZeRO-2, fp32, `--async_save`, a save every --every steps, OMP_NUM_THREADS=1. Each round runs
both cases from the same start, each a fresh run:

- "no write in flight": SIGUSR1 once the log says the save of step --every was committed in the background: the
  preemption writes its checkpoint once, synchronously;
- "write in flight": SIGUSR1 as soon as the log says step --every's snapshot was taken (its write has just started):
  at the next step boundary the preemption waits for that write, commits it, then writes the steps since;
- "at a save's step": the run signals itself (tests/helpers/slow_rank.py's SCALETRAIN_TEST_SIGNAL_AT) in the first
  forward of step --every, whose periodic save is due: the ranks agree on the preemption at that boundary, the
  periodic save snapshots the step and the preemption commits its background write, with no second write (timed
  from the helper's stamp of the signal, in the run's log).

Reported: the seconds from os.kill to the process's exit (85), the run's own "preemption ... in Ns" line (the save
under the signal, with the drain), and the write-in-flight case against the other, medians over --rounds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts.bench.checkpoint import COMMON, model
from scripts.bench.common import bench_parser
from scripts.launching import child_env

REPO = Path(__file__).resolve().parents[2]

CASES = {
    "no write in flight": r"committed checkpoint \S+/step{every}, written in the background",
    "write in flight": r"checkpoint step{every}: snapshot taken",
    "at a save's step": None,  # signalled from inside the run (tests/helpers/slow_rank.py) during step --every
}
SLOW_RANK = REPO / "tests" / "helpers" / "slow_rank.py"
SENT = re.compile(r"test helper: SIGUSR1 sent at ([\d.]+)")


def preempt(folder: Path, out: Path, every: int, case: str) -> dict:
    """One run signalled at the moment `case` names: {"exit_s": signal to exit, "save_s": the run's own figure}."""
    args = [*COMMON, "--config_name", str(folder), "--tokenizer_name", str(folder), "--output_dir", str(out)]
    args += ["--max_steps", "1000", "--per_device_train_batch_size", "2", "--save_steps", str(every), "--async_save"]
    if CASES[case] is None:
        return preempt_from_inside(args, every)
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list = []
    seen = threading.Event()
    moment = re.compile(CASES[case].format(every=every))

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if moment.search(line):
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not seen.wait(timeout=900):
        proc.kill()
        sys.exit(f"{case}: the run never logged {moment.pattern!r}:\n{''.join(lines)[-3000:]}")
    signalled = time.perf_counter()
    os.kill(proc.pid, signal.SIGUSR1)
    code = proc.wait(timeout=900)
    exit_s = time.perf_counter() - signalled
    reader.join(timeout=10)
    log = "".join(lines)
    if code != 85:
        sys.exit(f"{case}: exit {code}, not 85:\n{log[-3000:]}")
    return figures(log, exit_s)


def preempt_from_inside(args: list, every: int) -> dict:
    """The run signals itself in the first forward of step `every`, whose periodic save is due at its boundary:
    the preemption agreed there commits that save's background write and writes nothing else. Timed from the
    helper's stamp of the signal to the process's exit."""
    env = child_env(SCALETRAIN_TEST_SIGNAL_AT=f"0:{every}")
    proc = subprocess.run(
        [sys.executable, str(SLOW_RANK), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    exited = time.time()
    log = proc.stdout + proc.stderr
    sent = SENT.search(log)
    if proc.returncode != 85 or sent is None:
        sys.exit(f"at a save's step: exit {proc.returncode}, signal stamp {bool(sent)}:\n{log[-3000:]}")
    if f"step {every} is already committed" not in log:
        sys.exit(f"at a save's step: the preemption did not commit step {every}'s write alone:\n{log[-3000:]}")
    return figures(log, exited - float(sent.group(1)))


def figures(log: str, exit_s: float) -> dict:
    """A preempted run's figures: signal to exit, and its own 'preemption ... committed at step N in Ns'."""
    save = re.search(r"preemption \(SIGUSR1\): checkpoint committed at step (\d+) in ([\d.]+)s", log)
    return {"exit_s": round(exit_s, 2), "save_s": float(save.group(2)), "step": int(save.group(1))}


def main() -> None:
    parser = bench_parser(__doc__, rounds=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--every", type=int, default=4)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="bench_preemption_"))
    folder = model(tmp / "model", args.hidden, args.layers)
    results: dict = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            out = tmp / "run"
            results[case].append(preempt(folder, out, args.every, case))
            print(json.dumps({"case": case, **results[case][-1]}), flush=True)
            shutil.rmtree(out)
    shutil.rmtree(tmp)
    exit_s = {case: statistics.median(r["exit_s"] for r in runs) for case, runs in results.items()}
    save_s = {case: statistics.median(r["save_s"] for r in runs) for case, runs in results.items()}
    ratio = exit_s["write in flight"] / exit_s["no write in flight"]
    for case in CASES:
        runs = ", ".join(f"{r['exit_s']}" for r in results[case])
        print(f"| {case} | {exit_s[case]:.2f} s ({runs}) | {save_s[case]:.2f} s |", flush=True)
    print(f"write in flight / no write in flight, signal to exit: **{ratio:.2f}x**", flush=True)
    at_save = exit_s["at a save's step"] / exit_s["no write in flight"]
    print(f"at a save's step / no write in flight, signal to exit: **{at_save:.2f}x**", flush=True)


if __name__ == "__main__":
    main()
