"""Memory planner (--plan): what each ZeRO stage and offload option needs per GPU and per node, before any GPU is
touched, for a model built on the meta device. Model states are counted as DeepSpeed 0.19 holds them at their peak
(checked against real 2-rank runs within 10%), the working memory is estimated; the formulas, and what they were
measured against, are in docs/parallelism.md#memory-planner."""

from __future__ import annotations

from dataclasses import dataclass, replace

from scaletrain.config import bucket_elements
from scaletrain.observability.flops import matmul_modules
from scaletrain.parts import ParallelLayout

GIB = 2**30
HEADROOM = 0.90  # plan to use at most 90% of a GPU: allocator fragmentation, NCCL buffers, the CUDA context
OPTIMIZER_BYTES = 12  # fp32 master weights + Adam m and v
AUTO_LOSS_CHUNK_BYTES = 256 * 2**20  # --loss_chunk_size auto: a chunk's fp32 logits take at most this much


def auto_loss_chunk(vocab_size: int) -> int:
    """Tokens per chunk of the chunked loss for --loss_chunk_size auto: fp32 logits of at most 256 MiB. Large
    enough that each chunk's matrix product keeps a GPU busy (523 tokens x 128k vocabulary x hidden), small
    enough to be a rounding error next to the model's activations."""
    return max(1, AUTO_LOSS_CHUNK_BYTES // (4 * vocab_size))


@dataclass(frozen=True)
class ModelShape:
    n_params: int
    largest_layer_params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    linear_params: int = 0  # in matrix products (flops.matmul_modules): what tensor parallelism splits
    kv_heads: int = 0  # key/value heads (0: unknown): a tensor-parallel size must divide them
    heads: int = 0  # query heads (0: unknown): Ulysses splits them over the sequence-parallel ranks
    embedding_params: int = 0  # the input embeddings (tokens, learned positions): the first pipeline stage's
    head_params: int = 0  # the output head on the last pipeline stage (a tied head holds a copy of the embedding)
    head_tied: bool = False  # the head's weight is the embedding's (counted once in n_params)

    def params_per_tp_rank(self, tp: int) -> float:
        return self.n_params - self.linear_params + self.linear_params / tp

    def params_per_rank(self, tp: int, pp: int = 1) -> float:
        """Parameters on one rank: its share of the largest pipeline stage (the first, with the embeddings, or the
        last, with the head, each with layers / pp decoder layers). Under tensor x pipeline parallelism a stage's
        decoder layers split their linear layers over the tensor ranks, and its embedding and head stay whole
        (scaletrain.distributed.layout.TENSOR_STAGE_PARTITION)."""
        return max(self.pipeline_stage(pp, which).params_per_tp_rank(tp) for which in ("first", "last"))

    def pipeline_stage(self, pp: int, which: str) -> ModelShape:
        """The `which` stage of `pp` ("first": with the embeddings, "last": with the head) as a model of its own: its
        share of the decoder layers (whose linear weights tensor parallelism splits) and its end's parameters, whole;
        params_per_tp_rank of it is params_per_rank's count for that stage (its counts may be fractions)."""
        if pp == 1:
            return self
        body = self.n_params - self.embedding_params - (0 if self.head_tied else self.head_params)
        split = min(max(self.linear_params - self.head_params, 0), body)  # the decoder layers' linear weights
        end = self.embedding_params if which == "first" else self.head_params
        # A stage's share of the body is fractional where PP does not divide the layers: the sums take it as it is.
        return replace(self, n_params=body / pp + end, linear_params=split / pp)  # type: ignore[arg-type]

    @classmethod
    def from_meta_model(cls, model, model_config) -> ModelShape:
        import torch

        text = model_config.get_text_config()
        leaves = [m for m in model.modules() if not list(m.children())]
        head = model.get_output_embeddings()
        hidden = getattr(text, "hidden_size", None) or text.n_embd
        return cls(
            n_params=sum(p.numel() for p in model.parameters()),
            largest_layer_params=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in leaves),
            layers=getattr(text, "num_hidden_layers", None) or text.n_layer,
            hidden=hidden,
            intermediate=getattr(text, "intermediate_size", None) or 4 * hidden,
            vocab=text.vocab_size,
            linear_params=sum(p.numel() for m in matmul_modules(model) for p in m.parameters(recurse=False)),
            kv_heads=getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", 0) or 0,
            heads=getattr(text, "num_attention_heads", 0) or 0,
            embedding_params=sum(
                p.numel()
                for m in model.modules()
                if isinstance(m, torch.nn.Embedding)
                for p in m.parameters(recurse=False)
            ),
            head_params=head.weight.numel() if head is not None else 0,
            head_tied=head is not None and head.weight is model.get_input_embeddings().weight,
        )

    def splits_into(self, tp: int) -> bool:
        """Whether tensor parallelism of size tp divides what it splits (see scaletrain.distributed.layout)."""
        return all(d % tp == 0 for d in (self.intermediate, self.vocab, self.kv_heads or tp))


