"""Raw documents: local files or a Hugging Face dataset, loaded as `datasets.Dataset`s and checked before anything
heavy (every local file has documents, and its text column exists and holds text)."""

from __future__ import annotations

from pathlib import Path

from scaletrain.config import LOCAL_DATA_FORMATS, DataArgs, expand_data_files
from scaletrain.errors import UsageError


def record_kind(record: dict) -> str | None:
    """ "messages", "prompt_completion", "preference" (chosen/rejected pairs), or None for a record of plain text
    (chat data: data/chat_store.py; preference pairs: data/preference_store.py)."""
    if "chosen" in record or "rejected" in record:  # one without the other is refused by name when checked
        return "preference"
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    return None


def _local_builder(files: list, flag: str) -> str:
    kinds = {LOCAL_DATA_FORMATS[Path(f).suffix.lower()] for f in files}
    if len(kinds) != 1:
        raise UsageError(f"--{flag}: files of different formats ({', '.join(sorted(kinds))})", "use one format")
    return kinds.pop()


def local_data_files(data: DataArgs) -> dict:
    """{split: [files]} of the run's local files (the built-in sample when no data flag is given): "train" (none
    with --dataset_name), then each validation set ("validation", or "validation.<name>" for a named one)."""
    files = {"train": expand_data_files(data.train_data_file)} if not data.dataset_name else {}
    return {**files, **data.validation_sets}


def _is_saved_dataset(path: str) -> bool:
    folder = Path(path)
    return folder.is_dir() and ((folder / "dataset_dict.json").exists() or (folder / "dataset_info.json").exists())


def load_raw_datasets(data: DataArgs, scratch_dir: Path | None = None) -> tuple:
    """(train, {validation split: dataset}, the hub commit or None) as `datasets.Dataset`s of documents: the
    --validation_file sets where given (beside any source, a hub dataset's too), else the source's own validation
    split ({} when it has none: the preparer may hold some training documents out).

    A local corpus (files, or a folder given as --dataset_name) is converted to Arrow in `scratch_dir` (the caller
    removes it when done) instead of the Hugging Face cache, which would keep a second full copy of it there for good.
    A hub dataset is cached there as usual (a download kept for the next preparation).
    """
    import datasets

    scratch = {"cache_dir": str(scratch_dir)} if scratch_dir is not None else {}
    revision = None
    if data.dataset_name and _is_saved_dataset(data.dataset_name):
        raw = datasets.load_from_disk(data.dataset_name)
        raw = raw if isinstance(raw, datasets.DatasetDict) else datasets.DatasetDict({"train": raw})
    elif data.dataset_name:
        raw, revision = _load_hub_dataset(data, scratch if Path(data.dataset_name).is_dir() else {})
    else:
        files = local_data_files(data)
        builder = _local_builder([f for split in files.values() for f in split], "train_file/--validation_file")
        # Plain text: a blank line separates documents (one file may hold many; a paragraph is a document).
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        raw = datasets.load_dataset(builder, data_files=files, **extra, **scratch)
    if "train" not in raw:
        raise UsageError(f"--dataset_name {data.dataset_name}: no train split (splits: {', '.join(raw)})")
    sets = data.validation_sets
    if sets and data.dataset_name:  # local validation files beside a dataset's training split
        builder = _local_builder([f for files in sets.values() for f in files], "validation_file")
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        raw = {**raw, **datasets.load_dataset(builder, data_files=sets, **extra, **scratch)}
    validation = (
        {split: raw[split] for split in sets}
        if sets
        else ({"validation": raw["validation"]} if "validation" in raw else {})
    )
    return raw["train"], validation, revision


def _load_hub_dataset(data: DataArgs, cache: dict) -> tuple:
    """(A hub dataset at --dataset_revision, the commit it resolved to); one line naming it when it cannot be reached
    or found (the model and tokenizer get the same)."""
    import datasets

    assert data.dataset_name is not None  # called only for a --dataset_name
    try:
        # load_dataset's own steps, keeping the builder: its hash is the commit the revision resolved to.
        builder = datasets.load_dataset_builder(
            data.dataset_name, data.dataset_config_name, revision=data.dataset_revision, **cache
        )
        builder.download_and_prepare()
        raw = builder.as_dataset()
    except (ConnectionError, FileNotFoundError) as exc:  # no network, offline mode, or no such dataset
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"--dataset_name {data.dataset_name}: cannot load it ({detail})",
            "check the name and the network (a hub dataset is downloaded once, then read from the "
            "Hugging Face cache), or give local files with --train_file",
        ) from exc
    local = Path(data.dataset_name).is_dir()  # a local folder's hash is of its files, not a commit
    return raw, None if local else builder.hash


def check_data_files(data: DataArgs) -> None:
    """Before anything is built: each local file has documents, and its --text_column exists and holds text.

    Reads only the first record, streaming (no Arrow cache is written). A --dataset_name is checked when loaded
    (its --validation_file sets here). The built-in sample is ours: not read ahead (nor datasets imported, about 1 s).
    """
    if data.data_path or data.uses_default_data:
        return
    import datasets

    for split, split_files in local_data_files(data).items():
        flag = "train_file" if split == "train" else "validation_file"
        for path in split_files:
            builder = _local_builder([path], flag)
            extra = {"sample_by": "paragraph"} if builder == "text" else {}
            with open(path, "rb") as f:
                head = f.read(1 << 16)
            if not head.strip() and Path(path).stat().st_size <= len(head):
                raise UsageError(f"--{flag} {path}: the file holds no documents", "give a file with at least one")
            try:
                stream = datasets.load_dataset(
                    builder, data_files={"train": path}, split="train", streaming=True, **extra
                )
                first = next(iter(stream), None)
            except Exception as exc:  # the readers raise many types; the user needs the file and the reason
                detail = str(exc).splitlines()[0][:200] if str(exc) else "no detail"
                raise UsageError(
                    f"--{flag} {path}: cannot read it as {builder} ({type(exc).__name__}: {detail})",
                    "check the file's format and contents",
                ) from exc
            if first is None:
                raise UsageError(f"--{flag} {path}: the file holds no documents", "give a file with at least one")
            if data.text_column not in first:
                raise UsageError(
                    f"--text_column {data.text_column}: not a column of {path}", f"columns there: {', '.join(first)}"
                )
            if not isinstance(first[data.text_column], str):
                raise UsageError(
                    f"--text_column {data.text_column}: holds {type(first[data.text_column]).__name__} "
                    f"in {path}, not text",
                    "pick a column of strings",
                )


def check_text_column(ds, column: str, source: str) -> None:
    if len(ds) == 0:
        raise UsageError(f"{source}: the dataset is empty", "give a file or dataset with at least one document")
    if column not in ds.column_names:
        kind = record_kind(dict.fromkeys(ds.column_names))
        if kind is not None:  # chat data whose first record the pre-flight could not read, taken for plain text
            columns = {
                "messages": "a messages column",
                "prompt_completion": "prompt and completion columns",
                "preference": "chosen and rejected columns",
            }[kind]
            raise UsageError(
                f"--text_column {column}: not a column of {source}, which has {columns}: chat data that the "
                "pre-flight could not recognise (its first record could not be read ahead), so it was read as text",
                "save it with datasets' save_to_disk and give that folder as --dataset_name, or its files as "
                "--train_file: their first record is read before loading and they are rendered as chat data",
            )
        raise UsageError(
            f"--text_column {column}: not a column of {source}",
            f"columns there: {', '.join(ds.column_names)}",
        )
    feature = ds.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise UsageError(f"--text_column {column}: holds {feature}, not text", "pick a column of strings")
