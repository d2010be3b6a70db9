"""Chat data from every source, and --dataset_mix of chat stores.

Sources: a local folder of chat files given as --dataset_name, and a hub dataset. The hub cannot be reached here,
so the hub dataset is one that the Hugging Face cache holds once it was downloaded: the layout datasets itself
writes for `<namespace>/<name>` (`<namespace>___<name>/<config>/<version>/<commit>/<name>-train.arrow` and its
dataset_info.json), made by datasets' own builder from a local file, and read through load_dataset's offline path
to that cache (the same calls as online: load_dataset, load_dataset_builder). Hub access itself is not tested.

Mixes: two chat stores made by data/prepare.py pack whole conversations per store with their own masks, and a real
run over one epoch of the mix counts exactly the hand-found assistant tokens of both; a chat store with a text
store, or stores rendered with different templates or training different tokens, are refused (exit 2) naming both.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from scaletrain.data.blocks import IGNORE_INDEX, MixedBlocks
from scaletrain.data.chat_store import attach_masks, prepare_chat_store, resolve_chat_data
from scaletrain.config.cli import parse_run_config
from scaletrain.errors import UsageError
from scaletrain.data.packing import blocks_for
from scaletrain.data.token_store import open_store
from tests.harness import REPO, check_ok, launch, read_metrics, child_env
from tests.core.test_bad_input import tree_digest
from tests.data.test_chat_store import BLOCK, CHAT, CHATS, MISTRAL, TEMPLATES, TINY, by_hand, hand_labels, packed_pieces

HUB_NAME = "scaletrain-tests/chats"  # only ever read from the test's own cache, offline


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cache_hub_dataset(cache: Path, rows: list, name: str = HUB_NAME) -> None:
    """Put `rows` into the datasets cache as the download of hub dataset `name` (config default) would leave them."""
    import datasets

    source = write_jsonl(cache.parent / "hub-source" / f"{name.replace('/', '_')}.jsonl", rows)
    builder = datasets.load_dataset_builder(
        "json", data_files={"train": str(source)}, cache_dir=str(cache.parent / "hub-build")
    )
    builder.download_and_prepare()
    namespace, short = name.split("/")
    entry = cache / f"{namespace}___{short}" / "default" / "0.0.0" / ("0123abcd" * 5)  # the commit it resolved to
    entry.mkdir(parents=True)
    shutil.copy(Path(builder.cache_dir) / "json-train.arrow", entry / f"{short}-train.arrow")
    info = json.loads((Path(builder.cache_dir) / "dataset_info.json").read_text())
    info.update(builder_name="parquet", dataset_name=short, config_name="default")
    info["splits"]["train"]["dataset_name"] = short
    (entry / "dataset_info.json").write_text(json.dumps(info))


def data_args(tmp_path, *flags):
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


def chats() -> list:
    return [json.loads(line)["messages"] for line in CHATS.read_text().splitlines()]


def assert_hand_masks(store: Path, conversations: list, tokenizer) -> None:
    """The store holds each conversation's tokens, and the assistant-only mask found by hand in its rendered text."""
    opened = attach_masks(open_store(store), store)
    split, mask = opened["splits"]["train"], opened["masks"]["train"]
    ends = list(split.doc_starts[1:]) + [split.n_tokens]
    assert split.n_documents == len(conversations)
    for messages, start, end in zip(conversations, split.doc_starts, ends, strict=True):
        ids, hand = by_hand(messages, tokenizer)
        assert split.tokens[start:end].tolist() == ids
        assert mask[start:end].tolist() == hand


ASSISTANT_ONLY = ("--chat_template", str(MISTRAL), "--assistant_only_loss")


# --- every source: the pre-flight recognises the chat data, the store renders it with assistant-only masks --------