@dataclass(frozen=True)
class MemoryFeatures:
    """The run's long-context memory features the working memory is counted with (--tiled_mlp,
    --activation_offloading)."""

    tiled_mlp: bool = False
    offload: bool = False

    def describe(self) -> str:
        names = [n for n, on in (("tiled MLP", self.tiled_mlp), ("activation offloading", self.offload)) if on]
        return f", with {' and '.join(names)}" if names else ""


NO_FEATURES = MemoryFeatures()


def zero_ranks(parallel: ParallelLayout) -> int:
    """The ranks ZeRO partitions the model states over: data x sequence parallel (DeepSpeed's sequence-data-parallel
    group: the sequence-parallel ranks of a replica hold the same parameters)."""
    return parallel.dp * parallel.sp


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """The run --plan sizes: its GPUs and their parallel layout, micro-batch, precision, loss chunk and memory
    features."""

    gpus_per_node: int = 1
    nodes: int = 1
    parallel: ParallelLayout = ParallelLayout()  # how its GPUs split (data_parallel_run: data parallelism alone)
    micro_batch: int = 1
    block_size: int = 1024
    precision: str = "bf16"
    loss_chunk: int | None = None  # tokens per chunk of the chunked loss (None: the whole logits)
    grad_accum: int = 1  # micro-batches per update: ZeRO-1/2 hold the earlier ones' gradients through the later ones
    features: MemoryFeatures = NO_FEATURES

    def __post_init__(self):
        assert self.parallel.world_size == self.ranks, (
            f"{self.parallel} spans {self.parallel.world_size} ranks, not the {self.nodes} node(s) x "
            f"{self.gpus_per_node} GPU(s) planned"
        )

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def zero_ranks(self) -> int:
        """The ranks ZeRO partitions over (under sequence parallelism: all of them)."""
        return zero_ranks(self.parallel)


def data_parallel_run(*, gpus_per_node: int = 1, nodes: int = 1, **options) -> PlannedRun:
    """A planned run of data parallelism over all its GPUs."""
    parallel = ParallelLayout(dp=gpus_per_node * nodes)
    return PlannedRun(gpus_per_node=gpus_per_node, nodes=nodes, parallel=parallel, **options)


def with_model_parallel(run: PlannedRun, tp: int = 1, sp: int = 1, pp: int = 1) -> PlannedRun:
    """`run` on the same GPUs with these model-parallel sizes (data parallelism takes the rest)."""
    return replace(run, parallel=ParallelLayout.of_world(run.ranks, tp, sp, pp))


@dataclass(frozen=True)
class Option:
    name: str
    ds_config: str  # the file in ds_configs/ that sets it up
    stage: int
    offload_optimizer: str = "none"  # "none", "cpu", "nvme"
    offload_params: str = "none"


OPTIONS = [
    Option("ZeRO-1", "zero1.json", 1),
    Option("ZeRO-2", "zero2.json", 2),
    Option("ZeRO-2 + optimizer offload (CPU)", "zero2_offload.json", 2, "cpu"),
    Option("ZeRO-3", "zero3.json", 3),
    Option(
        "ZeRO-3 + optimizer and parameter offload (CPU)",
        ds_config="zero3_offload.json",
        stage=3,
        offload_optimizer="cpu",
        offload_params="cpu",
    ),
    Option(
        "ZeRO-3 + optimizer and parameter offload (NVMe)",
        ds_config="zero3_nvme.json",
        stage=3,
        offload_optimizer="nvme",
        offload_params="nvme",
    ),
]


@dataclass(frozen=True)
class Estimate:
    option: Option
    params: float  # bytes per GPU
    grads: float
    optimizer: float
    activations: float
    activations_checkpointed: float
    host_per_node: float  # bytes of host memory per node for offloaded states
    nvme_per_node: float

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    def total(self, checkpointing: bool) -> float:
        return self.model_states + (self.activations_checkpointed if checkpointing else self.activations)


