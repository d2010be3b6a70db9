"""Chat data wired end to end: the store keeps the loss mask beside the tokens (checked against masks found by hand
in the rendered text), whole examples are best-fit packed and never split, the packed loss counts exactly the
assistant tokens and no example attends to another, the fingerprint names the template and the loss mode, bad
input exits 2, and a real 2-rank run trains exactly the assistant tokens and exports the template.

The tiny test tokenizer has no chat template; the Mistral v0.2 template needs no tokens it lacks (`<s>`, `</s>`).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from scaletrain.data.blocks import EMPTY_SLOT, IGNORE_INDEX
from scaletrain.data.chat_store import attach_masks, chat_fingerprint, prepare_chat_store, resolve_chat_data
from scaletrain.config.cli import parse_run_config
from scaletrain.errors import UsageError
from scaletrain.data.packing import best_fit_decreasing, blocks_for, pack_examples, print_samples
from scaletrain.data.preparation import default_store_path
from scaletrain.data.token_store import open_store
from tests.harness import REPO, check_ok, launch, read_metrics
from tests.core.test_bad_input import tree_digest

TINY = REPO / "data" / "tiny-llama"
CHATS = REPO / "tests" / "fixtures" / "chat" / "messages.jsonl"
TEMPLATES = REPO / "tests" / "fixtures" / "chat_templates"
MISTRAL = TEMPLATES / "mistral-7b-instruct-v0.2.jinja"
BLOCK = 128  # the longest example of CHATS has 91 tokens: nothing is truncated at this size


def data_args(tmp_path, *flags, train_file=CHATS):
    return parse_run_config(
        [
            "--config",
            str(REPO / "ds_configs/zero2.json"),
            "--output_dir",
            str(tmp_path / "o"),
            "--validation_split_percentage",
            "0",
            "--train_file",
            str(train_file),
            *flags,
        ]
    ).data


def conversations() -> list:
    return [json.loads(line)["messages"] for line in CHATS.read_text().splitlines()]


def by_hand(messages, tokenizer) -> tuple:
    """(ids, mask) of one conversation without prefix renders: each reply found by string search in the text the
    Mistral v0.2 template writes (`[INST] question [/INST]` then the reply and `</s>`), the text cut there, the pieces
    tokenized, the reply pieces (their `</s>` included) marked."""
    text = tokenizer.apply_chat_template(messages, chat_template=MISTRAL.read_text(), tokenize=False)
    cuts, pos = [], 0
    for message in messages:
        if message["role"] == "assistant":
            start = text.index(" [/INST]" + message["content"] + "</s>", pos) + len(" [/INST]")
            pos = start + len(message["content"]) + len("</s>")
            cuts.append((start, pos))
    ids, mask, bounds = [], [], [0] + [b for cut in cuts for b in cut] + [len(text)]
    for k in range(len(bounds) - 1):
        piece = tokenizer(text[bounds[k] : bounds[k + 1]], add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [k % 2] * len(piece)
    return ids, mask


def hand_labels(ids, mask) -> list:
    """What the loss trains: a masked token, never an example's first (nothing in the example precedes it)."""
    return [t if m and j else IGNORE_INDEX for j, (t, m) in enumerate(zip(ids, mask, strict=True))]


def chat_store(tmp_path, tokenizer, *flags, name="store"):
    data = data_args(tmp_path, "--chat_template", str(MISTRAL), "--assistant_only_loss", *flags)
    chat = resolve_chat_data(data, tokenizer)
    store = prepare_chat_store(
        data, tokenizer=tokenizer, block_size=BLOCK, store=tmp_path / name, chat=chat, show_progress=False
    )
    return data, attach_masks(open_store(store), store)


def test_the_store_keeps_the_hand_found_assistant_mask_beside_the_tokens(tmp_path, tokenizer, offline):
    _, opened = chat_store(tmp_path, tokenizer)
    split, mask = opened["splits"]["train"], opened["masks"]["train"]
    ends = list(split.doc_starts[1:]) + [split.n_tokens]
    chats = conversations()
    assert split.n_documents == len(chats)
    for messages, start, end in zip(chats, split.doc_starts, ends, strict=True):
        ids, hand = by_hand(messages, tokenizer)
        assert split.tokens[start:end].tolist() == ids
        assert mask[start:end].tolist() == hand
        assert sum(hand) > 0 and tokenizer.decode(np.asarray(ids)[np.asarray(hand, bool)]).count("</s>") == sum(
            m["role"] == "assistant" for m in messages
        )  # every reply's end of turn is trained
    assert opened["manifest"]["splits"]["train"]["n_trained_tokens"] == int(mask.sum(dtype=np.int64))


