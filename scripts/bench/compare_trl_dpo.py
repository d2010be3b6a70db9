"""train.py's preference training against TRL 1.16 on the same pairs, for each --loss_type: per-step losses and
logged metrics, and steady pairs per second with each side's defaults.

TRL's trainer for each loss: DPOTrainer with that loss_type for sigmoid (DPO), ipo, hinge and robust; CPOTrainer
(trl.experimental.cpo) with loss_type "simpo" and cpo_alpha 0 (no NLL term) for simpo; ORPOTrainer
(trl.experimental.orpo) for orpo. Both sides load the same weights (a Llama built from data/tiny-llama's config,
widened to ~5M parameters as scripts/bench/common.py's bench_model, random init from --seed, saved once to the work
folder) and train on the same pairs file (tests/helpers/preference_data.py's arithmetic questions) with the same
hyper-parameters: the loss, --beta (0.1), --label_smoothing (robust: 0.1; simpo: 0), --simpo_gamma (0.5),
--learning_rate, a constant LR with no warmup, AdamW (0.9, 0.95, eps 1e-8, no weight decay), gradient clipping at
1.0, fp32, --batch pairs per step on one process, max_length = block_size (every pair fits: checked on both sides,
nothing is truncated), a log record at every step. CPOTrainer and ORPOTrainer put a BOS token before each prompt
(DPOTrainer and train.py do not): for simpo and orpo the pairs file's prompts start with the BOS text, so both sides
score the same tokens.

- TRL: the trainer in a child process, TRL installed with `pip install --no-deps --target DIR trl==1.16.0` (never
  into the venv; its requirements are checked against the venv first) and found through PYTHONPATH=DIR (the
  caller's PYTHONPATH kept after it). Its defaults otherwise: for the DPO family the reference model is a second
  copy of the model run at every step (precompute_ref_log_probs off; --trl_precompute_ref_log_probs turns it
  on), dropout disabled, no DeepSpeed (one process). Two of its defaults are overridden because they change what is
  computed, not how fast the trainer is: bf16 (fp32 here, as ours) and gradient checkpointing (off, as ours).
- ours: `python train.py --config ds_configs/zero2.json --model_name_or_path MODEL ...` (ZeRO-2 on one process,
  CPU), its defaults otherwise: for the DPO family, reference log-probabilities precomputed before the first step.

The data order: the pairs file is one global batch by default (--pairs = --batch), so every step of both sides
trains on the same pairs (ours draws a seeded permutation of them, TRL's sampler shuffles them; within a step the
order of pairs does not change the loss). With more pairs than the batch the orders differ and nothing is compared.

Figures:
- loss at each step, both sides (the first round's), and the relative difference |ours - TRL| / |TRL| (goal:
  within 1e-3 on the first --loss_steps steps, default 5; for the DPO family the first is known, the policy being
  its own reference: log 2 for sigmoid and robust, 1 for hinge, (1/(2 beta))^2 for ipo).
- every metric both sides log (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
  logps/chosen, logps/rejected, and for orpo nll_loss) at each of those steps: |ours - TRL| / max(|TRL|,
  METRIC_FLOOR) (goal: within 1e-3; the floor, 0.01, because rewards start at 0); the table shows each metric's
  largest.
- steady pairs/s of each run from wall-clock stamps at every step end (ours: metrics.jsonl's `time`, TRL: a
  callback's, as scripts/bench/hf_trainer_clm.py's StepClock), steps up to --warmup left out: the median step's
  pairs/s (the headline: robust to another process taking the cores for a moment) and --batch x steps over the
  span from step --warmup to the last; each the median over --rounds alternating rounds, and the ratio ours / TRL
  of the medians (goal, for sigmoid against TRL's defaults: >= 1.5; simpo and orpo have no reference model on
  either side). Ours' median per-step `samples_per_s` and TRL's own `train_samples_per_second` (all steps, start-up
  included) are in the JSON too.
- --cpu-threads (OMP_NUM_THREADS of both sides) is 1 by default: on a small machine that other jobs share, two
  threads per process made single steps take 10-50x longer at random (OpenMP threads waiting on each other).

    python scripts/bench/compare_trl_dpo.py --steps 16 --warmup 4 --batch 8 --rounds 2 --out figures.json  # ~1 min
    python scripts/bench/compare_trl_dpo.py --loss_type ipo ...  # any of sigmoid, ipo, hinge, robust, simpo, orpo
    python scripts/bench/compare_trl_dpo.py --trl_precompute_ref_log_probs ...  # no reference model on either side
    python scripts/bench/compare_trl_dpo.py --quick  # data/tiny-llama's size, 4 pairs, 4 steps, 1 round (~25 s)

Prints a Markdown table and the goals as a JSON line, writes every figure as JSON (--out); each run's output is
kept in the work folder; exits non-zero with a run's command and the tail of its output if one fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from itertools import pairwise
from pathlib import Path

from scripts.bench.common import bench_parser, median_runs, metrics, steady_rate
from scripts.bench.trl_environment import installed_version, run_env, trl_env, unmet_requirements
from scaletrain.config import LOSS_TYPES
from scaletrain.train.preference import METRIC_NAMES  # the metrics both sides log, by TRL's names

REPO = Path(__file__).resolve().parents[2]

# Compared where both sides log them: TRL's metrics, and ORPO's nll_loss (CPOTrainer logs one too; ours, for orpo only).
COMPARED = (*METRIC_NAMES, "nll_loss")

TRL_VERSION = "1.16.0"
DS_CONFIG = "ds_configs/zero2.json"
LOSS_GOAL, SPEED_GOAL = 1e-3, 1.5
# A logged metric's difference is relative to max(|TRL's value|, this): rewards start at 0 (the policy is its own
# reference), where a relative difference means nothing.
METRIC_FLOOR = 1e-2
# TRL 1.16's trainer for each loss: (module, trainer, config). DPOTrainer's loss_type covers the DPO family; SimPO is
# CPOTrainer's loss_type "simpo" (with cpo_alpha 0: no NLL term), ORPO has its own trainer.
TRL_TRAINERS = {
    **{loss: ("trl", "DPOTrainer", "DPOConfig") for loss in ("sigmoid", "ipo", "hinge", "robust")},
    "simpo": ("trl.experimental.cpo", "CPOTrainer", "CPOConfig"),
    "orpo": ("trl.experimental.orpo", "ORPOTrainer", "ORPOConfig"),
}
# The hyper-parameters both sides are given explicitly (train.py's flag and TRL's config field share each name).
SHARED_HPARAMS = dict(
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_epsilon=1e-8,
    weight_decay=0.0,
    max_grad_norm=1.0,
)
# Model shapes over data/tiny-llama's config (hidden 128, 4 layers, vocab 4096): the benchmark's ~5M parameters
# (bench_model's), and the tiny model itself for --quick.
MODEL_SHAPES = {
    "bench": dict(hidden_size=256, intermediate_size=688, head_dim=64),
    "tiny": {},
}
QUICK = dict(steps=4, warmup=2, rounds=1, batch=4, model="tiny")
OUR_PAIRS_LINE = re.compile(r"preference data \(train\): (\d+) pairs; (\d+) (?:sequences|pairs) longer than the block")


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, steps=16, warmup=4, rounds=2, block_size=128)
    parser.add_argument("--batch", type=int, default=8, help="pairs per step (--per_device_train_batch_size)")
    parser.add_argument("--pairs", type=int, default=None, help="pairs in the file (default: --batch, one batch)")
    parser.add_argument("--cpu-threads", type=int, default=1, help="OMP_NUM_THREADS of both sides (default 1)")
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--loss_type", choices=LOSS_TYPES, default="sigmoid", help="the loss (default sigmoid)")
    parser.add_argument("--beta", type=float, default=0.1, help="both sides' beta (default 0.1)")
    parser.add_argument("--label_smoothing", type=float, default=None, help="robust and simpo (default 0.1 / 0)")
    parser.add_argument("--simpo_gamma", type=float, default=0.5, help="simpo's target margin (default 0.5)")
    parser.add_argument("--seed", type=int, default=42, help="weights, pairs and both trainers' seed")
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="bench", help="model shape (default bench)")
    parser.add_argument(
        "--loss_steps",
        type=int,
        default=None,
        help="steps whose losses and metrics must agree (default: 5, at most --steps)",
    )
    parser.add_argument(
        "--trl_precompute_ref_log_probs", action="store_true", help="TRL's reference log-probs computed up front"
    )
    parser.add_argument(
        "--our_precompute_ref_log_probs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train.py's reference log-probs computed before the first step (its default: on)",
    )
    parser.add_argument("--trl_dir", type=Path, default=None, help="TRL's install folder (default: WORK/trl)")
    parser.add_argument("--work_dir", type=Path, default=None, help="model, pairs, runs (default: a temp folder)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    parser.add_argument("--quick", action="store_true", help=f"small run for a smoke test: {QUICK}")
    parser.add_argument("--trl_side", type=Path, default=None, help=argparse.SUPPRESS)  # the child: its spec file
    return parser


def parse_args(argv: list | None = None) -> argparse.Namespace:
    """The flags; --quick changes the defaults only, so a flag typed beside it still wins."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if "--quick" in argv:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    args.pairs = args.pairs or args.batch
    if args.pairs < args.batch:
        parser.error(f"--pairs {args.pairs}: at least --batch {args.batch} (a whole batch)")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    if not 0 < args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} must be in [1, --steps {args.steps})")
    if args.loss_steps is None:
        args.loss_steps = min(5, args.steps)
    if not 0 < args.loss_steps <= args.steps:
        parser.error(f"--loss_steps {args.loss_steps} must be in [1, --steps {args.steps}]")
    if args.label_smoothing is None:
        args.label_smoothing = 0.1 if args.loss_type == "robust" else 0.0
    elif args.label_smoothing and args.loss_type not in ("robust", "simpo"):
        parser.error(f"--label_smoothing with --loss_type {args.loss_type}: only robust and simpo read it")
    return args