def weight_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def model_state_bytes(
    option: Option,
    *,
    shape: ModelShape,
    dp: int,
    precision: str,
    tp: int = 1,
    pp: int = 1,
    reduce_bucket: int | None = None,
) -> tuple:
    """(params, grads, optimizer) bytes on one GPU, and (host, nvme) bytes per rank, for one option (under pipeline
    parallelism on the largest stage's ranks; a given stage's: shape.pipeline_stage(pp, which) with pp=1).
    `reduce_bucket`: the reduce bucket in elements (default: dsconfig's rule for a CUDA link)."""
    p, n = weight_bytes(precision), shape.params_per_rank(tp, pp)
    grad_bytes = 4 if precision == "fp32" else (p if option.stage == 3 else p + 4)
    params = p * n / dp if option.stage == 3 else p * n
    grads, optimizer = grad_bytes * n / dp, OPTIMIZER_BYTES * n / dp
    if option.stage == 1:  # whole gradients from the backward until the boundary's reduction
        grads = max(grads, p * n)
    if option.stage in (1, 3):  # the reduce bucket's buffer, allocated whole (measured; ZeRO-2 reduces in place)
        bucket = bucket_elements("cuda", precision, shape.n_params)[0] if reduce_bucket is None else reduce_bucket
        grads += min(bucket, n) * (4 if precision == "fp32" else p)
    host = nvme = 0.0
    if option.offload_optimizer != "none":
        moved = (4 + OPTIMIZER_BYTES) * n / dp  # the fp32 gradient partition and the optimizer states
        grads = optimizer = 0.0
        host, nvme = (moved, 0.0) if option.offload_optimizer == "cpu" else (0.0, moved)
    if option.offload_params != "none":
        moved, params = params, 0.0
        if option.offload_params == "cpu":
            host += moved
        else:
            nvme += moved
    return params, grads, optimizer, host, nvme


ZERO3_MAX_LIVE_PARAMETERS = 10**9  # ds_configs/zero3*.json's stage3_max_live_parameters (and reuse distance)


def activation_bytes(
    shape: ModelShape,
    run: PlannedRun,
    stage: int = 1,
    reduce_bucket: int | None = None,
    grads_offloaded: bool = False,
) -> tuple:
    """Working memory (without, with activation checkpointing): bytes per GPU that a training step of `run` under ZeRO
    `stage` holds at its peak beyond the model states (model_state_bytes), from a timeline of the step (step_peaks);
    under pipeline parallelism of the stage that needs most.
    `reduce_bucket` in elements as in model_state_bytes; `grads_offloaded`: the gradient partition lives in host memory
    (optimizer offload)."""
    option, parallel = Option("", "", max(stage, 1), "cpu" if grads_offloaded else "none"), run.parallel
    states = model_state_bytes(
        option,
        shape=shape,
        dp=run.zero_ranks,
        precision=run.precision,
        tp=parallel.tp,
        pp=parallel.pp,
        reduce_bucket=reduce_bucket,
    )
    stages = ("first", "last") if parallel.pp > 1 else ("last",)
    peaks = [peak_bytes(shape, run=run, option=option, reduce_bucket=reduce_bucket, which=which) for which in stages]
    return tuple(max(peak[i] for peak in peaks) - sum(states[:3]) for i in (0, 1))


def peak_bytes(shape: ModelShape, run: PlannedRun, option: Option, reduce_bucket: int | None, which: str) -> tuple:
    """(without, with activation checkpointing) the most a rank of the `which` pipeline stage ("first" or "last";
    without pipeline parallelism, any rank) holds during a step of `run` under `option`: its parameters and
    optimizer states, and the highest of step_peaks (or of ZeRO-1/2's gradients at the update)."""
    tp, stage_shape = run.parallel.tp, shape.pipeline_stage(run.parallel.pp, which)
    params, grads, optimizer, *_ = model_state_bytes(
        option, shape=stage_shape, dp=run.zero_ranks, precision=run.precision, tp=tp, pp=1, reduce_bucket=reduce_bucket
    )
    n = stage_shape.params_per_tp_rank(tp)
    transient = grads if option.stage < 3 else 0.0  # ZeRO-1/2's gradients live from the backward to the update
    persistent = params + optimizer + grads - transient
    return tuple(
        persistent + max(*phases, transient)
        for phases in step_peaks(
            shape,
            run=run,
            stage=option.stage,
            n=n,
            reduce_bucket=reduce_bucket,
            which=which,
            grads_offloaded=option.offload_optimizer != "none",
        )
    )


