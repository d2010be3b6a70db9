"""DeepSpeed's op builders and torch's build directory, which engine/ops.py needs to load DeepSpeed's compiled ops
under its own lock (so a stale torch build lock cannot hang a run); py-cpuinfo's probe, which DeepSpeed's CPU op
builders call, answered once per host boot (remember_cpu_info)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import socket
from pathlib import Path

from scaletrain.engine.ds_internals.guard import Hook, check_version

# Proven by tests/engine/test_ops.py::test_stale_build_locks_are_removed_and_a_two_rank_offload_run_finishes.
_OPS = "loading DeepSpeed's compiled ops under scaletrain's build lock"
BUILD_DIRECTORY = Hook("torch.utils.cpp_extension", "_get_build_directory", _OPS)
INSTALLED_OPS = Hook("deepspeed.git_version_info", "installed_ops", _OPS)
CREATE_OP_BUILDER = Hook("deepspeed.accelerator.abstract_accelerator:DeepSpeedAccelerator", "create_op_builder", _OPS)
BUILDER_LOAD = Hook("deepspeed.ops.op_builder.builder:OpBuilder", "load", _OPS)
BUILDER_COMPATIBLE = Hook("deepspeed.ops.op_builder.builder:OpBuilder", "is_compatible", _OPS)
BUILDER_NAME = Hook("deepspeed.ops.op_builder.builder:OpBuilder", "name", _OPS)  # on the instance only
# Proven by tests/engine/test_ops.py::test_the_cpu_probe_runs_once_per_host_boot.
CPU_INFO = Hook("cpuinfo", "get_cpu_info", "answering DeepSpeed's CPU op builders' probe of the CPU once per host boot")


def torch_build_directory(op_name: str) -> str:
    """Where torch.utils.cpp_extension builds (and caches) an op: torch's own rule, so the paths agree."""
    return BUILD_DIRECTORY.resolve()(op_name, verbose=False)


def create_op_builder(builder_name: str):
    """This accelerator's DeepSpeed op builder named `builder_name` (None where there is none), its API checked."""
    from deepspeed.accelerator import get_accelerator

    check_version()
    builder = CREATE_OP_BUILDER.on(get_accelerator())(builder_name)
    if builder is not None:
        for hook in (BUILDER_NAME, BUILDER_LOAD, BUILDER_COMPATIBLE):
            hook.on(builder)
    return builder


def op_preinstalled(builder) -> bool:
    """Whether the op was compiled into the DeepSpeed install (DS_BUILD_OPS=1): nothing to build or lock."""
    return bool(INSTALLED_OPS.resolve().get(builder.name, False))


_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def remember_cpu_info(folder: str | None) -> None:
    """py-cpuinfo's get_cpu_info answered from its first answer on this host since it booted. DeepSpeed calls it
    three times per rank to load cpu_adam (its builder's cpu_arch and simd_width, then DeepSpeedCPUAdam), each call
    a fresh interpreter probing the CPU (~1.2 s on 2 cores), and ranks load under one lock, so a 2-rank offload run
    waited ~5 s for them. The answer is kept in this process and, where `folder` is given (the ops' build root), in
    a file named by the host and its boot id: the next rank or run reads it, and nodes that share the folder never
    read each other's. An empty answer (a failed probe) is not kept. Without py-cpuinfo (a DeepSpeed requirement,
    imported only by the ops that probe) there is nothing to answer."""
    if importlib.util.find_spec("cpuinfo") is None:
        return
    module = CPU_INFO.owner_object()
    probe = CPU_INFO.on(module)
    if getattr(probe, "remembered", False):
        return
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:  # not Linux: this process only
        boot = None
    path = Path(folder) / f"cpuinfo-{socket.gethostname()}-{boot}.json" if folder and boot else None
    answer: dict = {}

    def get_cpu_info() -> dict:
        if not answer:
            answer.update(_read_cpu_info(path) or probe())
            if answer and path is not None:
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                try:
                    tmp.write_text(json.dumps(answer))
                    os.replace(tmp, path)
                except OSError:  # a read-only or full folder: the probe runs again in the next process
                    tmp.unlink(missing_ok=True)
        return copy.deepcopy(answer)

    get_cpu_info.remembered = True  # type: ignore[attr-defined]  # a marker on the replacement: installed once
    module.get_cpu_info = get_cpu_info


def _read_cpu_info(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or damaged: probed again
        return {}
    return info if isinstance(info, dict) else {}
