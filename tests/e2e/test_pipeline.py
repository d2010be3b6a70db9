"""The real pipeline end to end: real DeepSpeed engines, several gloo processes, the tiny Llama, local data.

Each run is a subprocess started the way a user starts it (deepspeed launcher, torchrun, plain python). All but the
single-process run are slow (several ranks, or tens of seconds); that one is part of the fast tier.
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
    LAYOUT_STEPS,
    PROBE,
    REPO,
    check_ok,
    launch,
    layout_flags,
    read_metrics,
    reference_output,
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
def test_prepared_store_and_raw_files_train_on_identical_batches(tmp_path, cache_dir):
    """data/prepare.py + --data_path, and raw files given to train.py, give the same losses step by step."""
    import subprocess
    import sys

    from tests.harness import child_env

    files = ["--train_file", str(REPO / "data/sample/validation.jsonl"), "--validation_split_percentage", "0"]
    env = {**child_env(cache_dir), "SCALETRAIN_CACHE": str(tmp_path / "cache")}
    prep = subprocess.run(
        [
            sys.executable,
            str(REPO / "data/prepare.py"),
            *files,
            "--tokenizer_name",
            str(REPO / "data/tiny-llama"),
            "--block_size",
            "64",
            "--output_dir",
            str(tmp_path / "store"),
            "--num_proc",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    check_ok(prep)
    common = [
        "--config",
        "ds_configs/zero2.json",
        "--max_steps",
        "6",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "--per_device_train_batch_size",
        "2",
    ]
    from_store = launch(
        REPO / "train.py",
        [*common, "--data_path", str(tmp_path / "store"), "--output_dir", str(tmp_path / "a")],
        "deepspeed",
        cache_dir,
        nprocs=2,
    )
    check_ok(from_store)
    from_raw = launch(
        REPO / "train.py",
        [*common, *files, "--block_size", "64", "--output_dir", str(tmp_path / "b")],
        "deepspeed",
        cache_dir,
        nprocs=2,
    )
    check_ok(from_raw)
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")
    assert len(train_losses(tmp_path / "a")) == 6


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
plan = plan.replace(dist=start_world(plan, lifetime=lifetime))
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


@pytest.mark.slow
def test_readme_main_command_trains_the_default_and_loss_falls(tmp_path, cache_dir):
    """Exactly `deepspeed train.py --config ds_configs/zero3.json`, run in a copy-free view of the repo."""
    for name in ("train.py", "ds_configs", "data", "scaletrain"):
        (tmp_path / name).symlink_to(REPO / name)
    from tests.harness import VENV_BIN, child_env
    import subprocess

    proc = subprocess.run(
        [str(VENV_BIN / "deepspeed"), "train.py", "--config", "ds_configs/zero3.json"],
        cwd=tmp_path,
        env=child_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=900,
    )
    check_ok(proc)
    run_dir = tmp_path / "runs" / "default"
    losses = train_losses(run_dir)
    assert losses[-1] <= 0.75 * losses[0], f"loss fell only from {losses[0]:.3f} to {losses[-1]:.3f}"
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "tokenizer.json").is_file()
    assert "precision: fp32" in proc.stdout


@pytest.mark.slow
def test_observability_sinks_profile_plot_and_dry_run(tmp_path, cache_dir):
    """TensorBoard events, a profiler trace, the PNG dashboard, and --dry_run, from real runs."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    proc = launch(
        REPO / "train.py",
        [
            "--config",
            "ds_configs/zero2.json",
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "5",
            "--report_to",
            "tensorboard,wandb",
            "--profile_steps",
            "2-3",
            "--eval_steps",
            "2",
            *FAST_FLAGS,
            "--logging_steps",
            "1",
        ],
        "python",
        cache_dir,
    )
    check_ok(proc)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]
    assert {"mfu", "forward_s", "eval_loss"} <= set(events.Tags()["scalars"])
    trace = json.loads((run_dir / "profile" / "trace_rank0_steps2-3.json").read_text())
    assert len(trace["traceEvents"]) > 100
    plot = subprocess.run(
        [sys.executable, str(REPO / "scripts/plot_metrics.py"), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_ok(plot)
    png = (run_dir / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    # a resumed run continues the same wandb run
    first_id = next((run_dir / "wandb").glob("offline-run-*")).name.rsplit("-", 1)[1]
    check_ok(
        launch(
            REPO / "train.py",
            [
                "--config",
                "ds_configs/zero2.json",
                "--output_dir",
                str(run_dir),
                "--max_steps",
                "7",
                "--report_to",
                "wandb",
                *FAST_FLAGS,
            ],
            "python",
            cache_dir,
        )
    )
    ids = {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert ids == {first_id}

    dry = launch(
        REPO / "train.py",
        ["--config", "ds_configs/zero3.json", "--output_dir", str(tmp_path / "dry"), "--dry_run", *FAST_FLAGS],
        "python",
        cache_dir,
    )
    check_ok(dry)
    assert "dry run OK: one step in" in dry.stdout
    assert not (tmp_path / "dry").exists()


@pytest.mark.extended  # ~40 s: the scaling-report script
@pytest.mark.slow
def test_scaling_report_runs_at_world_sizes_1_and_2(tmp_path, cache_dir):
    import subprocess
    import sys

    from tests.harness import child_env

    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/scaling_report.py"),
            "--world_sizes",
            "1,2",
            "--steps",
            "8",
            "--out",
            str(tmp_path),
            "--",
            "--block_size",
            "64",
            "--per_device_train_batch_size",
            "2",
            "--max_eval_samples",
            "8",
        ],
        env=child_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=900,
    )
    check_ok(proc)
    text = (tmp_path / "scaling.md").read_text()
    table = text[: text.index("\n\n")].splitlines()
    # the time model beside: calibrated by world size 1, so its prediction there is its measured step
    beside = text[text.index("\n\n") :].strip().splitlines()
    assert beside[0].startswith("| world size | measured step (s) | predicted step (s) |")
    first = [cell.strip() for cell in beside[2].strip("|").split("|")]
    assert first[0] == "1" and float(first[2]) == pytest.approx(float(first[1]), rel=0.02)
    assert beside[3].startswith("| 2 |") and float(beside[3].split("|")[3]) > 0
    assert beside[-1].startswith("phase whose share grew most (1 -> 2 ranks): ") and "likely fix: " in beside[-1]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)) for line in table[2:]]
    assert [row["world size"] for row in rows] == ["1", "2"]
    for row in rows:  # each figure is the steady state (after the warm-up quarter) of that world size's own run
        world = int(row["world size"])
        steady = [r for r in read_metrics(tmp_path / f"world{world}") if "loss" in r][8 // 4 :]
        assert len(steady) == 6
        tokens_per_s = sum(r["tokens_per_s"] for r in steady) / len(steady)
        assert float(row["tokens/s"]) == pytest.approx(tokens_per_s, abs=0.5)
        assert float(row["tokens/s per rank"]) == pytest.approx(tokens_per_s / world, abs=0.5)
        for phase in ("forward", "backward", "sync"):
            mean = sum(r[f"{phase}_s"] for r in steady) / len(steady)
            assert float(row[f"{phase} (s)"]) == pytest.approx(mean, abs=0.0006)
    # scaling efficiency: per-rank throughput at world size 2 over world size 1 (figures rounded to whole tokens/s)
    base, two = (float(row["tokens/s per rank"]) for row in rows)
    assert rows[0]["scaling efficiency"] == "1.00"
    assert float(rows[1]["scaling efficiency"]) == pytest.approx(two / base, abs=0.005 + 1 / base)
    # the phase named is the one whose time grew most between the two rows, with its growth (cells rounded to 1 ms)
    phases = [name.removesuffix(" (s)") for name in header if name.endswith(" (s)") and name != "step time (s)"]
    growth = {p: float(rows[1][f"{p} (s)"]) - float(rows[0][f"{p} (s)"]) for p in phases}
    grew, by = rows[1]["grew most vs smallest"].removesuffix("s)").split(" (+")
    assert growth[grew] >= max(growth.values()) - 0.001, (grew, growth)
    assert float(by) == pytest.approx(growth[grew], abs=0.0015)
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a compiled 1-rank run (inductor builds its graphs on the CPU) against the layout tests' reference
def test_torch_compile_trains_as_eager_does_and_a_compile_section_turns_it_on(layout_reference, tmp_path, cache_dir):
    # Eager: the layout tests' shared 1-rank run (harness.layout_flags), which the compiled run repeats with
    # --torch_compile (and no export at the end): the same losses, step by step.
    assert "torch.compile" not in "".join(reference_output(layout_reference))
    compiled = tmp_path / "compiled"
    proc = launch(
        REPO / "train.py",
        layout_flags(compiled, "zero2", "--no-export_hf_at_end", "--torch_compile"),
        "python",
        cache_dir,
    )
    check_ok(proc)
    assert "torch.compile: backend inductor, DeepCompile off" in proc.stdout + proc.stderr
    expected = {r["step"]: r["loss"] for r in read_metrics(layout_reference) if "loss" in r}
    got = {r["step"]: r["loss"] for r in read_metrics(compiled) if "loss" in r}
    assert sorted(got) == list(range(1, LAYOUT_STEPS + 1))
    for step, loss in expected.items():  # fused kernels sum in another order: equal to 1e-5, not bit for bit
        assert got[step] == pytest.approx(loss, rel=1e-5), step
    # A "compile" section in the JSON is honoured (DeepSpeed reads it only in engine.compile())
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["compile"] = {"deepcompile": False}
    (tmp_path / "compile.json").write_text(json.dumps(config))
    proc = launch(
        REPO / "train.py",
        ["--config", str(tmp_path / "compile.json"), "--output_dir", str(tmp_path / "dry"), *FAST_FLAGS, "--dry_run"],
        "python",
        cache_dir,
    )
    check_ok(proc)
    assert "torch.compile: backend inductor" in proc.stdout + proc.stderr


def test_torch_compile_with_a_model_parallel_layout_is_refused():
    from scaletrain.engine.initialize import check_compile, compile_requested
    from scaletrain.parts import ParallelLayout

    assert compile_requested(False, {"compile": {}}) and not compile_requested(False, {})
    check_compile(True, ParallelLayout(), "x.json")
    from scaletrain.errors import UsageError

    with pytest.raises(UsageError, match="with tensor, sequence or pipeline parallelism: not supported here"):
        check_compile(True, ParallelLayout(pp=2), "x.json")
    check_compile(False, ParallelLayout(tp=2), "x.json")
