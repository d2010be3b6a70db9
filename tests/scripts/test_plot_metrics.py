"""scripts/plot_metrics.py's dashboard: each curve where it can be seen. MFU is tokens/s times a constant, so on a
second axis of the tokens/s panel its curve lay exactly over the other; it has a panel of its own."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from scripts.plot_metrics import dashboard  # noqa: E402


def test_tokens_per_second_and_mfu_are_on_panels_of_their_own():
    train = [
        {
            "step": s,
            "loss": 5.0 - s / 10,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 1000.0 + 10 * s,
            "mfu": (1000.0 + 10 * s) * 1e-5,
            "hfu": (1000.0 + 10 * s) * 1.3e-5,
            "step_time_s": 0.5,
            "forward_s": 0.2,
        }
        for s in range(1, 6)
    ]
    fig = dashboard(train, [{"step": 5, "eval_loss": 4.6}], "run")
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    throughput, mfu = panels["throughput (tokens/s)"], panels["model FLOPs utilisation (%)"]
    assert [line.get_label() for line in throughput.lines] == ["tokens/s"]
    assert [line.get_label() for line in mfu.lines] == ["MFU", "HFU (with recomputation)"]
    assert list(mfu.lines[0].get_ydata()) == [100 * r["mfu"] for r in train]
    overlaid = [ax for ax in fig.axes if ax is not throughput and ax.bbox.bounds == throughput.bbox.bounds]
    assert not overlaid, "no second axis drawn over the tokens/s panel"


def test_a_run_without_a_known_peak_says_why_its_mfu_panel_is_empty():
    train = [{"step": s, "loss": 5.0, "tokens_per_s": 1000.0, "step_time_s": 0.5} for s in range(1, 4)]
    fig = dashboard(train, [], "run")
    mfu = next(ax for ax in fig.axes if ax.get_title() == "model FLOPs utilisation (%)")
    assert not mfu.lines and "peak is unknown" in mfu.texts[0].get_text()


def test_benchmark_scores_are_plotted_against_steps_with_their_stderr():
    """--lm_eval_tasks' records: accuracies on the panel's own axis, a perplexity on a log axis of its own."""
    train = [{"step": s, "loss": 5.0, "tokens_per_s": 1000.0, "step_time_s": 0.5} for s in range(1, 5)]
    scores = [
        {"step": 2, "lm_eval/arc/acc": 0.25, "lm_eval/arc/acc_stderr": 0.05, "lm_eval/wiki/word_perplexity": 900.0},
        {"step": 4, "lm_eval/arc/acc": 0.35, "lm_eval/arc/acc_stderr": 0.04, "lm_eval/wiki/word_perplexity": 400.0},
    ]
    fig = dashboard(train, [], "run", scores)
    panel = next(ax for ax in fig.axes if ax.get_title() == "benchmark scores (lm-eval)")
    accuracy = next(line for line in panel.lines if list(line.get_ydata()) == [0.25, 0.35])
    assert list(accuracy.get_xdata()) == [2, 4]
    twin = [ax for ax in fig.axes if ax is not panel and ax.bbox.bounds == panel.bbox.bounds]
    assert len(twin) == 1 and twin[0].get_yscale() == "log"
    assert [list(line.get_ydata()) for line in twin[0].lines if len(line.get_ydata()) == 2] == [[900.0, 400.0]]
    labels = [text.get_text() for text in panel.get_legend().get_texts()]
    assert labels == ["arc/acc", "wiki/word_perplexity"]


def test_a_run_without_benchmark_scores_says_so():
    train = [{"step": s, "loss": 5.0, "tokens_per_s": 1000.0, "step_time_s": 0.5} for s in range(1, 4)]
    fig = dashboard(train, [], "run")
    panel = next(ax for ax in fig.axes if ax.get_title() == "benchmark scores (lm-eval)")
    assert not panel.lines and "--lm_eval_tasks" in panel.texts[0].get_text()
