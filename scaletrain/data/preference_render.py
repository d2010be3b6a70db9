"""Preference data: a TRL preference row (explicit text, explicit or implicit conversational) turned into prompt +
chosen and prompt + rejected, each trained on its completion, tokenized exactly as TRL 1.16's DPOTrainer
(`_prepare_dataset`) does so that a run here sees the ids a TRL run sees. Formats:
docs/fine-tuning.md#preference-optimization-dpo.

The completion starts where the prompt's ids and each whole sequence's ids first differ, as in TRL. That can be before
the end of the prompt (a BPE merge across the boundary: "is " + "blue" is "is", " blue"), training prompt tokens as
completion; chat_render.py cuts at the boundary instead, but here TRL's choice is kept on purpose, because a preference
run is checked against TRL's numbers. Rows TRL would take but that train nothing true (identical completions, an empty
one, a prompt that is not one) are refused, naming `example {index}`.
"""

from __future__ import annotations

from collections.abc import Iterable

from scaletrain.data.chat_render import ChatTemplate, MaskedTokens, _render, check_messages
from scaletrain.errors import UsageError

PREFERENCE_FORMATS = ("explicit_text", "explicit_conversational", "implicit_conversational")
_PROMPT_ROLES = ("system", "user")  # the turns a reply answers
_FORMAT_FIX = (
    "a preference row is TRL's: prompt, chosen and rejected (all text or all message lists), or chosen and rejected "
    "message lists that repeat the prompt turns"
)


def preference_format(row: dict, index: int = 0) -> str:
    """Which of PREFERENCE_FORMATS the row is in, from its columns and their value types (a string is text, a list
    is messages, checked later). A plain-text pair without a prompt is refused: TRL's extract_prompt would take
    their common characters as the prompt, cutting at the first character that differs, which can split a word
    ("It is bad" / "It is bold": prompt "It is b"), so the completions trained would not be the ones written."""
    has_chosen, has_rejected = "chosen" in row, "rejected" in row
    if not (has_chosen and has_rejected):
        present, missing = ("chosen", "rejected") if has_chosen else ("rejected", "chosen")
        if not (has_chosen or has_rejected):
            raise UsageError(
                f"example {index} has neither a chosen nor a rejected column (columns: {', '.join(sorted(row))})",
                _FORMAT_FIX,
            )
        raise UsageError(f"example {index} has a {present} column but no {missing} column", _FORMAT_FIX)
    chosen_kind, rejected_kind = _kind(row, "chosen", index), _kind(row, "rejected", index)
    if chosen_kind != rejected_kind:
        raise UsageError(f"example {index}: chosen is {chosen_kind} but rejected is {rejected_kind}", _FORMAT_FIX)
    if "prompt" in row:
        prompt_kind = _kind(row, "prompt", index)
        if prompt_kind != chosen_kind:
            raise UsageError(
                f"example {index}: the prompt is {prompt_kind} but chosen and rejected are {chosen_kind}",
                "give prompt, chosen and rejected all as text or all as message lists",
            )
        return "explicit_text" if chosen_kind == "text" else "explicit_conversational"
    if chosen_kind == "text":
        raise UsageError(
            f"example {index}: plain-text chosen and rejected without a prompt column",
            "add a prompt column: a text prompt cannot be told from the completions (TRL's extract_prompt cuts at "
            'the first differing character, which can split a word: "It is bad" / "It is bold" -> "It is b")',
        )
    return "implicit_conversational"


def _kind(row: dict, field: str, index: int) -> str:
    value = row[field]
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple)):
        return "a message list"
    raise UsageError(
        f"example {index}: {field} is {type(value).__name__}, neither text nor a message list", _FORMAT_FIX
    )


def mixed_formats_error(first: str, other: str, index: int) -> UsageError:
    """The error for a row whose format is not the first row's (the caller raises it)."""
    return UsageError(
        f"example {index} is {other} but example 0 is {first}: a preference dataset has one format",
        "convert the rows to one format (TRL too decides from the first row whether to extract prompts and append "
        "EOS, and would mistreat the others)",
    )


