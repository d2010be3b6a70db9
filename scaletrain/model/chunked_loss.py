"""The token loss computed through the LM head in chunks of tokens, so the `[tokens, vocabulary]` logits never exist (at
a 128k vocabulary and 4 x 4096 tokens, 8 GB of fp32 plus their gradient). Each chunk's gradients are computed in the
forward, so the backward only scales them by the incoming gradient: the same three matrix products as unchunked, no
logits recomputed. The head's class becomes `ChunkedLossHead` (same parameters and names), whose forward returns the
loss while targets are pending and logits otherwise; computing inside the head's forward makes it ZeRO-3-safe, as
DeepSpeed gathers the weight around it. Not DeepSpeed 0.19.8's `TiledFusedLogitsLoss`: it writes the weight's `.grad`
itself assuming an incoming gradient of 1, so the loop's (and fp16's) loss scaling would miss it. Under tensor
parallelism each rank holds a shard of the vocabulary's rows (AutoTP's column-parallel head) and the chunk's softmax is
reduced over the tensor group (Megatron-LM's vocabulary-parallel cross-entropy); under pipeline parallelism the last
stage's loss function calls the same chunked loss on the head's weight (distributed/pipeline.py). Models that change
the head's output: docs/model.md#chunked-loss.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from scaletrain.data import IGNORE_INDEX
from scaletrain.observability import auto_loss_chunk

log = logging.getLogger(__name__)

# Config keys of models whose forward changes the head's output before returning it (soft-capping, scaling).
LOGIT_TRANSFORM_KEYS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling")


def _chunk(hidden, targets, start: int, chunk: int) -> tuple:
    """(the chunk's hidden states with ignored tokens zeroed, its targets made indexable, which are ignored)."""
    t = targets[start : start + chunk]
    ignored = t == IGNORE_INDEX
    return hidden[start : start + chunk].masked_fill(ignored.unsqueeze(1), 0), t.masked_fill(ignored, 0), ignored


def _gradient_buffers(hidden, weight, bias, with_grad: bool) -> tuple:
    """(hidden's, weight's, bias's) gradient accumulators of a chunked loss, None where none is wanted. The weight's
    is summed in its own dtype, as autograd does: an fp32 accumulator would add V x H x 4 bytes (4.2 GB for a 128k x
    8192 head); the bias's in fp32."""
    grad_hidden = torch.empty_like(hidden) if with_grad and hidden.requires_grad else None
    grad_weight = torch.zeros_like(weight) if with_grad and weight.requires_grad else None
    grad_bias = (
        torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        if with_grad and bias is not None and bias.requires_grad
        else None
    )
    return grad_hidden, grad_weight, grad_bias


def _add_chunk_gradients(grads: tuple, *, d_logits, h, weight, ignored, start: int, chunk: int) -> None:
    """Add one chunk's gradients, from d(loss)/d(logits) [c, V] (fp32), to the buffers of _gradient_buffers; the
    ignored tokens' rows reach neither the bias's nor (zeroed) the hidden states' gradient."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_bias is not None:
        grad_bias += torch.mv(d_logits.t(), (~ignored).to(d_logits.dtype))
    d_logits = d_logits.to(h.dtype)
    if grad_hidden is not None:
        torch.mm(d_logits, weight, out=grad_hidden[start : start + chunk])
        grad_hidden[start : start + chunk].masked_fill_(ignored.unsqueeze(1), 0)
    if grad_weight is not None:
        grad_weight.addmm_(d_logits.t(), h.to(grad_weight.dtype))


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight^T + bias, targets), ignoring IGNORE_INDEX targets, in chunks.

    hidden [N, H], weight [V, H], bias [V] or None, targets [N]. With `with_grad` the gradients are computed in the
    forward (summed over chunks: the weight's in its own dtype, the bias's in fp32) and scaled in the backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, with_grad: bool):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grads = _gradient_buffers(hidden, weight, bias, with_grad)
        for start in range(0, hidden.size(0), chunk):
            # Ignored tokens are masked on the [tokens, hidden] side, as zero hidden states (finite logits whatever the
            # model produced there): they reach neither the weight's gradient nor, zeroed below, the hidden states'.
            h, safe_targets, ignored = _chunk(hidden, targets, start, chunk)
            # One fused pass over the chunk's logits (max, sum of exponentials, subtraction) instead of
            # logsumexp's several; the softmax for the gradient is its exponential, in place.
            log_probs = F.log_softmax(F.linear(h, weight, bias), dim=-1, dtype=torch.float32)
            total -= log_probs.gather(1, safe_targets.unsqueeze(1)).squeeze(1).masked_fill(ignored, 0).sum()
            if not with_grad:
                continue
            # d(summed loss)/d(logits) = softmax - one_hot(target)
            d_logits = log_probs.exp_()
            d_logits[torch.arange(h.size(0), device=h.device), safe_targets] -= 1.0
            _add_chunk_gradients(
                grads, d_logits=d_logits, h=h, weight=weight, ignored=ignored, start=start, chunk=chunk
            )
        ctx.grads = grads
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        # in place: the stored gradients are this function's own (a V x H copy would double the head's gradient)
        grads = [
            None if grad is None else grad.mul_(grad_output).to(dtype)
            for grad, dtype in zip(ctx.grads, ctx.dtypes, strict=True)
        ]
        ctx.grads = None
        return (*grads, None, None, None)


class ChunkedTargetLogProbs(torch.autograd.Function):
    """log_softmax(hidden @ weight^T + bias)[n, targets[n]] for each token n (0 where the target is IGNORE_INDEX), in
    chunks: the per-token log-probabilities a preference loss sums per row. hidden [N, H], weight [V, H], bias [V] or
    None, targets [N] -> [N] float32.

    Each token's incoming gradient is its row's (DPO weighs chosen and rejected differently), known only in the
    backward, so the backward recomputes each chunk's logits rather than keep [N, V]; the last chunk's stay (the
    memory its recomputation would take anyway), so one chunk recomputes nothing. ZeRO-3 gathers the weight again
    around the head's backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, with_grad: bool):
        out = torch.zeros(hidden.size(0), dtype=torch.float32, device=hidden.device)
        starts = range(0, hidden.size(0), chunk)
        ctx.kept = None
        for start in starts:
            h, safe_targets, ignored = _chunk(hidden, targets, start, chunk)
            log_probs = F.log_softmax(F.linear(h, weight, bias), dim=-1, dtype=torch.float32)
            picked = log_probs.gather(1, safe_targets.unsqueeze(1)).squeeze(1)
            out[start : start + chunk] = picked.masked_fill(ignored, 0)
            if with_grad and start == starts[-1]:
                ctx.kept = log_probs
        ctx.save_for_backward(hidden, targets)
        ctx.weight, ctx.bias, ctx.chunk = weight, bias, chunk
        return out

    @staticmethod
    def backward(ctx, grad_output):
        hidden, targets = ctx.saved_tensors
        weight, bias, chunk = ctx.weight, ctx.bias, ctx.chunk
        ctx.weight = ctx.bias = None
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if ctx.needs_input_grad[2] else None
        )
        for start in reversed(range(0, hidden.size(0), chunk)):  # the last chunk first: its log-probs are kept
            h, safe_targets, ignored = _chunk(hidden, targets, start, chunk)
            g = grad_output[start : start + chunk].float().masked_fill(ignored, 0)
            log_probs, ctx.kept = ctx.kept, None
            if log_probs is None:
                log_probs = F.log_softmax(F.linear(h, weight, bias), dim=-1, dtype=torch.float32)
            # d(log p[target])/d(logits) = one_hot(target) - softmax, times each token's incoming gradient
            d_logits = log_probs.exp_().mul_(-g.unsqueeze(1))
            d_logits[torch.arange(h.size(0), device=h.device), safe_targets] += g
            if grad_bias is not None:
                grad_bias += d_logits.sum(0)
            d_logits = d_logits.to(h.dtype)
            if grad_hidden is not None:
                torch.mm(d_logits, weight, out=grad_hidden[start : start + chunk])
                grad_hidden[start : start + chunk].masked_fill_(ignored.unsqueeze(1), 0)
            if grad_weight is not None:
                grad_weight.addmm_(d_logits.t(), h.to(grad_weight.dtype))
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """ChunkedCrossEntropy with the head's rows split over a tensor-parallel group. `how` is (chunk, with_grad, group,
    vocab_start): this rank holds `weight` [V/T, H] (rows from vocab_start) and `bias` [V/T]; per chunk the logits'
    maximum and the sum of exponentials (and each target's logit, from the rank that holds its row) are all-reduced
    over the group, so every rank returns the same sum. The hidden states' gradient sums every rank's part (one
    all-reduce of [N, H], in the forward, where the gradients are computed); the weight's and bias's are the rank's
    own rows."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, how: tuple):
        import torch.distributed as dist

        chunk, with_grad, group, vocab_start = how
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grads = _gradient_buffers(hidden, weight, bias, with_grad)
        rows = weight.size(0)
        for start in range(0, hidden.size(0), chunk):
            h, safe_targets, ignored = _chunk(hidden, targets, start, chunk)
            logits = F.linear(h, weight, bias).float()
            local = safe_targets - vocab_start
            mine = (local >= 0) & (local < rows)  # the tokens whose target row this rank holds
            local = local.clamp(0, rows - 1)
            target_logit = logits.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0)
            top = logits.amax(dim=-1)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            exps = logits.sub_(top.unsqueeze(1)).exp_()  # in place: the chunk's one [c, V/T] buffer
            sums = torch.stack([exps.sum(-1), target_logit])
            dist.all_reduce(sums, group=group)
            # -log softmax[target] = log(sum of exp(logit - top)) + top - logit[target]
            total += (sums[0].log() + top - sums[1]).masked_fill(ignored, 0).sum()
            if not with_grad:
                continue
            d_logits = exps.div_(sums[0].unsqueeze(1))  # softmax over the whole vocabulary, this rank's columns
            picked = torch.arange(h.size(0), device=h.device)[mine]
            d_logits[picked, local[mine]] -= 1.0
            _add_chunk_gradients(
                grads, d_logits=d_logits, h=h, weight=weight, ignored=ignored, start=start, chunk=chunk
            )
        if grads[0] is not None:  # every rank's part of the hidden states' gradient
            dist.all_reduce(grads[0], group=group)
        ctx.grads = grads
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # scales the gradients computed in the forward
        return ChunkedCrossEntropy.backward(ctx, grad_output)[:4] + (None,)


def chunked_target_logps(hidden, *, weight, bias, targets, chunk: int):
    """Per-token log-probabilities of `targets` [...] under the head, `chunk` tokens at a time: [...] float32."""
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    flat = ChunkedTargetLogProbs.apply(
        hidden.reshape(-1, hidden.size(-1)), weight, bias, targets.reshape(-1), chunk, with_grad
    )
    return flat.view(targets.shape)


def chunked_token_loss(hidden, weight, bias, targets, chunk: int, vocab_shard: tuple | None = None):
    """Summed token cross-entropy of `hidden` [..., H] through the head, `chunk` tokens at a time; with `vocab_shard`
    (tensor-parallel group, first row) the head holds only those rows of the vocabulary (VocabParallelCrossEntropy)."""
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if vocab_shard is not None:
        how = (chunk, with_grad, *vocab_shard)
        return VocabParallelCrossEntropy.apply(flat_hidden, weight, bias, flat_targets, how)
    return ChunkedCrossEntropy.apply(flat_hidden, weight, bias, flat_targets, chunk, with_grad)


class ChunkedLoss:
    """What turns an LM head (torch's Linear, or AutoTP's column-parallel LinearLayer: the class after this one in a
    subclass) into one that, while targets are pending, returns the summed token loss (or, `per_token`, each target's
    log-probability) instead of the logits."""

    chunk_tokens: int = 0  # set by install_chunked_loss
    vocab_shard: tuple | None = None  # (tensor-parallel group, first row) of a head that holds part of the vocabulary
    forward_is_eager = False  # forward wrapped in torch.compiler.disable (by install_chunked_loss)

    @contextmanager
    def pending(self, targets, per_token: bool = False):
        """Targets for the next forward (the loss, or the [rows, T] log-probs of the targets with `per_token`, comes
        back in the model output's `logits` field)."""
        self.__dict__.update(_targets=targets, _returned=None, _per_token=per_token)
        try:
            yield
        finally:
            self.__dict__["_targets"] = None

    # Eager under --torch_compile (install_chunked_loss wraps it in torch.compiler.disable): traced, the chunk loop
    # unrolls and each step's targets recompile the graph. Not a decorator here: that imports torch._dynamo (2.3 s)
    # in every process, the checkpoint writer included.
    def forward(self, hidden):
        targets = self.__dict__.get("_targets")
        if targets is None:
            return super().forward(hidden)  # the head's own forward: the logits
        if hidden.shape[:-1] != targets.shape:
            raise RuntimeError(
                f"chunked loss: the head received hidden states of shape {tuple(hidden.shape)} for "
                f"targets of shape {tuple(targets.shape)}; run with --loss_chunk_size 0"
            )
        if self.__dict__.get("_per_token"):
            if self.vocab_shard is not None:  # preference training refuses tensor parallelism before this
                raise RuntimeError("chunked loss: per-token log-probabilities of a vocabulary shard are not supported")
            result = chunked_target_logps(
                hidden, weight=self.weight, bias=self.bias, targets=targets, chunk=self.chunk_tokens
            )
        else:
            result = chunked_token_loss(
                hidden,
                weight=self.weight,
                bias=self.bias,
                targets=targets,
                chunk=self.chunk_tokens,
                vocab_shard=self.vocab_shard,
            )
        self.__dict__["_returned"] = result.data_ptr(), result.dim()
        return result

    def check_returned(self, output) -> None:
        """The model returned the head's result unchanged (ZeRO-3 returns a detached alias: same storage)."""
        if (output.data_ptr(), output.dim()) != self.__dict__.get("_returned"):
            raise RuntimeError(
                "--loss_chunk_size: this model changes the LM head's output before returning it (scaling or "
                "soft-capping the logits), so the loss cannot be computed inside the head; run with "
                "--loss_chunk_size 0"
            )


class ChunkedLossHead(ChunkedLoss, torch.nn.Linear):
    """A torch Linear LM head with the chunked loss."""


_TENSOR_PARALLEL_HEADS: dict = {}  # AutoTP's head class -> its chunked-loss subclass


def _tensor_parallel_head_class(layer_class: type) -> type:
    """The chunked-loss subclass of AutoTP's head class (made once per process)."""
    if layer_class not in _TENSOR_PARALLEL_HEADS:
        _TENSOR_PARALLEL_HEADS[layer_class] = type(
            "TensorParallelChunkedLossHead",
            (ChunkedLoss, layer_class),
            {"__doc__": "AutoTP's column-parallel LM head with the chunked loss over its vocabulary shard."},
        )
    return _TENSOR_PARALLEL_HEADS[layer_class]


def chunked_loss_head(model) -> ChunkedLoss | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, ChunkedLoss) else None


