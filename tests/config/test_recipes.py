"""--recipe: a YAML file of flag values, checked like flags; the command line wins; every value says where it came
from. The shipped recipes in recipes/ are exercised with --print_config and --dry_run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scaletrain.errors import UsageError
from scaletrain.config.cli import explain_run_config, parse_run_config
from tests.harness import REPO, check_ok, launch

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
ZERO2 = str(REPO / "ds_configs" / "zero2.json")


def recipe(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def parse(tmp_path, *argv):
    return parse_run_config(["--output_dir", str(tmp_path / "out"), *argv])


def test_recipe_values_apply_with_their_types_and_the_command_line_wins(tmp_path):
    path = recipe(
        tmp_path,
        "config: ds_configs/zero2.json\nlearning_rate: 1e-4\nmax_steps: 7\nbf16: false\n"
        "report_to: [wandb, tensorboard]\nlr_scheduler_type: wsd\nrun_name: null\n",
    )
    cfg = parse(tmp_path, "--recipe", path, "--max_steps", "9")
    assert cfg.engine.config == "ds_configs/zero2.json"
    assert cfg.optim.learning_rate == 1e-4 and isinstance(cfg.optim.learning_rate, float)  # YAML reads 1e-4 as text
    assert cfg.optim.max_steps == 9  # typed on the command line: wins over the recipe's 7
    assert cfg.optim.lr_scheduler_type == "wsd"
    assert cfg.logging.report_to == "wandb,tensorboard" and cfg.logging.report_sinks == ("wandb", "tensorboard")
    assert cfg.source_of("learning_rate") == f"recipe {path}"
    assert cfg.source_of("max_steps") == "command line"
    assert cfg.source_of("seed") == "default"
    assert cfg.run.recipe == path and cfg.source_of("recipe") == "command line"
    explained = explain_run_config(cfg)
    assert f"learning_rate = 0.0001  <- recipe {path}" in explained
    assert "max_steps = 9  <- --max_steps" in explained
    assert "seed = 42  <- default" in explained
    # A recipe value counts as set by the user: it must agree with an explicit value in the DeepSpeed JSON.
    assert {"learning_rate", "max_steps", "config"} <= cfg.explicit_flags


def test_the_command_line_can_turn_off_a_switch_the_recipe_turned_on(tmp_path):
    path = recipe(tmp_path, "attention_isolation: true\ngradient_checkpointing: true\n")
    cfg = parse(tmp_path, "--recipe", path, "--no-attention_isolation")
    assert cfg.data.attention_isolation is False and cfg.source_of("attention_isolation") == "command line"
    assert cfg.model.gradient_checkpointing is True and cfg.source_of("gradient_checkpointing") == f"recipe {path}"


def test_deepspeed_alias_works_in_a_recipe(tmp_path):
    cfg = parse(tmp_path, "--recipe", recipe(tmp_path, "deepspeed: ds_configs/zero1.json\n"))
    assert cfg.engine.config == "ds_configs/zero1.json"


@pytest.mark.parametrize(
    "text, message",
    [
        ("learning_rat: 1e-3\n", 'run.yaml: unknown key "learning_rat"'),
        ("learning_rate: fast\n", "learning_rate: 'fast' is not a number"),
        ("max_steps: 1.5\n", "max_steps: 1.5 is not an integer"),
        ("bf16: yes please\n", "bf16: 'yes please' is not true or false"),
        ("lr_scheduler_type: cosin\n", "lr_scheduler_type: 'cosin': not a schedule (ours: cosine, linear"),
        ("seed: null\n", "seed: needs a value"),
        ("recipe: other.yaml\n", "a recipe cannot name another recipe"),
        ("- learning_rate\n", "must be a mapping of flag names to values, not a list"),
        ("learning_rate: [1, 2\n", "not valid YAML at line"),
        ("per_device_train_batch_size: 0\n", "--per_device_train_batch_size 0: must be at least 1"),  # the flag checks
        ("train_file: missing.jsonl\n", "--train_file missing.jsonl: no such file"),
    ],
)
def test_bad_recipes_are_one_clear_usage_error(tmp_path, text, message):
    with pytest.raises(UsageError) as raised:
        parse(tmp_path, "--recipe", recipe(tmp_path, text))
    assert message in str(raised.value)


def test_unknown_key_gets_a_did_you_mean_and_a_missing_recipe_is_named(tmp_path):
    with pytest.raises(UsageError) as raised:
        parse(tmp_path, "--recipe", recipe(tmp_path, "gradient_acumulation_steps: 4\n"))
    assert raised.value.hint == "did you mean gradient_accumulation_steps?"
    with pytest.raises(UsageError, match="--recipe nowhere.yaml: no such file"):
        parse(tmp_path, "--recipe", "nowhere.yaml")


def test_a_bad_recipe_ends_train_py_with_one_line_and_exit_2_writing_nothing(tmp_path, capsys):
    from train import main

    out = tmp_path / "out"
    code = main(["--recipe", recipe(tmp_path, "learning_rat: 1e-3\n"), "--output_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[0].startswith("train.py: error: --recipe ") and 'unknown key "learning_rat"' in err[0]
    assert err[1:] == ["  hint: did you mean learning_rate?"]
    assert not out.exists()


# Per recipe: flags the tests add (a local stand-in for a hub model; blocks the tiny model's 256 positions allow).
RECIPE_OVERRIDES = {
    "pretrain_small.yaml": lambda pretrained: [],
    "continue_pretrain_zero3_offload.yaml": lambda pretrained: [
        "--model_name_or_path",
        str(pretrained),
        "--block_size",
        "64",
    ],
    "lora_zero3.yaml": lambda pretrained: ["--model_name_or_path", str(pretrained), "--block_size", "64"],
    # the tiny tokenizer has no chat template: the Mistral v0.2 one renders with its tokens
    "sft_chat.yaml": lambda pretrained: [
        "--model_name_or_path",
        str(pretrained),
        "--block_size",
        "128",
        "--train_file",
        "tests/fixtures/chat/messages.jsonl",
        "--chat_template",
        "tests/fixtures/chat_templates/mistral-7b-instruct-v0.2.jinja",
    ],
    # preference pairs as conversations sharing their prompt turns, rendered with the Qwen 2.5 template
    "dpo.yaml": lambda pretrained: [
        "--model_name_or_path",
        str(pretrained),
        "--block_size",
        "128",
        "--train_file",
        "tests/fixtures/preference/pairs.jsonl",
        "--chat_template",
        "tests/fixtures/chat_templates/qwen2.5-instruct.jinja",
    ],
}


def test_shipped_recipes_hold_only_known_flags_with_valid_values(tmp_path):
    assert {r.name for r in RECIPES} == set(RECIPE_OVERRIDES), "every shipped recipe is exercised below"
    for path in RECIPES:
        cfg = parse(tmp_path, "--recipe", str(path), *RECIPE_OVERRIDES[path.name](REPO / "data" / "tiny-llama"))
        assert all(source.startswith(("recipe", "command line")) for source in cfg.sources.values())
        assert len(cfg.sources) >= 10, f"{path.name}: a recipe that sets almost nothing"


@pytest.fixture(scope="module")
def pretrained_tiny(tmp_path_factory):
    """A pretrained checkpoint folder (random weights, saved as from_pretrained reads them): stands in for the hub
    model of the continue-pretraining recipe, which cannot be downloaded here."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("pretrained")
    tiny = REPO / "data" / "tiny-llama"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", sorted(RECIPE_OVERRIDES))
