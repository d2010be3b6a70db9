"""The layout object: sizes, each rank's coordinates and the groups along each axis, numbered as DeepSpeed's pipe
topology numbers them (the pipe grid and AutoTP build their groups from that numbering, so ours must match it)."""

from __future__ import annotations

import itertools

import pytest

from scaletrain.config import ParallelArgs
from scaletrain.distributed.layout import apply_layout
from scaletrain.parts import Coordinates, DistInfo, ParallelLayout


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (4, 1, 2), (1, 2, 4), (2, 4, 1), (1, 1, 8)])
def test_groups_and_coordinates_match_deepspeeds_pipe_model_data_topology(tp, pp, dp):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
    assert layout.world_size == topology.world_size() == tp * pp * dp
    for ours, theirs in (("tp", "model"), ("dp", "data"), ("pp", "pipe")):
        assert [list(g) for g in layout.groups(ours)] == topology.get_axis_comm_lists(theirs), ours
    for rank in range(layout.world_size):
        coords, theirs = layout.coordinates(rank), topology.get_coord(rank)
        assert (coords.tp, coords.dp, coords.pp) == (theirs.model, theirs.data, theirs.pipe)
        assert layout.rank_at(coords) == rank


def test_sequence_parallel_groups_sit_inside_each_data_parallel_replica_after_the_tensor_axis():
    layout = ParallelLayout(tp=2, sp=2, dp=2)  # 8 ranks: heads split by TP first, then Ulysses within a TP slice
    assert layout.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.groups("sp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.coordinates(6) == Coordinates(tp=0, sp=1, dp=1, pp=0)
    every = sorted(itertools.chain.from_iterable(layout.groups("sp")))
    assert every == list(range(8))  # each rank in exactly one group of each axis


def test_the_layout_of_a_world_gives_data_parallelism_the_rest_and_refuses_a_world_it_does_not_divide():
    layout = ParallelLayout.of_world(12, tp=2, pp=3)
    assert (layout.tp, layout.sp, layout.pp, layout.dp, layout.model_parallel) == (2, 1, 3, 2, 6)
    assert layout.tp_enabled and layout.pp_enabled and layout.dp_enabled and not layout.sp_enabled
    assert layout.describe() == "tensor parallel 2 x pipeline parallel 3 x data parallel 2"
    assert ParallelLayout(dp=4).describe() == "data parallel 4"
    with pytest.raises(AssertionError):
        ParallelLayout.of_world(10, tp=4)


def test_a_launch_is_data_parallel_until_the_runs_layout_is_applied():
    dist = DistInfo(rank=5, local_rank=1, world_size=8, launcher="srun")
    assert dist.layout == ParallelLayout(dp=8) and dist.coords == Coordinates(dp=5)
    placed = apply_layout(ParallelArgs(tensor_parallel_size=2), dist)
    assert placed.layout == ParallelLayout(tp=2, dp=4) and placed.coords == Coordinates(tp=1, dp=2)
    assert dist.layout == ParallelLayout(dp=8)  # a new value: the launch's is left as it was
    with pytest.raises(AssertionError):
        DistInfo(rank=0, local_rank=0, world_size=8, launcher="srun", layout=ParallelLayout(dp=4))
