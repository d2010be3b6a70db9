"""The ground floor every wing may import: the launch (DistInfo), its parallel layout (ParallelLayout, one type for
the runtime, the checks and the planners) with a rank's coordinates in it, and the checkpoint a run continues
(ResumePoint). All frozen: what changes during a run (the accelerator once the process group exists, the layout the
pre-flight sets) is a new value. It names no type of any wing, not even for annotations: the plan a pre-flight
makes of a whole run (scaletrain/plan.py) sits above the wings, with the composition root.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

AXES = ("tp", "sp", "dp", "pp")  # fastest-varying first: rank = ((pp x DP + dp) x SP + sp) x TP + tp


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits on each axis of the layout."""

    tp: int = 0  # its shard of each tensor-parallel layer
    sp: int = 0  # which 1/SP of each block's tokens it holds
    dp: int = 0  # its data-parallel replica: which slice of each global batch it reads
    pp: int = 0  # its pipeline stage


@dataclass(frozen=True)
class ParallelLayout:
    """How the world's ranks split: tensor (TP), sequence (SP), pipeline (PP) and data (DP) parallel sizes, with
    TP x SP x PP x DP the world. Ranks are numbered tensor axis fastest, pipeline axis slowest, as DeepSpeed's
    PipeModelDataParallelTopology (axes pipe, data, model) numbers them: a tensor- or sequence-parallel group is
    consecutive ranks (inside a node), and a pipeline stage's data-parallel replicas are consecutive too."""

    tp: int = 1
    sp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self):
        bad = {axis: size for axis, size in self.sizes().items() if not (isinstance(size, int) and size >= 1)}
        assert not bad, f"parallel sizes must be whole numbers of at least 1: {bad}"

    @classmethod
    def of_world(cls, world_size: int, tp: int = 1, sp: int = 1, pp: int = 1) -> ParallelLayout:
        """The layout of `world_size` ranks with these model-parallel sizes; data parallelism takes the rest."""
        assert world_size % (tp * sp * pp) == 0, f"{tp} x {sp} x {pp} does not divide {world_size} ranks"
        return cls(tp, sp, pp, world_size // (tp * sp * pp))

    @property
    def world_size(self) -> int:
        return self.tp * self.sp * self.pp * self.dp

    @property
    def model_parallel(self) -> int:
        """The ranks one replica of the model spans (tensor x sequence x pipeline)."""
        return self.tp * self.sp * self.pp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def sizes(self) -> dict:
        """{"tp": TP, "sp": SP, "dp": DP, "pp": PP}, fastest axis first."""
        return {axis: getattr(self, axis) for axis in AXES}

    def coordinates(self, rank: int) -> Coordinates:
        assert 0 <= rank < self.world_size, f"rank {rank} outside a world of {self.world_size}"
        found = {}
        for axis, size in self.sizes().items():
            rank, found[axis] = divmod(rank, size)
        return Coordinates(**found)

    def rank_at(self, coords: Coordinates) -> int:
        rank = 0
        for axis in reversed(AXES):
            rank = rank * getattr(self, axis) + getattr(coords, axis)
        return rank

    def group(self, axis: str, rank: int) -> tuple:
        """The ranks that share every coordinate of `rank` but the one on `axis` (its tensor-parallel group for
        "tp", its data-parallel replicas for "dp", ...), in order of that coordinate."""
        coords = self.coordinates(rank)
        return tuple(self.rank_at(dataclasses.replace(coords, **{axis: k})) for k in range(getattr(self, axis)))

    def groups(self, axis: str) -> list:
        """Every group along `axis`, each a tuple of ranks, ordered by their first rank."""
        return sorted({self.group(axis, rank) for rank in range(self.world_size)})

    def describe(self) -> str:
        """ "tensor parallel 2 x data parallel 4": the model-parallel kinds in use, then data parallelism."""
        names = (("tp", "tensor"), ("sp", "sequence"), ("pp", "pipeline"))
        used = [f"{name} parallel {getattr(self, axis)}" for axis, name in names if getattr(self, axis) > 1]
        return " x ".join([*used, f"data parallel {self.dp}"])


def ulysses_split_problem(heads: int, kv_heads: int, sp: int) -> str | None:
    """Why Ulysses cannot split `heads` query and `kv_heads` key/value heads (a tensor rank's, under TP) over `sp`
    ranks ("heads" or "kv_heads"), or None: each rank takes heads / sp query heads, and the key/value heads split
    the same way when sp divides them or repeat across the group when sp is a multiple of them (MQA and GQA past the
    KV heads), as DeepSpeed's UlyssesSPAttentionHF does. The layout check and the planners' degrees both ask this."""
    if heads % sp:
        return "heads"
    if kv_heads % sp and sp % kv_heads:
        return "kv_heads"
    return None


@dataclass(frozen=True)
class DistInfo:
    """The launch: this process's rank, read once from the launcher's environment (distributed.read_launch_env),
    and the world's parallel layout, whose size is the world's (`launched` makes it data parallelism over the world;
    the pre-flight sets the run's)."""

    rank: int
    local_rank: int
    launcher: str  # "torchrun/deepspeed", "srun" or "single"
    layout: ParallelLayout
    accelerator: str = "cpu"  # DeepSpeed's accelerator name, known once the process group exists

    @classmethod
    def launched(cls, *, rank: int, local_rank: int, world_size: int, launcher: str, accelerator: str = "cpu"):
        """A launch of `world_size` ranks, data parallel over all of them until the run's layout is applied."""
        return cls(
            rank,
            local_rank=local_rank,
            launcher=launcher,
            layout=ParallelLayout(dp=world_size),
            accelerator=accelerator,
        )

    def __post_init__(self):
        assert 0 <= self.rank < self.layout.world_size, f"rank {self.rank} outside {self.layout}"

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def coords(self) -> Coordinates:
        """This rank's place in the layout."""
        return self.layout.coordinates(self.rank)


@dataclass(frozen=True)
class ResumePoint:
    """The committed checkpoint a run continues, as the pre-flight checked it."""

    checkpoint: Path
    state: dict  # its train state (step, data position, the layout that saved it)
    reshard: bool  # it loads through DeepSpeed's universal form (another rank count, layout or offload)
    previous_run_config: dict | None  # run_config.json of the run that wrote it, where there is one

    @property
    def step(self) -> int | None:
        return self.state.get("step")