def test_print_config_says_which_values_came_from_the_recipe(name, tmp_path, pretrained_tiny, monkeypatch, capsys):
    from train import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    path = f"recipes/{name}"
    overrides = RECIPE_OVERRIDES[name](pretrained_tiny)
    code = main(["--recipe", path, "--output_dir", str(out), "--print_config", *overrides])
    printed = capsys.readouterr().out
    assert code == 0 and not out.exists()
    assert f"recipe = '{path}'  <- --recipe" in printed
    assert f"output_dir = '{out}'  <- --output_dir" in printed  # the command line over the recipe's runs/...
    if name == "pretrain_small.yaml":
        assert f"learning_rate = 0.003  <- recipe {path}" in printed
        assert f"attention_isolation = True  <- recipe {path}" in printed
        assert "DeepSpeed config ds_configs/zero2.json" in printed
    elif name == "lora_zero3.yaml":
        assert f"use_peft = True  <- recipe {path}" in printed
        assert f"lora_target_modules = 'all-linear'  <- recipe {path}" in printed
        assert "DeepSpeed config ds_configs/zero3.json" in printed
    elif name == "sft_chat.yaml":
        assert f"assistant_only_loss = True  <- recipe {path}" in printed
        assert f"print_samples = 2  <- recipe {path}" in printed
        assert (
            "chat_template = 'tests/fixtures/chat_templates/mistral-7b-instruct-v0.2.jinja'  <- --chat_template"
            in printed
        )
    elif name == "dpo.yaml":
        assert f"loss_type = 'sigmoid'  <- recipe {path}" in printed
        assert f"beta = 0.1  <- recipe {path}" in printed
        assert f"learning_rate = 5e-07  <- recipe {path}" in printed
    else:
        assert f"gradient_checkpointing = True  <- recipe {path}" in printed
        assert f"model_name_or_path = '{pretrained_tiny}'  <- --model_name_or_path" in printed
        assert "block_size = 64  <- --block_size" in printed
        assert '"device": "cpu"' in printed  # the offload config's sections, resolved
        assert f"gradient_accumulation_steps = 8  <- recipe {path}" in printed
        assert "train_batch_size = 32  <- micro batch 4 x accumulation 8 x data-parallel size 1" in printed
    assert "seed = 42  <- default" in printed


