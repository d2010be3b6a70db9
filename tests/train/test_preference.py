"""Preference training (DPO and relatives) on real engines, runs shared by this module's tests (`dpo_runs`): the loss
a mean over the global batch's pairs on any number of ranks and accumulation steps, the reference's log-probs
computed once and reused, LoRA's live reference equal to the precomputed one, a reference model of its own, TRL's
metric names, exact resume after kill -9, and nodes with their own stores. The pairs' store, batches, log-probs,
reference cache and bad inputs, in-process: tests/train/test_preference_pairs.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from scaletrain.train.preference import METRIC_NAMES
from tests.harness import GIVEN_PEAK, REPO, check_ok, freeze, launch, read_metrics, thaw
from tests.helpers import preference_data
from tests.checkpoint.test_checkpoint import latest_step, rank_processes, start, step_losses, wait_for

TINY = REPO / "data" / "tiny-llama"
METRICS = METRIC_NAMES  # TRL's names
STEPS, SAVE_EVERY = 8, 3


def dpo_flags(run_dir: Path, data: Path, *extra: str, config: str = "zero3", micro: int = 4) -> list:
    """`data` holds the pairs (train.jsonl, validation.jsonl) and the starting model (model/)."""
    return [
        "--config",
        f"ds_configs/{config}.json",
        "--model_name_or_path",
        str(data / "model"),
        "--train_file",
        str(data / "train.jsonl"),
        "--validation_file",
        str(data / "validation.jsonl"),
        "--output_dir",
        str(run_dir),
        "--block_size",
        "128",
        "--per_device_train_batch_size",
        str(micro),
        "--per_device_eval_batch_size",
        "4",
        "--learning_rate",
        "5e-4",
        "--max_steps",
        str(STEPS),
        "--logging_steps",
        "1",
        "--eval_steps",
        "4",
        "--save_steps",
        str(SAVE_EVERY),
        "--disable_tqdm",
        *GIVEN_PEAK,
        *extra,
    ]


def save_starting_model(folder: Path, seed: int = 1234) -> None:
    """The tiny Llama with seeded random weights, as from_pretrained reads it: the policy's start and reference."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(folder)


class DPORuns:
    """Runs made on first use and shared by this module's tests: {name: run folder}."""

    def __init__(self, tmp_path_factory, cache_dir: Path):
        self.root = tmp_path_factory.mktemp("dpo")
        self.cache = cache_dir
        self.data = self.root / "data"
        # 30 pairs: the 8th step of 4 pairs holds 2 and 2 empty slots, where a per-rank or per-micro-batch mean
        # would differ from the mean over the global batch's pairs
        preference_data.explicit_text(self.data / "train.jsonl", n=30, seed=0)
        preference_data.explicit_text(self.data / "validation.jsonl", n=8, seed=1)
        save_starting_model(self.data / "model")
        save_starting_model(self.data / "other_model", seed=99)  # another reference
        self._made: dict = {}
        self.logs: dict = {}

    def run(self, name: str, *extra: str, nprocs: int = 1, **kwargs) -> Path:
        if name not in self._made:
            run_dir = self.root / name
            proc = launch(
                REPO / "train.py",
                dpo_flags(run_dir, self.data, *extra, **kwargs),
                "deepspeed",
                self.cache,
                nprocs=nprocs,
            )
            check_ok(proc)
            self._made[name], self.logs[name] = run_dir, proc.stdout + proc.stderr
        return self._made[name]


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory, cache_dir) -> DPORuns:
    return DPORuns(tmp_path_factory, cache_dir)


def records(run_dir: Path) -> dict:
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def eval_records(run_dir: Path) -> dict:
    return {r["step"]: r for r in read_metrics(run_dir) if "eval_loss" in r}


