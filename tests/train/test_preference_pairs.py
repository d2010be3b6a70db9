"""Preference pairs in-process (DPO and relatives): pairs prepared into a store exactly as render_pair makes them, a
pair's two sequences in one micro-batch, padding-free log-probs, ORPO's loss as TRL computes it on any split of the
batch, long pairs cut or dropped, the reference cache's file and key, and the bad inputs refused before anything is
prepared. The real runs: tests/train/test_preference.py."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from scaletrain.config.cli import parse_run_config
from scaletrain.data.blocks import EMPTY_SLOT, IGNORE_INDEX
from scaletrain.data.chat_store import attach_masks, prepare_chat_store, resolve_chat_data
from scaletrain.data.pairs import pairs_from_store
from scaletrain.data.preference_render import render_pair
from scaletrain.data.token_store import open_store
from tests.harness import REPO
from tests.helpers import preference_data
from tests.helpers.bad_input import tree_digest

TINY = REPO / "data" / "tiny-llama"
FORMATS = {
    "explicit_text": preference_data.explicit_text,
    "explicit_conversational": preference_data.explicit_conversational,
    "implicit_conversational": preference_data.implicit_conversational,
}


def prepared(tmp_path: Path, tokenizer, train_file: Path, *flags: str):
    """(the opened store, its ChatData, the rows) of a preference file prepared as a run prepares it."""
    cfg = parse_run_config(["--train_file", str(train_file), "--validation_split_percentage", "0", *flags])
    chat = resolve_chat_data(cfg.data, tokenizer)
    store = prepare_chat_store(
        cfg.data, tokenizer=tokenizer, block_size=64, store=tmp_path / "store", chat=chat, show_progress=False
    )
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    return attach_masks(open_store(store), store), chat, rows


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_store_holds_each_pair_as_render_pair_makes_it_and_batches_keep_pairs_together(
    fmt, tmp_path, tokenizer, offline
):
    template = [] if fmt == "explicit_text" else ["--chat_template", str(preference_data.CHAT_TEMPLATE)]
    opened, chat, rows = prepared(tmp_path, tokenizer, FORMATS[fmt](tmp_path / "pairs.jsonl", n=12), *template)
    assert chat.kind == "preference" and (chat.template is None) == (fmt == "explicit_text")
    assert opened["manifest"]["chat_kind"] == "preference"
    pairs = pairs_from_store(opened, split="train", block_size=1024, truncation="truncate")
    assert len(pairs) == len(rows) == pairs.n_split_pairs
    batch = pairs.batch(np.array([3, EMPTY_SLOT, 0]))
    assert batch["pair_ids"].tolist() == [3, -1, 0]
    assert batch["input_ids"].shape[0] == 6  # chosen rows, then rejected rows
    for slot, index in ((0, 3), (2, 0)):
        chosen, rejected = render_pair(rows[index], tokenizer, chat.template, index)
        for row, expected in ((slot, chosen), (3 + slot, rejected)):
            n = len(expected.input_ids)
            assert batch["input_ids"][row, :n].tolist() == expected.input_ids
            trained = [t if m else IGNORE_INDEX for t, m in zip(expected.input_ids, expected.loss_mask, strict=True)]
            assert batch["labels"][row, :n].tolist() == trained
            assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
    assert (batch["labels"][[1, 4]] == IGNORE_INDEX).all()  # the empty slot: two rows of padding, no loss
    assert pairs.targets_in(np.array([3, EMPTY_SLOT, 0])) == 2  # the normaliser counts pairs


def test_a_save_to_disk_folder_and_a_parquet_file_give_the_jsonl_files_store(tmp_path, tokenizer, offline):
    """Pairs as message lists (nested columns through Arrow) from a `save_to_disk` folder (--dataset_name) and from a
    parquet file: the same store, token for token and mask for mask, as from the JSON-lines file."""
    import datasets

    rows_file = preference_data.explicit_conversational(tmp_path / "pairs.jsonl", n=10)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pairs.parquet"))
    template = ("--chat_template", str(preference_data.CHAT_TEMPLATE))

    def store(name: str, *source: str):
        cfg = parse_run_config([*source, "--validation_split_percentage", "0", *template])
        chat = resolve_chat_data(cfg.data, tokenizer)
        assert chat.kind == "preference", name
        made = prepare_chat_store(
            cfg.data, tokenizer=tokenizer, block_size=64, store=tmp_path / name, chat=chat, show_progress=False
        )
        pairs = pairs_from_store(
            attach_masks(open_store(made), made), split="train", block_size=1024, truncation="truncate"
        )
        return pairs.batch(np.arange(len(pairs)))

    expected = store("jsonl", "--train_file", str(rows_file))
    assert expected["input_ids"].shape[0] == 2 * len(rows)
    for name, source in (
        ("disk", ("--dataset_name", str(tmp_path / "saved"))),
        ("parquet", ("--train_file", str(tmp_path / "pairs.parquet"))),
    ):
        got = store(name, *source)
        for key in ("input_ids", "labels"):
            assert torch.equal(got[key], expected[key]), (name, key)


@pytest.mark.parametrize("chunked", [True, False])
def test_padding_free_batches_give_the_padded_batches_log_probs_and_gradients(chunked, tmp_path, tokenizer, offline):
    """--padding_free: a micro-batch's sequences as one row, positions restarting per sequence: each sequence's
    summed completion log-probs and token count, and the gradients, as from the padded rows (sdpa keeps attention
    within each sequence); an empty slot has none, and a micro-batch of empty slots still runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from scaletrain.model.chunked_loss import install_chunked_loss
    from scaletrain.train.preference import row_logps

    opened, _, _ = prepared(tmp_path, tokenizer, preference_data.explicit_text(tmp_path / "p.jsonl", n=8))
    padded = pairs_from_store(opened, split="train", block_size=1024, truncation="truncate")
    packed = pairs_from_store(opened, split="train", block_size=1024, truncation="truncate", padding_free=True)
    indices = np.array([3, EMPTY_SLOT, 0, 5])
    flat = packed.batch(indices)
    assert flat["input_ids"].shape[0] == 1 and flat["input_ids"].numel() == padded.tokens_in(indices)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY, attn_implementation="sdpa")
    models = [AutoModelForCausalLM.from_config(config) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for model in models:
        install_chunked_loss(model, 16 if chunked else 0)
    weights = torch.linspace(-1.0, 1.5, 8)
    results = []
    for model, batch in zip(models, (padded.batch(indices), flat), strict=True):
        logps, counts = row_logps(model, batch, "cpu")
        (logps * weights).sum().backward()
        results.append((logps, counts, {n: p.grad for n, p in model.named_parameters()}))
    (want, want_counts, want_grads), (got, got_counts, got_grads) = results
    assert torch.equal(got_counts, want_counts) and want_counts[[1, 5]].tolist() == [0, 0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4) and (want[[0, 2, 3]] < 0).all()
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-7, name
    empty = packed.batch(np.array([EMPTY_SLOT, EMPTY_SLOT]))
    logps, counts = row_logps(models[1], empty, "cpu")
    assert logps.tolist() == [0.0] * 4 and counts.tolist() == [0] * 4


@pytest.mark.parametrize("chunked", [True, False])
def test_orpo_is_trls_loss_on_any_split_of_the_batch_and_either_layout(chunked, tmp_path, tokenizer, offline):
    """ORPO as TRL 1.16's ORPOTrainer computes it on one batch, by hand from the model's logits: the cross-entropy
    over every target of the whole chosen sequences (prompts included, TRL's token mean over the batch) less beta
    times the mean log-sigmoid of the completions' log odds ratio. The objective gives it, divided by the batch's
    pairs as the loop divides, on the padded and the padding-free layout, whole or split into micro-batches that
    carry the step's counts; TRL's nll_loss is logged too."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from scaletrain.model.chunked_loss import install_chunked_loss
    from scaletrain.train.preference import PreferenceObjective
    from scaletrain.train.preference_loss import PreferenceLoss

    opened, _, _ = prepared(tmp_path, tokenizer, preference_data.explicit_text(tmp_path / "p.jsonl", n=8))
    padded = pairs_from_store(opened, split="train", block_size=1024, truncation="truncate")
    packed = pairs_from_store(opened, split="train", block_size=1024, truncation="truncate", padding_free=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY, attn_implementation="sdpa"))
    install_chunked_loss(model, 16 if chunked else 0)
    beta, step = 0.25, np.array([3, 0, 5, 6])
    # TRL's computation, from the whole logits of the padded batch.
    batch = padded.batch(step)
    n, real_tokens = len(step), batch["sequence_labels"] != IGNORE_INDEX
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits.float()
    chosen_targets = batch["sequence_labels"][:n][:, 1:]
    nll = F.cross_entropy(logits[:n, :-1].reshape(-1, logits.shape[-1]), chosen_targets.reshape(-1))
    token_logps = logits[:, :-1].log_softmax(-1).gather(-1, batch["labels"][:, 1:].clamp(min=0)[..., None])[..., 0]
    completion = batch["labels"][:, 1:] != IGNORE_INDEX
    mean_logps = (token_logps * completion).sum(-1) / completion.sum(-1)
    chosen, rejected = mean_logps[:n], mean_logps[n:]
    log_odds = (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))
    trl_loss = nll - beta * F.logsigmoid(log_odds).mean()
    assert real_tokens[:n].sum() - n == padded.sequence_targets_in(step) and not real_tokens[n:].any()

    objective = PreferenceObjective(PreferenceLoss("orpo", beta=beta))
    for pairs in (padded, packed):
        shared = pairs.step_fields(step)
        assert shared["step_pairs"].item() == 4
        for micro_batches in ([step], [step[:1], step[1:]], [step[:2], np.array([EMPTY_SLOT]), step[2:]]):
            with torch.no_grad():
                results = [objective(model, {**pairs.batch(m), **shared}) for m in micro_batches]
            loss = sum(summed for summed, _ in results) / 4
            assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-5), (pairs.padding_free, len(micro_batches))
            logged = sum(metrics["nll_loss"] for _, metrics in results) / 4
            assert logged.item() == pytest.approx(nll.item(), rel=1e-5)
    with pytest.raises(RuntimeError, match="step_sequence_targets"):  # a batch without its step's counts
        objective(model, padded.batch(step))


def test_a_long_pair_loses_its_prompt_start_or_is_dropped_and_counted(tmp_path, tokenizer, offline):
    opened, chat, rows = prepared(tmp_path, tokenizer, preference_data.explicit_text(tmp_path / "p.jsonl", n=12))
    whole = pairs_from_store(opened, split="train", block_size=1024, truncation="truncate")
    lengths = whole.lengths.reshape(-1, 2).max(axis=1)
    block = int(np.sort(lengths)[len(lengths) // 2])  # about half the pairs are longer
    long_pairs = int((lengths > block).sum())
    cut = pairs_from_store(opened, split="train", block_size=block, truncation="truncate")
    assert len(cut) == 12 and cut.truncated >= long_pairs > 0 and cut.lengths.max() <= block
    for r in np.flatnonzero(whole.lengths > block):  # the completion whole, the prompt's start gone
        completion = whole.tokens[whole.starts[r] + whole.completion_at[r] : whole.starts[r] + whole.lengths[r]]
        kept = cut.tokens[cut.starts[r] + cut.completion_at[r] : cut.starts[r] + cut.lengths[r]]
        assert kept.tolist() == completion.tolist()
        assert cut.completion_at[r] == block - len(completion)
    dropped = pairs_from_store(opened, split="train", block_size=block, truncation="drop")
    assert dropped.dropped == long_pairs and len(dropped) == 12 - long_pairs
    assert all(lengths[p] <= block for p in dropped.kept)


def _row(chosen, rejected, prompt="Question: 1 plus 1? Answer:"):
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


GOOD = [_row(" 2.", " 3.")] * 5
CHAT_PROMPT = [{"role": "user", "content": "1 plus 1?"}]
BAD_INPUT = {
    # name: (rows of the train file or None, extra flags, text the error line must contain)
    "chosen without rejected": ([{"prompt": "p", "chosen": " a"}] * 4, [], "no rejected"),
    "identical pair deep in the file": (GOOD + [_row(" 2.", " 2.")], [], "pairs.jsonl: example 5"),
    "empty completion": (GOOD + [_row("", " 3.")], [], "example 5"),
    "implicit prompts that differ": (
        [
            {
                "chosen": [*CHAT_PROMPT, {"role": "assistant", "content": "2"}],
                "rejected": [{"role": "user", "content": "2 plus 2?"}, {"role": "assistant", "content": "3"}],
            }
        ]
        * 4,
        ["--chat_template", str(preference_data.CHAT_TEMPLATE)],
        "example 0",
    ),
    "files of mixed formats": (GOOD, ["--validation_file", "CONVERSATIONAL"], "files of mixed formats"),
    "label smoothing on sigmoid": (GOOD, ["--label_smoothing", "0.1"], "--label_smoothing with --loss_type sigmoid"),
    "preference flag on text": (None, ["--beta", "0.2"], "--beta: only acts on preference data"),
    "padding-free on text": (None, ["--padding_free"], "--padding_free: only acts on preference data"),
    "padding-free on a model without position ids": (
        GOOD,
        ["--config_name", "BLOOM", "--tokenizer_name", str(TINY), "--padding_free"],
        "--padding_free: BloomForCausalLM takes no position_ids",
    ),
    "live reference of a model trained from scratch": (
        GOOD,
        ["--config_name", str(TINY), "--no-precompute_ref_log_probs"],
        "no reference model to run",
    ),
    "reference model for a reference-free loss": (
        GOOD,
        ["--loss_type", "simpo", "--ref_model_name_or_path", str(TINY)],
        "a reference-free loss reads no reference",
    ),
    "reference model of another vocabulary": (GOOD, ["--ref_model_name_or_path", "OTHER_VOCAB"], "a vocabulary of 64"),
    "preference data under pipeline parallelism": (GOOD, ["--pipeline_parallel_size", "2"], "--pipeline_parallel_size"),
}


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_preference_input_is_one_line_exit_2_and_prepares_nothing(name, tmp_path, offline, capsys):
    from train import main

    rows, flags, expected = BAD_INPUT[name]
    data = []
    if rows is not None:
        path = tmp_path / "pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        data = ["--train_file", str(path), "--validation_split_percentage", "0"]
    if "OTHER_VOCAB" in flags:  # a model folder whose config has another vocabulary
        config = json.loads((TINY / "config.json").read_text())
        (tmp_path / "other_vocab").mkdir()
        (tmp_path / "other_vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": 64}))
        flags = [str(tmp_path / "other_vocab") if f == "OTHER_VOCAB" else f for f in flags]
    if "BLOOM" in flags:  # a model whose forward takes no position ids (ALiBi)
        from transformers import BloomConfig

        vocab = len(AutoTokenizer.from_pretrained(TINY))
        BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=vocab).save_pretrained(tmp_path / "bloom")
        flags = [str(tmp_path / "bloom") if f == "BLOOM" else f for f in flags]
    if "CONVERSATIONAL" in flags:  # a validation file of message lists beside a train file of text
        conversational = preference_data.explicit_conversational(tmp_path / "conversational.jsonl", n=4)
        flags = [str(conversational) if f == "CONVERSATIONAL" else f for f in flags]
    out = tmp_path / "out"
    before = tree_digest(out)
    try:
        code = main(["--config", str(REPO / "ds_configs/zero2.json"), "--output_dir", str(out), *data, *flags])
    except BaseException:
        pytest.fail(f"{name}: raised instead of a clean error:\n{traceback.format_exc()}")
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith(("train.py", "  hint"))]
    assert code == 2 and 1 <= len(err) <= 2 and err[0].startswith("train.py: error: "), err
    assert expected in err[0], err
    assert tree_digest(out) == before
    stores = tmp_path / "cache" / "scaletrain" / "token_stores"
    assert not any((p / "manifest.json").exists() or p.name.startswith(".") for p in stores.glob("*"))


def test_a_resumed_run_without_its_reference_file_stops_naming_it(tmp_path, tokenizer, offline):
    from scaletrain.errors import UsageError
    from scaletrain.train.reference import ReferencePass, attach_reference_logps, reference_file

    opened, _, _ = prepared(tmp_path, tokenizer, preference_data.explicit_text(tmp_path / "p.jsonl", n=4))
    pairs = pairs_from_store(opened, split="train", block_size=1024, truncation="truncate")
    identity = {"model": {"source": "x"}, "precision": "fp32", "block_size": 1024, "truncation": "truncate"}
    with pytest.raises(UsageError) as caught:
        attach_reference_logps(
            None, sets={"train": pairs}, ref=ReferencePass(tmp_path / "store", identity, 4), dist=None, fresh=False
        )
    assert str(reference_file(tmp_path / "store", "train", identity)) in caught.value.message
    assert "--resume_from_checkpoint none" in caught.value.hint


@pytest.mark.parametrize("damage", ["another shape", "a torn file", "a record of another reference"])
def test_a_damaged_reference_cache_is_never_trusted(tmp_path, tokenizer, offline, caplog, damage):
    """A fresh run computes a damaged file again (it reads it as missing); a resumed run, which cannot, stops naming
    the file and what is wrong with it."""
    from scaletrain.errors import UsageError
    from scaletrain.train.reference import ReferencePass, _save, attach_reference_logps, reference_file

    opened, _, _ = prepared(tmp_path, tokenizer, preference_data.explicit_text(tmp_path / "p.jsonl", n=4))
    pairs = pairs_from_store(opened, split="train", block_size=1024, truncation="truncate")
    identity = {"model": {"source": "x"}, "precision": "fp32", "block_size": 1024, "truncation": "truncate"}
    path = reference_file(tmp_path / "store", "train", identity)
    good = np.zeros((pairs.n_split_pairs, 2))
    if damage == "another shape":
        _save(path, np.zeros((pairs.n_split_pairs + 1, 2)), identity)
    elif damage == "a torn file":
        _save(path, good, identity)
        path.write_bytes(path.read_bytes()[:40])
    else:
        _save(path, good, {**identity, "precision": "bf16"})
    with caplog.at_level("WARNING", logger="scaletrain.train.reference"), pytest.raises(UsageError) as caught:
        attach_reference_logps(
            None, sets={"train": pairs}, ref=ReferencePass(tmp_path / "store", identity, 4), dist=None, fresh=False
        )
    assert f"{path}: the reference log-probabilities of this run's train pairs are damaged" in caught.value.message
    assert f"{path}: damaged" in caplog.text and "not used" in caplog.text
    _save(path, good, identity)  # whole again: read back, nothing computed (no engine here)
    attach_reference_logps(
        None, sets={"train": pairs}, ref=ReferencePass(tmp_path / "store", identity, 4), dist=None, fresh=False
    )
    assert pairs.ref_logps.shape == good.shape


@pytest.mark.parametrize(
    "flags, changes",
    [
        (["--attn_implementation", "eager"], "attention"),
        (["--block_size", "128"], "block_size"),
        (["--truncation", "drop"], "truncation"),
    ],
)
def test_the_reference_cache_key_changes_with_what_changes_the_log_probs(tmp_path, offline, flags, changes):
    from scaletrain.parts import DistInfo
    from scaletrain.preflight import resolve_run
    from scaletrain.train.reference import reference_identity

    data = preference_data.explicit_text(tmp_path / "p.jsonl", n=4)
    base = ["--config", str(REPO / "ds_configs/zero2.json"), "--train_file", str(data), "--output_dir", str(tmp_path)]
    dist = DistInfo.launched(rank=0, local_rank=0, world_size=1, launcher="single")

    def identity(argv):
        plan = resolve_run(argv, dist)
        return reference_identity(
            plan.cfg,
            precision=plan.ds.precision,
            attn_implementation=plan.attn_implementation,
            block_size=plan.block_size,
        )

    before, after = identity(base), identity([*base, *flags])
    assert {key for key in before if before[key] != after[key]} == {changes}


def test_print_samples_shows_each_pair_with_its_completions_marked(tmp_path, tokenizer, offline):
    import logging

    from scaletrain.data.pairs import print_pairs

    opened, _, rows = prepared(tmp_path, tokenizer, preference_data.explicit_text(tmp_path / "p.jsonl", n=4))
    pairs = pairs_from_store(opened, split="train", block_size=1024, truncation="truncate")
    # A handler on the module's own logger: an earlier in-process run's logging setup may stop propagation to root.
    records, logger = [], logging.getLogger("scaletrain.data.pairs")
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        print_pairs(pairs, 2, tokenizer)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    shown = [r.getMessage() for r in records]
    assert len(shown) == 4 and "pair 0, chosen" in shown[0] and "pair 1, rejected" in shown[3]
    for message, completion in zip(shown, [rows[0]["chosen"], rows[0]["rejected"], rows[1]["chosen"]], strict=False):
        marked = message.split("[[", 1)[1].split("]]", 1)[0]
        assert completion.strip() in marked and rows[0]["prompt"].split(":")[0] not in marked
