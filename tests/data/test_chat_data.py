"""Chat data: assistant-only loss masks for four real chat templates (none has `{% generation %}` markers), checked
against masks found by hand in the rendered text; prompt/completion records; the refusals of bad input."""

from __future__ import annotations

import functools

import pytest
from transformers import AutoTokenizer

from scaletrain.data.chat_render import (
    ChatTemplate,
    check_masks,
    format_sample,
    load_chat_template,
    render_conversation,
    render_example,
    render_prompt_completion,
)
from scaletrain.errors import USAGE_EXIT_CODE, UsageError
from tests.harness import REPO

TINY = REPO / "data" / "tiny-llama"
TEMPLATES = REPO / "tests" / "fixtures" / "chat_templates"


# What each real template writes around a reply, known by reading it: the text that opens an assistant turn (the
# generation prompt), the token that closes it, and the special tokens its tokenizer has (the tiny test tokenizer
# gets them so that each is one token, as in the real one).
FAMILIES = {
    "llama-3.1-instruct": dict(
        opens="<|start_header_id|>assistant<|end_header_id|>\n\n",
        closes="<|eot_id|>",
        strips=True,
        special={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        extra=["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"],
    ),
    "qwen2.5-instruct": dict(
        opens="<|im_start|>assistant\n",
        closes="<|im_end|>",
        strips=False,
        special={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        extra=["<|im_start|>"],
    ),
    "gemma-3-it": dict(
        opens="<start_of_turn>model\n",
        closes="<end_of_turn>",
        strips=True,
        special={"bos_token": "<bos>", "eos_token": "<eos>"},
        extra=["<start_of_turn>", "<end_of_turn>"],
    ),
    "mistral-7b-instruct-v0.2": dict(opens=" [/INST]", closes="</s>", strips=False, special={}, extra=[]),
    "mistral-7b-instruct-v0.3": dict(
        opens="[/INST]",
        closes="</s>",
        strips=True,
        special={},
        extra=[
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
    ),
}

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
TURNS = [
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "The sky is blue on a clear day."},
    {"role": "user", "content": "And at night?"},
    {"role": "assistant", "content": " At night it looks black. "},  # edge whitespace: some templates trim it
    {"role": "user", "content": "Thanks, and the sea?"},
    {"role": "assistant", "content": "The sea mostly mirrors the sky."},
]


def family_tokenizer(name: str):
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    family = FAMILIES[name]
    if family["special"]:
        tokenizer.add_special_tokens(family["special"])
    if family["extra"]:
        tokenizer.add_tokens(family["extra"], special_tokens=True)
    return tokenizer


@functools.cache
def family(name: str):
    tokenizer = family_tokenizer(name)
    return tokenizer, load_chat_template(tokenizer, str(TEMPLATES / f"{name}.jinja"))


def render_text(tokenizer, template, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=template.text, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def expected_by_hand(name, tokenizer, text, messages):
    """Ids and mask built without prefix rendering: find each reply in the rendered text by string search (the
    template's opening text, the reply as the template writes it, its closing token), cut the text there,
    tokenize the pieces, mark the reply pieces."""
    family = FAMILIES[name]
    cuts, pos = [], 0
    for message in messages:
        if message["role"] != "assistant":
            continue
        content = message["content"].strip() if family["strips"] else message["content"]
        pattern = family["opens"] + (" " if name == "mistral-7b-instruct-v0.3" else "") + content + family["closes"]
        found = text.index(pattern, pos)
        start = found + len(family["opens"])
        cuts.append((start, found + len(pattern)))
        pos = found + len(pattern)
    ids, mask, bounds = [], [], [0] + [b for cut in cuts for b in cut] + [len(text)]
    for k in range(len(bounds) - 1):
        piece = tokenizer(text[bounds[k] : bounds[k + 1]], add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [k % 2] * len(piece)
    return ids, mask, [text[a:b] for a, b in cuts]


# The Mistral templates refuse a system prompt (v0.2) or move it (v0.3): test_mistral_system_prompt_*.
CASES = [(name, system) for name in FAMILIES for system in (False, True) if not (system and "mistral" in name)]


@pytest.mark.parametrize("name,with_system", CASES, ids=[f"{n}-{'system' if s else 'no-system'}" for n, s in CASES])
def test_assistant_mask_equals_the_hand_found_replies_and_end_of_turn_tokens(name, with_system):
    tokenizer, template = family(name)
    messages = [SYSTEM, *TURNS] if with_system else TURNS
    assert not template.has_generation_markers  # the prefix method is all there is for these templates
    result = render_conversation(messages, tokenizer, template)
    text = render_text(tokenizer, template, messages)
    ids, mask, replies = expected_by_hand(name, tokenizer, text, messages)
    assert result.input_ids == ids and result.loss_mask == mask
    trained = tokenizer.decode(result.trained_ids, skip_special_tokens=False)
    assert trained == "".join(replies)
    assert trained.count(FAMILIES[name]["closes"]) == 3  # each reply's end-of-turn token is trained
    assert FAMILIES[name]["opens"].strip() not in trained  # no role header, no generation prompt
    for message in messages:
        if message["role"] != "assistant":
            assert message["content"] not in trained and message["content"] in text  # the prompt is context
    assert tokenizer.decode(result.input_ids, skip_special_tokens=False) == text


def test_gemma_folds_the_system_prompt_into_the_first_user_turn_untrained():
    tokenizer = family_tokenizer("gemma-3-it")
    template = load_chat_template(tokenizer, str(TEMPLATES / "gemma-3-it.jinja"))
    result = render_conversation([SYSTEM, *TURNS[:2]], tokenizer, template)
    text = tokenizer.decode(result.input_ids, skip_special_tokens=False)
    assert f"<start_of_turn>user\n{SYSTEM['content']}\n\n{TURNS[0]['content']}" in text
    assert format_sample(result.input_ids, result.loss_mask, tokenizer, color=False).endswith(
        f"<start_of_turn>model\n[[{TURNS[1]['content']}<end_of_turn>]]\n"
    )


def test_a_reply_starts_right_after_the_generation_prompt_tokens_as_at_inference():
    """Llama 3's header ends in "\\n\\n", which the tiny tokenizer makes one token at the end of a prompt and two
    before text: tokenizing the whole conversation at once would give the reply a context it never has when the
    model generates (FastChat#2871's "tokenization mismatch")."""
    tokenizer = family_tokenizer("llama-3.1-instruct")
    template = load_chat_template(tokenizer, str(TEMPLATES / "llama-3.1-instruct.jinja"))
    result = render_conversation(TURNS[:2], tokenizer, template)
    prompt_ids = tokenizer.apply_chat_template(
        TURNS[:1], chat_template=template.text, add_generation_prompt=True, return_dict=False
    )
    assert result.input_ids[: len(prompt_ids)] == prompt_ids
    assert result.loss_mask[: len(prompt_ids)] == [0] * len(prompt_ids) and result.loss_mask[len(prompt_ids)] == 1
    whole = tokenizer.apply_chat_template(TURNS[:2], chat_template=template.text, return_dict=False)
    assert whole[: len(prompt_ids)] != prompt_ids  # the merge this avoids is real with this tokenizer


def test_the_v02_fixture_renders_as_published():
    """huggingface.js's expected render of its example chat with this template (packages/jinja/test/e2e.test.js)."""
    tokenizer, template = family("mistral-7b-instruct-v0.2")
    chat = [
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
        {"role": "user", "content": "I'd like to show off how chat templating works!"},
    ]
    assert render_text(tokenizer, template, chat) == (
        "<s>[INST] Hello, how are you? [/INST]I'm doing great. How can I help you today?</s>[INST] I'd like to "
        "show off how chat templating works! [/INST]"
    )


def test_mistral_system_prompt_v02_refusal_is_reported_with_the_template_and_example():
    """v0.2 has no system role: its own raise_exception, in one line naming the template and the example."""
    tokenizer = family_tokenizer("mistral-7b-instruct-v0.2")
    template = load_chat_template(tokenizer, str(TEMPLATES / "mistral-7b-instruct-v0.2.jinja"))
    with pytest.raises(
        UsageError,
        match=r"mistral-7b-instruct-v0\.2\.jinja refuses example 7: Conversation roles "
        r"must alternate user/assistant",
    ) as caught:
        render_conversation([SYSTEM, *TURNS], tokenizer, template, index=7)
    assert caught.value.exit_code == USAGE_EXIT_CODE


def test_mistral_system_prompt_v03_moved_to_the_last_user_turn_is_not_prefix_consistent():
    """v0.3 writes the system message into the last user turn only when that turn is last: rendered with its
    reply, the system message is gone. No mask is true for that, so it is refused, naming the turn."""
    tokenizer = family_tokenizer("mistral-7b-instruct-v0.3")
    template = load_chat_template(tokenizer, str(TEMPLATES / "mistral-7b-instruct-v0.3.jinja"))
    assert SYSTEM["content"] in render_text(tokenizer, template, [SYSTEM, TURNS[0]], add_generation_prompt=True)
    assert SYSTEM["content"] not in render_text(tokenizer, template, [SYSTEM, *TURNS[:2]])
    with pytest.raises(
        UsageError,
        match=r"mistral-7b-instruct-v0\.3\.jinja: renders of example 3 are not "
        r"prefix-consistent at turn 2 \(assistant\)",
    ):
        render_conversation([SYSTEM, *TURNS], tokenizer, template, index=3)


QWEN_MARKED = "{%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
QWEN_ASSISTANT = "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"


def qwen_with_markers(marked_part: str) -> ChatTemplate:
    """Qwen 2.5's template with TRL-style generation markers around its plain assistant turns."""
    text = (TEMPLATES / "qwen2.5-instruct.jinja").read_text()
    plain_turn = '(message.role == "assistant" and not message.tool_calls) %}\n        ' + QWEN_ASSISTANT
    assert plain_turn in text
    branch = (
        '(message.role == "assistant" and not message.tool_calls) %}\n'
        "        {%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        + marked_part
        + "{%- else %}"
        + QWEN_ASSISTANT
        + "{%- endif %}"
    )
    return ChatTemplate(text.replace(plain_turn, branch), "qwen2.5 with markers")


@pytest.mark.parametrize(
    "marked_part",
    [
        QWEN_MARKED,
        # TRL's training templates mark the newline after the end of turn too: never generated, so not trained here
        "{%- generation %}{{- message.content + '<|im_end|>\\n' }}{%- endgeneration %}",
    ],
    ids=["end-of-turn", "end-of-turn-and-newline"],
)
def test_generation_markers_agree_with_the_prefix_renders(marked_part):
    tokenizer = family_tokenizer("qwen2.5-instruct")
    plain = load_chat_template(tokenizer, str(TEMPLATES / "qwen2.5-instruct.jinja"))
    marked = qwen_with_markers(marked_part)
    assert marked.has_generation_markers
    assert render_text(tokenizer, marked, TURNS) == render_text(tokenizer, plain, TURNS)
    assert render_conversation(TURNS, tokenizer, marked) == render_conversation(TURNS, tokenizer, plain)


def test_generation_markers_that_leave_out_the_end_of_turn_are_refused():
    tokenizer = family_tokenizer("qwen2.5-instruct")
    without_end_of_turn = qwen_with_markers(
        "{%- generation %}{{- message.content }}{%- endgeneration %}{{- '<|im_end|>\\n' }}"
    )
    with pytest.raises(UsageError, match="qwen2.5 with markers: its {% generation %} markers disagree"):
        render_conversation(TURNS, tokenizer, without_end_of_turn)


def qwen3_tokenizer():
    tokenizer = family_tokenizer("qwen2.5-instruct")  # the same special tokens
    tokenizer.add_tokens(["<think>", "</think>"])  # one token each but not special, as in Qwen3's tokenizer
    return tokenizer


@pytest.mark.parametrize("with_system", [False, True], ids=["no-system", "system"])
def test_qwen3_trains_the_empty_think_block_it_writes_into_a_last_reply(with_system):
    tokenizer = qwen3_tokenizer()
    template = load_chat_template(tokenizer, str(TEMPLATES / "qwen3.jinja"))
    messages = [SYSTEM, *TURNS[:2]] if with_system else TURNS[:2]
    result = render_conversation(messages, tokenizer, template)
    text = render_text(tokenizer, template, messages)
    start = text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    end = text.index("<|im_end|>", start) + len("<|im_end|>")
    prompt, reply, tail = (
        tokenizer(part, add_special_tokens=False)["input_ids"] for part in (text[:start], text[start:end], text[end:])
    )
    assert text[start:end] == "<think>\n\n</think>\n\n" + TURNS[1]["content"] + "<|im_end|>"
    assert result.input_ids == prompt + reply + tail
    assert result.loss_mask == [0] * len(prompt) + [1] * len(reply) + [0] * len(tail)


def test_qwen3_multi_turn_is_not_prefix_consistent():
    """Qwen3 drops the think block of replies before the last user turn: rendered with later turns, reply 1 is
    another text than the one its own render trained."""
    tokenizer = qwen3_tokenizer()
    template = load_chat_template(tokenizer, str(TEMPLATES / "qwen3.jinja"))
    assert "<think>" in render_text(tokenizer, template, TURNS[:2])
    assert render_text(tokenizer, template, TURNS).count("<think>") == 1
    with pytest.raises(UsageError, match=r"qwen3\.jinja: renders of example 0 are not prefix-consistent at turn 1"):
        render_conversation(TURNS, tokenizer, template)


def test_whole_conversation_training_renders_once_and_needs_no_prefix_consistency():
    """Without --assistant_only_loss every token trains: one render of the whole conversation, tokenized as it is
    (what TRL does), so Qwen3's multi-turn template, refused for masks above, is fine here."""
    tokenizer = qwen3_tokenizer()
    template = load_chat_template(tokenizer, str(TEMPLATES / "qwen3.jinja"))
    result = render_example({"messages": TURNS}, tokenizer, template, 0, assistant_only=False)
    text = render_text(tokenizer, template, TURNS)
    assert result.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert result.loss_mask == [1] * len(result.input_ids)
    with pytest.raises(UsageError, match="not prefix-consistent"):
        render_example({"messages": TURNS}, tokenizer, template, 0)


def test_prompt_completion_text_trains_the_completion_and_eos():
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    prompt, completion = "The capital of France is", " Paris."
    result = render_prompt_completion(prompt, completion=completion, tokenizer=tokenizer, template=None)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    assert result.input_ids == prompt_ids + completion_ids + [tokenizer.eos_token_id]
    assert result.loss_mask == [0] * len(prompt_ids) + [1] * (len(completion_ids) + 1)


def test_prompt_completion_messages_train_only_the_completion_reply():
    """A few-shot prompt holds an assistant turn of its own: context, not trained."""
    tokenizer = family_tokenizer("qwen2.5-instruct")
    template = load_chat_template(tokenizer, str(TEMPLATES / "qwen2.5-instruct.jinja"))
    prompt, completion = TURNS[:5], TURNS[5:]
    result = render_example({"prompt": prompt, "completion": completion}, tokenizer, template, 0)
    conversation = render_conversation(TURNS, tokenizer, template)
    assert result.input_ids == conversation.input_ids
    trained = tokenizer.decode(result.trained_ids, skip_special_tokens=False)
    assert trained == TURNS[5]["content"] + "<|im_end|>"
    assert sum(conversation.loss_mask) > sum(result.loss_mask)  # the prompt's replies were trained as messages
    with pytest.raises(UsageError, match="example 4: prompt and completion must both be strings or both be"):
        render_prompt_completion("a string", completion=completion, tokenizer=tokenizer, template=template, index=4)


def test_an_unknown_role_names_the_role_the_example_and_the_allowed_roles():
    tokenizer = family_tokenizer("qwen2.5-instruct")
    template = load_chat_template(tokenizer, str(TEMPLATES / "qwen2.5-instruct.jinja"))
    messages = [TURNS[0], {"role": "bot", "content": "hi"}]
    with pytest.raises(
        UsageError,
        match=r"example 12: messages\[1\] has role 'bot'; the allowed roles are "
        r"system, user, assistant",
    ) as caught:
        render_example({"messages": messages}, tokenizer, template, 12)
    assert caught.value.exit_code == USAGE_EXIT_CODE
    with pytest.raises(UsageError, match=r"example 2: completion\[0\] has role 'tool'"):
        render_prompt_completion(
            TURNS[:1], completion=[{"role": "tool", "content": "42"}], tokenizer=tokenizer, template=template, index=2
        )


def test_no_template_anywhere_says_to_pass_chat_template(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    assert tokenizer.chat_template is None
    with pytest.raises(UsageError, match=f"the tokenizer {TINY} has no chat template") as caught:
        load_chat_template(tokenizer)
    assert "pass --chat_template FILE" in str(caught.value) and caught.value.exit_code == USAGE_EXIT_CODE
    with pytest.raises(UsageError, match="--chat_template .*missing.jinja: no such file"):
        load_chat_template(tokenizer, str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message.content }}")
    with pytest.raises(UsageError, match=r"--chat_template .*broken.jinja: not a valid Jinja template \(line 1"):
        load_chat_template(tokenizer, str(broken))
    with pytest.raises(UsageError, match="example 0: a conversation needs a chat template"):
        render_example({"messages": TURNS}, tokenizer, None, 0)


def test_check_masks_refuses_nothing_or_everything_trained_naming_the_template():
    tokenizer = family_tokenizer("llama-3.1-instruct")
    template = load_chat_template(tokenizer, str(TEMPLATES / "llama-3.1-instruct.jinja"))
    user_only = [render_conversation([TURNS[0]], tokenizer, template, i).loss_mask for i in range(3)]
    with pytest.raises(
        UsageError,
        match=r"no token of the 3 examples is trained with --chat_template "
        r".*llama-3.1-instruct.jinja",
    ) as caught:
        check_masks(user_only, template)
    assert caught.value.exit_code == USAGE_EXIT_CODE
    # A template that writes nothing but the messages' text, and prompts that are empty: nothing is prompt.
    bare = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", "--chat_template bare.jinja")
    everything = [render_conversation([{"role": "user", "content": ""}, TURNS[1]], tokenizer, bare).loss_mask]
    with pytest.raises(UsageError, match="every token of the 1 examples is trained with --chat_template bare.jinja"):
        check_masks(everything, bare)
    with pytest.raises(UsageError, match="every token .* with no chat template"):
        check_masks(
            [render_prompt_completion("", completion="Paris.", tokenizer=tokenizer, template=None).loss_mask], None
        )
    good = render_conversation(TURNS, tokenizer, template)
    summary = check_masks([good.loss_mask, user_only[0]], template)
    assert (summary.examples, summary.trained_tokens, summary.examples_without_trained_tokens) == (
        2,
        good.trained_tokens,
        1,
    )
    assert summary.tokens == len(good.loss_mask) + len(user_only[0])


def test_format_sample_marks_the_trained_tokens():
    tokenizer = family_tokenizer("qwen2.5-instruct")
    template = load_chat_template(tokenizer, str(TEMPLATES / "qwen2.5-instruct.jinja"))
    result = render_conversation(TURNS[:2], tokenizer, template)
    plain = format_sample(result.input_ids, result.loss_mask, tokenizer, color=False)
    assert plain == (
        render_text(tokenizer, template, TURNS[:1], add_generation_prompt=True)
        + f"[[{TURNS[1]['content']}<|im_end|>]]\n"
    )
    coloured = format_sample(result.input_ids, result.loss_mask, tokenizer, color=True)
    assert coloured == plain.replace("[[", "\x1b[32m").replace("]]", "\x1b[0m")
