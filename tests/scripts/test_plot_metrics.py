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
