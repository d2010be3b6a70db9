"""The time model (--plan) against published large training runs: each run's shape, GPUs, links, layout and batch as
its paper gives them, its measured iteration time, and the model's prediction. Nothing here is fitted: the model's
constants are scaletrain/observability/time_model.py's published hardware facts.

    python scripts/bench/time_model_published.py    # the Markdown table for BENCHMARKS.md

Where a paper reports per-GPU TFLOP/s rather than seconds, the iteration time follows from its own FLOP count
(Megatron-LM's eq. 3, activation recomputation included, for Megatron, MT-NLG and BLOOM; 6 N + 6 L h s per token
for Llama 3), as the paper derived the TFLOP/s from the time. tests/observability/test_time_model.py fails if a
prediction drifts past 25%.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import GPUS
from scaletrain.observability.memory_planner import ModelShape
from scaletrain.observability.time_model import Cluster, Layout, dense_shape, predict_step
from scaletrain.parts import ParallelLayout

REPO = Path(__file__).resolve().parents[2]

TOLERANCE = 0.25


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    shape: ModelShape
    seq_len: int
    cluster: Cluster
    layout: Layout
    measured_step_s: float
    note: str = ""

    def predicted_step_s(self) -> float:
        return predict_step(self.shape, seq_len=self.seq_len, layout=self.layout, cluster=self.cluster).step_time


def megatron_step_s(batch: int, seq: int, layers: int, hidden: int, vocab: int, gpus: int, tflops: float) -> float:
    """Megatron-LM eq. 3 (96 B s l h^2 (1 + s/6h + V/16lh) FLOPs an iteration, recomputation included) over the
    reported per-GPU TFLOP/s: the iteration time the paper measured."""
    flops = 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return flops / (gpus * tflops * 1e12)


def _megatron_2021() -> list[PublishedRun]:
    """Narayanan et al. 2021 (SC'21), Table 1: GPT models on Selene (DGX A100 80GB, 8 x 200 Gb/s HDR a node),
    sequence 2048, vocabulary 51200, micro-batch 1, full recomputation, fp16, unfused softmax attention (2021),
    fp32 gradient all-reduce at the end of the step."""
    rows = [  # (parameters, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU)
        ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
        ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
        ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
        ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
        ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    ]
    runs = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, tflops in rows:
        dp = gpus // (tp * pp)
        runs.append(
            PublishedRun(
                f"Megatron-LM GPT {size}, {gpus} A100",
                "Narayanan et al. 2021, Table 1",
                dense_shape(layers, hidden, heads, 51200),
                2048,
                Cluster(gpus // 8, 8, GPUS["a100-80gb"], 1600),
                Layout(
                    ParallelLayout(tp=tp, pp=pp, dp=dp),
                    zero_stage=0,
                    micro_batch=1,
                    grad_accum=batch // dp,
                    checkpointing=True,
                    flash_attention=False,
                    grad_reduce_bytes=4,
                ),  # fmt: skip
                megatron_step_s(batch, 2048, layers, hidden, 51200, gpus, tflops),
                f"TP {tp} x PP {pp} x DP {dp}, batch {batch}; {tflops} TFLOP/s a GPU",
            )
        )
    return runs


def _mt_nlg() -> list[PublishedRun]:
    """Smith et al. 2022 (MT-NLG 530B), the scaling table: Megatron TP 8 x DeepSpeed's pipeline 35 x ZeRO-1 data
    parallelism on DGX A100 80GB (8 x 200 Gb/s HDR), batch 1920 of 2048 tokens at every size (fixed global batch),
    micro-batch 1, recomputation."""
    runs = []
    for nodes, seconds in ((280, 60.1), (350, 50.2), (420, 44.4)):
        gpus = nodes * 8
        dp = gpus // 280
        runs.append(
            PublishedRun(
                f"MT-NLG 530B, {gpus} A100",
                "Smith et al. 2022, §3 (iteration time by node count)",
                dense_shape(105, 20480, 128, 51200),
                2048,
                Cluster(nodes, 8, GPUS["a100-80gb"], 1600),
                Layout(
                    ParallelLayout(tp=8, pp=35, dp=dp),
                    zero_stage=1,
                    micro_batch=1,
                    grad_accum=1920 // dp,
                    checkpointing=True,
                    flash_attention=False,
                    grad_reduce_bytes=4,
                ),  # fmt: skip
                seconds,
                f"TP 8 x PP 35 x DP {dp}, batch 1920",
            )
        )
    return runs


def _bloom() -> PublishedRun:
    """BigScience BLOOM-176B (Le Scao et al. 2022, §3.4): 384 A100 80GB on Jean Zay (48 nodes, 4 x 100 Gb/s
    Omni-Path a node), TP 4 x PP 12 x DP 8, ZeRO-1, batch 2048 x 2048, micro-batch 2, bf16, recomputation, about
    150 TFLOP/s a GPU (Megatron-DeepSpeed's count)."""
    return PublishedRun(
        "BLOOM 176B, 384 A100",
        "Le Scao et al. 2022, §3.4; bigscience tr11-176B-ml logs",
        dense_shape(70, 14336, 112, 250880, style="gpt-tied"),
        2048,
        Cluster(48, 8, GPUS["a100-80gb"], 400),
        Layout(
            ParallelLayout(tp=4, pp=12, dp=8),
            zero_stage=1,
            micro_batch=2,
            grad_accum=128,
            checkpointing=True,
            flash_attention=False,
        ),  # fmt: skip
        megatron_step_s(2048, 2048, 70, 14336, 250880, 384, 150),
        "TP 4 x PP 12 x DP 8, batch 2048; 150 TFLOP/s a GPU",
    )


def _llama3() -> list[PublishedRun]:
    """Llama 3 405B (Dubey et al. 2024, Table 4): H100 80GB, 8 a node (NVLink), 400 Gb/s RoCE a GPU (3200 a node),
    TP 8 x PP 16 x DP, 8192-token sequences, 16M tokens a batch, bf16, interleaved 1F1B (the virtual-stage count is
    not published: 4 assumed, two layers a chunk), no full recomputation."""
    shape = dense_shape(126, 16384, 128, 128256, intermediate=53248, kv_heads=8, style="llama")
    runs = []
    for gpus, dp, per_replica, tflops in ((8192, 64, 32, 430), (16384, 128, 16, 400)):
        tokens = dp * per_replica * 8192
        seconds = tokens * (6 * shape.linear_params + 6 * 126 * 16384 * 8192) / (gpus * tflops * 1e12)
        runs.append(
            PublishedRun(
                f"Llama 3 405B, {gpus} H100",
                "Dubey et al. 2024, Table 4",
                shape,
                8192,
                Cluster(gpus // 8, 8, GPUS["h100-sxm"], 3200),
                Layout(
                    ParallelLayout(tp=8, pp=16, dp=dp),
                    zero_stage=1,
                    micro_batch=1,
                    grad_accum=per_replica,
                    virtual_stages=4,
                ),  # fmt: skip
                seconds,
                f"TP 8 x PP 16 x DP {dp}, 16M tokens; {tflops} TFLOP/s a GPU; virtual stages assumed",
            )
        )
    return runs


def published_runs() -> list[PublishedRun]:
    return [*_megatron_2021(), *_mt_nlg(), _bloom(), *_llama3()]


def markdown() -> str:
    lines = [
        "| run | source | layout | measured s/iteration | predicted | predicted / measured |",
        "|---|---|---|---|---|---|",
    ]
    for run in published_runs():
        predicted = run.predicted_step_s()
        lines.append(
            f"| {run.name} | {run.source} | {run.note} | {run.measured_step_s:.1f} | {predicted:.1f} | "
            f"{predicted / run.measured_step_s:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
