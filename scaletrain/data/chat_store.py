"""Chat data as a token store: each example rendered by chat_render.py into its tokens (no EOS added: the template
writes its own) and a loss mask, one byte per token in <split>.mask.bin beside them; the fingerprint adds the template's
hash and the loss mode (`assistant_only`, `completion_only` or `all`). The masks are checked before the store is renamed
into place, so a refused dataset leaves nothing behind. Layout: docs/data.md#chat-data.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.data.chat_render import ChatTemplate, check_masks, check_messages, load_chat_template, render_example
from scaletrain.config import DataArgs
from scaletrain.errors import UsageError
from scaletrain.data.raw import record_kind
from scaletrain.data.token_store import FORMAT_VERSION, MANIFEST, Fingerprint, read_manifest

log = logging.getLogger(__name__)

CHAT_PACKING = "whole_examples"  # the fingerprint's packing of a chat store: whole examples, best fit
MASK_DTYPE = np.dtype(np.uint8)


@dataclass(frozen=True)
class ChatData:
    """What the pre-flight found: the kind of chat dataset, the template that renders it and what the loss trains."""

    kind: str  # "messages", "prompt_completion" or "preference" (chosen/rejected pairs)
    template: ChatTemplate | None  # None for a prompt/completion of plain strings (no template needed)
    loss_mode: str  # "assistant_only", "completion_only", "all" or "preference" (each pair's two completions)
    sources: tuple = ()  # ((split, the files or dataset it is read from), ...): what a bad row's error names


@dataclass(frozen=True)
class ChatFingerprint(Fingerprint):
    """A token store's fingerprint, plus what makes a chat store's masks: another template is another store."""

    chat_template_sha256: str | None = None
    loss_mode: str = "all"
    packing: str = CHAT_PACKING

    def as_dict(self) -> dict:
        return {**super().as_dict(), "chat_template_sha256": self.chat_template_sha256, "loss_mode": self.loss_mode}


def is_chat_store(opened_or_manifest: dict) -> bool:
    manifest = opened_or_manifest.get("manifest", opened_or_manifest)
    return manifest.get("fingerprint", {}).get("packing") == CHAT_PACKING


# The value of a column that the features say is there but that was not read (the features-only look of a dataset
# whose first row could not be streamed): its kind is known, its content is not, so it is not checked here.
NOT_READ = object()


def _first_records(data: DataArgs, reads_first_row: bool = True) -> list:
    """(where, first record) of each local file, of a save_to_disk folder, or of the train split of --dataset_name
    (a hub dataset or a local folder of data files); [] for the built-in sample and where nothing could be looked
    at (the loader then reports why, when the data is loaded)."""
    if data.uses_default_data:
        return []  # without importing datasets: a run whose token store is ready never needs it
    import datasets

    from scaletrain.data.raw import _is_saved_dataset, _local_builder, local_data_files

    records = []
    if data.dataset_name and not _is_saved_dataset(data.dataset_name):
        records = _first_record_of_dataset(data, reads_first_row)
    elif data.dataset_name:
        raw = datasets.load_from_disk(data.dataset_name)  # memory-mapped: reads no rows
        train = raw["train"] if isinstance(raw, datasets.DatasetDict) and "train" in raw else raw
        if not isinstance(train, datasets.DatasetDict) and len(train) > 0:
            records = [(f"--dataset_name {data.dataset_name}", train[0])]
    for split, paths in local_data_files(data).items():  # --validation_file sets beside a --dataset_name too
        flag = "--train_file" if split == "train" else "--validation_file"
        for path in paths:
            builder = _local_builder([path], flag.lstrip("-"))
            if builder == "text":
                records.append((f"{flag} {path}", {"text": ""}))
                continue
            try:
                stream = datasets.load_dataset(builder, data_files={"train": path}, split="train", streaming=True)
                first = next(iter(stream), None)
            except Exception:  # unreadable: check_data_files names the file and the reason
                return []
            if first is not None:
                records.append((f"{flag} {path}", first))
    return records


def _first_record_of_dataset(data: DataArgs, reads_first_row: bool = True) -> list:
    """The first training record of a hub dataset or a local folder of data files (load_dataset's builder, then a
    stream of the train split). Features known without reading a row that say plain text stream nothing, since
    streaming a row can read a whole parquet row group or json file; an unstreamable format's features stand in, with
    NOT_READ for non-string columns. Chat data is streamed only where `reads_first_row` (global rank 0), so 512 ranks
    make one request to the hub, not 512."""
    import datasets

    where = f"--dataset_name {data.dataset_name}"
    try:
        builder = datasets.load_dataset_builder(
            data.dataset_name, data.dataset_config_name, revision=data.dataset_revision
        )
    except Exception:  # a look ahead only: not reachable, not cached; the loader names the dataset and the reason
        return []
    features = builder.info.features
    described = features and {
        name: "" if getattr(feature, "dtype", None) in ("string", "large_string") else NOT_READ
        for name, feature in features.items()
    }
    if described and (record_kind(described) is None or not reads_first_row):
        return [(where, described)]  # plain text: as before, nothing read; chat: rank 0 reads its first record
    try:
        first = next(iter(builder.as_streaming_dataset(split="train")), None)
        return [(where, first)] if first is not None else []
    except Exception:  # as above
        pass
    if not described:
        return []
    log.info("%s: its first record could not be streamed; its kind of data is taken from its features", where)
    return [(where, described)]


def resolve_chat_data(data: DataArgs, tokenizer, reads_first_row: bool = True) -> ChatData | None:
    """Pre-flight, before anything heavy: whether the run's data is chat data and how it is rendered; None for
    plain text. Refuses chat flags on data without conversations, a conversation with no template anywhere, and a
    first example that no template can render (an unknown role). Prepared stores say it in their manifest.
    `reads_first_row`: False on every rank but global rank 0, which alone streams a dataset's first record where the
    dataset's features already say it is chat data (see _first_record_of_dataset)."""
    if data.store_paths:
        return _chat_data_of_stores(data)
    records = _first_records(data, reads_first_row)
    kinds = {record_kind(record) for _, record in records}
    if len(kinds) > 1:
        raise UsageError(
            f"{', '.join(where for where, _ in records)}: some files hold chat data and some do not",
            "give files of one kind",
        )
    kind = kinds.pop() if kinds else None
    if kind is None:
        for flag, given in (
            ("--assistant_only_loss", data.assistant_only_loss),
            ("--chat_template", data.chat_template),
            ("--print_samples", data.print_samples),
        ):
            if given:
                where = records[0][0] if records else "the data"
                raise UsageError(
                    f"{flag}: {where} holds no conversations (no messages column, nor prompt and completion columns)",
                    "give a dataset with a messages column (TRL's conversational format), or drop the flag",
                )
        return None
    where, first = records[0]
    if kind == "preference":
        from scaletrain.data.preference_store import PREFERENCE_KIND, check_same_preference_format, preference_template

        read = [(w, r) for w, r in records if not any(value is NOT_READ for value in r.values())]
        check_same_preference_format(read)
        template = preference_template(where, first, data, tokenizer, unread=len(read) < len(records))
        return ChatData(PREFERENCE_KIND, template, PREFERENCE_KIND, _split_sources(data))
    if kind == "messages":
        if first["messages"] is not NOT_READ:
            check_messages(first["messages"], 0)
        template = load_chat_template(tokenizer, data.chat_template)
        return ChatData(kind, template, "assistant_only" if data.assistant_only_loss else "all")
    conversational = not isinstance(first["prompt"], str)
    if conversational:
        for name in ("prompt", "completion"):
            if first[name] is not NOT_READ:
                check_messages(first[name], 0, name)
    elif data.assistant_only_loss:
        raise UsageError(
            f"--assistant_only_loss: {where} holds prompt/completion text, not conversations",
            "drop the flag: a prompt/completion dataset trains on the completion only anyway",
        )
    template = load_chat_template(tokenizer, data.chat_template) if conversational or data.chat_template else None
    return ChatData(kind, template, "completion_only")


