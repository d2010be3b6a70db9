"""The global order of training blocks and the micro-batches each rank reads at each step: a permutation per (seed,
epoch), independent of the world size, cut into contiguous global batches. The batch of step s is computed from s, so
seeking costs O(1) and nothing is replayed. A batch-size ramp-up is a short list of constant-batch segments.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from collections.abc import Callable
from functools import cached_property

import numpy as np

from scaletrain.data.blocks import EMPTY_SLOT, PackedBlocks


@dataclass(frozen=True)
class BatchRamp:
    """Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch of a step is decided by the blocks
    consumed before it, start + floor(consumed / samples_per_increment) x increment, up to the full batch, where
    samples_per_increment = SAMPLES / ((full - start) / increment). Integer arithmetic: no float rounding."""

    start: int
    increment: int
    samples: int
    full: int

    @property
    def increments(self) -> int:
        return (self.full - self.start) // self.increment

    def global_batch(self, consumed: int) -> int:
        done = consumed * self.increments // self.samples
        return min(self.start + done * self.increment, self.full)

    def next_change(self, consumed: int) -> int:
        """The fewest blocks consumed at which the batch is larger than at `consumed`."""
        done = consumed * self.increments // self.samples
        return -(-(done + 1) * self.samples // self.increments)


@dataclass(frozen=True)
class GlobalOrder:
    """Which blocks make up each global batch, and which of them a rank reads at each accumulation step. 1 rank with
    accumulation 4 and 2 ranks with accumulation 2 train on the same blocks in each step. The last global batch of an
    epoch leaves the slots it cannot fill EMPTY_SLOT (padding rows that carry no loss).
    """

    n_blocks: int
    micro_batch: int
    accumulation: int
    dp_world_size: int
    seed: int
    # A resume's first step and blocks consumed: the same global batch gives an uninterrupted run's batches, another
    # (a resume on another number of ranks) continues the epoch's order from that position.
    start_step: int = 0
    start_samples: int = 0
    # With a ramp-up, `accumulation` is the full batch's and the ramp's steps use fewer micro-batches.
    ramp: BatchRamp | None = None

    @property
    def global_batch(self) -> int:
        """The full global batch (the size after any ramp-up)."""
        return self.micro_batch * self.accumulation * self.dp_world_size

    @cached_property
    def stages(self) -> list:
        """Constant-batch orders, each valid from its start_step: the ramp's stages from this run's start, then the
        full batch. Each stage starts at the data position its first step reads, as a resume there would."""
        ramp = self.ramp
        assert ramp is not None, "stages are those of a ramp-up"  # read only where there is one
        segments, step, samples = [], self.start_step, self.start_samples
        unit = self.micro_batch * self.dp_world_size
        while True:
            batch = ramp.global_batch(samples)
            segment = dataclasses.replace(
                self, accumulation=batch // unit, start_step=step, start_samples=samples, ramp=None
            )
            segments.append(segment)
            if batch >= ramp.full:
                return segments
            threshold = ramp.next_change(samples)
            while segment.consumed_before(step) < threshold:
                step += 1
            samples = segment.consumed_before(step)

    def segment(self, step: int) -> GlobalOrder:
        """The constant-batch order that holds step `step` (the order itself without a ramp-up)."""
        if self.ramp is None:
            return self
        starts = [s.start_step for s in self.stages]
        return self.stages[max(0, bisect.bisect_right(starts, step) - 1)]

    def global_batch_at(self, step: int) -> int:
        return self.segment(step).global_batch

    def consumed_before(self, step: int) -> int:
        """Blocks consumed by the steps before `step` (the data position a resume at `step` starts from)."""
        epoch, lo = self.position(step)
        return epoch * self.n_blocks + lo

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n_blocks / self.global_batch)

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_blocks)

    def position(self, step: int) -> tuple:
        """(epoch, first position in that epoch's order) of optimizer step `step`; O(1)."""
        if self.ramp is not None:
            return self.segment(step).position(step)
        g = self.global_batch
        epoch0, offset0 = divmod(self.start_samples, self.n_blocks)
        k = step - self.start_step
        if offset0:
            first = math.ceil((self.n_blocks - offset0) / g)  # steps that finish the interrupted epoch
            if k < first:
                return epoch0, offset0 + k * g
            k, epoch0 = k - first, epoch0 + 1
        return epoch0 + k // self.steps_per_epoch, (k % self.steps_per_epoch) * g

    def total_steps(self, epochs: float) -> int:
        """The step at which `epochs` epochs of blocks have been trained."""
        if self.ramp is not None:
            segments = self.stages
            for segment, following in zip(segments, segments[1:] + [None], strict=True):
                steps = segment.total_steps(epochs)
                if following is None or steps <= following.start_step:
                    return steps
        epoch0, offset0 = divmod(self.start_samples, self.n_blocks)
        remaining = epochs - epoch0 - offset0 / self.n_blocks
        if remaining <= 0:
            return self.start_step
        steps = self.start_step
        if offset0:
            part = (self.n_blocks - offset0) / self.n_blocks
            if remaining <= part:
                return steps + math.ceil(remaining * self.n_blocks / self.global_batch)
            steps += math.ceil((self.n_blocks - offset0) / self.global_batch)
            remaining -= part
        return steps + math.ceil(round(remaining * self.steps_per_epoch, 9))

    def global_batch_indices(self, step: int, permutation: np.ndarray | None = None) -> np.ndarray:
        """Block indices of optimizer step `step` (0-based), padded with EMPTY_SLOT to the step's global batch."""
        epoch, lo = self.position(step)
        perm = self.epoch_permutation(epoch) if permutation is None else permutation
        size = self.global_batch_at(step)
        chosen = perm[lo : lo + size]
        padded = np.full(size, EMPTY_SLOT, dtype=np.int64)
        padded[: len(chosen)] = chosen
        return padded

    def micro_batches(self, global_indices: np.ndarray, rank: int) -> list:
        """This rank's micro-batches of one global batch: micro-step k, rank r reads slot (k * dp + r). As many
        micro-batches as the batch holds (fewer during a ramp-up)."""
        grid = global_indices.reshape(-1, self.dp_world_size, self.micro_batch)
        return [grid[k, rank] for k in range(len(grid))]


class StepBatches:
    """Yields, for each optimizer step, this rank's micro-batches and the global count of loss targets."""

    def __init__(
        self, blocks: PackedBlocks, order: GlobalOrder, rank: int, shard: Callable[[dict], dict] | None = None
    ):
        self.blocks = blocks
        self.order = order
        self.rank = rank  # the data-parallel rank: which micro-batches of each global batch
        self.shard = shard  # what this rank keeps of each micro-batch (sequence parallelism), or all of it
        self._epoch = -1
        self._permutation: np.ndarray | None = None

    def _global_indices(self, step: int) -> np.ndarray:
        epoch, _ = self.order.position(step)
        if epoch != self._epoch:
            self._epoch, self._permutation = epoch, self.order.epoch_permutation(epoch)
        return self.order.global_batch_indices(step, self._permutation)

    def for_step(self, step: int) -> tuple:
        global_indices = self._global_indices(step)
        # Every rank knows the whole global batch, so the loss normaliser needs no communication.
        global_targets = self.blocks.targets_in(global_indices)
        micro = [self.blocks.batch(idx) for idx in self.order.micro_batches(global_indices, self.rank)]
        step_fields = getattr(self.blocks, "step_fields", None)  # what each micro-batch needs of the whole step
        if step_fields is not None:
            shared = step_fields(global_indices)
            micro = [{**batch, **shared} for batch in micro]
        if self.shard is not None:
            micro = [self.shard(batch) for batch in micro]
        n_blocks = int((global_indices != EMPTY_SLOT).sum())
        return micro, global_targets, n_blocks

    def tokens_for(self, step: int) -> int | None:
        """Real tokens of one step's whole global batch, where its blocks say it (preference pairs); else None."""
        counted = getattr(self.blocks, "tokens_in", None)
        return None if counted is None else counted(self._global_indices(step))

    def sample_ids(self, step: int) -> list:
        """The global sample ids (block indices of the training order) of one step's whole global batch."""
        return [int(i) for i in self._global_indices(step) if i != EMPTY_SLOT]
