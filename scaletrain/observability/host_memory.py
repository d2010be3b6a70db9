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
        assert peak is not None and self.start is not None, "own_peak: /proc/self/status reports VmRSS and VmHWM"
        log.info("%s: host memory peak %.0f MiB (+%.0f MiB in it)", self.phase, peak, peak - self.start)
        return peak, peak - self.start


UNLIMITED = 2**60  # a cgroup v1 limit at or above this is "no limit" (the kernel writes 2^63 rounded to a page)


class CgroupMemory:
    """The memory limit of the tightest cgroup this process is in (cgroup v2 `memory.max` or v1
    `memory.limit_in_bytes`, over the group and its ancestors, as the kernel enforces them): under Slurm (and in a
    container) the job's limit, not the host's memory, is what an allocation may use, and /dev/shm pages count in it.
    `in_use` is the group's working set: its usage less its inactive file cache, which the kernel reclaims first."""

    def __init__(self, path: Path, limit: int, in_use: int):
        self.path, self.limit, self.in_use = path, limit, in_use

    @property
    def free(self) -> int:
        return max(self.limit - self.in_use, 0)

    @classmethod
    def of_this_process(cls, proc: Path = Path("/proc/self")) -> CgroupMemory | None:
        """None where no cgroup of this process limits memory (or none can be read: not Linux)."""
        try:
            groups = (proc / "cgroup").read_text().splitlines()
            mounts = (proc / "mountinfo").read_text().splitlines()
        except OSError:
            return None
        tightest = None
        for folder, v2 in _memory_cgroup_folders(groups, mounts):
            for group in (folder, *folder.parents):
                found = _read_group(group, v2)
                if found is not None and (tightest is None or found.free < tightest.free):
                    tightest = found
                if group == _mount_point(folder, mounts):
                    break
        return tightest


def _memory_cgroup_folders(groups: list, mounts: list):
    """(the folder of this process's memory cgroup, whether it is cgroup v2) for each hierarchy that has one."""
    for line in groups:
        number, controllers, path = line.split(":", 2)
        v2 = number == "0" and controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for mount in mounts:
            fields = mount.split()
            dash = fields.index("-")
            fstype, options = fields[dash + 1], fields[dash + 3].split(",")
            if (v2 and fstype == "cgroup2") or (not v2 and fstype == "cgroup" and "memory" in options):
                root, point = fields[3], Path(fields[4])
                if path == root or path.startswith(root.rstrip("/") + "/"):
                    yield point / path[len(root) :].lstrip("/"), v2
                    break


def _mount_point(folder: Path, mounts: list) -> Path:
    points = [Path(m.split()[4]) for m in mounts]
    inside = [p for p in points if p == folder or p in folder.parents]
    return max(inside, key=lambda p: len(p.parts)) if inside else Path("/")


def _read_group(group: Path, v2: bool) -> CgroupMemory | None:
    limit_file, usage_file, inactive = (
        ("memory.max", "memory.current", "inactive_file")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    try:
        text = (group / limit_file).read_text().strip()
        if text == "max" or int(text) >= UNLIMITED:
            return None
        usage = int((group / usage_file).read_text())
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
    except (OSError, ValueError):
        return None
    return CgroupMemory(group, int(text), max(usage - int(stat.get(inactive, 0)), 0))