def _split_sources(data: DataArgs) -> tuple:
    """((split, "--flag value"), ...) of the run's raw data, for the errors that name a bad row's file."""
    from scaletrain.data.raw import local_data_files

    named = [("train", f"--dataset_name {data.dataset_name}")] if data.dataset_name else []
    for split, files in local_data_files(data).items():
        flag = "--train_file" if split == "train" else "--validation_file"
        named.append((split, f"{flag} {','.join(map(str, files))}"))
    return tuple(named)


def _chat_data_of_stores(data: DataArgs) -> ChatData | None:
    """The chat data of prepared stores, from their manifests. A --dataset_mix of chat stores must agree on what a
    run of one of them would be: one chat template (the one the export carries; none for every store, or the same
    for all), and the same kind of loss: whole conversations, or the replies only (an assistant-only conversation
    store and a prompt/completion store both train only the replies: they mix). Refused otherwise, naming both."""
    paths = list(data.store_paths)
    manifests = [read_manifest(Path(p)) for p in paths]
    chat = [(path, m) for path, m in zip(paths, manifests, strict=True) if is_chat_store(m)]
    if not chat:
        if data.assistant_only_loss or data.chat_template:
            raise UsageError(
                f"{data.store_flag}: a store of plain text; --assistant_only_loss and --chat_template "
                "apply when the store is prepared",
                "prepare a store from chat data",
            )
        return None
    if len(chat) != len(manifests):
        text = [path for path, m in zip(paths, manifests, strict=True) if not is_chat_store(m)]
        raise UsageError(
            f"{data.store_flag}: mixes chat stores ({', '.join(p for p, _ in chat)}) with stores of "
            f"plain text ({', '.join(text)})",
            "mix stores of one kind: prepare the text as chat data "
            "(a messages or prompt/completion file), or train the two kinds in separate runs",
        )
    first_path, first = chat[0]
    for path, manifest in chat[1:]:
        _check_same_chat(first_path, first=first, path=path, manifest=manifest, flag=data.store_flag)
    template_text = first.get("chat_template")  # every store's, as checked
    template = ChatTemplate(template_text, f"the chat template of store {first_path}") if template_text else None
    return ChatData(first.get("chat_kind", "messages"), template, first["fingerprint"]["loss_mode"])