def test_best_fit_decreasing_puts_each_item_where_it_fits_tightest():
    # 5, 4, 3 open three bins; the second 3 fills the 3's bin; a 2 fills the 4's; the next 2 opens a bin; the 1
    # goes where the least room is left (the 5's bin), not into the emptier new one.
    assert best_fit_decreasing(np.array([5, 4, 3, 3, 2, 2, 1]), 6) == [[0, 6], [1, 4], [2, 3], [5]]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=500)
    bins = best_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(500))  # every item once
    assert all(lengths[b].sum() <= 100 for b in bins)
    assert len(bins) <= int(np.ceil(lengths.sum() / 100) * 1.1) + 1  # close to the bound of perfect packing
    assert bins == best_fit_decreasing(lengths, 100)  # deterministic


def packed_pieces(batch) -> list:
    """(row, start, end) of each sequence of a batch: position ids restart at 0 where one begins."""
    pieces = []
    for row, positions in enumerate(batch["position_ids"].tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        pieces += [(row, a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return pieces


def test_packing_never_splits_a_conversation_and_trains_exactly_its_assistant_tokens(tmp_path, tokenizer, offline):
    data, opened = chat_store(tmp_path, tokenizer)
    blocks = blocks_for(opened, "train", BLOCK, data)
    assert blocks.truncated == blocks.dropped == 0 and len(blocks) < len(conversations())  # several per block
    hand = [(tuple(ids), hand_labels(ids, mask)) for ids, mask in (by_hand(m, tokenizer) for m in conversations())]
    expected = dict(hand)  # (some conversations of the fixture are alike)
    batch = blocks.batch(np.arange(len(blocks)))
    found = []
    for row, a, b in packed_pieces(batch):
        ids = tuple(batch["input_ids"][row, a:b].tolist())
        if ids in expected:  # a whole conversation, starting at position 0 of its own
            assert batch["labels"][row, a:b].tolist() == expected[ids]
            found.append(ids)
        else:  # the padding after the last one: no loss
            assert set(ids) == {opened["manifest"]["pad_id"]} and b == BLOCK
            assert (batch["labels"][row, a:b] == IGNORE_INDEX).all()
    assert sorted(found) == sorted(ids for ids, _ in hand)  # each conversation once, whole, in one block
    hand_total = sum(sum(label != IGNORE_INDEX for label in labels) for _, labels in hand)
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == hand_total
    assert blocks.targets_in(np.array([*range(len(blocks)), EMPTY_SLOT])) == hand_total  # the loss normaliser


def test_an_example_longer_than_the_block_is_truncated_or_dropped_and_counted(tokenizer):
    tokens = np.arange(30, dtype=np.uint16)
    mask = np.ones(30, dtype=np.uint8)
    starts = np.array([0, 4, 16, 20])  # lengths 4, 12, 4, 10
    cut = pack_examples(tokens, mask=mask, starts=starts, block_size=8, pad_id=0, truncation="truncate")
    assert (cut.truncated, cut.dropped, cut.n_documents) == (2, 0, 4)
    batch = cut.batch(np.arange(len(cut)))
    kept = {tuple(batch["input_ids"][r, a:b].tolist()) for r, a, b in packed_pieces(batch)}
    assert tuple(range(4, 12)) in kept and tuple(range(20, 28)) in kept  # the first 8 tokens of each long one
    dropped = pack_examples(tokens, mask=mask, starts=starts, block_size=8, pad_id=0, truncation="drop")
    assert (dropped.truncated, dropped.dropped, dropped.n_documents) == (0, 2, 2)
    assert sorted(e for b in dropped.bins for e in b) == [0, 2]
    assert (
        pack_examples(tokens[:12], mask=mask[:12], starts=np.array([0]), block_size=8, pad_id=0, truncation="drop")
        is None
    )  # nothing left to train


class EngineStandIn:
    """The part of a DeepSpeed engine the loss function touches (its device, module and forward): the real engine
    runs the same function in test_chat_run_trains_exactly_the_assistant_tokens_at_two_ranks."""

    def __init__(self, model):
        self.module, self.device = model, torch.device("cpu")

    def __call__(self, **kwargs):
        return self.module(**kwargs)


@pytest.mark.parametrize("attn,micro", [("sdpa", 1), ("sdpa", 4), ("eager", 1), ("eager", 4)])
def test_packed_loss_is_each_conversation_alone_on_its_assistant_tokens(attn, micro, tmp_path, tokenizer, offline):
    """Isolation and the mask together: the loop's summed loss over packed blocks equals the sum, over each
    conversation run alone, of the cross-entropy of its hand-found assistant tokens; the logits of each packed
    conversation equal its logits alone (no token attends across a conversation)."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from scaletrain.train.losses import token_loss_sum

    data, opened = chat_store(tmp_path, tokenizer)
    blocks = blocks_for(opened, "train", BLOCK, data)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY), attn_implementation=attn).eval()
    rows = np.array([i % len(blocks) for i in range(micro)])
    batch = blocks.batch(rows)
    with torch.no_grad():
        packed_sum = token_loss_sum(EngineStandIn(model), batch)
        packed_logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        alone_sum, checked = 0.0, 0
        hand = {tuple(ids): mask for ids, mask in (by_hand(m, tokenizer) for m in conversations())}
        for row, a, b in packed_pieces(batch):
            ids = tuple(batch["input_ids"][row, a:b].tolist())
            if ids not in hand:
                continue  # padding
            alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            torch.testing.assert_close(packed_logits[row, a:b], alone, rtol=1e-4, atol=1e-4)
            targets = torch.tensor([t if m else IGNORE_INDEX for t, m in zip(ids[1:], hand[ids][1:], strict=True)])
            alone_sum += float(F.cross_entropy(alone[:-1], targets, ignore_index=IGNORE_INDEX, reduction="sum"))
            checked += 1
    assert checked >= 2 * micro  # every block holds at least two conversations
    assert float(packed_sum) == pytest.approx(alone_sum, rel=1e-5)


def test_the_fingerprint_names_the_template_and_the_loss_mode(tmp_path, tokenizer, offline):
    def fingerprint(*flags):
        data = data_args(tmp_path, *flags)
        return chat_fingerprint(data, tokenizer, BLOCK, resolve_chat_data(data, tokenizer))

    mistral = fingerprint("--chat_template", str(MISTRAL), "--assistant_only_loss")
    assert default_store_path(mistral) == default_store_path(
        fingerprint("--chat_template", str(MISTRAL), "--assistant_only_loss")
    )
    llama = fingerprint("--chat_template", str(TEMPLATES / "llama-3.1-instruct.jinja"), "--assistant_only_loss")
    whole = fingerprint("--chat_template", str(MISTRAL))
    assert mistral.differences(llama.as_dict()) == ["chat_template_sha256"]
    assert mistral.differences(whole.as_dict()) == ["loss_mode"]
    assert len({default_store_path(f) for f in (mistral, llama, whole)}) == 3
    _, opened = chat_store(tmp_path, tokenizer)  # a store made with Mistral's template is not reused for Llama's
    data = data_args(tmp_path, "--chat_template", str(TEMPLATES / "llama-3.1-instruct.jinja"), "--assistant_only_loss")
    with pytest.raises(UsageError, match="chat_template_sha256 differ"):
        prepare_chat_store(
            data,
            tokenizer=tokenizer,
            block_size=BLOCK,
            store=tmp_path / "store",
            chat=resolve_chat_data(data, tokenizer),
        )


def test_without_assistant_only_loss_a_conversation_trains_whole(tmp_path, tokenizer, offline):
    data = data_args(tmp_path, "--chat_template", str(MISTRAL))
    chat = resolve_chat_data(data, tokenizer)
    assert chat.loss_mode == "all"
    store = prepare_chat_store(
        data, tokenizer=tokenizer, block_size=BLOCK, store=tmp_path / "store", chat=chat, show_progress=False
    )
    assert attach_masks(open_store(store), store)["masks"]["train"].all()


def test_a_prompt_completion_dataset_trains_the_completion_and_eos_only(tmp_path, tokenizer, offline):
    path = tmp_path / "pc.jsonl"
    records = [{"prompt": f"Q{i}: what is {i} plus {i}?", "completion": f" It is {2 * i}."} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = data_args(tmp_path, train_file=path)
    chat = resolve_chat_data(data, tokenizer)
    assert (chat.kind, chat.loss_mode, chat.template) == ("prompt_completion", "completion_only", None)
    store = prepare_chat_store(
        data, tokenizer=tokenizer, block_size=BLOCK, store=tmp_path / "store", chat=chat, show_progress=False
    )
    opened = attach_masks(open_store(store), store)
    split, mask = opened["splits"]["train"], opened["masks"]["train"]
    trained = split.tokens[mask.astype(bool)].tolist()
    expected = [
        t
        for r in records
        for t in tokenizer(r["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ]
    assert trained == expected


def test_print_samples_shows_the_rendered_examples_with_the_trained_tokens_marked(tmp_path, tokenizer, offline, caplog):
    data, opened = chat_store(tmp_path, tokenizer)
    blocks = blocks_for(opened, "train", BLOCK, data)
    with caplog.at_level("INFO", logger="scaletrain.data.packing"):
        print_samples(blocks, 2, tokenizer)
    shown = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sample ")]
    assert len(shown) == 2
    first = conversations()[0]
    assert shown[0].endswith(f"<s>[INST] {first[0]['content']} [/INST][[{first[1]['content']}</s>]]")


@pytest.mark.slow  # over 5 s: real processes (the fast tier stays under 3 minutes)
def test_prepare_py_makes_the_chat_store_that_data_path_reads_with_its_template(tmp_path, tokenizer, offline):
    import subprocess
    import sys

    store = tmp_path / "prepared"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "data/prepare.py"),
            "--train_file",
            str(CHATS),
            "--chat_template",
            str(MISTRAL),
            "--assistant_only_loss",
            "--tokenizer_name",
            str(TINY),
            "--block_size",
            str(BLOCK),
            "--validation_split_percentage",
            "0",
            "--output_dir",
            str(store),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_ok(proc)
    data, made_here = chat_store(tmp_path, tokenizer)
    opened = attach_masks(open_store(store), store)
    assert opened["manifest"]["fingerprint"] == made_here["manifest"]["fingerprint"]  # what train.py would make
    assert opened["masks"]["train"].tolist() == made_here["masks"]["train"].tolist()
    chat = resolve_chat_data(
        parse_run_config(["--config", str(REPO / "ds_configs/zero2.json"), "--data_path", str(store)]).data, tokenizer
    )
    assert (chat.loss_mode, chat.template.text) == ("assistant_only", MISTRAL.read_text())  # the export carries it


# --- bad input: one line, exit code 2, the output folder untouched ------------------------------------------------


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
BAD_INPUT = {
    "no template anywhere": (
        lambda t: ["--train_file", str(CHATS), "--assistant_only_loss"],
        "data/tiny-llama has no chat template",
    ),
    "assistant-only loss on text": (
        lambda t: [
            "--train_file",
            str(write_jsonl(t / "text.jsonl", [{"text": "plain text"}] * 4)),
            "--assistant_only_loss",
        ],
        "--assistant_only_loss: --train_file",
    ),
    "samples of plain text": (
        lambda t: [
            "--train_file",
            str(write_jsonl(t / "plain.jsonl", [{"text": "plain text"}] * 4)),
            "--print_samples",
            "2",
        ],
        "--print_samples: --train_file",
    ),
    "unknown role in the first example": (
        lambda t: [
            "--train_file",
            str(
                write_jsonl(
                    t / "role.jsonl",
                    [{"messages": [{"role": "robot", "content": "Hi?"}, *CHAT[1:]]}] + [{"messages": CHAT}] * 3,
                )
            ),
            "--chat_template",
            str(MISTRAL),
        ],
        "example 0: messages[0] has role 'robot'",
    ),
    "unknown role deep in the file": (  # found when the store is prepared, before any model or process group
        lambda t: [
            "--train_file",
            str(
                write_jsonl(
                    t / "late.jsonl",
                    [{"messages": CHAT}] * 5 + [{"messages": [CHAT[0], {"role": "bot", "content": "Hello."}]}],
                )
            ),
            "--chat_template",
            str(MISTRAL),
        ],
        "example 5: messages[1] has role 'bot'",
    ),
    "nothing trained": (
        lambda t: [
            "--train_file",
            str(write_jsonl(t / "mute.jsonl", [{"messages": CHAT[:1]}] * 4)),
            "--chat_template",
            str(MISTRAL),
            "--assistant_only_loss",
        ],
        f"chat data: no token of the 4 examples is trained with --chat_template {MISTRAL}",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_chat_input_is_one_line_exit_2_and_touches_nothing(name, tmp_path, offline, capsys):
    from train import main

    make_flags, expected = BAD_INPUT[name]
    extra = make_flags(tmp_path)
    out = tmp_path / "out"
    before = tree_digest(out)
    try:
        code = main(
            [
                "--config",
                str(REPO / "ds_configs/zero2.json"),
                "--output_dir",
                str(out),
                "--validation_split_percentage",
                "0",
                *extra,
            ]
        )
    except BaseException:
        pytest.fail(f"{name}: raised instead of a clean error:\n{traceback.format_exc()}")
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    lines = [line for line in captured.err.strip().splitlines() if line.startswith(("train.py", "  hint"))]
    assert 1 <= len(lines) <= 2 and lines[0].startswith("train.py: error: "), captured.err
    assert expected in lines[0], lines
    assert tree_digest(out) == before
    stores = tmp_path / "cache" / "scaletrain" / "token_stores"
    assert (
        not any(p.name.startswith(".") or (p / "manifest.json").exists() for p in stores.glob("*"))
        if stores.exists()
        else True
    )  # no store, and no half-written one, was kept


# --- a real run ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_chat_run_trains_exactly_the_assistant_tokens_at_two_ranks(tmp_path, cache_dir, tokenizer):
    """2 ranks (gloo, ZeRO-2), one epoch: the loop's count of trained tokens is the hand-found assistant tokens of
    every conversation; the validation file is evaluated; the samples are printed; the export carries the chat
    template."""
    out = tmp_path / "run"
    proc = launch(
        REPO / "train.py",
        [
            "--config",
            "ds_configs/zero2.json",
            "--output_dir",
            str(out),
            "--train_file",
            str(CHATS),
            "--chat_template",
            str(MISTRAL),
            "--assistant_only_loss",
            "--print_samples",
            "2",
            "--validation_file",
            str(CHATS),
            "--validation_split_percentage",
            "0",
            "--block_size",
            str(BLOCK),
            "--num_train_epochs",
            "1",
            "--per_device_train_batch_size",
            "2",
            "--logging_steps",
            "1",
            "--disable_tqdm",
        ],
        "deepspeed",
        cache_dir,
        nprocs=2,
    )
    check_ok(proc)
    hand_total = sum(
        sum(label != IGNORE_INDEX for label in hand_labels(*by_hand(m, tokenizer))) for m in conversations()
    )
    records = [r for r in read_metrics(out) if "loss" in r]
    assert records and all(np.isfinite(r["loss"]) for r in records)
    assert records[-1]["tokens_seen"] == hand_total
    evaluated = [r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r]  # whole-example validation blocks
    assert evaluated and np.isfinite(evaluated[-1])
    text = proc.stdout + proc.stderr
    assert "[[" + conversations()[0][1]["content"] + "</s>]]" in text and "longer than the block" in text
    assert AutoTokenizer.from_pretrained(out).chat_template == MISTRAL.read_text()


@pytest.mark.slow
def test_rendering_workers_give_the_same_store_and_name_a_bad_row(tmp_path, tokenizer, monkeypatch):
    """--preprocessing_num_workers: worker processes render batches of rows, read back in order, so the arrays are
    those of one process; a bad row deep in the data stops it with that row's number and its hint. (Workers start
    from 20,000 rows; the test lowers that to 1,024 to stay small.)"""
    import datasets

    from scaletrain.data import chat_store
    from scaletrain.data.chat_store import ChatData, render_split
    from scaletrain.data.chat_render import load_chat_template

    monkeypatch.setattr(chat_store, "PARALLEL_MIN_ROWS", 1024)
    min_rows = chat_store.PARALLEL_MIN_ROWS

    template = load_chat_template(tokenizer, str(MISTRAL))
    chat = ChatData("messages", template, "assistant_only")
    rows = [{"messages": m} for m in conversations()]
    ds = datasets.Dataset.from_list((rows * (min_rows // len(rows) + 1))[: min_rows + 7])
    alone = render_split(ds, tokenizer, chat, "train", False, workers=1)
    shared = render_split(ds, tokenizer, chat, "train", False, workers=2)
    for one, two in zip(alone, shared, strict=True):
        np.testing.assert_array_equal(one, two)
    assert len(alone[2]) == len(ds) and alone[1].sum() > 0
    bad = ds.to_list()
    bad[min_rows - 3]["messages"] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "user", "content": "c"},
    ]  # the template refuses it
    with pytest.raises(UsageError, match=f"refuses example {min_rows - 3}") as caught:
        render_split(datasets.Dataset.from_list(bad), tokenizer, chat, "train", False, workers=2)
    assert caught.value.hint and "--chat_template" in caught.value.hint
