"""Packing keeps every token; the global order is independent of world size; batches split as documented."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.data.blocks import EMPTY_SLOT, IGNORE_INDEX, MixedBlocks, PackedBlocks, blocks_from_store, eval_batches
from scaletrain.errors import UsageError
from scaletrain.config.values import parse_dataset_mix
from scaletrain.config.cli import parse_run_config
from scaletrain.data.sampling import GlobalOrder, StepBatches
from scaletrain.data.preparation import DEFAULT_SEED, prepare_token_store, store_fingerprint
from scaletrain.data.token_store import open_store
from tests.harness import REPO

TINY = REPO / "data" / "tiny-llama"


def write_docs(path, docs, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    elif fmt == "csv":
        import csv

        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "n"])
            w.writerows([d, i] for i, d in enumerate(docs))
    elif fmt == "txt":
        path.write_text("\n\n".join(docs))  # a blank line separates documents
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), path)


DOCS = [("word " * n).strip() + f" end{n}." for n in (3, 40, 7, 90, 1, 15, 60)]


def raw_cfg(tmp_path, *flags):
    """The data slice of a run with these flags (what the store side receives)."""
    return parse_run_config(
        [
            "--config",
            str(REPO / "ds_configs/zero2.json"),
            "--output_dir",
            str(tmp_path / "o"),
            "--validation_split_percentage",
            "0",
            *flags,
        ]
    ).data


def prepare(tmp_path, tokenizer, cfg, name="store", num_proc=1, block_size=16, seed=DEFAULT_SEED):
    cfg = dataclasses.replace(cfg, preprocessing_num_workers=num_proc)
    return prepare_token_store(cfg, tokenizer, str(TINY), block_size, tmp_path / name, show_progress=False, seed=seed)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "txt", "parquet"])
def test_every_token_of_every_document_is_stored_once(fmt, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"docs.{fmt}"
    write_docs(path, DOCS, fmt)
    store = prepare(tmp_path, tokenizer, raw_cfg(tmp_path, "--train_file", str(path)))
    opened = open_store(store)
    expected = [t for d in DOCS for t in tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]]
    assert opened["splits"]["train"].tokens.tolist() == expected  # nothing dropped or reordered, EOS after each
    assert opened["splits"]["train"].n_documents == len(DOCS)
    blocks = blocks_from_store(opened, "train", 16, isolate_documents=False)
    rows = blocks.batch(np.arange(len(blocks)))
    real = rows["labels"][rows["labels"] != IGNORE_INDEX]
    assert real.tolist() == expected  # every stored token reaches a training block exactly once per epoch


def test_globs_several_files_and_save_to_disk_folders(tmp_path, tokenizer, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    write_docs(tmp_path / "a.jsonl", DOCS[:3], "jsonl")
    write_docs(tmp_path / "b.jsonl", DOCS[3:], "jsonl")
    from_glob = open_store(
        prepare(tmp_path, tokenizer, raw_cfg(tmp_path, "--train_file", str(tmp_path / "*.jsonl")), "glob")
    )
    from_list = open_store(
        prepare(
            tmp_path,
            tokenizer,
            raw_cfg(tmp_path, "--train_file", f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"),
            "list",
        )
    )
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    from_disk = open_store(
        prepare(tmp_path, tokenizer, raw_cfg(tmp_path, "--dataset_name", str(tmp_path / "saved")), "disk")
    )
    expected = [t for d in DOCS for t in tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]]
    for opened in (from_glob, from_list, from_disk):
        assert opened["splits"]["train"].tokens.tolist() == expected


def test_store_is_the_same_for_any_number_of_processes(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # spawned tokenizer workers import scaletrain
    cfg = raw_cfg(tmp_path, "--train_file", str(REPO / "data/sample/validation.jsonl"))
    one = open_store(prepare(tmp_path, tokenizer, cfg, "one", num_proc=1))
    monkeypatch.setattr("scaletrain.data.token_store.MAX_TOKENIZER_THREADS", 1)  # num_proc 2 -> two worker processes
    two = open_store(prepare(tmp_path, tokenizer, cfg, "two", num_proc=2))
    assert one["splits"]["train"].tokens.tolist() == two["splits"]["train"].tokens.tolist()
    assert one["splits"]["train"].doc_starts.tolist() == two["splits"]["train"].doc_starts.tolist()


def test_fingerprint_reuse_mismatch_and_corruption(tmp_path, tokenizer, monkeypatch, caplog):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "docs.jsonl"
    write_docs(path, DOCS, "jsonl")
    cfg = raw_cfg(tmp_path, "--train_file", str(path))
    store = prepare(tmp_path, tokenizer, cfg)
    stamp = (store / "train.tokens.bin").stat().st_mtime_ns
    with caplog.at_level("INFO", logger="scaletrain"):
        prepare(tmp_path, tokenizer, cfg)  # same input: reused, not rewritten
    assert "reusing it" in caplog.text and (store / "train.tokens.bin").stat().st_mtime_ns == stamp
    with pytest.raises(UsageError, match="made from different input \\(block_size differ\\)"):
        prepare(tmp_path, tokenizer, cfg, block_size=32)
    write_docs(path, DOCS[:-1], "jsonl")  # the source changed: its hash no longer matches
    with pytest.raises(UsageError, match="source differ"):
        prepare(tmp_path, tokenizer, cfg)
    expected = store_fingerprint(cfg, tokenizer, 16)
    with pytest.raises(UsageError, match="prepared from different input"):
        open_store(store, expected)
    data = (store / "train.tokens.bin").read_bytes()
    (store / "train.tokens.bin").write_bytes(data[:-2])
    with pytest.raises(UsageError, match="truncated or corrupt"):
        open_store(store)
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["format_version"] = 99
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UsageError, match="format version 99"):
        open_store(store)
    assert not list(tmp_path.glob(".store.tmp-*"))  # no half-written store left behind


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


def test_the_cached_store_is_found_by_path_size_and_mtime_and_the_content_hashed_once(tmp_path, tokenizer, monkeypatch):
    """Every rank looks the store up at every start: by path, size and modification time, reading no content.
    The preparer hashes each file once and keeps the hash in the manifest; a file with a new mtime gets a new store."""
    import hashlib
    import os

    from scaletrain.data import token_store as tokenstore
    from scaletrain.data.preparation import ensure_token_store

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path / "stores"))
    path = tmp_path / "docs.jsonl"
    write_docs(path, DOCS, "jsonl")
    cfg = raw_cfg(tmp_path, "--train_file", str(path))
    hashed = []
    real_sha256 = tokenstore.file_sha256
    monkeypatch.setattr(tokenstore, "file_sha256", lambda p: hashed.append(Path(p)) or real_sha256(p))

    store = ensure_token_store(cfg, tokenizer, str(TINY), 16, 0, False)
    assert hashed == [path]  # once, by the preparer
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["source_sha256"] == {"train": {str(path.resolve()): hashlib.sha256(path.read_bytes()).hexdigest()}}
    hashed.clear()
    for local_rank in (0, 1):  # a restart of the preparing rank, and a rank that waits: the store is found as is
        assert ensure_token_store(cfg, tokenizer, str(TINY), 16, local_rank, False) == store
    assert hashed == []

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: it may have changed
    touched = ensure_token_store(cfg, tokenizer, str(TINY), 16, 0, False)
    assert touched != store and (touched / "manifest.json").exists() and hashed == [path]
    write_docs(path, DOCS[:-1], "jsonl")  # another size
    assert ensure_token_store(cfg, tokenizer, str(TINY), 16, 0, False) not in (store, touched)


def _held_out_docs(store, tokenizer) -> list:
    """The documents of a store's splits, as text, in stored order."""
    opened = open_store(store)
    out = {}
    for name, part in opened["splits"].items():
        ends = list(part.doc_starts[1:]) + [part.n_tokens]
        out[name] = [tokenizer.decode(part.tokens[s : e - 1]) for s, e in zip(part.doc_starts, ends, strict=True)]
    return out


