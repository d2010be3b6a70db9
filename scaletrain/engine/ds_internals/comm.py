"""DeepSpeed's communication layer: the shm all-reduce build skipped on one CPU rank, ShmAllReduce (large CPU sums
through DeepSpeed's shared-memory kernel instead of gloo, --cpu_shm_allreduce), and the comms logger made to record
each op's own latency (--comms_log)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from scaletrain.engine.ds_internals.guard import Hook, moved

# Only speed depends on it: tests/engine/test_ds_internals.py checks that it resolves.
SHM_BUILD = Hook("deepspeed.comm.torch", "build_shm_op", "skipping the shm all-reduce build on one CPU rank")
# Proven by tests/e2e/test_pipeline.py::test_loss_and_update_do_not_depend_on_accumulation_or_rank_count (its 2-rank
# run).
_SHM, _SHM_INSTEAD = "the shared-memory all-reduce of CPU ranks (--cpu_shm_allreduce)", "pass --no-cpu_shm_allreduce"
COMM_BACKEND = Hook("deepspeed.comm.comm", "cdb", _SHM, _SHM_INSTEAD)
BACKEND_ALL_REDUCE = Hook("deepspeed.comm.torch:TorchBackend", "all_reduce", _SHM, _SHM_INSTEAD)
SHM_KERNEL_LEVEL = Hook("deepspeed.comm.torch:TorchBackend", "shm_vector_kernel_level", _SHM, _SHM_INSTEAD)  # instance
SHM_COMM_OP = Hook("deepspeed.comm.torch:TorchBackend", "shm_comm_op", _SHM, _SHM_INSTEAD)  # instance
# Proven by tests/observability/test_comm_log.py: per-op latencies against wall-clock times of known collectives,
# DeepSpeed's own figures still running totals, and no bus traffic for an all-reduce on a one-rank group
# (COMMS_MSG_SIZE).
_COMMS, _COMMS_INSTEAD = "the communication log (--comms_log)", "train without --comms_log"
COMMS_LOGGER = Hook("deepspeed.comm.comm", "comms_logger", _COMMS, _COMMS_INSTEAD)
COMMS_APPEND = Hook("deepspeed.utils.comms_logging:CommsLogger", "append", _COMMS, _COMMS_INSTEAD)
COMMS_RECORDS = Hook("deepspeed.utils.comms_logging:CommsLogger", "comms_dict", _COMMS, _COMMS_INSTEAD)  # instance
COMMS_MSG_SIZE = Hook("deepspeed.comm.comm", "get_msg_size_from_args", _COMMS, _COMMS_INSTEAD)


def skip_shm_op_build() -> None:
    """Replace DeepSpeed's shm all-reduce build by a no-op: a single CPU rank never communicates, and the build
    takes tens of seconds to minutes on a fresh machine."""
    # importlib (in Hook): `import deepspeed.comm.torch` would resolve to the torch package re-exported there.
    SHM_BUILD.resolve()
    SHM_BUILD.owner_object().build_shm_op = lambda: None


class ShmAllReduce:
    """Large synchronous all-reduce sums over every rank, sent through DeepSpeed's shared-memory kernel
    (torch.ops.deepspeed.inference_all_reduce_, built for inference) instead of the backend's (gloo) all_reduce;
    everything else (other groups, other ops, async calls, small or strided tensors, types the host's kernel cannot
    sum) goes to the original. Installed on DeepSpeed's backend instance after
    deepspeed.init_distributed, so the comms logger still sees each call as an all_reduce.

    Every rank routes a call the same way: the tests below depend only on what all ranks of an all-reduce share
    (its group, op, dtype and size), so a call never meets gloo on one rank and shared memory on another."""

    def __init__(self, world_size: int, min_bytes: int):
        import torch

        self.world_size, self.min_bytes = world_size, min_bytes
        self.calls, self.bytes = 0, 0
        backend = COMM_BACKEND.resolve()
        if backend is None:
            raise RuntimeError("ShmAllReduce: deepspeed.init_distributed has not run")
        self._original = BACKEND_ALL_REDUCE.on(backend)
        # Both set on the instance; the level only where DeepSpeed built and loaded the kernel.
        level = SHM_KERNEL_LEVEL.on(backend) if SHM_COMM_OP.on(backend) is not None else 0
        self._kernel = getattr(getattr(torch.ops, "deepspeed", None), "inference_all_reduce_", None)
        # The kernel's fp32 sums need AVX2 (level 1), its bf16/fp16 ones AVX-512BW (level 2).
        self.dtypes = (
            {torch.float32} if level == 1 else {torch.float32, torch.bfloat16, torch.float16} if level >= 2 else set()
        )
        self.usable = self._kernel is not None and bool(self.dtypes)
        self._backend = backend

    def install(self) -> None:
        import torch

        route = self.routes
        kernel, original = self._kernel, self._original

        @torch.compiler.disable
        def all_reduce(tensor, op=None, group=None, async_op=False):
            if route(tensor, op, group, async_op):
                kernel(tensor)
                return None
            return original(
                tensor=tensor, op=torch.distributed.ReduceOp.SUM if op is None else op, group=group, async_op=async_op
            )

        self._backend.all_reduce = all_reduce

    def uninstall(self) -> None:
        self._backend.__dict__.pop("all_reduce", None)

    def routes(self, tensor, op, group, async_op) -> bool:
        """Whether this all-reduce goes through shared memory (and counts it)."""
        import torch.distributed as tdist

        nbytes = tensor.numel() * tensor.element_size()
        if (
            async_op
            or nbytes < self.min_bytes
            or tensor.dtype not in self.dtypes
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or not _is_sum(op)
        ):
            return False
        if (
            group is not None
            and group is not tdist.GroupMember.WORLD
            and tdist.get_world_size(group) != self.world_size
        ):
            return False
        self.calls += 1
        self.bytes += nbytes
        return True


def _is_sum(op) -> bool:
    """DeepSpeed's ReduceOp.SUM (an Enum), torch's (a pybind enum: also named), or the default (None)."""
    return op is None or getattr(op, "name", None) == "SUM"


def _group_ranks(func, args: tuple, kwargs: dict) -> tuple | None:
    """The global ranks of the group a deepspeed.comm op runs on (a send or receive: this rank and its peer); None for
    the world (no group given, or not found)."""
    import torch.distributed as torch_dist

    try:
        arguments = inspect.signature(func).bind_partial(*args, **kwargs).arguments
        group, peer = arguments.get("group"), arguments.get("dst", arguments.get("src"))
        if group is None and isinstance(peer, int):
            return tuple(sorted({torch_dist.get_rank(), peer}))
        return None if group is None else tuple(torch_dist.get_process_group_ranks(group))
    except (TypeError, ValueError, RuntimeError):
        return None


def per_op_comm_latencies(
    bandwidth: Callable[[str, int, float, int | None], tuple], group_name: Callable[[tuple | None], str] | None = None
):
    """DeepSpeed's comms logger, made to record each op's own latency with `bandwidth(op, bytes, ms, group size or
    None for the world) -> (algbw, busbw)`; its records keep DeepSpeed's format, {name: {bytes: [count, [ms], [algbw],
    [busbw]]}}, each name followed by "@" and `group_name(the group's global ranks, None for the world)` when given.

    DeepSpeed 0.19.8 hands CommsLogger.append the running total of every op of a name so far (timed_op reads its
    timer with reset=False) as the op's latency: the instance's append is replaced by one that keeps each op's own
    time, and refuses a total that shrinks (a fixed DeepSpeed). The logger is not told which group an op ran on, so a
    subgroup's op (a tensor-parallel all-reduce) would get the world's bus bandwidth, and could not be told from a
    data-parallel one: get_msg_size_from_args, which timed_op calls with the op and its arguments just before it runs,
    is wrapped to note the group's ranks."""
    logger = COMMS_LOGGER.resolve()
    COMMS_APPEND.on(logger)
    records = COMMS_RECORDS.on(logger)
    comm_module = COMMS_MSG_SIZE.owner_object()
    size_of = COMMS_MSG_SIZE.on(comm_module)
    running: dict[str, float] = {}  # the last running total per op name
    pending = {}  # the group of the op being timed (ops are timed one at a time: each is made blocking)

    def msg_size_noting_group(func, *args, **kwargs):
        pending["group"] = _group_ranks(func, args, kwargs)
        return size_of(func, *args, **kwargs)

    comm_module.get_msg_size_from_args = msg_size_noting_group

    def append(raw_name, record_name, latency, msg_size):
        own = latency - running.get(record_name, 0.0)
        if own < -1e-6:
            raise moved(
                COMMS_APPEND.where,
                "received a latency below the previous one of the same op, so no longer a running total",
                _COMMS,
                _COMMS_INSTEAD,
            )
        running[record_name] = latency
        group = pending.pop("group", None)
        algbw, busbw = bandwidth(raw_name, msg_size, own, None if group is None else len(group))
        name = record_name if group_name is None else f"{record_name}@{group_name(group)}"
        entry = records.setdefault(name, {}).setdefault(msg_size, [0, [], [], []])
        entry[0] += 1
        entry[1].append(own)
        entry[2].append(algbw)
        entry[3].append(busbw)

    logger.append = append
    return logger
