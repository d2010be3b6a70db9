"""Pipeline parallelism (--pipeline_parallel_size, deepspeed.pipe) against a single-rank run of the same global batch.

Real runs of train.py on gloo CPU ranks, fp32, clipping that acts: the tiny Llama cut into 2 stages with ZeRO-1
(activation checkpointing on, 2 micro-batches per step through the 1F1B schedule), with ZeRO-0 (whose clipping
DeepSpeed 0.19.8 gets wrong under a pipeline: the fix is checked, and so is that it is still needed), and as 2
stages x 2 data-parallel replicas on 4 ranks; a tiny GPT-2 (learned positions, tied embeddings); per-step losses
within 1e-5 relative and gradient norms within 1e-4 over 8 steps, the Hugging Face export equal to the reference's,
a resume on the same layout and on one rank (universal checkpoint, renamed to the model's parameter names), a NaN
on the last stage skipping every stage's update; and what is refused before anything is built.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.data import IGNORE_INDEX
from scaletrain.config.slices import ParallelArgs
from scaletrain.config.cli import parse_run_config
from scaletrain.parts import DistInfo, ParallelLayout
from scaletrain.errors import UsageError
from scaletrain.distributed.layout import apply_layout, check_pipeline_run, layout_ds_keys
from scaletrain.distributed.pipeline import check_pipeline_model, hf_parameter_name
from scaletrain.observability.calibration import PROBE_FILE
from tests.harness import LAYOUT_STEPS as STEPS, REPO, check_ok, launch, layout_flags, read_metrics
from tests.distributed.test_tensor_parallel import (
    _assert_matches,
    _assert_same_export,
    _records,
    _resolved,
    _relative_difference,
    resume_copy_at_step4,
)

PP = ["--pipeline_parallel_size", "2"]
# 2 micro-batches of 2 blocks per step: the schedule interleaves them; the global batch stays the reference's 4.
TWO_MICRO = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]


def _zero0_config(folder: Path) -> Path:
    config = json.loads((REPO / "ds_configs" / "zero1.json").read_text())
    config["zero_optimization"] = {"stage": 0}
    path = folder / "zero0.json"
    path.write_text(json.dumps(config))
    return path


def _eval_losses(run_dir: Path) -> dict:
    return {r["step"]: r["eval_loss"] for r in read_metrics(run_dir) if "eval_loss" in r}


def _flags(run_dir: Path, config, *extra: str) -> list:
    args = layout_flags(run_dir, "zero1", *extra)
    args[args.index("--config") + 1] = str(config) if isinstance(config, Path) else f"ds_configs/{config}.json"
    return args


@pytest.fixture(scope="module")
def pp2_zero1(tmp_path_factory, cache_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("pp") / "pp2_zero1"
    proc = launch(
        REPO / "train.py",
        _flags(run_dir, "zero1", *PP, *TWO_MICRO, "--gradient_checkpointing"),
        "deepspeed",
        cache_dir,
        nprocs=2,
    )
    check_ok(proc)
    output = proc.stdout + proc.stderr
    assert "layout: pipeline parallel 2 x data parallel 1" in output
    # balanced by parameters: the embedding and the head weigh the same here, so 2 decoder layers each
    assert (
        "pipeline stages (--pipeline_partition parameters): stage 0: embedding + 2 decoder layers (0.89M "
        "parameters); stage 1: 2 decoder layers + norm + head (0.89M parameters)"
    ) in output
    return run_dir


@pytest.mark.slow  # three pipeline runs of 8 steps (2, 2 and 4 ranks) against the shared 1-rank reference
# PP 2 x DP 2 is extended (CI's budget): test_composed_layouts.py runs the stages' data-parallel replicas in
# TP 2 x PP 2 x DP 2.
@pytest.mark.parametrize("stage,nprocs", [(1, 2), (0, 2), pytest.param(1, 4, marks=pytest.mark.extended)])
def test_pipeline_parallel_matches_one_rank(stage, nprocs, layout_reference, pp2_zero1, tmp_path, cache_dir):
    """PP 2 with ZeRO-1 (activation checkpointing), with ZeRO-0, and PP 2 x DP 2 (each replica reads half the
    global batch of 4, as 2 micro-batches of 1)."""
    if (stage, nprocs) == (1, 2):
        run_dir = pp2_zero1
    else:
        run_dir = tmp_path / "pp2"
        micro = (
            TWO_MICRO if nprocs == 2 else ["--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2"]
        )
        config = _zero0_config(tmp_path) if stage == 0 else "zero1"
        proc = launch(REPO / "train.py", _flags(run_dir, config, *PP, *micro), "deepspeed", cache_dir, nprocs=nprocs)
        check_ok(proc)
        assert f"layout: pipeline parallel 2 x data parallel {nprocs // 2}" in proc.stdout + proc.stderr
    _assert_matches(run_dir, layout_reference)
    _assert_same_export(run_dir, layout_reference)
    assert _eval_losses(run_dir) == pytest.approx(_eval_losses(layout_reference), rel=1e-5)  # the pipe's inference
    # MFU counts the model's FLOPs once, over every device (each stage does part of the work).
    record, reference_record = _records(run_dir)[STEPS], _records(layout_reference)[STEPS]
    flops_per_token = reference_record["tflops_per_device"] * 1e12 / reference_record["tokens_per_s"]
    assert record["tflops_per_device"] == pytest.approx(
        record["tokens_per_s"] * flops_per_token / nprocs / 1e12, rel=1e-6
    )
    assert record["pipeline_s"] > 0 and record["forward_s"] == 0  # the schedule's time is one phase


@pytest.mark.slow  # one 2-rank ZeRO-0 run with DeepSpeed's own pipeline clipping
def test_deepspeed_still_clips_every_stage_by_stage_0s_norm(layout_reference, tmp_path, cache_dir):
    """The ZeRO-0 fix is still needed: without it the run leaves the reference once the clipping acts. When an
    upgrade fixes DeepSpeed this fails; then drop ds_internals.fix_pipeline_stage0_clipping."""
    run_dir = tmp_path / "unfixed"
    check_ok(
        launch(
            REPO / "tests" / "helpers" / "deepspeed_pipeline_clipping.py",
            _flags(run_dir, _zero0_config(tmp_path), *PP, *TWO_MICRO),
            "deepspeed",
            cache_dir,
            nprocs=2,
        )
    )
    expected, got = _records(layout_reference), _records(run_dir)
    worst = max(abs(got[s]["loss"] - expected[s]["loss"]) / expected[s]["loss"] for s in range(1, STEPS + 1))
    assert worst > 1e-4, f"DeepSpeed's own ZeRO-0 pipeline clipping now matches one rank ({worst:.1e})"


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> Path:
    """GPT-2 without dropout (the reference and the pipeline must draw nothing at random): learned positions and
    tied embeddings, the tiny Llama's tokenizer."""
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("gpt2") / "config"
    GPT2Config(
        vocab_size=4096,
        n_positions=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=1,
    ).save_pretrained(folder)
    return folder