def loss_hparams(args: argparse.Namespace) -> dict:
    """The loss's hyper-parameters, by the names train.py's flags and TRL's config fields share: beta always,
    label_smoothing where the loss reads it, simpo_gamma for simpo. loss_type is added by each side (ORPOConfig
    has none)."""
    hparams = dict(beta=args.beta)
    if args.loss_type in ("robust", "simpo"):
        hparams["label_smoothing"] = args.label_smoothing
    if args.loss_type == "simpo":
        hparams["simpo_gamma"] = args.simpo_gamma
    return hparams


# ---- TRL: install, environment, the child's spec ------------------------------------------------------------


def install_trl(target: Path) -> Path:
    """TRL 1.16.0 in `target` (pip --no-deps --target, from the configured index), unless already there."""
    if not (target / f"trl-{TRL_VERSION}.dist-info").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
        run_checked([*cmd, f"trl=={TRL_VERSION}"], dict(os.environ), target.parent / "pip_trl.log")
    return target


def trl_spec(args: argparse.Namespace, model: Path, pairs: Path, out_dir: Path) -> dict:
    """What the TRL child runs: the trainer for --loss_type and its config's fields, the model and pairs, where it
    writes its record."""
    config = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_length=args.block_size,
        bf16=False,  # TRL's default is bf16 autocast; fp32 as ours
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
        **SHARED_HPARAMS,
        **loss_hparams(args),
    )
    module, trainer, config_class = TRL_TRAINERS[args.loss_type]
    if config_class == "DPOConfig":
        config.update(loss_type=args.loss_type, precompute_ref_log_probs=args.trl_precompute_ref_log_probs)
        config["activation_checkpointing"] = False  # TRL's default is on; ours is off
    else:
        config["gradient_checkpointing"] = False  # CPOConfig's and ORPOConfig's default is on; ours is off
    if config_class == "CPOConfig":
        config.update(loss_type="simpo", cpo_alpha=0.0)  # SimPO: no behaviour-cloning NLL term
    return dict(
        trl_version=TRL_VERSION,
        trainer=[module, trainer, config_class],
        model=str(model),
        train_file=str(pairs),
        record=str(out_dir / "trl_steps.json"),
        config=config,
    )


