"""DeepSpeed's compiled ops (cpu_adam, shm all-reduce, async_io, fused_adam): built once, loaded safely.

DeepSpeed JIT-builds an op on first use through torch.utils.cpp_extension, which guards the build folder with a
bare `lock` file. A process killed while it holds that file (a preempted job, a SIGKILLed rank, a timed-out
test) leaves it behind, and every later run that needs the op then waits on it forever, silently.

`load_op` takes an flock beside the build folder first. The kernel drops an flock when its holder dies, so
whoever holds it knows no other pipeline process is building: a `lock` file found then is stale, and is removed
with a warning. The op is then loaded into DeepSpeed's per-process op cache, so DeepSpeed's own later load (in
deepspeed.init_distributed or deepspeed.initialize) returns at once. `scripts/build_ops.py` builds them ahead of
a job (a login node, a CI warm-up), so that no rank pays minutes of compiling inside a job's time limit.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import time
from contextlib import contextmanager
from collections.abc import Callable, Iterator

from scaletrain.engine import ds_internals

log = logging.getLogger(__name__)

# DeepSpeed's optimizer "type" (lower case) -> the op builder of its host (CPU) implementation under offload.
_CPU_OPTIMIZER_OPS = {
    "adam": "CPUAdamBuilder",
    "adamw": "CPUAdamBuilder",
    "adagrad": "CPUAdagradBuilder",
    "lion": "CPULionBuilder",
}
_FUSED_OPTIMIZER_OPS = {"adam": "FusedAdamBuilder", "adamw": "FusedAdamBuilder", "lion": "FusedLionBuilder"}


def engine_ops(ds_config: dict, accelerator: str) -> list[str]:
    """The op builders deepspeed.initialize will load for this (resolved) config: NVMe I/O, the optimizer's."""
    zero = ds_config.get("zero_optimization") or {}
    offload_opt = (zero.get("offload_optimizer") or {}).get("device", "none")
    offload_param = (zero.get("offload_param") or {}).get("device", "none")
    optimizer = ds_config.get("optimizer") or {}
    opt_type = str(optimizer.get("type", "")).lower()
    ops = []
    if "nvme" in (offload_opt, offload_param):
        ops.append("AsyncIOBuilder")
    if offload_opt in ("cpu", "nvme") and opt_type in _CPU_OPTIMIZER_OPS:
        ops.append(_CPU_OPTIMIZER_OPS[opt_type])
    elif (
        accelerator != "cpu"
        and opt_type in _FUSED_OPTIMIZER_OPS
        and not (optimizer.get("params") or {}).get("torch_adam", False)
    ):
        ops.append(_FUSED_OPTIMIZER_OPS[opt_type])
    return ops


def build_directory(op_name: str) -> str:
    """Where torch.utils.cpp_extension builds (and caches) an op: $TORCH_EXTENSIONS_DIR or ~/.cache/..."""
    return ds_internals.torch_build_directory(op_name)


@contextmanager
def _exclusive(path: str) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_op(builder_name: str, say: Callable[[str], None] | None = None):
    """Load (building first if needed) one DeepSpeed op for this accelerator; None if it does not apply here."""
    say = say or log.warning  # from whichever rank builds: minutes of silence otherwise look like a hang
    builder = ds_internals.create_op_builder(builder_name)
    if builder is None or not builder.is_compatible(verbose=False):
        return None
    if ds_internals.op_preinstalled(builder):  # compiled into the DeepSpeed install: nothing to build
        ds_internals.remember_cpu_info(None)
        return builder.load()
    folder = build_directory(builder.name)
    ds_internals.remember_cpu_info(os.path.dirname(folder.rstrip("/")))  # DeepSpeed's CPU builders probe the CPU
    with _exclusive(folder.rstrip("/") + ".scaletrain-lock"):
        stale = os.path.join(folder, "lock")
        if os.path.exists(stale):
            # We hold the flock, so no pipeline process is building this op: a killed builder left the file.
            log.warning(
                "removing a stale build lock %s (left by a process killed while building %s)", stale, builder.name
            )
            os.unlink(stale)
        fresh = not glob.glob(os.path.join(folder, "*.so"))
        if fresh:
            say(
                f"building DeepSpeed op {builder.name} in {folder} (first use with this torch and DeepSpeed: "
                "minutes, once; scripts/build_ops.py does it ahead of a job)"
            )
        started = time.perf_counter()
        module = builder.load(verbose=False)
        seconds = time.perf_counter() - started
        if fresh or seconds > 10:  # a rebuild: the op's sources, flags or DeepSpeed install path changed
            say(f"built DeepSpeed op {builder.name} in {seconds:.0f}s")
    return module


def comm_ops(accelerator: str, world_size: int) -> list[str]:
    """The op builder deepspeed.init_distributed loads: the shared-memory all-reduce of several CPU ranks."""
    return ["ShareMemCommBuilder"] if accelerator == "cpu" and world_size > 1 else []


def load_ops(names: list[str], say: Callable[[str], None] | None = None) -> None:
    for name in names:
        load_op(name, say)
