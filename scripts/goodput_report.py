"""Where a run's wall-clock time went, across its attempts: the goodput ledger (<run_dir>/goodput.json) as a table
and a PNG, for a finished run or one still running (or requeued by Slurm several times).

    python scripts/goodput_report.py runs/default        # prints the table, writes runs/default/goodput.png

The table: each category's seconds and share of the wall-clock time (they add up to it), then one line per attempt.
The PNG: one bar per attempt, split into its categories, and the gaps between attempts.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path


from scaletrain.observability.goodput import LEDGER_FILE, per_attempt, read_ledger, render_table

COLOURS = {
    "productive": "tab:green",
    "startup": "tab:gray",
    "data_wait": "tab:orange",
    "checkpoint": "tab:blue",
    "eval": "tab:purple",
    "lost_work": "tab:red",
    "between_attempts": "white",
    "other": "tab:brown",
}
# Left to right in each attempt's bar, roughly as they happen; the gaps between attempts stay empty.
DRAWN = ("startup", "productive", "lost_work", "data_wait", "checkpoint", "eval", "other")


def describe_attempts(ledger: dict) -> str:
    rows = []
    for index, attempt in enumerate(ledger["attempts"], 1):
        start = datetime.datetime.fromtimestamp(attempt["start"]).isoformat(timespec="seconds")
        code = "running or killed" if attempt["exit_code"] is None else f"exit {attempt['exit_code']}"
        rows.append(
            f"  attempt {index}: {start}, {attempt['end'] - attempt['start']:.0f} s, steps "
            f"{attempt['first_step']} -> {attempt['last_step']}, {code}"
        )
    return "\n".join(rows)


def plot(ledger: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attempts = ledger["attempts"]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.5 * len(attempts)))
    for index, attempt in enumerate(attempts):
        share = attempt_seconds(attempts, index)
        left = attempt["start"] - attempts[0]["start"]
        for name in DRAWN:
            if share[name] > 0:
                ax.barh(index, share[name], left=left, color=COLOURS[name], label=name, edgecolor="black", lw=0.3)
                left += share[name]
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_yticks(range(len(attempts)), [f"attempt {i + 1}" for i in range(len(attempts))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first attempt's start")
    ax.set_title(f"goodput {ledger['goodput']:.1%} of {ledger['wall_s']:.0f} s")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def attempt_seconds(attempts: list, index: int) -> dict:
    """Attempt `index`'s seconds by category, its lost work judged by the attempt after it (and the gap to it)."""
    return per_attempt(attempts)[index]["seconds"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="PNG to write (default: <run_dir>/goodput.png)")
    args = parser.parse_args(argv)
    ledger = read_ledger(args.run_dir)
    if ledger is None:
        print(
            f"goodput_report.py: error: {args.run_dir / LEDGER_FILE}: no such file (a run folder whose training "
            "has started holds one)",
            file=sys.stderr,
        )
        return 2
    print(render_table(ledger))
    print(describe_attempts(ledger))
    print(f"wrote {plot(ledger, args.out or args.run_dir / 'goodput.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
