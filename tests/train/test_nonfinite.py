"""Non-finite loss / gradient norm and loss spikes: a global skip, the ledger, rollback, stop.

Bad batches come from tests/helpers/inject_nonfinite.py, train.py with its loss function wrapped: driven by
SCALETRAIN_TEST_INJECT_NONFINITE, it multiplies one rank's loss at a given data step by NaN (or a factor), so that
rank's gradients go bad too.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from scaletrain.train.nonfinite import SPIKE_WARMUP_STEPS, NonFiniteGuard, NonFinitePolicy, NonFiniteStop
from scaletrain.train.state import TrainState
from tests.harness import FAST_FLAGS, REPO, check_ok, launch, read_metrics
from tests.helpers.wandb_records import run_end

TRAIN = REPO / "train.py"
INJECTING = REPO / "tests" / "helpers" / "inject_nonfinite.py"  # train.py plus the bad losses INJECT asks for
INJECT = "SCALETRAIN_TEST_INJECT_NONFINITE"


def ledger(run_dir: Path) -> list:
    path = run_dir / "nonfinite_ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def step_records(run_dir: Path) -> dict:
    records = [r for r in read_metrics(run_dir) if "tokens_per_s" in r]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r for r in records}


def fp32_weights(ckpt: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)


def global_samples(step: int, global_batch: int) -> list:
    """The sample ids the pipeline's global order gives a data step (1-based), computed independently here."""
    import numpy as np

    from scaletrain.data.sampling import GlobalOrder

    order = GlobalOrder(n_blocks=3484, micro_batch=4, accumulation=1, dp_world_size=global_batch // 4, seed=42)
    permutation = np.random.default_rng([42, 0]).permutation(3484)
    return [int(i) for i in order.global_batch_indices(step - 1, permutation)]


# --- the policy itself, in-process -----------------------------------------------------------------------------


def guard(action="skip", limit=3, spike=0.0, fp16=False, tmp_path=None) -> NonFiniteGuard:
    return NonFiniteGuard(
        NonFinitePolicy(action, limit, spike, fp16), TrainState(), str(tmp_path or "."), is_main=tmp_path is not None
    )


def test_judge_flags_nonfinite_and_spikes_only_after_the_running_mean_warms_up(tmp_path):
    g = guard(spike=3.0, tmp_path=tmp_path)
    assert g.judge(float("nan")) == "nonfinite_loss" and g.judge(float("inf")) == "nonfinite_loss"
    assert g.judge(100.0) is None  # no running mean yet
    for step in range(1, SPIKE_WARMUP_STEPS + 1):
        assert g.after_step(step, global_loss=2.0, forced=None, applied=True, sample_ids=list) == "ok"
    assert g.loss_mean == pytest.approx(2.0)
    assert g.judge(5.9) is None and g.judge(6.1) == "loss_spike"
    assert guard(spike=0.0).judge(1e9) is None  # spike detection off


def test_skips_count_in_a_row_then_ask_for_rollback_and_land_in_the_ledger(tmp_path):
    g = guard(limit=3, tmp_path=tmp_path)
    assert (
        g.after_step(1, global_loss=float("nan"), forced="nonfinite_loss", applied=False, sample_ids=lambda: [7, 9])
        == "skipped"
    )
    assert (
        g.after_step(2, global_loss=4.0, forced=None, applied=True, sample_ids=list) == "ok"
    )  # an applied step breaks the streak
    assert (
        g.after_step(3, global_loss=float("nan"), forced="nonfinite_loss", applied=False, sample_ids=lambda: [1])
        == "skipped"
    )
    assert (
        g.after_step(4, global_loss=4.0, forced=None, applied=False, sample_ids=lambda: [2]) == "skipped"
    )  # DeepSpeed refused: grad norm
    assert (
        g.after_step(5, global_loss=float("nan"), forced="nonfinite_loss", applied=False, sample_ids=lambda: [3])
        == "rollback"
    )
    entries = ledger(tmp_path)
    assert [e["step"] for e in entries] == [1, 3, 4, 5]
    assert entries[0]["samples"] == [7, 9] and entries[0]["loss"] == "nan"
    assert entries[2]["reason"] == "nonfinite_grad_norm" and entries[3]["consecutive"] == 3


def test_fp16_overflow_is_the_loss_scalers_business_and_stop_raises(tmp_path):
    assert (
        guard(fp16=True).after_step(1, global_loss=3.0, forced=None, applied=False, sample_ids=list) == "ok"
    )  # a loss-scale overflow, not a failure
    with pytest.raises(NonFiniteStop, match=r"step 4: nonfinite loss .* samples \[5, 6\]; stopped \(--on_nonfinite"):
        guard(action="stop", tmp_path=tmp_path).after_step(
            4, global_loss=float("nan"), forced="nonfinite_loss", applied=False, sample_ids=lambda: [5, 6]
        )
    assert ledger(tmp_path)[0]["step"] == 4


# --- real runs: 2 ranks, real DeepSpeed engines ----------------------------------------------------------------


@pytest.mark.slow
# zero2: the rollback test; zero1 (stage_1_and_2.py, as zero2) left out for CI's budget; zero2_offload in the
# extended run only (CPU offload is in CI with zero3_offload)
@pytest.mark.parametrize(
    "ds_config", ["zero3", pytest.param("zero2_offload", marks=pytest.mark.extended), "zero3_offload"]
)
def test_a_nan_on_one_rank_skips_the_update_on_every_rank(ds_config, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    proc = launch(
        INJECTING,
        [
            "--config",
            f"ds_configs/{ds_config}.json",
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "5",
            "--save_steps",
            "4",
            "--logging_steps",
            "1",
            "--no-export_hf_at_end",
            *FAST_FLAGS[:-3],
            "--disable_tqdm",
        ],
        "deepspeed",
        cache_dir,
        nprocs=2,
        env={INJECT: "1:5"},
    )  # rank 1's loss at step 5 only
    check_ok(proc)
    [entry] = ledger(run_dir)
    assert (entry["step"], entry["reason"], entry["event"]) == (5, "nonfinite_loss", "skipped")
    assert entry["samples"] == global_samples(5, global_batch=8)
    records = step_records(run_dir)
    assert sorted(records) == [1, 2, 3, 4, 5]
    assert records[5]["skipped"] == 1 and records[5]["skipped_steps"] == 1 and "loss" not in records[5]
    assert records[5]["lr"] == records[4]["lr"] != records[3]["lr"]  # the schedule did not advance
    assert records[5]["tokens_seen"] == records[4]["tokens_seen"]
    # The skipped step changed no weight, on any rank's shard: step 4 and step 5 checkpoints hold the same model.
    before, after = fp32_weights(run_dir / "checkpoints" / "step4"), fp32_weights(run_dir / "checkpoints" / "step5")
    for name, tensor in after.items():
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, before[name]), f"{name} changed in a skipped step"
    assert not (run_dir / "model.safetensors").exists()  # --no-export_hf_at_end


@pytest.mark.slow
def test_consecutive_skips_roll_back_past_the_bad_samples_and_resume_keeps_the_offset(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    args = [
        "--config",
        "ds_configs/zero2.json",
        "--max_steps",
        "10",
        "--save_steps",
        "4",
        "--logging_steps",
        "1",
        "--max_consecutive_skips",
        "3",
        "--no-export_hf_at_end",
        *FAST_FLAGS[:-3],
        "--disable_tqdm",
    ]
    check_ok(
        launch(
            INJECTING, ["--output_dir", str(run_dir), *args], "deepspeed", cache_dir, nprocs=2, env={INJECT: "0:5,6,7"}
        )
    )
    entries = ledger(run_dir)
    assert [(e["event"], e["step"]) for e in entries] == [
        ("skipped", 5),
        ("skipped", 6),
        ("skipped", 7),
        ("rollback", 7),
    ]
    assert entries[3]["to_step"] == 4 and entries[3]["data_offset"] == 3
    records = step_records(run_dir)
    assert sorted(records) == list(range(1, 11))  # every step exactly once, the rolled-back ones replaced
    assert all(math.isfinite(r["loss"]) and r["skipped"] == 0 for r in records.values())
    state = json.loads((run_dir / "checkpoints" / "step10" / "train_state.json").read_text())
    assert state["data_offset"] == 3 and state["samples_seen"] == 13 * 8  # the data moved past steps 5-7
    # The guard's running mean travels beside the train state (its own state, carried by the checkpoint manager):
    # 10 applied steps, the skipped ones not counted; no wandb here, so no run id.
    assert state["loss_mean_steps"] == 10 and state["loss_mean"] > 0 and state["wandb_run_id"] is None
    for name, tensor in fp32_weights(run_dir / "checkpoints" / "step10").items():
        assert torch.isfinite(tensor).all(), name

    # A restart from step 8 (after the rollback) reads the same data: the offset is part of the saved state. Its
    # step 10 is saved again (the copy's is removed): the guard's running mean was restored with step 8's checkpoint.
    again = tmp_path / "again"
    shutil.copytree(run_dir, again)
    shutil.rmtree(again / "checkpoints" / "step10")
    check_ok(
        launch(
            TRAIN,
            ["--output_dir", str(again), "--resume_from_checkpoint", str(again / "checkpoints" / "step8"), *args],
            "deepspeed",
            cache_dir,
            nprocs=2,
        )
    )
    resumed = step_records(again)
    for step in (9, 10):
        assert resumed[step]["loss"] == pytest.approx(records[step]["loss"], rel=1e-6, abs=0)
    again_state = json.loads((again / "checkpoints" / "step10" / "train_state.json").read_text())
    assert again_state["loss_mean_steps"] == 10  # 8 restored + 2 (a guard that started afresh would count 2)
    assert again_state["loss_mean"] == pytest.approx(state["loss_mean"], rel=1e-6)


@pytest.mark.slow
def test_a_loss_spike_is_skipped_and_stop_ends_the_run_with_its_code(tmp_path, cache_dir):
    run_dir = tmp_path / "spike"
    check_ok(
        launch(
            INJECTING,
            [
                "--config",
                "ds_configs/zero1.json",
                "--output_dir",
                str(run_dir),
                "--max_steps",
                "13",
                "--loss_spike_factor",
                "3",
                "--logging_steps",
                "1",
                *FAST_FLAGS[:-3],
                "--disable_tqdm",
            ],
            "python",
            cache_dir,
            env={INJECT: "0:12x50"},
        )
    )
    [entry] = ledger(run_dir)
    assert (entry["step"], entry["reason"]) == (12, "loss_spike") and entry["loss"] > 3 * entry["running_mean_loss"]
    assert step_records(run_dir)[12]["skipped"] == 1
    assert (run_dir / "model.safetensors").exists()  # exported at the end by default

    stopped = tmp_path / "stop"
    proc = launch(
        INJECTING,
        [
            "--config",
            "ds_configs/zero2.json",
            "--output_dir",
            str(stopped),
            "--max_steps",
            "6",
            "--on_nonfinite",
            "stop",
            "--report_to",
            "wandb",
            *FAST_FLAGS,
        ],
        "deepspeed",
        cache_dir,
        nprocs=2,
        env={INJECT: "1:3"},
    )
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert run_end(stopped) == (3, False)  # wandb shows the stopped run as failed, not finished
    assert proc.stderr.count("train.py: stopped: step 3: nonfinite loss") == 1  # once, from rank 0
    assert "--on_nonfinite skip" in proc.stderr
    assert ledger(stopped)[0]["step"] == 3
    assert not any((stopped / "checkpoints").glob("step*"))  # stopped before any save (no folder counts too)


@pytest.mark.slow
def test_a_nan_on_a_tensor_parallel_rank_skips_the_update_on_every_rank(tmp_path, cache_dir):
    """TP 2: rank 1 (the second rank of the TP group, whose loss is not counted in the reported loss: both ranks
    compute the same one) sees a NaN; every rank skips, and neither rank's weight shard changes."""
    run_dir = tmp_path / "run"
    proc = launch(
        INJECTING,
        [
            "--config",
            "ds_configs/zero1.json",
            "--output_dir",
            str(run_dir),
            "--tensor_parallel_size",
            "2",
            "--max_steps",
            "5",
            "--save_steps",
            "4",
            "--logging_steps",
            "1",
            "--no-export_hf_at_end",
            *FAST_FLAGS[:-3],
            "--disable_tqdm",
        ],
        "deepspeed",
        cache_dir,
        nprocs=2,
        env={INJECT: "1:5"},
    )
    check_ok(proc)
    [entry] = ledger(run_dir)
    assert (entry["step"], entry["reason"], entry["event"]) == (5, "nonfinite_loss", "skipped")
    records = step_records(run_dir)
    assert records[5]["skipped"] == 1 and "loss" not in records[5] and records[5]["lr"] == records[4]["lr"]
    for tp_rank in (0, 1):  # each TP rank's shard, as its engine saved it
        name = f"mp_rank_0{tp_rank}_model_states.pt"
        before = torch.load(run_dir / "checkpoints" / "step4" / name, weights_only=False)["module"]
        after = torch.load(run_dir / "checkpoints" / "step5" / name, weights_only=False)["module"]
        assert before.keys() == after.keys()
        for key, tensor in after.items():
            assert torch.isfinite(tensor).all() and torch.equal(tensor, before[key]), f"{name}: {key} changed"