def _template_name(manifest: dict) -> str:
    sha = manifest["fingerprint"].get("chat_template_sha256")
    return f"chat template sha256 {sha[:12]}" if sha else "no chat template"


def _check_same_chat(first_path: str, *, first: dict, path: str, manifest: dict, flag: str) -> None:
    a, b = first["fingerprint"], manifest["fingerprint"]
    if a.get("chat_template_sha256") != b.get("chat_template_sha256"):
        raise UsageError(
            f"{flag}: the stores were rendered with different chat templates ({first_path}: "
            f"{_template_name(first)}; {path}: {_template_name(manifest)})",
            "prepare every store with the same --chat_template (the model learns one format, and the "
            "export carries one template)",
        )
    whole = {a["loss_mode"], b["loss_mode"]}
    if "all" in whole and len(whole) > 1:
        raise UsageError(
            f"{flag}: the stores train different tokens ({first_path}: {a['loss_mode']}; {path}: "
            f"{b['loss_mode']}): whole conversations in one, only the replies in the other",
            "prepare the conversation store with --assistant_only_loss (a prompt/completion store "
            "trains only its completions)"
            if "completion_only" in whole
            else "prepare both stores with --assistant_only_loss, or both without",
        )


def chat_fingerprint(data: DataArgs, tokenizer, block_size: int, chat: ChatData) -> ChatFingerprint:
    from scaletrain.data.preparation import store_fingerprint

    base = store_fingerprint(data, tokenizer, block_size)
    # No held-out draw: a chat store's validation comes from --validation_file only (nor does --seed change it).
    fields = {name: getattr(base, name) for name in base.__dataclass_fields__ if name not in ("packing", "held_out")}
    fields["held_out"] = None
    return ChatFingerprint(
        **fields, chat_template_sha256=chat.template.sha256 if chat.template else None, loss_mode=chat.loss_mode
    )


def _check_rows(ds, chat: ChatData, split: str) -> None:
    """Every row's messages, before any is rendered: a bad row deep in the file is refused as early as the first."""
    kind = chat.kind
    if kind == "preference":
        from scaletrain.data.preference_store import check_preference_rows

        return check_preference_rows(ds, dict(chat.sources).get(split, f"{split} data"))
    columns = ("messages",) if kind == "messages" else ("prompt", "completion")
    for name in columns:
        if name not in ds.column_names:
            raise UsageError(
                f"{split} data: no {name} column (columns: {', '.join(ds.column_names)})",
                "every file of a chat dataset has the same columns",
            )
    if kind == "prompt_completion" and ds.features["prompt"].__class__.__name__ == "Value":
        return  # plain strings: nothing to check
    for index, row in enumerate(ds.select_columns(list(columns))):
        for name in columns:
            check_messages(row[name], index, name)


# Rows per batch a rendering worker gets, and the fewest rows worth starting workers for: each imports transformers
# and loads the tokenizer (seconds), and one process renders about 2,000 short conversations a second.
RENDER_BATCH = 256
PARALLEL_MIN_ROWS = 20_000
_RENDERER: dict = {}


