"""--cpu_shm_allreduce: gradient all-reduces of CPU ranks on one host through DeepSpeed's shared-memory kernel.

The decision (where the kernel can work) is tested here; the kernel's sums in a real run are tested by
tests/e2e/test_pipeline.py::test_loss_and_update_do_not_depend_on_accumulation_or_rank_count, whose 2-rank ZeRO-2 run
(the kernel on, the default) must train exactly as one rank does, having sent its gradient buckets through it.
"""

from __future__ import annotations

import pytest

from scaletrain.distributed.world import shm_allreduce_refusal
from scaletrain.parts import DistInfo


def _dist(world_size: int, accelerator: str = "cpu") -> DistInfo:
    return DistInfo.launched(
        rank=0, local_rank=0, world_size=world_size, launcher="torchrun/deepspeed", accelerator=accelerator
    )


@pytest.mark.parametrize(
    "dist,local_sizes,cores,usable,refused",
    [
        (_dist(2), ["2", "2"], 2, [True, True], None),  # the deepspeed launcher, 2 ranks on 2 cores
        (_dist(8), ["8"] * 8, 64, [True] * 8, None),
        (_dist(2, "cuda"), ["2", "2"], 2, [True, True], "the cuda backend's collectives are used"),
        (_dist(1), ["1"], 2, [True], "one rank"),
        (_dist(2), [None, None], 2, [True, True], "rank 0: LOCAL_SIZE unset, world size 2"),  # torchrun, srun
        (_dist(4), ["2"] * 4, 2, [True] * 4, "rank 0: LOCAL_SIZE 2, world size 4"),  # two nodes
        (_dist(2), ["2", "3"], 2, [True, True], "rank 1: LOCAL_SIZE 3"),  # one odd rank decides for all
        (_dist(4), ["4"] * 4, 2, [True] * 4, "4 ranks on 2 cores"),  # oversubscribed: spinning ranks starve the others
        (_dist(2), ["2", "2"], 2, [True, False], "rank 1: DeepSpeed's kernel is not loaded"),
    ],
)
def test_the_shared_memory_all_reduce_is_used_only_where_its_kernel_works(dist, local_sizes, cores, usable, refused):
    refusal = shm_allreduce_refusal(dist, local_sizes, cores, usable)
    if refused is None:
        assert refusal is None
    else:
        assert refusal is not None and refused in refusal