def trl_command(spec_file: Path) -> list:
    return [sys.executable, str(Path(__file__).resolve()), "--trl_side", str(spec_file)]


def our_command(args: argparse.Namespace, model: Path, pairs: Path, out_dir: Path) -> list:
    """train.py on one process: the ZeRO-2 JSON, the shared hyper-parameters, a record at every step, no save."""
    flags = dict(
        config=DS_CONFIG,
        model_name_or_path=model,
        train_file=pairs,
        validation_split_percentage=0,
        output_dir=out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        block_size=args.block_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",  # no warmup (Hugging Face's meaning), as TRL's
        warmup_steps=0,
        logging_steps=1,
        seed=args.seed,
        loss_type=args.loss_type,
        **SHARED_HPARAMS,
        **loss_hparams(args),
    )
    cmd = [sys.executable, "train.py"]
    for name, value in flags.items():
        cmd += [f"--{name}", str(value)]
    if TRL_TRAINERS[args.loss_type][2] == "DPOConfig":  # a reference model: precomputed or run at every step
        on = args.our_precompute_ref_log_probs
        cmd.append("--precompute_ref_log_probs" if on else "--no-precompute_ref_log_probs")
    return [*cmd, "--no-bf16", "--no-fp16", "--no-save_at_end", "--no-export_hf_at_end", "--disable_tqdm"]


