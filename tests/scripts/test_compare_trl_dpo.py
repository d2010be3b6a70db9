"""scripts/bench/compare_trl_dpo.py's pure parts: reading both sides' records, the figures and goals, the commands
and environments of the two runs. No TRL install, no training (the script itself is run by hand)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from scripts.bench import compare_trl_dpo as cmp
from tests.harness import REPO

LOG2 = math.log(2)


def test_trl_losses_are_the_per_step_records_of_the_log_history():
    history = [
        {"loss": LOG2, "grad_norm": 6.1, "rewards/chosen": 0.0, "epoch": 1.0, "step": 1},
        {"loss": 0.67, "grad_norm": 5.8, "epoch": 2.0, "step": 2},
        {"eval_loss": 0.5, "epoch": 2.0, "step": 2},
        {"train_runtime": 18.7, "train_loss": 0.68, "train_samples_per_second": 0.85, "epoch": 2.0, "step": 2},
    ]
    assert cmp.step_losses(history) == {1: LOG2, 2: 0.67}


def test_our_losses_skip_records_without_a_training_loss():
    records = [{"step": 1, "loss": LOG2, "samples_per_s": 4.0}, {"step": 2, "eval_loss": 0.5}, {"step": 2, "loss": 0.6}]
    assert cmp.step_losses(records) == {1: LOG2, 2: 0.6}


def test_compare_losses_gives_the_relative_difference_to_trl_on_common_steps_in_order():
    rows = cmp.compare_losses({2: 0.5005, 1: LOG2, 3: 0.4}, {1: LOG2, 2: 0.5})
    assert [row[0] for row in rows] == [1, 2]  # step 3 only on our side
    assert rows[0][3] == 0.0
    assert rows[1][1:3] == (0.5005, 0.5) and rows[1][3] == pytest.approx(1e-3)


def test_step_rates_leave_out_the_warmup_steps():
    steps, times = [1, 2, 3, 4, 5], [10.0, 20.0, 21.0, 23.0, 27.0]
    assert cmp.step_rates(steps, times, batch=8, warmup=2) == [8.0, 4.0, 2.0]  # steps 3, 4, 5
    figures = cmp.steady(steps, times, batch=8, warmup=2)
    assert figures["median_step"] == 4.0
    assert figures["span"] == pytest.approx(3 * 8 / 7)  # end of step 2 to end of step 5


def test_step_rates_count_the_steps_between_sparse_stamps():
    assert cmp.step_rates([2, 4, 6], [0.0, 1.0, 3.0], batch=4, warmup=2) == [8.0, 4.0]


def test_our_steady_adds_train_pys_own_median_samples_per_s():
    records = [
        {"step": s, "time": 100.0 + s, "loss": 0.5, "samples_per_s": v} for s, v in [(1, 1.0), (2, 7.0), (3, 9.0)]
    ]
    figures = cmp.our_steady(records, batch=8, warmup=1)
    assert figures["samples_per_s"] == 8.0  # median of steps 2 and 3, step 1 left out
    assert figures["median_step"] == 8.0 and figures["span"] == 8.0


def rows(*losses, first=LOG2):
    return [(1, first, first, 0.0), *((s, a, b, abs(a - b) / b) for s, (a, b) in enumerate(losses, start=2))]


def test_verdicts_check_the_loss_goal_on_the_first_steps():
    ok = cmp.verdicts(rows((0.6, 0.6003), (0.5, 0.5)), loss_steps=3, ratio=2.0, comparable=True)
    assert ok["losses_agree"] is True and ok["first_loss_as_expected"] and ok["loss_steps_compared"] == 3
    assert ok["max_rel_loss_diff"] == pytest.approx(0.0003 / 0.6003)
    off = cmp.verdicts(rows((0.6, 0.6015)), loss_steps=2, ratio=2.0, comparable=True)
    assert off["losses_agree"] is False
    # A later step past --loss_steps does not count.
    late = cmp.verdicts(rows((0.6, 0.6), (0.1, 0.2)), loss_steps=2, ratio=2.0, comparable=True)
    assert late["losses_agree"] is True and late["loss_steps_compared"] == 2


def test_verdicts_need_log2_first_every_step_and_a_comparable_order():
    assert cmp.verdicts(rows(first=0.7), 1, 2.0, comparable=True)["losses_agree"] is False
    assert cmp.verdicts(rows((0.6, 0.6)), loss_steps=3, ratio=2.0, comparable=True)["losses_agree"] is False
    assert cmp.verdicts(rows((0.6, 0.6)), loss_steps=2, ratio=2.0, comparable=False)["losses_agree"] is None


def test_verdicts_speed_goal_is_one_and_a_half():
    assert cmp.verdicts(rows(), 1, ratio=1.5, comparable=True)["speed_goal_met"] is True
    assert cmp.verdicts(rows(), 1, ratio=1.49, comparable=True)["speed_goal_met"] is False


def test_table_shows_each_step_and_the_median_ratio():
    text = cmp.table(
        rows((0.6, 0.6)), {"median_step": [30.0, 10.0], "span": [18.0, 20.0]}, {"median_step": [10.0], "span": [6.0]}
    )
    assert "| loss, step 2 | 0.6000000 | 0.6000000 | 0.0e+00 |" in text
    assert "| pairs/s, median step | 20.00 (30.00, 10.00) | 10.00 (10.00) | 2.00x |" in text
    assert "| pairs/s, whole steady span | 19.00 (18.00, 20.00) | 6.00 (6.00) | 3.17x |" in text


METADATA = """Metadata-Version: 2.4
Name: trl
Version: 1.16.0
Requires-Dist: accelerate>=1.10.1
Requires-Dist: datasets>=4.7.0
Requires-Dist: jinja2
Requires-Dist: transformers>=4.56.2
Requires-Dist: deepspeed>=0.18.6; extra == "deepspeed"
Requires-Dist: harbor>=0.13.0; python_version >= "3.12" and extra == "harbor"
Requires-Dist: pywin32; sys_platform == "win32"
"""


def test_unmet_requirements_names_the_missing_and_the_too_old_and_skips_extras():
    installed = {"accelerate": "1.15.0", "datasets": "3.0.0", "transformers": "5.24.0"}.get
    unmet = cmp.unmet_requirements(METADATA, installed)
    assert unmet == ["datasets>=4.7.0 (installed: 3.0.0)", "jinja2 (installed: none)"]
    everything = {"accelerate": "1.15.0", "datasets": "5.2.0", "jinja2": "3.1.6", "transformers": "5.24.0"}.get
    assert cmp.unmet_requirements(METADATA, everything) == []


def test_trl_child_finds_trl_first_then_the_repository_then_the_callers_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/caller/a", "/caller/b"]))
    env = cmp.trl_env(tmp_path / "trl", threads=3, cache=tmp_path / "cache")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "trl"), str(REPO), "/caller/a", "/caller/b"]
    assert env["OMP_NUM_THREADS"] == "3" and env["HF_HUB_OFFLINE"] == "1"
    ours = cmp.run_env(threads=3, cache=tmp_path / "cache")
    assert str(tmp_path / "trl") not in ours["PYTHONPATH"] and ours["OMP_NUM_THREADS"] == "3"
    assert ours["SCALETRAIN_CACHE"] == str(tmp_path / "cache" / "scaletrain")


def test_trl_command_runs_this_script_as_the_child():
    cmd = cmp.trl_command(REPO / "spec.json")
    assert cmd[0] == sys.executable and cmd[1].endswith("scripts/bench/compare_trl_dpo.py")
    assert cmd[2:] == ["--trl_side", str(REPO / "spec.json")]
    assert cmp.parse_args(cmd[2:]).trl_side == REPO / "spec.json"


def flag_values(cmd: list) -> dict:
    """--name value pairs of a command line (switches without a value map to True)."""
    out, i = {}, 0
    while i < len(cmd):
        if cmd[i].startswith("--"):
            has_value = i + 1 < len(cmd) and not cmd[i + 1].startswith("--")
            out[cmd[i][2:]] = cmd[i + 1] if has_value else True
            i += 2 if has_value else 1
        else:
            i += 1
    return out


def test_both_sides_get_the_same_hyper_parameters(tmp_path):
    args = cmp.parse_args(["--batch", "6", "--steps", "9", "--block_size", "96", "--learning_rate", "3e-5"])
    ours = flag_values(cmp.our_command(args, tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "o"))
    trl = cmp.trl_spec(args, tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "t")["config"]
    shared = ["per_device_train_batch_size", "max_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "seed"]
    for name in shared + list(cmp.SHARED_HPARAMS):
        assert float(ours[name]) == trl[name] if isinstance(trl[name], float) else ours[name] == str(trl[name]), name
    assert trl["per_device_train_batch_size"] == 6 and trl["max_steps"] == 9 and trl["learning_rate"] == 3e-5
    assert trl["lr_scheduler_type"] == "constant" and trl["warmup_steps"] == 0  # no warmup on either side
    assert trl["max_length"] == int(ours["block_size"]) == 96
    assert trl["bf16"] is False and ours["no-bf16"] is True and trl["activation_checkpointing"] is False
    assert trl["loss_type"] == "sigmoid" and trl["beta"] == 0.1 and trl["logging_steps"] == 1
    assert ours["config"] == "ds_configs/zero2.json" and ours["logging_steps"] == "1"
    assert ours["model_name_or_path"] == str(tmp_path / "m") and ours["train_file"] == str(tmp_path / "p.jsonl")


def test_reference_log_probs_follow_each_sides_flag(tmp_path):
    paths = (tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "o")
    defaults = cmp.parse_args([])
    assert "--precompute_ref_log_probs" in cmp.our_command(defaults, *paths)
    assert cmp.trl_spec(defaults, *paths)["config"]["precompute_ref_log_probs"] is False  # TRL's default
    flipped = cmp.parse_args(["--no-our_precompute_ref_log_probs", "--trl_precompute_ref_log_probs"])
    assert "--no-precompute_ref_log_probs" in cmp.our_command(flipped, *paths)
    assert cmp.trl_spec(flipped, *paths)["config"]["precompute_ref_log_probs"] is True


def test_quick_changes_defaults_and_a_typed_flag_still_wins():
    quick = cmp.parse_args(["--quick"])
    assert (quick.steps, quick.batch, quick.model, quick.rounds) == (4, 4, "tiny", 1)
    assert quick.pairs == quick.batch  # one global batch: the same pairs at every step
    assert cmp.parse_args(["--quick", "--steps", "7"]).steps == 7
    assert cmp.parse_args([]).steps == 16 and cmp.parse_args([]).model == "bench"
    with pytest.raises(SystemExit):
        cmp.parse_args(["--steps", "4", "--warmup", "4"])
    with pytest.raises(SystemExit):
        cmp.parse_args(["--batch", "8", "--pairs", "4"])


def test_our_pairs_line_reads_the_count_and_the_truncated():
    log = "04:15:47 [rank0] INFO preference data (train): 8 pairs; 0 sequences longer than the block truncated to it"
    assert cmp.our_pairs_line(f"noise\n{log}\nmore") == (8, 0)
    assert cmp.our_pairs_line(log.replace("8 pairs; 0", "12 pairs; 3")) == (12, 3)
    assert cmp.our_pairs_line("no such line") is None


# ---- every loss type against its TRL trainer ----------------------------------------------------------------


def test_each_loss_type_runs_against_its_trl_trainer_with_the_same_loss_settings(tmp_path):
    paths = (tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "o")
    for loss in ("sigmoid", "ipo", "hinge", "robust"):
        args = cmp.parse_args(["--loss_type", loss, "--beta", "0.25"])
        spec, ours = cmp.trl_spec(args, *paths), flag_values(cmp.our_command(args, *paths))
        assert spec["trainer"] == ["trl", "DPOTrainer", "DPOConfig"]
        assert spec["config"]["loss_type"] == ours["loss_type"] == loss
        assert spec["config"]["beta"] == float(ours["beta"]) == 0.25
        assert spec["config"]["activation_checkpointing"] is False and "precompute_ref_log_probs" in ours
        # Only robust reads label smoothing (0.1 by default here); train.py refuses it for the others.
        smoothing = spec["config"].get("label_smoothing")
        assert smoothing == (0.1 if loss == "robust" else None)
        assert ours.get("label_smoothing") == (None if smoothing is None else str(smoothing))

    simpo = cmp.parse_args(["--loss_type", "simpo", "--simpo_gamma", "0.8", "--label_smoothing", "0.05"])
    spec, ours = cmp.trl_spec(simpo, *paths), flag_values(cmp.our_command(simpo, *paths))
    assert spec["trainer"] == ["trl.experimental.cpo", "CPOTrainer", "CPOConfig"]
    config = spec["config"]
    assert config["loss_type"] == "simpo" and config["cpo_alpha"] == 0.0  # SimPO: no behaviour-cloning term
    assert config["simpo_gamma"] == float(ours["simpo_gamma"]) == 0.8
    assert config["label_smoothing"] == float(ours["label_smoothing"]) == 0.05
    assert config["gradient_checkpointing"] is False and "activation_checkpointing" not in config
    assert "precompute_ref_log_probs" not in config and "precompute_ref_log_probs" not in ours  # no reference

    orpo = cmp.parse_args(["--loss_type", "orpo"])
    spec, ours = cmp.trl_spec(orpo, *paths), flag_values(cmp.our_command(orpo, *paths))
    assert spec["trainer"] == ["trl.experimental.orpo", "ORPOTrainer", "ORPOConfig"]
    assert "loss_type" not in spec["config"] and ours["loss_type"] == "orpo"  # ORPOConfig has no loss_type
    assert spec["config"]["beta"] == float(ours["beta"]) == 0.1
    assert "label_smoothing" not in spec["config"] and "label_smoothing" not in ours


def test_loss_flags_are_checked_and_five_steps_are_compared_by_default():
    assert cmp.parse_args([]).loss_steps == 5 and cmp.parse_args(["--quick"]).loss_steps == 4  # at most --steps
    assert cmp.parse_args(["--loss_type", "orpo"]).loss_steps == 5
    assert cmp.parse_args(["--loss_type", "orpo", "--loss_steps", "3"]).loss_steps == 3
    for bad in (["--loss_type", "sigmoid", "--label_smoothing", "0.1"], ["--loss_steps", "17"], ["--loss_type", "kto"]):
        with pytest.raises(SystemExit):
            cmp.parse_args(bad)


def test_orpos_nll_loss_is_compared_where_both_sides_log_it():
    ours = {1: {"loss": 8.4, "nll_loss": 8.41, "logps/chosen": -8.3}}
    trl = {1: {"loss": 8.4, "nll_loss": 8.41, "logps/chosen": -8.3}, 2: {"nll_loss": 1.0}}
    assert [row[1] for row in cmp.compare_metrics(ours, trl, cmp.COMPARED)] == ["logps/chosen", "nll_loss"]
    # CPOTrainer logs nll_loss for simpo too; train.py only for orpo: compared where both have it.
    assert [row[1] for row in cmp.compare_metrics({1: {"logps/chosen": -8.3}}, trl, cmp.COMPARED)] == ["logps/chosen"]


def test_the_dpo_family_starts_at_a_known_loss_and_the_reference_free_losses_do_not():
    assert cmp.expected_first_loss("sigmoid", 0.1) == cmp.expected_first_loss("robust", 0.3) == LOG2
    assert cmp.expected_first_loss("hinge", 0.1) == 1.0
    assert cmp.expected_first_loss("ipo", 0.1) == pytest.approx(25.0)
    assert cmp.expected_first_loss("simpo", 0.1) is None and cmp.expected_first_loss("orpo", 0.1) is None
    ipo = cmp.verdicts(rows((24.7, 24.7), first=25.0), 2, 2.0, comparable=True, first_loss=25.0)
    assert ipo["losses_agree"] is True and ipo["first_loss_as_expected"] is True
    assert cmp.verdicts(rows(first=25.0), 1, 2.0, comparable=True)["first_loss_as_expected"] is False  # not log 2
    free = cmp.verdicts(rows((0.96, 0.96), first=0.97), 2, 1.0, comparable=True, first_loss=None)
    assert free["losses_agree"] is True and free["first_loss_as_expected"] is True


def test_metrics_are_compared_where_both_log_them_relative_to_a_floor():
    ours = {1: {"rewards/chosen": 0.0, "logps/chosen": -105.0}, 2: {"rewards/chosen": 0.0378, "logps/chosen": -104.9}}
    trl = {1: {"rewards/chosen": 1e-7, "logps/chosen": -105.0}, 2: {"rewards/chosen": 0.0379}, 3: {"logps/chosen": 1}}
    found = cmp.compare_metrics(ours, trl)
    assert [(row[0], row[1]) for row in found] == [(1, "rewards/chosen"), (1, "logps/chosen"), (2, "rewards/chosen")]
    assert found[0][4] == pytest.approx(1e-7 / cmp.METRIC_FLOOR)  # near 0: against the floor, not 1e-7
    assert found[2][4] == pytest.approx(0.0001 / 0.0379)
    result = cmp.verdicts(rows((0.6, 0.6)), 2, 2.0, comparable=True, metric_rows=found)
    assert result["metrics_agree"] is False and result["worst_metric"] == {"step": 2, "name": "rewards/chosen"}
    assert result["metrics_compared"] == ["logps/chosen", "rewards/chosen"]
    assert cmp.verdicts(rows((0.6, 0.6)), 1, 2.0, comparable=True, metric_rows=found)["metrics_agree"] is True
    assert cmp.verdicts(rows(), 1, 2.0, comparable=False, metric_rows=found)["metrics_agree"] is None
    text = cmp.table(rows(), {"median_step": [1.0], "span": [1.0]}, {"median_step": [1.0], "span": [1.0]}, found, "X")
    assert "| figure | train.py | TRL X |" in text and "| rewards/chosen, largest diff (step 2) |" in text


def test_cpo_and_orpo_pairs_carry_the_bos_text_that_tokenises_to_the_bos_token(tmp_path):
    from transformers import AutoTokenizer

    from tests.helpers.preference_data import explicit_text

    pairs = cmp.with_bos_prompts(explicit_text(tmp_path / "pairs.jsonl", 3, 0), REPO / "data" / "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "data" / "tiny-llama")
    for line in pairs.read_text().splitlines():
        prompt = json.loads(line)["prompt"]
        assert prompt.startswith(tokenizer.bos_token) and not prompt.startswith(tokenizer.bos_token * 2)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]


def test_the_longest_pair_is_read_from_either_tokenised_layout():
    from datasets import Dataset

    dpo = Dataset.from_dict({"prompt_ids": [[1, 2], [3]], "chosen_ids": [[4, 5, 6], [7]], "rejected_ids": [[8], [9]]})
    assert cmp.longest_tokenized_pair(dpo) == 5
    cpo = Dataset.from_dict({"chosen_input_ids": [[0, 1, 2], [0, 1]], "rejected_input_ids": [[0], [0, 1, 2, 3]]})
    assert cmp.longest_tokenized_pair(cpo) == 4
