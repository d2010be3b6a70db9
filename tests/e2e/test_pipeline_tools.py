"""The real pipeline through the tools around a run: data/prepare.py's store against raw files, the README's
main command, the observability sinks (TensorBoard, wandb, the profiler, scripts/plot_metrics.py) and --dry_run, the
scaling report, and torch.compile. Real subprocesses, all slow but the check that refuses torch.compile with a
model-parallel layout (in-process).
"""

from __future__ import annotations

import json

import pytest

from tests.harness import (
    FAST_FLAGS,
    LAYOUT_STEPS,
    REPO,
    check_ok,
    launch,
    layout_flags,
    read_metrics,
    reference_output,
    train_losses,
)


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