def step_peaks(
    shape: ModelShape,
    *,
    run: PlannedRun,
    stage: int,
    n: float,
    reduce_bucket: int | None,
    which: str = "last",
    grads_offloaded: bool = False,
) -> tuple:
    """((forward, backward, end of backward) without, the same with activation checkpointing): bytes a step holds
    above the parameters and optimizer states at each of its three highest points, on a rank that holds `n`
    parameters (`which` pipeline stage: "first" holds the embeddings and pp micro-batches of its layers in flight
    under 1F1B, "last" one micro-batch, the final norm and the loss). Measured on real runs (tests/helpers/
    peak_memory_probe.py, BENCHMARKS.md "--plan's total against each rank's measured peak"):

    - forward, at the loss: every layer's saved activations (per_layer), the chunked loss's gradient buffers (the
      head's weight and the hidden states', filled in its forward) and one chunk's logits with their fp32
      log-probabilities; gradients held from the step's earlier micro-batches; ZeRO-3's gathered parameters (up to
      stage3_max_live_parameters stay gathered until the backward releases them).
    - backward, at its first gradient: the activations, the MLP backward's two [tokens, intermediate] temporaries, and
      the gradient memory the backward opens at once: ZeRO-0/1's reduce bucket (whole), ZeRO-2's two (overlap_comm),
      beside the gradients held from earlier micro-batches. The activations are freed as the gradients grow, so the
      two are never counted whole at once: ZeRO-1/2's whole gradients are the update's (the model states).
    - end of backward: ZeRO-2's gradient partition beside its buckets; ZeRO-3's reduce bucket flattened and the
      reduce-scatter's copy of it.
    Under 1F1B the first stage's later backwards hold one micro-batch fewer each beside the gradients.
    """
    p = weight_bytes(run.precision)
    scale = 2 if run.precision == "fp32" else 1
    tp, pp = run.parallel.tp, run.parallel.pp
    tokens = run.micro_batch * run.block_size / run.parallel.sp
    mlp_tokens = min(tokens, shape.hidden) if run.features.tiled_mlp else tokens
    per_layer = (
        tokens * (8 * shape.hidden + 10 * shape.hidden / tp) + mlp_tokens * 8 * shape.intermediate / tp
    ) * scale
    kept = 2 * tokens * shape.hidden * scale  # a checkpointed layer's input
    kept_layers = min(shape.layers, 2) if run.features.offload else shape.layers
    last = which == "last" or pp == 1
    # 1F1B: the first stage holds up to pp micro-batches in flight for its layers / pp layers, the last stage one
    layers = shape.layers / pp if last else shape.layers
    activations = layers * per_layer
    checkpointed = min(kept_layers, layers) * kept
    loss_kept, loss_peak = loss_bytes(shape, run, tokens) if last else (0.0, 0.0)
    bucket = bucket_elements("cuda", run.precision, shape.n_params)[0] if reduce_bucket is None else reduce_bucket
    bucket = min(bucket, n)
    accumulating = run.grad_accum > 1 or pp > 1
    if stage == 3:
        gathered = max(shape.largest_layer_params, min(n, ZERO3_MAX_LIVE_PARAMETERS)) * p
        held, opened, end = 0.0, 0.0, 2 * bucket * p
    else:
        gathered = 0.0
        # ZeRO-0/1: the reduce bucket, allocated whole at the backward's first gradient, and the autograd gradients
        # (16-bit), whole until the boundary's reduction; ZeRO-2: its two reduce buckets (overlap_comm) and, reduced
        # into, the gradient partition (16-bit and fp32, or in host memory under optimizer offload)
        partition = 0.0 if grads_offloaded else (4 if run.precision == "fp32" else p + 4) * n / run.zero_ranks
        whole = p * n + bucket * p
        held = (whole if stage < 2 else partition) if accumulating else 0.0
        opened = (held or bucket * p) if stage < 2 else 2 * bucket * p + held
        end = 0.0 if stage < 2 else partition + 2 * bucket * p
        if not last:  # 1F1B: the first stage's first backward, every micro-batch in flight, opens the bucket alone;
            opened = bucket * p  # its later ones hold fewer micro-batches beside the gradients (below)
            held = held if run.grad_accum > pp else 0.0  # its forwards come before its backwards
    temporaries = 2 * mlp_tokens * shape.intermediate / tp * p
    phases = []
    for saved, recomputed in ((activations, 0.0), (checkpointed, per_layer)):
        forward = saved + loss_kept + loss_peak + held + gathered
        backward = saved + recomputed + loss_kept + temporaries + opened + gathered
        if not last and stage < 3:  # the first stage's last backward: one micro-batch left, every gradient held
            backward = max(backward, saved / pp + recomputed + temporaries + (p * n + bucket * p))
        phases.append((forward, backward, end))
    return tuple(phases)