def _init_renderer(
    tokenizer_dir: str, template: ChatTemplate | None, assistant_only: bool, kind: str, parent_pid: int | None
) -> None:
    """A rendering worker: the run's tokenizer from its saved folder, one tokenizer thread."""
    from transformers import AutoTokenizer

    from scaletrain.data.token_store import _die_with_parent

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    _RENDERER.update(
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        template=template,
        assistant_only=assistant_only,
        kind=kind,
    )


def _render_rows(batch: tuple) -> tuple:
    """(ids, mask, lengths) of rows numbered from `first` (the numbers errors name), as flat arrays: cheap to send
    back from a worker. A preference row is two sequences, its chosen then its rejected one."""
    first, rows = batch
    w = _RENDERER
    if w["kind"] == "preference":
        from scaletrain.data.preference_render import render_pair

        rendered = [
            seq for k, row in enumerate(rows) for seq in render_pair(row, w["tokenizer"], w["template"], first + k)
        ]
    else:
        rendered = [
            render_example(row, w["tokenizer"], w["template"], first + k, assistant_only=w["assistant_only"])
            for k, row in enumerate(rows)
        ]
    ids = np.fromiter((i for r in rendered for i in r.input_ids), dtype=np.int64)
    mask = np.fromiter((m for r in rendered for m in r.loss_mask), dtype=MASK_DTYPE)
    return ids, mask, np.fromiter((len(r.input_ids) for r in rendered), dtype=np.int64, count=len(rendered))


def _row_batches(ds):
    """(index of the first row, the rows) of `ds`, RENDER_BATCH rows at a time."""
    for first in range(0, len(ds), RENDER_BATCH):
        part = ds[first : first + RENDER_BATCH]
        yield first, [dict(zip(part, values, strict=True)) for values in zip(*part.values(), strict=True)]


