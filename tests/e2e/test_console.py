"""What a run prints where output is not a terminal (a Slurm log, a redirect, as here): no progress-bar frames, the
run's own first line first, DeepSpeed's accelerator guess and the resolved JSON not repeated (the JSON at
--log_level debug), warnings kept."""

from __future__ import annotations

import pytest

from tests.harness import GIVEN_PEAK, REPO, check_ok, launch


@pytest.mark.slow
def test_a_redirected_two_rank_run_prints_lines_not_frames_and_its_launch_line_first(tmp_path, cache_dir):
    flags = ["--config", "ds_configs/zero2.json", "--output_dir", str(tmp_path / "run"), "--max_steps", "2"]
    proc = launch(
        REPO / "train.py",
        [*flags, *GIVEN_PEAK, "--block_size", "64", "--logging_steps", "1"],
        "deepspeed",
        cache_dir,
        nprocs=2,
    )
    check_ok(proc)
    output = proc.stdout + proc.stderr
    assert "\r" not in output  # no progress-bar frames: the training and tokenizing bars give way to log lines
    ours = [line for line in proc.stdout.splitlines() if "[rank" in line]
    assert "] INFO launch: torchrun/deepspeed, world size 2" in ours[0], ours[:3]
    assert sum("INFO step=" in line and " epoch=" in line for line in ours) == 2  # a line per logging step
    # DeepSpeed's guess that there is no GPU: from launch.py's own process at most, never again from each rank
    assert output.count("Setting accelerator to CPU") <= 1
    assert proc.stdout.count("INFO accelerator: cpu") == 1
    assert proc.stdout.count("DeepSpeed config ds_configs/zero2.json: ZeRO-2") == 1
    assert "where the decided values came from" not in output  # the whole JSON only at --log_level debug


@pytest.mark.slow
def test_log_level_debug_adds_the_resolved_json_and_warning_keeps_warnings_alone(tmp_path, cache_dir):
    base = ["--config", "ds_configs/zero2.json", "--dry_run", *GIVEN_PEAK, "--block_size", "64"]
    debug = launch(
        REPO / "train.py", [*base, "--output_dir", str(tmp_path / "a"), "--log_level", "debug"], "python", cache_dir
    )
    check_ok(debug)
    assert "where the decided values came from" in debug.stdout and '"stage": 2' in debug.stdout
    quiet = launch(
        REPO / "train.py", [*base, "--output_dir", str(tmp_path / "b"), "--log_level", "warning"], "python", cache_dir
    )
    check_ok(quiet)
    assert " INFO " not in quiet.stdout and "launch:" not in quiet.stdout