def test_a_local_folder_of_chat_files_given_as_dataset_name_is_rendered_as_chat_data(tmp_path, tokenizer, offline):
    folder = tmp_path / "chat-folder"
    folder.mkdir()
    shutil.copy(CHATS, folder / "train.jsonl")
    data = data_args(tmp_path, "--dataset_name", str(folder), *ASSISTANT_ONLY)
    chat = resolve_chat_data(data, tokenizer)
    assert chat is not None and (chat.kind, chat.loss_mode) == ("messages", "assistant_only")
    store = prepare_chat_store(
        data, tokenizer=tokenizer, block_size=BLOCK, store=tmp_path / "store", chat=chat, show_progress=False
    )
    assert_hand_masks(store, chats(), tokenizer)
    assert not list(offline.rglob("*.arrow"))  # the look ahead streamed; the conversion was to a scratch folder


def test_a_cached_hub_chat_dataset_is_streamed_from_the_cache_and_rendered(tmp_path, tokenizer, offline):
    cache_hub_dataset(offline, [{"messages": m} for m in chats()])
    data = data_args(tmp_path, "--dataset_name", HUB_NAME, *ASSISTANT_ONLY)
    chat = resolve_chat_data(data, tokenizer)
    assert chat is not None and (chat.kind, chat.loss_mode) == ("messages", "assistant_only")
    store = prepare_chat_store(
        data, tokenizer=tokenizer, block_size=BLOCK, store=tmp_path / "store", chat=chat, show_progress=False
    )
    assert_hand_masks(store, chats(), tokenizer)


def test_the_first_hub_record_is_checked_before_anything_heavy(tmp_path, tokenizer, offline):
    """Read, not only classified: an unknown role in the first record of a hub dataset is refused in the pre-flight."""
    cache_hub_dataset(offline, [{"messages": [{"role": "robot", "content": "Hi?"}, *CHAT[1:]]}, {"messages": CHAT}])
    with pytest.raises(UsageError, match="example 0: messages\\[0\\] has role 'robot'"):
        resolve_chat_data(data_args(tmp_path, "--dataset_name", HUB_NAME, "--chat_template", str(MISTRAL)), tokenizer)


@pytest.fixture
def streams_asked(monkeypatch):
    """The real as_streaming_dataset, recording the splits it is asked for (a spy, not a mock: it streams)."""
    import datasets

    asked, real = [], datasets.DatasetBuilder.as_streaming_dataset

    def as_streaming_dataset(self, split=None, base_path=None):
        asked.append(split)
        return real(self, split=split, base_path=base_path)

    monkeypatch.setattr(datasets.DatasetBuilder, "as_streaming_dataset", as_streaming_dataset)
    return asked


def test_only_global_rank_0_streams_the_first_record_of_a_hub_chat_dataset(tmp_path, tokenizer, offline, streams_asked):
    """At 512 ranks, one hub request for the first record, not 512: the other ranks take the kind from the features.
    A first record that rank 0 refuses stops them all at the rendezvous (as a mistake on one node does:
    test_agreement.py), so they need not check it themselves."""
    from scaletrain.parts import DistInfo
    from scaletrain.preflight import resolve_run

    cache_hub_dataset(offline, [{"messages": [{"role": "robot", "content": "Hi?"}, *CHAT[1:]]}, {"messages": CHAT}])
    data = data_args(tmp_path, "--dataset_name", HUB_NAME, "--chat_template", str(MISTRAL))
    chat = resolve_chat_data(data, tokenizer, reads_first_row=False)
    assert chat is not None and chat.kind == "messages" and chat.template is not None
    assert streams_asked == []
    with pytest.raises(UsageError, match="example 0: messages\\[0\\] has role 'robot'"):
        resolve_chat_data(data, tokenizer, reads_first_row=True)
    assert streams_asked == ["train"]

    argv = [
        "--config",
        str(REPO / "ds_configs/zero2.json"),
        "--output_dir",
        str(tmp_path / "run"),
        "--validation_split_percentage",
        "0",
        "--dataset_name",
        HUB_NAME,
        "--chat_template",
        str(MISTRAL),
    ]
    streams_asked.clear()
    resolved = resolve_run(argv, DistInfo.launched(rank=1, local_rank=1, world_size=2, launcher="torchrun/deepspeed"))
    assert resolved.chat == chat and streams_asked == []  # a rank but 0: the features, no request
    with pytest.raises(UsageError, match="has role 'robot'"):
        resolve_run(argv, DistInfo.launched(rank=0, local_rank=0, world_size=2, launcher="torchrun/deepspeed"))
    assert streams_asked == ["train"]


