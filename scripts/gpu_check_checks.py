"""The GPU check's checks: losses against the fp32 reference, peak memory against the plan, QLoRA's memory against
ZeRO-3's, DPO's first loss, and the exit code they make. See scripts/gpu_check.py."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from scripts.gpu_check_rows import CHECK_FAILED, FAILED, OK, Row

REPO = Path(__file__).resolve().parents[1]

LOSS_RTOL = 2e-2  # bf16 rounds to ~3 significant digits
DPO_LOG2_ATOL = 1e-2  # policy == reference at step 1, up to bf16 rounding between the two forwards
MEMORY_MARGIN = 0.25  # the plan's working memory is an estimate; allocator slack and buffers come on top


def loss_check(losses: list, reference: list, rtol: float = LOSS_RTOL) -> tuple:
    """(passed, text): the first len(reference) losses each within rtol (relative) of the reference's."""
    if len(losses) < len(reference) or not reference:
        return False, f"loss vs fp32: {len(losses)} losses against {len(reference)} reference losses"
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[: len(reference)], reference, strict=True))
    passed = worst <= rtol
    return passed, (
        f"loss vs fp32, first {len(reference)} steps: max rel. diff {worst:.1e} {'<=' if passed else '>'} {rtol:g}"
    )


def memory_check(peak_gb: float | None, planned_gb: float | None, margin: float = MEMORY_MARGIN) -> tuple:
    """(passed, text): the measured peak at most `margin` above the plan; (True, '') when either is missing."""
    if peak_gb is None or planned_gb is None:
        return True, ""
    passed = peak_gb <= planned_gb * (1 + margin)
    return passed, (f"peak/plan {peak_gb / planned_gb:.2f} {'<=' if passed else '>'} {1 + margin:g}")


def qlora_memory_check(qlora_gb: float | None, zero3_gb: float | None) -> tuple:
    """(passed, text): QLoRA's peak below the full ZeRO-3 run's on the same model and batch; (True, '') when either
    is missing (a CPU, or zero3 not run)."""
    if qlora_gb is None or zero3_gb is None:
        return True, ""
    passed = qlora_gb < zero3_gb
    return passed, f"peak vs zero3 {qlora_gb:.2f} {'<' if passed else '>='} {zero3_gb:.2f} GB"


def dpo_check(row: Row, records: list) -> None:
    """Step 1's loss against log 2, and pairs/s (the median step's samples_per_s, which counts pairs)."""
    if row.losses:
        diff = abs(row.losses[0] - math.log(2))
        _record(row, diff <= DPO_LOG2_ATOL, f"step-1 loss {row.losses[0]:.4f} vs log 2: diff {diff:.1e}")
    pairs = [r["samples_per_s"] for r in records if "samples_per_s" in r]
    if pairs:
        row.checks.append(f"pairs/s {statistics.median(pairs):.2f} (median step)")


def apply_checks(rows: dict, specs_by_name: dict, planned: dict, reference: list | None) -> None:
    """The loss check on the ZeRO runs against fp32_ref, the memory check on every run with a plan figure, and
    QLoRA's peak against zero3's."""
    for name, row in rows.items():
        if row.status != OK:
            continue
        spec = specs_by_name[name]
        if name in ("zero1", "zero2", "zero3"):
            if reference is None:
                row.checks.append("loss vs fp32: no reference (fp32_ref did not run)")
            else:
                _record(row, *loss_check(row.losses, reference))
        if spec.plan_key and planned:
            row.planned_gb = planned.get(spec.plan_key)
            _record(row, *memory_check(row.peak_gb, row.planned_gb))
        if name == "qlora" and rows.get("zero3") is not None and rows["zero3"].status in (OK, CHECK_FAILED):
            _record(row, *qlora_memory_check(row.peak_gb, rows["zero3"].peak_gb))


def _record(row: Row, passed: bool, text: str) -> None:
    """A check's text on its row, failing the row if the check did not pass; nothing for an empty text."""
    if not text:
        return
    if passed:
        row.checks.append(text)
    else:
        row.fail_check(text)


def exit_code(rows: dict) -> int:
    return 1 if any(row.status in (FAILED, CHECK_FAILED) for row in rows.values()) else 0
