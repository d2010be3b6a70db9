"""train.py alone under variants of ds_configs/zero2.json: which DeepSpeed setting moves steady tokens/s.

2 ranks (deepspeed launcher), the 5.0M-parameter Llama of scripts/bench/overhead.py, 4 x 256 tokens per rank per step,
60 steps, fp32; steady tokens/s from the end of step 10 (metrics.jsonl stamps); variants alternate, --rounds times.

    python scripts/bench/zero2_ablation.py [--variants default,bucket_model,...] [--rounds 2]

Variants: default, unfused, no_overlap, allreduce, bucket5e8, bucket_model, reduce_per_rank (VARIANTS below).
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
from pathlib import Path

from scripts.bench.common import bench_model, bench_parser, median_runs, train_args, train_rate

REPO = Path(__file__).resolve().parents[2]

VARIANTS = {  # (zero_optimization changes, optimizer.params changes)
    "default": ({}, {}),
    "unfused": ({}, {"foreach": False}),  # torch's per-tensor AdamW loop instead of the fused kernel
    "no_overlap": ({"overlap_comm": False}, {}),
    "allreduce": ({"reduce_scatter": False}, {}),
    "bucket5e8": ({"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000}, {}),
    # one bucket: 5M elements hold all 4,999,424 parameters of bench_model (a larger model needs a larger figure)
    "bucket_model": ({"reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000}, {}),
    # each rank's gradient partition reduced to it alone (one reduce per destination) instead of the whole bucket
    # all-reduced and every rank keeping its slice: half the bytes, one collective per rank and bucket
    "reduce_per_rank": ({"use_multi_rank_bucket_allreduce": False}, {}),
}
STEPS, WARMUP, BATCH, BLOCK, RANKS = 60, 10, 4, 256, 2


def main() -> None:
    parser = bench_parser(__doc__, rounds=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    names = args.variants.split(",")
    base = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    rates = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = bench_model(tmp / "model")
        for round_ in range(args.rounds):
            for name in names:
                zero, optimizer = VARIANTS[name]
                config = copy.deepcopy(base)
                config["zero_optimization"].update(zero)
                config["optimizer"]["params"].update(optimizer)
                path = tmp / f"{name}.json"
                path.write_text(json.dumps(config))
                run = tmp / f"{name}{round_}"
                flags = train_args(path, model, run, STEPS, BLOCK, BATCH, "--no-export_hf_at_end", "--no-save_at_end")
                rate, records = train_rate(flags, RANKS, RANKS * BATCH * BLOCK, WARMUP)
                rates[name].append(rate)
                print(
                    f"round {round_}: {name}: {rate:.0f} tokens/s (forward {records[-1]['forward_s']:.3f} s, "
                    f"backward {records[-1]['backward_s']:.3f} s, optimizer {records[-1]['optimizer_s']:.3f} s)",
                    flush=True,
                )
    default = statistics.median(rates.get("default") or rates[names[0]])
    for name in names:
        print(f"| {name} | {median_runs(rates[name])} | {statistics.median(rates[name]) / default:.2f} |")


if __name__ == "__main__":
    main()
