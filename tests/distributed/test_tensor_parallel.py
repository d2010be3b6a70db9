"""Tensor parallelism (--tensor_parallel_size, DeepSpeed AutoTP) against a single-rank run of the same global batch.

Real runs of train.py on gloo CPU ranks, fp32, the tiny Llama, clipping that acts (--max_grad_norm below the
gradient norms): per-step losses within 1e-5 relative over 8 steps, the Hugging Face export holds the full weights
(gathered from the TP shards) and equals the reference's, MFU counts the model's FLOPs once per device, a resume on
the same layout and on one rank (through DeepSpeed's universal checkpoint) continues exactly; and the layouts that
are not supported stop before anything is built.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from scaletrain.config.slices import ParallelArgs
from scaletrain.parts import DistInfo, ParallelLayout
from scaletrain.errors import UsageError
from scaletrain.config import assemble_ds_config
from scaletrain.distributed.layout import apply_layout, check_model_layout, layout_ds_keys
from tests.harness import LAYOUT_STEPS, REPO, check_ok, launch, layout_flags, read_metrics

STEPS = LAYOUT_STEPS
_flags = layout_flags


def _records(run_dir: Path) -> dict:
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


def _relative_difference(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.fixture
def reference(layout_reference) -> Path:
    return layout_reference


@pytest.fixture(scope="module")
def tp2_zero1(tmp_path_factory, cache_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("tp") / "tp2_zero1"
    # The loss in chunks of 96 of each rank's 256 tokens (the last one short) over its half of the vocabulary.
    flags = _flags(run_dir, "zero1", "--tensor_parallel_size", "2", "--loss_chunk_size", "96")
    proc = launch(REPO / "train.py", flags, "deepspeed", cache_dir, nprocs=2)
    check_ok(proc)
    # The group and its host: both ranks on this machine, so the cross-node check lets it run.
    assert f"layout: tensor parallel 2 x data parallel 1; tensor groups 0-1@{socket.gethostname()}" in proc.stdout
    assert "loss: through the LM head in chunks of 96 tokens, over this rank's 2048 rows of the vocabulary" in (
        proc.stdout + proc.stderr
    )
    return run_dir


@pytest.fixture(scope="module")
def tp2_zero3(tmp_path_factory, cache_dir) -> Path:
    """TP 2 x DP 2 under ZeRO-3, 4 ranks."""
    run_dir = tmp_path_factory.mktemp("tp") / "tp2_zero3"
    flags = _flags(run_dir, "zero3", "--tensor_parallel_size", "2", "--per_device_train_batch_size", "2")
    proc = launch(REPO / "train.py", flags, "deepspeed", cache_dir, nprocs=4)
    check_ok(proc)
    assert "layout: tensor parallel 2 x data parallel 2" in proc.stdout + proc.stderr
    return run_dir


def _assert_matches(run_dir: Path, reference: Path, steps=range(1, STEPS + 1)) -> None:
    expected, got = _records(reference), _records(run_dir)
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-4), step


def _assert_same_export(run_dir: Path, reference: Path) -> None:
    from transformers import AutoModelForCausalLM

    got, expected = _weights(run_dir), _weights(reference)
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].shape == expected[name].shape, name  # whole tensors, not one rank's shard
        assert _relative_difference(got[name], expected[name]) < 1e-4, name
    AutoModelForCausalLM.from_pretrained(run_dir)  # a folder Hugging Face loads as it is


@pytest.mark.slow  # a 1-rank reference, a 2-rank run and two 4-rank runs of 8 steps
# (TP 2 under ZeRO-2 was dropped to keep CI in its budget: ZeRO-1 and -2 are one optimizer in DeepSpeed)
# TP 2 x DP 2 under ZeRO-1 runs in the extended tier (CI's budget): TP x PP x DP and TP x SP x DP run it composed
@pytest.mark.parametrize(
    "config,nprocs", [("zero1", 2), pytest.param("zero1", 4, marks=pytest.mark.extended), ("zero3", 4)]
)
def test_tensor_parallel_matches_one_rank(config, nprocs, reference, tp2_zero1, tp2_zero3, tmp_path, cache_dir):
    """TP 2 alone, and TP 2 x DP 2 (4 ranks: each TP group reads half of the global batch of 4) under ZeRO-1 and
    ZeRO-3 (AutoTP shards the whole weights, then ZeRO-3 partitions each shard over the data-parallel ranks)."""
    if (config, nprocs) in (("zero1", 2), ("zero3", 4)):
        run_dir = tp2_zero1 if config == "zero1" else tp2_zero3
    else:
        run_dir = tmp_path / "tp2"
        proc = launch(
            REPO / "train.py",
            _flags(run_dir, config, "--tensor_parallel_size", "2", "--per_device_train_batch_size", str(8 // nprocs)),
            "deepspeed",
            cache_dir,
            nprocs=nprocs,
        )
        check_ok(proc)
        assert f"layout: tensor parallel 2 x data parallel {nprocs // 2}" in proc.stdout + proc.stderr
    _assert_matches(run_dir, reference)
    _assert_same_export(run_dir, reference)
    # MFU counts the model's FLOPs once: tokens/s x FLOPs per token over both devices, not once per TP rank.
    record = _records(run_dir)[STEPS]
    reference_record = _records(reference)[STEPS]
    flops_per_token = reference_record["tflops_per_device"] * 1e12 / reference_record["tokens_per_s"]
    assert record["tflops_per_device"] == pytest.approx(
        record["tokens_per_s"] * flops_per_token / nprocs / 1e12, rel=1e-6
    )


def resume_copy_at_step4(
    source: Path,
    run_dir: Path,
    layout: list,
    nprocs: int,
    cache_dir: Path,
    converted: bool | None = None,
    config: str = "zero1",
) -> None:
    """Resume a copy of `source`'s run folder from its step-4 checkpoint to the end, with `layout`'s flags on
    `nprocs` ranks: it says where it resumed from, and goes through the universal checkpoint exactly when the
    layout changed (`converted`; by default: on 1 rank)."""
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step4", run_dir / "checkpoints" / "step4")
    for name in ("run_config.json", "ds_config.json"):
        shutil.copy(source / name, run_dir / name)
    proc = launch(
        REPO / "train.py",
        _flags(run_dir, config, *layout),
        "deepspeed" if nprocs > 1 else "python",
        cache_dir,
        nprocs=nprocs,
    )
    check_ok(proc)
    output = proc.stdout + proc.stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'step4'} (step 4," in output
    converted = nprocs == 1 if converted is None else converted
    assert ("converted" in output) == converted  # another layout goes through the universal checkpoint


@pytest.mark.slow  # two runs resumed from the TP checkpoint at step 4: on 2 ranks (TP 2) and on 1 rank
@pytest.mark.parametrize("nprocs", [2, 1])
def test_a_tensor_parallel_checkpoint_resumes_on_the_same_layout_and_on_one_rank(
    nprocs, reference, tp2_zero1, tmp_path, cache_dir
):
    run_dir = tmp_path / "resumed"
    resume_copy_at_step4(tp2_zero1, run_dir, ["--tensor_parallel_size", "2"] if nprocs == 2 else [], nprocs, cache_dir)
    _assert_matches(run_dir, reference, steps=range(5, STEPS + 1))
    _assert_same_export(run_dir, reference)


@pytest.mark.slow  # runs resumed from the TP 2 x DP 2 ZeRO-3 checkpoint at step 4: on 1 rank (through the universal
# checkpoint) and, in the extended tier (CI's budget; TP 2 under ZeRO-1 resumes on its own layout in CI), on 4 ranks
@pytest.mark.parametrize("nprocs", [pytest.param(4, marks=pytest.mark.extended), 1])
def test_a_tensor_parallel_zero3_checkpoint_resumes_on_the_same_layout_and_on_one_rank(
    nprocs, reference, tp2_zero3, tmp_path, cache_dir
):
    run_dir = tmp_path / "resumed"
    layout = ["--tensor_parallel_size", "2", "--per_device_train_batch_size", "2"] if nprocs == 4 else []
    resume_copy_at_step4(tp2_zero3, run_dir, layout, nprocs, cache_dir, config="zero3")
    _assert_matches(run_dir, reference, steps=range(5, STEPS + 1))
    _assert_same_export(run_dir, reference)


# --- refused before anything is built ----------------------------------------------------------------------------


def _tiny_llama_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")


def test_the_world_must_split_into_tensor_parallel_groups():
    dist = DistInfo.launched(rank=5, local_rank=1, world_size=6, launcher="srun")
    placed = apply_layout(ParallelArgs(tensor_parallel_size=2), dist)
    assert (placed.layout.dp, placed.coords.dp, placed.coords.tp) == (3, 2, 1)  # consecutive ranks per TP group
    with pytest.raises(UsageError, match="--tensor_parallel_size 4 does not divide the world size 6"):
        apply_layout(ParallelArgs(tensor_parallel_size=4), dist)


def test_the_model_must_split_evenly():
    config = _tiny_llama_config()  # 4 attention heads, 2 key/value heads, MLP 352, vocabulary 4096
    check_model_layout(ParallelLayout(tp=2), config)
    with pytest.raises(UsageError, match=r"the model's 2 key/value heads \(num_key_value_heads\) do not split"):
        check_model_layout(ParallelLayout(tp=4), config)
    with pytest.raises(UsageError, match=r"the model's 4 attention heads \(num_attention_heads\) do not split"):
        check_model_layout(ParallelLayout(tp=3), config)


def _resolved(config: dict):
    from scaletrain.config.deepspeed_json import ResolvedDSConfig

    return ResolvedDSConfig(config, {}, "fp32", "test")


@pytest.mark.parametrize(
    "config,message",
    [
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "with offload"),
        (
            {"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 4}},
            "tensor_parallel.autotp_size 4 in x.json contradicts --tensor_parallel_size 2",
        ),
        (
            {"zero_optimization": {"stage": 1}, "tensor_parallel": {"vocab_parallel_lm_head": True}},
            "tensor_parallel.vocab_parallel_lm_head in x.json",
        ),
    ],
)
def test_unsupported_combinations_are_refused_with_the_reason(config, message):
    with pytest.raises(UsageError, match=message):
        layout_ds_keys(ParallelLayout(tp=2), _resolved(config), "x.json")


def test_the_layout_is_written_into_the_deepspeed_config():
    given = _resolved({"zero_optimization": {"stage": 2}})
    ds = assemble_ds_config(given, layout_ds_keys(ParallelLayout(tp=2), given, "x.json"))
    assert "tensor_parallel" not in given.config  # a new value: the one given is left as it was
    assert ds.config["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    assert ds.sources["tensor_parallel.autotp_size"] == "--tensor_parallel_size"
    untouched = _resolved({"zero_optimization": {"stage": 3}})
    assert layout_ds_keys(ParallelLayout(tp=1), untouched, "x.json") == ()


@pytest.mark.slow  # needs the 2-rank TP checkpoint
def test_export_script_refuses_a_tensor_parallel_checkpoint_with_a_way_out(tp2_zero1, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "export_hf.py"),
            str(tp2_zero1 / "checkpoints" / "step4"),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr
    assert "saved with tensor parallelism 2" in proc.stderr and "resume it on one rank" in proc.stderr
    assert not (tmp_path / "out").exists()