def dry_run(name, tmp_path, cache_dir, pretrained):
    out = tmp_path / "out"
    proc = launch(
        REPO / "train.py",
        [
            "--recipe",
            f"recipes/{name}",
            "--output_dir",
            str(out),
            "--dry_run",
            "--disable_tqdm",
            *RECIPE_OVERRIDES[name](pretrained),
        ],
        "python",
        cache_dir,
        timeout=600,
    )
    check_ok(proc)
    assert "dry run OK: one step in" in proc.stderr + proc.stdout
    assert not out.exists()  # a dry run writes nothing
    return proc.stderr + proc.stdout


@pytest.mark.slow  # over 10 s: a real run (the fast tier stays under 3 minutes)
def test_pretrain_recipe_dry_run_runs_one_real_step(tmp_path, cache_dir, pretrained_tiny):
    dry_run("pretrain_small.yaml", tmp_path, cache_dir, pretrained_tiny)


@pytest.mark.slow  # over 10 s: a real run (the fast tier stays under 3 minutes)
def test_sft_chat_recipe_dry_run_runs_one_real_step_on_chat_data(tmp_path, cache_dir, pretrained_tiny):
    dry_run("sft_chat.yaml", tmp_path, cache_dir, pretrained_tiny)


@pytest.mark.slow
def test_continue_pretrain_recipe_dry_run_runs_one_real_step_under_zero3_offload(
    tmp_path, cache_dir, pretrained_tiny, compiled_ops
):
    dry_run("continue_pretrain_zero3_offload.yaml", tmp_path, cache_dir, pretrained_tiny)


@pytest.mark.slow
def test_lora_recipe_dry_run_runs_one_real_step_under_zero3(tmp_path, cache_dir, pretrained_tiny, compiled_ops):
    dry_run("lora_zero3.yaml", tmp_path, cache_dir, pretrained_tiny)


@pytest.mark.slow  # over 10 s: a real run
def test_dpo_recipe_dry_run_runs_one_real_step_with_the_reference_of_its_pairs_alone(
    tmp_path, cache_dir, pretrained_tiny
):
    """ZeRO-3, gradient checkpointing, conversational pairs: one real step, whose pairs' reference log-probs are
    computed alone and not saved (a dry run reads no more of the data than its step needs)."""
    log = dry_run("dpo.yaml", tmp_path, cache_dir, pretrained_tiny)
    assert "reference log-probs: the dry run's 16 pairs computed (not saved)" in log  # 4 x 4 x 1 rank: one batch
    store = Path(re.search(r"token store\(s\): (\S+)", log).group(1))
    assert (store / "manifest.json").exists() and not (store / "reference").exists()