def check_same_format(rows: Iterable[dict], first_format: str) -> None:
    """Refuse a dataset whose rows are not all in `first_format`, naming the first row that differs."""
    for index, row in enumerate(rows):
        fmt = preference_format(row, index)
        if fmt != first_format:
            raise mixed_formats_error(first_format, fmt, index)


def check_pair(row: dict, index: int, fmt: str) -> tuple:
    """The row's (prompt, chosen, rejected), an implicit row's prompt taken out of both, after refusing what trains
    nothing true: identical completions, an empty one, messages that are not a prompt and a reply. A conversational
    completion must be assistant turns after a system or user turn: TRL's extract_prompt takes any common prefix as
    the prompt, so a pair differing at an earlier turn would train user text, or replies to other contexts, as the
    model's reply."""
    assert fmt in PREFERENCE_FORMATS, fmt
    if fmt == "explicit_text":
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        for field, text in (("chosen", chosen), ("rejected", rejected)):
            if not text.strip():
                raise UsageError(
                    f"example {index}: the {field} completion is empty", "drop the example, or fill in the completion"
                )
        _check_different(chosen, rejected, index)
        return prompt, chosen, rejected
    for field in ("prompt", "chosen", "rejected") if fmt == "explicit_conversational" else ("chosen", "rejected"):
        check_messages(row[field], index, field)
    if fmt == "explicit_conversational":
        prompt, chosen, rejected = list(row["prompt"]), list(row["chosen"]), list(row["rejected"])
        _check_different(chosen, rejected, index)
        if prompt[-1]["role"] not in _PROMPT_ROLES:
            raise UsageError(
                f"example {index}: the prompt ends with an assistant turn; a completion answers a system or user turn",
                "end the prompt with the user turn the completions answer",
            )
    else:
        prompt, chosen, rejected = _extract_prompt(list(row["chosen"]), list(row["rejected"]), index)
    for field, completion in (("chosen", chosen), ("rejected", rejected)):
        _check_completion(completion, field, index)
    return prompt, chosen, rejected


def _check_different(chosen, rejected, index: int) -> None:
    if chosen == rejected:
        raise UsageError(
            f"example {index}: chosen and rejected are identical, so the pair prefers nothing",
            "drop the example",
        )


def _extract_prompt(chosen: list, rejected: list, index: int) -> tuple:
    """The turns chosen and rejected share (their longest common prefix, as TRL's extract_prompt), and what follows
    in each; refused unless the shared turns end with a system or user turn and only assistant turns follow."""
    _check_different(chosen, rejected, index)
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    fix = (
        "an implicit-prompt pair repeats the same prompt turns in chosen and rejected and differs only in the final "
        "assistant turn(s); or give the prompt in a prompt column"
    )
    for field, messages, other in (("chosen", chosen, "rejected"), ("rejected", rejected, "chosen")):
        if shared == len(messages):
            raise UsageError(
                f"example {index}: {field} has no turn after the {shared} turns it shares with {other}, so its "
                "completion is empty",
                fix,
            )
    turn = next(
        (
            (field, j, m["role"])
            for field, ms in (("chosen", chosen), ("rejected", rejected))
            for j, m in enumerate(ms)
            if j >= shared and m["role"] != "assistant"
        ),
        None,
    )
    if turn is not None or shared == 0:
        where = f", where {turn[0]}[{turn[1]}] is a {turn[2]} turn" if turn else ": no prompt turn is shared"
        raise UsageError(
            f"example {index}: chosen and rejected do not share their prompt turns: they differ from message "
            f"{shared} on{where}; only the final assistant turn(s) may differ",
            fix,
        )
    if chosen[shared - 1]["role"] not in _PROMPT_ROLES:
        raise UsageError(
            f"example {index}: the turns chosen and rejected share end with an assistant turn (message {shared - 1}); "
            "a completion answers a system or user turn",
            fix,
        )
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _check_completion(completion: list, field: str, index: int) -> None:
    for j, message in enumerate(completion):
        if message["role"] != "assistant":
            raise UsageError(
                f"example {index}: {field}[{j}] is a {message['role']} turn; a completion holds only assistant turns",
                "put the conversation before the reply in the prompt column",
            )
        if not message["content"].strip():
            raise UsageError(
                f"example {index}: {field}[{j}] (assistant) is empty", "drop the example, or fill in the reply"
            )


