"""The real pipeline end to end: real DeepSpeed engines, several gloo processes, the tiny Llama, local data.

Each run is a subprocess started the way a user starts it (deepspeed launcher, torchrun, plain python): two ranks
train, checkpoint and export under each ZeRO setting, one process under python with wandb offline, ZeRO-3's
partitions, the process groups freed before exit, and the loss and update independent of accumulation and rank
count. All are slow (several ranks, or tens of seconds); tests/e2e/test_pipeline_tools.py has the tools around it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from tests.harness import (
    FAST_FLAGS,
    GIVEN_PEAK,
    PROBE,
    REPO,
    check_ok,
    launch,
    read_metrics,
    train_losses,
)


def assert_export_matches_engine(run_dir: Path) -> None:
    """The exported folder loads in plain transformers and reproduces the trained engine's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    probe = torch.load(run_dir / "probe_logits.pt")
    model = AutoModelForCausalLM.from_pretrained(run_dir, dtype=torch.float32)
    assert any(p.name.endswith(".safetensors") for p in run_dir.iterdir())
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    assert logits.abs().sum() > 0  # real weights, not the empty ZeRO-3 placeholders
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    assert AutoTokenizer.from_pretrained(run_dir).eos_token == "</s>"


def assert_checkpoint_written(run_dir: Path, step: int) -> None:
    from scaletrain.checkpoint.commit import verify

    ckpt = run_dir / "checkpoints" / f"step{step}"
    assert ckpt.is_dir() and verify(ckpt) is None, f"no committed checkpoint in {ckpt}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step{step}"