CORPUS = [f"doc{i} " + " ".join(f"w{(i * 13 + j) % 97}" for j in range(5 + i % 11)) for i in range(200)]


def test_held_out_documents_are_drawn_at_random_by_the_seed_and_the_split_is_in_the_fingerprint(
    tmp_path, tokenizer, monkeypatch
):
    from scaletrain.data.preparation import default_store_path

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "docs.jsonl"
    write_docs(path, CORPUS, "jsonl")
    cfg = raw_cfg(tmp_path, "--train_file", str(path), "--validation_split_percentage", "10")

    def held_out(name, seed):
        store = prepare(tmp_path, tokenizer, cfg, name, seed=seed)
        return _held_out_docs(store, tokenizer)

    first, again, other = held_out("a", 7), held_out("b", 7), held_out("c", 8)
    assert len(first["validation"]) == 20 and len(first["train"]) == 180
    assert sorted(first["validation"] + first["train"]) == sorted(CORPUS)  # each document in exactly one split
    assert set(first["validation"]) != set(CORPUS[:20])  # not the first 5% (here 10%) of the corpus
    assert first["train"] == [d for d in CORPUS if d not in first["validation"]]  # training keeps the file's order
    assert first == again  # the same seed: the same split, on every rank and at every restart
    assert set(other["validation"]) != set(first["validation"])
    # Whatever decides the split is in the fingerprint: another seed, percentage or cap is another cached store.
    paths = {default_store_path(store_fingerprint(cfg, tokenizer, 16, seed)) for seed in (7, 8)}
    paths.add(
        default_store_path(
            store_fingerprint(
                raw_cfg(
                    tmp_path,
                    "--train_file",
                    str(path),
                    "--validation_split_percentage",
                    "10",
                    "--validation_split_max_tokens",
                    "100",
                ),
                tokenizer,
                16,
                7,
            )
        )
    )
    assert len(paths) == 3


