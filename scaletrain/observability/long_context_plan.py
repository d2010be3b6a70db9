"""--plan's longest block: for each set of long-context features, at sequence parallelism 1 and at the largest degree
Ulysses accepts on the planned GPUs, the longest block of micro-batch 1 whose working memory
(memory_planner.activation_bytes) fits in 90% of a GPU beside the model states of the leanest option that layout runs,
and, given the host memory, whose offloaded states and checkpoints fit in 90% of it. An estimate of the same kind as
the plan's working memory (docs/parallelism.md#memory-planner)."""

from __future__ import annotations

from dataclasses import replace

from scaletrain.observability.memory_planner import (
    GIB,
    HEADROOM,
    MemoryFeatures,
    ModelShape,
    PlannedRun,
    activation_bytes,
    model_state_bytes,
    offloaded_checkpoint_bytes,
    options_for,
    with_model_parallel,
)
from scaletrain.parts import ulysses_split_problem

FEATURE_SETS = (  # (name, tiled MLP, activation offloading), each with activation checkpointing
    ("checkpointing", False, False),
    ("+ tiled MLP", True, False),
    ("+ tiled MLP + activation offloading", True, True),
)
GRAIN = 1024  # blocks are reported in multiples of 1K tokens


def ulysses_degrees(shape: ModelShape, ranks: int) -> list:
    """1 and every sequence-parallel degree up to `ranks` that Ulysses accepts for the model: it divides the ranks
    and splits the heads (parts.ulysses_split_problem; a model of unknown heads: 1 only)."""
    heads, kv = shape.heads, shape.kv_heads or shape.heads
    if not heads:
        return [1]
    return [1] + [n for n in range(2, ranks + 1) if ranks % n == 0 and ulysses_split_problem(heads, kv, n) is None]


def sequence_degrees(shape: ModelShape, ranks: int) -> list:
    """1 and the largest sequence-parallel degree up to `ranks` that Ulysses accepts for the model."""
    return [1, *ulysses_degrees(shape, ranks)[1:][-1:]]


def longest_block(shape: ModelShape, run: PlannedRun, gpu_bytes: float, host_bytes: float | None) -> tuple:
    """(tokens of the longest block, host bytes per GPU its offloaded checkpoints take, the option planned) for
    `run`'s GPUs, precision, sequence parallelism, loss chunk and features, at micro-batch 1 without tensor or pipeline
    parallelism. With `host_bytes` (per node) the offloaded states and checkpoints of a node's GPUs must fit in 90% of
    it too."""
    run = replace(with_model_parallel(run, sp=run.parallel.sp), micro_batch=1)
    sp, precision, offload = run.parallel.sp, run.precision, run.features.offload
    option = min(
        options_for(1, sp),
        key=lambda o: (
            o.offload_optimizer == "nvme",
            sum(model_state_bytes(o, shape=shape, dp=run.ranks, precision=precision)[:3]),
        ),
    )
    params, grads, optimizer, host_states, _ = model_state_bytes(option, shape=shape, dp=run.ranks, precision=precision)

    def offloaded(tokens: int) -> float:  # a GPU's checkpointed inputs in host memory
        return offloaded_checkpoint_bytes(shape, tokens / sp, precision) if offload else 0

    def fits(tokens: int) -> bool:
        working = activation_bytes(shape, replace(run, block_size=tokens), option.stage)
        on_host = (host_states + offloaded(tokens)) * run.gpus_per_node
        return params + grads + optimizer + working[1] <= HEADROOM * gpu_bytes and (
            host_bytes is None or on_host <= HEADROOM * host_bytes
        )

    low, high = 0, GRAIN
    while fits(high) and high < 2**40:
        low, high = high, high * 2
    while high - low > GRAIN:
        middle = (low + high) // 2 // GRAIN * GRAIN
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, offloaded(low), option


def render_longest_blocks(shape: ModelShape, run: PlannedRun, gpu_bytes: float, host_bytes: float | None) -> list:
    """The plan's lines for the longest block per feature set and sequence-parallel degree over `run`'s GPUs."""
    degrees = sequence_degrees(shape, run.ranks)
    lines = [
        "longest block (micro-batch 1, activation checkpointing, the leanest ZeRO option of each layout"
        + (", within the host memory" if host_bytes else "")
        + "; host: offloaded checkpoints per GPU):",
        "| features | " + " | ".join(f"sequence parallel {n}" for n in degrees) + " |",
        "|---|" + "---|" * len(degrees),
    ]
    option_names = set()
    for name, tiled, offload in FEATURE_SETS:
        cells = []
        for sp in degrees:
            features = MemoryFeatures(tiled_mlp=tiled, offload=offload)
            tokens, host, option = longest_block(
                shape, replace(with_model_parallel(run, sp=sp), features=features), gpu_bytes, host_bytes
            )
            option_names.add(option.name)
            cells.append(f"{tokens // GRAIN}K tokens" + (f" (host {host / GIB:.0f} GB)" if offload else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"(states: {'; '.join(sorted(option_names))}; flags: --gradient_checkpointing --tiled_mlp "
                 "--activation_offloading --sequence_parallel_size N)")  # fmt: skip
    return lines