@pytest.mark.slow  # a 1-rank and a 2-rank GPT-2 run of 8 steps
def test_a_gpt2_pipeline_with_tied_embeddings_matches_one_rank(tiny_gpt2, tmp_path, cache_dir):
    from transformers import AutoModelForCausalLM

    # 30 evaluation blocks in batches of 8: the last one is smaller, a shape the stages must agree on anew
    model = [
        "--config_name",
        str(tiny_gpt2),
        "--tokenizer_name",
        str(REPO / "data" / "tiny-llama"),
        "--max_eval_samples",
        "30",
    ]
    reference, run_dir = tmp_path / "reference", tmp_path / "pp2"
    check_ok(launch(REPO / "train.py", layout_flags(reference, "zero2", *model), "python", cache_dir))
    proc = launch(
        REPO / "train.py",
        _flags(run_dir, "zero1", *model, *PP, *TWO_MICRO, "--pipeline_partition", "uniform"),
        "deepspeed",
        cache_dir,
        nprocs=2,
    )
    check_ok(proc)
    # uniform: one decoder layer per stage, whatever the embedding (and its tied copy on the last stage) weigh
    output = proc.stdout + proc.stderr
    assert (
        "pipeline stages (--pipeline_partition uniform): stage 0: embedding + positions + 1 decoder layer "
        "(0.33M parameters); stage 1: 1 decoder layer + norm + head (0.05M parameters)"
    ) in output
    _assert_matches(run_dir, reference)
    assert _eval_losses(run_dir) == pytest.approx(_eval_losses(reference), rel=1e-5)
    got = AutoModelForCausalLM.from_pretrained(run_dir).state_dict()
    expected = AutoModelForCausalLM.from_pretrained(reference).state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        assert _relative_difference(got[name], expected[name]) < 1e-4, name
    assert got["lm_head.weight"].data_ptr() == got["transformer.wte.weight"].data_ptr()  # still tied