def test_a_plain_text_hub_dataset_stays_plain_text(tmp_path, tokenizer, offline):
    cache_hub_dataset(offline, [{"text": f"plain document {i}."} for i in range(4)])
    assert resolve_chat_data(data_args(tmp_path, "--dataset_name", HUB_NAME), tokenizer) is None
    with pytest.raises(UsageError, match=f"--assistant_only_loss: --dataset_name {HUB_NAME} holds no conversations"):
        resolve_chat_data(data_args(tmp_path, "--dataset_name", HUB_NAME, *ASSISTANT_ONLY), tokenizer)


@pytest.fixture
def streaming_refused(monkeypatch):
    """MOCK of one call only: a builder's as_streaming_dataset (load_dataset's streaming step) fails, as for a hub
    dataset in a format that does not stream (tgz). With datasets 5.2 a cached download streams offline, so no
    real dataset here fails that way; load_dataset_builder and everything else is the real one. Returns the list of
    the streams asked for."""
    import datasets

    asked = []

    def as_streaming_dataset(self, split=None, base_path=None):
        asked.append(split)
        raise NotImplementedError("streaming refused by the test's mock")

    monkeypatch.setattr(datasets.DatasetBuilder, "as_streaming_dataset", as_streaming_dataset)
    return asked


CONVERSATIONAL_PC = [
    {
        "prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}],
        "completion": [{"role": "assistant", "content": f"It is {2 * i}."}],
    }
    for i in range(4)
]
FEATURE_CASES = {  # rows -> (kind, loss mode, whether a template renders them), or None for plain text
    "messages": ([{"messages": m} for m in chats()[:4]], ("messages", "assistant_only", True), ASSISTANT_ONLY),
    "prompt/completion text": (
        [{"prompt": f"Q{i}?", "completion": f" A{i}."} for i in range(4)],
        ("prompt_completion", "completion_only", False),
        (),
    ),
    "conversational prompt/completion": (
        CONVERSATIONAL_PC,
        ("prompt_completion", "completion_only", True),
        ("--chat_template", str(MISTRAL)),
    ),
    "plain text": ([{"text": f"doc {i}", "n": i} for i in range(4)], None, ()),
}


@pytest.mark.parametrize("case", list(FEATURE_CASES))
def test_without_streaming_the_builders_features_tell_the_kind_of_data(
    case, tmp_path, tokenizer, offline, streaming_refused
):
    rows, expected, flags = FEATURE_CASES[case]
    cache_hub_dataset(offline, rows)
    data = data_args(tmp_path, "--dataset_name", HUB_NAME, *flags)
    chat = resolve_chat_data(data, tokenizer)
    found = chat and (chat.kind, chat.loss_mode, chat.template is not None)
    assert found == expected
    assert streaming_refused == ([] if expected is None else ["train"])  # plain text by its features: not streamed
    if case == "messages":  # the rows the features stood in for are checked and rendered when the store is made
        store = prepare_chat_store(
            data, tokenizer=tokenizer, block_size=BLOCK, store=tmp_path / "store", chat=chat, show_progress=False
        )
        assert_hand_masks(store, chats()[:4], tokenizer)