@pytest.mark.slow
# (zero2_offload was dropped to keep CI in its budget: zero3_offload offloads the optimizer too, and test_checkpoint
# resumes a ZeRO-2 run under zero2_offload. zero1 too: its optimizer and checkpoint files are ZeRO-2's, DeepSpeed's
# stage_1_and_2.py without gradient partitioning, and both exports, checkpoint/export.py's and export_hf.py's, take
# every stage below 3 alike, as [zero2] checks; 2-rank ZeRO-1 training is checked against ZeRO-2's by
# test_checkpoint.py::test_resume_under_another_zero_setting_continues_exactly[zero1-zero2].)
@pytest.mark.parametrize("ds_config", ["zero2", "zero3", "zero3_offload"])
def test_two_ranks_train_checkpoint_and_export(ds_config, tmp_path, cache_dir):
    import glob

    shm_before = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
    run_dir = tmp_path / "run"
    proc = launch(
        PROBE,
        [
            "--config",
            f"ds_configs/{ds_config}.json",
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "12",
            "--learning_rate",
            "3e-3",
            *FAST_FLAGS,
        ],
        "deepspeed",
        cache_dir,
        nprocs=2,
    )
    check_ok(proc)
    # the finished run freed its process groups (test_a_run_frees_its_process_groups_before_exit: a crash, a pipeline)
    after_close = sorted(re.findall(r"probe: rank (\d): (\d+) communication threads after close", proc.stdout))
    assert after_close == [("0", "0"), ("1", "0")], after_close
    assert "outlive the process group" not in proc.stderr + proc.stdout
    losses = train_losses(run_dir)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses
    assert_checkpoint_written(run_dir, 12)
    assert_export_matches_engine(run_dir)
    # scripts/export_hf.py from the sharded checkpoint (fp32 master weights) gives the same model
    import subprocess
    import sys

    exported = run_dir.parent / "exported"
    check_ok(
        subprocess.run(
            [sys.executable, str(REPO / "scripts/export_hf.py"), str(run_dir / "checkpoints/step12"), str(exported)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    probe = torch.load(run_dir / "probe_logits.pt")
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(exported).eval()(input_ids=probe["input_ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    # both exports are complete: a generation config and a model card with the losses up to the checkpoint
    for folder in (run_dir, exported):
        assert (folder / "generation_config.json").exists(), folder
        assert "final training loss" in (folder / "README.md").read_text(), folder
    saved = json.loads((run_dir / "ds_config.json").read_text())
    assert saved["train_batch_size"] == 4 * 1 * 2 and "auto" not in json.dumps(saved)
    assert json.loads((run_dir / "run_config.json").read_text())["world_size"] == 2
    assert proc.stdout.count("DeepSpeed config ds_configs/") == 1  # its one line, printed once, by rank 0
    # DeepSpeed's CPU all-reduce buffers (69 MB each in RAM-backed /dev/shm) are unlinked at the end
    assert set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*")) <= shm_before


@pytest.mark.slow  # over 10 s: a real run (the fast tier stays under 3 minutes)
def test_single_process_python_with_wandb_offline(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    proc = launch(
        REPO / "train.py",
        [
            "--config",
            "ds_configs/zero2.json",
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "6",
            "--report_to",
            "wandb",
            "--save_steps",
            "2",
            *FAST_FLAGS[len(GIVEN_PEAK) :],  # no --peak_tflops: the CPU calibration runs
        ],
        "python",
        cache_dir,
    )
    check_ok(proc)
    assert "launch: single, world size 1" in proc.stdout
    assert "shm_comm" not in proc.stdout  # a single rank needs no shared-memory all-reduce build
    assert len(train_losses(run_dir)) == 3
    assert_checkpoint_written(run_dir, 6)
    # where the time goes: the phases add up to the step time, and MFU comes from a measured CPU peak
    for record in (r for r in read_metrics(run_dir) if "loss" in r):
        phases = (
            sum(record[f"{p}_s"] for p in ("forward", "backward", "optimizer", "sync", "checkpoint"))
            + record["data_wait_s"]
        )
        assert phases == pytest.approx(record["step_time_s"], rel=0.05)
        assert 0 < record["mfu"] < 1 and record["tflops_per_device"] > 0 and record["cpu_rss_gb"] > 0
    assert "fp32 matrix-product calibration on this CPU" in proc.stdout
    # real wandb in offline mode: a run folder whose record file holds the logged metrics
    records = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1
    payload = records[0].read_bytes()
    for key in (b"loss", b"grad_norm", b"tokens_per_s", b"eval_loss"):
        assert key in payload, key


@pytest.mark.slow
def test_torchrun_two_ranks_zero3_with_gradient_checkpointing(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    proc = launch(
        PROBE,
        [
            "--config",
            "ds_configs/zero3.json",
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "8",
            "--gradient_checkpointing",
            "--attention_isolation",
            "--learning_rate",
            "3e-3",
            "--eval_steps",
            "4",
            *FAST_FLAGS,
        ],
        "torchrun",
        cache_dir,
        nprocs=2,
    )
    check_ok(proc)
    losses = train_losses(run_dir)
    assert losses[-1] < losses[0], losses
    evals = [r for r in read_metrics(run_dir) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"])) for r in evals)
    assert_export_matches_engine(run_dir)


@pytest.mark.slow
def test_zero3_never_holds_the_whole_model_on_a_rank(tmp_path, cache_dir):
    """Under ZeRO-3 each rank's parameters are partitions built by zero.Init, not full tensors."""
    script = tmp_path / "shard_check.py"
    script.write_text(f"""
import sys, json
from scaletrain.distributed.world import communication_threads, read_launch_env
from scaletrain.run import Lifetime, build_rank_model, plan_run, start_world

def shard_sizes(model):
    params = list(model.module.parameters())
    return {{"local": sum(p.ds_tensor.numel() for p in params), "full": sum(p.ds_numel for p in params),
             "empty": all(p.numel() == 0 for p in params)}}  # the module's own tensors are placeholders

dist = read_launch_env()
plan = plan_run(["--config", "ds_configs/zero3.json", "--output_dir", {str(tmp_path / "o")!r}], dist)
lifetime = Lifetime()
start_world(plan, lifetime=lifetime)
model = build_rank_model(plan, lifetime=lifetime)
report = {{"rank": dist.rank, **shard_sizes(model)}}
del model
lifetime.close(0)
report["threads_after_close"] = communication_threads()  # the parameters held the process group
# one file per rank: two ranks printing to one pipe can interleave their lines
open({str(tmp_path)!r} + f"/shard{{dist.rank}}.json", "w").write(json.dumps(report))
""")
    proc = launch(script, [], "deepspeed", cache_dir, nprocs=2)
    check_ok(proc)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("shard*.json"))]
    assert len(reports) == 2
    for r in reports:
        assert r["empty"]
        assert r["threads_after_close"] == 0
        assert r["local"] <= r["full"] / 2 + 10_000  # its half of every parameter (plus partition padding)
    assert sum(r["local"] for r in reports) >= reports[0]["full"]


@pytest.mark.slow
# A finished ZeRO-2/ZeRO-3 run's threads: test_two_ranks_train_checkpoint_and_export (its probe counts them after close)
@pytest.mark.parametrize("stage,ending", [("zero3", "crashed"), ("zero1_pp2", "finished")])
def test_a_run_frees_its_process_groups_before_exit(tmp_path, cache_dir, stage, ending):
    """After train.py's main returns or raises, no gloo thread is left for the interpreter to tear down at exit.

    DeepSpeed keeps process groups on the engine, on ZeRO-3's parameters and in module-level caches, and a
    crash's traceback holds the training loop's frames; left there, the groups were destroyed during interpreter
    shutdown, which now and then aborted a finished rank (SIGABRT, "terminate called without an active exception").
    """
    script = tmp_path / "train_then_count.py"
    script.write_text(f"""
import json, sys
import train
from deepspeed.runtime.engine import DeepSpeedEngine
from scaletrain.distributed.world import communication_threads, read_launch_env

real_step = DeepSpeedEngine.step
def failing_step(engine, *args, **kwargs):  # an unexpected error on every rank at the second step
    if engine.global_steps >= 1:
        raise RuntimeError("injected failure")
    return real_step(engine, *args, **kwargs)
if {ending == "crashed"!r}:
    DeepSpeedEngine.step = failing_step
try:
    outcome = train.main(sys.argv[1:])
except RuntimeError as err:
    outcome = str(err)
report = {{"outcome": outcome, "threads": communication_threads()}}
open({str(tmp_path)!r} + f"/threads{{read_launch_env().rank}}.json", "w").write(json.dumps(report))
""")
    config, _, pipeline = stage.partition("_")  # zero1_pp2: 2 pipeline stages (their point-to-point groups too)
    layout = ["--pipeline_parallel_size", pipeline[2:], "--gradient_accumulation_steps", "2"] if pipeline else []
    proc = launch(
        script,
        [
            "--config",
            f"ds_configs/{config}.json",
            "--output_dir",
            str(tmp_path / "run"),
            "--max_steps",
            "2",
            *FAST_FLAGS,
            *layout,
        ],
        "deepspeed",
        cache_dir,
        nprocs=2,
    )
    check_ok(proc)
    assert "outlive the process group" not in proc.stderr + proc.stdout
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("threads*.json"))]
    assert [r["outcome"] for r in reports] == ([0, 0] if ending == "finished" else ["injected failure"] * 2)
    assert [r["threads"] for r in reports] == [0, 0]


def _corpus_of_blocks(path: Path, block_size: int, n_blocks: int) -> None:
    """Sample documents whose token stream fills n_blocks - 1 blocks and part of the last one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "data" / "tiny-llama")
    target_low, target_high = (n_blocks - 1) * block_size + 5, n_blocks * block_size - 10
    docs, total = [], 0
    for line in (REPO / "data" / "sample" / "train.jsonl").read_text().splitlines():
        text = json.loads(line)["text"]
        n = len(tok(text)["input_ids"]) + 1
        if total + n <= target_high:
            docs.append(text)
            total += n
        if total >= target_low:
            break
    assert target_low <= total <= target_high
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


@pytest.mark.slow
def test_loss_and_update_do_not_depend_on_accumulation_or_rank_count(tmp_path, cache_dir):
    """One global batch of 8 blocks (the last one partly padding), split three ways: same loss, same update. The
    2-rank run sums its gradients through shared memory (the CPU default on one host), so a kernel that dropped,
    doubled or misplaced a rank's gradient would change its norm and update."""
    from safetensors.torch import load_file

    data = tmp_path / "eight_blocks.jsonl"
    _corpus_of_blocks(data, block_size=64, n_blocks=8)
    splits = {  # name: (ranks, micro batch, accumulation)
        "1rank_gas1": (1, 8, 1),
        "1rank_gas4": (1, 2, 4),
        "2ranks_gas2": (2, 2, 2),  # ranks and accumulation together (2 ranks alone was dropped for CI time)
    }
    results = {}
    for name, (ranks, micro, gas) in splits.items():
        run_dir = tmp_path / name
        proc = launch(
            REPO / "train.py",
            [
                "--config",
                "ds_configs/zero2.json",
                "--train_file",
                str(data),
                "--validation_split_percentage",
                "0",
                "--output_dir",
                str(run_dir),
                "--block_size",
                "64",
                "--per_device_train_batch_size",
                str(micro),
                "--gradient_accumulation_steps",
                str(gas),
                "--max_steps",
                "1",
                "--logging_steps",
                "1",
                # A large Adam epsilon makes the first update proportional to the gradient (with the default 1e-8 it
                # is nearly sign(g), which turns fp32 summation-order noise in near-zero gradients into full steps).
                "--learning_rate",
                "1e-2",
                "--adam_epsilon",
                "1e-3",
                "--disable_tqdm",
            ],
            "deepspeed",
            cache_dir,
            nprocs=ranks,
        )
        check_ok(proc)
        if ranks > 1:  # the gradient buckets were summed by DeepSpeed's shared-memory kernel (--cpu_shm_allreduce)
            carried = re.search(
                r"cpu: (\d+) all-reduces \(([\d.]+) GB\) went through shared memory", proc.stdout + proc.stderr
            )
            assert carried is not None and int(carried.group(1)) >= gas, (proc.stdout + proc.stderr)[-3000:]
        record = read_metrics(run_dir)[0]
        results[name] = (record["loss"], record["grad_norm"], load_file(run_dir / "model.safetensors"))
    ref_loss, ref_norm, ref_weights = results["1rank_gas1"]
    for name, (loss, norm, weights) in results.items():
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert norm == pytest.approx(ref_norm, rel=1e-4), name
        for key, tensor in ref_weights.items():
            torch.testing.assert_close(weights[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
