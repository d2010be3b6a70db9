"""scripts/compare_hf_trainer.py at a tiny size: both sides train, evaluate and report figures, on the same job."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import REPO, child_env

BLOCK, BATCH, STEPS = 64, 4, 6


@pytest.mark.extended  # ~45 s: the benchmark script
@pytest.mark.slow  # two DeepSpeed launches, ~40 s on 2 cores
def test_both_sides_train_the_same_tokens_and_report_figures(tmp_path):
    out = tmp_path / "figures.json"
    cmd = [
        sys.executable,
        "scripts/compare_hf_trainer.py",
        "--measure",
        "memory",
        "--hidden_size",
        "64",
        "--vocab_size",
        "4096",
        "--block_size",
        str(BLOCK),
        "--batch",
        str(BATCH),
        "--steps",
        str(STEPS),
        "--warmup",
        "2",
        "--rounds",
        "1",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    result = json.loads(out.read_text())["memory"]
    ours, theirs = result["runs"]["train.py"][0], result["runs"]["hf_trainer"][0]
    for side in (ours, theirs):
        assert side["max_rss_kb"] > 0 and side["tokens_per_s"] > 0
        assert len(side["eval_losses"]) == 1  # one evaluation, at the end
    # Each side's own count of what it trained per step: the whole blocks of the global batch, and one target
    # fewer than tokens per block (the last token of a block has no next token); no padding in these steps.
    assert ours["input_tokens_per_step"] == theirs["input_tokens_per_step"] == BATCH * BLOCK
    assert ours["targets_per_step"] == theirs["targets_per_step"] == BATCH * (BLOCK - 1)
    assert theirs["eval_blocks"] == 4
    assert theirs["deepspeed"]["zero_stage"] == 2 and theirs["deepspeed"]["world_size"] == 1
    # The same config and seed, so the same initial weights: after a few steps the eval losses are close.
    assert abs(ours["eval_losses"][0] - theirs["eval_losses"][0]) < 0.1
    assert set(result["ratio"]) >= {"max_rss_kb", "tokens_per_s"} and all(v > 0 for v in result["ratio"].values())
    assert result["round_ratios"] == pytest.approx([ours["tokens_per_s"] / theirs["tokens_per_s"]])
    assert "| memory: peak RSS" in proc.stdout and "| memory: steady tokens/s" in proc.stdout


@pytest.mark.slow  # a launch that train.py refuses, ~15 s
def test_a_failing_run_exits_non_zero_with_its_command_and_output(tmp_path):
    cmd = [
        sys.executable,
        "scripts/compare_hf_trainer.py",
        "--measure",
        "memory",
        "--vocab_size",
        "4096",
        "--block_size",
        "64",
        "--rounds",
        "1",
        "--attn_implementation",
        "no_such_attention",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "a run failed" in proc.stderr and "train.py --config ds_configs/zero2.json" in proc.stderr
    assert "no_such_attention" in proc.stderr.split("its tail:", 1)[1]  # train.py's own message, from its log


def test_the_token_check_allows_train_pys_padded_block_and_nothing_more():
    from argparse import Namespace

    from scripts.compare_hf_trainer import RunFailed, check_same_tokens

    s = Namespace(steps=10, block_size=64)
    hf = {"input_tokens_per_step": 256, "targets_per_step": 252.0}

    def ours(targets_per_step, input_tokens=256):
        return {"input_tokens_per_step": input_tokens, "targets_per_step": targets_per_step, "epochs_touched": 1}

    check_same_tokens(ours(252.0), hf, s)
    check_same_tokens(ours(252.0 - 40 / 10), hf, s)  # one padded block of 40 pads in the 10 steps
    for wrong in (ours(252.0 - 64 / 10), ours(253.0), ours(252.0, input_tokens=320)):
        with pytest.raises(RunFailed):
            check_same_tokens(wrong, hf, s)