def test_chat_columns_read_as_text_get_an_error_that_says_so():
    import datasets

    from scaletrain.data.raw import check_text_column

    for rows, columns in (
        ([{"messages": CHAT}], "a messages column"),
        ([{"prompt": "Q?", "completion": "A."}], "prompt and completion columns"),
    ):
        with pytest.raises(UsageError) as err:
            check_text_column(datasets.Dataset.from_list(rows), "text", f"--dataset_name {HUB_NAME}")
        assert (
            f"--text_column text: not a column of --dataset_name {HUB_NAME}, which has {columns}: chat data "
            "that the pre-flight could not recognise" in err.value.message
        )
        assert "save_to_disk" in err.value.hint and "--train_file" in err.value.hint
    with pytest.raises(UsageError) as err:  # other data: as before
        check_text_column(datasets.Dataset.from_list([{"body": "words"}]), "text", "x")
    assert (err.value.message, err.value.hint) == ("--text_column text: not a column of x", "columns there: body")


# --- --dataset_mix of chat stores --------------------------------------------------------------------------------


def numbers_chats() -> list:
    """A second chat dataset, other words and turn counts than CHATS."""
    out = []
    for i in range(24):  # 12 blocks of 128, as many as CHATS makes
        turns = []
        for j in range(1 + i % 3):
            a, b = i + j, 2 * i + 1
            turns += [
                {"role": "user", "content": f"How much is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} plus {b} makes {a + b}."},
            ]
        out.append(turns)
    return out