# ---- Reading both sides' records ----------------------------------------------------------------------------


def step_records(records: list) -> dict:
    """{step: its record} of the per-step training records of either side: a Trainer's state.log_history (its
    end-of-training summary holds `train_loss`, not `loss`) or train.py's metrics.jsonl (evaluation records hold
    `eval_loss`)."""
    return {r["step"]: r for r in records if "loss" in r and "step" in r}


def step_losses(records: list) -> dict:
    """{step: loss} of step_records."""
    return {step: r["loss"] for step, r in step_records(records).items()}


def expected_first_loss(loss_type: str, beta: float) -> float | None:
    """The DPO family's loss at step 1, where the policy is its own reference (d = 0): log 2 for sigmoid and robust,
    1 for hinge, (1/(2 beta))^2 for ipo. None for simpo and orpo (no reference: it depends on the data)."""
    return {"sigmoid": math.log(2), "robust": math.log(2), "hinge": 1.0, "ipo": (1 / (2 * beta)) ** 2}.get(loss_type)


def compare_losses(ours: dict, theirs: dict) -> list:
    """(step, ours, TRL, relative difference to TRL's) for every step both logged, in step order."""
    return [(s, ours[s], theirs[s], abs(ours[s] - theirs[s]) / abs(theirs[s])) for s in sorted(ours.keys() & theirs)]


def compare_metrics(ours: dict, theirs: dict, names=METRIC_NAMES) -> list:
    """(step, name, ours, TRL, difference) for every step both logged and every metric of `names` both records hold,
    the difference relative to max(|TRL's|, METRIC_FLOOR). `ours`/`theirs`: {step: record}."""
    rows = []
    for step in sorted(ours.keys() & theirs):
        for name in names:
            if name in ours[step] and name in theirs[step]:
                a, b = ours[step][name], theirs[step][name]
                rows.append((step, name, a, b, abs(a - b) / max(abs(b), METRIC_FLOOR)))
    return rows


def our_pairs_line(output: str) -> tuple | None:
    """(pairs, sequences truncated) from train.py's 'preference data (train): ...' log line, or None."""
    found = OUR_PAIRS_LINE.search(output)
    return (int(found[1]), int(found[2])) if found else None


def step_rates(steps: list, times: list, batch: int, warmup: int) -> list:
    """Pairs per second of each step after `warmup`: its pairs over the wall-clock time since the previous stamp."""
    stamps = pairwise(zip(steps, times, strict=True))
    return [batch * (s - s0) / (t - t0) for (s0, t0), (s, t) in stamps if s > warmup]


