"""--comms_log: per-op latencies (DeepSpeed 0.19.8 records running totals), per collective type, per window.

Real collectives on 2 gloo ranks: a known sequence whose per-op logged latencies must add up to (at most) its
wall-clock time, and DeepSpeed's own figures checked to still be running totals (when an upgrade fixes that, the
correction in scaletrain/engine/ds_internals/comm.py must go, and this fails). Then train.py --comms_log end to end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from scaletrain.observability.comms_log import CollectiveTotals, bandwidth_gbps, comms_summary, totals_by_type
from tests.harness import FAST_FLAGS, REPO, check_ok, launch, read_metrics


def test_records_sum_per_collective_type_with_the_bus_bandwidth_convention():
    raw = {
        "all_reduce": {1000: [2, [1.0, 3.0], [0, 0], [10.0, 20.0]]},
        "all_gather_into_tensor": {500: [1, [2.0], [0], [4.0]]},
        "all_gather": {100: [1, [1.0], [0], [1.0]]},
        "barrier": {0: [1, [0.5], [0], [0.0]]},
    }
    totals = totals_by_type(raw)
    assert totals["all_reduce"] == CollectiveTotals(count=2, bytes=2000, ms=4.0, busbw_ms=10.0 + 60.0)
    assert totals["all_gather"] == CollectiveTotals(count=2, bytes=600, ms=3.0, busbw_ms=9.0)
    assert totals["other"].count == 1
    metrics = totals["all_reduce"].as_metrics("all_reduce")
    assert metrics["comm_all_reduce_mean_ms"] == 2.0 and metrics["comm_all_reduce_busbw_gbps"] == 70.0 / 4.0
    # 1 MB all-reduced in 1 ms over 2 ranks: 2 MB/ms algorithm bandwidth, 2 (n-1)/n = 1 MB/ms on the bus
    assert bandwidth_gbps("all_reduce", 10**6, 1.0, 2) == pytest.approx((16.0, 8.0))
    assert bandwidth_gbps("all_gather_into_tensor", 10**6, 1.0, 2) == pytest.approx((16.0, 8.0))  # 2 parts
    assert bandwidth_gbps("send", 10**6, 1.0, 2) == pytest.approx((8.0, 8.0))
    assert bandwidth_gbps("all_gather_object", 10, 0.0, 2) == (0.0, 0.0)  # DeepSpeed's exits on this name


def test_the_summary_shows_every_rank_and_the_rank_that_spent_longest():
    per_rank = [
        {"all_reduce": CollectiveTotals(4, 4000, 10.0, 80.0)},
        {"all_reduce": CollectiveTotals(4, 4000, 25.0, 100.0), "send_recv": CollectiveTotals(1, 10, 1.0, 1.0)},
    ]
    lines = comms_summary(per_rank).splitlines()
    assert lines[0].startswith("communication (every rank, --comms_log): type | rank |")
    assert "  all_reduce | 0 | 4 | 4000 | 10.0 | 2.500 | 8.000" in lines
    assert "  all_reduce | 1 | 4 | 4000 | 25.0 | 6.250 | 4.000" in lines
    assert "  all_reduce: longest on rank 1, 2.50x rank 0's" in lines
    assert "  send_recv | 1 | 1 | 10 | 1.0 | 1.000 | 1.000" in lines
    assert not any(line.startswith("  send_recv: longest") for line in lines)  # one rank: nothing to compare


def test_each_op_is_also_counted_under_the_layout_group_it_ran_on():
    from scaletrain.observability.comms_log import group_name
    from scaletrain.parts import ParallelLayout

    layout = ParallelLayout(tp=2, sp=2, dp=2)  # 8 ranks: tensor fastest, then sequence, then data
    assert group_name(layout, (2, 3)) == "tensor"
    assert group_name(layout, (1, 3)) == "sequence"
    assert group_name(layout, (1, 3, 5, 7)) == "sequence x data"  # AutoTP's data-parallel group under SP
    assert group_name(layout, None) == group_name(layout, tuple(range(8))) == "world"
    assert group_name(layout, (4,)) == "self"
    assert group_name(ParallelLayout(tp=2, pp=2, dp=2), (1, 5)) == "pipeline"
    raw = {
        "all_reduce@tensor": {1000: [2, [1.0, 3.0], [0, 0], [10.0, 20.0]]},
        "all_reduce@sequence x data": {500: [1, [2.0], [0], [4.0]]},
        "all_to_all_single@sequence": {100: [4, [1.0] * 4, [0] * 4, [1.0] * 4]},
    }
    assert totals_by_type(raw)["all_reduce"] == CollectiveTotals(count=3, bytes=2500, ms=6.0, busbw_ms=78.0)
    by_group = totals_by_type(raw, by_group=True)
    assert by_group["all_reduce over tensor"] == CollectiveTotals(count=2, bytes=2000, ms=4.0, busbw_ms=70.0)
    assert by_group["all_to_all over sequence"].count == 4 and set(by_group) == {
        "all_reduce over tensor",
        "all_reduce over sequence x data",
        "all_to_all over sequence",
    }
    lines = comms_summary([{"all_reduce": by_group["all_reduce over tensor"], **by_group}]).splitlines()
    assert "communication by group: type over group | rank | count | bytes | total ms | mean ms | bus Gbit/s" in lines
    assert "  all_reduce over tensor | 0 | 2 | 2000 | 4.0 | 2.000 | 17.500" in lines


KNOWN_SEQUENCE = """
import json, sys, time
import torch, deepspeed.comm as dist
from scaletrain.distributed.world import init_distributed, read_launch_env
init_distributed(read_launch_env())  # the shm all-reduce op loaded under the pipeline's build lock, as in train.py
from deepspeed.comm.comm import comms_logger
x = torch.ones(2_000_000)

