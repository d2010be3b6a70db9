"""--comms_log: what this rank's DeepSpeed collectives cost, per logging window and for the whole run, from DeepSpeed's
comms logger. DeepSpeed 0.19.8 records each op's latency as the running total of all ops of that name, so
ds_internals.per_op_comm_latencies recovers each op's own time. The logger starts only after the engine is built (its
start-up broadcasts are not training) and only with --comms_log, since it synchronises after every op and so removes the
overlap of communication with compute. Metrics and the end table: docs/observability.md#communication-log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# deepspeed.comm's op names (its log names) -> the collective type reported
COLLECTIVE_TYPES = {
    "all_reduce": "all_reduce",
    "inference_all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_coalesced": "reduce_scatter",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_object": "all_gather",
    "allgather_fn": "all_gather",
    "all_gather_coalesced": "all_gather",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "send": "send_recv",
    "recv": "send_recv",
    "isend": "send_recv",
    "irecv": "send_recv",
    "batch_isend_irecv": "send_recv",
}
TYPES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send_recv", "other")
AXIS_NAMES = {"tp": "tensor", "sp": "sequence", "dp": "data", "pp": "pipeline"}  # parts.AXES, fastest first


@dataclass
class CollectiveTotals:
    count: int = 0
    bytes: int = 0
    ms: float = 0.0
    busbw_ms: float = 0.0  # sum of bus bandwidth x latency, for the latency-weighted mean bandwidth

    def add(self, other: CollectiveTotals) -> None:
        self.count += other.count
        self.bytes += other.bytes
        self.ms += other.ms
        self.busbw_ms += other.busbw_ms

    def as_metrics(self, name: str) -> dict:
        return {
            f"comm_{name}_count": self.count,
            f"comm_{name}_bytes": self.bytes,
            f"comm_{name}_ms": self.ms,
            f"comm_{name}_mean_ms": self.ms / self.count if self.count else 0.0,
            f"comm_{name}_busbw_gbps": self.busbw_ms / self.ms if self.ms else 0.0,
        }


def collective_type(record_name: str) -> str:
    return COLLECTIVE_TYPES.get(record_name.partition("@")[0], "other")


def group_name(layout, ranks: tuple | None) -> str:
    """The layout axes a group of global ranks spans, as the comms log names it: "tensor", "pipeline", "sequence x
    data" (AutoTP's data-parallel group under sequence parallelism), ...; "world" for every rank (or an op given no
    group), "self" for a group of one."""
    if ranks is None or len(ranks) == layout.world_size:
        return "world"
    if len(ranks) == 1:
        return "self"
    coordinates = [layout.coordinates(rank) for rank in ranks]
    return " x ".join(name for axis, name in AXIS_NAMES.items() if len({getattr(c, axis) for c in coordinates}) > 1)


def bandwidth_gbps(op: str, size: int, ms: float, group_size: int) -> tuple:
    """(algorithm bandwidth, bus bandwidth) in Gbit/s of one op moving `size` bytes in `ms`, by the NCCL-tests
    convention DeepSpeed uses: all-reduce moves 2 (n-1)/n of the buffer per rank on the bus, all-gather and
    reduce-scatter (n-1)/n of the whole (the size given is one rank's part), all-to-all (n-1)/n, the rest 1.
    (DeepSpeed's own function exits the process on an op name it does not list, such as all_gather_object.)"""
    if ms <= 0:
        return 0.0, 0.0
    n, kind = group_size, collective_type(op)
    if kind in ("all_gather", "reduce_scatter"):
        size *= n
    per_ms = size / ms
    if kind == "all_reduce":
        algbw, busbw = 2 * per_ms, per_ms * 2 * (n - 1) / n
    elif kind in ("all_gather", "reduce_scatter", "all_to_all"):
        algbw, busbw = per_ms, per_ms * (n - 1) / n
    else:
        algbw = busbw = per_ms
    return algbw * 8 / 1e6, busbw * 8 / 1e6  # bytes per ms -> Gbit/s


def totals_by_type(raw: dict, by_group: bool = False) -> dict:
    """{type: CollectiveTotals} from the comms logger's records {name[@group]: {bytes: [count, [ms], [algbw],
    [busbw]]}}; `by_group`: {"<type> over <group>": CollectiveTotals} instead, for the names that carry a group."""
    totals: dict = {}
    for name, by_size in raw.items():
        if by_group and "@" not in name:
            continue
        key = f"{collective_type(name)} over {name.partition('@')[2]}" if by_group else collective_type(name)
        bucket = totals.setdefault(key, CollectiveTotals())
        for size, (count, latencies, _, busbws) in by_size.items():
            bucket.add(
                CollectiveTotals(
                    count,
                    count * int(size),
                    float(sum(latencies)),
                    float(sum(b * ms for b, ms in zip(busbws, latencies, strict=True))),
                )
            )
    return totals


class CommLog:
    """The comms logger switched on for the run, read and cleared once per logging window; each op is also counted
    under the layout's group it ran on (`layout`: the run's parts.ParallelLayout)."""

    def __init__(self, layout):
        import deepspeed.comm as ds_comm

        from scaletrain.engine import per_op_comm_latencies

        world = ds_comm.get_world_size()
        # DeepSpeed's logger, its records made per op and named by group, with this module's bandwidth arithmetic
        # over the op's group
        self._logger = per_op_comm_latencies(
            lambda op, size, ms, group: bandwidth_gbps(op, size, ms, group or world),
            lambda ranks: group_name(layout, ranks),
        )
        ds_comm.configure(enabled=True, prof_all=True, verbose=False, debug=False)
        self.run_totals: dict = {}

    def window(self) -> dict:
        """This window's figures as flat metrics (every rank must call it: each clears its own records)."""
        raw = self._logger.get_raw_data()
        window, by_group = totals_by_type(raw), totals_by_type(raw, by_group=True)
        self._logger.reset_data()
        metrics = {}
        for name in TYPES:
            if name in window:
                self.run_totals.setdefault(name, CollectiveTotals()).add(window[name])
                metrics.update(window[name].as_metrics(name))
        for name, totals in sorted(by_group.items()):  # comm_all_reduce_over_tensor_ms, ...
            self.run_totals.setdefault(name, CollectiveTotals()).add(totals)
            slug = name.replace(" x ", "_x_").replace(" ", "_")
            metrics.update({f"comm_{slug}_{key}": getattr(totals, key) for key in ("count", "bytes", "ms")})
        return metrics

    def totals(self) -> dict:
        """This rank's totals over the run, what the last window left included: {type: CollectiveTotals}."""
        self.window()
        return dict(self.run_totals)

    def close(self) -> None:
        import deepspeed.comm as ds_comm

        ds_comm.configure(enabled=False)


def comms_summary(per_rank: list) -> str:
    """Every rank's totals over the run (`per_rank[r]`: rank r's CommLog.totals()), one line per collective type
    and rank, and for each type the rank that spent longest in it against the fastest (a slow link or a straggler);
    then the same lines per type and group ("all_reduce over tensor")."""
    lines = ["communication (every rank, --comms_log): type | rank | count | bytes | total ms | mean ms | bus Gbit/s"]
    for name in TYPES:
        ranks = [(rank, totals[name]) for rank, totals in enumerate(per_rank) if name in totals]
        lines += [_row(name, rank, t) for rank, t in ranks]
        if len(ranks) < 2:
            continue
        slowest, fastest = max(ranks, key=lambda r: r[1].ms), min(ranks, key=lambda r: r[1].ms)
        if fastest[1].ms > 0:
            lines.append(
                f"  {name}: longest on rank {slowest[0]}, {slowest[1].ms / fastest[1].ms:.2f}x rank {fastest[0]}'s"
            )
    grouped = sorted({name for totals in per_rank for name in totals if name not in TYPES})
    if grouped:
        lines.append("communication by group: type over group | rank | count | bytes | total ms | mean ms | bus Gbit/s")
    for name in grouped:
        lines += [_row(name, rank, totals[name]) for rank, totals in enumerate(per_rank) if name in totals]
    return "\n".join(lines)


def _row(name: str, rank: int, t: CollectiveTotals) -> str:
    return (
        f"  {name} | {rank} | {t.count} | {t.bytes} | {t.ms:.1f} | {t.ms / t.count:.3f} | "
        f"{t.busbw_ms / t.ms if t.ms else 0.0:.3f}"
    )
