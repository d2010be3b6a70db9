"""References DeepSpeed leaves behind after engine.destroy(): a ZeRO-3 engine's modules on the global forward-module
stack and in a class-wide functools cache, and a pipeline engine's grid and process groups in the point-to-point
layer's globals. Left there, they keep the process groups alive until the interpreter exits, where gloo's threads can
abort a finished run. Proven by tests/e2e/test_pipeline.py::test_a_run_frees_its_process_groups_before_exit[zero3-*,
zero1_pp2-*]."""

from __future__ import annotations

from typing import Any

from scaletrain.engine.ds_internals.guard import Hook

_RELEASE = "freeing a ZeRO-3 engine's process groups before exit"


def _caches(function: object) -> list[Any]:
    """Every functools cache in `function` or inside its decorators' closures."""
    found: list[Any] = []  # each has cache_clear()
    pending: list[object] = [function]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen or not callable(current):
            continue
        seen.add(id(current))
        if hasattr(current, "cache_clear"):
            found.append(current)
        for cell in getattr(current, "__closure__", None) or ():
            try:
                pending.append(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                pass
        if hasattr(current, "__wrapped__"):
            pending.append(current.__wrapped__)
    return found


def _no_cache(function: object) -> str | None:
    # If DeepSpeed dropped the cache, the leak it caused may be fixed: say so rather than clear nothing in silence.
    return None if _caches(function) else "no longer carries a functools cache (if the leak is fixed, drop this hook)"


FWD_MODULE_STACK = Hook("deepspeed.runtime.zero.parameter_offload", "FWD_MODULE_STACK", _RELEASE)
PARAMS_TO_RELEASE = Hook(
    "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator",
    "_PartitionedParameterCoordinator__params_to_release",
    _RELEASE,
    problem=_no_cache,
)
PIPE_P2P_GROUPS = Hook("deepspeed.runtime.pipe.p2p", "_groups", _RELEASE)
PIPE_P2P_GRID = Hook("deepspeed.runtime.pipe.p2p", "_grid", _RELEASE)
# Ulysses' all-to-all finds its group by name in this module-level registry (filled by UlyssesSPAttentionHF).
ULYSSES_GROUPS = Hook("deepspeed.sequence.layer", "_all_to_all_groups", _RELEASE)


def release_zero3_references(module) -> None:
    """Drop the module-level references a destroyed ZeRO-3 engine leaves behind (DeepSpeed 0.19,
    deepspeed/runtime/zero): its modules on the global forward-module stack, and a class-wide `functools.lru_cache`
    on PartitionedParameterCoordinator.__params_to_release, keyed by coordinator and module."""
    stack = FWD_MODULE_STACK.resolve()
    PARAMS_TO_RELEASE.resolve()  # the cache we know of must still be there
    coordinator = PARAMS_TO_RELEASE.owner_object()
    own = {id(sub) for sub in module.modules()}  # a forward cut short leaves submodules there too
    stack[:] = [sub for sub in stack if id(sub) not in own]
    for attribute in vars(coordinator).values():
        for cache in _caches(attribute):
            cache.cache_clear()


def release_pipeline_references() -> None:
    """Drop the module-level references of DeepSpeed's pipeline point-to-point layer (deepspeed/runtime/pipe/p2p.py
    keeps the grid and one process group per pair of adjacent stages in globals, alive after the engine is gone)."""
    PIPE_P2P_GROUPS.resolve()
    PIPE_P2P_GRID.resolve()
    from deepspeed.runtime.pipe import p2p

    p2p._groups = None
    p2p._grid = None


def release_sequence_group(group) -> None:
    """Drop a sequence-parallel group from the registry of groups Ulysses' all-to-all reads it from by name
    (deepspeed/sequence/layer.py), where it would outlive the engine."""
    ULYSSES_GROUPS.resolve().pop(group.group_name, None)