def loss_bytes(shape: ModelShape, run: PlannedRun, tokens: float) -> tuple:
    """(kept through the step, the loss's own peak) bytes of the last stage's loss on `tokens` tokens: the chunked
    loss holds one chunk's logits in the training dtype and their fp32 log-probabilities (the vocabulary-parallel loss
    exponentiates an fp32 chunk in place) and fills the head's and the hidden states' gradients in its forward; the
    whole logits take their fp32 copy, log-softmax and gradient (10 bytes each, x1.5 in fp32). Kept too: the final
    norm's input and output, and under pipeline parallelism the pipe engine's other output buffer."""
    p, tp, pp, chunk = weight_bytes(run.precision), run.parallel.tp, run.parallel.pp, run.loss_chunk
    logit_tokens = min(tokens, chunk) if chunk else tokens
    vocab_parallel = bool(chunk) and pp == 1 and tp > 1
    vocab = shape.vocab / tp if vocab_parallel else shape.vocab  # AutoTP's whole-logits head gathers them
    if chunk:
        peak = logit_tokens * vocab * (4 if vocab_parallel and p == 4 else p + 4)
        kept = vocab * shape.hidden * p + tokens * shape.hidden * p
    else:
        peak, kept = logit_tokens * vocab * 10 * (1.5 if run.precision == "fp32" else 1), 0.0
    kept += 2 * tokens * shape.hidden * p
    if pp > 1:  # pipeline_kept_outputs: one buffer beside the one in use
        kept += (
            pipeline_kept_outputs(
                shape,
                micro_batch=run.micro_batch,
                block_size=run.block_size,
                precision=run.precision,
                chunked=bool(chunk),
            )
            / 2
        )
    return kept, peak


def offloaded_checkpoint_bytes(shape: ModelShape, tokens: float, precision: str) -> float:
    """Host bytes per GPU that --activation_offloading takes: every layer's input for this GPU's tokens."""
    return shape.layers * 2 * tokens * shape.hidden * (2 if precision == "fp32" else 1)


def pipeline_kept_outputs(
    shape: ModelShape, *, micro_batch: int, block_size: int, precision: str, chunked: bool = False
) -> float:
    """Bytes of the last pipeline stage's outputs that DeepSpeed's pipe engine keeps through a step: its
    TrainSchedule gives every stage at least 2 buffers (num_pipe_buffers), each holding one micro-batch's outputs
    until the next step reuses it, so 2 s b V p of logits are still alive at the update; 2 s b H p of hidden states
    with the chunked loss (the loss applies the head: distributed/pipeline.py's TokenLoss)."""
    width = shape.hidden if chunked else shape.vocab
    return 2 * micro_batch * block_size * width * weight_bytes(precision)


def options_for(tp: int, sp: int = 1, pp: int = 1) -> list[Option]:
    """The options the pipeline runs with this layout (TP: ZeRO-1/2/3, PP: ZeRO-1, neither with offload; SP:
    ZeRO-1/2/3 with CPU offload, not NVMe)."""
    if pp > 1:
        return [o for o in OPTIONS if o.stage == 1]
    if tp > 1:
        return [o for o in OPTIONS if o.offload_optimizer == "none" and o.offload_params == "none"]
    return OPTIONS if sp == 1 else [o for o in OPTIONS if o.offload_optimizer != "nvme"]