def run_prepare(*flags) -> int:
    spec = importlib.util.spec_from_file_location("prepare_py", REPO / "data" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(
        ["--tokenizer_name", str(TINY), "--block_size", str(BLOCK), "--validation_split_percentage", "0", *flags]
    )


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Stores made by data/prepare.py: {name: folder}."""
    import datasets

    root = tmp_path_factory.mktemp("chat-mix")
    numbers = write_jsonl(root / "numbers.jsonl", [{"messages": m} for m in numbers_chats()])
    pc = write_jsonl(root / "pc.jsonl", CONVERSATIONAL_PC)
    text = write_jsonl(root / "text.jsonl", [{"text": f"a plain document, number {i}."} for i in range(30)])
    plans = {
        "chats": (CHATS, *ASSISTANT_ONLY),
        "numbers": (numbers, *ASSISTANT_ONLY),
        "llama": (CHATS, "--chat_template", str(TEMPLATES / "llama-3.1-instruct.jinja"), "--assistant_only_loss"),
        "whole": (CHATS, "--chat_template", str(MISTRAL)),
        "pc": (pc, "--chat_template", str(MISTRAL)),
        "text": (text,),
    }
    with pytest.MonkeyPatch.context() as mp:
        env = child_env(root / "cache")
        mp.setenv("HF_DATASETS_CACHE", env["HF_DATASETS_CACHE"])
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", Path(env["HF_DATASETS_CACHE"]))
        for name, (source, *flags) in plans.items():
            assert run_prepare("--train_file", str(source), *flags, "--output_dir", str(root / name)) == 0, name
    return {name: root / name for name in plans}


def mix_args(tmp_path, *names, stores):
    return data_args(tmp_path, "--dataset_mix", ",".join(f"{stores[n]}:1" for n in names))


def test_mixed_chat_stores_pack_whole_conversations_of_one_store_with_their_masks(tmp_path, stores, tokenizer):
    data = mix_args(tmp_path, "chats", "numbers", stores=stores)
    chat = resolve_chat_data(data, tokenizer)
    assert (chat.loss_mode, chat.template.text) == ("assistant_only", MISTRAL.read_text())
    sources = [
        blocks_for(attach_masks(open_store(stores[n]), stores[n]), "train", BLOCK, data) for n in ("chats", "numbers")
    ]
    assert len(sources[0]) == len(sources[1])  # weights 1:1 over one epoch then draw every block of both once
    mixed = MixedBlocks(sources, [0.5, 0.5], seed=3)
    hand = [
        {tuple(ids): hand_labels(ids, mask) for ids, mask in (by_hand(m, tokenizer) for m in conversations)}
        for conversations in (chats(), numbers_chats())
    ]
    batch = mixed.batch(np.arange(len(mixed)))
    seen = []
    for row in range(len(mixed)):
        k = mixed.locate(row)[0]
        for _, a, b in packed_pieces({"position_ids": batch["position_ids"][row : row + 1]}):
            ids = tuple(batch["input_ids"][row, a:b].tolist())
            if ids in hand[k]:  # a whole conversation of this row's store, with that store's mask
                assert batch["labels"][row, a:b].tolist() == hand[k][ids]
                seen.append((k, ids))
            else:  # the padding after the last one
                assert b == BLOCK and (batch["labels"][row, a:b] == IGNORE_INDEX).all()
    expected = [(k, tuple(by_hand(m, tokenizer)[0])) for k, c in enumerate((chats(), numbers_chats())) for m in c]
    assert sorted(seen) == sorted(expected)  # each conversation of both stores once, whole, in a block of its store


def test_an_assistant_only_store_and_a_prompt_completion_store_mix(tmp_path, stores, tokenizer):
    """Both train only the replies, with one template: the mix is what each store would train alone."""
    chat = resolve_chat_data(mix_args(tmp_path, "chats", "pc", stores=stores), tokenizer)
    assert chat.template.text == MISTRAL.read_text()


MIX_REFUSALS = {
    "chat and text": (("chats", "text"), "mixes chat stores ({chats}) with stores of plain text ({text})"),
    "text and chat": (("text", "numbers"), "mixes chat stores ({numbers}) with stores of plain text ({text})"),
    "different templates": (
        ("chats", "llama"),
        "the stores were rendered with different chat templates ({chats}: chat template sha256 ",
    ),
    "whole and assistant-only": (
        ("whole", "chats"),
        "the stores train different tokens ({whole}: all; {chats}: assistant_only)",
    ),
}


@pytest.mark.parametrize("case", list(MIX_REFUSALS))
def test_a_mix_of_unlike_stores_is_refused_with_exit_2_naming_both(case, tmp_path, stores, monkeypatch, capsys):
    from train import main

    names, expected = MIX_REFUSALS[case]
    out = tmp_path / "out"
    before = tree_digest(out)
    code = main(
        [
            "--config",
            str(REPO / "ds_configs/zero2.json"),
            "--output_dir",
            str(out),
            "--dataset_mix",
            ",".join(f"{stores[n]}:1" for n in names),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.startswith(("train.py", "  hint"))]
    assert 1 <= len(lines) <= 2 and lines[0].startswith("train.py: error: --dataset_mix: "), err
    assert expected.format(**{n: stores[n] for n in stores}) in lines[0]
    assert tree_digest(out) == before


@pytest.mark.slow
def test_a_run_over_a_mix_of_two_chat_stores_trains_exactly_the_assistant_tokens_of_both(
    tmp_path, cache_dir, stores, tokenizer
):
    """One rank, one epoch of a 1:1 mix of two chat stores of as many blocks: every block of both is drawn once, so
    the loop's count of trained tokens is the hand-found assistant tokens of every conversation of both."""
    out = tmp_path / "run"
    proc = launch(
        REPO / "train.py",
        [
            "--config",
            "ds_configs/zero2.json",
            "--output_dir",
            str(out),
            "--dataset_mix",
            f"{stores['chats']}:1,{stores['numbers']}:1",
            "--num_train_epochs",
            "1",
            "--per_device_train_batch_size",
            "2",
            "--logging_steps",
            "1",
            "--no-export_hf_at_end",
            "--disable_tqdm",
        ],
        "python",
        cache_dir,
    )
    check_ok(proc)
    hand_total = sum(
        sum(label != IGNORE_INDEX for label in hand_labels(*by_hand(m, tokenizer))) for m in chats() + numbers_chats()
    )
    records = [r for r in read_metrics(out) if "loss" in r]
    assert records and all(np.isfinite(r["loss"]) for r in records)
    assert records[-1]["tokens_seen"] == hand_total
    log = proc.stdout + proc.stderr
    assert f"chat data (train): {len(chats())} examples packed whole" in log
    assert f"chat data (train): {len(numbers_chats())} examples packed whole" in log