@pytest.mark.parametrize("num_proc", [1, 2])
def test_the_held_out_split_is_capped_in_tokens(num_proc, tmp_path, tokenizer, monkeypatch):
    """--validation_split_max_tokens caps the held-out split (the documents that do not fit stay in training); with
    worker processes, the batches already sent when the cap is reached are dropped, not written."""
    import functools

    from scaletrain.data import token_store as tokenstore

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # spawned tokenizer workers import scaletrain
    monkeypatch.setattr(tokenstore, "MAX_TOKENIZER_THREADS", 1)  # num_proc 2 -> two worker processes
    monkeypatch.setattr(tokenstore, "write_store", functools.partial(tokenstore.write_store, batch_size=3))
    path = tmp_path / "docs.jsonl"
    write_docs(path, CORPUS, "jsonl")
    cfg = raw_cfg(
        tmp_path,
        "--train_file",
        str(path),
        "--validation_split_percentage",
        "50",
        "--validation_split_max_tokens",
        "150",
    )
    store = prepare(tmp_path, tokenizer, cfg, num_proc=num_proc)
    splits = open_store(store)["splits"]
    docs = _held_out_docs(store, tokenizer)
    assert 100 < splits["validation"].n_tokens <= 150  # the cap, not 50% of the corpus (about 3,000 tokens)
    assert len(docs["validation"]) < 100
    assert sorted(docs["validation"] + docs["train"]) == sorted(CORPUS)  # nothing lost, nothing twice
    assert not list(store.glob("*.indices.arrow"))


def test_a_negative_held_out_cap_is_refused(tmp_path):
    with pytest.raises(UsageError, match="--validation_split_max_tokens -1"):
        raw_cfg(tmp_path, "--validation_split_max_tokens", "-1")


def _arrow_files(folder: Path) -> list:
    return sorted(p for p in folder.rglob("*.arrow")) if folder.exists() else []