@pytest.mark.slow
def test_one_rank_two_ranks_and_accumulation_give_the_same_losses_and_metrics(dpo_runs):
    """One rank with 4 pairs per micro-batch and two ranks with 2 each (ZeRO-3), one rank accumulating 2 x 2 under
    ZeRO-2 from the whole logits (--loss_chunk_size 0; the others sum the log-probs through the chunked LM head) and
    padding-free (--padding_free: each micro-batch's sequences in one row): the same per-step loss (the mean over
    the global batch's 4 pairs) and TRL's metrics, within 1e-5; step 1's loss is log 2 (the policy is the
    reference), and the reference's log-probs were computed once and then read back."""
    one = records(dpo_runs.run("one_rank"))
    two = records(dpo_runs.run("two_ranks", nprocs=2, micro=2))
    accumulated = records(
        dpo_runs.run(
            "accumulated",
            "--gradient_accumulation_steps",
            "2",
            "--loss_chunk_size",
            "0",
            "--padding_free",
            micro=2,
            config="zero2",
        )
    )
    assert sorted(one) == list(range(1, STEPS + 1))
    assert one[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for other in (two, accumulated):
        for step in one:
            for key in ("loss", *METRICS):
                if (other, step, key) == (accumulated, 1, "rewards/accuracies"):
                    # Step 1: the policy is the reference, every reward 0 up to rounding, and the padding-free
                    # layout rounds otherwise than the padded one that computed the reference's file: the share
                    # of rewards above 0 is a count of rounding signs there (its rewards, within 1e-5, are checked).
                    continue
                assert other[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-5), (step, key)
    assert one[STEPS]["loss"] < one[1]["loss"] and one[STEPS]["rewards/margins"] > 0
    evaluations = [eval_records(dpo_runs.run(n)) for n in ("one_rank", "two_ranks", "accumulated")]
    assert sorted(evaluations[0]) == [4, STEPS]
    for other in evaluations[1:]:
        for step, record in evaluations[0].items():
            for key in ("eval_loss", *(f"eval_{m}" for m in METRICS)):
                assert other[step][key] == pytest.approx(record[key], rel=1e-5, abs=1e-5), (step, key)
    assert "computed by the starting model" in dpo_runs.logs["one_rank"]
    assert "reference log-probs (train): read from" in dpo_runs.logs["two_ranks"]
    assert "loss: through the LM head in chunks" in dpo_runs.logs["one_rank"]
    assert "loss: from the whole logits (--loss_chunk_size 0)" in dpo_runs.logs["accumulated"]


@pytest.mark.slow
@pytest.mark.extended  # ~45 s: ORPO's loss on any split of the batch is tested in process, the ranks by the DPO test
def test_orpo_trains_the_same_on_one_rank_two_ranks_and_padding_free_accumulation(dpo_runs):
    """ORPO's NLL term is the token mean over the global batch's whole chosen sequences: one rank, two ranks (ZeRO-3)
    and one rank accumulating 2 x 2 padding-free give the same per-step loss, nll_loss and TRL's metrics, within 1e-5
    (the 8th step's 2 pairs and 2 empty slots included, where a per-rank mean would differ), and so the validation
    figures; no reference is computed (ORPO has none)."""
    orpo = ("--loss_type", "orpo", "--beta", "0.25")
    accumulated = ("--gradient_accumulation_steps", "2", "--padding_free")
    one = records(dpo_runs.run("orpo_one_rank", *orpo))
    others = [
        records(dpo_runs.run("orpo_two_ranks", *orpo, nprocs=2, micro=2)),
        records(dpo_runs.run("orpo_accumulated", *orpo, *accumulated, micro=2, config="zero2")),
    ]
    assert sorted(one) == list(range(1, STEPS + 1)) and one[STEPS]["loss"] < one[1]["loss"]
    for other in others:
        for step in one:
            for key in ("loss", "nll_loss", *METRICS):
                assert other[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-5), (step, key)
    evaluations = [eval_records(dpo_runs.run(n)) for n in ("orpo_one_rank", "orpo_two_ranks", "orpo_accumulated")]
    assert sorted(evaluations[0]) == [4, STEPS]
    for other in evaluations[1:]:
        for step, record in evaluations[0].items():
            for key in ("eval_loss", "eval_nll_loss", *(f"eval_{m}" for m in METRICS)):
                assert other[step][key] == pytest.approx(record[key], rel=1e-5, abs=1e-5), (step, key)
    assert "reference log-probs" not in dpo_runs.logs["orpo_one_rank"]


@pytest.mark.slow
def test_lora_with_a_live_reference_trains_as_with_the_precomputed_one(dpo_runs):
    """--use_peft under ZeRO-3 with parameters and optimizer offloaded, and activation checkpointing: the reference
    computed at every step by the base with the adapter disabled gives the same losses as the log-probs precomputed
    before step 1 (the zero-initialised adapter is the base); the export is an adapter."""
    lora = ("--use_peft", "--lora_r", "8", "--gradient_checkpointing")
    pre = records(dpo_runs.run("lora_precomputed", *lora, config="zero3_offload"))
    live = records(dpo_runs.run("lora_live", *lora, "--no-precompute_ref_log_probs", config="zero3_offload"))
    assert "reference log-probs" not in dpo_runs.logs["lora_live"]
    for step in pre:
        for key in ("loss", *METRICS):
            assert live[step][key] == pytest.approx(pre[step][key], rel=1e-5, abs=1e-5), (step, key)
    assert pre[STEPS]["loss"] < pre[1]["loss"]
    assert (dpo_runs.run("lora_live") / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_sigkill_of_one_rank_then_restart_on_one_rank_continues_exactly(dpo_runs, tmp_path):
    """Two ranks under ZeRO-3, one killed after a committed checkpoint, restarted on one rank with the same global
    batch (the checkpoint converted to a universal one): the restart reads the reference's log-probs back (its model
    is no longer the starting one) and continues with the uninterrupted 2-rank run's losses."""
    reference = records(dpo_runs.run("two_ranks", nprocs=2, micro=2))
    run_dir = tmp_path / "killed"
    args = dpo_flags(run_dir, dpo_runs.data, micro=2)
    proc = start(args, dpo_runs.cache)
    ranks = rank_processes(proc)
    wait_for(
        lambda: (run_dir / "checkpoints" / "latest").exists() and any(s > SAVE_EVERY for s in records(run_dir)), proc
    )
    freeze(*(rank.pid for rank in ranks))
    saved = latest_step(run_dir)
    ranks[1].kill()
    thaw(ranks[0].pid)
    proc.wait(timeout=120)
    assert proc.returncode != 0 and latest_step(run_dir) == saved
    one_rank = dpo_flags(run_dir, dpo_runs.data, micro=4)
    restarted = launch(REPO / "train.py", one_rank, "deepspeed", dpo_runs.cache, nprocs=1)
    check_ok(restarted)
    assert f"(step {saved}," in restarted.stdout and "reference log-probs (train): read from" in restarted.stdout
    assert "universal checkpoint" in restarted.stdout
    losses = step_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in losses:  # another rank count: equal to 1e-5 (sums in another order), as one rank and two are
        assert losses[step] == pytest.approx(reference[step]["loss"], rel=1e-5, abs=1e-6), step


@pytest.mark.slow
def test_nodes_with_their_own_stores_agree_to_compute_a_reference_one_of_them_misses(dpo_runs, tmp_path):
    """Two "nodes" (one rank each, started as srun starts them), each with its own cache and so its own store: node 0
    holds the reference log-probs (the shared runs' cache), node 1 prepares its store afresh and has none. Both ranks
    compute them together (where node 0 alone had read its file, node 1's ZeRO-3 forward would have waited for it
    forever); node 1 saves its copy, and the run trains as the 2-rank run that computed them on one store."""
    from tests.distributed.test_agreement import finish, start_ranks

    reference = records(dpo_runs.run("two_ranks", nprocs=2, micro=2))
    node1_cache = tmp_path / "node1_cache"
    run_dir = tmp_path / "run"
    args = dpo_flags(run_dir, dpo_runs.data, micro=2)
    envs = [{}, {"SCALETRAIN_CACHE": str(node1_cache / "scaletrain"), "HF_DATASETS_CACHE": str(node1_cache / "ds")}]
    results = finish(start_ranks(dpo_runs.cache, [REPO, REPO], args, rank_envs=envs), timeout=300)
    assert [code for code, _ in results] == [0, 0], [err[-3000:] for _, err in results]
    # (the shared runs' cache may also hold the references of other identities, e.g. a LoRA run's: one per key)
    node1_files = sorted(node1_cache.glob("**/reference/train-*.npy"))
    assert len(node1_files) == 1, node1_files
    node0_files = sorted((dpo_runs.cache / "scaletrain").glob(f"**/reference/{node1_files[0].name}"))
    assert len(node0_files) == 1, node0_files
    assert np.array_equal(np.load(node1_files[0]), np.load(node0_files[0]))
    got = records(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:  # (the "nodes" all-reduce over gloo's TCP path, the reference over shared memory: 1e-5)
        for key in ("loss", *METRICS):
            assert got[step][key] == pytest.approx(reference[step][key], rel=1e-5, abs=1e-6), (step, key)


@pytest.mark.extended  # ~37 s; a live reference: the LoRA test
@pytest.mark.slow
def test_a_reference_model_of_its_own_runs_live_or_precomputed(dpo_runs):
    """Without LoRA, --no-precompute_ref_log_probs runs the starting model as its own engine (ZeRO-3, no optimizer) at
    every step: the same losses as the precomputed log-probs. --ref_model_name_or_path names another model, whose
    log-probs are computed by its own engine before step 1 (then freed): step 1's loss is no longer log 2."""
    one = records(dpo_runs.run("one_rank"))
    live = records(dpo_runs.run("live_reference", "--no-precompute_ref_log_probs"))
    assert "reference model: " in dpo_runs.logs["live_reference"]
    for step in one:
        for key in ("loss", *METRICS):
            assert live[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-5), (step, key)
    other = str(dpo_runs.data / "other_model")
    pre = records(dpo_runs.run("other_reference", "--ref_model_name_or_path", other))
    assert f"computed by --ref_model_name_or_path {other}" in dpo_runs.logs["other_reference"]
    assert abs(pre[1]["loss"] - math.log(2)) > 1e-3 and pre[1]["rewards/margins"] != 0
    assert pre[STEPS]["loss"] < pre[1]["loss"]