def steady(steps: list, times: list, batch: int, warmup: int) -> dict:
    """A run's steady pairs/s: the median step's, and over the whole span from step `warmup` to the last."""
    return {
        "median_step": statistics.median(step_rates(steps, times, batch, warmup)),
        "span": steady_rate(steps, times, batch, warmup),
    }


def our_steady(records: list, batch: int, warmup: int) -> dict:
    """steady() over train.py's metrics.jsonl `step` / `time` stamps, with its own median per-step samples_per_s."""
    figures = steady([r["step"] for r in records], [r["time"] for r in records], batch, warmup)
    figures["samples_per_s"] = statistics.median(r["samples_per_s"] for r in records if r["step"] > warmup)
    return figures


def verdicts(
    losses: list,
    loss_steps: int,
    ratio: float,
    comparable: bool,
    first_loss: float | None = math.log(2),
    metric_rows: list = (),
) -> dict:
    """The goals: losses within LOSS_GOAL over the first `loss_steps` steps, the first at `first_loss` (unless None),
    and so every logged metric of `metric_rows` (compare_metrics') over those steps; both None when the data
    orders differ. Ours >= SPEED_GOAL x TRL's pairs/s."""
    first = [row for row in losses if row[0] <= loss_steps]
    max_rel = max(row[3] for row in first) if first else math.nan
    starts_right = bool(first) and first[0][0] == 1
    if first_loss is not None:
        starts_right = starts_right and all(abs(v - first_loss) < 1e-5 * max(1.0, first_loss) for v in first[0][1:3])
    agree = len(first) == loss_steps and max_rel <= LOSS_GOAL and starts_right
    metrics_first = [row for row in metric_rows if row[0] <= loss_steps]
    max_metric = max((row[4] for row in metrics_first), default=math.nan)
    worst = max(metrics_first, key=lambda row: row[4], default=None)
    metrics_agree = bool(metrics_first) and max_metric <= LOSS_GOAL
    return {
        "max_rel_loss_diff": max_rel,
        "loss_steps_compared": len(first),
        "first_loss_as_expected": starts_right,
        "losses_agree": agree if comparable else None,
        "max_metric_diff": max_metric,
        "worst_metric": None if worst is None else {"step": worst[0], "name": worst[1]},
        "metrics_compared": sorted({row[1] for row in metrics_first}),
        "metrics_agree": metrics_agree if comparable else None,
        "ratio": ratio,
        "speed_goal_met": ratio >= SPEED_GOAL,
    }


def table(losses: list, ours: dict, trl: dict, metric_rows: list = (), trainer: str = "DPOTrainer") -> str:
    """Markdown: one row per step's loss, the largest difference of each logged metric, then the steady pairs/s of
    each side (median over the rounds, each round's in brackets) and the ratio of the medians. `ours`/`trl`:
    {figure: [one value per round]}."""
    rows = [f"| figure | train.py | TRL {trainer} | rel. diff / ratio |", "|---|---|---|---|"]
    rows += [f"| loss, step {s} | {a:.7f} | {b:.7f} | {rel:.1e} |" for s, a, b, rel in losses]
    for name in dict.fromkeys(row[1] for row in metric_rows):
        step, _, a, b, diff = max((row for row in metric_rows if row[1] == name), key=lambda row: row[4])
        rows.append(f"| {name}, largest diff (step {step}) | {a:.7g} | {b:.7g} | {diff:.1e} |")
    for key, name in (("median_step", "median step"), ("span", "whole steady span")):
        ratio = statistics.median(ours[key]) / statistics.median(trl[key])
        rows.append(
            f"| pairs/s, {name} | {median_runs(ours[key], '.2f')} | {median_runs(trl[key], '.2f')} | {ratio:.2f}x |"
        )
    return "\n".join(rows)


# ---- Running ------------------------------------------------------------------------------------------------


def run_checked(cmd: list, env: dict, log: Path) -> str:
    """Run `cmd` from the repository, its stdout and stderr together written to `log` and returned. Exits with
    the command and the output's tail if it fails."""
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout)
    if proc.returncode != 0:
        sys.exit(f"a run failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stdout[-4000:]}")
    return proc.stdout


