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
import json
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
        notice = build_notice(builder.name, folder)
        if notice:
            say(notice)
        started = time.perf_counter()
        module = builder.load(verbose=False)
        seconds = time.perf_counter() - started
        record_build(folder)
        if notice or seconds > 10:  # also a rebuild nothing foretold: the op's sources or flags changed
            say(f"built DeepSpeed op {builder.name} in {seconds:.0f}s")
    return module


# Measured on the 2-core CPU box of BENCHMARKS.md (a build runs on every core it is given).
BUILD_SECONDS = {"deepspeed_shm_comm": 35, "cpu_adam": 50, "cpu_adagrad": 40, "cpu_lion": 40, "async_io": 180}
BUILD_RECORD = "scaletrain-build.json"  # what an op in a build folder was built with


def build_environment() -> dict:
    """What decides whether torch rebuilds an op it finds built: the interpreter, torch, and DeepSpeed's install (its
    sources' path is in the build's commands)."""
    import sys

    import deepspeed
    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "deepspeed_sources": os.path.dirname(deepspeed.__file__),
    }


def build_notice(op_name: str, folder: str) -> str | None:
    """What is about to be built and why, with about how long it takes; None where the op is built for this
    environment (a load of seconds)."""
    if not glob.glob(os.path.join(folder, "*.so")):
        why = "missing: first use with this torch and DeepSpeed"
    else:
        try:
            with open(os.path.join(folder, BUILD_RECORD)) as record:
                built = json.load(record)
        except (OSError, ValueError):
            return None  # built before records were kept: a rebuild, if any, is said when it is done
        now = build_environment()
        changed = [f"{key} {built.get(key)} -> {now[key]}" for key in now if built.get(key) != now[key]]
        if not changed:
            return None
        why = "built for another environment: " + ", ".join(changed)
    estimate = BUILD_SECONDS.get(op_name)
    how_long = f"about {estimate} s on 2 cores" if estimate else "a minute or more"
    return (
        f"building DeepSpeed op {op_name} in {folder} ({why}): {how_long}, once; "
        "scripts/build_ops.py does it ahead of a job"
    )


def record_build(folder: str) -> None:
    """Note the environment the op in `folder` is built for (after a load, which built it if it had to)."""
    path = os.path.join(folder, BUILD_RECORD)
    try:
        with open(path + ".tmp", "w") as record:
            json.dump(build_environment(), record)
        os.replace(path + ".tmp", path)
    except OSError as err:  # a read-only shared cache: the op is built, only the next notice may be wrong
        log.debug("could not record the build of %s: %s", folder, err)


def comm_ops(accelerator: str, world_size: int) -> list[str]:
    """The op builder deepspeed.init_distributed loads: the shared-memory all-reduce of several CPU ranks."""
    return ["ShareMemCommBuilder"] if accelerator == "cpu" and world_size > 1 else []


def load_ops(names: list[str], say: Callable[[str], None] | None = None) -> None:
    for name in names:
        load_op(name, say)
