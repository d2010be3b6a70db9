"""Chat data rendered with a chat template into token ids and a loss mask that trains the assistant's replies, each up
to its end-of-turn token (so the model learns to stop; not the newline some templates write after it, which is never
generated), never the role headers or the generation prompt.

Replies are found by rendering prefix by prefix, since most templates (Llama 3, Qwen 2.5, Mistral, Gemma) have no
`{% generation %}` markers: `messages[:i]` with the generation prompt ends where reply i starts, `messages[:i + 1]`
where it ends. A template that renders an earlier turn differently once later turns follow (Mistral v0.3 moves the
system message, Qwen3 drops earlier think blocks) is refused, since no mask would be true for the trained text; where
markers exist, their spans must agree. The text is tokenized segment by segment, as at inference: tokenized whole, a BPE
merge can cross the prompt/reply boundary (the tiny test tokenizer's header "\\n\\n") and train on a context never seen
when generating.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from collections.abc import Collection, Iterable, Sequence

from scaletrain.errors import UsageError

ROLES = ("system", "user", "assistant")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the words that name it in messages."""

    text: str
    source: str  # "--chat_template path" or "the chat template of tokenizer <name>"

    @property
    def sha256(self) -> str:
        """For the token store's fingerprint: another template is another store."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def has_generation_markers(self) -> bool:
        return _GENERATION_MARKER.search(self.text) is not None


@dataclass(frozen=True)
class MaskedTokens:
    """One example's token ids, and 1 where the token is trained (its loss counts), 0 where it is context only."""

    input_ids: list
    loss_mask: list

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def trained_ids(self) -> list:
        return [token for token, trained in zip(self.input_ids, self.loss_mask, strict=True) if trained]


def load_chat_template(tokenizer, chat_template_file: str | None = None) -> ChatTemplate:
    """The template in `chat_template_file` (--chat_template), else the tokenizer's own; refused when neither
    exists, when the file cannot be read or when the template is not valid Jinja."""
    if chat_template_file is not None:
        path = Path(chat_template_file)
        if not path.is_file():
            raise UsageError(
                f"--chat_template {chat_template_file}: no such file",
                "pass a Jinja chat template file (e.g. a model's chat_template.jinja)",
            )
        template = ChatTemplate(path.read_text(encoding="utf-8"), f"--chat_template {chat_template_file}")
    else:
        text = tokenizer.chat_template
        if isinstance(text, dict):  # a tokenizer with named templates: the default one renders chats
            text = text.get("default")
        if not text:
            raise UsageError(
                f"the tokenizer {tokenizer.name_or_path} has no chat template",
                "pass --chat_template FILE with the model family's Jinja chat template",
            )
        template = ChatTemplate(text, f"the chat template of tokenizer {tokenizer.name_or_path}")
    _check_syntax(template)
    return template