def build_model(folder: Path, shape: str, seed: int) -> Path:
    """data/tiny-llama's config with `shape`'s changes, random init from `seed`, saved with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from data.build_tiny_llama import tiny_llama_variant

    tiny_llama_variant(folder, **MODEL_SHAPES[shape])
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return folder


def run_trl(args, trl_dir: Path, model: Path, pairs: Path, out_dir: Path) -> dict:
    """One TRL run in `out_dir`: its record (clock, log history, longest pair), checked for truncation."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = trl_spec(args, model, pairs, out_dir)
    (out_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    env = trl_env(trl_dir, args.cpu_threads, out_dir.parent.parent / "cache")
    run_checked(trl_command(out_dir / "spec.json"), env, out_dir / "output.log")
    record = json.loads(Path(spec["record"]).read_text())
    if record["longest"] > args.block_size or record["pairs"] != args.pairs:
        sys.exit(
            f"TRL: {record['pairs']} pairs, the longest {record['longest']} tokens: not all of --pairs "
            f"{args.pairs} fit --block_size {args.block_size}"
        )
    return record


def run_ours(args, model: Path, pairs: Path, out_dir: Path) -> list:
    """One train.py run in `out_dir`: its metrics.jsonl training records, checked for truncation."""
    env = run_env(args.cpu_threads, out_dir.parent.parent / "cache")
    output = run_checked(our_command(args, model, pairs, out_dir), env, out_dir.parent / "ours.log")
    counted = our_pairs_line(output)
    if counted != (args.pairs, 0):
        sys.exit(f"train.py: expected {args.pairs} pairs and none truncated, its log says (pairs, truncated) {counted}")
    return metrics(out_dir, "loss")


def trl_side(spec_file: Path) -> None:
    """The TRL child: the spec's trainer (DPOTrainer, CPOTrainer or ORPOTrainer) on its model and pairs; writes the
    per-step clock, the log history, the longest pair it tokenised and its own throughput figure."""
    import importlib

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts.bench.hf_trainer_clm import StepClock

    spec = json.loads(spec_file.read_text())
    if trl.__version__ != spec["trl_version"]:
        sys.exit(f"TRL {trl.__version__} imported from {trl.__file__}, {spec['trl_version']} expected")
    module, trainer_name, config_name = spec["trainer"]
    module = importlib.import_module(module)
    rows = [json.loads(line) for line in Path(spec["train_file"]).read_text().splitlines()]
    clock = StepClock()
    model = spec["model"] if trainer_name == "DPOTrainer" else AutoModelForCausalLM.from_pretrained(spec["model"])
    trainer = getattr(module, trainer_name)(
        model=model,
        args=getattr(module, config_name)(**spec["config"]),
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(spec["model"]),
        callbacks=[clock],
    )
    longest = longest_tokenized_pair(trainer.train_dataset)
    result = trainer.train()
    record = {
        "steps": clock.steps,
        "times": clock.times,
        "log_history": trainer.state.log_history,
        "train_samples_per_second": result.metrics["train_samples_per_second"],
        "longest": longest,
        "pairs": len(trainer.train_dataset),
        "trl": trl.__file__,
        "trainer": type(trainer).__name__,
        "threads": torch.get_num_threads(),
        "activation_checkpointing": bool(trainer.model.is_activation_checkpointing),
        "ref_model": getattr(trainer, "ref_model", None) is not None,
    }
    Path(spec["record"]).write_text(json.dumps(record))


def with_bos_prompts(pairs: Path, model: Path) -> Path:
    """The pairs file with the tokenizer's BOS text before each prompt: CPOTrainer and ORPOTrainer put a BOS token
    before a prompt that has none (DPOTrainer and train.py do not), so the prompts carry it and both sides score
    the same tokens (the BOS text tokenises to the BOS token on both)."""
    from transformers import AutoTokenizer

    bos = AutoTokenizer.from_pretrained(model).bos_token
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    pairs.write_text("".join(json.dumps({**row, "prompt": bos + row["prompt"]}) + "\n" for row in rows))
    return pairs


def longest_tokenized_pair(data) -> int:
    """The longest sequence of a TRL trainer's tokenised pairs: DPOTrainer keeps the prompt and each completion apart
    (prompt_ids, chosen_ids, rejected_ids), CPOTrainer and ORPOTrainer each whole sequence (chosen_input_ids,
    rejected_input_ids)."""
    if "prompt_ids" in data.column_names:
        columns = (data["prompt_ids"], data["chosen_ids"], data["rejected_ids"])
        return max(len(p) + max(len(c), len(r)) for p, c, r in zip(*columns, strict=True))
    return max(len(ids) for name in ("chosen_input_ids", "rejected_input_ids") for ids in data[name])


def main(argv: list | None = None) -> None:
    args = parse_args(argv)
    if args.trl_side is not None:
        return trl_side(args.trl_side)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="compare_trl_dpo-"))
    work.mkdir(parents=True, exist_ok=True)
    trl_dir = install_trl(args.trl_dir or work / "trl")
    unmet = unmet_requirements((trl_dir / f"trl-{TRL_VERSION}.dist-info" / "METADATA").read_text(), installed_version)
    if unmet:
        sys.exit(f"TRL {TRL_VERSION} needs what this environment lacks (not installed here): {'; '.join(unmet)}")

    from tests.helpers.preference_data import explicit_text

    model = build_model(work / "model", args.model, args.seed)
    pairs = explicit_text(work / "pairs.jsonl", args.pairs, args.seed)
    if TRL_TRAINERS[args.loss_type][1] != "DPOTrainer":
        with_bos_prompts(pairs, model)
    ours, trl = {"median_step": [], "span": [], "samples_per_s": []}, {"median_step": [], "span": []}
    for n in range(args.rounds):  # the two sides alternate; medians over the rounds
        trl_record = run_trl(args, trl_dir, model, pairs, work / f"round{n}" / "trl")
        our_records = run_ours(args, model, pairs, work / f"round{n}" / "ours")
        for key, value in steady(trl_record["steps"], trl_record["times"], args.batch, args.warmup).items():
            trl[key].append(value)
        for key, value in our_steady(our_records, args.batch, args.warmup).items():
            ours[key].append(value)
        if n == 0:
            losses = compare_losses(step_losses(our_records), step_losses(trl_record["log_history"]))
            metric_rows = compare_metrics(step_records(our_records), step_records(trl_record["log_history"]), COMPARED)
            first_trl = trl_record

    ratio = statistics.median(ours["median_step"]) / statistics.median(trl["median_step"])
    first_loss = expected_first_loss(args.loss_type, args.beta)
    result = verdicts(losses, args.loss_steps, ratio, args.pairs == args.batch, first_loss, metric_rows)
    result = {"loss_type": args.loss_type, "trl_trainer": first_trl["trainer"], **result}
    print(table(losses, ours, trl, [r for r in metric_rows if r[0] <= args.loss_steps], first_trl["trainer"]))
    print(json.dumps(result))
    if args.out:
        figures = {
            "losses": [dict(step=s, ours=a, trl=b, rel_diff=rel) for s, a, b, rel in losses],
            "metrics": [dict(step=s, name=m, ours=a, trl=b, diff=d) for s, m, a, b, d in metric_rows],
            "pairs_per_s": {"ours": ours, "trl": trl},
            "trl_train_samples_per_second_all_steps": first_trl["train_samples_per_second"],
            **result,
            "setup": {
                "args": {k: str(v) for k, v in vars(args).items() if k != "trl_side"},
                "trl_dir": str(trl_dir),
                "work_dir": str(work),
                "ours": our_command(args, model, pairs, work / "round0" / "ours"),
                "trl_config": trl_spec(args, model, pairs, work / "round0" / "trl")["config"],
                "trl_side": {k: first_trl[k] for k in ("threads", "longest", "activation_checkpointing", "ref_model")},
            },
        }
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
