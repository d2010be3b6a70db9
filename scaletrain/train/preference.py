"""The objective of a preference run: one micro-batch's summed per-pair loss (preference_loss.py) over the policy's
completion log-probs and the reference's (precomputed with the batch, reference.py, or a forward per step), and the sums
behind TRL's metrics. Sums, because the loop divides by the global batch's pair count, making the loss the mean over its
pairs on any number of ranks. Padding pairs (the epoch's last, short batch) still run the forward, since ZeRO-3's
gathers are collectives, but stay out of the loss and the metrics.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletrain.data import IGNORE_INDEX
from scaletrain.config import PreferenceArgs

if TYPE_CHECKING:
    from scaletrain.data import ChatData
    from scaletrain.train.preference_loss import PreferenceLoss

METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def _aligned_targets(labels):
    """labels shifted left by one: position t holds the token the logits at t predict."""
    import torch.nn.functional as F

    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def row_logps(model, batch: dict, device, whole_sequences: bool = False) -> tuple:
    """(summed completion log-probs per sequence, completion tokens per sequence) of one forward of `model` (the
    engine, or the module itself for a reference pass), in the padded layout's order (chosen rows, then rejected).
    With `whole_sequences`, also (summed log-probs of each whole chosen sequence, prompt included, and its targets;
    0 on rejected rows): ORPO's NLL term, from the same forward. Through the chunked LM head where the model has one
    (the [rows, T, V] logits never exist: model/chunked_loss.py), else from the whole logits. A padding-free batch
    (one row of the sequences end to end, data/pairs.py) is summed per sequence by its `token_rows`."""
    from deepspeed import DeepSpeedEngine

    from scaletrain.model import chunked_loss_head
    from scaletrain.train.preference_loss import token_logps

    input_ids = batch["input_ids"].to(device, non_blocking=True)
    targets = _targets(batch, "shift_labels", "labels", device)
    masks = [targets != IGNORE_INDEX]
    if whole_sequences:  # whole chosen sequences' targets, a superset of their completions'
        whole = _targets(batch, "sequence_shift_labels", "sequence_labels", device)
        masks.append(whole != IGNORE_INDEX)
        targets = whole.where(masks[1], targets)
    extra = {}
    if "position_ids" in batch:  # restarting per sequence: transformers keeps attention within each
        extra["position_ids"] = batch["position_ids"].to(device, non_blocking=True)
    head = chunked_loss_head(model.module if isinstance(model, DeepSpeedEngine) else model)
    if head is None:
        per_token = token_logps(model(input_ids=input_ids, use_cache=False, **extra).logits, targets)
    else:
        with head.pending(targets, per_token=True):
            per_token = model(input_ids=input_ids, use_cache=False, **extra).logits
        head.check_returned(per_token)
    out = []
    for mask in masks:
        out += _per_sequence(per_token * mask, mask, batch, device)
    return tuple(out)


def _targets(batch: dict, shifted: str, aligned: str, device):
    """The targets each position's logits predict: a padding-free batch's are shifted within each sequence already."""
    if shifted in batch:
        return batch[shifted].to(device, non_blocking=True)
    return _aligned_targets(batch[aligned].to(device, non_blocking=True))


def _per_sequence(per_token, mask, batch: dict, device) -> list:
    """[summed log-probs, target count] per sequence (row of the padded layout) of masked per-token log-probs."""
    import torch

    if "token_rows" not in batch:
        return [per_token.sum(-1), mask.sum(-1)]
    owners = batch["token_rows"].to(device, non_blocking=True)
    rows = 2 * batch["pair_ids"].numel()
    counted = owners >= 0
    summed = torch.zeros(rows, dtype=per_token.dtype, device=device).index_add(
        0, owners[counted], per_token[0][counted]
    )
    counts = torch.zeros(rows, dtype=torch.int64, device=device).index_add(0, owners[counted], mask[0][counted].long())
    return [summed, counts]


@dataclass(frozen=True)
class PreferenceObjective:
    """Called by the loop for each micro-batch: (summed per-pair loss, {metric: summed value}), both on the device."""

    loss: PreferenceLoss
    live_reference: bool = False  # the reference runs at every step: the reference engine, or the LoRA base
    reference: object = None  # the reference's own engine (train/reference.py), or None: the LoRA base

    def __call__(self, engine, batch: dict) -> tuple:
        import torch

        from scaletrain.train.preference_loss import SequenceLogps, metric_sums

        whole = self.loss.whole_sequence_nll
        logps, counts, *sequences = row_logps(engine, batch, engine.device, whole_sequences=whole)
        real = batch["pair_ids"].to(engine.device) >= 0
        n = real.numel()
        policy = _pairs(SequenceLogps, logps=logps, counts=counts, n=n, real=real)
        reference = None
        if self.loss.needs_reference:
            if "ref_chosen_logps" in batch:
                chosen = batch["ref_chosen_logps"].to(engine.device, dtype=logps.dtype)[real]
                rejected = batch["ref_rejected_logps"].to(engine.device, dtype=logps.dtype)[real]
                reference = SequenceLogps(chosen, rejected, policy.chosen_tokens, policy.rejected_tokens)
            elif self.live_reference:
                with torch.no_grad(), _adapter_disabled(engine.module) if self.reference is None else nullcontext():
                    model = engine.module if self.reference is None else self.reference
                    ref_logps, _ = row_logps(model, batch, engine.device)
                reference = _pairs(SequenceLogps, logps=ref_logps.to(logps.dtype), counts=counts, n=n, real=real)
            else:  # the pre-flight refuses this; a batch without its reference must not train silently on zeros
                raise RuntimeError("preference loss: the batch carries no reference log-probabilities")
        terms = self.loss.pair_terms(policy, reference)
        # 0 x the log-probs keeps the graph connected when every pair is padding (the backward still runs).
        summed = terms.loss.sum() + 0.0 * logps.sum()
        sums = metric_sums(terms, policy)
        if whole:  # ORPO's NLL: the token mean over the whole batch's chosen sequences, as a share per pair
            nll = _whole_sequence_nll(sequences[0][:n][real].sum(), batch)
            summed, sums["nll_loss"] = summed + nll, nll.detach()
        return summed, sums

    def evaluate(self, engine, batches, prefix: str = "eval_") -> dict:
        return evaluate_pairs(engine, batches, self, prefix)


def _whole_sequence_nll(summed_logps, batch: dict):
    """This micro-batch's part of ORPO's NLL term, scaled so that the loop's division by the step's pair count makes
    the term the mean over every target of the step's chosen sequences: -sum * pairs / targets (the batch carries
    the whole step's counts, data/pairs.py's step_fields)."""
    if "step_sequence_targets" not in batch:
        raise RuntimeError("ORPO: the batch carries no step_sequence_targets (its step's chosen-sequence targets)")
    weight = batch["step_pairs"] / batch["step_sequence_targets"].clamp(min=1)
    return -summed_logps * weight.to(summed_logps.device, summed_logps.dtype)


def _pairs(cls, *, logps, counts, n: int, real):
    """SequenceLogps of the real pairs: rows [0, n) are the chosen sequences, [n, 2n) the rejected ones."""
    return cls(logps[:n][real], logps[n:][real], counts[:n][real], counts[n:][real])


def _adapter_disabled(module):
    """peft's context that runs the base model alone; nothing to disable on a model without an adapter."""
    disable = getattr(module, "disable_adapter", None)
    return disable() if disable is not None else nullcontext()


