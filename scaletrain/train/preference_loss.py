"""Preference-optimisation losses on (chosen, rejected) completion pairs, formula for formula as TRL 1.16. Per pair:
pi_c, pi_r are the policy's summed log-probs of the chosen / rejected completion tokens, ref_c, ref_r the reference
model's, n_c, n_r the completion token counts, d = (pi_c - ref_c) - (pi_r - ref_r), b = beta, e = label_smoothing,
avg_c = pi_c / n_c (and so for r), ls(x) = log(sigmoid(x)).

  sigmoid (DPO):  -ls(b*d)            (TRL 1.16's DPO sigmoid has no label smoothing: e is not read)
  hinge (SLiC):   max(0, 1 - b*d)
  ipo:            ((pi_c - ref_c)/n_c - (pi_r - ref_r)/n_r - 1/(2b))^2   (per-token normalised, as TRL does)
  robust (rDPO):  (-(1-e)*ls(b*d) + e*ls(-b*d)) / (1 - 2e)
  simpo:          -(1-e)*ls(b*z) - e*ls(-b*z),  z = avg_c - avg_r - gamma/b   (no reference model)
  orpo:           -b*ls(log_odds),  log_odds = avg_c - avg_r - (log(1-exp(avg_c)) - log(1-exp(avg_r))), plus the
                  NLL of the whole chosen sequences (prompts included), the token mean over the batch: a term of the
                  batch, not of a pair, which the objective adds (train/preference.py, whole_sequence_nll)

The first four match trl/trainer/dpo_trainer.py (`_compute_loss` with TRL's defaults: f_divergence_type="reverse_kl",
ld_alpha=None, use_weighting=False, one loss type), simpo trl/experimental/cpo/cpo_trainer.py (`cpo_loss`,
loss_type="simpo", alpha=0, cpo_alpha=0), orpo trl/experimental/orpo/orpo_trainer.py (`odds_ratio_loss`, beta as the
paper's lambda). Rewards, as those trainers log them: beta*(pi - ref) for the DPO family, beta*avg for simpo and orpo
("logps/chosen": pi_c, or avg_c). ORPO's NLL term is TRL's too: the mean over every target token of the batch's whole
chosen sequences, prompts included; here the batch is the step's global batch, so the term does not depend on how the
pairs are split over ranks and micro-batches (TRL's is each micro-batch's mean, averaged).
Every loss and gradient is finite for a padding pair (both completions empty), so a loop can weight it out; torch is
imported lazily, so a config can validate a PreferenceLoss cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletrain.config import LOSS_TYPES, REFERENCE_FREE_LOSSES, PreferenceArgs

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["LOSS_TYPES", "PairTerms", "PreferenceLoss", "SequenceLogps", "metric_sums", "sequence_logps", "token_logps"]
LOG_HALF = -0.6931471805599453  # log(1/2): where log1mexp switches form, as TRL's
LOG1MEXP_MAX_X = -1e-12  # log1mexp's argument is clamped below this, so log(1 - exp(x)) stays finite (see _log1mexp)


@dataclass(frozen=True)
class SequenceLogps:
    """One model's log-probs for n_pairs pairs, each field a 1-D tensor of length n_pairs."""

    chosen: Tensor  # summed log-prob of the chosen completion's tokens
    rejected: Tensor
    chosen_tokens: Tensor  # how many completion tokens were summed (int or float)
    rejected_tokens: Tensor


@dataclass(frozen=True)
class PairTerms:
    """What one loss makes of n_pairs pairs, each field a 1-D tensor of length n_pairs."""

    loss: Tensor  # per pair; the step's loss is its mean over the pairs of the global batch
    chosen_rewards: Tensor  # detached, as TRL logs them
    rejected_rewards: Tensor
    # Detached policy log-probs as TRL logs "logps/chosen": summed for the DPO family, per-token mean for simpo and
    # orpo. None means the summed ones (SequenceLogps.chosen), which metric_sums then reads instead.
    chosen_logps: Tensor | None = None
    rejected_logps: Tensor | None = None


