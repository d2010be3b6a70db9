"""Packing keeps every token; the global order is independent of world size; batches split as documented."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from scaletrain.config import parse_run_config
from scaletrain.data import EMPTY_SLOT, IGNORE_INDEX, GlobalOrder, PackedBlocks, eval_batches, load_raw_datasets, \
    tokenize_and_pack
from tests.conftest import REPO


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "data" / "tiny-llama")


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


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "txt", "parquet"])
def test_every_token_of_every_document_is_packed_once(fmt, tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"docs.{fmt}"
    write_docs(path, DOCS, fmt)
    cfg = parse_run_config(["--config", str(REPO / "ds_configs/zero2.json"), "--train_file", str(path),
                            "--validation_split_percentage", "0", "--output_dir", str(tmp_path / "o")])
    train, val = load_raw_datasets(cfg)
    assert val is None and len(train) == len(DOCS)
    blocks = tokenize_and_pack(train, tokenizer, "text", 16, None, str(path))
    expected = [t for d in DOCS for t in tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]]
    stream = np.concatenate([blocks.tokens[i, : blocks.lengths[i]] for i in range(len(blocks))])
    assert stream.tolist() == expected  # nothing dropped, nothing reordered, EOS between documents
    assert blocks.lengths[:-1].tolist() == [16] * (len(blocks) - 1)
    assert blocks.n_documents == len(DOCS)


def test_last_partial_block_is_padded_and_masked():
    tokens = np.arange(3 * 4).reshape(3, 4)
    blocks = PackedBlocks(tokens, np.array([4, 4, 2]), n_documents=1, pad_id=99)
    batch = blocks.batch(np.array([2, EMPTY_SLOT]))
    assert batch["input_ids"].tolist() == [[8, 9, 99, 99], [99, 99, 99, 99]]
    assert batch["labels"].tolist() == [[8, 9, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX] * 4]
    assert blocks.targets_in(np.array([0, 2, EMPTY_SLOT])) == 3 + 1


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
    blocks = PackedBlocks(np.zeros((5, 4), dtype=np.int64), np.array([4, 4, 4, 4, 3]), 1, 0)
    per_rank = [eval_batches(blocks, batch_size=2, rank=r, world=2, limit=None) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 2
    real = sum(int((b["labels"] != IGNORE_INDEX).sum()) for batches in per_rank for b in batches)
    assert real == 19
