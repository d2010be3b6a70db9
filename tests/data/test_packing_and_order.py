"""Packing and the order of batches: a partial block padded and masked, documents kept apart in attention (each
backend that runs on a CPU), the global order independent of world size, seekable at any step and resumable with
another batch size, dataset mixes, and evaluation batches (the same count on every rank, read lazily)."""

import math

import numpy as np
import pytest
import torch

from scaletrain.data.blocks import EMPTY_SLOT, IGNORE_INDEX, MixedBlocks, PackedBlocks, eval_batches
from scaletrain.errors import UsageError
from scaletrain.config.values import parse_dataset_mix
from scaletrain.data.sampling import GlobalOrder, StepBatches
from tests.harness import REPO

TINY = REPO / "data" / "tiny-llama"


def test_last_partial_block_is_padded_and_masked():
    blocks = PackedBlocks(np.arange(10), np.array([0]), block_size=4, pad_id=99)
    assert len(blocks) == 3 and blocks.last_block_length == 2
    batch = blocks.batch(np.array([2, EMPTY_SLOT]))
    assert batch["input_ids"].tolist() == [[8, 9, 99, 99], [99, 99, 99, 99]]
    assert batch["labels"].tolist() == [[8, 9, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX] * 4]
    assert blocks.targets_in(np.array([0, 2, EMPTY_SLOT])) == 3 + 1


def test_isolation_position_ids_restart_at_documents_and_blocks():
    blocks = PackedBlocks(np.arange(12), np.array([0, 3, 9]), block_size=6, pad_id=0, isolate_documents=True)
    batch = blocks.batch(np.array([0, 1]))
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2]]


@pytest.mark.parametrize(
    "attn,micro",
    [
        ("sdpa", 1),
        ("sdpa", 4),
        ("eager", 1),
        ("eager", 4),
        pytest.param("flex_attention", 1, marks=pytest.mark.slow),  # flex compiles its kernel on the CPU: ~30 s
        pytest.param("flex_attention", 4, marks=[pytest.mark.slow, pytest.mark.extended]),  # ~40 s
    ],
)
def test_attention_isolation_matches_each_document_run_alone(attn, micro, tokenizer):
    """Logits of packed blocks with isolation equal each document's logits computed on its own, for each attention
    backend that runs on a CPU, in a micro-batch of 1 and of 4 (rows that cut the documents at other places)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY), attn_implementation=attn).eval()
    assert model.config._attn_implementation == attn
    _check_isolated_pieces_equal_each_alone(model, tokenizer, micro)


def test_attention_isolation_is_exact_with_the_backend_transformers_picks_for_gemma2(tokenizer):
    """--attn_implementation left unset: Gemma-2 (soft-capped attention, sliding-window layers) gets the backend
    transformers picks for it, and packed documents stay isolated with it, as the run's default promises."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,  # shorter than the documents: the window and the isolation combine
        pad_token_id=2,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.config._attn_implementation in ("sdpa", "eager")
    _check_isolated_pieces_equal_each_alone(model, tokenizer, 4)


def _check_isolated_pieces_equal_each_alone(model, tokenizer, micro: int) -> None:
    import torch

    texts = (
        "A short one.",
        "Then a longer document follows here, with more words.",
        "End.",
        "And a fourth one, of middling length.",
        "Five.",
    )
    docs = [tokenizer(d)["input_ids"] + [tokenizer.eos_token_id] for d in texts]
    stream = np.array([t for d in docs for t in d])
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    block = len(stream) // 2
    isolated = PackedBlocks(stream, starts, block_size=block, pad_id=0, isolate_documents=True)
    rows = np.array([i % len(isolated) for i in range(micro)])  # micro 4: both blocks, twice
    batch = isolated.batch(rows)
    with torch.no_grad():
        # use_cache=False as in training: transformers builds the per-document mask only without a KV cache
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        plain = model(input_ids=batch["input_ids"], use_cache=False).logits
        checked = 0
        for row in range(micro):
            positions = batch["position_ids"][row].tolist()
            piece_starts = [i for i, p in enumerate(positions) if p == 0] + [block]
            for begin, end in zip(piece_starts[:-1], piece_starts[1:], strict=True):
                ids = batch["input_ids"][row, begin:end]
                # the piece of a document inside this block, run alone (a document cut at the block's end starts
                # its next block at position 0, so each piece is its own sequence)
                alone = model(input_ids=ids.unsqueeze(0), use_cache=False).logits[0]
                torch.testing.assert_close(packed[row, begin:end], alone, rtol=1e-4, atol=1e-4)
                checked += 1
        assert checked >= 2 * micro  # every row holds pieces of at least two documents
    mixed = max(float((plain[r] - packed[r]).abs().max()) for r in range(micro))
    assert mixed > 1e-3  # without isolation, documents do mix


