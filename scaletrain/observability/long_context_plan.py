"""--plan's longest block: how many tokens one block can hold on the planned GPUs, with the long-context features.

For each set of features (activation checkpointing; + --tiled_mlp; + --activation_offloading) and for sequence
parallelism 1 and over every planned GPU (Ulysses, where the model's heads allow it), the longest block whose
working memory (memory_planner.activation_bytes, micro-batch 1) fits beside the model states of the leanest option
the layout runs (ZeRO-3 with CPU offload where it may: the states then take the least GPU memory) in 90% of a GPU.
Offloaded checkpoints take host memory instead: L x 2 x tokens per GPU x hidden x bytes, shown beside the length.

Attention is counted without a [T, T] term (FlashAttention or memory-efficient SDPA), the loss in chunks
(--loss_chunk_size auto). The figure is an estimate of the same kind as the plan's working memory.
"""

from __future__ import annotations

from scaletrain.observability.memory_planner import (
    GIB,
    HEADROOM,
    ModelShape,
    activation_bytes,
    model_state_bytes,
    offloaded_checkpoint_bytes,
    options_for,
)

FEATURE_SETS = (  # (name, tiled MLP, activation offloading), each with activation checkpointing
    ("checkpointing", False, False),
    ("+ tiled MLP", True, False),
    ("+ tiled MLP + activation offloading", True, True),
)
GRAIN = 1024  # blocks are reported in multiples of 1K tokens


def sequence_degrees(shape: ModelShape, ranks: int) -> list:
    """1 and the largest sequence-parallel degree up to `ranks` that Ulysses accepts for the model (it divides the
    ranks and the query heads, and divides or is a multiple of the KV heads)."""
    heads, kv = shape.heads, shape.kv_heads or shape.heads
    fitting = [n for n in range(2, ranks + 1) if ranks % n == 0 and heads % n == 0 and (kv % n == 0 or n % kv == 0)]
    return [1, *fitting[-1:]]


def longest_block(
    shape: ModelShape,
    gpus_per_node: int,
    nodes: int,
    precision: str,
    gpu_bytes: float,
    host_bytes: float | None,
    sp: int,
    loss_chunk: int | None,
    tiled_mlp: bool,
    offload: bool,
) -> tuple:
    """(tokens of the longest block, host bytes per GPU its offloaded checkpoints take, the option planned). With
    `host_bytes` (per node) the offloaded states and checkpoints of a node's GPUs must fit in 90% of it too."""
    ranks = gpus_per_node * nodes
    option = min(
        options_for(1, sp),
        key=lambda o: (o.offload_optimizer == "nvme", sum(model_state_bytes(o, shape, ranks, precision)[:3])),
    )
    params, grads, optimizer, host_states, _ = model_state_bytes(option, shape, ranks, precision)

    def offloaded(tokens: int) -> float:  # a GPU's checkpointed inputs in host memory
        return offloaded_checkpoint_bytes(shape, tokens / sp, precision) if offload else 0

    def fits(tokens: int) -> bool:
        working = activation_bytes(shape, 1, tokens, precision, option.stage, 1, sp, 1, loss_chunk, tiled_mlp, offload)
        on_host = (host_states + offloaded(tokens)) * gpus_per_node
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


def render_longest_blocks(
    shape: ModelShape,
    gpus_per_node: int,
    nodes: int,
    precision: str,
    gpu_bytes: float,
    host_bytes: float | None,
    loss_chunk: int | None,
) -> list:
    """The plan's lines for the longest block per feature set and sequence-parallel degree."""
    degrees = sequence_degrees(shape, gpus_per_node * nodes)
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
            tokens, host, option = longest_block(
                shape, gpus_per_node, nodes, precision, gpu_bytes, host_bytes, sp, loss_chunk, tiled, offload
            )
            option_names.add(option.name)
            cells.append(f"{tokens // GRAIN}K tokens" + (f" (host {host / GIB:.0f} GB)" if offload else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(f"(states: {'; '.join(sorted(option_names))}; flags: --gradient_checkpointing --tiled_mlp "
                 "--activation_offloading --sequence_parallel_size N)")  # fmt: skip
    return lines
