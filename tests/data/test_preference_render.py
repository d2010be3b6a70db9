"""Preference rows (TRL's explicit text, explicit and implicit conversational formats) tokenized as TRL 1.16's
DPOTrainer does: the expectations below were first checked, row by row, against TRL's own `_prepare_dataset` on the
same tokenizers and templates (TRL is not a dependency, so the tests spell the ids out by hand instead). Also the
refusal of every bad row, each naming the example.

The tiny test tokenizer has no chat template: the conversational tests borrow test_chat_data's real templates and
the tokenizer given each family's special tokens.
"""

from __future__ import annotations

import copy

import pytest
from tokenizers.processors import TemplateProcessing

from scaletrain.data.preference_render import (
    PREFERENCE_FORMATS,
    check_same_format,
    preference_format,
    render_pair,
)
from scaletrain.errors import USAGE_EXIT_CODE, UsageError
from tests.data.test_chat_data import family


def with_bos(tokenizer, bos: str):
    """The tokenizer, adding `bos` to every text it tokenizes with its special tokens (as Llama's does)."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))]
    )
    return tokenizer


def ids(tokenizer, text: str, add_special_tokens: bool = False) -> list:
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def trained_text(tokenizer, tokens) -> str:
    return tokenizer.decode(tokens.trained_ids, skip_special_tokens=False)


def untrained_ids(tokens) -> list:
    return [t for t, trained in zip(tokens.input_ids, tokens.loss_mask, strict=True) if not trained]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
SKY = user("What colour is the sky?")
NIGHT = [SKY, assistant("Blue."), user("And at night?")]


# Plain text: TRL appends the EOS text, and tokenizes with the tokenizer's special tokens.


def test_explicit_text_appends_eos_once_and_trains_the_completion_only(tokenizer):
    row = {"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5</s>"}  # rejected ends with the EOS text already
    chosen, rejected = render_pair(row, tokenizer, None, 0)
    eos = tokenizer.eos_token_id
    prompt = ids(tokenizer, "Q: 2+2?\nA:")
    assert chosen.input_ids == prompt + ids(tokenizer, " 4") + [eos]
    assert chosen.loss_mask == [0] * len(prompt) + [1, 1]
    assert rejected.input_ids == prompt + ids(tokenizer, " 5") + [eos]  # one EOS, not two
    assert rejected.loss_mask == chosen.loss_mask
    assert trained_text(tokenizer, rejected) == " 5</s>"


def test_explicit_text_keeps_the_tokenizers_bos_in_the_untrained_prompt(tokenizer):
    """TRL calls the tokenizer on plain text with its defaults, so a BOS-adding tokenizer starts each sequence with
    BOS (once: prompt and prompt + completion both get it, and it lies in their common prefix)."""
    bos_tokenizer = with_bos(tokenizer, "<s>")
    row = {"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}
    chosen, rejected = render_pair(row, bos_tokenizer, None, 0)
    assert chosen.input_ids == [bos_tokenizer.bos_token_id] + ids(tokenizer, "Q: 2+2?\nA: 4</s>")
    assert untrained_ids(chosen) == [bos_tokenizer.bos_token_id] + ids(tokenizer, "Q: 2+2?\nA:")
    assert trained_text(tokenizer, rejected) == " 5</s>"


def test_a_bpe_merge_across_the_boundary_moves_the_completion_start_back_as_in_trl(tokenizer):
    """The prompt's trailing space is its own token alone ("is", " ") but merges into the chosen completion ("is",
    " b"): the completion starts where the tokenizations part, and the shorter common prefix of the two completions
    is taken, so the rejected sequence (whose " " stays a token) trains that space too."""
    row = {"prompt": "The sky is ", "chosen": "blue.", "rejected": " green."}
    prompt_alone = ids(tokenizer, "The sky is ")
    assert tokenizer.convert_ids_to_tokens(prompt_alone[-2:]) == ["Ġis", "Ġ"]
    chosen, rejected = render_pair(row, tokenizer, None, 0)
    assert chosen.input_ids == ids(tokenizer, "The sky is blue.</s>")  # the merged tokens, as tokenized whole
    assert rejected.input_ids == prompt_alone + ids(tokenizer, " green.</s>")
    assert untrained_ids(chosen) == untrained_ids(rejected) == prompt_alone[:-1]
    assert trained_text(tokenizer, chosen) == " blue.</s>"
    assert trained_text(tokenizer, rejected) == "  green.</s>"


# Conversations: rendered with the template, tokenized without the tokenizer's special tokens.


def render_ids(tokenizer, template, messages, add_generation_prompt=False) -> list:
    text = tokenizer.apply_chat_template(
        messages, chat_template=template.text, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return ids(tokenizer, text)


# What TRL trains of the chosen reply "It is blue.": Llama 3's header ends in "\n\n", one token at the end of the
# prompt rendered alone and two before a reply (see test_chat_data), so the completion starts at "\n\n" and trains
# it; Qwen's reply is trained with the newline its template writes after <|im_end|>.
TRAINED = {
    "llama-3.1-instruct": "\n\nIt is blue.<|eot_id|>",
    "qwen2.5-instruct": "It is blue.<|im_end|>\n",
    "gemma-3-it": "It is blue.<end_of_turn>\n",
}


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_explicit_conversational_ids_are_the_whole_render_and_the_completion_is_trained(name):
    tokenizer, template = family(name)
    row = {"prompt": [SKY], "chosen": [assistant("It is blue.")], "rejected": [assistant("Green, surely.")]}
    chosen, rejected = render_pair(row, tokenizer, template, 0)
    assert chosen.input_ids == render_ids(tokenizer, template, [SKY, assistant("It is blue.")])
    assert rejected.input_ids == render_ids(tokenizer, template, [SKY, assistant("Green, surely.")])
    assert trained_text(tokenizer, chosen) == TRAINED[name]
    with_prompt = render_ids(tokenizer, template, [SKY], add_generation_prompt=True)
    assert with_prompt[: len(untrained_ids(chosen))] == untrained_ids(chosen) == untrained_ids(rejected)
    # the generation prompt rendered alone is the prompt part, up to where a merge moved the start back
    assert len(with_prompt) - len(untrained_ids(chosen)) == (1 if name == "llama-3.1-instruct" else 0)


def test_a_conversation_gets_the_templates_bos_only_not_the_tokenizers_too():
    tokenizer, template = family("llama-3.1-instruct")
    tokenizer = with_bos(tokenizer, "<|begin_of_text|>")
    assert ids(tokenizer, "x", add_special_tokens=True)[0] == tokenizer.bos_token_id
    row = {"prompt": [SKY], "chosen": [assistant("It is blue.")], "rejected": [assistant("Green.")]}
    chosen, _ = render_pair(row, tokenizer, template, 0)
    assert chosen.input_ids.count(tokenizer.bos_token_id) == 1 and chosen.input_ids[0] == tokenizer.bos_token_id


PROMPTS = {"one-turn": [SKY], "multi-turn": NIGHT, "system": [SYSTEM, SKY]}
IMPLICIT_CASES = [  # Mistral v0.2 has no system role
    (name, prompt)
    for name in ("llama-3.1-instruct", "qwen2.5-instruct", "mistral-7b-instruct-v0.2")
    for prompt in PROMPTS
    if not (name.startswith("mistral") and prompt == "system")
]


@pytest.mark.parametrize("name,prompt", IMPLICIT_CASES, ids=[f"{n}-{p}" for n, p in IMPLICIT_CASES])
def test_an_implicit_prompt_pair_renders_as_the_same_pair_with_an_explicit_prompt(name, prompt):
    tokenizer, template = family(name)
    prompt = PROMPTS[prompt]
    chosen, rejected = [assistant("It is blue.")], [assistant(" Pink, at night. ")]
    implicit = {"chosen": prompt + chosen, "rejected": prompt + rejected}
    explicit = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    assert preference_format(implicit) == "implicit_conversational"
    pair = render_pair(implicit, tokenizer, template, 0)
    assert pair == render_pair(explicit, tokenizer, template, 0)
    assert all(tokens.trained_tokens for tokens in pair)


def test_each_format_is_told_from_the_columns_and_value_types():
    rows = [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"prompt": [SKY], "chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]},
        {"chosen": [SKY, assistant("Blue.")], "rejected": [SKY, assistant("Green.")]},
    ]
    assert tuple(preference_format(row) for row in rows) == PREFERENCE_FORMATS


def test_a_row_in_another_format_than_the_first_is_named_with_both_formats():
    text = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    chat = {"prompt": [SKY], "chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]}
    check_same_format([text, text], "explicit_text")
    with pytest.raises(UsageError) as caught:
        check_same_format([text, text, chat, text], "explicit_text")
    assert "example 2 is explicit_conversational but example 0 is explicit_text" in caught.value.message


# Bad rows: one line naming the example, and a hint.

EMPTY = "completion is empty"
NOT_SHARED = "do not share their prompt turns"
TEXT_ROWS = {  # row -> what the message says
    "chosen without rejected": ({"prompt": "p", "chosen": "a"}, "has a chosen column but no rejected column"),
    "rejected without chosen": ({"prompt": "p", "rejected": "a"}, "has a rejected column but no chosen column"),
    "neither": ({"prompt": "p", "completion": "a"}, "neither a chosen nor a rejected column"),
    "prompt text, completions messages": (
        {"prompt": "p", "chosen": [assistant("a")], "rejected": [assistant("b")]},
        "the prompt is text but chosen and rejected are a message list",
    ),
    "chosen text, rejected messages": (
        {"prompt": "p", "chosen": "a", "rejected": [assistant("b")]},
        "chosen is text but rejected is a message list",
    ),
    "a number": ({"prompt": "p", "chosen": 1, "rejected": "b"}, "chosen is int, neither text nor a message list"),
    "implicit text": ({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "without a prompt column"),
    "identical text": ({"prompt": "p", "chosen": " a", "rejected": " a"}, "chosen and rejected are identical"),
    "identical once EOS is added": (
        {"prompt": "p", "chosen": " a", "rejected": " a</s>"},
        "chosen and rejected are identical",
    ),
    "empty text": ({"prompt": "p", "chosen": "", "rejected": " b"}, f"the chosen {EMPTY}"),
    "blank text": ({"prompt": "p", "chosen": " a", "rejected": " \n"}, f"the rejected {EMPTY}"),
}
CHAT_ROWS = {
    "identical explicit": (
        {"prompt": [SKY], "chosen": [assistant("Blue.")], "rejected": [assistant("Blue.")]},
        "chosen and rejected are identical",
    ),
    "identical implicit": (
        {"chosen": [SKY, assistant("Blue.")], "rejected": [SKY, assistant("Blue.")]},
        "chosen and rejected are identical",
    ),
    "empty assistant content": (
        {"prompt": [SKY], "chosen": [assistant("Blue.")], "rejected": [assistant(" ")]},
        "rejected[0] (assistant) is empty",
    ),
    "empty implicit assistant content": (
        {"chosen": [SKY, assistant("")], "rejected": [SKY, assistant("Green.")]},
        "chosen[0] (assistant) is empty",
    ),
    "no assistant turn in the completion": (
        {"prompt": [SKY], "chosen": [user("Blue?")], "rejected": [assistant("Green.")]},
        "chosen[0] is a user turn; a completion holds only assistant turns",
    ),
    "explicit prompt ending with the assistant": (
        {"prompt": [SKY, assistant("Blue.")], "chosen": [assistant("Sure.")], "rejected": [assistant("No.")]},
        "the prompt ends with an assistant turn",
    ),
    "implicit: nothing after the shared turns": (
        {"chosen": [SKY, assistant("Blue.")], "rejected": [*NIGHT, assistant("Black.")]},
        f"chosen has no turn after the 2 turns it shares with rejected, so its {EMPTY}",
    ),
    "implicit: different first user turns": (
        {"chosen": [SKY, assistant("Blue.")], "rejected": [user("And the sea?"), assistant("Blue.")]},
        f"{NOT_SHARED}: they differ from message 0 on, where chosen[0] is a user turn",
    ),
    "implicit: different earlier replies": (
        {"chosen": [*NIGHT, assistant("Black.")], "rejected": [SKY, assistant("Red."), NIGHT[2], assistant("Dark.")]},
        f"{NOT_SHARED}: they differ from message 1 on, where chosen[2] is a user turn",
    ),
    "implicit: shared turns end with the assistant": (
        {
            "chosen": [SKY, assistant("Blue."), assistant("Sure.")],
            "rejected": [SKY, assistant("Blue."), assistant("No.")],
        },
        "the turns chosen and rejected share end with an assistant turn (message 1)",
    ),
    "implicit: no shared turn": (
        {"chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]},
        f"{NOT_SHARED}: they differ from message 0 on: no prompt turn is shared",
    ),
    "a role outside system/user/assistant": (
        {"prompt": [{"role": "tool", "content": "42"}], "chosen": [assistant("a")], "rejected": [assistant("b")]},
        "prompt[0] has role 'tool'",
    ),
    "a message without content": (
        {"chosen": [SKY, {"role": "assistant"}], "rejected": [SKY, assistant("b")]},
        "chosen[1] (assistant) has no string content",
    ),
    "an empty prompt": (
        {"prompt": [], "chosen": [assistant("a")], "rejected": [assistant("b")]},
        "prompt is not a non-empty list of messages",
    ),
}


@pytest.mark.parametrize("case", [*TEXT_ROWS, *CHAT_ROWS])
def test_a_bad_row_is_refused_naming_the_example(case, tokenizer):
    row, says = TEXT_ROWS[case] if case in TEXT_ROWS else CHAT_ROWS[case]
    _, template = family("qwen2.5-instruct")
    with pytest.raises(UsageError) as caught:
        render_pair(row, tokenizer, template, 7)
    assert caught.value.message.startswith("example 7")
    assert says in caught.value.message
    assert caught.value.hint and "\n" not in caught.value.message
    assert caught.value.exit_code == USAGE_EXIT_CODE


def test_the_text_prompt_refusal_says_what_trl_would_have_cut():
    with pytest.raises(UsageError) as caught:
        preference_format({"chosen": "It is bad", "rejected": "It is bold"}, 3)
    assert "add a prompt column" in caught.value.hint and '"It is b"' in caught.value.hint


def test_a_conversation_without_a_chat_template_points_to_the_flag(tokenizer):
    row = {"chosen": [SKY, assistant("Blue.")], "rejected": [SKY, assistant("Green.")]}
    with pytest.raises(UsageError, match="example 4: a conversational preference pair needs a chat template") as caught:
        render_pair(row, tokenizer, None, 4)
    assert "--chat_template FILE" in caught.value.hint


def test_plain_text_needs_an_eos_token(tokenizer):
    without_eos = copy.deepcopy(tokenizer)
    without_eos.eos_token = None
    with pytest.raises(UsageError, match="has no EOS token to end a completion with"):
        render_pair({"prompt": "p", "chosen": " a", "rejected": " b"}, without_eos, None, 0)


def test_a_template_that_refuses_the_row_names_it_and_the_example():
    tokenizer, template = family("mistral-7b-instruct-v0.2")  # no system role: its own raise_exception
    row = {"prompt": [SYSTEM, SKY], "chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]}
    with pytest.raises(UsageError, match=f"{template.source} refuses example 5"):
        render_pair(row, tokenizer, template, 5)
