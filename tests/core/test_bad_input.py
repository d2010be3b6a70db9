"""Bad input ends in one clear line (and at most one hint), exit code 2, no traceback, nothing written.

The table runs train.py's real `main` in-process (every check happens before a process group, model or dataset is
built, so nothing heavier than reading files runs); the last tests run real processes, one under a 2-rank launch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import traceback
from pathlib import Path

import pytest

from tests.harness import REPO, launch

ZERO2 = REPO / "ds_configs" / "zero2.json"
TINY = REPO / "data" / "tiny-llama"


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    if root.exists():
        for path in sorted(root.rglob("*")):
            h.update(str(path.relative_to(root)).encode())
            if path.is_file():
                h.update(path.read_bytes())
    return h.hexdigest()


# A task whose dataset is on the Hub (under a name nobody has cached): offline, it cannot be loaded.
HUB_TASK = """task: hub_task
dataset_path: scaletrain-tests/never-cached
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: choices
doc_to_target: label
"""


# --- builders of bad inputs: each gets the test's tmp folder and returns extra flags -----------------------------


def ds_json(tmp: Path, edit) -> list:
    raw = json.loads(ZERO2.read_text())
    edit(raw)
    path = tmp / "edited.json"
    path.write_text(json.dumps(raw))
    return ["--config", str(path)]


def text_file(tmp: Path, name: str, content: str) -> Path:
    path = tmp / name
    path.write_text(content)
    return path


def tokenizer_without_eos(tmp: Path) -> list:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    tok.eos_token = None
    tok.save_pretrained(tmp / "no_eos")
    return ["--tokenizer_name", str(tmp / "no_eos")]


def remote_code_model(tmp: Path) -> list:
    folder = tmp / "custom_model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "my_custom_lm", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}})
    )
    return ["--config_name", str(folder)]


def huge_model(tmp: Path) -> list:
    """A Llama config whose checkpoint needs twice the free disk: the disk check must stop it."""
    free = shutil.disk_usage(tmp).free
    per_layer = 4 * 8192 * 8192 + 3 * 8192 * 28672
    layers = max(1, int(2 * free / 16 / per_layer) + 1)
    config = json.loads((TINY / "config.json").read_text())
    config.update(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=64,
        head_dim=128,
    )
    folder = tmp / "huge"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return ["--config_name", str(folder), "--tokenizer_name", str(TINY)]


def small_vocab_model(tmp: Path) -> list:
    config = json.loads((TINY / "config.json").read_text())
    config["vocab_size"] = 100
    folder = tmp / "small_vocab"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return ["--config_name", str(folder), "--tokenizer_name", str(TINY)]


def moe_model(tmp: Path) -> list:
    """A tiny Qwen2-MoE config: its decoder MLPs are expert blocks, which --tiled_mlp cannot tile."""
    config = {
        "model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 4096,
    }  # fmt: skip
    folder = tmp / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return ["--config_name", str(folder), "--tokenizer_name", str(TINY), "--tiled_mlp"]


def previous_run(tmp: Path, identity: dict) -> None:
    out = tmp / "out"
    out.mkdir()
    (out / "run_config.json").write_text(json.dumps(identity))
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')


def set_in(raw: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        raw = raw.setdefault(part, {})
    raw[leaf] = value


def json_edit(dotted: str, value):
    return lambda tmp: ds_json(tmp, lambda raw: set_in(raw, dotted, value))


CASES = {
    # name: (builder of extra flags given the tmp folder, the culprit: the flag or DeepSpeed JSON key the error line
    #        must name, text that line must contain)
    "missing config": (
        lambda t: ["--config", "ds_configs/zero9.json"],
        "--config",
        "--config ds_configs/zero9.json: no such file",
    ),
    "invalid json": (
        lambda t: ["--config", str(text_file(t, "b.json", '{"train_batch_size": '))],
        "--config",
        "not valid JSON",
    ),
    "json not an object": (
        lambda t: ["--config", str(text_file(t, "l.json", "[1, 2]"))],
        "--config",
        "must be a JSON object",
    ),
    "misspelled top-level key": (
        json_edit("gradient_clipp1ng", 1.0),
        "gradient_clipp1ng",
        'unknown key "gradient_clipp1ng"',
    ),
    "misspelled zero key": (
        json_edit("zero_optimization.overlap_com", True),
        "zero_optimization.overlap_com",
        'unknown key "zero_optimization.overlap_com"',
    ),
    "misspelled offload key": (
        json_edit("zero_optimization.offload_optimizer.pin_memmory", True),
        "zero_optimization.offload_optimizer.pin_memmory",
        'unknown key "zero_optimization.offload_optimizer.pin_memmory"',
    ),
    "misspelled adam param": (
        json_edit("optimizer.params.betas1", 0.9),
        "optimizer.params.betas1",
        'unknown key "optimizer.params.betas1"',
    ),
    "unknown optimizer type": (json_edit("optimizer.type", "AdamWW"), "optimizer.type", 'optimizer.type "AdamWW"'),
    "unknown flag": (lambda t: ["--learning_rat", "1e-3"], "--learning_rat", "unknown flag --learning_rat"),
    "global batch arithmetic": (json_edit("train_batch_size", 100), "train_batch_size", "train_batch_size 100 in "),
    "bf16 and fp16 in json": (
        lambda t: ds_json(t, lambda r: (set_in(r, "bf16.enabled", True), set_in(r, "fp16.enabled", True))),
        "fp16.enabled",
        "bf16.enabled and fp16.enabled are both true",
    ),
    "bf16 and fp16 flags": (lambda t: ["--bf16", "--fp16"], "--fp16", "--bf16 and --fp16"),
    "unreachable hub dataset": (
        lambda t: ["--dataset_name", "someorg/no-such-dataset"],
        "--dataset_name",
        "--dataset_name someorg/no-such-dataset: cannot load it",
    ),
    "fp16 on a cpu": (lambda t: ["--fp16"], "--fp16", "--fp16: fp16 training needs a GPU"),
    "max steps zero": (lambda t: ["--max_steps", "0"], "--max_steps", "--max_steps 0: give a positive number of steps"),
    "flag contradicts json precision": (
        lambda t: json_edit("fp16.enabled", True)(t) + ["--bf16"],
        "--bf16",
        "--bf16 contradicts fp16.enabled=true",
    ),
    "param offload below stage 3": (
        json_edit("zero_optimization.offload_param", {"device": "cpu"}),
        "zero_optimization.offload_param",
        "parameter offload needs ZeRO stage 3",
    ),
    "optimizer offload at stage 0": (
        lambda t: ds_json(
            t,
            lambda r: (
                set_in(r, "zero_optimization.stage", 0),
                set_in(r, "zero_optimization.offload_optimizer", {"device": "cpu"}),
            ),
        ),
        "zero_optimization.offload_optimizer",
        "optimizer offload needs ZeRO stage 1 or higher",
    ),
    "bad offload device": (
        json_edit("zero_optimization.offload_optimizer", {"device": "gpu"}),
        "zero_optimization.offload_optimizer.device",
        'zero_optimization.offload_optimizer.device "gpu"',
    ),
    "bad zero stage": (json_edit("zero_optimization.stage", 5), "zero_optimization.stage", "zero_optimization.stage 5"),
    "nvme folder missing": (
        lambda t: ["--config", str(REPO / "ds_configs/zero3_nvme.json"), "--nvme_path", str(t / "no_nvme")],
        "--nvme_path",
        "does not exist",
    ),
    "micro batch contradicts flag": (
        lambda t: json_edit("train_micro_batch_size_per_gpu", 4)(t) + ["--per_device_train_batch_size", "8"],
        "--per_device_train_batch_size",
        "--per_device_train_batch_size 8 contradicts train_micro_batch_size_per_gpu=4",
    ),
    "lr contradicts flag": (
        lambda t: json_edit("optimizer.params.lr", 1e-4)(t) + ["--learning_rate", "3e-4"],
        "--learning_rate",
        "--learning_rate 0.0003 contradicts optimizer.params.lr=0.0001",
    ),
    "unresolvable auto": (
        json_edit("zero_optimization.stage3_max_live_parameters", "auto"),
        "zero_optimization.stage3_max_live_parameters",
        'is "auto" but the pipeline does not decide it',
    ),
    "scheduler section": (
        json_edit("scheduler", {"type": "WarmupLR", "params": {}}),
        "scheduler",
        '"scheduler" section',
    ),
    "comms logger section": (
        json_edit("comms_logger", {"enabled": True}),
        "comms_logger",
        '"comms_logger" section; the pipeline reports communication itself',
    ),
    "deepspeed activation checkpointing": (
        json_edit("activation_checkpointing", {"cpu_checkpointing": True}),
        "activation_checkpointing.cpu_checkpointing",
        "only acts on models that call deepspeed.checkpointing",
    ),
    "block size above max positions": (
        lambda t: ["--block_size", "4096"],
        "--block_size",
        "--block_size 4096: above the model's",
    ),
    "tokenizer without eos": (tokenizer_without_eos, "--tokenizer_name", "the tokenizer has no EOS token"),
    "tokenizer larger than vocab": (
        small_vocab_model,
        "--tokenizer_name",
        "4096 tokens, but the model's vocabulary has 100",
    ),
    "model needs remote code": (remote_code_model, "--config_name", "needs custom code"),
    "attention backend not installed": (
        lambda t: ["--attn_implementation", "flash_attention_2"],
        "--attn_implementation",
        "the package for FlashAttention2",
    ),
    "unknown attention backend": (
        lambda t: ["--attn_implementation", "nonsense"],
        "--attn_implementation",
        'attn_implementation="nonsense"` is not supported',
    ),
    "missing model folder": (
        lambda t: ["--model_name_or_path", "./models/none"],
        "--model_name_or_path",
        "--model_name_or_path ./models/none: no such file or folder",
    ),
    "missing train file": (
        lambda t: ["--train_file", "data/none.jsonl"],
        "--train_file",
        "--train_file data/none.jsonl: no such file",
    ),
    "unsupported data format": (
        lambda t: ["--train_file", str(text_file(t, "notes.md", "# hi"))],
        "--train_file",
        "unsupported file type .md",
    ),
    "empty train file": (
        lambda t: ["--train_file", str(text_file(t, "empty.jsonl", ""))],
        "--train_file",
        "holds no documents",
    ),
    "missing text column": (
        lambda t: ["--train_file", str(text_file(t, "c.csv", "body,n\nhello,1\n"))],
        "--text_column",
        "--text_column text: not a column",
    ),
    "non-text column": (
        lambda t: ["--train_file", str(text_file(t, "n.jsonl", '{"text": 5}\n'))],
        "--text_column",
        "--text_column text: holds int",
    ),
    "output holds a different run": (
        lambda t: previous_run(t, {"config_name": "other/model"}) or [],
        "--output_dir",
        "holds a different run (config_name: other/model -> None)",
    ),
    "output holds the same run": (
        lambda t: previous_run(t, {}) or ["--resume_from_checkpoint", "none"],
        "--output_dir",
        "holds a previous run of this model and data",
    ),
    "resume from a missing checkpoint": (
        lambda t: ["--resume_from_checkpoint", str(t / "nope")],
        "--resume_from_checkpoint",
        "no such folder",
    ),
    "disk smaller than a checkpoint": (huge_model, "--output_dir", "GB free on its disk, one checkpoint"),
    "loss spike factor below 1": (
        lambda t: ["--loss_spike_factor", "0.5"],
        "--loss_spike_factor",
        "--loss_spike_factor 0.5: must be above 1",
    ),
    "hang timeout not below the process group's": (
        lambda t: ["--hang_timeout", "900", "--ddp_timeout", "600"],
        "--hang_timeout",
        "--hang_timeout 900: must be below --ddp_timeout 600",
    ),
    "hang timeout too short": (
        lambda t: ["--hang_timeout", "2"],
        "--hang_timeout",
        "--hang_timeout 2: must be at least 5 seconds",
    ),
    "process group timeout not positive": (
        lambda t: ["--ddp_timeout", "0", "--hang_timeout", "0"],
        "--ddp_timeout",
        "--ddp_timeout 0: must be positive",
    ),
    "unknown non-finite action": (lambda t: ["--on_nonfinite", "ignore"], "--on_nonfinite", "invalid choice: 'ignore'"),
    "negative skip limit": (
        lambda t: ["--max_consecutive_skips", "-1"],
        "--max_consecutive_skips",
        "--max_consecutive_skips -1: must not be",
    ),
    "skip at stage 0 in bf16": (
        lambda t: ds_json(t, lambda r: set_in(r, "zero_optimization.stage", 0)) + ["--bf16"],
        "--on_nonfinite",
        "--on_nonfinite skip: updates of ZeRO stage 0 in bf16 cannot be skipped",
    ),
    "ramp-up start not below the batch": (
        lambda t: ["--rampup_batch_size", "8", "2", "100"],
        "--rampup_batch_size",
        "START 8 is not below the global batch 8",
    ),
    "ramp-up start not whole micro-batches": (
        lambda t: [
            "--per_device_train_batch_size",
            "2",
            "--gradient_accumulation_steps",
            "4",
            "--rampup_batch_size",
            "3",
            "1",
            "100",
        ],
        "--rampup_batch_size",
        "START 3 is not a multiple of micro batch 2",
    ),
    "ramp-up increment not dividing": (
        lambda t: [
            "--per_device_train_batch_size",
            "2",
            "--gradient_accumulation_steps",
            "4",
            "--rampup_batch_size",
            "2",
            "4",
            "100",
        ],
        "--rampup_batch_size",
        "INCREMENT 4 does not divide the ramp from 2",
    ),
    "tensor parallel above the world": (
        lambda t: ["--tensor_parallel_size", "2"],
        "--tensor_parallel_size",
        "--tensor_parallel_size 2 does not divide the world size 1",
    ),
    "sequence parallel above the world": (
        lambda t: ["--sequence_parallel_size", "2"],
        "--sequence_parallel_size",
        "--sequence_parallel_size 2 does not divide the world size 1",
    ),
    "heads that do not split over tensor x sequence ranks": (
        lambda t: ["--plan", "--num_gpus", "8", "--tensor_parallel_size", "2", "--sequence_parallel_size", "4"],
        "--sequence_parallel_size",
        "the model's 4 attention heads (num_attention_heads) (2 on each of --tensor_parallel_size 2 ranks) do not "
        "split into 4 equal parts",
    ),
    "tiled MLP on a mixture of experts": (
        moe_model,
        "--tiled_mlp",
        "model.layers.0.mlp is a Qwen2MoeSparseMoeBlock, which does not work token by token",
    ),
    "activation offloading without checkpointing": (
        lambda t: ["--activation_offloading"],
        "--activation_offloading",
        "--activation_offloading without --gradient_checkpointing",
    ),
    "push to a malformed repository id": (
        lambda t: ["--push_to_hub", "not a/valid id"],
        "--push_to_hub",
        "not a repository id",
    ),
    "eval prompts file missing": (
        lambda t: ["--eval_prompts", str(t / "prompts.jsonl")],
        "--eval_prompts",
        "prompts.jsonl: no such file",
    ),
    "lm-eval task unknown": (
        lambda t: ["--lm_eval_tasks", "docstring_modul"],
        "--lm_eval_tasks",
        "'docstring_modul' is not a task, group or tag lm-eval knows",
    ),
    "lm-eval task YAML that does not parse": (
        lambda t: ["--lm_eval_tasks", str(text_file(t, "broken.yaml", "task: [unclosed\n"))],
        "--lm_eval_tasks",
        "task broken.yaml: ",
    ),
    "lm-eval task whose dataset is not cached offline": (
        lambda t: ["--lm_eval_tasks", str(text_file(t, "hub_task.yaml", HUB_TASK))],
        "--lm_eval_tasks",
        "task hub_task.yaml: ",
    ),
    "lm-eval cadence without tasks": (
        lambda t: ["--lm_eval_steps", "5"],
        "--lm_eval_steps",
        "--lm_eval_steps needs --lm_eval_tasks",
    ),
    "validation set without a name": (
        lambda t: [
            "--train_file",
            "data/sample/train.jsonl",
            "--validation_file",
            "a=data/sample/validation.jsonl,data/sample/validation.jsonl",
        ],
        "--validation_file",
        "has no set name, the others do",
    ),
    "validation set named twice": (
        lambda t: [
            "--train_file",
            "data/sample/train.jsonl",
            "--validation_file",
            "a=data/sample/validation.jsonl,a=data/sample/train.jsonl",
        ],
        "--validation_file",
        "the set a is named twice",
    ),
    "named validation file missing": (
        lambda t: ["--train_file", "data/sample/train.jsonl", "--validation_file", "code=data/none.jsonl"],
        "--validation_file",
        "--validation_file data/none.jsonl: no such file",
    ),
    "plan unknown gpu": (
        lambda t: ["--plan", "--gpu", "b900"],
        "--gpu",
        "--gpu b900: unknown GPU; known: v100-32gb, a100-40gb, a100-80gb, h100-sxm, h200",
    ),
    "plan bandwidth of zero": (
        lambda t: ["--plan", "--inter_node_gbps", "0"],
        "--inter_node_gbps",
        "--inter_node_gbps 0.0: must be positive",
    ),
    "plan scaling not node counts": (
        lambda t: ["--plan", "--plan_scaling", "1,two"],
        "--plan_scaling",
        "--plan_scaling 1,two: not a list of node counts",
    ),
    "plan calibration not a run": (
        lambda t: ["--plan", "--plan_calibration", str(t)],
        "--plan_calibration",
        ": no metrics.jsonl",
    ),
    "ramp-up lr scaling alone": (
        lambda t: ["--rampup_lr_scaling", "sqrt"],
        "--rampup_lr_scaling",
        "--rampup_lr_scaling sqrt: only acts with --rampup_batch_size",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_touches_nothing(name, tmp_path, offline, capsys):
    from train import main

    make_flags, culprit, expected = CASES[name]
    extra = make_flags(tmp_path)
    out = tmp_path / "out"
    before = tree_digest(out)
    try:
        code = main(["--config", str(ZERO2), "--output_dir", str(out), *extra])
    except BaseException:  # a traceback is a failure of this test, whatever the exit code would have been
        pytest.fail(f"{name}: raised instead of a clean error:\n{traceback.format_exc()}")
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    lines = captured.err.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("train.py: error: "), captured.err
    assert expected in lines[0], lines
    assert names(culprit, lines[0]), f"the error does not name {culprit}: {lines[0]}"
    if len(lines) == 2:
        assert lines[1].startswith("  hint: ")
    assert tree_digest(out) == before


def assert_refused(
    name: str, argv: list, out: Path, capsys, culprit: str, expected: str, hint: str | None = None
) -> None:
    """train.py's main on `argv` exits 2 with one error line naming `culprit` and holding `expected` (then the
    `hint` line, where given), no traceback, and `out` untouched."""
    from train import main

    before = tree_digest(out)
    try:
        code = main(argv)
    except BaseException:
        pytest.fail(f"{name}: raised instead of a clean error:\n{traceback.format_exc()}")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert 1 <= len(err) <= 2 and err[0].startswith("train.py: error: ") and expected in err[0], err
    assert names(culprit, err[0]), f"the error does not name {culprit}: {err[0]}"
    if hint is not None:
        assert err[1] == f"  hint: {hint}", err
    assert tree_digest(out) == before


def names(culprit: str, line: str) -> bool:
    """`culprit` appears in `line` as a whole flag or key: --config is not named by --config_name, nor
    zero_optimization.offload_optimizer by zero_optimization.offload_optimizer.device."""
    return re.search(rf"(?<![\w.-]){re.escape(culprit)}(?![\w.-])", line) is not None


def test_table_covers_25_flags_and_keys_and_tells_every_case_apart():
    """The table exercises at least 25 different flags and DeepSpeed keys, each case's error names its own, and no
    case's expected text also fits another case's error (each case proves its own check, not a shared message)."""
    culprits = {culprit for _, culprit, _ in CASES.values()}
    assert len(culprits) >= 25, sorted(culprits)
    for culprit in culprits:  # a flag as typed, or a (dotted) key of the DeepSpeed JSON
        assert re.fullmatch(r"--[a-z0-9_]+|[a-z0-9_]+(\.[a-z0-9_]+)*", culprit), culprit
    for name, (_, _, expected) in CASES.items():
        fits = [other for other, (_, _, text) in CASES.items() if other != name and expected in text]
        assert not fits, f"{name}: {expected!r} also fits the error of {fits}"
    assert names("--config", "--config x.json: no such file") and not names("--config", "--config_name x: ...")
    assert not names("zero_optimization.offload_optimizer", 'zero_optimization.offload_optimizer.device "gpu"')


@pytest.mark.slow  # over 5 s: real processes (the fast tier stays under 3 minutes)
def test_real_process_exits_2_without_traceback(tmp_path, cache_dir):
    proc = launch(
        REPO / "train.py",
        [
            "--config",
            str(ZERO2),
            "--output_dir",
            str(tmp_path / "out"),
            "--train_file",
            str(text_file(tmp_path, "c.csv", "body\nhello\n")),
        ],
        "python",
        cache_dir,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[0] == "train.py: error: --text_column text: not a column of " + str(
        tmp_path / "c.csv"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a real process (~10 s)
def test_a_column_the_built_in_sample_lacks_exits_2_when_its_store_is_prepared(tmp_path, cache_dir):
    """The built-in sample is not read ahead in the pre-flight (that would import datasets at every start): a
    --text_column it lacks is refused by the store's preparation, in the same one line, before anything is built."""
    out = tmp_path / "out"
    args = ["--config", str(ZERO2), "--output_dir", str(out), "--text_column", "body"]
    proc = launch(REPO / "train.py", args, "python", cache_dir, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    sample = REPO / "data" / "sample" / "train.jsonl"
    assert proc.stderr.strip().splitlines()[0] == f"train.py: error: --text_column body: not a column of {sample}"
    assert not out.exists()


@pytest.mark.slow  # the ranks join the rendezvous to share the error (DeepSpeed's CPU ops, gloo): ~40 s loaded
def test_error_is_printed_once_under_a_two_rank_launch(tmp_path, cache_dir):
    out = tmp_path / "out"
    proc = launch(
        REPO / "train.py",
        ["--config", "ds_configs/missing.json", "--output_dir", str(out)],
        "deepspeed",
        cache_dir,
        nprocs=2,
        timeout=300,
    )
    assert proc.returncode == 2
    text = proc.stdout + proc.stderr
    assert text.count("train.py: error: --config ds_configs/missing.json: no such file") == 1
    assert "Traceback" not in text
    assert not out.exists()


@pytest.mark.slow  # over 10 s: a real run (the fast tier stays under 3 minutes)
def test_secrets_never_reach_logs_configs_or_metrics(tmp_path, cache_dir):
    """A run with credentials in its environment: none of them appears in its output or its run folder."""
    secrets = {"WANDB_API_KEY": "wandb-secret-3f9a1c", "HF_TOKEN": "hf_secret_77d2e0"}  # in the runs' environment
    run_dir = tmp_path / "run"
    from tests.harness import FAST_FLAGS

    proc = launch(
        REPO / "train.py",
        [
            "--config",
            str(ZERO2),
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "2",
            "--report_to",
            "wandb",
            "--print_config",
        ],
        "python",
        cache_dir,
        env=secrets,
    )
    assert proc.returncode == 0
    proc2 = launch(
        REPO / "train.py",
        ["--config", str(ZERO2), "--output_dir", str(run_dir), "--max_steps", "2", "--report_to", "wandb", *FAST_FLAGS],
        "python",
        cache_dir,
        env=secrets,
    )
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    for output in (proc.stdout, proc.stderr, proc2.stdout, proc2.stderr):
        assert not any(s in output for s in secrets.values())
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets.values()), path
    assert os.environ.get("WANDB_API_KEY") != secrets["WANDB_API_KEY"]


@pytest.mark.parametrize(
    "owner, name",
    [
        ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "_overflow_check_and_loss_scale_update"),
        ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),  # read by the DeepSpeed JSON's key check
    ],
)
def test_a_moved_deepspeed_hook_is_one_line_exit_2_before_anything_is_built(owner, name, tmp_path, offline, capsys):
    """An upgrade of DeepSpeed that moved an internal the pipeline hooks (here removed from the real module) is
    found by the pre-flight, as a usage-style error naming the internal, before any model is built."""
    import importlib

    module, _, cls = owner.partition(".DeepSpeed")
    target = getattr(importlib.import_module(module), "DeepSpeed" + cls) if cls else importlib.import_module(owner)
    with pytest.MonkeyPatch.context() as patch:
        patch.delattr(target, name)
        assert_refused(
            name,
            ["--config", str(ZERO2), "--output_dir", str(tmp_path / "out")],
            tmp_path / "out",
            capsys,
            f"{owner}.{name}",
            "is missing, which scaletrain needs for",
            "pip install -r requirements.txt installs the DeepSpeed these hooks were checked against",
        )
