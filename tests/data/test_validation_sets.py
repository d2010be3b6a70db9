"""Several named evaluation sets (--validation_file name=path,...), each with its own loss.

The store keeps one split per set ("validation.<name>"); the run evaluates each one and logs eval_<name>_loss, the
loss of the model over that set's own blocks. Validation files also work beside a --dataset_name (they were ignored
there before).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from scaletrain.config.values import eval_metric_prefix, parse_validation_sets
from scaletrain.config.cli import parse_run_config
from scaletrain.errors import UsageError
from scaletrain.checkpoint.publish import final_losses
from scaletrain.data.preparation import prepare_token_store
from scaletrain.data.token_store import read_manifest
from tests.harness import REPO, check_ok, launch, read_metrics

TINY = REPO / "data" / "tiny-llama"
SAMPLE = REPO / "data" / "sample"


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """A small training file and two validation files of different documents (code docs from two halves)."""
    folder = tmp_path_factory.mktemp("sets")
    validation = SAMPLE.joinpath("validation.jsonl").read_text().splitlines()
    out = {"train": folder / "train.jsonl", "a": folder / "a.jsonl", "b": folder / "b.jsonl"}
    out["train"].write_text("\n".join(SAMPLE.joinpath("train.jsonl").read_text().splitlines()[:300]) + "\n")
    out["a"].write_text("\n".join(validation[:20]) + "\n")
    out["b"].write_text("\n".join(validation[-30:]) + "\n")
    return out


def test_plain_paths_are_one_set_and_named_items_one_set_each(tmp_path):
    one, two = tmp_path / "x.jsonl", tmp_path / "y.jsonl"
    assert parse_validation_sets(f"{one},{two}") == {"validation": [str(one), str(two)]}
    assert parse_validation_sets(f"chat={one}, code={two}") == {
        "validation.chat": [str(one)],
        "validation.code": [str(two)],
    }
    for a, b in ((1, 2), (2, 3)):
        (tmp_path / f"part{a}.jsonl").write_text("{}\n")
        (tmp_path / f"part{b}.jsonl").write_text("{}\n")
    assert parse_validation_sets(f"parts={tmp_path}/part*.jsonl")["validation.parts"] == [
        str(tmp_path / f"part{i}.jsonl") for i in (1, 2, 3)
    ]  # a glob joins files into one set
    assert parse_validation_sets(None) == {}
    assert eval_metric_prefix("validation") == "eval_" and eval_metric_prefix("validation.chat") == "eval_chat_"
    with pytest.raises(UsageError, match="has no set name, the others do"):
        parse_validation_sets(f"chat={one},{two}")
    with pytest.raises(UsageError, match="the set chat is named twice"):
        parse_validation_sets(f"chat={one},chat={two}")


def test_model_card_lists_each_sets_final_loss():
    rows = final_losses(
        {"step": 9, "loss": 2.5, "eval_chat_loss": 3.0, "eval_chat_perplexity": 20.1, "eval_code_loss": 4.0}
    )
    assert rows == [
        ("final training loss", 2.5),
        ("final evaluation loss (chat)", 3.0),
        ("final evaluation loss (code)", 4.0),
    ]
    assert final_losses({"eval_loss": 1.5, "eval_perplexity": 4.5}) == [("final evaluation loss", 1.5)]


def data_args(tmp_path, *flags):
    return parse_run_config(
        ["--config", str(REPO / "ds_configs/zero2.json"), "--output_dir", str(tmp_path / "o"), *flags]
    ).data


def test_store_holds_one_split_per_named_set(tmp_path, files):
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    data = data_args(
        tmp_path,
        "--train_file",
        str(files["train"]),
        "--validation_file",
        f"a={files['a']},b={files['b']}",
        "--preprocessing_num_workers",
        "1",
    )
    store = prepare_token_store(data, tokenizer, str(TINY), 64, tmp_path / "store", show_progress=False)
    splits = read_manifest(store)["splits"]
    assert set(splits) == {"train", "validation.a", "validation.b"}
    assert splits["validation.a"]["n_documents"] == lines(files["a"])
    assert splits["validation.b"]["n_documents"] == lines(files["b"])
    assert splits["train"]["n_documents"] == lines(files["train"])  # nothing held out of training


def test_validation_files_beside_a_dataset_name_are_evaluated(tmp_path, files):
    """A local dataset folder (as --dataset_name) and a --validation_file: the file is the validation split and no
    training document is held out. Before, the file was silently ignored and 5% of training held out instead."""
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text(files["train"].read_text())
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    data = data_args(
        tmp_path,
        "--dataset_name",
        str(folder),
        "--validation_file",
        str(files["b"]),
        "--preprocessing_num_workers",
        "1",
    )
    store = prepare_token_store(data, tokenizer, str(TINY), 64, tmp_path / "store", show_progress=False)
    manifest = read_manifest(store)
    assert manifest["splits"]["validation"]["n_documents"] == lines(files["b"])
    assert manifest["splits"]["train"]["n_documents"] == lines(files["train"])
    assert str(files["b"].resolve()) in json.dumps(manifest["fingerprint"]["source"])  # another file, another store


@pytest.mark.slow
def test_each_named_set_gets_its_own_loss_that_of_its_own_file(files, cache_dir, tmp_path):
    """A run with the named sets a and b: at each evaluation eval_a_loss and eval_b_loss, no eval_loss; the final
    ones equal the exported model's token-weighted loss over each set's own validation blocks, computed here with
    plain Hugging Face forwards; the model card lists both and the plot draws them."""
    import re

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from scaletrain.data.blocks import IGNORE_INDEX, blocks_from_store, eval_batches
    from scaletrain.data.token_store import open_store

    run = tmp_path / "named"
    proc = launch(
        REPO / "train.py",
        [
            "--config",
            "ds_configs/zero2.json",
            "--train_file",
            str(files["train"]),
            "--max_steps",
            "4",
            "--eval_steps",
            "2",
            "--logging_steps",
            "1",
            "--disable_tqdm",
            "--per_device_eval_batch_size",
            "4",
            "--output_dir",
            str(run),
            "--validation_file",
            f"a={files['a']},b={files['b']}",
        ],
        "python",
        cache_dir,
    )
    check_ok(proc)
    evals = [r for r in read_metrics(run) if any(k.startswith("eval_") for k in r)]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(
        {"eval_a_loss", "eval_b_loss", "eval_a_perplexity", "eval_b_perplexity"} <= set(r) and "eval_loss" not in r
        for r in evals
    )
    store = open_store(Path(re.search(r"token store\(s\): (\S+)", proc.stdout + proc.stderr).group(1)))
    block_size = store["manifest"]["fingerprint"]["block_size"]
    model = AutoModelForCausalLM.from_pretrained(run).eval()
    for name in ("a", "b"):
        blocks = blocks_from_store(store, f"validation.{name}", block_size, False)
        loss_sum, targets = 0.0, 0
        with torch.no_grad():
            for batch in eval_batches(blocks, batch_size=4, rank=0, world=1, limit=None):
                logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
                labels = batch["labels"][:, 1:]
                loss_sum += float(
                    F.cross_entropy(
                        logits.flatten(0, 1).double(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
                    )
                )
                targets += int((labels != IGNORE_INDEX).sum())
        assert targets > 0 and evals[-1][f"eval_{name}_loss"] == pytest.approx(loss_sum / targets, rel=1e-5), name
    assert abs(evals[-1]["eval_a_loss"] - evals[-1]["eval_b_loss"]) > 1e-3  # different documents
    card = (run / "README.md").read_text()
    assert "final evaluation loss (a)" in card and "final evaluation loss (b)" in card
    plot = subprocess.run(
        [sys.executable, str(REPO / "scripts/plot_metrics.py"), str(run)], capture_output=True, text=True
    )
    assert plot.returncode == 0, plot.stderr


def test_a_chat_store_keeps_a_mask_for_each_named_set(tmp_path, monkeypatch):
    from scaletrain.data.chat_store import prepare_chat_store, resolve_chat_data
    from tests.data.test_chat_store import BLOCK, CHATS, MISTRAL

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    data = data_args(
        tmp_path,
        "--train_file",
        str(CHATS),
        "--chat_template",
        str(MISTRAL),
        "--assistant_only_loss",
        "--validation_file",
        f"chat={CHATS}",
    )
    store = prepare_chat_store(
        data,
        tokenizer=tokenizer,
        block_size=BLOCK,
        store=tmp_path / "store",
        chat=resolve_chat_data(data, tokenizer),
        show_progress=False,
    )
    splits = read_manifest(store)["splits"]
    assert set(splits) == {"train", "validation.chat"}
    assert splits["validation.chat"] == splits["train"]  # the same file: the same tokens and trained tokens
    assert 0 < splits["train"]["n_trained_tokens"] < splits["train"]["n_tokens"]
    assert (store / "validation.chat.mask.bin").stat().st_size == splits["train"]["n_tokens"]
