"""Bad input, the DeepSpeed JSON and the training flags: the config file and its keys, precision, ZeRO and
offload, batch and learning-rate arithmetic, timeouts, non-finite steps, ramp-up, the parallel layout and the plan.
Each case runs train.py's real `main` in-process and ends in one clear line (and at most one hint), exit code 2, no
traceback, nothing written (every check happens before a process group, model or dataset is built).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import REPO
from tests.helpers.bad_input import check_bad_input, ZERO2, text_file

# --- builders of bad inputs: each gets the test's tmp folder and returns extra flags -----------------------------


def ds_json(tmp: Path, edit) -> list:
    raw = json.loads(ZERO2.read_text())
    edit(raw)
    path = tmp / "edited.json"
    path.write_text(json.dumps(raw))
    return ["--config", str(path)]


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
    "a pipeline's export without its final checkpoint": (
        lambda t: ["--pipeline_parallel_size", "2", "--no-save_at_end"],
        "--pipeline_parallel_size",
        "--no-save_at_end with --pipeline_parallel_size 2: the Hugging Face export at the end is written from the "
        "final checkpoint's layer files",
    ),
    "heads that do not split over tensor x sequence ranks": (
        lambda t: ["--plan", "--num_gpus", "8", "--tensor_parallel_size", "2", "--sequence_parallel_size", "4"],
        "--sequence_parallel_size",
        "the model's 4 attention heads (num_attention_heads) (2 on each of --tensor_parallel_size 2 ranks) do not "
        "split into 4 equal parts",
    ),
    "activation offloading without checkpointing": (
        lambda t: ["--activation_offloading"],
        "--activation_offloading",
        "--activation_offloading without --gradient_checkpointing",
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
    check_bad_input(name, CASES[name], tmp_path, capsys)
