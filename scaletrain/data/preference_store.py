"""Preference pairs as a chat store: each row (TRL's `chosen`/`rejected` formats, scaletrain/data/preference_render.py)
becomes two sequences, prompt + chosen completion then prompt + rejected completion, written one after the other
with a loss mask on the completion tokens. So pair i is examples 2i and 2i + 1 of its split, and the chat store's
machinery (fingerprint, rendering workers, atomic write, masks) serves preference data unchanged; the manifest says
`chat_kind: preference`. scaletrain/data/pairs.py reads the pairs back for training.

Every row is checked before any is rendered (its format, both columns, identical or empty completions, implicit
prompts that differ): a bad row deep in a file is refused as early as the first, naming the file and the row, and
nothing is written.
"""

from __future__ import annotations

from scaletrain.config import DataArgs
from scaletrain.data.chat_render import load_chat_template
from scaletrain.errors import UsageError

PREFERENCE_KIND = "preference"


def preference_template(where: str, first: dict, data: DataArgs, tokenizer, unread: bool):
    """The pre-flight's look at preference data: its first row's format checked (`unread`: only its features are
    known), and the chat template a conversational format renders with (or that the export carries, where
    --chat_template is given); None for plain-text pairs without one."""
    from scaletrain.data.preference_render import preference_format

    if data.assistant_only_loss:
        raise UsageError(
            f"--assistant_only_loss: {where} holds preference pairs, whose loss is on the completions already",
            "drop the flag",
        )
    conversational = unread or preference_format(first, 0) != "explicit_text"
    return load_chat_template(tokenizer, data.chat_template) if conversational or data.chat_template else None


def check_same_preference_format(records: list) -> None:
    """The first rows of every file (`records`: [(where, row)]) in one format: a run trains one kind of pair."""
    from scaletrain.data.preference_render import preference_format

    formats = [(where, preference_format(row, 0)) for where, row in records]
    for where, fmt in formats[1:]:
        if fmt != formats[0][1]:
            raise UsageError(
                f"{where} holds {fmt.replace('_', ' ')} pairs, {formats[0][0]} {formats[0][1].replace('_', ' ')} "
                "ones: files of mixed formats",
                "give every file the same columns and kind of values (all text, or all message lists)",
            )


def check_preference_rows(ds, where: str) -> None:
    """Every row of a split (read from `where`, which errors name), before any is rendered: both columns there, one
    format throughout, and each pair checked as render_pair will check it (so a bad row is refused here, in the
    parent)."""
    from scaletrain.data.preference_render import check_pair, preference_format

    for name in ("chosen", "rejected"):
        if name not in ds.column_names:
            raise UsageError(
                f"{where}: no {name} column (columns: {', '.join(ds.column_names)})",
                "preference data has chosen and rejected columns (and a prompt column, or conversations that share "
                "their prompt turns)",
            )
    first_format = None
    for index, row in enumerate(ds):
        try:
            fmt = preference_format(row, index)
            if first_format is None:
                first_format = fmt
            elif fmt != first_format:
                raise UsageError(
                    f"example {index} is {fmt.replace('_', ' ')} while example 0 is "
                    f"{first_format.replace('_', ' ')}: rows of mixed formats",
                    "give every row the same columns and kind of values (all text, or all message lists)",
                )
            check_pair(row, index, fmt)
        except UsageError as err:
            raise UsageError(f"{where}: {err.message}", err.hint) from None