def render_split(ds, tokenizer, chat: ChatData, split: str, show_progress: bool, workers: int = 1) -> tuple:
    """(token ids, mask, example lengths) of every row of `ds`, as flat arrays. With workers > 1 (and enough rows)
    worker processes render batches of rows, read back in order: the same arrays for any number of workers."""
    import tempfile

    from tqdm.auto import tqdm

    from scaletrain.data.token_store import WorkerPool, _dtype_for

    _check_rows(ds, chat, split)
    assistant_only = chat.loss_mode != "all"
    ids, masks, lengths = [], [], []
    dtype = _dtype_for(len(tokenizer))
    pool, tokenizer_dir, finished = None, None, False
    with tqdm(total=len(ds), desc=f"rendering {split}", unit="example", disable=not show_progress) as bar:
        try:
            if workers > 1 and len(ds) >= PARALLEL_MIN_ROWS:  # the workers load the tokenizer from a saved copy
                tokenizer_dir = tempfile.mkdtemp(prefix="scaletrain-render-")
                tokenizer.save_pretrained(tokenizer_dir)
                pool = WorkerPool(
                    min(workers, len(ds) // RENDER_BATCH),
                    (tokenizer_dir, chat.template, assistant_only, chat.kind),
                    _init_renderer,
                    _render_rows,
                )
                results = pool.map(_row_batches(ds))
            else:
                _RENDERER.update(
                    tokenizer=tokenizer, template=chat.template, assistant_only=assistant_only, kind=chat.kind
                )
                results = map(_render_rows, _row_batches(ds))
            for batch_ids, batch_mask, batch_lengths in results:
                ids.append(batch_ids.astype(dtype))
                masks.append(batch_mask)
                lengths.append(batch_lengths)
                bar.update(len(batch_lengths))
            finished = True
        finally:
            if pool is not None:
                pool.close(finished)
            if tokenizer_dir is not None:
                shutil.rmtree(tokenizer_dir, ignore_errors=True)
            _RENDERER.clear()
    if not ids:
        return np.zeros(0, dtype), np.zeros(0, MASK_DTYPE), np.zeros(0, np.int64)
    return np.concatenate(ids), np.concatenate(masks), np.concatenate(lengths)


def write_chat_store(
    splits: dict,
    *,
    tokenizer,
    fingerprint: ChatFingerprint,
    chat: ChatData,
    store: Path,
    show_progress: bool = True,
    workers: int = 1,
) -> Path:
    """Render every split into `store` (`workers` processes), atomically (a temporary folder renamed into place when
    complete)."""
    from scaletrain.data.token_store import WorkerDied, _dtype_for

    started = time.perf_counter()
    try:
        rendered = {
            name: render_split(
                ds, tokenizer=tokenizer, chat=chat, split=name, show_progress=show_progress, workers=workers
            )
            for name, ds in splits.items()
            if ds is not None
        }
    except WorkerDied as err:
        raise err.as_prepare_error(f"chat store {store}", "rendering", "--preprocessing_num_workers") from None
    train_ids, train_mask, train_lengths = rendered["train"]
    if chat.loss_mode not in ("all", "preference"):  # before anything is written: a refused dataset leaves nothing
        bounds = np.cumsum(train_lengths)[:-1]
        summary = check_masks((m.astype(np.int64) for m in np.split(train_mask, bounds)), chat.template)
        if summary.examples_without_trained_tokens:
            log.warning(
                "chat data: %d of %d training examples have no trained token",
                summary.examples_without_trained_tokens,
                summary.examples,
            )
    tmp = store.parent / f".{store.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        counts = {}
        for name, (ids, mask, lengths) in rendered.items():
            (tmp / f"{name}.tokens.bin").write_bytes(ids.tobytes())
            (tmp / f"{name}.mask.bin").write_bytes(mask.tobytes())
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
            np.save(tmp / f"{name}.docs.npy", starts.astype(np.int64))
            counts[name] = {
                "n_tokens": int(len(ids)),
                "n_documents": int(len(lengths)),
                "n_trained_tokens": int(mask.sum(dtype=np.int64)),
            }
        manifest = {
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint.as_dict(),
            "dtype": _dtype_for(len(tokenizer)).str,
            "eos_id": tokenizer.eos_token_id,
            "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            "splits": counts,
            "chat_kind": chat.kind,
            "chat_template": chat.template.text if chat.template else None,
            "prepared_seconds": round(time.perf_counter() - started, 2),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, store)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return store


def prepare_chat_store(
    data: DataArgs, *, tokenizer, block_size: int, store: Path, chat: ChatData, show_progress: bool = True
) -> Path:
    """Render the run's chat data into `store`, or reuse the store there when it was made from the same input,
    template and loss mode. As for a text store: one preparer at a time (the leftovers of a killed one removed), and
    the local corpus's Arrow copy in a scratch folder removed afterwards, not in the Hugging Face cache."""
    from scaletrain.data.raw import load_raw_datasets
    from scaletrain.data.preparation import exclusive_preparation, partial_folders, reusable_store

    fingerprint = chat_fingerprint(data, tokenizer, block_size, chat)
    with exclusive_preparation(store):
        if reusable_store(store, fingerprint) is not None:
            log.info("chat store %s: reusing it (same input, tokenizer, template and loss mode)", store)
            return store
        folder, name = partial_folders(store, str(os.getpid()))[1]
        scratch = folder / name
        try:
            train, validation, _revision = load_raw_datasets(data, scratch_dir=scratch)
            if len(train) == 0:
                raise UsageError("chat data: the training set is empty", "give at least one example")
            started = time.perf_counter()
            write_chat_store(
                {"train": train, **validation},
                tokenizer=tokenizer,
                fingerprint=fingerprint,
                chat=chat,
                store=store,
                show_progress=show_progress,
                workers=data.preprocessing_num_workers or os.cpu_count() or 1,
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    log.info(
        f"chat store {store}: prepared in {time.perf_counter() - started:.1f}s ("
        f"{chat.template.source if chat.template else 'no template'}, loss on {chat.loss_mode.replace('_', ' ')} "
        "tokens)"
    )
    return store


def store_plan(data: DataArgs, *, tokenizer, block_size: int, chat: ChatData, show_progress: bool) -> tuple:
    """(where a chat store of this data goes, how to prepare it there): preparation.ensure_store's arguments."""
    from scaletrain.data.preparation import default_store_path

    store = default_store_path(chat_fingerprint(data, tokenizer, block_size, chat))
    return store, lambda path: prepare_chat_store(
        data, tokenizer=tokenizer, block_size=block_size, store=path, chat=chat, show_progress=show_progress
    )


def attach_masks(opened: dict, store: Path) -> dict:
    """A chat store's masks beside its opened splits (`opened["masks"]`); a plain store is returned as it is."""
    if not is_chat_store(opened):
        return opened
    masks = {}
    for split, part in opened["splits"].items():
        path = Path(store) / f"{split}.mask.bin"
        size = path.stat().st_size if path.exists() else -1
        if size != part.n_tokens * MASK_DTYPE.itemsize:
            raise UsageError(
                f"--data_path {store}: {path.name} holds {size} bytes, the store has {part.n_tokens} "
                "tokens (truncated or corrupt)",
                "prepare the store again",
            )
        masks[split] = np.memmap(path, dtype=MASK_DTYPE, mode="r") if part.n_tokens else np.zeros(0, MASK_DTYPE)
    return {**opened, "masks": masks}