def test_flash_attention_keeps_documents_apart_only_in_batches_of_one():
    from scaletrain.errors import UsageError
    from scaletrain.model.build import check_attention_isolation

    check_attention_isolation("flash_attention_2", True, 1, 1)
    check_attention_isolation("sdpa", True, 8, 8)
    check_attention_isolation("flash_attention_2", False, 8, 8)
    with pytest.raises(UsageError, match="flash attention separates documents only in a batch of 1"):
        check_attention_isolation("flash_attention_3", True, 1, 8)  # the evaluation batch counts too


def test_seeking_to_any_step_costs_the_same(monkeypatch):
    """O(1) seek: the batch of step s comes from s alone; no earlier step is replayed, whatever s is."""
    blocks = PackedBlocks(np.arange(64 * 1000), np.array([0]), block_size=64, pad_id=0)
    order = GlobalOrder(len(blocks), micro_batch=4, accumulation=2, dp_world_size=2, seed=1)
    calls = []
    original = GlobalOrder.epoch_permutation
    monkeypatch.setattr(GlobalOrder, "epoch_permutation", lambda self, e: calls.append(e) or original(self, e))
    for step in (10, 10_000_000):
        calls.clear()
        micro, targets, n_blocks = StepBatches(blocks, order, rank=1).for_step(step)
        assert calls == [step // order.steps_per_epoch]  # one permutation, of that step's epoch only
        assert n_blocks == 16 and targets == 16 * 63
        expected = order.micro_batches(order.global_batch_indices(step), 1)
        assert [m["input_ids"][:, 0].tolist() for m in micro] == [(e * 64).tolist() for e in expected]


@pytest.mark.parametrize("micro, accumulation, world", [(4, 1, 2), (2, 2, 2), (1, 8, 1), (8, 1, 1)])
def test_global_batches_are_the_same_blocks_whatever_the_split(micro, accumulation, world):
    reference = GlobalOrder(n_blocks=37, micro_batch=8, accumulation=1, dp_world_size=1, seed=3)
    order = GlobalOrder(n_blocks=37, micro_batch=micro, accumulation=accumulation, dp_world_size=world, seed=3)
    assert order.steps_per_epoch == reference.steps_per_epoch == 5  # ceil(37 / 8): the tail is not dropped
    seen = []
    for step in range(order.steps_per_epoch):
        indices = order.global_batch_indices(step)
        assert indices.tolist() == reference.global_batch_indices(step).tolist()
        per_rank = [np.concatenate(order.micro_batches(indices, r)) for r in range(world)]
        union = np.concatenate(per_rank)
        assert sorted(union.tolist()) == sorted(indices.tolist())  # ranks read disjoint parts of the batch
        seen += [i for i in indices.tolist() if i != EMPTY_SLOT]
    assert sorted(seen) == list(range(37))  # one epoch: every block exactly once


def test_order_depends_on_seed_and_epoch():
    order = GlobalOrder(50, 5, 1, 1, seed=1)
    assert order.epoch_permutation(0).tolist() != order.epoch_permutation(1).tolist()
    assert order.epoch_permutation(0).tolist() == GlobalOrder(50, 5, 1, 1, seed=1).epoch_permutation(0).tolist()
    assert order.epoch_permutation(0).tolist() != GlobalOrder(50, 5, 1, 1, seed=2).epoch_permutation(0).tolist()


def test_eval_batches_give_every_rank_the_same_count():
    blocks = PackedBlocks(np.zeros(19, dtype=np.int64), np.array([0]), block_size=4, pad_id=0)
    per_rank = [eval_batches(blocks, batch_size=2, rank=r, world=2, limit=None) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 2
    real = sum(int((b["labels"] != IGNORE_INDEX).sum()) for batches in per_rank for b in batches)
    assert real == 19


def test_dataset_mix_proportions_are_exact_deterministic_and_world_size_free():
    a = PackedBlocks(np.arange(100 * 8), np.array([0]), block_size=8, pad_id=0)
    b = PackedBlocks(10_000 + np.arange(30 * 8), np.array([0]), block_size=8, pad_id=0)
    mixed = MixedBlocks([a, b], [0.7, 0.3], seed=5, period=100)
    order = GlobalOrder(len(mixed), micro_batch=2, accumulation=1, dp_world_size=2, seed=5)
    sources = []
    for step in range(order.steps_per_epoch):
        for j in order.global_batch_indices(step):
            if j != EMPTY_SLOT:
                sources.append(mixed.locate(j)[0])
    assert len(sources) == 130
    assert abs(sources.count(0) / 130 - 0.7) <= 0.01  # exact up to one period's rounding
    # b (30 blocks) is drawn 39 times: one full cycle over its blocks, then a fresh permutation
    drawn_b = [mixed.locate(j)[1] for j in range(130) if mixed.locate(j)[0] == 1]
    assert sorted(drawn_b[:30]) == list(range(30))
    again = MixedBlocks([a, b], [0.7, 0.3], seed=5, period=100)
    assert [again.locate(j) for j in range(130)] == [mixed.locate(j) for j in range(130)]
    row = mixed.batch(np.array([0, EMPTY_SLOT]))
    k, block = mixed.locate(0)
    assert row["input_ids"][0].tolist() == [a, b][k].batch(np.array([block]))["input_ids"][0].tolist()
    assert row["labels"][1].tolist() == [IGNORE_INDEX] * 8


def test_parse_dataset_mix_normalises_and_rejects_bad_weights():
    assert parse_dataset_mix("x:3,y:1") == [("x", 0.75), ("y", 0.25)]
    for bad in ("x:0.5", "x:abc,y:1", "x:-1,y:1", "x,y"):
        with pytest.raises(UsageError, match="--dataset_mix"):
            parse_dataset_mix(bad)


def test_resumed_order_reproduces_the_batches_or_continues_the_epoch_with_a_new_batch_size():
    full = GlobalOrder(n_blocks=37, micro_batch=2, accumulation=2, dp_world_size=2, seed=4)  # global batch 8
    consumed = 3 * 8  # three steps into epoch 0
    same = GlobalOrder(37, 2, 2, 2, seed=4, start_step=3, start_samples=consumed)
    for step in range(3, 15):
        assert same.global_batch_indices(step).tolist() == full.global_batch_indices(step).tolist()
    assert same.total_steps(3.0) == full.total_steps(3.0) == 15
    # on one rank with global batch 4: the rest of epoch 0 in the same order, then epoch 1 from its start
    resharded = GlobalOrder(37, 2, 2, 1, seed=4, start_step=3, start_samples=consumed)
    rest = [i for step in range(3, 7) for i in resharded.global_batch_indices(step).tolist() if i != EMPTY_SLOT]
    assert rest == full.epoch_permutation(0)[consumed:].tolist()
    assert resharded.position(7) == (1, 0)
    assert resharded.total_steps(1.0) == 7 and resharded.total_steps(2.0) == 7 + 10


def test_eval_batches_read_the_store_lazily_and_equal_the_blocks(tmp_path):
    """The evaluation set holds block indices, not the split as tensors: building it for a 4M-token split
    allocates well under the 64 MB its int64 inputs and labels would take, and each batch read is the very
    tensors the blocks give for those indices (so the evaluation loss is unchanged)."""
    import tracemalloc

    n_tokens = 4_000_000
    stream = np.memmap(tmp_path / "validation.tokens.bin", dtype=np.uint16, mode="w+", shape=(n_tokens,))
    stream[:] = np.arange(n_tokens) % 5000
    stream.flush()
    blocks = PackedBlocks(
        np.memmap(tmp_path / "validation.tokens.bin", dtype=np.uint16, mode="r"),
        np.array([0, 1000, 123_457]),
        block_size=64,
        pad_id=0,
        isolate_documents=True,
    )
    tracemalloc.start()
    try:
        batches = eval_batches(blocks, batch_size=8, rank=1, world=2, limit=None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"building the evaluation set allocated {peak / 2**20:.0f} MiB"
    assert len(batches) == math.ceil(math.ceil(len(blocks) / 2) / 8)
    owned = np.arange(1, len(blocks), 2)
    for i in (0, 1, len(batches) - 1):
        expected = blocks.batch(owned[i * 8 : (i + 1) * 8])
        got = batches[i]
        assert set(got) == set(expected) == {"input_ids", "labels", "position_ids"}
        for key in expected:
            assert torch.equal(got[key], expected[key]), key
    assert batches.targets() == sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
