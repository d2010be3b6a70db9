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
    for bad in ({"dp": 0}, {"tp": -2}, {"pp": 1.5}):  # the layout validates itself, however it is made
        with pytest.raises(AssertionError, match="whole numbers of at least 1"):
            ParallelLayout(**bad)


def test_a_launch_is_data_parallel_until_the_runs_layout_is_applied():
    dist = DistInfo.launched(rank=5, local_rank=1, world_size=8, launcher="srun")
    assert dist.layout == ParallelLayout(dp=8) and dist.coords == Coordinates(dp=5)
    placed = apply_layout(ParallelArgs(tensor_parallel_size=2), dist)
    assert placed.layout == ParallelLayout(tp=2, dp=4) and placed.coords == Coordinates(tp=1, dp=2)
    assert dist.layout == ParallelLayout(dp=8)  # a new value: the launch's is left as it was
    assert placed.world_size == dist.world_size == 8  # the layout's size is the world's: one number, not two
    with pytest.raises(AssertionError):
        DistInfo.launched(rank=8, local_rank=0, world_size=8, launcher="srun")


def test_the_launch_line_names_each_model_parallel_group_with_its_hosts():
    from scaletrain.distributed.layout import describe_groups

    hosts = ["n1", "n1", "n2", "n2", "n1", "n1", "n2", "n2"]
    assert describe_groups(ParallelLayout(dp=8), hosts) == ""  # data parallelism alone: nothing to add
    tp_pp = describe_groups(ParallelLayout(tp=2, pp=2, dp=2), ["n1"] * 4 + ["n2"] * 4)
    assert tp_pp == (
        "tensor groups 0-1@n1, 2-3@n1, 4-5@n2, 6-7@n2; pipeline groups 0,4@n1+n2, 1,5@n1+n2, 2,6@n1+n2, 3,7@n1+n2"
    )
    many = describe_groups(ParallelLayout(tp=2, dp=8), ["n1"] * 8 + ["n2"] * 8)  # 8 groups: 4 named, 4 counted
    assert many == "tensor groups 0-1@n1, 2-3@n1, 4-5@n1, 6-7@n1 and 4 more"
    assert describe_groups(ParallelLayout(tp=2, dp=4), hosts) == ("tensor groups 0-1@n1, 2-3@n2, 4-5@n1, 6-7@n2")
    assert describe_groups(ParallelLayout(sp=4, dp=2), hosts) == "sequence groups 0-3@n1+n2, 4-7@n1+n2"


def test_a_tensor_group_across_nodes_is_refused_unless_allowed():
    from scaletrain.distributed.layout import check_tensor_groups_within_nodes
    from scaletrain.errors import UsageError

    inside = ParallelLayout(tp=2, dp=2)
    check_tensor_groups_within_nodes(inside, ["n1", "n1", "n2", "n2"], allow_cross_node=False)
    # One rank per node (srun with --ntasks-per-node=1): each tensor group of 2 spans two nodes.
    with pytest.raises(UsageError) as refused:
        check_tensor_groups_within_nodes(inside, ["n1", "n2", "n3", "n4"], allow_cross_node=False)
    assert str(refused.value).startswith(
        "--tensor_parallel_size 2: tensor group 0-1@n1+n2 spans nodes (2 of 2 groups do), so its all-reduces"
    )
    assert "launch a multiple of 2 ranks on each node (this launch has 1 per node)" in refused.value.hint
    assert "--allow_cross_node_tensor_parallel" in refused.value.hint
    # 3 ranks on one node and 1 on the other: only the second group spans them.
    with pytest.raises(UsageError, match=r"tensor group 2-3@n1\+n2 spans nodes \(1 of 2 groups do\)") as uneven:
        check_tensor_groups_within_nodes(inside, ["n1", "n1", "n1", "n2"], allow_cross_node=False)
    assert "(this launch has 1 to 3 per node)" in uneven.value.hint
    check_tensor_groups_within_nodes(inside, ["n1", "n2", "n3", "n4"], allow_cross_node=True)
    # Pipeline and sequence groups may span nodes: stage-to-stage sends are what crosses them in a large layout.
    check_tensor_groups_within_nodes(ParallelLayout(pp=2), ["n1", "n2"], allow_cross_node=False)


def test_a_launch_is_checked_on_its_own_layout_and_a_plan_on_the_planned_clusters():
    from scaletrain.config import PlanningArgs
    from scaletrain.distributed.layout import place_ranks
    from scaletrain.errors import UsageError

    launch = DistInfo.launched(rank=1, local_rank=1, world_size=4, launcher="deepspeed")
    sizes = ParallelArgs(tensor_parallel_size=2)
    placed, layout = place_ranks(sizes, PlanningArgs(), launch)
    assert placed.layout == layout == ParallelLayout(tp=2, dp=2) and placed.coords.tp == 1
    # --plan for 4 nodes of 8 GPUs from a one-process launch: the launch keeps its ranks, the checks get 32 GPUs'.
    one = DistInfo.launched(rank=0, local_rank=0, world_size=1, launcher="python")
    planning = PlanningArgs(plan=True, num_gpus=8, num_nodes=4)
    placed, layout = place_ranks(ParallelArgs(tensor_parallel_size=8, pipeline_parallel_size=2), planning, one)
    assert placed == one and layout == ParallelLayout(tp=8, pp=2, dp=2)
    with pytest.raises(UsageError, match="--tensor_parallel_size 3 does not divide --num_gpus 8"):
        place_ranks(ParallelArgs(tensor_parallel_size=3), planning, one)
    with pytest.raises(UsageError, match=r"does not divide the 32 planned GPUs"):
        place_ranks(ParallelArgs(pipeline_parallel_size=3), planning, one)