def timed(op, n):
    walls = []
    for _ in range(n):
        dist.barrier()
        started = time.perf_counter()
        op()
        walls.append((time.perf_counter() - started) * 1e3)
    return walls

dist.broadcast(x, 0)  # warm-ups, not logged: the first op of a kind sets up its buffers
dist.all_reduce(x)
# DeepSpeed's own logger first, on broadcasts
dist.configure(enabled=True, prof_all=True, verbose=False, debug=False)
raw_walls = timed(lambda: dist.broadcast(x, 0), 5)
raw_logged = list(comms_logger.get_raw_data()["broadcast"].values())[0][1]
dist.configure(enabled=False)
comms_logger.reset_data()

from scaletrain.observability.comms_log import CommLog
from scaletrain.parts import ParallelLayout
comm = CommLog(ParallelLayout(dp=dist.get_world_size()))
walls = timed(lambda: dist.all_reduce(x), 6)
metrics = comm.window()
logged = list(comms_logger.get_raw_data().get("all_reduce", {{}}).values())
after = timed(lambda: dist.all_reduce(x), 3)
second = comm.window()
# each rank alone in a group of one: no bus traffic, whatever the world's size (the op's own group counts)
alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
for _ in range(2):
    dist.all_reduce(x, group=alone)
solo = comm.window()
comm.close()
json.dump({{"raw_walls": raw_walls, "raw_logged": raw_logged, "walls": walls, "metrics": metrics, "after": after,
           "second": second, "solo": solo}}, open({out!r} + f"/rank{{dist.get_rank()}}.json", "w"))
from scaletrain.distributed.world import teardown_distributed
teardown_distributed(dist.get_rank())  # and its shared-memory all-reduce buffer
"""


@pytest.mark.slow  # 2 ranks
def test_per_op_latencies_add_up_to_the_wall_time_of_known_collectives(tmp_path, cache_dir):
    script = tmp_path / "known.py"
    script.write_text(KNOWN_SEQUENCE.format(out=str(tmp_path)))
    check_ok(launch(script, [], "deepspeed", cache_dir, nprocs=2))
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # DeepSpeed 0.19.8: the k-th op is logged with the total of the first k (so the correction is still needed)
        raw, raw_walls = r["raw_logged"], r["raw_walls"]
        assert all(b > a for a, b in zip(raw[:-1], raw[1:], strict=True)), raw
        for k in range(len(raw)):  # each figure is (most of) the time of every op so far ...
            assert raw[k] >= 0.5 * sum(raw_walls[: k + 1]), (k, raw, raw_walls)
        assert raw[-1] > raw_walls[-1] + 0.5 * sum(raw_walls[:-1]), (raw, raw_walls)  # ... not of its own op
        # corrected: each op its own time, within its wall time; together most of the sequence's wall time
        m = r["metrics"]
        assert m["comm_all_reduce_count"] == 6 and m["comm_all_reduce_bytes"] == 6 * 8_000_000
        assert 0.5 * sum(r["walls"]) <= m["comm_all_reduce_ms"] <= sum(r["walls"]) + 1.0, (m, r["walls"])
        assert m["comm_all_reduce_mean_ms"] <= max(r["walls"]) + 1.0
        assert m["comm_all_reduce_busbw_gbps"] > 0
        # the next window counts only its own ops (the running total carries over, the records do not)
        s = r["second"]
        assert s["comm_all_reduce_count"] == 3 and s["comm_all_reduce_ms"] <= sum(r["after"]) + 1.0
        # an all-reduce on a one-rank group moves nothing on the bus (with the world's size it would be > 0)
        solo = r["solo"]
        assert solo["comm_all_reduce_count"] == 2 and solo["comm_all_reduce_busbw_gbps"] == 0.0, solo


@pytest.mark.slow  # a 2-rank run of 4 steps
def test_comms_log_reports_each_window_and_a_summary(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    proc = launch(
        REPO / "train.py",
        [
            "--config",
            "ds_configs/zero2.json",
            "--output_dir",
            str(run_dir),
            "--max_steps",
            "4",
            *FAST_FLAGS,
            "--comms_log",
            "--no-export_hf_at_end",
        ],
        "deepspeed",
        cache_dir,
        nprocs=2,
    )
    check_ok(proc)
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        # ZeRO-2 reduces gradients with all-reduces, plus one step agreement per step; ZeRO's all-gather
        assert r["comm_all_reduce_count"] >= 2 and r["comm_all_gather_count"] >= 2
        # per-op figures: the window's communication fits in its wall time (running totals would not)
        window_ms = 2 * r["step_time_s"] * 1000
        assert r["comm_all_reduce_ms"] + r["comm_all_gather_ms"] <= window_ms, (r, window_ms)
    output = proc.stdout + proc.stderr
    assert "communication (every rank, --comms_log): type | rank | count" in output
    for rank in (0, 1):  # every rank's totals, gathered to rank 0's table
        assert re.search(rf"^  all_reduce \| {rank} \| [1-9]\d* \| ", output, re.M), output[-3000:]
    assert re.search(r"^  all_reduce: longest on rank [01], \d+\.\d\dx rank [01]'s$", output, re.M)


def test_without_the_flag_nothing_is_logged(tmp_path):
    from scaletrain.config.cli import parse_run_config

    assert not parse_run_config([]).logging.comms_log
    assert parse_run_config(["--comms_log"]).logging.comms_log
    assert Path(REPO / "scaletrain" / "observability" / "comms_log.py").exists()