@pytest.mark.slow  # two runs resumed from the pipeline checkpoint at step 4: on 2 ranks (PP 2) and on 1 rank
@pytest.mark.parametrize("nprocs", [2, 1])
def test_a_pipeline_checkpoint_resumes_on_the_same_layout_and_on_one_rank(
    nprocs, layout_reference, pp2_zero1, tmp_path, cache_dir
):
    run_dir = tmp_path / "resumed"
    resume_copy_at_step4(pp2_zero1, run_dir, [*PP, *TWO_MICRO] if nprocs == 2 else [], nprocs, cache_dir)
    _assert_matches(run_dir, layout_reference, steps=range(5, STEPS + 1))
    _assert_same_export(run_dir, layout_reference)


@pytest.mark.slow  # reads the shared 2-rank pipeline run's records
def test_each_stages_bubble_is_measured_beside_the_schedules(pp2_zero1):
    """Every training record carries each stage's measured bubble (its receives' waits over its passes' time) and
    the 1F1B schedule's (2 - 1) / 2 micro-batches; every stage waits (stage 1 for the fill, stage 0 for the drain);
    the evaluation records carry none."""
    records = read_metrics(pp2_zero1)
    training = [r for r in records if "loss" in r]
    assert len(training) == STEPS
    for record in training:
        assert record["pipeline_bubble_expected"] == 0.5
        assert all(record[f"pipeline_bubble_stage{stage}"] > 0 for stage in (0, 1)), record
    assert not any("pipeline_bubble_stage0" in r for r in records if "eval_loss" in r)
    # the pipe engine's schedule runs whole steps only: no probe of one micro-batch for --plan_calibration
    assert not (pp2_zero1 / PROBE_FILE).exists()


@pytest.mark.slow  # needs the 2-rank pipeline checkpoint
def test_export_script_reads_a_pipeline_checkpoints_layer_files(pp2_zero1, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "export_hf.py"),
            str(pp2_zero1 / "checkpoints" / f"step{STEPS}"),
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported, end_of_run = load_file(str(out / "model.safetensors")), load_file(str(pp2_zero1 / "model.safetensors"))
    assert exported.keys() == end_of_run.keys()
    for name, tensor in end_of_run.items():
        assert exported[name].equal(tensor), name