def logit_transforms(model) -> list:
    """The config keys by which `model` changes its head's output (the loss cannot be computed inside the head)."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return [key for key in LOGIT_TRANSFORM_KEYS if getattr(text_config, key, None) not in (None, 1, 1.0)]


def install_chunked_loss(model, chunk_size: int | None) -> int | None:
    """Turn the model's LM head (torch's Linear, or AutoTP's column-parallel head) into a chunked-loss head; returns
    the tokens per chunk, or None (whole logits)."""
    from scaletrain.engine import column_parallel_head

    if chunk_size == 0:
        log.info("loss: from the whole logits (--loss_chunk_size 0)")
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    transforms = logit_transforms(model)
    shard = None if head is None or type(head) is torch.nn.Linear else column_parallel_head(head)
    if (type(head) is not torch.nn.Linear and shard is None) or transforms:
        why = f"its config sets {', '.join(transforms)}" if transforms else f"its head is a {type(head).__name__}"
        log.info("loss: whole logits (%s: the loss cannot be chunked through the head)", why)
        return None
    assert head is not None  # a missing head is no Linear and has no shard: returned above
    # this rank's rows of the vocabulary (under ZeRO-3 the weight is partitioned: out_features is the whole count)
    rows = head.out_features if shard is None else getattr(head.weight, "ds_shape", head.weight.shape)[0]
    tokens = chunk_size or auto_loss_chunk(rows)
    if not ChunkedLoss.forward_is_eager:  # once per process (see the forward's comment)
        ChunkedLoss.forward = torch.compiler.disable(ChunkedLoss.forward)  # type: ignore[method-assign]  # eager, once
        ChunkedLoss.forward_is_eager = True
    head.__class__ = ChunkedLossHead if shard is None else _tensor_parallel_head_class(type(head))
    head.chunk_tokens = tokens
    head.vocab_shard = shard
    where = "" if shard is None else f", over this rank's {rows} rows of the vocabulary"
    log.info("loss: through the LM head in chunks of %d tokens%s (the full logits are never built)", tokens, where)
    return tokens
