"""The loss through the LM head in chunks (scaletrain/model/chunked_loss.py, --loss_chunk_size): the same loss and
gradients as the whole-logits loss, no tensor the size of the whole logits ever built, evaluation without gradients,
models whose forward changes the head's output kept on (or stopped before) the whole-logits path, and a real 2-rank
ZeRO-3 run (the head's weight partitioned) equal to the shared 1-rank reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from scaletrain.data.blocks import IGNORE_INDEX
from scaletrain.model.chunked_loss import (
    ChunkedCrossEntropy,
    chunked_loss_head,
    chunked_target_logps,
    chunked_token_loss,
    install_chunked_loss,
)
from scaletrain.config.cli import parse_run_config
from scaletrain.errors import UsageError
from scaletrain.observability.memory_planner import auto_loss_chunk
from tests.harness import REPO, check_ok, launch, layout_flags, read_metrics
from tests.distributed.test_tensor_parallel import _assert_matches, _assert_same_export

VOCAB = 1000


def _llama(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            tie_word_embeddings=tied,
        )
    )


def _batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (3, 17), generator=generator)
    targets = torch.randint(0, VOCAB, (3, 17), generator=generator)
    targets[0, 5:] = IGNORE_INDEX  # padding at the end of a block
    targets[2, :3] = IGNORE_INDEX
    return input_ids, targets


def _whole_logits_loss(model, input_ids, targets):
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(
        logits.reshape(-1, VOCAB).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _chunked_loss(model, input_ids, targets):
    head = chunked_loss_head(model)
    with head.pending(targets):
        loss = model(input_ids=input_ids).logits
    head.check_returned(loss)
    return loss


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 16, 51, 4096])  # 51 = every token in one chunk; 4096 > the batch
def test_chunked_loss_gives_the_whole_logits_loss_and_gradients(tied, chunk):
    model = _llama(tied)
    chunked = copy.deepcopy(model)
    assert install_chunked_loss(chunked, chunk) == chunk
    # under --torch_compile the head stays eager (torch.compiler.disable, applied at install: see its forward)
    assert getattr(type(chunked_loss_head(chunked)).forward, "_torchdynamo_disable", False)
    input_ids, targets = _batch()
    expected, got = _whole_logits_loss(model, input_ids, targets), _chunked_loss(chunked, input_ids, targets)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    (expected * 0.37).backward()  # the loop scales the summed loss (dp / global targets) before backward
    (got * 0.37).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), chunked.named_parameters(), strict=True):
        assert (p.grad - q.grad).norm() <= 5e-6 * p.grad.norm(), name  # fp32 rounding (sums in other orders)
    assert chunked.state_dict().keys() == model.state_dict().keys()  # checkpoints and exports keep their names
    assert torch.equal(chunked(input_ids=input_ids).logits, chunked.lm_head(chunked.model(input_ids).last_hidden_state))


def _head_inputs() -> tuple:
    """hidden [23, 8], a head with a bias (weight [40, 8], bias [40]), targets with every 4th ignored; seeded."""
    torch.manual_seed(0)
    hidden = torch.randn(23, 8, requires_grad=True)
    weight, bias = torch.randn(40, 8, requires_grad=True), torch.randn(40, requires_grad=True)
    targets = torch.randint(0, 40, (23,))
    targets[::4] = IGNORE_INDEX
    return hidden, weight, bias, targets


def test_the_function_with_a_bias_and_16_bit_weights():
    hidden, weight, bias, targets = _head_inputs()
    expected = F.cross_entropy(
        F.linear(hidden, weight, bias).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    expected_grads = torch.autograd.grad(expected * 2.5, (hidden, weight, bias))
    got = chunked_token_loss(hidden, weight, bias, targets, 6)
    got_grads = torch.autograd.grad(got * 2.5, (hidden, weight, bias))
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(got_grads, expected_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # bf16 (the GPU default): the same figures within bf16's precision, gradients in the parameters' dtype
    leaves = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight, bias)]
    low = chunked_token_loss(*leaves, targets, 6)
    low_grads = torch.autograd.grad(low * 2.5, leaves)
    assert low.item() == pytest.approx(expected.item(), rel=2e-2)
    for a, b in zip(low_grads, expected_grads, strict=True):
        assert a.dtype == torch.bfloat16
        assert (a.float() - b).norm() <= 2e-2 * b.norm()


def _row_logps(model, input_ids, targets, chunked: bool):
    """Per row: the summed log-probs of the targets (what a preference loss needs), from the whole logits or through
    the chunked head's per-token mode."""
    from scaletrain.train.preference_loss import sequence_logps

    if not chunked:
        return sequence_logps(model(input_ids=input_ids).logits, targets)[0]
    head = chunked_loss_head(model)
    with head.pending(targets, per_token=True):
        per_token = model(input_ids=input_ids).logits
    head.check_returned(per_token)
    assert per_token.shape == targets.shape and per_token.dtype == torch.float32
    return per_token.sum(-1)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 16, 4096])
