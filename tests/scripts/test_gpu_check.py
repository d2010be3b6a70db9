"""scripts/gpu_check.py: its parsing, checks and table, and its CPU mode end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import gpu_check as gc
from scripts import gpu_check_checks as gc_checks
from scripts import gpu_check_report as gc_report
from scripts import gpu_check_rows as gc_rows
from scripts import gpu_check_runs as gc_runs
from tests.harness import REPO, child_env

PLAN_OUTPUT = """\
memory plan: 961.0M parameters, 1 node(s) x 1 GPU(s) = 1 data-parallel ranks, bf16, micro-batch 4 x 4096 tokens
GB per GPU unless marked; 'fits' leaves 10% of the GPU free (fragmentation, communication buffers)

| option | params | grads | optimizer | model states | working (no ckpt / ckpt) | total (no ckpt / ckpt) | host \
per node | NVMe per node | fits (no ckpt / ckpt) | config |
|---|---|---|---|---|---|---|---|---|---|---|
| ZeRO-1 | 1.79 | 5.37 | 10.74 | 17.90 | 20.10 / 3.20 | 38.00 / 21.10 | 0.00 | 0.00 | yes / yes | z1 |
| ZeRO-2 | 1.79 | 5.37 | 10.74 | 17.90 | 20.10 / 3.20 | 37.50 / 21.00 | 0.00 | 0.00 | yes / yes | z2 |
| ZeRO-2 + optimizer offload (CPU) | 1.8 | 0.00 | 0.00 | 1.79 | 20.10 / 3.20 | 21.89 / 4.99 | 16.1 | 0.0 | yes | x |
| ZeRO-3 | 1.79 | 3.58 | 10.74 | 16.11 | 20.50 / 3.60 | 36.61 / 19.71 | 0.00 | 0.00 | yes / yes | z3 |
"""


def test_parse_plan_reads_the_totals_of_zero_1_2_3_without_offload():
    planned = gc_runs.parse_plan(PLAN_OUTPUT)
    assert planned == {
        (1, False): 38.0,
        (1, True): 21.1,
        (2, False): 37.5,
        (2, True): 21.0,
        (3, False): 36.61,
        (3, True): 19.71,
    }
    assert gc_runs.parse_plan("no table here") == {}


def test_loss_check_passes_within_the_tolerance_and_fails_outside_it():
    reference = [10.4, 10.1, 9.7]
    # extra steps beyond the reference ignored
    passed, text = gc_checks.loss_check([10.41, 10.12, 9.69, 9.0], reference)
    assert passed and "first 3 steps" in text and "<= 0.02" in text
    passed, text = gc_checks.loss_check([10.4, 10.1, 9.7 * 1.03], reference)  # 3% off at the third step
    assert not passed and "> 0.02" in text and "3.0e-02" in text
    assert not gc_checks.loss_check([10.4], reference)[0]  # a run shorter than the reference cannot pass


def test_memory_check_holds_the_peak_against_the_plan_with_a_margin():
    assert gc_checks.memory_check(40.0, 36.0)[0]  # 11% above: within 25%
    passed, text = gc_checks.memory_check(50.0, 36.0)
    assert not passed and "1.39 > 1.25" in text
    assert gc_checks.memory_check(None, 36.0) == (True, "")  # a CPU run has no GPU peak: no check, no failure


def test_train_figures_are_steady_medians_and_the_largest_peak():
    records = [
        {"step": s, "loss": 10.0 - s, "tokens_per_s": 100.0 * s, "mfu": 0.1 * s, "gpu_peak_gb": 20.0 + s}
        for s in range(1, 7)
    ] + [{"step": 6, "eval_loss": 4.0, "gpu_peak_gb": 30.0}]
    figures = gc_runs.train_figures(records, warmup=3)
    assert figures["steps"] == 6 and figures["losses"] == [9.0, 8.0, 7.0, 6.0, 5.0, 4.0]
    assert figures["tokens_per_s"] == 500.0 and figures["mfu"] == pytest.approx(0.5)  # steps 4-6
    assert figures["peak_gb"] == 30.0  # the evaluation's peak counts too
    assert gc_runs.train_figures(records[:2], warmup=3)["tokens_per_s"] == 150.0  # shorter than the warmup: all steps


def _rows(**statuses):
    return {name: gc_rows.Row(name, "x", status=status) for name, status in statuses.items()}


def test_an_off_loss_or_memory_fails_the_check_and_the_exit_code(tmp_path):
    specs = {s.name: s for s in gc_rows.specs(gc_rows.GPU_SETUP, tmp_path, tmp_path, flash=False, extra=())}
    rows = _rows(zero1="ok", zero2="ok", zero3="ok", sdpa_ckpt="ok", flash="not installed", hf="skipped")
    reference = [10.4, 10.1, 9.7, 9.3, 9.0]
    for name in ("zero1", "zero2", "zero3"):
        rows[name].losses = [x * 1.001 for x in reference] + [8.0] * 15
        rows[name].peak_gb = 30.0
    rows["zero3"].losses[4] = 9.5  # 5.6% off
    rows["sdpa_ckpt"].peak_gb = 40.0  # twice the plan
    planned = gc_runs.parse_plan(PLAN_OUTPUT)
    gc_checks.apply_checks(rows, specs, planned, reference)
    assert [rows[n].status for n in ("zero1", "zero2", "zero3")] == ["ok", "ok", "check failed"]
    assert rows["zero1"].planned_gb == 38.0 and rows["zero3"].planned_gb == 36.61
    assert rows["sdpa_ckpt"].status == "check failed" and rows["sdpa_ckpt"].planned_gb == 21.0
    assert gc_checks.exit_code(rows) == 1
    table = gc_report.render(rows, "## header")
    assert "| zero3 | x |" in table and "> 0.02" in table and "| check failed |" in table
    assert table.count("\n|") == len(rows) + 2  # the column row, the rule and one row per run


def test_the_exit_code_counts_failures_not_skips():
    skips = _rows(a="ok", b="skipped", c="not installed (flash_attn does not import)", d="needs a GPU")
    assert gc_checks.exit_code(skips) == 0
    assert gc_checks.exit_code(_rows(a="ok", b="FAILED")) == 1


def test_the_runs_cpu_mode_skips_gpu_rows_and_extra_flags_reach_train_runs_only(tmp_path):
    cpu = {s.name: s for s in gc_rows.specs(gc_rows.CPU_SETUP, tmp_path, tmp_path, flash=True, extra=("--seed", "7"))}
    assert [n for n, s in cpu.items() if s.unavailable] == ["ops", "sdpa_compile", "flash", "flash_ckpt", "qlora"]
    assert cpu["zero3"].args[-2:] == ("--seed", "7") and "--seed" not in cpu["plan"].args
    gpu = {s.name: s for s in gc_rows.specs(gc_rows.GPU_SETUP, tmp_path, tmp_path, flash=False, extra=())}
    assert gpu["flash"].unavailable.startswith("not installed") and gpu["sdpa_compile"].unavailable is None
    assert "--bf16" in gpu["zero1"].args and "--bf16" not in gpu["fp32_ref"].args
    reference_config = json.loads((tmp_path / "zero2_fp32.json").read_text())
    assert reference_config["bf16"]["enabled"] is False and reference_config["fp16"]["enabled"] is False
    assert gpu["zero2"].steps == 20 and gpu["fp32_ref"].steps == 5 and gpu["sdpa_ckpt"].steps == 10
    qlora = gpu["qlora"].args
    assert qlora[:2] == ("--config", "ds_configs/zero3.json") and "--config_name" not in qlora
    assert {"--use_peft", "--load_in_4bit", "--gradient_checkpointing", "--bf16"} <= set(qlora)
    assert qlora[qlora.index("--model_name_or_path") + 1] == str(tmp_path / gc_rows.PRETRAINED)
    dpo = gpu["dpo"].args  # preference training of the same saved weights, in bf16, sharded
    assert dpo[:2] == ("--config", "ds_configs/zero3.json") and "--config_name" not in dpo
    assert {"--gradient_checkpointing", "--bf16"} <= set(dpo) and gpu["dpo"].steps == 20
    assert dpo[dpo.index("--model_name_or_path") + 1] == str(tmp_path / gc_rows.PRETRAINED)
    assert dpo[dpo.index("--train_file") + 1] == str(tmp_path / gc_rows.PAIRS)


def test_the_qlora_dpo_and_long_context_rows_run_only_when_asked_for():
    assert gc.runs_to_skip(gc.parse_args([])) == ["qlora", "long_context", "dpo"]
    assert gc.runs_to_skip(gc.parse_args(["--skip", "hf"])) == ["hf", "qlora", "long_context", "dpo"]
    assert gc.runs_to_skip(gc.parse_args(["--qlora", "--long_context", "--dpo"])) == []
    assert gc.runs_to_skip(gc.parse_args(["--only", "qlora,zero3,long_context,dpo"])) == []


def test_the_qlora_row_must_use_less_memory_than_full_zero3():
    assert gc_checks.qlora_memory_check(9.0, 30.0)[0] and not gc_checks.qlora_memory_check(31.0, 30.0)[0]
    assert gc_checks.qlora_memory_check(None, 30.0) == (True, "")


def test_bad_options_exit_2_before_any_run(tmp_path, capsys):
    assert gc.main(["--cpu_test", "--work_dir", str(tmp_path / "w"), "--only", "zero9"]) == 2
    assert "unknown run(s) zero9" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert gc.main(["--cpu_test", "--work_dir", str(tmp_path / "full")]) == 2


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_the_shell_driver_refuses_a_machine_without_a_gpu():
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--only", "plan"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "needs a CUDA GPU (or --cpu_test)" in proc.stderr


def _run(tmp_path, *flags):
    cmd = [
        "bash",
        "scripts/gpu_check.sh",
        "--cpu_test",
        "--work_dir",
        str(tmp_path / "work"),
        "--json",
        str(tmp_path / "check.json"),
        *flags,
    ]
    env = {**child_env(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return proc, json.loads((tmp_path / "check.json").read_text())


@pytest.mark.slow  # three launches, ~45 s on 2 cores (the whole CPU mode, 8 launches, takes ~3 minutes)
def test_cpu_mode_runs_the_plan_a_zero_run_and_the_reference_and_checks_them(tmp_path):
    proc, result = _run(tmp_path, "--only", "plan,zero3,fp32_ref,dpo")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["run"]: r for r in result["rows"]}
    assert list(rows) == [
        "ops",
        "plan",
        "default",
        "zero1",
        "zero2",
        "zero3",
        "fp32_ref",
        "sdpa_ckpt",
        "sdpa_compile",
        "flash",
        "flash_ckpt",
        "qlora",
        "hf",
        "dpo",
        "long_context",
    ]
    assert {n: r["status"] for n, r in rows.items() if r["status"] != "ok"} == {
        "ops": "not needed on a CPU",
        "default": "skipped",
        "zero1": "skipped",
        "zero2": "skipped",
        "sdpa_ckpt": "skipped",
        "sdpa_compile": "needs a GPU",
        "flash": "needs a GPU",
        "flash_ckpt": "needs a GPU",
        "qlora": "needs a GPU",
        "hf": "skipped",
        "long_context": "skipped",
    }
    assert set(result["planned_gb"]) == {"zero1", "zero1_ckpt", "zero2", "zero2_ckpt", "zero3", "zero3_ckpt"}
    zero3 = rows["zero3"]
    assert zero3["planned_gb"] == result["planned_gb"]["zero3"] > 0
    assert zero3["steps"] == gc_rows.CPU_SETUP.zero_steps and zero3["tokens_per_s"] > 0
    assert len(result["loss_reference"]) == gc_rows.CPU_SETUP.ref_steps
    assert any(c.startswith("loss vs fp32, first 3 steps: max rel. diff") for c in zero3["checks"])
    assert "| zero3 | ZeRO-3, fp32, sdpa" in proc.stdout and "| run | what | steps |" in proc.stdout
    # MFU beside train.py's: attention counted causally, over the matmul rate measured at the start
    assert result["machine"]["measured_matmul_tflops"] > 0 and 0 < zero3["mfu_causal_measured"] < 1
    assert not (tmp_path / "work" / "zero3" / "checkpoints").exists()  # --no-save_at_end: no 14 GB per 1B run
    # the dpo row: preference training from the saved weights, step 1's loss log 2 (policy == reference)
    dpo = rows["dpo"]
    assert dpo["steps"] == gc_rows.CPU_SETUP.zero_steps and dpo["tokens_per_s"] > 0
    assert dpo["checks"][0].startswith("step-1 loss 0.6931 vs log 2") and dpo["checks"][1].startswith("pairs/s ")
    assert dpo["mfu_causal_measured"] is None  # another token count than the Llama rows'
    pairs = [json.loads(line) for line in (tmp_path / "work" / gc_rows.PAIRS).read_text().splitlines()]
    assert len(pairs) == gc_rows.CPU_SETUP.batch * gc_rows.CPU_SETUP.zero_steps
    assert all(p["chosen"] != p["rejected"] and p["prompt"] for p in pairs)


@pytest.mark.extended  # ~50 s; the CPU mode of gpu_check runs in CI
@pytest.mark.slow  # two launches of train.py (256 and 512 tokens), ~45 s
def test_the_long_context_row_reports_the_longest_block_that_trained(tmp_path):
    proc, result = _run(tmp_path, "--only", "long_context", "--long_context")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    row = {r["run"]: r for r in result["rows"]}["long_context"]
    assert row["status"] == "ok" and row["tokens_per_s"] > 0
    assert row["checks"][0].startswith("longest block 512 tokens, step ")
    assert row["checks"][0].endswith("stopped by --max_tokens")
    log = Path(row["log"]).read_text()
    assert "longest_block: 256 tokens: ok" in log and "longest_block: 512 tokens: ok" in log


@pytest.mark.slow  # one launch that fails at once, ~15 s
def test_cpu_mode_exits_non_zero_when_a_run_fails(tmp_path):
    proc, result = _run(tmp_path, "--only", "zero1", "--train_args", "--no_such_flag 1")
    assert proc.returncode == 1
    zero1 = next(r for r in result["rows"] if r["run"] == "zero1")
    assert zero1["status"] == "FAILED" and zero1["checks"][0].startswith("exit ")
    assert "| zero1 |" in proc.stdout and "exit code 1" in proc.stdout


# --- the first run on an offline GPU machine: packages carried with `pip install --target`, no launcher
# script beside the interpreter, no /usr/bin/time, a row that cannot start --------------------------------------


@pytest.mark.extended  # ~30 s
@pytest.mark.slow  # one launch, ~30 s
def test_cpu_mode_runs_from_a_target_install_with_no_launcher_beside_the_interpreter(tmp_path):
    """The image's own interpreter (no `deepspeed` script beside it, none on PATH) with the packages on PYTHONPATH,
    as `pip install --no-index --no-deps --target DIR` leaves them: every child keeps that PYTHONPATH, and the
    launcher is found as a module."""
    import sysconfig

    base = sys._base_executable
    assert not (Path(base).parent / "deepspeed").exists(), "the base interpreter has a launcher script beside it"
    target = sysconfig.get_paths()["purelib"]  # this venv's packages, used as the carried --target folder
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "deepspeed").exists())
    env = {**child_env(tmp_path), "PYTHON": base, "PYTHONPATH": target, "PATH": path}
    cmd = ["bash", "scripts/gpu_check.sh", "--cpu_test", "--work_dir", str(tmp_path / "work"), "--only", "zero2"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "work" / "gpu_check.json").read_text())
    zero2 = next(r for r in result["rows"] if r["run"] == "zero2")
    assert zero2["status"] == "ok" and zero2["steps"] == gc_rows.CPU_SETUP.zero_steps
    assert result["machine"]["deepspeed"] != "missing" and result["machine"]["gpu"] == "none"
    assert "gpu_check: machine: python " in proc.stdout and "free_disk_gb" in proc.stdout


def test_a_row_that_cannot_start_is_failed_and_the_json_is_written_after_each_row(tmp_path, monkeypatch):
    json_path = tmp_path / "check.json"
    seen = []

    def run_train(spec, setup, work, env, timeout, row):
        if spec.name == "default":
            raise FileNotFoundError(2, "No such file or directory", "deepspeed")
        seen.append(json.loads(json_path.read_text()))  # what a check killed now would leave behind
        row.status, row.steps, row.losses = gc_rows.OK, 1, [1.0]

    monkeypatch.setattr(gc_runs, "run_train", run_train)
    code = gc.main(
        ["--cpu_test", "--work_dir", str(tmp_path / "w"), "--only", "default,zero1", "--json", str(json_path)]
    )
    assert code == 1
    after_default = {r["run"]: r for r in seen[0]["rows"]}
    assert after_default["default"]["status"] == "FAILED" and not seen[0]["finished"]
    assert after_default["default"]["checks"][0].startswith("could not run: FileNotFoundError")
    assert after_default["zero1"]["status"] == "not run"
    final = {r["run"]: r for r in json.loads(json_path.read_text())["rows"]}
    assert final["zero1"]["status"] == "ok" and final["default"]["status"] == "FAILED"


@pytest.mark.slow  # one launch of a tiny script, ~10 s
def test_without_gnu_time_the_largest_process_sampled_rss_stands_in(tmp_path, monkeypatch):
    import argparse

    from scripts import compare_hf_trainer as cmp

    script = tmp_path / "hold.py"
    script.write_text("import time\nblock = bytearray(200 * 2**20)\ntime.sleep(2)\n")
    monkeypatch.setattr(cmp, "GNU_TIME", str(tmp_path / "no" / "time"))
    s = argparse.Namespace(ranks=1, max_rss_gb=8, timeout=120)
    result = cmp.launch(str(script), [], s, cmp.common_env(tmp_path), tmp_path / "hold.log")
    assert result["max_rss_source"] == "sampled (no /usr/bin/time)"
    assert 200 * 1024 <= result["max_rss_kb"] <= result["tree_peak_rss_kb"], result


def test_every_child_keeps_the_callers_pythonpath_after_the_repository(tmp_path, monkeypatch):
    from scripts import compare_hf_trainer as cmp

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/carried/packages", str(REPO)]))
    for env in (cmp.common_env(tmp_path), child_env(HF_HUB_OFFLINE="1")):
        assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/carried/packages"]


def test_the_wheels_to_carry_are_the_pins_and_every_need_the_image_lacks():
    """`pip install --no-deps --target` installs exactly the carried wheels: each of their requirements must be
    carried too or be in the image; torch and the image's packages are never carried (torch is never reinstalled)."""
    import importlib.metadata
    import re

    from scripts import gpu_wheels

    carry = gpu_wheels.to_carry()
    pinned = gpu_wheels.pins(REPO / "requirements.txt")
    assert carry["deepspeed"] == pinned["deepspeed"] and carry["datasets"] == pinned["datasets"]
    assert "torch" not in carry and not set(carry) & gpu_wheels.IMAGE_HAS
    for name in carry:
        for requirement in importlib.metadata.requires(name) or []:
            if "extra ==" in requirement:
                continue
            needed = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")
            assert needed in carry or needed in gpu_wheels.IMAGE_HAS, f"{name} needs {needed}: carry it"


def test_mfu_against_the_measured_rate_counts_attention_causally():
    from scaletrain.observability.flops import ModelFlops

    flops = ModelFlops(matmul_params=1000, layers=2, heads=4, head_dim=8, seq_len=64)
    full, causal = flops.per_token(), flops.per_token(causal=True)
    assert full == 6 * 1000 + 12 * 2 * 4 * 8 * 64 and causal == 6 * 1000 + 6 * 2 * 4 * 8 * 64
    assert flops.per_token(recompute=True, causal=True) == 8 * 1000 + 8 * 2 * 4 * 8 * 64
    rows = {name: gc_rows.Row(name, "") for name in ("zero2", "default", "qlora", "flash")}
    rows["zero2"].tokens_per_s = rows["default"].tokens_per_s = rows["qlora"].tokens_per_s = 5000.0
    gc_report.add_measured_mfu(rows, causal, peak_tflops=0.5)
    assert rows["zero2"].mfu_causal_measured == pytest.approx(5000.0 * causal / 0.5e12)
    # the default job's tiny model and QLoRA's frozen base are other FLOPs; a row that did not run has no figure
    assert [rows[n].mfu_causal_measured for n in ("default", "qlora", "flash")] == [None, None, None]
