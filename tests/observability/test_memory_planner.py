"""The memory planner: its model-state figures against a real 2-rank CPU run, and the --plan command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from scaletrain.observability import memory_planner, plan_report
from scaletrain.observability.memory_planner import PlannedRun as Run
from scaletrain.observability.memory_planner import data_parallel_run
from scaletrain.parts import ParallelLayout
from tests.harness import FAST_FLAGS, REPO, check_ok, launch, child_env

MEMORY_PROBE = REPO / "tests" / "helpers" / "memory_probe.py"
TINY = REPO / "data" / "tiny-llama"


def tiny_shape() -> memory_planner.ModelShape:
    from transformers import AutoConfig

    from scaletrain.model.build import meta_model

    config = AutoConfig.from_pretrained(TINY)
    return memory_planner.ModelShape.from_meta_model(meta_model(config, False), config)


def test_model_state_formulas_by_stage_and_offload():
    shape = memory_planner.ModelShape(
        n_params=1000, largest_layer_params=100, layers=2, hidden=8, intermediate=16, vocab=50
    )
    by_name = {o.name: o for o in memory_planner.OPTIONS}
    states = {
        name: memory_planner.model_state_bytes(option, shape=shape, dp=4, precision="bf16", reduce_bucket=0)
        for name, option in by_name.items()
    }
    assert states["ZeRO-1"] == (2000, 2000, 3000, 0, 0)  # whole 16-bit gradients until the reduction
    assert states["ZeRO-2"] == (2000, 1500, 3000, 0, 0)  # 16-bit + fp32 gradient partition, 12-byte optimizer / 4
    assert states["ZeRO-3"] == (500, 500, 3000, 0, 0)
    assert states["ZeRO-2 + optimizer offload (CPU)"] == (2000, 0, 0, 4000, 0)
    assert states["ZeRO-3 + optimizer and parameter offload (CPU)"] == (0, 0, 0, 4500, 0)
    assert states["ZeRO-3 + optimizer and parameter offload (NVMe)"] == (0, 0, 0, 0, 4500)
    assert memory_planner.model_state_bytes(by_name["ZeRO-1"], shape=shape, dp=4, precision="fp32", reduce_bucket=0)[
        :3
    ] == (
        4000,
        4000,
        3000,
    )
    assert memory_planner.model_state_bytes(by_name["ZeRO-2"], shape=shape, dp=4, precision="fp32")[:3] == (
        4000,
        1000,
        3000,
    )
    # ZeRO-1 and -3 allocate their reduce bucket whole (in the gradients' dtype), never larger than the model
    assert (
        memory_planner.model_state_bytes(by_name["ZeRO-1"], shape=shape, dp=4, precision="bf16", reduce_bucket=100)[1]
        == 2200
    )
    assert (
        memory_planner.model_state_bytes(by_name["ZeRO-3"], shape=shape, dp=4, precision="bf16", reduce_bucket=100)[1]
        == 700
    )
    assert memory_planner.model_state_bytes(by_name["ZeRO-3"], shape=shape, dp=4, precision="bf16")[1] == 500 + 2 * 1000
    # tensor parallelism splits the linear layers' weights (here 800 of 1000) and leaves the rest whole
    split = memory_planner.ModelShape(
        n_params=1000, largest_layer_params=100, layers=2, hidden=8, intermediate=16, vocab=50, linear_params=800
    )
    assert memory_planner.model_state_bytes(by_name["ZeRO-2"], shape=split, dp=2, precision="fp32", tp=4)[:3] == (
        1600,
        800,
        2400,
    )
    # sequence parallelism: each rank holds 1/sp of the tokens, so every per-token term shrinks by sp (on the same
    # 2 GPUs, whose ZeRO partition is the same: ZeRO partitions over the sequence-parallel ranks too)
    sequence_parallel = Run(gpus_per_node=2, parallel=ParallelLayout(sp=2), micro_batch=2, block_size=16)
    assert memory_planner.activation_bytes(shape, sequence_parallel) == (
        memory_planner.activation_bytes(shape, data_parallel_run(gpus_per_node=2, micro_batch=1, block_size=16))
    )
    assert [o.name for o in memory_planner.options_for(1, 2)] == [  # sequence parallelism: CPU offload, no NVMe
        o.name for o in memory_planner.OPTIONS if o.offload_optimizer != "nvme"
    ]
    # pipeline stages: the largest stage's parameters (its layers / k, plus the embedding or the head), ZeRO-1 only
    staged = memory_planner.ModelShape(
        n_params=1000,
        largest_layer_params=100,
        layers=4,
        hidden=8,
        intermediate=16,
        vocab=50,
        embedding_params=100,
        head_params=100,
    )
    assert staged.params_per_rank(1, pp=2) == (1000 - 200) / 2 + 100
    assert memory_planner.model_state_bytes(
        by_name["ZeRO-1"], shape=staged, dp=2, precision="fp32", pp=2, reduce_bucket=0
    )[:3] == (
        2000,
        2000,
        3000,
    )
    assert [o.name for o in memory_planner.options_for(1, 1, 2)] == ["ZeRO-1"]
    # the step's timeline (step_peaks: forward at the loss, backward at its first gradient, end of backward)
    peaks = lambda run, stage=1, bucket=0, which="last", on=shape: memory_planner.step_peaks(  # noqa: E731
        on, run=run, stage=stage, n=1000, reduce_bucket=bucket, which=which
    )[0]
    run = Run(block_size=16)
    # the first stage keeps k micro-batches of its layers / k layers in flight: the same activations as the whole
    # model for one micro-batch, without the loss (the last stage's) and without gradients until its first backward
    pipelined = Run(gpus_per_node=4, parallel=ParallelLayout(pp=4), block_size=16, grad_accum=4)
    loss = 16 * 50 * 10 + 2 * 16 * 8 * 2  # the whole logits' 10 bytes, the final norm's input and output
    assert peaks(pipelined, which="first", on=staged)[0] == peaks(run, on=staged)[0] - loss
    # ZeRO-3 keeps the parameters it gathers in the forward (up to stage3_max_live_parameters, at least the largest
    # layer); its gradient partition is a model state
    assert peaks(run, stage=3)[0] - peaks(run)[0] == 2 * 1000
    # the backward's first gradient opens ZeRO-1's reduce bucket, ZeRO-2's two (overlap_comm), never larger than the
    # rank's share
    assert peaks(run, stage=2, bucket=300)[1] - peaks(run)[1] == 2 * 300 * 2
    assert peaks(run, stage=2, bucket=10**9)[1] - peaks(run, bucket=10**9)[1] == 2 * 1000 * 2 - 1000 * 2
    # accumulating, ZeRO-1 holds its 16-bit gradients and its bucket, ZeRO-2 its gradient partition (16-bit + fp32
    # / dp) through the next micro-batch's forward
    accumulating = Run(block_size=16, grad_accum=2)
    assert peaks(accumulating, bucket=300)[0] - peaks(run, bucket=300)[0] == 2 * 1000 + 2 * 300
    assert peaks(accumulating, stage=2)[0] - peaks(run, stage=2)[0] == 6 * 1000
    # the working memory is the step's highest point beyond the model states: ZeRO-1's gradients, counted in the
    # model states, are not counted twice
    states = sum(
        memory_planner.model_state_bytes(by_name["ZeRO-1"], shape=shape, dp=1, precision="bf16", reduce_bucket=0)[:3]
    )
    persistent = 2 * 1000 + 12 * 1000
    assert memory_planner.activation_bytes(shape, run, 1, 0)[0] == persistent + max(*peaks(run), 2000) - states


def test_a_planned_run_holds_one_parallel_layout_of_its_gpus():
    """The planned GPUs and the layout are one count: data parallelism over them by default, ZeRO partitioned over
    the data x sequence-parallel ranks, and a layout of another world refused."""
    run = data_parallel_run(gpus_per_node=8, nodes=2)
    assert run.parallel == ParallelLayout(dp=16) and run.zero_ranks == 16
    composed = memory_planner.with_model_parallel(run, tp=2, sp=2, pp=2)
    assert composed.parallel == ParallelLayout(tp=2, sp=2, pp=2, dp=2) and composed.zero_ranks == 4
    with pytest.raises(AssertionError, match="spans 8 ranks, not the 2 node"):
        Run(gpus_per_node=8, nodes=2, parallel=ParallelLayout(tp=8))


def test_recommendation_prefers_the_fastest_option_that_fits_then_checkpointing():
    shape = memory_planner.ModelShape(
        n_params=7_000_000_000,
        largest_layer_params=131_000_000,
        layers=32,
        hidden=4096,
        intermediate=11008,
        vocab=32000,
    )
    estimates = memory_planner.plan_memory(
        shape, data_parallel_run(gpus_per_node=8, nodes=1, micro_batch=1, block_size=2048)
    )
    est, ckpt = memory_planner.recommend(estimates, 80 * memory_planner.GIB, None)
    assert (est.option.name, ckpt) == ("ZeRO-1", False)
    est, ckpt = memory_planner.recommend(estimates, 24 * memory_planner.GIB, None)
    assert est.option.stage == 3 and est.total(ckpt) <= 0.9 * 24 * memory_planner.GIB
    assert memory_planner.recommend(estimates, 1 * memory_planner.GIB, None) is None
    # A 4 GB GPU fits only with offload: CPU offload while host memory is unchecked (117 GB per node), NVMe when
    # the host has 10 GB (CPU offload would not fit there, the NVMe option needs no host memory for the states)
    cpu, _ = memory_planner.recommend(estimates, 4 * memory_planner.GIB, None)
    assert cpu.option.name == "ZeRO-3 + optimizer and parameter offload (CPU)"
    assert cpu.host_per_node > 100 * memory_planner.GIB
    nvme, _ = memory_planner.recommend(estimates, 4 * memory_planner.GIB, host_bytes=10 * memory_planner.GIB)
    assert nvme.option.name == "ZeRO-3 + optimizer and parameter offload (NVMe)"
    assert nvme.host_per_node <= 0.9 * 10 * memory_planner.GIB


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,accumulation,tp,sp,dp",
    [
        pytest.param(1, 1, 1, 1, 2, marks=pytest.mark.extended),  # for CI's time: ZeRO-1 is planned in CI at GA 2
        (1, 2, 1, 1, 2),
        (2, 2, 1, 1, 2),
        (3, 1, 1, 1, 2),
        pytest.param(2, 1, 2, 1, 1, marks=pytest.mark.extended),  # for CI's time: TP 2 x SP 2 plans TP's shards
        (3, 1, 1, 2, 1),
        (2, 1, 2, 2, 1),  # TP 2 x SP 2 on 4 ranks
        (3, 1, 2, 1, 2),  # TP 2 x DP 2 on 4 ranks: ZeRO-3 partitions each tensor rank's shard over its 2 replicas
    ],
)
def test_planned_model_states_match_a_real_two_rank_run_within_10_percent(
    stage, accumulation, tp, sp, dp, tmp_path, cache_dir
):
    run_dir = tmp_path / "run"
    nprocs = tp * sp * dp
    proc = launch(
        MEMORY_PROBE,
        [
            "--config",
            f"ds_configs/zero{stage}.json",
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "2",
            "--max_eval_samples",
            "8",
            *FAST_FLAGS,
            "--gradient_accumulation_steps",
            str(accumulation),
            "--tensor_parallel_size",
            str(tp),
            "--sequence_parallel_size",
            str(sp),
        ],
        "deepspeed",
        cache_dir,
        nprocs=nprocs,
    )
    check_ok(proc)
    option = next(o for o in memory_planner.OPTIONS if o.stage == stage and o.offload_optimizer == "none")
    # ZeRO partitions over the ranks left by tensor parallelism (the sequence ranks among them)
    bucket = json.loads((run_dir / "ds_config.json").read_text())["zero_optimization"]["reduce_bucket_size"]
    params, grads, optimizer, _, _ = memory_planner.model_state_bytes(
        option, shape=tiny_shape(), dp=nprocs // tp, precision="fp32", tp=tp, reduce_bucket=bucket
    )
    planned = params + grads + optimizer
    for rank in range(nprocs):
        # The second step's peak (the first one created the optimizer's moments: Adam builds them lazily): before
        # the update, at the end of the backward before ZeRO-1's reduction, and between micro-batches.
        memory = json.loads((run_dir / f"memory_rank{rank}.json").read_text())
        per_step = len(memory["accumulating"]) // 2
        measured = max([memory["before_update"][1], *memory["before_reduce"][1:2], *memory["accumulating"][per_step:]])
        assert abs(planned - measured) <= 0.10 * measured, (
            f"ZeRO-{stage} GA {accumulation} TP {tp} rank {rank}: planned {planned / 2**20:.1f} MiB, measured "
            f"{measured / 2**20:.1f} MiB"
        )


PEAK_LAYOUTS = {  # ZeRO stage, ranks, accumulation, tensor, sequence, pipeline sizes
    "zero2_sp2": (2, 2, 1, 1, 2, 1),
    "zero1_tp2xpp2": (1, 4, 2, 2, 1, 2),
}


@pytest.mark.slow  # a 2-rank and a 4-rank run of 4 steps under torch's profiler
@pytest.mark.parametrize("layout", PEAK_LAYOUTS.values(), ids=PEAK_LAYOUTS.keys())
def test_the_plans_total_is_within_10_percent_of_each_ranks_measured_peak(layout, tmp_path, cache_dir):
    """The plan's per-GPU total without checkpointing (its step timeline: the highest of the forward at the loss, the
    backward's first gradient and the update, above the parameters and optimizer states) against each rank's peak
    during a training step, measured by tests/helpers/peak_memory_probe.py (torch's profiler counts every allocation
    and free): SP 2 under ZeRO-2 (two reduce buckets opened at the backward's first gradient, 0.86x of the peak
    before the plan counted them, 1.22x while it added whole gradients to every activation) and TP 2 x PP 2 (each
    pipeline stage against its own plan: the first holds two micro-batches in flight and no loss, the last the loss
    and the pipe engine's gradients between micro-batches; 1.61x and 1.12x before the timeline). The other layouts:
    BENCHMARKS.md, "--plan's total against each rank's measured peak"."""
    stage, nprocs, accumulation, tp, sp, pp = layout
    run_dir = tmp_path / "run"
    flags = ["--config", f"ds_configs/zero{stage}.json", "--output_dir", str(run_dir), "--max_steps", "4"]
    flags += [*FAST_FLAGS, "--max_eval_samples", "8", "--gradient_accumulation_steps", str(accumulation)]
    flags += ["--tensor_parallel_size", str(tp), "--sequence_parallel_size", str(sp)]
    flags += ["--pipeline_parallel_size", str(pp)]
    proc = launch(REPO / "tests" / "helpers" / "peak_memory_probe.py", flags, "deepspeed", cache_dir, nprocs=nprocs)
    check_ok(proc)
    bucket = json.loads((run_dir / "ds_config.json").read_text())["zero_optimization"]["reduce_bucket_size"]
    shape = tiny_shape()
    chunk = memory_planner.auto_loss_chunk(shape.vocab)
    planned_run = Run(
        gpus_per_node=nprocs, parallel=ParallelLayout.of_world(nprocs, tp, sp, pp), micro_batch=4, block_size=64,
        precision="fp32", loss_chunk=chunk, grad_accum=accumulation,
    )  # fmt: skip
    option = next(o for o in memory_planner.OPTIONS if o.stage == stage and o.offload_optimizer == "none")
    for rank in range(nprocs):
        which = "first" if rank < nprocs // pp else "last"  # the pipe axis varies slowest
        total = memory_planner.peak_bytes(shape, planned_run, option, bucket, which)[0]
        steps = json.loads((run_dir / f"peak_memory_rank{rank}.json").read_text())["steps"]
        assert len(steps) == 3, steps  # steps 2 to 4 (the first builds Adam's moments)
        # the step the profiler saw whole: its running sum ends within 5% of the peak from the live bytes (0.0-1.5% in
        # the benchmark's SP 2 runs). About one rank-step in twenty here ends 3.2-3.9 MB high (4 of 80 on this machine,
        # once in CI): an allocation of the step (2.8 MB on the last stage, where it was traced) whose free the
        # profiler never records although the tensor is gone at the mark, so that step's running sum, and its peak
        # if the free came before it, are not a measure. Of three steps, one is clean all but always.
        step = min(steps, key=lambda record: abs(record["drift"]))
        assert abs(step["drift"]) <= 0.05 * step["peak"], steps
        assert step["start"] < step["peak"], step
        assert abs(total - step["peak"]) <= 0.10 * step["peak"], (
            f"rank {rank} ({which} stage): planned {total / 2**20:.2f} MiB, {step}"
        )
    if pp == 1:  # the table's total is the rank's plan
        estimates = memory_planner.plan_memory(shape, planned_run, reduce_bucket=bucket)
        assert next(e for e in estimates if e.option == option).total(checkpointing=False) == total


@pytest.mark.slow  # a 2-rank and two 4-rank pipeline runs of 2 steps
@pytest.mark.parametrize(
    "nprocs,tp,chunk", [(2, 1, "0"), (4, 1, "auto"), (4, 2, "auto")], ids=["pp2_whole_logits", "pp2xdp2", "tp2xpp2"]
)
def test_planned_model_states_match_a_real_pipeline_run_within_10_percent(nprocs, tp, chunk, tmp_path, cache_dir):
    """ZeRO-1 under PP 2 (and PP 2 x DP 2, and TP 2 x PP 2: each stage's layers split over 2 ranks): each stage's
    model states, measured right before the pipe engine's update, against the planner's figure for the largest stage
    (the two stages of the tiny Llama weigh the same: the embedding on one, the head on the other); the last stage
    also holds the outputs the pipe engine keeps in its two output buffers (the logits, whole on every tensor rank,
    with --loss_chunk_size 0; the hidden states under the chunked loss: 7 MiB less), which the planner counts in that
    stage's working memory."""
    run_dir = tmp_path / "run"
    proc = launch(
        MEMORY_PROBE,
        [
            "--config",
            "ds_configs/zero1.json",
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "2",
            "--max_eval_samples",
            "8",
            *FAST_FLAGS,
            "--gradient_accumulation_steps",
            "2",
            "--pipeline_parallel_size",
            "2",
            "--tensor_parallel_size",
            str(tp),
            *(["--loss_chunk_size", chunk] if chunk != "auto" else []),
        ],
        "deepspeed",
        cache_dir,
        nprocs=nprocs,
    )
    check_ok(proc)
    option = next(o for o in memory_planner.OPTIONS if o.stage == 1)
    bucket = json.loads((run_dir / "ds_config.json").read_text())["zero_optimization"]["reduce_bucket_size"]
    dp = nprocs // (2 * tp)
    params, grads, optimizer, _, _ = memory_planner.model_state_bytes(
        option, shape=tiny_shape(), dp=dp, precision="fp32", tp=tp, pp=2, reduce_bucket=bucket
    )
    kept = memory_planner.pipeline_kept_outputs(
        tiny_shape(), micro_batch=4, block_size=64, precision="fp32", chunked=chunk == "auto"
    )
    for rank in range(nprocs):
        memory = json.loads((run_dir / f"memory_rank{rank}.json").read_text())
        assert len(memory["before_update"]) == 2, memory  # the probe saw each pipeline update
        measured = max([memory["before_update"][1], *memory["before_reduce"][1:2]])
        last_stage = rank >= nprocs // 2  # rank = stage x dp + data-parallel index
        planned = params + grads + optimizer + (kept if last_stage else 0)
        assert abs(planned - measured) <= 0.10 * measured, (
            f"TP {tp} x PP 2 x DP {dp} rank {rank}: planned {planned / 2**20:.2f} MiB, measured "
            f"{measured / 2**20:.2f} MiB"
        )


@pytest.mark.slow  # train.py --plan in real processes: over 10 s on a loaded day (the fast tier keeps under 3 minutes)
def test_plan_command_prints_every_option_and_a_recommendation(tmp_path):
    out = tmp_path / "untouched"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--plan",
            "--num_gpus",
            "8",
            "--num_nodes",
            "2",
            "--gpu_memory_gb",
            "40",
            "--per_device_train_batch_size",
            "2",
            "--output_dir",
            str(out),
            "--gpu",
            "a100-40gb",
            "--plan_scaling",
            "1,2,4",
            "--plan_tokens",
            "1e9",
            "--plan_json",
            str(tmp_path / "plan.json"),
        ],
        cwd=REPO,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_ok(proc)
    start, timing = proc.stdout.index("memory plan:"), proc.stdout.index("time plan:")  # after DeepSpeed's notice
    lines = proc.stdout[start:timing].strip().splitlines()
    assert lines[0].startswith("memory plan: 1.8M parameters, 2 node(s) x 8 GPU(s) = 16 data-parallel ranks, bf16")
    for option in memory_planner.OPTIONS:
        assert any(line.startswith(f"| {option.name} |") for line in lines), option.name
    assert lines[-2].startswith("memory plan's choice: --config ds_configs/zero1.json")
    # 1.8M parameters: 12 bytes each over 16 ranks, plus rank 0's bf16 weights; ZeRO-3 the partition alone
    assert lines[-1].startswith("--async_save: snapshot buffers in host memory (/dev/shm), per rank: up to 0.00 GiB")
    assert "x 8 ranks per node" in lines[-1]
    assert any(line.startswith("longest block (micro-batch 1, activation checkpointing") for line in lines)
    # the tiny Llama's 4 heads: Ulysses reaches 4 of the 16 GPUs
    assert "| features | sequence parallel 1 | sequence parallel 4 |" in lines
    assert not out.exists()  # a plan writes nothing but --plan_json
    timed = proc.stdout[timing:].splitlines()
    assert timed[0].startswith("time plan: 2 node(s) x 8 a100-40gb (peak 312 TFLOP/s")
    assert timed[5].startswith("| flags: DP 16 | ZeRO-3 | 2 x 1 | no | yes (")  # ds_configs/zero3.json, the default
    assert any(line.startswith("recommended (fastest predicted that fits): --config ds_configs/") for line in timed)
    assert "| 4 | 32 | 1 x 1 |" in proc.stdout  # 32 sequences a step: one each on 4 nodes
    plan = json.loads((tmp_path / "plan.json").read_text())
    flags = plan["layouts"][0]
    assert (flags["data_parallel_size"], flags["zero_stage"], flags["micro_batch_size"]) == (16, 3, 2)
    assert plan["layouts"][plan["recommended"]]["fits"] and [row["nodes"] for row in plan["scaling"]] == [1, 2, 4]


LLAMA_8B = memory_planner.ModelShape(  # Llama-3.1-8B: hidden 4096, MLP 14336, 32 layers, 32 heads, 8 KV heads
    n_params=8_030_261_248,
    largest_layer_params=128256 * 4096,
    layers=32,
    hidden=4096,
    intermediate=14336,
    vocab=128256,
    kv_heads=8,
    heads=32,
)


def test_tiled_mlp_and_offloading_shrink_the_planned_working_memory():
    shape, tokens = LLAMA_8B, 131072
    chunk = memory_planner.auto_loss_chunk(shape.vocab)
    run = Run(micro_batch=1, block_size=tokens, precision="bf16", loss_chunk=chunk)
    base = memory_planner.activation_bytes(shape, run, stage=3)[1]
    tiled_run = replace(run, features=memory_planner.MemoryFeatures(tiled_mlp=True))
    tiled = memory_planner.activation_bytes(shape, tiled_run, stage=3)[1]
    both_run = replace(run, features=memory_planner.MemoryFeatures(tiled_mlp=True, offload=True))
    both = memory_planner.activation_bytes(shape, both_run, stage=3)[1]
    # at the backward's peak (a layer recomputed), the MLP's 8 f bytes per token and its backward's two bf16
    # temporaries (4 f) leave for one slice of 4096 tokens; the kept inputs drop from 32 layers to 2
    assert base - tiled == pytest.approx((tokens - 4096) * 12 * 14336)
    assert tiled - both == pytest.approx(30 * 2 * tokens * 4096)


def test_the_plan_counts_the_runs_memory_features():
    """--plan --tiled_mlp --activation_offloading: the table's checkpointed working memory shrinks as
    activation_bytes says, and the offloaded checkpoints show in the host memory per node."""
    run = Run(gpus_per_node=8, parallel=ParallelLayout(sp=8), micro_batch=1, block_size=131072, precision="bf16")
    plain = memory_planner.plan_memory(LLAMA_8B, run)
    lean_run = replace(run, features=memory_planner.MemoryFeatures(tiled_mlp=True, offload=True))
    lean = memory_planner.plan_memory(LLAMA_8B, lean_run)
    for before, after in zip(plain, lean, strict=True):
        offloaded_grads = before.option.offload_optimizer != "none"
        expected = memory_planner.activation_bytes(LLAMA_8B, lean_run, before.option.stage, None, offloaded_grads)[1]
        assert after.activations_checkpointed == expected < before.activations_checkpointed
        offloaded = 8 * 32 * 2 * (131072 / 8) * 4096  # 8 GPUs, 32 layers' inputs of 16K tokens each, bf16
        assert after.host_per_node - before.host_per_node == pytest.approx(offloaded)
    header = plan_report.render_memory_plan(
        lean, shape=LLAMA_8B, run=lean_run, gpu_memory_gb=80, host_memory_gb=None
    ).splitlines()[0]
    assert header.endswith("micro-batch 1 x 131072 tokens, with tiled MLP and activation offloading, 80 GB per GPU")


def test_the_longest_block_is_the_longest_that_fits():
    from scaletrain.observability.long_context_plan import FEATURE_SETS, GRAIN, longest_block, sequence_degrees

    gpu, chunk = 80 * memory_planner.GIB, memory_planner.auto_loss_chunk(LLAMA_8B.vocab)

    def planned(sp: int, tiled: bool, offload: bool, gpus: int = 8) -> Run:
        features = memory_planner.MemoryFeatures(tiled_mlp=tiled, offload=offload)
        parallel = ParallelLayout.of_world(gpus, sp=sp)
        return Run(gpus_per_node=gpus, parallel=parallel, precision="bf16", loss_chunk=chunk, features=features)

    def longest(sp: int, tiled: bool, offload: bool, host=None, gpus: int = 8) -> tuple:
        return longest_block(LLAMA_8B, planned(sp, tiled, offload, gpus), gpu, host)

    lengths = [longest(8, tiled, offload)[0] for _, tiled, offload in FEATURE_SETS]
    assert lengths[0] < lengths[1] < lengths[2]  # each feature makes room
    tokens, host, option = longest(8, True, True)
    assert option.name == "ZeRO-3 + optimizer and parameter offload (CPU)"  # the leanest option SP runs
    working = memory_planner.activation_bytes(LLAMA_8B, replace(planned(8, True, True), block_size=tokens), 3)[1]
    more = memory_planner.activation_bytes(LLAMA_8B, replace(planned(8, True, True), block_size=tokens + GRAIN), 3)[1]
    assert working <= memory_planner.HEADROOM * gpu < more  # the states are offloaded: the working memory decides
    assert host == 32 * tokens / 8 * 4096 * 2  # every layer's input for this GPU's tokens, in bf16
    assert 7.5 < tokens / longest(1, True, True, gpus=1)[0] <= 8.1  # SP 8 holds about 8 times the tokens of one GPU
    capped = longest(8, True, True, host=1000 * memory_planner.GIB)
    assert capped[0] < tokens and capped[1] * 8 <= 0.9 * 1000 * memory_planner.GIB  # the host binds offloading
    assert sequence_degrees(LLAMA_8B, 64) == [1, 32]  # 64 GPUs: Ulysses stops at the 32 query heads
    # 12 heads, 4 KV heads on 24 GPUs: 12 (KV heads repeated 3 times); 6 neither divides nor is a multiple of 4
    assert sequence_degrees(memory_planner.ModelShape(1, 1, 1, 64, 64, 64, kv_heads=4, heads=12), 24) == [1, 12]


@pytest.mark.slow  # over 10 s: a real run (the fast tier stays under 3 minutes)
def test_plan_recommends_tensor_parallelism_inside_a_node_before_offload(tmp_path):
    """A 70B Llama on 4 nodes x 8 GPUs of 80 GB, 4096 tokens per micro-batch: ZeRO-1/2 hold the whole weights and
    do not fit; ZeRO-3 (with checkpointing) does, and comes first; with --tensor_parallel_size 8 the plan is the TP
    layout's (ZeRO-1/2/3, no offload: AutoTP with offload is refused), and its recommendation names the size
    (BENCHMARKS.md, "--plan for a 70B Llama on 4 nodes x 8 GPUs of 80 GB")."""
    model = tmp_path / "llama70b"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 8192,
                "intermediate_size": 28672,
                "num_hidden_layers": 80,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "max_position_embeddings": 8192,
                "tie_word_embeddings": False,
                "bos_token_id": 0,
                "eos_token_id": 1,
            }
        )
    )

    def plan(*extra):
        proc = subprocess.run(
            [
                sys.executable,
                "train.py",
                "--plan",
                "--num_gpus",
                "8",
                "--num_nodes",
                "4",
                "--gpu_memory_gb",
                "80",
                "--config_name",
                str(model),
                "--tokenizer_name",
                str(TINY),
                "--per_device_train_batch_size",
                "1",
                "--block_size",
                "4096",
                *extra,
            ],
            cwd=REPO,
            env=child_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        check_ok(proc)
        return proc.stdout[proc.stdout.index("memory plan:") : proc.stdout.index("time plan:")].strip().splitlines()

    plain = plan()
    assert plain[-2].startswith("memory plan's choice: --config ds_configs/zero3.json --gradient_checkpointing")
    # asynchronous saves: each rank's 1/32 of 70.6B x 12 bytes (24.6 GiB) under ZeRO-3, plus the bf16 weights on rank 0
    assert re.search(r"up to 156\.\d\d GiB under ZeRO-0/1/2 .*, 24\.6\d GiB under ZeRO-3; x 8 ranks", plain[-1])
    tensor_parallel = plan("--tensor_parallel_size", "8")
    assert "32 ranks: tensor parallel 8 x 4 data-parallel" in tensor_parallel[0]
    rows = [line for line in tensor_parallel if line.startswith("| ZeRO")]
    assert [row.split(" | ")[0] for row in rows] == ["| ZeRO-1", "| ZeRO-2", "| ZeRO-3"]
    # ZeRO-3 fits without activation checkpointing (the memory plan's first try), ZeRO-1 with it: the chunked loss
    # holds a chunk of each rank's 16,032 rows of the head (84 MB), not the 5.3 GB of whole logits AutoTP's head
    # would gather
    assert tensor_parallel[-2].startswith(
        "memory plan's choice: --config ds_configs/zero3.json --tensor_parallel_size 8 (ZeRO-3:"
    )
    assert rows[0].split(" | ")[-2] == "no / yes"
    # without ZeRO-3 the open layout goes to tensor parallelism (the smallest size that fits) before any offload
    from transformers import AutoConfig

    from scaletrain.model.build import meta_model

    config = AutoConfig.from_pretrained(model)
    shape = memory_planner.ModelShape.from_meta_model(meta_model(config, False), config)
    assert shape.kv_heads == 8 and shape.linear_params > 0.98 * shape.n_params
    run = data_parallel_run(gpus_per_node=8, nodes=4, micro_batch=1, block_size=4096, precision="bf16")
    tp, pp, est, _ = memory_planner.recommend_layout(shape, run, 75 * memory_planner.GIB, None)
    assert (tp, pp, est.option.stage) == (1, 1, 3)
    no_zero3 = [o for o in memory_planner.OPTIONS if o.stage < 3]
    original = memory_planner.OPTIONS
    try:
        memory_planner.OPTIONS = no_zero3
        tp, pp, est, _ = memory_planner.recommend_layout(shape, run, 80 * memory_planner.GIB, None)
        # a single key/value head (no TP size splits it) and no ZeRO-3: pipeline stages before offload, the fewest
        # that fit (2 and 4 stages leave ZeRO-1's whole weights and gradients of a stage above 72 GB)
        import dataclasses

        single_kv = dataclasses.replace(shape, kv_heads=1)
        tp_staged, pp_staged, staged, _ = memory_planner.recommend_layout(single_kv, run, 80 * memory_planner.GIB, None)
    finally:
        memory_planner.OPTIONS = original
    assert tp == 8 and pp == 1 and est.option.offload_optimizer == "none"
    assert (tp_staged, pp_staged, staged.option.name) == (1, 8, "ZeRO-1")
    # TP 8 inside each node x PP 4 across the nodes
    both = plan("--tensor_parallel_size", "8", "--pipeline_parallel_size", "4")
    assert "32 ranks: tensor parallel 8 x pipeline parallel 4 x 1 data-parallel" in both[0]
    assert [line.split(" | ")[0] for line in both if line.startswith("| ZeRO")] == ["| ZeRO-1"]
    assert not any(line.startswith("planning only:") for line in both)  # TP x PP runs
    assert both[-2].startswith(
        "memory plan's choice: --config ds_configs/zero1.json --tensor_parallel_size 8 --pipeline_parallel_size 4"
    )


def test_plan_flags_are_checked():
    proc = subprocess.run(
        [sys.executable, "train.py", "--plan", "--num_gpus", "0"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2 and "--num_gpus 0: must be at least 1" in proc.stderr