def test_per_token_log_probs_give_the_whole_logits_row_sums_and_gradients(tied, chunk):
    """The preference losses' path (--loss_type sigmoid and the others): each row's summed target log-probs, and
    the gradients when each row's sum gets its own weight (a DPO loss weighs chosen and rejected rows apart)."""
    model = _llama(tied)
    chunked = copy.deepcopy(model)
    install_chunked_loss(chunked, chunk)
    input_ids, targets = _batch()
    expected, got = _row_logps(model, input_ids, targets, False), _row_logps(chunked, input_ids, targets, True)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-5)
    row_weights = torch.tensor([0.7, -1.3, 2.1])
    (expected * row_weights).sum().backward()
    (got * row_weights).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), chunked.named_parameters(), strict=True):
        assert (p.grad - q.grad).norm() <= 5e-6 * p.grad.norm(), name
    with torch.no_grad():  # a reference pass: no gradient kept
        assert not _row_logps(chunked, input_ids, targets, True).requires_grad


def test_per_token_log_probs_with_a_bias_and_16_bit_weights():
    hidden, weight, bias, targets = _head_inputs()
    incoming = torch.randn(23)
    log_probs = F.log_softmax(F.linear(hidden, weight, bias).float(), -1)
    expected = log_probs.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1).masked_fill(targets < 0, 0)
    expected_grads = torch.autograd.grad((expected * incoming).sum(), (hidden, weight, bias))
    got = chunked_target_logps(hidden, weight=weight, bias=bias, targets=targets, chunk=6)
    got_grads = torch.autograd.grad((got * incoming).sum(), (hidden, weight, bias))
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, expected_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    leaves = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight, bias)]
    low_hidden, low_weight, low_bias = leaves
    low = chunked_target_logps(low_hidden, weight=low_weight, bias=low_bias, targets=targets, chunk=6)
    low_grads = torch.autograd.grad((low * incoming).sum(), leaves)
    assert low.dtype == torch.float32 and (low - expected).norm() <= 2e-2 * expected.norm()
    for a, b in zip(low_grads, expected_grads, strict=True):
        assert a.dtype == torch.bfloat16
        assert (a.float() - b).norm() <= 3e-2 * b.norm()


class _ShapeRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the element count of every tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_tensor_of_the_whole_logits_is_ever_built():
    model = _llama()
    chunked = copy.deepcopy(model)
    install_chunked_loss(chunked, 8)
    input_ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(1))
    targets = input_ids.roll(-1, 1)
    whole = input_ids.numel() * VOCAB
    with _ShapeRecorder() as recorder:
        _whole_logits_loss(model, input_ids, targets).backward()
    assert recorder.largest >= whole  # the recorder sees the logits where they exist
    with _ShapeRecorder() as recorder:
        _chunked_loss(chunked, input_ids, targets).backward()
    # one chunk's logits (8 x VOCAB) at most, or the head's weight and its gradient (32 x VOCAB)
    assert recorder.largest == chunked.lm_head.weight.numel() < whole
    with _ShapeRecorder() as recorder:  # the preference losses' per-token mode, backward included
        _row_logps(chunked, input_ids, targets, True).sum().backward()
    assert recorder.largest == chunked.lm_head.weight.numel() < whole


def test_evaluation_computes_no_gradient():
    model = _llama()
    install_chunked_loss(model, 5)
    input_ids, targets = _batch()
    with torch.no_grad():
        loss = _chunked_loss(model, input_ids, targets)
    assert not loss.requires_grad
    assert loss.item() == pytest.approx(_whole_logits_loss(model, input_ids, targets).item(), rel=1e-6)


def test_every_target_ignored_gives_zero_and_zero_gradients():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    loss = ChunkedCrossEntropy.apply(hidden, weight, None, torch.full((6,), IGNORE_INDEX), 4, True)
    loss.backward()
    assert loss.item() == 0 and not hidden.grad.any() and not weight.grad.any()