def _check_syntax(template: ChatTemplate) -> None:
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template.text)
    except TemplateSyntaxError as exc:
        raise UsageError(f"{template.source}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from exc


def check_messages(messages, index: int, field: str = "messages") -> None:
    """Refuse what no template can render right: a non-list, a message without a string role and content, a role
    outside system/user/assistant, and a conversation that opens with the assistant (its reply has no prompt)."""
    where = f"example {index}: {field}"
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UsageError(
            f"{where} is not a non-empty list of messages",
            'each message is {"role": ..., "content": ...} (the TRL / OpenAI conversational format)',
        )
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UsageError(f"{where}[{j}] has no role", 'each message is {"role": ..., "content": "..."}')
        if message["role"] not in ROLES:
            raise UsageError(
                f"{where}[{j}] has role {message['role']!r}; the allowed roles are {', '.join(ROLES)}",
                "fix or drop the example",
            )
        if not isinstance(message.get("content"), str):
            raise UsageError(
                f"{where}[{j}] ({message['role']}) has no string content",
                'each message is {"role": ..., "content": "..."}',
            )


def render_conversation(
    messages: Sequence[dict], tokenizer, template: ChatTemplate, index: int = 0, train_from: int = 0
) -> MaskedTokens:
    """The conversation's tokens, with its assistant replies (from message `train_from` on) and their end-of-turn
    tokens trained. `index` names the example in errors."""
    check_messages(messages, index)
    if messages[0]["role"] == "assistant":
        raise UsageError(
            f"example {index}: messages[0] is an assistant turn; a conversation starts with a system or user message",
            "drop the example or add the prompt it answers",
        )
    full = _render(tokenizer, template=template, messages=messages, add_generation_prompt=False, index=index)
    replies: list[tuple[int, int]] = []  # (start, end) of each trained reply in the text of the whole conversation
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < train_from:
            continue
        prompt = _render(tokenizer, template=template, messages=messages[:i], add_generation_prompt=True, index=index)
        through = _render(
            tokenizer, template=template, messages=messages[: i + 1], add_generation_prompt=False, index=index
        )
        start = len(prompt)
        if not (through.startswith(prompt) and full.startswith(through)) or (replies and start < replies[-1][1]):
            raise UsageError(
                f"{template.source}: renders of example {index} are not prefix-consistent at turn {i} (assistant): "
                "the template renders earlier turns differently once later turns follow (it moves or drops a "
                "message), so no loss mask matches the text trained on",
                "pass --chat_template FILE with a prefix-preserving template (adding a turn leaves the earlier "
                "ones as they were, like TRL's *_training.jinja), or drop the system message if the template "
                "moves it",
            )
        replies.append((start, len(through)))
    pieces = _tokenize_pieces(full, replies, tokenizer)
    mask = _through_end_of_turn(pieces[0], pieces[2], tokenizer)
    if template.has_generation_markers and not train_from:  # markers cover every reply, a completion only some
        _check_generation_markers(
            messages, tokenizer=tokenizer, template=template, index=index, full=full, pieces=pieces, mask=mask
        )
    return MaskedTokens(pieces[0], mask)


def _render(
    tokenizer, *, template: ChatTemplate, messages: Sequence[dict], add_generation_prompt: bool, index: int
) -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            list(messages), chat_template=template.text, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as exc:  # the template's own raise_exception, e.g. "roles must alternate"
        raise UsageError(
            f"{template.source} refuses example {index}: {exc}",
            "fix the example, or pass --chat_template FILE with a template that accepts it",
        ) from exc


def _end_of_turn_ids(tokenizer) -> set:
    """Special tokens (EOS, <|eot_id|>, <|im_end|>, <end_of_turn>, ...): the last one in a reply closes it."""
    return {i for i, token in tokenizer.added_tokens_decoder.items() if token.special} | {tokenizer.eos_token_id}


def _tokenize_pieces(text: str, replies: list, tokenizer) -> tuple:
    """Token ids of `text` cut at the reply boundaries, each piece tokenized alone; with each token's character
    span in `text` and whether it lies in a reply."""
    bounds = [0] + [b for span in replies for b in span] + [len(text)]
    ids, offsets, in_reply = [], [], []
    for k in range(len(bounds) - 1):
        start = bounds[k]
        piece = tokenizer(text[start : bounds[k + 1]], add_special_tokens=False, return_offsets_mapping=True)
        ids += piece["input_ids"]
        offsets += [(start + a, start + b) for a, b in piece["offset_mapping"]]
        in_reply += [k % 2 == 1] * len(piece["input_ids"])  # pieces alternate prompt, reply, ..., tail
    return ids, offsets, in_reply


def _through_end_of_turn(ids: list, marked: list, tokenizer) -> list:
    """Each run of marked tokens, trained up to its last end-of-turn token (the whole run when it has none): the
    separator a template writes after the end of turn (Qwen's and Gemma's newline) is never generated."""
    end_of_turn = _end_of_turn_ids(tokenizer)
    mask = [0] * len(ids)
    for is_marked, group in itertools.groupby(range(len(ids)), key=lambda j: marked[j]):
        run = list(group)
        if is_marked:
            closing = [j for j in run if ids[j] in end_of_turn]
            for j in run[: run.index(closing[-1]) + 1] if closing else run:
                mask[j] = 1
    return mask


def _check_generation_markers(
    messages, *, tokenizer, template: ChatTemplate, index: int, full: str, pieces: tuple, mask: list
) -> None:
    """A template with `{% generation %}` markers says itself which text is the assistant's: the tokens it marks,
    up to each end-of-turn token, must be the ones the prefix renders train (markers that leave out the end-of-turn
    token would teach the model never to stop)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    # With return_assistant_tokens_mask it returns (renders, generation spans) though annotated `-> str`
    rendered, spans = cast(
        "tuple[list[str], list[list[tuple[int, int]]]]",
        render_jinja_template(
            conversations=[list(messages)],
            chat_template=template.text,
            return_assistant_tokens_mask=True,
            **tokenizer.special_tokens_map,
        ),
    )
    assert rendered[0] == full, "transformers renders the template another way than apply_chat_template"
    ids, offsets = pieces[0], pieces[1]
    marked = [any(a < end and b > start for start, end in spans[0]) for a, b in offsets]
    by_markers = _through_end_of_turn(ids, marked, tokenizer)
    if by_markers != mask:

        def text(m):
            return tokenizer.decode([t for t, on in zip(ids, m, strict=True) if on], skip_special_tokens=False)

        raise UsageError(
            f"{template.source}: its {{% generation %}} markers disagree with the assistant turns of "
            f"example {index}: marked {text(by_markers)!r}, replies {text(mask)!r}",
            "the markers must wrap each reply and its end-of-turn token",
        )


def render_prompt_completion(
    prompt, *, completion, tokenizer, template: ChatTemplate | None, index: int = 0
) -> MaskedTokens:
    """A prompt/completion record (TRL's columns), trained on the completion only. Both strings: the text
    prompt + completion + EOS, no template (TRL's standard format). Both message lists: the conversation
    prompt + completion rendered with the template, its completion's assistant turns trained."""
    if isinstance(prompt, str) and isinstance(completion, str):
        if tokenizer.eos_token_id is None:
            raise UsageError(f"the tokenizer {tokenizer.name_or_path} has no EOS token to end a completion with")
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return MaskedTokens(prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids))
    if isinstance(prompt, (list, tuple)) and isinstance(completion, (list, tuple)):
        check_messages(prompt, index, "prompt")
        check_messages(completion, index, "completion")
        if template is None:
            raise UsageError(
                f"example {index}: a conversational prompt/completion needs a chat template",
                "pass --chat_template FILE, or use a tokenizer that has one",
            )
        return render_conversation([*prompt, *completion], tokenizer, template, index, train_from=len(prompt))
    raise UsageError(
        f"example {index}: prompt and completion must both be strings or both be message lists "
        f"(got {type(prompt).__name__} and {type(completion).__name__})"
    )


def render_whole_conversation(
    messages: Sequence[dict], tokenizer, template: ChatTemplate, index: int = 0
) -> MaskedTokens:
    """The conversation's tokens, every one trained (no --assistant_only_loss, as TRL does): one render of the whole
    conversation, so a template need not be prefix-consistent (Qwen3's dropped think blocks are fine here)."""
    check_messages(messages, index)
    ids = tokenizer(
        _render(tokenizer, template=template, messages=messages, add_generation_prompt=False, index=index),
        add_special_tokens=False,
    )["input_ids"]
    return MaskedTokens(ids, [1] * len(ids))


def render_example(
    example: dict, tokenizer, template: ChatTemplate | None, index: int, assistant_only: bool = True
) -> MaskedTokens:
    """A dataset row: a `messages` conversation (its assistant replies trained, or with assistant_only=False every
    token) or a `prompt`/`completion` record (its completion trained)."""
    if "messages" in example:
        if template is None:
            raise UsageError(
                f"example {index}: a conversation needs a chat template",
                "pass --chat_template FILE, or use a tokenizer that has one",
            )
        if not assistant_only:
            return render_whole_conversation(example["messages"], tokenizer, template, index)
        return render_conversation(example["messages"], tokenizer, template, index)
    if "prompt" in example and "completion" in example:
        return render_prompt_completion(
            example["prompt"], completion=example["completion"], tokenizer=tokenizer, template=template, index=index
        )
    raise UsageError(
        f"example {index} has neither a messages column nor prompt and completion columns "
        f"(columns: {', '.join(sorted(example))})"
    )


@dataclass(frozen=True)
class MaskSummary:
    examples: int
    tokens: int
    trained_tokens: int
    examples_without_trained_tokens: int


def check_masks(masks: Iterable[Collection[int]], template: ChatTemplate | None) -> MaskSummary:
    """Refuse a dataset whose masks train nothing, or everything: either way the template did not separate the
    prompts from the replies (the silent all-zero or all-one masks of stock templates; marin#7237)."""
    examples = tokens = trained = untrained_examples = 0
    for mask in masks:
        examples += 1
        tokens += len(mask)
        count = sum(mask)
        trained += count
        untrained_examples += count == 0
    name = template.source if template is not None else "no chat template (prompt/completion text)"
    if trained == 0:
        raise UsageError(
            f"chat data: no token of the {examples} examples is trained with {name}",
            "check that the examples have assistant replies (or completions) and that the template renders them",
        )
    if trained == tokens:
        raise UsageError(
            f"chat data: every token of the {examples} examples is trained with {name}: nothing is prompt",
            "pass --chat_template FILE with the model's own template",
        )
    return MaskSummary(examples, tokens, trained, untrained_examples)


def format_sample(ids: Sequence[int], mask: Sequence[int], tokenizer, color: bool | None = None) -> str:
    """The example's text with the trained tokens marked (--print_samples): green on a terminal, else in [[...]]."""
    if color is None:
        color = sys.stdout.isatty()
    opening, closing = ("\x1b[32m", "\x1b[0m") if color else ("[[", "]]")
    parts, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            text = tokenizer.decode(list(ids[start:k]), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            parts.append(f"{opening}{text}{closing}" if mask[start] else text)
            start = k
    return "".join(parts)
