"""The time model calibrated on this CPU: one 1-rank run of the benchmark model (256-token blocks, micro-batch 4)
calibrates --plan's rates (its steps' phases and its probe: a micro-batch's fixed cost, attention's rate), which then
predict runs of other block sizes and micro-batches; each run is measured (median step time of its steady steps)
beside its prediction, and beside the prediction of the same calibration without its probe.

    python scripts/bench/time_model_calibration.py    # Markdown rows for BENCHMARKS.md
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from scripts.bench.common import bench_model, bench_parser, launch

REPO = Path(__file__).resolve().parents[2]

SHAPES = ((256, 4), (128, 8), (64, 16), (256, 8), (256, 2), (128, 2), (64, 4))


def main() -> None:
    args = bench_parser(__doc__, steps=16).parse_args()
    from transformers import AutoConfig

    from scaletrain.model import meta_model
    from dataclasses import replace

    from scaletrain.observability.calibration import calibrate, calibrated_gpu, describe_calibration, read_calibration
    from scaletrain.observability.memory_planner import ModelShape
    from scaletrain.observability.time_model import Cluster, predict_step

    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model(Path(tmp) / "model")
        runs = {}
        for block, micro in SHAPES:
            out = Path(tmp) / f"run_{block}x{micro}"
            launch("train.py", [
                "--config", "ds_configs/zero2.json", "--config_name", str(model), "--tokenizer_name", str(model),
                "--output_dir", str(out), "--max_steps", str(args.steps), "--block_size", str(block),
                "--per_device_train_batch_size", str(micro), "--validation_split_percentage", "0", "--disable_tqdm",
                "--logging_steps", "1", "--save_steps", "0", "--peak_tflops", "0.2",
            ], 1)  # fmt: skip
            runs[block, micro] = read_calibration(out)
        config = AutoConfig.from_pretrained(model)
        shape = ModelShape.from_meta_model(meta_model(config, False), config)
        reference = runs[SHAPES[0]]
        cluster = calibrate(Cluster(1, 1, calibrated_gpu(reference, 24)), reference, shape)
        unprobed = replace(reference, micro_batch_fixed_s=None, attention_tflops=None)
        without = calibrate(Cluster(1, 1, calibrated_gpu(unprobed, 24)), unprobed, shape)
        print(describe_calibration(reference, cluster))
        print()
        print("| block x micro-batch | tokens a micro-batch | measured s/step | predicted | predicted / measured | "
              "without the probe |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for (block, micro), run in runs.items():
            predicted = predict_step(
                shape, seq_len=block, layout=run.layout, cluster=cluster, precision="fp32"
            ).step_time
            plain = predict_step(shape, seq_len=block, layout=run.layout, cluster=without, precision="fp32").step_time
            label = f"{block} x {micro}" + (" (calibration)" if run is reference else "")
            print(f"| {label} | {block * micro} | {run.phases['step']:.3f} | {predicted:.3f} | "
                  f"{predicted / run.phases['step']:.2f} | {plain / run.phases['step']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