@dataclass(frozen=True)
class PreferenceLoss:
    """Which preference loss, with its settings; validated when built, so a bad flag stops the run before any work."""

    loss_type: str = "sigmoid"  # one of LOSS_TYPES
    beta: float = 0.1  # DPO's beta; IPO's tau; SimPO's beta; ORPO's lambda (weight of the odds-ratio term)
    label_smoothing: float = 0.0  # read by robust (flip probability, in [0, 0.5)) and simpo only, as in TRL
    simpo_gamma: float = 0.5  # SimPO's target reward margin

    def __post_init__(self):  # the flags' own checks (pre-flight), for a loss built from anywhere else too
        PreferenceArgs(self.loss_type, self.beta, self.label_smoothing, self.simpo_gamma).validate()

    @property
    def whole_sequence_nll(self) -> bool:
        """Whether the loss adds an NLL term over whole chosen sequences (ORPO's, TRL's: prompts included, the token
        mean over the batch), which the objective adds to pair_terms' per-pair loss (train/preference.py)."""
        return self.loss_type == "orpo"

    @property
    def needs_reference(self) -> bool:
        """Whether pair_terms needs the reference model's log-probs (so whether a reference forward is run)."""
        return self.loss_type not in REFERENCE_FREE_LOSSES

    def pair_terms(self, logps: SequenceLogps, ref: SequenceLogps | None = None) -> PairTerms:
        """The per-pair loss and logged rewards of the policy's `logps` (and the reference's `ref`, where needed)."""
        if self.loss_type == "simpo":
            return self._simpo(logps)
        if self.loss_type == "orpo":
            return self._orpo(logps)
        if ref is None:
            raise ValueError(f"loss_type {self.loss_type!r} needs the reference model's log-probs")
        return self._dpo_family(logps, ref)

    def _dpo_family(self, logps: SequenceLogps, ref: SequenceLogps) -> PairTerms:
        import torch
        import torch.nn.functional as F

        b, e = self.beta, self.label_smoothing
        chosen_logratios = logps.chosen - ref.chosen
        rejected_logratios = logps.rejected - ref.rejected
        delta = chosen_logratios - rejected_logratios
        if self.loss_type == "sigmoid":
            loss = -F.logsigmoid(b * delta)
        elif self.loss_type == "hinge":
            loss = torch.relu(1 - b * delta)
        elif self.loss_type == "ipo":
            # Token-summed log-ratios make the squared loss grow with completion length; TRL (with the IPO authors)
            # averages them per token so that one tau suits every length.
            ipo_delta = _per_token(chosen_logratios, logps.chosen_tokens) - _per_token(
                rejected_logratios, logps.rejected_tokens
            )
            loss = (ipo_delta - 1 / (2 * b)) ** 2
        else:  # robust: unbiased under labels flipped with probability e
            clean = -(1 - e) * F.logsigmoid(b * delta)
            flipped = -e * F.logsigmoid(-b * delta)
            loss = (clean - flipped) / (1 - 2 * e)
        return PairTerms(
            loss=loss,
            chosen_rewards=b * chosen_logratios.detach(),
            rejected_rewards=b * rejected_logratios.detach(),
            chosen_logps=logps.chosen.detach(),
            rejected_logps=logps.rejected.detach(),
        )

    def _simpo(self, logps: SequenceLogps) -> PairTerms:
        import torch.nn.functional as F

        b, e = self.beta, self.label_smoothing
        avg_chosen = _per_token(logps.chosen, logps.chosen_tokens)
        avg_rejected = _per_token(logps.rejected, logps.rejected_tokens)
        logits = (avg_chosen - avg_rejected) - self.simpo_gamma / b
        loss = -F.logsigmoid(b * logits) * (1 - e) - F.logsigmoid(-b * logits) * e
        return _reference_free_terms(loss, b, avg_chosen, avg_rejected)

    def _orpo(self, logps: SequenceLogps) -> PairTerms:
        import torch.nn.functional as F

        avg_chosen = _at_least_fp32(_per_token(logps.chosen, logps.chosen_tokens))
        avg_rejected = _at_least_fp32(_per_token(logps.rejected, logps.rejected_tokens))
        # log odds(y) = log p - log(1 - p), p = exp(avg): Eqs. (4) and (7) of the ORPO paper, in log space.
        log_odds = (avg_chosen - avg_rejected) - (_log1mexp(avg_chosen) - _log1mexp(avg_rejected))
        loss = -self.beta * F.logsigmoid(log_odds)  # the NLL term is the batch's, added by the objective
        return _reference_free_terms(loss, self.beta, avg_chosen, avg_rejected)