@pytest.mark.slow  # over 5 s: real processes (the fast tier stays under 3 minutes)
def test_preparing_local_files_leaves_no_copy_of_the_corpus_in_the_datasets_cache(tmp_path):
    """load_dataset converts local files to Arrow in the Hugging Face cache and keeps it there: a second full copy
    of the user's corpus. The preparer converts in a scratch folder and removes it once the store is written."""
    import subprocess
    import sys

    from tests.harness import child_env
    from tests.data.test_prepare_failures import PREPARE, prepare_argv, write_corpus

    corpus = write_corpus(tmp_path / "corpus.jsonl", 300)
    env = child_env(tmp_path)  # HF_DATASETS_CACHE: tmp_path / "datasets"
    proc = subprocess.run(
        [sys.executable, str(PREPARE), *prepare_argv(corpus, tmp_path / "store", "--num_proc", "1")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert open_store(tmp_path / "store")["splits"]["train"].n_documents == 300
    assert _arrow_files(tmp_path / "datasets") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "datasets", "store"]  # no lock, no scratch


@pytest.mark.slow  # two preparations in fresh processes, one killed half-way: 15-25 s
def test_a_preparer_killed_half_way_leaves_nothing_the_next_one_does_not_remove(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.harness import child_env
    from tests.data.test_prepare_failures import PREPARE, prepare_argv, write_corpus

    corpus = write_corpus(tmp_path / "corpus.jsonl", 60_000)
    env = child_env(tmp_path)
    argv = [sys.executable, str(PREPARE), *prepare_argv(corpus, tmp_path / "store", "--num_proc", "1")]
    first = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size for p in tmp_path.glob(".store.tmp-*/train.tokens.bin")):  # tokenizing
        assert first.poll() is None, first.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the preparation never started writing"
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    first.stderr.close()
    assert list(tmp_path.glob(".store.tmp-*")) and _arrow_files(tmp_path / "datasets")  # what a kill leaves

    second = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "left by a preparation that did not finish" in second.stdout + second.stderr
    assert open_store(tmp_path / "store")["splits"]["train"].n_documents == 60_000
    assert list(tmp_path.glob(".store.*")) == [] and _arrow_files(tmp_path / "datasets") == []


def test_a_hub_datasets_revision_is_in_the_store_fingerprint(tmp_path, tokenizer):
    """Two revisions of one hub dataset are two stores (the fingerprint is computed without the network)."""
    from scaletrain.data.preparation import default_store_path

    def store_for(*revision):
        cfg = raw_cfg(tmp_path, "--dataset_name", "someorg/corpus", *revision)
        return default_store_path(store_fingerprint(cfg, tokenizer, 16))

    stores = {store_for(), store_for("--dataset_revision", "v1"), store_for("--dataset_revision", "v2")}
    assert len(stores) == 3
    assert store_for("--dataset_revision", "v1") == store_for("--dataset_revision", "v1")
    with pytest.raises(UsageError, match="--dataset_revision v1: needs --dataset_name"):
        raw_cfg(tmp_path, "--dataset_revision", "v1")


def test_a_local_dataset_folder_is_fingerprinted_by_its_files_and_loaded_at_the_revision(tmp_path, tokenizer):
    """A folder of data files given as --dataset_name (the offline stand-in for a hub dataset: load_dataset reads
    both through the same builder, here with --dataset_revision passed on) is identified by its files, so an edited
    file gets a new store, as --train_file's do; no commit is recorded for it."""
    import os

    folder = tmp_path / "corpus"
    folder.mkdir()
    write_docs(folder / "train.jsonl", DOCS, "jsonl")
    cfg = raw_cfg(tmp_path, "--dataset_name", str(folder), "--dataset_revision", "v1")
    store = prepare(tmp_path, tokenizer, cfg, "store")
    opened = open_store(store)
    expected = [t for d in DOCS for t in tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]]
    assert opened["splits"]["train"].tokens.tolist() == expected
    source = opened["manifest"]["fingerprint"]["source"]
    assert source["kind"] == "folder" and [f["path"] for f in source["files"]] == ["train.jsonl"]
    assert "source_revision" not in opened["manifest"]
    stat = (folder / "train.jsonl").stat()
    os.utime(folder / "train.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert store_fingerprint(cfg, tokenizer, 16).differences(opened["manifest"]["fingerprint"]) == ["source"]
