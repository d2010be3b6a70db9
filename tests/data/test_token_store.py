"""The token store: every token of every document stored once (any file format, globs, lists, save_to_disk folders,
any number of processes), its fingerprint (reuse, a mismatch, corruption, a hub revision, a local folder), the
cached store found by path, size and mtime, the held-out split drawn by the seed and capped in tokens, and no copy of
the corpus left in the datasets cache, even by a preparer killed half-way."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from scaletrain.data.blocks import IGNORE_INDEX, blocks_from_store
from scaletrain.errors import UsageError
from scaletrain.config.cli import parse_run_config
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
