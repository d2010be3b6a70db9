"""The state of a run that changes as it trains, in one object that checkpoints save and restore."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
    step: int = 0  # optimizer updates done
    samples_seen: int = 0  # training blocks consumed, counted globally (the data position)
    tokens_seen: int = 0  # loss targets trained on, globally (padding excluded)
    skipped_steps: int = 0  # updates not applied: non-finite loss or gradient norm, loss spike, fp16 overflow
    consecutive_skips: int = 0  # skips in a row, for --max_consecutive_skips
    loss_mean: float | None = None  # running mean of the applied steps' losses, for --loss_spike_factor
    loss_mean_steps: int = 0  # how many applied steps the running mean has seen
    data_offset: int = 0  # data steps jumped over by rollbacks: step s trains on the batch of data step s + offset
    world_size: int = 0  # data-parallel ranks that produced this state (a resume must match it)
    tensor_parallel_size: int = 1  # the tensor-parallel size that produced it (another one reshards)
    sequence_parallel_size: int = 1  # likewise the sequence-parallel size
    pipeline_parallel_size: int = 1  # the pipeline stages (a resume must match: layer files do not reshard)
    # Tensor x pipeline: every stage's tensor split is recorded for the universal conversion (older checkpoints
    # record only their own stage's, so they resume on their own layout only).
    stage_splits_recorded: bool = False
    zero_stage: int | None = None  # the ZeRO stage that produced it (None: a checkpoint from before it was kept)
    offload: str | None = None  # "optimizer=<device>,param=<device>" of that run (another one converts)
    wandb_run_id: str | None = None  # so a resumed run continues the same wandb run

    def record_layout(self, layout: ParallelLayout, zero_stage: int, offload: str) -> None:
        """The layout and ZeRO setting that produce this state from now on (what a resume compares)."""
        self.world_size, self.tensor_parallel_size = layout.dp, layout.tp
        self.sequence_parallel_size, self.pipeline_parallel_size = layout.sp, layout.pp
        self.zero_stage, self.offload = zero_stage, offload
        self.stage_splits_recorded = layout.tp > 1 and layout.pp > 1  # engine.build_engine merges them

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
