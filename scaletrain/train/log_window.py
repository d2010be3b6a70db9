"""The log window: what this rank's steps add up to since the last training record, and the one collective at a
logging step that turns it into the record's figures (the loss over every real token of every global batch in the
window, the same number however the batch is split; throughput, MFU, phases, the slowest rank, memory)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scaletrain.observability import PHASES, ThroughputModel, memory_stats

if TYPE_CHECKING:
    import torch

    from scaletrain.train.callbacks import StepOutcome


@dataclass
class LogWindow:
    """Sums since the last logging step."""

    loss_sum: torch.Tensor | float = 0.0  # this rank's summed token losses (a device tensor: no host sync per step)
    targets: int = 0  # global loss targets (identical on every rank)
    samples: int = 0  # global blocks trained
    steps: int = 0
    seconds: float = 0.0  # wall-clock of the steps, measured start to end independently of the phases
    phases: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    phase_steps: int = 0  # the steps split into phases (all of them on a CPU; the logged ones on a GPU)
    grad_norm: torch.Tensor | float | None = None  # the last applied step's, read only when the window is summarized
    loss_targets: int = 0  # targets of the applied steps (a skipped step's loss stays out of the mean)
    skipped: int = 0  # steps whose update was not applied
    aux_sum: torch.Tensor | float | None = None  # MoE: this rank's shares of the applied steps' mean aux losses
    metric_sums: dict | None = None  # preference pairs: this rank's sums of TRL's metrics over the applied steps
    tokens: int = 0  # tokens processed, where they are not the targets (preference pairs: targets count pairs)

    @property
    def applied_steps(self) -> int:
        return self.steps - self.skipped

    def add(self, outcome: StepOutcome, grad_norm) -> None:
        """One step: its result, wall-clock seconds and phases (None for a step that was not split, a GPU step not
        logged); `grad_norm` the engine's, kept only from an applied step."""
        result = outcome.result
        if result.aux_share is not None and self.aux_sum is None:
            self.aux_sum = 0.0
        if not result.applied:
            self.skipped += 1
        else:
            if result.aux_share is not None:
                assert self.aux_sum is not None  # opened at 0.0 above
                self.aux_sum = self.aux_sum + result.aux_share
            self.loss_sum = self.loss_sum + result.loss_sum
            self.loss_targets += result.targets
            if result.metric_sums is not None:
                old = self.metric_sums or dict.fromkeys(result.metric_sums, 0.0)
                self.metric_sums = {name: old[name] + value for name, value in result.metric_sums.items()}
            self.grad_norm = grad_norm
        self.targets += result.targets
        self.tokens += result.targets if result.tokens is None else result.tokens
        self.samples += result.blocks
        self.steps += 1
        self.seconds += outcome.seconds
        if outcome.phases is not None:
            self.phase_steps += 1
            for name, value in outcome.phases.items():
                self.phases[name] += value

    def summarize(self, device, throughput: ThroughputModel | None = None) -> dict:
        """Reduce across ranks (a collective: every rank must call it at the same step)."""
        import torch
        import torch.distributed as torch_dist

        step_time = self.seconds / max(self.steps, 1)
        # One collective: every rank's summed loss and load-balancing loss shares (added up) and its forward time per
        # step, the straggler signal. Not the step time: the step's collectives make every rank wait for the
        # slowest, so all ranks' step times are the same. The forward holds no gradient communication (ZeRO-3's
        # parameter gathers and tensor parallelism's all-reduces do wait in it, which blurs the signal there).
        extra = sorted(self.metric_sums or {})  # the same names on every rank: the same data kind
        mine = torch.zeros(3 + len(extra), dtype=torch.float64, device=device)
        mine[0] = torch.as_tensor(self.loss_sum, dtype=torch.float64, device=device).reshape(())
        mine[1] = self.phases["forward"] / self.phase_steps if self.phase_steps else 0.0
        aux = 0.0 if self.aux_sum is None else self.aux_sum
        mine[2] = torch.as_tensor(aux, dtype=torch.float64, device=device).reshape(())
        sums = self.metric_sums or {}
        for k, name in enumerate(extra):
            mine[3 + k] = torch.as_tensor(sums[name], dtype=torch.float64, device=device).reshape(())
        gathered = [torch.zeros_like(mine) for _ in range(torch_dist.get_world_size())]
        torch_dist.all_gather(gathered, mine)
        rows = torch.stack(gathered).cpu()
        total = rows[:, 0].sum()
        forward_times = rows[:, 1].tolist()
        slowest = max(range(len(forward_times)), key=forward_times.__getitem__)
        median_forward = statistics.median(forward_times)
        tokens_per_s = self.tokens / self.seconds if self.seconds else 0.0
        record = {
            "loss": total.item() / self.loss_targets if self.loss_targets else None,  # None: all skipped
            # MoE: the mean over the applied steps of each step's mean load-balancing loss (not times the coefficient)
            "aux_loss": rows[:, 2].sum().item() / self.applied_steps
            if self.aux_sum is not None and self.applied_steps
            else None,
            # preference pairs: TRL's metrics, each the mean over the applied steps' pairs
            **{
                name: rows[:, 3 + k].sum().item() / self.loss_targets if self.loss_targets else None
                for k, name in enumerate(extra)
            },
            "skipped": self.skipped,
            "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
            "tokens_per_s": tokens_per_s,
            "samples_per_s": self.samples / self.seconds if self.seconds else 0.0,
            "step_time_s": step_time,
            # the mean over the steps split into phases (none: no phase keys, rather than zeros)
            **(
                {f"{name}_s": value / self.phase_steps for name, value in self.phases.items()}
                if self.phase_steps
                else {}
            ),
            # None where no forward was timed apart (the pipeline's interleaved schedule)
            **(
                {
                    "slowest_rank": slowest,
                    "slowest_rank_forward_s": forward_times[slowest],
                    "straggler_ratio": forward_times[slowest] / median_forward,
                }
                if median_forward > 0
                else {}
            ),
            **memory_stats(device),
        }
        if throughput is not None:
            tflops = tokens_per_s * throughput.flops_per_token / throughput.world_size / 1e12
            record["tflops_per_device"] = tflops
            if throughput.peak_tflops:
                record["mfu"] = tflops / throughput.peak_tflops
                record["hfu"] = (
                    tokens_per_s
                    * throughput.hardware_flops_per_token
                    / throughput.world_size
                    / 1e12
                    / throughput.peak_tflops
                )
        return record
