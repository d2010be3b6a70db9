"""The state of a run that changes as it trains, in one object that checkpoints save and restore."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from scaletrain.parts import ParallelLayout


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's random generators, from the run's --seed."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainState:
    """The loop's position and the layout that produced it. Side concerns keep their own state (the non-finite guard's
    running mean, the wandb run id), which the checkpoint manager saves beside this one (checkpoint/manager.py)."""

    step: int = 0  # optimizer updates done
    samples_seen: int = 0  # training blocks consumed, counted globally (the data position)
    tokens_seen: int = 0  # loss targets trained on, globally (padding excluded)
    skipped_steps: int = 0  # updates not applied: non-finite loss or gradient norm, loss spike, fp16 overflow
    consecutive_skips: int = 0  # skips in a row, for --max_consecutive_skips
    data_offset: int = 0  # data steps jumped over by rollbacks: step s trains on the batch of data step s + offset
    # The layout that produced this state (None: not recorded yet). A resume compares it: other data-parallel,
    # tensor- or sequence-parallel sizes reshard, another pipeline size is refused (layer files do not reshard).
    layout: ParallelLayout | None = None
    # Tensor x pipeline: every stage's tensor split is recorded for the universal conversion (older checkpoints
    # record only their own stage's, so they resume on their own layout only).
    stage_splits_recorded: bool = False
    zero_stage: int | None = None  # the ZeRO stage that produced it (None: a checkpoint from before it was kept)
    offload: str | None = None  # "optimizer=<device>,param=<device>" of that run (another one converts)

    def record_layout(self, layout: ParallelLayout, zero_stage: int, offload: str) -> None:
        """The layout and ZeRO setting that produce this state from now on (what a resume compares)."""
        self.layout, self.zero_stage, self.offload = layout, zero_stage, offload
        self.stage_splits_recorded = layout.tp > 1 and layout.pp > 1  # engine.build_engine merges them

    def state_dict(self) -> dict:
        """The state as checkpoints keep it (train_state in the client state): the layout as its sizes, under the
        names checkpoints have always used (world_size: the data-parallel ranks; 0 where none was recorded)."""
        state = {name: value for name, value in asdict(self).items() if name != "layout"}
        layout = self.layout
        sizes = (0, 1, 1, 1) if layout is None else (layout.dp, layout.tp, layout.sp, layout.pp)
        return {**state, **dict(zip(_LAYOUT_KEYS, sizes, strict=True))}

    def load_state_dict(self, state: dict) -> None:
        known = {f.name for f in fields(self)}
        for key, value in state.items():
            if key in known:
                setattr(self, key, value)
        dp, tp, sp, pp = (state.get(key, 0 if key == "world_size" else 1) for key in _LAYOUT_KEYS)
        self.layout = ParallelLayout(tp=tp, sp=sp, pp=pp, dp=dp) if dp else None


# The layout's sizes in a saved train state: data parallel (as world_size), tensor, sequence, pipeline.
_LAYOUT_KEYS = ("world_size", "tensor_parallel_size", "sequence_parallel_size", "pipeline_parallel_size")
