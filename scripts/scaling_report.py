"""Scaling report: the same short job at several world sizes, as a Markdown table and a PNG.

For each world size the job keeps the per-rank batch (weak scaling, as data parallelism is used), runs with the
deepspeed launcher, and reads the steady-state figures from its metrics.jsonl: tokens/s per rank, scaling
efficiency (per-rank throughput against the smallest world size), and the step-time phases, so that the phase
that grew with the world size is named. Beside the measurements, the time model of `--plan` (calibrated by the
smallest world size's run, scaletrain/observability/calibration.py) predicts each size, term by term, and the report
names the phase whose share of the step grew and its likely fix.

    python scripts/scaling_report.py                          # world sizes 1 and 2, zero2, the tiny model
    python scripts/scaling_report.py --world_sizes 8,16,32 --launcher_args "--hostfile hosts" -- --model_name_or_path X

Flags after `--` go to train.py. Writes <out>/scaling.md and <out>/scaling.png.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from scaletrain.observability.metrics import METRICS_FILE, read_records
from scripts.launching import Launcher

REPO = Path(__file__).resolve().parents[1]

PHASES = ("data_wait", "forward", "backward", "pipeline", "optimizer", "sync", "checkpoint")


def run_job(world: int, out: Path, steps: int, launcher_args: str, extra: list) -> dict:
    run_dir = out / f"world{world}"
    launcher = Launcher("deepspeed", world, pick_port=False, launcher_args=tuple(shlex.split(launcher_args)))
    flags = [
        "--config",
        str(REPO / "ds_configs/zero2.json"),
        "--output_dir",
        str(run_dir),
        "--max_steps",
        str(steps),
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "--resume_from_checkpoint",
        "none",
        "--overwrite_output_dir",
        *extra,
    ]
    cmd = launcher.command(REPO / "train.py", flags)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        sys.exit(f"world size {world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records, _ = read_records(run_dir / METRICS_FILE)
    steady = [r for r in records if "loss" in r][steps // 4 :]  # skip the warm-up quarter
    mean = lambda key: sum(r.get(key, 0.0) for r in steady) / len(steady)  # noqa: E731
    return {
        "world": world,
        "tokens_per_s": mean("tokens_per_s"),
        "step_time_s": mean("step_time_s"),
        **{p: mean(f"{p}_s") for p in PHASES},
        "straggler_ratio": mean("straggler_ratio"),
    }


# The measured phase whose share grew -> its likely fix.
PHASE_FIXES = {
    "data_wait": "more data workers (--dataloader_num_workers) or a faster disk for the token store",
    "forward": "compute-bound forward; under ZeRO-3 its parameter gathers: a larger micro-batch, ZeRO-1/2, or "
    "hierarchical/quantized ZeRO-3 communication",
    "backward": "the gradient reduction inside the backward: a larger micro-batch or accumulation (fewer reductions "
    "per token), TP kept inside a node",
    "pipeline": "more micro-batches per step or fewer pipeline stages",
    "optimizer": "more data-parallel ranks to partition the optimizer (ZeRO-1+), or less offload",
    "sync": "the data-parallel reduction at the step's end: a larger accumulation, ZeRO-2's overlap_comm",
    "checkpoint": "--async_save, or fewer saves",
}


def predictions(results: list, out: Path) -> list:
    """The time model's step for each world size, calibrated by the smallest one's run (its model, layout, phases)."""
    from dataclasses import replace

    from transformers import AutoConfig

    from scaletrain.model import meta_model
    from scaletrain.observability.calibration import calibrate, calibrated_gpu, read_calibration
    from scaletrain.observability.memory_planner import ModelShape
    from scaletrain.observability.time_model import Cluster, predict_step
    from scaletrain.parts import ParallelLayout

    first = out / f"world{results[0]['world']}"
    calibration = read_calibration(first)
    config = AutoConfig.from_pretrained(first)
    shape = ModelShape.from_meta_model(meta_model(config, False), config)
    predicted = []
    for r in results:
        world = r["world"]
        sizes = calibration.layout.parallel
        layout = replace(calibration.layout, parallel=ParallelLayout.of_world(world, sizes.tp, sizes.sp, sizes.pp))
        cluster = calibrate(Cluster(1, calibration.world, calibrated_gpu(calibration, 24)), calibration, shape)
        cluster = replace(cluster, gpus_per_node=world)
        predicted.append(
            predict_step(
                shape, seq_len=calibration.block_size, layout=layout, cluster=cluster, precision=calibration.precision
            )
        )
    return predicted


def beside_prediction(results: list, predicted: list) -> list:
    """Measured step and phases beside the prediction and its terms, and the phase whose share grew most."""
    lines = [
        "",
        "| world size | measured step (s) | predicted step (s) | predicted compute | predicted DP/ZeRO comm | "
        "predicted optimizer | predicted other |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, p in zip(results, predicted, strict=True):
        t = p.terms
        lines.append(
            f"| {r['world']} | {r['step_time_s']:.3f} | {p.step_time:.3f} | {t['compute']:.3f} | "
            f"{t['data_parallel']:.3f} | {t['optimizer']:.3f} | {t['overhead']:.3f} |"
        )
    base, last = results[0], results[-1]
    if last is not base:
        share = {ph: last[ph] / last["step_time_s"] - base[ph] / base["step_time_s"] for ph in PHASES}
        grew = max(share, key=share.get)
        lines.append(
            f"\nphase whose share grew most ({base['world']} -> {last['world']} ranks): {grew} "
            f"({base[grew] / base['step_time_s']:.0%} -> {last[grew] / last['step_time_s']:.0%} of the step); "
            f"likely fix: {PHASE_FIXES[grew]}"
        )
    return lines


def report(results: list, out: Path) -> str:
    base = results[0]
    base_per_rank = base["tokens_per_s"] / base["world"]
    lines = [
        "| world size | tokens/s | tokens/s per rank | scaling efficiency | step time (s) | "
        + " | ".join(f"{p} (s)" for p in PHASES)
        + " | grew most vs smallest |",
        "|" + "---|" * (6 + len(PHASES)),
    ]
    for r in results:
        per_rank = r["tokens_per_s"] / r["world"]
        growth = {p: r[p] - base[p] for p in PHASES}
        grew = max(growth, key=growth.get) if r is not base else "-"
        grew_text = f"{grew} (+{growth[grew]:.3f}s)" if r is not base else "-"
        lines.append(
            f"| {r['world']} | {r['tokens_per_s']:.0f} | {per_rank:.0f} | {per_rank / base_per_rank:.2f} | "
            f"{r['step_time_s']:.3f} | " + " | ".join(f"{r[p]:.3f}" for p in PHASES) + f" | {grew_text} |"
        )
    lines += beside_prediction(results, predictions(results, out))
    table = "\n".join(lines) + "\n"
    (out / "scaling.md").write_text(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = [r["world"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(worlds, [r["tokens_per_s"] / r["world"] for r in results], "o-", label="tokens/s per rank")
    left.plot(worlds, [base_per_rank] * len(worlds), "k--", label="perfect scaling")
    left.set_xlabel("world size")
    left.set_title("throughput per rank")
    left.legend()
    bottom = [0.0] * len(results)
    for p in PHASES:
        values = [r[p] for r in results]
        right.bar([str(w) for w in worlds], values, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_xlabel("world size")
    right.set_title("step time by phase (s)")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=90)
    plt.close(fig)
    return table


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world_sizes", default="1,2")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None, help="folder for scaling.md/png (default: a temp folder)")
    parser.add_argument("--launcher_args", default="", help="extra deepspeed launcher flags (hostfile, ...)")
    args = parser.parse_args(own)
    out = args.out or Path(tempfile.mkdtemp(prefix="scaling_"))
    out.mkdir(parents=True, exist_ok=True)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    results = [run_job(w, out, args.steps, args.launcher_args, extra) for w in worlds]
    print(report(results, out))
    print(f"wrote {out / 'scaling.md'} and {out / 'scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