def test_non_finite_hidden_states_at_ignored_targets_reach_no_gradient():
    """Ignored tokens are masked on the hidden-state side: whatever the model produced there (here inf and NaN)
    gives the loss and gradients of the counted tokens alone."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 4, generator=generator)
    weight, bias = torch.randn(9, 4, generator=generator), torch.randn(9, generator=generator)
    targets = torch.randint(0, 9, (7,), generator=generator)
    targets[[1, 4]] = IGNORE_INDEX
    poisoned = hidden.clone()
    poisoned[1], poisoned[4] = float("nan"), float("inf")

    def gradients(h, chunk):
        h, w, b = (x.clone().requires_grad_() for x in (h, weight, bias))
        loss = ChunkedCrossEntropy.apply(h, w, b, targets, chunk, True)
        loss.backward()
        return loss.detach(), h.grad, w.grad, b.grad

    kept = targets != IGNORE_INDEX
    h, w, b = (x.clone().requires_grad_() for x in (hidden[kept], weight, bias))
    reference = F.cross_entropy(F.linear(h, w, b), targets[kept], reduction="sum")
    reference.backward()
    for chunk in (3, 7):
        loss, grad_hidden, grad_weight, grad_bias = gradients(poisoned, chunk)
        assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
        assert not grad_hidden[~kept].any()
        torch.testing.assert_close(grad_hidden[kept], h.grad)
        torch.testing.assert_close(grad_weight, w.grad)
        torch.testing.assert_close(grad_bias, b.grad)


def test_auto_chunk_keeps_a_chunks_fp32_logits_under_256_mib():
    assert auto_loss_chunk(128_256) == 523  # 523 x 128,256 x 4 bytes = 255.9 MiB
    assert auto_loss_chunk(128_256) * 128_256 * 4 <= 256 * 2**20 < (auto_loss_chunk(128_256) + 1) * 128_256 * 4
    assert auto_loss_chunk(10**9) == 1


def test_the_memory_plan_counts_one_chunk_of_logits():
    from dataclasses import replace

    from scaletrain.observability.memory_planner import ModelShape, PlannedRun, step_peaks
    from scaletrain.parts import ParallelLayout

    shape = ModelShape(
        n_params=10**9, largest_layer_params=10**8, layers=16, hidden=2048, intermediate=8192, vocab=128_256, kv_heads=8
    )
    run = PlannedRun(micro_batch=4, block_size=4096, precision="bf16")

    def forward(planned, which="last"):  # the step's forward peak (at the loss), without checkpointing
        return step_peaks(shape, run=planned, stage=1, n=10**9, reduce_bucket=0, which=which)[0][0]

    tokens, vocab, hidden = 4 * 4096, 128_256, 2048
    # the whole logits (bf16, their fp32 copy and log-softmax, their gradient: 10 bytes) against one chunk's (bf16
    # and fp32 log-probabilities: 6 bytes) and the gradients the chunked loss fills in its forward (head, hidden)
    chunked_extra = vocab * hidden * 2 + tokens * hidden * 2
    whole_minus_chunked = tokens * vocab * 10 - (523 * vocab * 6 + chunked_extra)
    assert forward(run) - forward(replace(run, loss_chunk=523)) == pytest.approx(whole_minus_chunked)
    # Tensor parallelism: a chunk of each rank's half of the head's rows, against the gathered whole logits.
    tp = replace(run, gpus_per_node=2, parallel=ParallelLayout(tp=2))
    chunked_tp_extra = vocab / 2 * hidden * 2 + tokens * hidden * 2
    assert forward(tp) - forward(replace(tp, loss_chunk=523)) == pytest.approx(
        tokens * vocab * 10 - (523 * vocab / 2 * 6 + chunked_tp_extra)
    )
    # Pipeline parallelism: a chunk of the whole head's logits on the last stage, and hidden states (not logits) in
    # the pipe engine's other output buffer; the first stage holds no logits at all.
    pp = replace(run, gpus_per_node=2, parallel=ParallelLayout(pp=2), grad_accum=2)
    kept = tokens * (vocab - hidden) * 2  # half of 2 s b (V - h) p: one buffer beside the one in use
    assert forward(pp) - forward(replace(pp, loss_chunk=523)) == pytest.approx(whole_minus_chunked + kept)
    assert forward(pp, "first") == forward(replace(pp, loss_chunk=523), "first")


def test_models_that_change_the_heads_output_keep_the_whole_logits():
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

    gemma = Gemma2ForCausalLM(
        Gemma2Config(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            vocab_size=VOCAB,
        )
    )
    assert gemma.config.final_logit_softcapping  # soft-capped: the loss cannot come back through the logits field
    assert install_chunked_loss(gemma, None) is None and chunked_loss_head(gemma) is None
    assert install_chunked_loss(_llama(), 0) is None  # --loss_chunk_size 0

    class DoubledLogits(LlamaForCausalLM):  # a model that changes the head's output in a way no config key says
        def forward(self, **kwargs):
            output = super().forward(**kwargs)
            output.logits = output.logits * 2
            return output

    model = DoubledLogits(_llama().config)
    assert install_chunked_loss(model, 4) == 4
    input_ids, targets = _batch()
    with pytest.raises(RuntimeError, match="--loss_chunk_size 0"):
        _chunked_loss(model, input_ids, targets)


def test_a_negative_chunk_size_is_a_usage_error():
    with pytest.raises(UsageError, match="--loss_chunk_size -3: must not be negative"):
        parse_run_config(["--loss_chunk_size", "-3"])


@pytest.mark.slow  # one 2-rank ZeRO-3 run of 8 steps against the shared 1-rank reference
def test_a_zero3_run_with_small_chunks_matches_the_reference(layout_reference_zero3, tmp_path, cache_dir):
    """ZeRO-3 partitions the head's weight: the chunks run inside the head's forward, where DeepSpeed gathers it.
    7-token chunks on 2 ranks against 1 rank taking each micro-batch in one chunk; the gradient norms show the head's
    gradient reached the optimizer, the export and the evaluation that the weights are the same."""
    layout_reference = layout_reference_zero3
    run_dir = tmp_path / "zero3_chunks"
    flags = layout_flags(run_dir, "zero3", "--loss_chunk_size", "7")
    flags[flags.index("--per_device_train_batch_size") + 1] = "2"  # 2 data-parallel ranks: the reference's 4 blocks
    proc = launch(REPO / "train.py", flags, "deepspeed", cache_dir, nprocs=2)
    check_ok(proc)
    assert "loss: through the LM head in chunks of 7 tokens" in proc.stdout + proc.stderr
    _assert_matches(run_dir, layout_reference)
    _assert_same_export(run_dir, layout_reference)
    evals = [[r["eval_loss"] for r in read_metrics(d) if "eval_loss" in r] for d in (run_dir, layout_reference)]
    assert evals[0] and evals[0] == pytest.approx(evals[1], rel=1e-5)


def _vocab_parallel_rank(rank: int, world: int, port: int) -> None:
    """One rank of a gloo group of `world`: its rows of a 41-row head (split 21/20, as AutoTP splits unevenly)
    through VocabParallelCrossEntropy equal the whole head's loss and gradients."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        hidden = torch.randn(23, 8, requires_grad=True)
        weight, bias = torch.randn(41, 8, requires_grad=True), torch.randn(41, requires_grad=True)
        targets = torch.randint(0, 41, (23,))
        targets[::4] = IGNORE_INDEX
        expected = F.cross_entropy(F.linear(hidden, weight, bias), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        expected_grads = torch.autograd.grad(expected * 2.5, (hidden, weight, bias))
        rows = [21, 20]
        start = sum(rows[:rank])
        mine = slice(start, start + rows[rank])
        shard = [t.detach()[mine].clone().requires_grad_() for t in (weight, bias)]
        leaves = (hidden.detach().clone().requires_grad_(), *shard)
        got = chunked_token_loss(leaves[0], *shard, targets, 6, vocab_shard=(dist.group.WORLD, start))
        got_hidden, got_weight, got_bias = torch.autograd.grad(got * 2.5, leaves)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(got_hidden, expected_grads[0], rtol=1e-5, atol=1e-6)  # summed over the ranks
        torch.testing.assert_close(got_weight, expected_grads[1][mine], rtol=1e-5, atol=1e-6)  # the rank's rows
        torch.testing.assert_close(got_bias, expected_grads[2][mine], rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_a_vocabulary_split_over_two_ranks_gives_the_whole_heads_loss_and_gradients():
    """Tensor parallelism's head (model/chunked_loss.py's VocabParallelCrossEntropy) on a real 2-rank gloo group:
    the softmax reduced over the ranks, each target's logit from the rank that holds its row, ignored tokens and a
    short last chunk."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_vocab_parallel_rank, args=(2, port), nprocs=2)
