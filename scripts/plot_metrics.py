"""A PNG dashboard of a run from its metrics.jsonl: loss and eval loss, learning rate, gradient norm, throughput
(tokens/s and MFU), memory, where each step's time went, and the benchmark scores of --lm_eval_tasks.

    python scripts/plot_metrics.py runs/default            # writes runs/default/metrics.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from scaletrain.config.values import eval_loss_set
from scaletrain.observability.metrics import METRICS_FILE, read_records

LM_EVAL = "lm_eval/"  # --lm_eval_tasks: lm_eval/<task>/<metric>, and <metric>_stderr beside it
PHASES = ("data_wait", "forward", "backward", "pipeline", "optimizer", "sync", "checkpoint", "evaluation")


def load(run_dir: Path) -> tuple:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        sys.exit(f"plot_metrics.py: error: {path}: no such file (is {run_dir} a run folder?)")
    records, _ = read_records(path)  # a last line cut short (a run killed while writing it) left out
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if any(eval_loss_set(k) is not None for k in r)]
    scores = [r for r in records if any(k.startswith(LM_EVAL) for k in r)]
    if not train:
        sys.exit(f"plot_metrics.py: error: {path} holds no training records yet")
    return train, evals, scores


def plot(run_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals, scores = load(run_dir)
    fig = dashboard(train, evals, str(run_dir), scores)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def dashboard(train: list, evals: list, title: str, scores: list = ()):
    """The figure: loss, LR, gradient norm, tokens/s, MFU (its own panel: on a second axis of the tokens/s panel
    its curve, the same shape, hid the other), memory, step time by phase, and lm-eval's scores."""
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]

    def series(key):
        return [r.get(key, float("nan")) for r in train]

    fig, axes = plt.subplots(4, 2, figsize=(13, 14))
    ax = axes[0, 0]
    ax.plot(steps, series("loss"), label="train loss")
    # One line per evaluation set: eval_loss, or eval_<name>_loss for each named --validation_file set.
    for key in dict.fromkeys(k for r in evals for k in r if eval_loss_set(k) is not None):
        points = [(r["step"], r[key]) for r in evals if key in r]
        name = eval_loss_set(key)
        ax.plot(*zip(*points, strict=True), "o-", label=f"eval loss ({name})" if name else "eval loss")
    ax.set_title("loss")
    ax.legend()
    axes[0, 1].plot(steps, series("lr"))
    axes[0, 1].set_title("learning rate")
    axes[1, 0].plot(steps, series("grad_norm"))
    axes[1, 0].set_title("gradient norm")
    axes[1, 1].plot(steps, series("tokens_per_s"), label="tokens/s")
    axes[1, 1].set_title("throughput (tokens/s)")
    ax = axes[2, 0]
    for key, label, style in (("mfu", "MFU", "-"), ("hfu", "HFU (with recomputation)", "--")):  # equal without it
        if any(key in r for r in train):
            ax.plot(steps, [100 * m for m in series(key)], style, label=label)
    ax.set_title("model FLOPs utilisation (%)")
    if ax.lines:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no MFU: the device's peak is unknown", ha="center", va="center", transform=ax.transAxes)
    ax = axes[2, 1]
    for key in ("gpu_peak_gb", "gpu_allocated_gb", "cpu_rss_gb"):
        if any(key in r for r in train):
            ax.plot(steps, series(key), label=key)
    ax.set_title("memory (GiB)")
    ax.legend()
    ax = axes[3, 0]
    present = [p for p in PHASES if any(f"{p}_s" in r for r in train)]
    if present:
        ax.stackplot(steps, *[series(f"{p}_s") for p in present], labels=present)
    ax.plot(steps, series("step_time_s"), "k--", label="step time")
    ax.set_title("step time by phase (s)")
    ax.legend(loc="upper right", fontsize="small")
    benchmark_panel(axes[3, 1], scores)
    for a in axes.flat:
        a.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def benchmark_panel(ax, scores: list) -> None:
    """Each lm-eval metric against the step, with its stderr as error bars: scores in [0, 1] (accuracy, exact match)
    on the left axis, the others (perplexities, bits per byte) on a logarithmic right axis."""
    keys = dict.fromkeys(k for r in scores for k in r if k.startswith(LM_EVAL) and not k.endswith("_stderr"))
    if not keys:
        ax.text(0.5, 0.5, "no benchmark scores (--lm_eval_tasks)", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("benchmark scores (lm-eval)")
        return
    other = None
    for key in keys:
        points = [(r["step"], r[key], r.get(f"{key}_stderr", 0.0)) for r in scores if key in r]
        steps, values, errors = zip(*points, strict=True)
        fraction = all(0.0 <= v <= 1.0 for v in values)
        if not fraction and other is None:
            other = ax.twinx()
            other.set_yscale("log")
        target = ax if fraction else other
        target.errorbar(steps, values, yerr=errors, fmt="o-" if fraction else "s--", label=key.removeprefix(LM_EVAL))
    ax.set_title("benchmark scores (lm-eval)")
    handles = [h for a in (ax, other) if a is not None for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, fontsize="small")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="PNG to write (default: <run_dir>/metrics.png)")
    args = parser.parse_args(argv)
    out = plot(args.run_dir, args.out or args.run_dir / "metrics.png")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
