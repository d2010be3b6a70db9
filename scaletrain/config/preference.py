"""Preference optimisation's flags (TRL's DPOConfig spellings): the loss, its temperature, and where the reference
log-probabilities come from. A run is a preference run because its data holds `chosen` and `rejected` columns
(scaletrain/data/preference_render.py); these flags only act on such data. Slices as in scaletrain/config/slices.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config.slices import _flag
from scaletrain.config.values import _check_model_path
from scaletrain.errors import UsageError

# TRL's --loss_type names: DPOTrainer's sigmoid / ipo / hinge / robust, CPOTrainer's simpo, ORPOTrainer's orpo.
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
REFERENCE_FREE_LOSSES = frozenset({"simpo", "orpo"})


@dataclass(frozen=True)
class PreferenceArgs:
    """Preference data (chosen/rejected pairs): the loss and the reference model's log-probabilities."""

    loss_type: str = _flag(
        "sigmoid",
        "Preference loss, by TRL's names: sigmoid (DPO), ipo, hinge, robust (with --label_smoothing), and the "
        "reference-free simpo (--simpo_gamma) and orpo.",
        choices=LOSS_TYPES,
    )
    beta: float = _flag(0.1, "Preference loss temperature (DPO's beta; ORPO's lambda; SimPO's beta).")
    label_smoothing: float = _flag(
        0.0, "Probability that a pair's preference is flipped (robust: in [0, 0.5); simpo: as TRL's CPOTrainer)."
    )
    simpo_gamma: float = _flag(0.5, "SimPO's target reward margin (--loss_type simpo).")
    precompute_ref_log_probs: bool = _flag(
        True,
        "The reference model's log-probabilities of every pair computed once, before the first step, by the starting "
        "model under the run's ZeRO stage, saved beside the store and reused by restarts and later runs "
        "(--no-precompute_ref_log_probs: the reference runs at every step, ZeRO-sharded without gradients or "
        "optimizer; under --use_peft it is the base with the adapter disabled).",
    )
    ref_model_name_or_path: str | None = _flag(
        None,
        "Reference model (hub id or local folder), with the policy's vocabulary. Default: the starting model "
        "(--model_name_or_path; under --use_peft, the base with the adapter disabled).",
    )

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE_LOSSES

    def validate(self) -> None:
        _check_model_path("ref_model_name_or_path", self.ref_model_name_or_path)
        if self.loss_type not in LOSS_TYPES:  # argparse checks the command line; this, a recipe or a caller
            raise UsageError(
                f"--loss_type {self.loss_type!r}: not a preference loss", f"choose one of: {', '.join(LOSS_TYPES)}"
            )
        if not self.beta > 0:
            raise UsageError(f"--beta {self.beta}: must be positive", "e.g. 0.1 (TRL's default)")
        if self.loss_type == "robust" and not 0.0 <= self.label_smoothing < 0.5:
            raise UsageError(
                f"--label_smoothing {self.label_smoothing}: the robust loss needs it in [0, 0.5)",
                "e.g. 0.1: the share of pairs whose preference may be flipped",
            )
        if not 0.0 <= self.label_smoothing < 1.0:
            raise UsageError(f"--label_smoothing {self.label_smoothing}: must be in [0, 1)")
        if self.label_smoothing and self.loss_type not in ("robust", "simpo"):
            raise UsageError(
                f"--label_smoothing with --loss_type {self.loss_type}: only robust and simpo use it (TRL's sigmoid "
                "has none)",
                "drop --label_smoothing, or use --loss_type robust",
            )


def check_preference_run(cfg, preference_data: bool, moe: bool) -> None:
    """Preference flags need preference data; preference data runs on data parallelism with a ZeRO stage (LoRA and
    offload included), one store, and a reference it can reach. `cfg`: the RunConfig."""
    if not preference_data:
        given = [name for name in (*PreferenceArgs.__dataclass_fields__, "padding_free") if name in cfg.sources]
        if given:
            raise UsageError(
                f"--{given[0]}: only acts on preference data (chosen and rejected columns)",
                "give preference pairs (TRL's format), or drop the flag",
            )
        return
    for name in ("tensor_parallel_size", "sequence_parallel_size", "pipeline_parallel_size"):
        if getattr(cfg.parallel, name) > 1:
            raise UsageError(
                f"--{name} {getattr(cfg.parallel, name)} with preference data: not supported here (untested)",
                "train preference pairs with data parallelism and a ZeRO stage (offload and LoRA work)",
            )
    if cfg.data.dataset_mix:
        raise UsageError("--dataset_mix with preference data: not supported here", "prepare the pairs as one store")
    if moe:
        raise UsageError(
            "preference data on a mixture-of-experts model: its load-balancing loss is not added here (untested)",
            "use a dense model",
        )
    args = cfg.preference
    if not args.needs_reference and args.ref_model_name_or_path:
        raise UsageError(
            f"--ref_model_name_or_path with --loss_type {args.loss_type}: a reference-free loss reads no reference",
            "drop --ref_model_name_or_path, or pick a loss that compares with a reference (sigmoid, ipo, ...)",
        )
    live = args.needs_reference and not args.precompute_ref_log_probs
    if live and not (args.ref_model_name_or_path or cfg.model.model_name_or_path):
        raise UsageError(
            f"--no-precompute_ref_log_probs with --loss_type {args.loss_type}: no reference model to run (the "
            "policy is trained from scratch, --config_name)",
            "give --ref_model_name_or_path, or drop --no-precompute_ref_log_probs (the starting model's log-probs are "
            "then computed once, before the first step)",
        )