@pytest.mark.slow  # one 2-rank run of 5 steps with a NaN on the last stage at step 5
def test_a_nan_on_the_last_stage_skips_every_stages_update(tmp_path, cache_dir):
    import torch

    from tests.train.test_nonfinite import INJECT, INJECTING, ledger, step_records

    run_dir = tmp_path / "run"
    args = _flags(run_dir, "zero1", *PP, *TWO_MICRO, "--no-export_hf_at_end")
    args[args.index("--max_steps") + 1] = "5"
    check_ok(launch(INJECTING, args, "deepspeed", cache_dir, nprocs=2, env={INJECT: "1:5"}))
    [entry] = ledger(run_dir)
    assert (entry["step"], entry["reason"], entry["event"]) == (5, "nonfinite_loss", "skipped")
    records = step_records(run_dir)
    assert records[5]["skipped"] == 1 and "loss" not in records[5] and records[5]["lr"] == records[4]["lr"]
    before, after = run_dir / "checkpoints" / "step4", run_dir / "checkpoints" / "step5"
    layer_files = sorted(p.name for p in after.glob("layer_*-model_states.pt"))
    assert len(layer_files) == 4 + 3  # both stages' layers: embedding, 4 decoder layers, norm, head
    for name in layer_files:
        old, new = (torch.load(folder / name, weights_only=True) for folder in (before, after))
        for key, tensor in new.items():
            assert torch.isfinite(tensor).all() and torch.equal(tensor, old[key]), f"{name}: {key} changed"


# --- the pieces, and what is refused before anything is built ---------------------------------------------------


def test_stages_are_consecutive_data_parallel_replicas():
    dist = DistInfo.launched(rank=5, local_rank=1, world_size=8, launcher="srun")
    placed = apply_layout(ParallelArgs(pipeline_parallel_size=2), dist)
    assert (placed.layout.dp, placed.coords.dp, placed.coords.pp) == (4, 1, 1)  # DeepSpeed: rank = stage x dp + d
    with pytest.raises(UsageError, match="--pipeline_parallel_size 3 does not divide the world size 8"):
        apply_layout(ParallelArgs(pipeline_parallel_size=3), dist)


def test_pipeline_parameter_names_map_back_to_the_models():
    places = [
        {"strip": "embedding.", "prefix": "model.embed_tokens."},
        {"strip": "layer.", "prefix": "model.layers.0."},
        {"strip": "norm.", "prefix": "model.norm."},
        {"strip": "", "prefix": None},
    ]
    assert hf_parameter_name("1.layer.self_attn.q_proj.weight", places) == "model.layers.0.self_attn.q_proj.weight"
    assert hf_parameter_name("tied_modules.embedding.embedding.weight", places) == "model.embed_tokens.weight"
    assert hf_parameter_name("2.norm.weight", places) == "model.norm.weight"
    with pytest.raises(ValueError, match="does not map"):
        hf_parameter_name("2.weight", places)


def _tiny(model_type: str, **extra):
    from transformers import AutoConfig

    if model_type == "gpt2":
        return AutoConfig.for_model(
            "gpt2",
            vocab_size=512,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **extra,
        )
    return AutoConfig.for_model(
        model_type,
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        **extra,
    )