def metric_sums(terms: PairTerms, logps: SequenceLogps) -> dict[str, Tensor]:
    """Per-micro-batch sums over pairs of TRL's logged metrics (detached float64 0-d tensors).

    Sums, not means: the loop all-reduces them and divides by the global pair count, so any split of the pairs over
    ranks and micro-batches reports TRL's batch means."""
    import torch

    def total(values) -> Tensor:
        return values.detach().to(torch.float64).sum()

    chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
    return {
        "rewards/chosen": total(chosen),
        "rewards/rejected": total(rejected),
        "rewards/accuracies": total(chosen > rejected),
        "rewards/margins": total(chosen - rejected),
        "logps/chosen": total(logps.chosen if terms.chosen_logps is None else terms.chosen_logps),
        "logps/rejected": total(logps.rejected if terms.rejected_logps is None else terms.rejected_logps),
    }


def sequence_logps(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """Per row: (summed float32 log-prob of the label tokens, how many label tokens), ignored labels skipped.

    `labels` are already aligned with `logits` (labels[:, t] is the target logits[:, t] predicts). An all-ignored row
    gives 0 and 0."""
    mask = labels != ignore_index
    return token_logps(logits, labels, ignore_index).sum(-1), mask.sum(-1)


def token_logps(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """[rows, T] float32: each label token's log-prob under `logits` [rows, T, V], 0 where the label is ignored.

    The log-softmax is taken in float32 one row at a time, so besides the logits only one [T, V] float32 tensor
    exists at once in the forward (autograd keeps one per row: one [rows, T, V] float32 in all)."""
    import torch

    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [rows, T]")
    mask = labels != ignore_index
    targets = labels.masked_fill(~mask, 0)  # any real index; the mask drops it again
    rows = [
        row_logits.float().log_softmax(-1).gather(-1, row_targets.unsqueeze(-1)).squeeze(-1)
        for row_logits, row_targets in zip(logits, targets, strict=True)
    ]
    per_token = torch.stack(rows) if rows else logits.new_zeros(labels.shape, dtype=torch.float32)
    return torch.where(mask, per_token, torch.zeros_like(per_token))


def _per_token(summed: Tensor, tokens: Tensor) -> Tensor:
    """`summed` divided by the token count. A count of 0 is taken as 1, giving 0: TRL's DPO clamps so for IPO, where
    CPO and ORPO would give NaN (an empty completion is a data error the preference store rejects anyway)."""
    return summed / tokens.to(summed.dtype).clamp(min=1.0)


def _at_least_fp32(values: Tensor) -> Tensor:
    """float16/bfloat16 lifted to float32 (TRL's ORPO computes its odds in float32); float64 kept."""
    import torch

    return values.float() if values.dtype in (torch.float16, torch.bfloat16) else values


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)), stable on both sides of log(1/2): TRL's ORPO value for every x < -1e-12. Two guards TRL lacks:
    x is clamped to at most -1e-12 (a fully confident or empty completion has mean log-prob 0, where this is -inf),
    and the log1p branch sees x only where it is taken, so the other cannot send a NaN gradient through torch.where."""
    import torch

    x = x.clamp(max=LOG1MEXP_MAX_X)
    below = torch.log1p(-torch.exp(torch.minimum(x, torch.full_like(x, LOG_HALF))))
    return torch.where(x < LOG_HALF, below, torch.log(-torch.expm1(x)))


def _reference_free_terms(loss: Tensor, beta: float, avg_chosen: Tensor, avg_rejected: Tensor) -> PairTerms:
    """simpo's and orpo's terms: rewards beta * per-token mean log-prob, logps logged as those means (as TRL)."""
    return PairTerms(
        loss=loss,
        chosen_rewards=beta * avg_chosen.detach(),
        rejected_rewards=beta * avg_rejected.detach(),
        chosen_logps=avg_chosen.detach(),
        rejected_logps=avg_rejected.detach(),
    )
