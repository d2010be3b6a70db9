"""Time model (--plan): the predicted step time of a layout on a cluster, split into its terms, from first principles
and published hardware facts, never fitted to the runs it is checked on. The formulas and their sources are in
docs/parallelism.md#time-model; in short, per pipeline stage and micro-batch of b sequences of s tokens:

    matrix products   2 x N_stage/T x b s/S FLOPs forward, twice that backward, once more when checkpointing recomputes
                      (Megatron-LM, Narayanan et al. 2021, eq. 3), at the GPU's peak x its achievable-matmul fraction
    attention         2 x b s^2 x h x L_stage / (T S) FLOPs forward (causal half of QK^T and AV), the same x 2 backward,
                      at the peak x FlashAttention's published fraction (Dao 2023; Shah et al. 2024); unfused attention
                      (runs before FlashAttention) computes the whole square and moves the b x heads x s^2 scores
                      through memory 6 times forward
    element-wise      24 x b s/S x h x bytes per layer forward (norms, residuals, activation, dropout), 2 x backward,
                      at the GPU's memory bandwidth (these kernels are memory-bound)
    tensor parallel   4 all-reduces of b s/S x h values per layer (2 forward, 2 backward, +2 when recomputing), each
                      2 (T-1)/T x bytes / bus bandwidth (NCCL's bus bandwidth, nccl-tests' PERFORMANCE.md)
    sequence parallel Ulysses' 4 all-to-alls per layer forward and backward (+4 recomputing), (S-1)/S x bytes each
    pipeline          DeepSpeed's 1F1B: (m + P - 1) slots of one micro-batch's forward and backward per step, m the
                      micro-batches; the bubble is the (P - 1) slots, (P - 1) / m of the work (Megatron-LM eq. 1);
                      every slot sends one activation forward and one gradient back (b s/S x h values)
    data parallel     ZeRO-0/1/2: a reduce-scatter and an all-gather of the gradients per step, 2 (D-1)/D x bytes
                      (ZeRO, Rajbhandari et al. 2020, §7); ZeRO-2 overlaps the reduction with the last backward;
                      ZeRO-3 gathers the parameters twice and reduce-scatters the gradients each micro-batch, 3 (D-1)/D
                      x bytes, overlapped with that micro-batch's compute (prefetch) and exposed beyond it
    fixed cost        a --plan_calibration run's measured time of a micro-batch that does not grow with its tokens
                      (operator dispatch, kernel launches, DeepSpeed's gradient hooks), per layer of the stage, once
                      more per recomputed forward; 0 on a datasheet GPU, where large micro-batches hide it
    optimizer         Adam reads and writes 30 bytes per parameter of the rank's partition at the memory bandwidth;
                      with CPU offload the gradients and updated weights cross PCIe and CPU-Adam runs on the host

A group's bus bandwidth is its slowest link: NVLink inside a node; across nodes the node's network (--inter_node_gbps)
shared by its GPUs, each group getting its GPUs' share. Efficiencies are published measurements, listed with GPUS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scaletrain.config import GPU
from scaletrain.observability.flops import ModelFlops
from scaletrain.observability.memory_planner import ModelShape, zero_ranks
from scaletrain.parts import ParallelLayout

ELEMENTWISE_VALUES = 24  # values read and written per token per layer forward by the memory-bound kernels
SCORE_PASSES = 6  # unfused attention forward: QK^T writes the scores, softmax reads and writes, dropout too, AV reads
ADAM_BYTES = 30  # fp32 weight, m, v and gradient read (16), weight, m and v written (12), the 16-bit copy (2)
NVLINK_EFFICIENCY = 0.80  # nccl-tests all_reduce_perf busbw on DGX A100/H100: ~235 of 300, ~360 of 450 GB/s
NETWORK_EFFICIENCY = 0.90  # nccl-tests across DGX nodes over InfiniBand: ~185-190 of 200 GB/s per node (8x HDR)
NVLINK_LATENCY_S = 10e-6  # a small collective inside a node (nccl-tests, 8 GPUs on NVSwitch: ~10-20 us)
NETWORK_LATENCY_S = 30e-6  # a small collective across nodes over InfiniBand (nccl-tests: ~20-50 us)
NETWORK_HOP_LATENCY_S = 5e-6  # each step of a ring across nodes (NCCL's tuning model, src/graph/tuning.cc: a few us)
DP_BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size: one reduce-scatter per bucket
PCIE_GBS = 25.0  # PCIe gen4 x16 host<->GPU copies achieve ~25 of 32 GB/s (pinned memory)
HOST_ADAM_PARAMS_PER_S = 1.0e9  # CPU-Adam per node, order of magnitude (ZeRO-Offload, Ren et al. 2021, §4.1)


@dataclass(frozen=True)
class Cluster:
    """The machines a plan is for: nodes x GPUs per node, the GPU, and the links between them."""

    nodes: int
    gpus_per_node: int
    gpu: GPU
    inter_node_gbps: float = 1600.0  # the node's network, Gbit/s (8 x 200 Gb/s HDR InfiniBand)
    peak_tflops: float | None = None  # overrides the GPU's (--gpu_peak_tflops)
    intra_node_gbs: float | None = None  # overrides the GPU's NVLink GB/s (--intra_node_gbps)
    matmul_efficiency: float | None = None  # measured (calibration, gpu_check.sh) instead of the published fraction
    # measured (a calibration run's attention probe) instead of the published fraction; compute_scale leaves it alone
    attention_efficiency: float | None = None
    compute_scale: float = 1.0  # measured compute over the FLOP model's (--plan_calibration)
    optimizer_scale: float = 1.0  # measured optimizer step over the model's
    step_overhead_s: float = 0.0  # measured per-step time outside compute and optimizer (data, synchronisation)
    # measured fixed time of one micro-batch's forward and backward per decoder layer, recomputation not included
    micro_batch_fixed_s_per_layer: float = 0.0

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node", "inter_node_gbps", "peak_tflops", "intra_node_gbs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} {value}: must be positive")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def peak_flops(self) -> float:
        return (self.peak_tflops or self.gpu.peak_tflops) * 1e12

    @property
    def matmul_flops(self) -> float:
        """FLOP/s the matrix products reach."""
        return self.peak_flops * (self.matmul_efficiency or self.gpu.matmul_efficiency)

    @property
    def attention_flops(self) -> float:
        return self.peak_flops * (self.attention_efficiency or self.gpu.attention_efficiency)

    def bus_bandwidth(self, group_size: int, stride: int = 1) -> float:
        """Bytes/s of bus bandwidth (NCCL's definition) of a collective over `group_size` ranks whose neighbours are
        `stride` ranks apart (ranks fill a node first). Inside one node: NVLink. Across nodes: the node's network
        shared by its GPUs, of which this group uses min(group, GPUs per node / stride) per node, each with its
        share; NCCL's rings cross every node boundary with them at once."""
        nvlink = (self.intra_node_gbs or self.gpu.nvlink_gbs) * 1e9 * NVLINK_EFFICIENCY
        if group_size <= 1:
            return float("inf")
        if group_size * stride <= self.gpus_per_node:
            return nvlink
        per_node = max(1, min(group_size, self.gpus_per_node // stride))
        network = self.inter_node_gbps / 8 * 1e9 * NETWORK_EFFICIENCY / self.gpus_per_node * per_node
        return min(nvlink, network)

    def latency(self, group_size: int, stride: int = 1) -> float:
        """Seconds a collective over the group takes whatever its volume: NCCL's small-message latency, and across
        nodes one network hop for each of a ring's group - 1 steps (all-gathers and reduce-scatters run as rings, so
        ZeRO-3 over thousands of ranks pays milliseconds a gather)."""
        if group_size <= 1:
            return 0.0
        if group_size * stride <= self.gpus_per_node:
            return NVLINK_LATENCY_S
        return NETWORK_LATENCY_S + (group_size - 1) * NETWORK_HOP_LATENCY_S

    def collective(self, volume: float, count: float, group_size: int, stride: int = 1) -> float:
        """Seconds for `count` collectives moving `volume` bytes in all over the group (bandwidth + latency)."""
        if group_size <= 1:
            return 0.0
        return volume / self.bus_bandwidth(group_size, stride) + count * self.latency(group_size, stride)


@dataclass(frozen=True)
class Layout:
    """One way to run the job: its parallel layout with a ZeRO option, batch split and activation checkpointing."""

    parallel: ParallelLayout = ParallelLayout()
    zero_stage: int = 1
    offload_optimizer: str = "none"  # "none", "cpu", "nvme"
    offload_params: str = "none"
    micro_batch: int = 1
    grad_accum: int = 1
    checkpointing: bool = False
    virtual_stages: int = 1  # interleaved 1F1B (Megatron-LM); DeepSpeed's pipeline runs 1
    flash_attention: bool = True  # fused attention (FlashAttention, SDPA); False: the s x s scores go through memory
    grad_reduce_bytes: int | None = None  # bytes per gradient value reduced (default: the training precision's)
    overlap_grad_reduce: bool | None = None  # default: ZeRO-2/3 overlap (overlap_comm), ZeRO-0/1 reduce at the end


@dataclass(frozen=True)
class StepPrediction:
    """A layout's predicted step: seconds per term (exposed, on the critical path), and the throughput."""

    terms: dict
    tokens_per_step: int
    model_flops_per_token: float
    world: int
    peak_flops: float
    volumes: dict = field(default_factory=dict)  # bytes each GPU moves per step, by kind

    @property
    def step_time(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time

    @property
    def model_flops_per_gpu(self) -> float:
        return self.tokens_per_s * self.model_flops_per_token / self.world

    @property
    def mfu(self) -> float:
        return self.model_flops_per_gpu / self.peak_flops

    def days_for(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / 86400

    def as_dict(self) -> dict:
        return {
            "step_time_s": self.step_time,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_flops_per_gpu / 1e12,
            "mfu": self.mfu,
            "time_breakdown": dict(self.terms),
            "bytes_per_gpu_per_step": dict(self.volumes),
        }


def matmul_params(shape: ModelShape) -> int:
    """Parameters in matrix products: the linear layers (head included), or, where a shape does not count them,
    every parameter but the input embeddings."""
    return shape.linear_params or (shape.n_params - shape.embedding_params)


def model_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Model FLOPs per token as train.py logs them (flops.ModelFlops, PaLM appendix B: 6 N + 12 L H Q s)."""
    heads = shape.heads or 1
    return ModelFlops(
        matmul_params(shape), layers=shape.layers, heads=heads, head_dim=shape.hidden / heads, seq_len=seq_len
    ).per_token()


def stage_matmul_params(shape: ModelShape, tp: int, pp: int) -> float:
    """Matrix-product parameters on one GPU of the busiest pipeline stage: its layers / P decoder layers split over
    the tensor ranks, and on the last stage the output head (split over the tensor ranks too, as vocabulary-parallel
    heads are)."""
    linear = matmul_params(shape)
    head = shape.head_params or shape.vocab * shape.hidden
    decoder = max(linear - head, 0)
    return (decoder / pp + head) / tp if pp > 1 else linear / tp


@dataclass(frozen=True)
class _Slot:
    """One micro-batch through the busiest stage: seconds of compute and of model-parallel traffic, bytes moved."""

    compute: float
    tensor: float
    sequence: float
    tensor_bytes: float
    sequence_bytes: float
    activation_bytes: float  # one layer's output on this GPU: what crosses a stage boundary

    @property
    def seconds(self) -> float:
        return self.compute + self.tensor + self.sequence


def compute_passes(layout: Layout) -> int:
    return 3 + (1 if layout.checkpointing else 0)  # forward = 1, backward = 2, recomputation = 1 more forward


def compute_parts(shape: ModelShape, *, seq_len: int, layout: Layout, cluster: Cluster, value_bytes: int) -> dict:
    """Seconds of one micro-batch's compute through one stage (forward, backward, recomputation) by kind, before the
    calibrated compute scale: matmul, attention, elementwise, fixed."""
    tp, sp, pp, b, h = layout.parallel.tp, layout.parallel.sp, layout.parallel.pp, layout.micro_batch, shape.hidden
    layers, passes, hbm = shape.layers / pp, compute_passes(layout), cluster.gpu.hbm_gbs * 1e9
    tokens = b * seq_len / sp  # tokens this GPU's layers see
    matmul = 2 * stage_matmul_params(shape, tp, pp) * tokens * passes / cluster.matmul_flops
    if layout.flash_attention:  # the causal half of QK^T and AV, in one fused kernel
        attention = 2 * b * seq_len**2 * h * layers / (tp * sp) * passes / cluster.attention_flops
    else:  # the whole square as batched products, and the scores written, soft-maxed, dropped out and read again
        scores = b * (shape.heads or 1) / (tp * sp) * seq_len**2 * layers
        attention = 4 * b * seq_len**2 * h * layers / (tp * sp) * passes / cluster.matmul_flops
        attention += SCORE_PASSES * scores * value_bytes * passes / hbm
    return {
        "matmul": matmul,
        "attention": attention,
        "elementwise": ELEMENTWISE_VALUES * tokens * h * value_bytes * layers * passes / hbm,
        "fixed": cluster.micro_batch_fixed_s_per_layer * layers * passes / 3,  # forward + backward = 3 passes
    }


def split_compute(parts: dict, cluster: Cluster) -> tuple:
    """(seconds the calibrated compute scale applies to, seconds it does not) of compute_parts: the scale corrects
    what the FLOP and byte model predicts, not what a probe measured (the fixed cost, a measured attention rate)."""
    measured = parts["fixed"] + (parts["attention"] if cluster.attention_efficiency is not None else 0.0)
    return sum(parts.values()) - measured, measured


def scaled_compute(parts: dict, cluster: Cluster) -> float:
    """A micro-batch's compute seconds, the calibrated scale applied."""
    scaled, measured = split_compute(parts, cluster)
    return scaled * cluster.compute_scale + measured


def _micro_batch_slot(shape: ModelShape, *, seq_len: int, layout: Layout, cluster: Cluster, value_bytes: int) -> _Slot:
    """One micro-batch through one stage (forward, backward, recomputation): compute and model-parallel traffic."""
    tp, sp, b, h = layout.parallel.tp, layout.parallel.sp, layout.micro_batch, shape.hidden
    layers, passes = shape.layers / layout.parallel.pp, compute_passes(layout)
    tokens = b * seq_len / sp  # tokens this GPU's layers see
    activation = tokens * h * value_bytes
    tp_allreduces = layers * (4 + (2 if layout.checkpointing else 0)) if tp > 1 else 0
    tp_bytes = tp_allreduces * 2 * (tp - 1) / tp * activation
    kv_share = (shape.kv_heads or shape.heads or 1) / (shape.heads or 1)
    sp_passes = passes - 1  # forward, backward, recomputation: one set of all-to-alls each
    # q, k, v in, the output back: of this tensor rank's heads
    sp_bytes = layers * (2 + 2 * kv_share) * activation / tp * (sp - 1) / sp * sp_passes
    return _Slot(
        compute=scaled_compute(
            compute_parts(shape, seq_len=seq_len, layout=layout, cluster=cluster, value_bytes=value_bytes), cluster
        ),
        tensor=cluster.collective(tp_bytes, tp_allreduces, tp),
        sequence=cluster.collective(sp_bytes, 4 * layers * sp_passes, sp, stride=tp),
        tensor_bytes=tp_bytes,
        sequence_bytes=sp_bytes if sp > 1 else 0.0,
        activation_bytes=activation,
    )


def _data_parallel(shape: ModelShape, *, layout: Layout, cluster: Cluster, value_bytes: int, slot: _Slot) -> tuple:
    """(exposed seconds, bytes a GPU moves) of the data-parallel traffic of one step. ZeRO partitions over the
    sequence-parallel ranks too."""
    parallel, m = layout.parallel, layout.grad_accum
    ranks, tp = zero_ranks(parallel), parallel.tp
    if ranks == 1:
        return 0.0, 0.0
    params = shape.params_per_rank(tp, parallel.pp)
    fraction = (ranks - 1) / ranks
    if layout.zero_stage == 3:  # gathers forward and backward, reduce-scatter, every micro-batch, prefetched
        per_micro_bytes = 3 * fraction * params * value_bytes
        per_micro = cluster.collective(per_micro_bytes, 3 * shape.layers / parallel.pp, ranks, stride=tp)
        return m * max(0.0, per_micro - slot.seconds), m * per_micro_bytes
    # reduce-scatter of the gradients (overlapped with the last backward where overlap_comm), all-gather of the weights
    grad_bytes = params * (layout.grad_reduce_bytes or value_bytes)
    buckets = max(1.0, params / DP_BUCKET_ELEMENTS)
    reduce = cluster.collective(fraction * grad_bytes, buckets, ranks, stride=tp)
    gather = cluster.collective(fraction * params * value_bytes, buckets, ranks, stride=tp)
    overlap = layout.overlap_grad_reduce if layout.overlap_grad_reduce is not None else layout.zero_stage >= 2
    backward_of_one = slot.seconds * 2 / compute_passes(layout)
    exposed = (max(0.0, reduce - backward_of_one) if overlap else reduce) + gather
    return exposed, fraction * (grad_bytes + params * value_bytes)


def _optimizer_and_offload(shape: ModelShape, layout: Layout, cluster: Cluster, value_bytes: int) -> tuple:
    """(optimizer seconds, offload seconds): Adam over this rank's partition (ZeRO-0 updates every parameter on
    every rank) on the GPU, or CPU-Adam on the host with the gradients and weights crossing PCIe."""
    params = shape.params_per_rank(layout.parallel.tp, layout.parallel.pp)
    partition = params / zero_ranks(layout.parallel) if layout.zero_stage >= 1 else params
    if layout.offload_optimizer == "none":
        optimizer, offload = ADAM_BYTES * partition / (cluster.gpu.hbm_gbs * 1e9) * cluster.optimizer_scale, 0.0
    else:
        optimizer = partition * cluster.gpus_per_node / HOST_ADAM_PARAMS_PER_S
        offload = (4 + value_bytes) * partition / (PCIE_GBS * 1e9)  # fp32 gradients out, 16-bit weights back
    if layout.offload_params != "none":  # each micro-batch's forward and backward fetch the partition from the host
        offload += 2 * layout.grad_accum * partition * value_bytes / (PCIE_GBS * 1e9)
    return optimizer, offload


def predict_step(
    shape: ModelShape, *, seq_len: int, layout: Layout, cluster: Cluster, precision: str = "bf16"
) -> StepPrediction:
    """The predicted step of `layout` on `cluster` for a model of `shape` trained on blocks of `seq_len` tokens."""
    value_bytes = 4 if precision == "fp32" else 2
    parallel, m = layout.parallel, layout.grad_accum
    pp = parallel.pp
    slot = _micro_batch_slot(shape, seq_len=seq_len, layout=layout, cluster=cluster, value_bytes=value_bytes)
    # The pipeline: m micro-batch slots of work, (P - 1) / v more of bubble, each slot sending one activation forward
    # and one gradient back across the stage boundary.
    transfers = 2 * (m + pp - 1) if pp > 1 else 0
    p2p_bytes = transfers * slot.activation_bytes
    stage_ranks = parallel.tp * parallel.sp * parallel.dp  # a stage's ranks: its neighbour is that far away
    p2p = cluster.collective(p2p_bytes, transfers, pp, stride=stage_ranks) if pp > 1 else 0.0
    data, dp_bytes = _data_parallel(shape, layout=layout, cluster=cluster, value_bytes=value_bytes, slot=slot)
    optimizer, offload = _optimizer_and_offload(shape, layout, cluster, value_bytes)
    terms = {
        "compute": m * slot.compute,
        "tensor_parallel": m * slot.tensor,
        "sequence_parallel": m * slot.sequence,
        "pipeline_bubble": (pp - 1) / layout.virtual_stages * slot.seconds,
        "pipeline_p2p": p2p,
        "data_parallel": data,
        "optimizer": optimizer,
        "offload": offload,
        "overhead": cluster.step_overhead_s,
    }
    volumes = {
        "tensor_parallel": m * slot.tensor_bytes,
        "sequence_parallel": m * slot.sequence_bytes,
        "pipeline_p2p": p2p_bytes,
        "data_parallel": dp_bytes,
    }
    return StepPrediction(
        terms=terms,
        tokens_per_step=layout.micro_batch * seq_len * m * parallel.dp,
        model_flops_per_token=model_flops_per_token(shape, seq_len),
        world=parallel.world_size,
        peak_flops=cluster.peak_flops,
        volumes=volumes,
    )


def dense_shape(
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    *,
    intermediate: int | None = None,
    kv_heads: int | None = None,
    style: str = "gpt",
) -> ModelShape:
    """The ModelShape of a dense decoder-only transformer from its published dimensions (for shapes that are not
    on this machine: the published runs BENCHMARKS.md checks the model against). `style`: "gpt" (a two-matrix MLP,
    an untied head), "gpt-tied" (the head is the embedding), "llama" (a gated three-matrix MLP, untied)."""
    gated_mlp, tied = style == "llama", style == "gpt-tied"
    intermediate = intermediate or 4 * hidden
    kv = kv_heads or heads
    attention = 2 * hidden * hidden + 2 * hidden * (hidden // heads * kv)
    mlp = (3 if gated_mlp else 2) * hidden * intermediate
    embedding = vocab * hidden
    head = vocab * hidden
    decoder = layers * (attention + mlp + 2 * hidden)
    return ModelShape(
        n_params=decoder + embedding + (0 if tied else head) + hidden,
        largest_layer_params=max(embedding, hidden * intermediate),
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        vocab=vocab,
        linear_params=layers * (attention + mlp) + head,
        kv_heads=kv,
        heads=heads,
        embedding_params=embedding,
        head_params=head,
        head_tied=tied,
    )
