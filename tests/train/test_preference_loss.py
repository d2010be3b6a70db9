"""The preference losses against hand computations (Python's math module, TRL 1.16's formulas written out), the logged
rewards and metric sums, sequence_logps against a direct log-softmax, and the flag checks. Fast, CPU, no model."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.config import REFERENCE_FREE_LOSSES
from scaletrain.errors import UsageError
from scaletrain.train.preference_loss import (
    LOSS_TYPES,
    PairTerms,
    PreferenceLoss,
    SequenceLogps,
    metric_sums,
    sequence_logps,
)

# Three pairs of different completion lengths. Pair 3's chosen mean log-prob (-0.3) lies above log(1/2) and the others
# below, so ORPO's log(1 - exp(x)) is taken on both of its branches; hinge (beta 0.6) is flat on pair 1 only.
PI_C = [-12.0, -30.5, -1.2]
PI_R = [-15.0, -28.0, -2.5]
N_C = [4, 10, 4]
N_R = [5, 8, 2]
REF_C = [-13.0, -29.0, -1.0]
REF_R = [-14.0, -29.5, -3.5]
PAIRS = range(3)
TOL = 1e-6


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def log1mexp(x: float) -> float:
    return math.log(-math.expm1(x))


def chosen_logratio(i: int) -> float:
    return PI_C[i] - REF_C[i]


def rejected_logratio(i: int) -> float:
    return PI_R[i] - REF_R[i]


def delta(i: int) -> float:
    return chosen_logratio(i) - rejected_logratio(i)


def avg_c(i: int) -> float:
    return PI_C[i] / N_C[i]


def avg_r(i: int) -> float:
    return PI_R[i] / N_R[i]


def hand_sigmoid(b, e, g, i):
    return -logsig(b * delta(i))


def hand_hinge(b, e, g, i):
    return max(0.0, 1 - b * delta(i))


def hand_ipo(b, e, g, i):
    return (chosen_logratio(i) / N_C[i] - rejected_logratio(i) / N_R[i] - 1 / (2 * b)) ** 2


def hand_robust(b, e, g, i):
    return (-(1 - e) * logsig(b * delta(i)) + e * logsig(-b * delta(i))) / (1 - 2 * e)


def hand_simpo(b, e, g, i):
    z = avg_c(i) - avg_r(i) - g / b
    return -(1 - e) * logsig(b * z) - e * logsig(-b * z)


def hand_orpo(b, e, g, i):
    """ORPO's odds-ratio term per pair; its NLL term is the batch's (tested with the objective, test_orpo_objective)."""
    log_odds = (avg_c(i) - avg_r(i)) - (log1mexp(avg_c(i)) - log1mexp(avg_r(i)))
    return -b * logsig(log_odds)


# (loss, its hand formula); the two losses that read label_smoothing get one (the others refuse it: see below).
CASES = [
    (PreferenceLoss("sigmoid", beta=0.1), hand_sigmoid),
    (PreferenceLoss("hinge", beta=0.6), hand_hinge),
    (PreferenceLoss("ipo", beta=0.1), hand_ipo),
    (PreferenceLoss("robust", beta=0.1, label_smoothing=0.2), hand_robust),
    (PreferenceLoss("simpo", beta=2.0, label_smoothing=0.1, simpo_gamma=0.7), hand_simpo),
    (PreferenceLoss("orpo", beta=0.25), hand_orpo),
]


def values(numbers, dtype=torch.float64, requires_grad=False):
    return torch.tensor(numbers, dtype=dtype, requires_grad=requires_grad)


def policy(dtype=torch.float64, requires_grad=False) -> SequenceLogps:
    return SequenceLogps(
        values(PI_C, dtype, requires_grad), values(PI_R, dtype, requires_grad), torch.tensor(N_C), torch.tensor(N_R)
    )


def reference(dtype=torch.float64) -> SequenceLogps:
    return SequenceLogps(values(REF_C, dtype), values(REF_R, dtype), torch.tensor(N_C), torch.tensor(N_R))


def terms_of(loss: PreferenceLoss, logps: SequenceLogps | None = None) -> PairTerms:
    return loss.pair_terms(logps or policy(), None if loss.loss_type in REFERENCE_FREE_LOSSES else reference())


def test_the_cases_cover_every_loss_type():
    assert sorted(case.loss_type for case, _ in CASES) == sorted(LOSS_TYPES)


@pytest.mark.parametrize("loss, hand", CASES, ids=[case.loss_type for case, _ in CASES])
def test_each_loss_matches_its_hand_computation(loss, hand):
    got = terms_of(loss).loss
    want = [hand(loss.beta, loss.label_smoothing, loss.simpo_gamma, i) for i in PAIRS]
    assert got.shape == (3,)
    assert got.tolist() == pytest.approx(want, abs=TOL, rel=0)


def test_hinge_is_flat_where_the_margin_is_met_and_sloped_elsewhere():
    loss = terms_of(CASES[1][0]).loss
    assert loss[0].item() == 0.0 and loss[1].item() > 0 and loss[2].item() > 0


@pytest.mark.parametrize("loss, hand", CASES, ids=[case.loss_type for case, _ in CASES])
def test_the_hand_values_hold_in_float32_too(loss, hand):
    got = loss.pair_terms(
        policy(torch.float32), None if loss.loss_type in REFERENCE_FREE_LOSSES else reference(torch.float32)
    )
    want = [hand(loss.beta, loss.label_smoothing, loss.simpo_gamma, i) for i in PAIRS]
    assert got.loss.tolist() == pytest.approx(want, abs=1e-4, rel=1e-5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "robust"])
def test_the_dpo_family_logs_beta_times_the_log_ratios_and_the_summed_logps(loss_type):
    loss = PreferenceLoss(loss_type, beta=0.3)
    logps = policy(requires_grad=True)
    terms = terms_of(loss, logps)
    assert terms.chosen_rewards.tolist() == pytest.approx([0.3 * chosen_logratio(i) for i in PAIRS], abs=TOL)
    assert terms.rejected_rewards.tolist() == pytest.approx([0.3 * rejected_logratio(i) for i in PAIRS], abs=TOL)
    assert terms.chosen_logps.tolist() == PI_C and terms.rejected_logps.tolist() == PI_R
    assert terms.loss.requires_grad
    assert not any(t.requires_grad for t in (terms.chosen_rewards, terms.rejected_rewards, terms.chosen_logps))


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_simpo_and_orpo_log_beta_times_the_per_token_mean_logps(loss_type):
    loss = PreferenceLoss(loss_type, beta=0.3)
    terms = loss.pair_terms(policy(requires_grad=True), None)
    assert terms.chosen_rewards.tolist() == pytest.approx([0.3 * avg_c(i) for i in PAIRS], abs=TOL)
    assert terms.rejected_rewards.tolist() == pytest.approx([0.3 * avg_r(i) for i in PAIRS], abs=TOL)
    assert terms.chosen_logps.tolist() == pytest.approx([avg_c(i) for i in PAIRS], abs=TOL)
    assert terms.rejected_logps.tolist() == pytest.approx([avg_r(i) for i in PAIRS], abs=TOL)
    assert terms.loss.requires_grad and not terms.chosen_rewards.requires_grad


def test_metric_sums_of_dpo_are_the_hand_sums():
    b = 0.1
    sums = metric_sums(terms_of(PreferenceLoss("sigmoid", beta=b)), policy())
    chosen = [b * chosen_logratio(i) for i in PAIRS]  # 0.1, -0.15, -0.02
    rejected = [b * rejected_logratio(i) for i in PAIRS]  # -0.1, 0.15, 0.1
    want = {
        "rewards/chosen": math.fsum(chosen),
        "rewards/rejected": math.fsum(rejected),
        "rewards/accuracies": 1.0,  # only pair 1's chosen reward is the larger
        "rewards/margins": math.fsum(c - r for c, r in zip(chosen, rejected, strict=True)),
        "logps/chosen": math.fsum(PI_C),
        "logps/rejected": math.fsum(PI_R),
    }
    assert set(sums) == set(want)
    for name, value in want.items():
        assert sums[name].item() == pytest.approx(value, abs=TOL), name


def test_metric_sums_of_orpo_use_the_per_token_mean_logps():
    b = 0.25
    sums = metric_sums(PreferenceLoss("orpo", beta=b).pair_terms(policy()), policy())
    assert sums["logps/chosen"].item() == pytest.approx(math.fsum(avg_c(i) for i in PAIRS), abs=TOL)
    assert sums["logps/rejected"].item() == pytest.approx(math.fsum(avg_r(i) for i in PAIRS), abs=TOL)
    assert sums["rewards/chosen"].item() == pytest.approx(b * math.fsum(avg_c(i) for i in PAIRS), abs=TOL)
    # mean log-probs: chosen -3, -3.05, -0.3 against rejected -3, -3.5, -1.25: pairs 2 and 3 (a tie is no win)
    assert sums["rewards/accuracies"].item() == 2.0


def test_metric_sums_are_detached_float64_scalars_that_add_up_over_any_split():
    loss = PreferenceLoss("robust", beta=0.1, label_smoothing=0.1)
    logps, ref = policy(torch.float32, requires_grad=True), reference(torch.float32)
    whole = metric_sums(loss.pair_terms(logps, ref), logps)
    parts = [slice(0, 1), slice(1, 3)]  # one rank's pair, the other rank's two
    split = [metric_sums(loss.pair_terms(pick(logps, s), pick(ref, s)), pick(logps, s)) for s in parts]
    for name, value in whole.items():
        assert value.dtype == torch.float64 and value.dim() == 0 and not value.requires_grad, name
        assert (split[0][name] + split[1][name]).item() == pytest.approx(value.item(), abs=1e-5), name


def pick(logps: SequenceLogps, rows: slice) -> SequenceLogps:
    return SequenceLogps(
        logps.chosen[rows], logps.rejected[rows], logps.chosen_tokens[rows], logps.rejected_tokens[rows]
    )


def test_metric_sums_fall_back_to_the_summed_logps_when_terms_carry_none():
    terms = PairTerms(
        loss=values([0.0, 0.0, 0.0]), chosen_rewards=values([1, 2, 3]), rejected_rewards=values([3, 2, 1])
    )
    sums = metric_sums(terms, policy())
    assert sums["logps/chosen"].item() == pytest.approx(math.fsum(PI_C))
    assert sums["rewards/accuracies"].item() == 1.0 and sums["rewards/margins"].item() == 0.0


@pytest.mark.parametrize("loss, hand", CASES, ids=[case.loss_type for case, _ in CASES])
def test_an_all_empty_pair_gives_a_finite_loss_and_finite_gradients(loss, hand):
    zeros = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    counts = torch.zeros(2, dtype=torch.long)
    empty = SequenceLogps(zeros * 1, zeros * 1, counts, counts)
    terms = loss.pair_terms(empty, SequenceLogps(zeros.detach(), zeros.detach(), counts, counts))
    terms.loss.sum().backward()
    assert torch.isfinite(terms.loss).all() and torch.isfinite(zeros.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orpo_stays_finite_for_a_completion_the_policy_is_certain_of(dtype):
    # Pair 1's chosen mean log-prob is exactly 0, pair 2's -1e-9 (exp of it is 1.0 in float32); pair 3 is ordinary.
    chosen = torch.tensor([0.0, -3e-9, -2.0], dtype=dtype, requires_grad=True)
    logps = SequenceLogps(chosen, values([-3.0, -3.0, -1.0], dtype), torch.tensor([3, 3, 2]), torch.tensor([3, 3, 2]))
    terms = PreferenceLoss("orpo", beta=0.5).pair_terms(logps)
    terms.loss.sum().backward()
    assert torch.isfinite(terms.loss).all() and torch.isfinite(chosen.grad).all()
    assert terms.loss[2].item() == pytest.approx(hand_orpo_one(0.5, -1.0, -0.5), abs=1e-5)


def hand_orpo_one(b: float, mean_chosen: float, mean_rejected: float) -> float:
    log_odds = (mean_chosen - mean_rejected) - (log1mexp(mean_chosen) - log1mexp(mean_rejected))
    return -b * logsig(log_odds)


@pytest.mark.parametrize("loss, hand", CASES, ids=[case.loss_type for case, _ in CASES])
def test_the_gradients_agree_with_finite_differences(loss, hand):
    ref = None if loss.loss_type in REFERENCE_FREE_LOSSES else reference()
    counts_c, counts_r = torch.tensor(N_C), torch.tensor(N_R)

    def total(chosen, rejected):
        return loss.pair_terms(SequenceLogps(chosen, rejected, counts_c, counts_r), ref).loss

    assert torch.autograd.gradcheck(total, (values(PI_C, requires_grad=True), values(PI_R, requires_grad=True)))


def test_which_losses_need_a_reference_model():
    assert {t for t in LOSS_TYPES if not PreferenceLoss(t).needs_reference} == {"simpo", "orpo"}
    with pytest.raises(ValueError, match="reference"):
        PreferenceLoss("sigmoid").pair_terms(policy(), None)


def test_sequence_logps_matches_a_direct_log_softmax_and_skips_ignored_labels():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7, requires_grad=True)
    labels = torch.tensor([[1, -100, 6, 0, -100], [-100, -100, -100, -100, -100], [2, 3, 4, 5, 6]])
    summed, counts = sequence_logps(logits, labels)
    rows = logits.detach().tolist()
    want = []
    for row_logits, row_labels in zip(rows, labels.tolist(), strict=True):
        total = 0.0
        for position, label in zip(row_logits, row_labels, strict=True):
            if label != -100:
                top = max(position)
                total += position[label] - (top + math.log(math.fsum(math.exp(v - top) for v in position)))
        want.append(total)
    assert summed.dtype == torch.float32
    assert summed.tolist() == pytest.approx(want, abs=1e-5)
    assert counts.tolist() == [3, 0, 5]
    summed.sum().backward()  # the log-probs carry gradients back to the logits; the ignored positions get none
    assert logits.grad[1].abs().sum().item() == 0.0 and logits.grad[0, 1].abs().sum().item() == 0.0
    assert logits.grad[0, 0].abs().sum().item() > 0


def test_sequence_logps_takes_half_precision_logits_to_float32():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 9).to(torch.bfloat16)
    labels = torch.tensor([[3, 8, -7, 0], [-7, 1, 1, -7]])
    summed, counts = sequence_logps(logits, labels, ignore_index=-7)
    direct = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert summed.dtype == torch.float32
    assert summed.tolist() == pytest.approx((direct * (labels != -7)).sum(-1).tolist(), abs=1e-6)
    assert counts.tolist() == [3, 2]


def test_sequence_logps_refuses_labels_of_another_shape():
    with pytest.raises(ValueError, match="disagree"):
        sequence_logps(torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))


def test_an_unknown_loss_type_names_the_flag_and_the_choices():
    with pytest.raises(UsageError) as caught:
        PreferenceLoss("kto")
    assert "--loss_type" in caught.value.message and "'kto'" in caught.value.message
    assert all(name in caught.value.hint for name in LOSS_TYPES)


@pytest.mark.parametrize("beta", [0.0, -0.1, float("nan")])
def test_beta_must_be_positive(beta):
    with pytest.raises(UsageError, match="--beta"):
        PreferenceLoss("sigmoid", beta=beta)


@pytest.mark.parametrize(
    "loss_type, label_smoothing",
    [("robust", 0.5), ("robust", -0.01), ("sigmoid", 1.0), ("simpo", 1.2), ("ipo", -0.1), ("orpo", float("nan"))],
)
def test_label_smoothing_out_of_range_names_the_flag(loss_type, label_smoothing):
    with pytest.raises(UsageError, match="--label_smoothing"):
        PreferenceLoss(loss_type, label_smoothing=label_smoothing)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "orpo"])
def test_label_smoothing_on_a_loss_that_ignores_it_is_refused(loss_type):
    with pytest.raises(UsageError, match=f"--label_smoothing with --loss_type {loss_type}"):
        PreferenceLoss(loss_type, label_smoothing=0.1)


@pytest.mark.parametrize("loss_type, label_smoothing", [("robust", 0.49), ("robust", 0.0), ("simpo", 0.6)])
def test_label_smoothing_in_range_is_accepted(loss_type, label_smoothing):
    assert PreferenceLoss(loss_type, label_smoothing=label_smoothing).label_smoothing == label_smoothing