def render_pair(row: dict, tokenizer, template: ChatTemplate | None, index: int) -> tuple[MaskedTokens, MaskedTokens]:
    """(prompt + chosen, prompt + rejected) as TRL tokenizes them, each trained on its completion only."""
    fmt = preference_format(row, index)
    if fmt != "explicit_text" and template is None:
        raise UsageError(
            f"example {index}: a conversational preference pair needs a chat template",
            "pass --chat_template FILE, or use a tokenizer that has one",
        )
    prompt, chosen, rejected = check_pair(row, index, fmt)
    if fmt == "explicit_text":
        prompt_ids, chosen_ids, rejected_ids = _tokenize_text(
            prompt, chosen=chosen, rejected=rejected, tokenizer=tokenizer, index=index
        )
    else:
        assert template is not None  # refused above without one
        prompt_ids, chosen_ids, rejected_ids = (
            _tokenize_chat(
                messages, tokenizer=tokenizer, template=template, index=index, generation_prompt=generation_prompt
            )
            for messages, generation_prompt in ((prompt, True), (prompt + chosen, False), (prompt + rejected, False))
        )
    # TRL: the completion starts where the tokenized prompt and prompt + completion diverge (common_prefix_length)
    prompt_len = min(_common_prefix_length(prompt_ids, chosen_ids), _common_prefix_length(prompt_ids, rejected_ids))
    pair = []
    for field, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        completion_ids = ids[prompt_len:]
        if not completion_ids:
            source = template.source if template is not None else "the tokenizer"
            raise UsageError(
                f"example {index}: {source} leaves no token of the {field} completion after the prompt",
                "check that the chat template renders the final assistant turn",
            )
        pair.append(
            MaskedTokens(prompt_ids[:prompt_len] + completion_ids, [0] * prompt_len + [1] * len(completion_ids))
        )
    return pair[0], pair[1]


def _tokenize_text(prompt: str, *, chosen: str, rejected: str, tokenizer, index: int) -> tuple:
    """TRL's plain-text path: EOS text appended unless there, the tokenizer's special tokens added (TRL calls the
    tokenizer on the text with its defaults)."""
    eos = tokenizer.eos_token
    if eos is None:
        raise UsageError(
            f"the tokenizer {tokenizer.name_or_path} has no EOS token to end a completion with",
            "use a tokenizer with an eos_token, or conversational rows and a chat template",
        )
    chosen, rejected = (text if text.endswith(eos) else text + eos for text in (chosen, rejected))
    _check_different(chosen, rejected, index)  # "yes" and "yes</s>" are one completion
    return tuple(tokenizer(text)["input_ids"] for text in (prompt, prompt + chosen, prompt + rejected))


def _tokenize_chat(messages: list, *, tokenizer, template: ChatTemplate, index: int, generation_prompt: bool) -> list:
    """TRL's conversational path: apply_chat_template(tokenize=True), which tokenizes the rendered text with
    add_special_tokens=False; rendered through chat_render so a template's refusal names the example."""
    text = _render(
        tokenizer, template=template, messages=messages, add_generation_prompt=generation_prompt, index=index
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _common_prefix_length(ids: list, other_ids: list) -> int:
    """TRL's common_prefix_length: how many leading tokens the two share."""
    length = 0
    for token, other in zip(ids, other_ids, strict=False):
        if token != other:
            break
        length += 1
    return length