@pytest.mark.parametrize(
    "model_type,tied",
    [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False), ("qwen3", False), ("gpt2", True)],
)
def test_the_stages_chained_compute_the_models_own_logits(model_type, tied):
    """Every supported family, in-process: the stage modules built from the layer specs, run one after the other
    (as the pipe engine does across ranks), give the Hugging Face model's logits; the layer map names every
    parameter once."""
    import torch
    from transformers import AutoModelForCausalLM

    from scaletrain.distributed.pipeline import layer_specs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        _tiny(model_type, tie_word_embeddings=tied), attn_implementation="sdpa"
    ).eval()
    specs, places, _ = layer_specs(model)
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        hidden = ids
        built = []
        for spec in specs:
            module = spec.build()
            built.append(module)
            hidden = spec.forward_fn(module, hidden) if getattr(spec, "forward_fn", None) else module(hidden)
        torch.testing.assert_close(hidden, model(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    names = [
        place.prefix + key[len(place.strip) :]
        for module, place in zip(built, places, strict=True)
        if place.prefix is not None
        for key in module.state_dict()
    ]
    assert sorted(names) == sorted(set(names))
    expected = set(model.state_dict()) - ({"lm_head.weight"} if tied else set())
    assert set(names) == expected


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("gpt2", True)])
def test_the_last_stages_chunked_loss_applies_the_head_and_equals_the_whole_logits_loss(model_type, tied):
    """With the chunked loss the last layer passes the hidden states through and TokenLoss applies the head (or the
    tied embedding) 5 tokens at a time: the loss and the head's gradient equal the Hugging Face logits' loss."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from scaletrain.distributed.pipeline import TokenLoss, layer_specs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny(model_type, tie_word_embeddings=tied), attn_implementation="sdpa")
    ids, targets = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    targets[0, 10:] = IGNORE_INDEX
    specs, _, _ = layer_specs(model, head_in_loss=True)
    hidden, built = ids, [spec.build() for spec in specs]
    for spec, module in zip(specs, built, strict=True):
        hidden = spec.forward_fn(module, hidden) if getattr(spec, "forward_fn", None) else module(hidden)
    assert hidden.shape == (2, 16, model.config.hidden_size)  # the hidden states leave the last stage
    loss = TokenLoss(chunk=5)
    loss.head = built[-1].embedding if tied else built[-1].head
    got = loss(hidden, targets)
    [got_grad] = torch.autograd.grad(got, loss.head.weight)
    logits = model(input_ids=ids, use_cache=False).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    [expected_grad] = torch.autograd.grad(expected, model.get_output_embeddings().weight)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_the_model_must_map_onto_stages():
    from transformers import AutoConfig, GPT2Config, GPTNeoXConfig

    llama = AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")  # 4 decoder layers
    check_pipeline_model(2, model_config=llama, attn_implementation="sdpa")
    check_pipeline_model(4, model_config=llama, attn_implementation="flash_attention_2")
    check_pipeline_model(2, model_config=GPT2Config(n_layer=2), attn_implementation="sdpa")
    with pytest.raises(UsageError, match=r"--pipeline_parallel_size 3 does not divide the model's 4 decoder layers"):
        check_pipeline_model(3, model_config=llama, attn_implementation="sdpa")
    with pytest.raises(UsageError, match=r"the model type 'gpt_neox' has no pipeline mapping .*supported: Llama"):
        check_pipeline_model(2, model_config=GPTNeoXConfig(num_hidden_layers=2), attn_implementation="sdpa")
    with pytest.raises(UsageError, match="the model's attention is 'eager'"):
        check_pipeline_model(2, model_config=llama, attn_implementation="eager")
    # a sliding window narrower than the block: the stages attend over the whole block, so it is refused
    windowed = _tiny("mistral", sliding_window=32)
    check_pipeline_model(2, model_config=windowed, attn_implementation="sdpa", block_size=32)
    with pytest.raises(UsageError, match="sliding window of 32 tokens, shorter than the block"):
        check_pipeline_model(2, model_config=windowed, attn_implementation="sdpa", block_size=64)
    check_pipeline_model(
        2,
        model_config=_tiny("qwen2", sliding_window=32, use_sliding_window=False),
        attn_implementation="sdpa",
        block_size=64,
    )


@pytest.mark.parametrize(
    "config,message",
    [
        ({"zero_optimization": {"stage": 2}}, "with ZeRO stage 2 .*supports ZeRO-0 and ZeRO-1 only"),
        ({"zero_optimization": {"stage": 3}}, "with ZeRO stage 3"),
        ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, "with offload"),
        (
            {"zero_optimization": {"stage": 1}, "pipeline": {"stages": 4}},
            "pipeline.stages 4 in x.json contradicts --pipeline_parallel_size 2",
        ),
    ],
)
def test_unsupported_deepspeed_configs_are_refused_with_the_reason(config, message):
    with pytest.raises(UsageError, match=message):
        layout_ds_keys(ParallelLayout(pp=2), _resolved(config), "x.json")


def test_unsupported_run_options_are_refused_with_the_reason():
    pp = ParallelLayout(pp=2)
    check_pipeline_run(pp, attention_isolation=False, precision="fp32", zero_stage=0, config_path="x.json")
    with pytest.raises(UsageError, match="with --attention_isolation: not supported yet"):
        check_pipeline_run(pp, attention_isolation=True, precision="fp32", zero_stage=1, config_path="x.json")
    with pytest.raises(UsageError, match="with ZeRO stage 0 in bf16"):
        check_pipeline_run(pp, attention_isolation=False, precision="bf16", zero_stage=0, config_path="x.json")
    filled = check_pipeline_run(
        pp, attention_isolation=False, precision="fp32", zero_stage=1, config_path="x.json", micro_batches=2
    )
    assert filled is None
    # Fewer micro-batches than stages is valid, only slow: a warning with the predicted bubble and the fix, no error.
    idle = check_pipeline_run(
        pp, attention_isolation=False, precision="fp32", zero_stage=1, config_path="x.json", micro_batches=1
    )
    assert idle is not None
    assert idle.startswith("--pipeline_parallel_size 2 with 1 micro-batch a step (--gradient_accumulation_steps 1)")
    assert "a predicted bubble of 100% of the step's work" in idle
    assert "--gradient_accumulation_steps 8 brings it to 12%" in idle
    quarter = check_pipeline_run(
        ParallelLayout(pp=4), attention_isolation=False, precision="fp32", zero_stage=1, config_path="x.json",
        micro_batches=2,
    )  # fmt: skip
    assert quarter is not None and "micro-batches a step" in quarter and "bubble of 150%" in quarter
    with pytest.raises(UsageError, match="--sequence_parallel_size 2 with --pipeline_parallel_size 2: sequence par"):
        apply_layout(
            parse_run_config(["--sequence_parallel_size", "2", "--pipeline_parallel_size", "2"]).parallel,
            DistInfo.launched(rank=0, local_rank=0, world_size=4, launcher="srun"),
        )


def test_a_bad_pipeline_launch_exits_2_before_anything_is_built(tmp_path, cache_dir):
    """Through train.py: one line, exit 2, the output folder not created."""
    out = tmp_path / "out"
    proc = launch(
        REPO / "train.py", ["--config", "ds_configs/zero2.json", "--output_dir", str(out), *PP], "python", cache_dir
    )
    assert proc.returncode == 2
    assert "--pipeline_parallel_size 2 does not divide the world size 1" in proc.stderr
    assert not out.exists()


@pytest.mark.slow  # a 2-rank dry run
def test_print_config_and_a_dry_run_under_a_pipeline(tmp_path, cache_dir):
    """--print_config with a 2-rank world (as scripts/train.sbatch checks the flags), and --dry_run: one real step
    through both stages, nothing written."""
    out = tmp_path / "out"
    args = ["--config", "ds_configs/zero1.json", "--output_dir", str(out), *PP, *TWO_MICRO]
    shown = launch(
        REPO / "train.py",
        [*args, "--print_config"],
        "python",
        cache_dir,
        env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"},
    )
    check_ok(shown)
    assert "pipeline_parallel_size = 2  <- --pipeline_parallel_size" in shown.stdout
    assert "resolved for 1 data-parallel rank(s)" in shown.stdout
    # The dry run's step with one micro-batch through two stages: valid, only slow (a stage idles the whole step),
    # so it runs, warned once (rank 0) with the predicted bubble.
    one_micro = ["--config", "ds_configs/zero1.json", "--output_dir", str(out), *PP]
    dry = launch(
        REPO / "train.py",
        [*one_micro, "--dry_run", "--block_size", "64", "--disable_tqdm"],
        "deepspeed",
        cache_dir,
        nprocs=2,
    )
    check_ok(dry)
    output = dry.stdout + dry.stderr
    assert "dry run OK: one step" in output
    assert output.count("--pipeline_parallel_size 2 with 1 micro-batch a step") == 1
    assert "a predicted bubble of 100% of the step's work" in output
    assert not out.exists()
