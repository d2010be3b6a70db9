"""The straggler figure names a rank slowed on purpose (tests/helpers/slow_rank.py), at 2 real ranks; a slow rank is
not a hang."""

import json

import pytest

from tests.harness import FAST_FLAGS, REPO, check_ok, launch, read_metrics

SLOW_RANK = REPO / "tests" / "helpers" / "slow_rank.py"
DELAY_S = 2.0  # per micro-batch forward of rank 1; a forward of the test model takes ~0.02 s
HANG_TIMEOUT_S = 5  # each step is well within it; the run's slowness adds up to more


@pytest.mark.slow
def test_a_rank_slowed_on_purpose_is_named_with_its_forward_time_over_the_median_and_is_not_a_hang(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    check_ok(
        launch(
            SLOW_RANK,
            [
                "--config",
                "ds_configs/zero2.json",
                "--output_dir",
                str(run_dir),
                "--max_steps",
                "4",
                "--no-save_at_end",
                "--no-export_hf_at_end",
                *FAST_FLAGS,
                "--hang_timeout",
                str(HANG_TIMEOUT_S),
            ],
            "deepspeed",
            cache_dir,
            nprocs=2,
            env={"SCALETRAIN_TEST_SLOW_RANK": f"1:{DELAY_S}"},
        )
    )
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert len(records) == 2
    for record in records:
        assert record["slowest_rank"] == 1
        assert record["slowest_rank_forward_s"] >= DELAY_S
        # the median of two ranks is their mean: (d + f) / ((d + f + f) / 2) with f << d approaches 2
        assert record["straggler_ratio"] > 1.5, record
    assert 4 * DELAY_S > HANG_TIMEOUT_S
    (attempt,) = (run_dir / "hang").iterdir()
    assert not (attempt / "report.txt").exists()
    beats = [json.loads(p.read_text()) for p in sorted((attempt / "heartbeat").glob("rank-*.json"))]
    assert [(b["rank"], b["finished"], b["step"]) for b in beats] == [(0, True, 4), (1, True, 4)]
