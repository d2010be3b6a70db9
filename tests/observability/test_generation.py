"""--eval_prompts: the prompts file checked in the pre-flight, and greedy generations at each evaluation under
ZeRO-3 at 2 ranks that equal the exported model's own generate()."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scaletrain.config.slices import DEFAULT_MODEL_DIR
from scaletrain.errors import UsageError
from scaletrain.observability.eval_prompts import load_eval_prompts
from scaletrain.parts import ParallelLayout
from tests.harness import FAST_FLAGS, check_ok, launch, read_metrics, REPO


def prompts_file(tmp_path, lines, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_prompts_are_read_from_jsonl_text_and_conversations(tmp_path, tokenizer):
    path = prompts_file(tmp_path, [json.dumps({"prompt": "Once upon a time"}), "", json.dumps({"prompt": "The"})])
    prompts = load_eval_prompts(path, tokenizer=tokenizer, max_new_tokens=8, max_positions=2048)
    assert prompts.shown == ("Once upon a time", "The") and prompts.max_new_tokens == 8
    assert list(prompts.input_ids[0]) == tokenizer("Once upon a time")["input_ids"]
    text = load_eval_prompts(
        prompts_file(tmp_path, ["Once upon a time"], "p.txt"), tokenizer=tokenizer, max_new_tokens=8, max_positions=2048
    )
    assert text.input_ids == prompts.input_ids[:1]
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    chat = load_eval_prompts(
        prompts_file(tmp_path, [json.dumps({"messages": [{"role": "user", "content": "hi"}]})]),
        tokenizer=tokenizer,
        max_new_tokens=8,
        max_positions=2048,
    )
    assert chat.shown == ("<user>hi<assistant>",)


@pytest.mark.parametrize(
    "lines, expected",
    [
        (["{not json"], "line 1: not valid JSON"),
        ([json.dumps({"prompt": "ok"}), json.dumps({"text": "x"})], 'line 2: needs a "prompt" string or a "messages"'),
        ([json.dumps({"messages": [{"role": "user", "content": "hi"}]})], "the tokenizer has no chat template"),
        ([json.dumps({"prompt": "word " * 300})], "exceeds the model's 256 positions"),
        ([], "holds no prompt"),
    ],
)
def test_a_bad_prompts_file_names_the_file_and_line(tmp_path, tokenizer, lines, expected):
    with pytest.raises(UsageError, match="--eval_prompts") as err:
        load_eval_prompts(prompts_file(tmp_path, lines), tokenizer=tokenizer, max_new_tokens=8, max_positions=256)
    assert expected in str(err.value)


def test_a_missing_file_and_a_parallel_layout_are_refused(tmp_path, tokenizer):
    with pytest.raises(UsageError, match="no such file"):
        load_eval_prompts(str(tmp_path / "nope.jsonl"), tokenizer=tokenizer, max_new_tokens=8, max_positions=256)
    path = prompts_file(tmp_path, [json.dumps({"prompt": "hi"})])
    with pytest.raises(UsageError, match="tensor, sequence or pipeline parallelism"):
        load_eval_prompts(path, tokenizer=tokenizer, max_new_tokens=8, max_positions=256, layout=ParallelLayout(pp=2))


@pytest.mark.slow
def test_zero3_two_ranks_generate_at_each_evaluation_as_the_exported_model_does(tmp_path, cache_dir, tokenizer):
    """A tiny learning rate keeps the model near its random initialisation: its greedy text is some rare token
    repeated, which a model with other weights would not hit (a trained tiny model repeats a newline, which a broken
    generation could match by chance)."""
    prompts = ["Once upon a time", "The little dog"]
    path = prompts_file(tmp_path, [json.dumps({"prompt": p}) for p in prompts])
    run_dir = tmp_path / "run"
    check_ok(
        launch(
            REPO / "train.py",
            [
                "--config",
                "ds_configs/zero3.json",
                "--output_dir",
                str(run_dir),
                "--max_steps",
                "4",
                "--eval_steps",
                "2",
                "--eval_prompts",
                path,
                "--eval_max_new_tokens",
                "8",
                "--learning_rate",
                "1e-6",
                "--no-save_at_end",
                *FAST_FLAGS,
            ],
            "deepspeed",
            cache_dir,
            nprocs=2,
        )
    )
    records = [r for r in read_metrics(run_dir) if "generations" in r]
    assert [r["step"] for r in records] == [2, 4]  # the evaluation at step 2, and the final one
    for record in records:
        assert [row["prompt"] for row in record["generations"]] == prompts
    model = AutoModelForCausalLM.from_pretrained(run_dir).eval()
    for prompt, row in zip(prompts, records[-1]["generations"], strict=True):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert row["completion"] == expected and expected
