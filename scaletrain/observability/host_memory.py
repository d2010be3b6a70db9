"""Host memory of a phase: the most resident memory this process held during it, and how much above what it held
when the phase began, in MiB.

On Linux the kernel's high-water mark (VmHWM) is reset at the start of the phase (/proc/self/clear_refs, 5), so the
peak is the phase's own even when an earlier phase peaked higher. Elsewhere the process's lifetime peak (ru_maxrss)
stands in, and a phase that stays below an earlier peak shows +0."""

from __future__ import annotations

import logging
import resource
import sys
from pathlib import Path

log = logging.getLogger(__name__)

STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _status_mib(field: str) -> float | None:
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _lifetime_peak_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)  # Linux reports KiB, macOS bytes


class HostMemoryPhase:
    """Started before a phase; `report()` after it logs, and returns, (peak MiB during it, peak - start MiB)."""

    def __init__(self, phase: str):
        self.phase = phase
        self.own_peak = _status_mib("VmRSS") is not None and _reset_peak()
        self.start = _status_mib("VmRSS") if self.own_peak else _lifetime_peak_mib()

    def report(self) -> tuple:
        peak = _status_mib("VmHWM") if self.own_peak else _lifetime_peak_mib()
        log.info("%s: host memory peak %.0f MiB (+%.0f MiB in it)", self.phase, peak, peak - self.start)
        return peak, peak - self.start