def plan_memory(shape: ModelShape, run: PlannedRun, reduce_bucket: int | None = None) -> list[Estimate]:
    """One estimate per option the run's layout trains with (options_for); `reduce_bucket` in elements as in
    model_state_bytes."""
    estimates, parallel = [], run.parallel
    for option in options_for(parallel.tp, parallel.sp, parallel.pp):
        offloaded = option.offload_optimizer != "none"
        act, act_ckpt = activation_bytes(
            shape, run=run, stage=option.stage, reduce_bucket=reduce_bucket, grads_offloaded=offloaded
        )
        params, grads, optimizer, host, nvme = model_state_bytes(
            option,
            shape=shape,
            dp=run.zero_ranks,
            precision=run.precision,
            tp=parallel.tp,
            pp=parallel.pp,
            reduce_bucket=reduce_bucket,
        )
        if run.features.offload:
            tokens = run.micro_batch * run.block_size / parallel.sp
            host += offloaded_checkpoint_bytes(shape, tokens, run.precision)
        per_node = run.gpus_per_node
        estimates.append(
            Estimate(
                option,
                params=params,
                grads=grads,
                optimizer=optimizer,
                activations=act,
                activations_checkpointed=act_ckpt,
                host_per_node=host * per_node,
                nvme_per_node=nvme * per_node,
            )
        )
    return estimates


def recommend(
    estimates: list[Estimate], gpu_bytes: float, host_bytes: float | None, checkpointing_allowed: bool = True
) -> tuple | None:
    """The first option (fastest first: less communication, no offload) that fits: (estimate, checkpointing)."""
    for checkpointing in (False, True) if checkpointing_allowed else (False,):
        for est in estimates:
            if est.total(checkpointing) <= HEADROOM * gpu_bytes and (
                host_bytes is None or est.host_per_node <= HEADROOM * host_bytes
            ):
                return est, checkpointing
    return None


def recommend_layout(shape: ModelShape, run: PlannedRun, gpu_bytes: float, host_bytes: float | None) -> tuple | None:
    """(tensor-parallel size, pipeline stages, estimate, checkpointing) of the fastest layout for `run` that fits,
    whatever layout it names, in this order: pure data parallelism without offload (ZeRO-1, 2, 3), then tensor
    parallelism inside a node (2, 4, ... GPUs; its all-reduces stay on the node's links), then pipeline stages (2, 4,
    ...; point-to-point transfers of one activation per micro-batch, which cross nodes well, at the cost of the
    pipeline's bubble), then offload (host memory and PCIe are slower still). Tensor and pipeline parallelism together
    are not proposed here; the time plan (time_plan.py) scores every layout, composed ones included, by predicted
    step time, and its recommendation is --plan's."""
    plain = plan_memory(shape, with_model_parallel(run))  # data parallelism over the run's GPUs
    in_gpu = [e for e in plain if e.option.offload_optimizer == "none"]
    choice = recommend(in_gpu, gpu_bytes, host_bytes)
    if choice:
        return (1, 1, *choice)
    tp = 2
    while tp <= run.gpus_per_node:
        if run.gpus_per_node % tp == 0 and shape.splits_into(tp):
            choice = recommend(plan_memory(shape, with_model_parallel(run, tp=tp)), gpu_bytes, host_bytes)
            if choice:
                return (tp, 1, *choice)
        tp *= 2
    pp = 2
    while pp <= min(shape.layers, run.ranks):
        if shape.layers % pp == 0 and run.ranks % pp == 0:
            choice = recommend(plan_memory(shape, with_model_parallel(run, pp=pp)), gpu_bytes, host_bytes)
            if choice:
                return (1, pp, *choice)
        pp *= 2
    choice = recommend([e for e in plain if e.option.offload_optimizer != "none"], gpu_bytes, host_bytes)
    return (1, 1, *choice) if choice else None


def layout_flags(tp: int, sp: int, pp: int) -> str:
    return "".join(
        f" --{kind}_parallel_size {size}"
        for kind, size in (("tensor", tp), ("sequence", sp), ("pipeline", pp))
        if size > 1
    )


def snapshot_bytes_per_rank(n_params: int, precision: str, zero_stage: int, world_size: int) -> int:
    """The most one rank copies into host buffers at an asynchronous save: its partition of the fp32 master weights
    and Adam moments, plus (ZeRO-0/1/2, rank 0) the module's weights in the training dtype."""
    weights = 0 if zero_stage == 3 else n_params * weight_bytes(precision)
    return n_params * OPTIMIZER_BYTES // max(world_size, 1) + weights