def evaluate_pairs(engine, batches, objective: PreferenceObjective, prefix: str = "eval_") -> dict:
    """Mean loss and TRL's metrics over a fixed set of validation pairs, across ranks. Each batch carries the whole
    set's step fields (its pairs and chosen-sequence targets over every rank: ORPO's NLL is their token mean)."""
    import deepspeed.comm as ds_comm
    import torch

    shared = _evaluation_fields(batches, engine.device)
    engine.eval()
    sums: dict = {}
    with torch.no_grad():
        for batch in batches:
            summed, metrics = objective(engine, {**batch, **shared})
            for name, value in (("loss", summed), ("pairs", (batch["pair_ids"] >= 0).sum()), *metrics.items()):
                sums[name] = sums.get(name, 0.0) + torch.as_tensor(value, device=engine.device).double()
    engine.train()
    names = sorted(sums)  # the same on every rank: every rank reads as many batches of one data kind
    totals = torch.stack([sums[name].reshape(()) for name in names])
    ds_comm.all_reduce(totals)
    total = dict(zip(names, totals.tolist(), strict=True))
    pairs = max(total.pop("pairs"), 1.0)
    return {f"{prefix}{name}": value / pairs for name, value in total.items()}


def _evaluation_fields(batches, device) -> dict:
    """The evaluation set's step fields summed over every rank ({} where its blocks have none)."""
    import deepspeed.comm as ds_comm
    import torch

    fields = batches.step_fields() if hasattr(batches, "step_fields") else None
    if not fields:
        return {}
    names = sorted(fields)
    totals = torch.stack([torch.as_tensor(fields[name], dtype=torch.float64) for name in names]).to(device)
    ds_comm.all_reduce(totals)
    return {name: value.cpu() for name, value in zip(names, totals, strict=True)}


def preference_objective(args: PreferenceArgs, *, chat: ChatData | None) -> PreferenceObjective | None:
    """The objective of a run on preference data (its chat data says so), or None for token data."""
    if chat is None or chat.kind != "preference":
        return None
    from scaletrain.train.preference_loss import PreferenceLoss

    loss = PreferenceLoss(args.loss_type, args.beta, args.label_smoothing, args.simpo_gamma)
    return PreferenceObjective(loss, live_reference=loss.needs_reference and not args.precompute_ref_log_probs)
