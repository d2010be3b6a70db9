"""The flat command line of train.py (and data/prepare.py's share of it): one argparse group per slice, generated
from the dataclasses, parsed (with the --recipe it names) into a checked RunConfig.

Parser: our own argparse, generated from the dataclasses. transformers.HfArgumentParser also parses several
dataclasses, but importing it pulls in numpy and transformers' utilities (a second per bad flag, and this module
must stay torch- and numpy-free), it spells negated booleans `--no_x` where ours have always been `--no-x`, and its
errors print the whole usage and exit; ours give one line with a did-you-mean (UsageError, exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

from scaletrain.config.checks import validate_run_config
from scaletrain.config.deepspeed_json import ResolvedDSConfig
from scaletrain.config.recipes import _recipe_flag, load_recipe
from scaletrain.config.run_config import FLAG_ALIASES, SLICES, RunConfig, _nargs, _value_type, flag_fields
from scaletrain.errors import UsageError

COMMAND_LINE = "command line"
HELP_FRONT = """Train a Hugging Face causal LM with DeepSpeed: ZeRO, offload, tensor, sequence and pipeline parallelism.
Flags follow Hugging Face's spelling; every flag is checked before anything heavy (one line, exit 2).

The commands most runs start from:
  deepspeed train.py --config ds_configs/zero3.json
      the built-in default: a tiny Llama trained on the sample corpus (a CPU is enough)
  deepspeed train.py --config ds_configs/zero3.json --model_name_or_path ORG/MODEL --dataset_name NAME
      your model and data (or --train_file data.jsonl; --config_name to train from scratch)
  deepspeed --num_gpus 8 train.py --config ds_configs/zero3.json --gradient_checkpointing ...
      several GPUs (ZeRO-3 shards the model; bf16 where the GPU has it; ds_configs/ has the offload variants)
  sbatch --nodes=4 --gpus-per-node=8 scripts/train.sbatch --config ds_configs/zero3.json ...
      several nodes under Slurm (a preempted job requeues and resumes)
  python train.py --plan --model_name_or_path ORG/MODEL --num_gpus 8 --num_nodes 4
      memory per GPU of each ZeRO stage, offload and layout, before you queue a job
  python train.py --print_config [flags]
      every resolved value and where it came from

The flags, by concern:"""


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, did-you-mean) instead of printing usage and exiting."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            unknown = message.split(":", 1)[1].split()
            flag = next((u for u in unknown if u.startswith("--")), unknown[0])
            name = flag.split("=", 1)[0]
            known = [opt for action in self._actions for opt in action.option_strings if opt.startswith("--")]
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"see {self.prog} --help for the flags"
            raise UsageError(f"unknown flag {name}", hint)
        raise UsageError(message, f"see {self.prog} --help")


def add_flags(
    parser: argparse.ArgumentParser,
    slices: Sequence[str] | None = None,
    suppress_defaults=False,
    defaults: dict | None = None,
    exclude: Sequence[str] = (),
) -> None:
    """Add the flags of `slices` (all by default), one argparse group per slice; `defaults` replace the fields'."""
    defaults = defaults or {}
    for slice_name in slices or SLICES:
        owner = SLICES[slice_name]
        group = parser.add_argument_group(slice_name, owner.__doc__)
        for f in dataclasses.fields(owner):
            if f.name in exclude:
                continue
            meta = {k: v for k, v in f.metadata.items() if k != "training_only"}
            help_text = meta.pop("help")
            names = [f"--{f.name}", *meta.pop("aliases", ())]
            value = defaults.get(f.name, f.default)
            default = argparse.SUPPRESS if suppress_defaults else value
            if _value_type(owner, f) is bool:  # --name / --no-name: the command line can undo a recipe's true
                group.add_argument(
                    *names, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text, default=default
                )
                continue
            default_text = "" if value is None else f" (default: {value})"
            if _nargs(owner, f):
                meta["nargs"] = _nargs(owner, f)
            meta.setdefault("type", _value_type(owner, f))  # a field's own converter (Hugging Face's names) wins
            group.add_argument(*names, dest=f.name, default=default, help=help_text + default_text, **meta)


def build_parser(suppress_defaults: bool = False, defaults: dict | None = None) -> argparse.ArgumentParser:
    """train.py's command line. With suppress_defaults, only typed flags appear in the namespace."""
    parser = _Parser(
        prog="train.py",
        usage="deepspeed [--num_gpus N] train.py [flags]   (or: torchrun ..., python train.py ...)",
        description=HELP_FRONT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_flags(parser, suppress_defaults=suppress_defaults, defaults=defaults)
    switches = {f.name for slice_name, f in flag_fields() if _value_type(SLICES[slice_name], f) is bool}
    for alias, name in FLAG_ALIASES.items():
        action: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if name in switches else {}
        parser.add_argument(
            f"--{alias}",
            dest=name,
            default=argparse.SUPPRESS,
            help=f"Alias of --{name} (Hugging Face spelling).",
            **action,
        )
    return parser


def slices_from(values: dict, slices: Sequence[str] | None = None) -> dict:
    """{slice name: slice instance} from flat {flag: value} (flags absent from `values` keep their defaults)."""

    def value(f):  # argparse gives a tuple flag as a list; the slices are frozen, so hold a tuple
        return tuple(values[f.name]) if isinstance(values[f.name], list) else values[f.name]

    return {
        name: SLICES[name](**{f.name: value(f) for f in dataclasses.fields(SLICES[name]) if f.name in values})
        for name in (slices or SLICES)
    }


def parse_run_config(argv: Sequence[str] | None = None) -> RunConfig:
    """Parse flags (and the --recipe they name) into a RunConfig and check every value checkable without torch."""
    argv = list(argv) if argv is not None else None
    recipe_path = _recipe_flag(argv)
    recipe = load_recipe(recipe_path) if recipe_path else {}
    namespace = build_parser(defaults=recipe).parse_args(argv)
    typed = vars(build_parser(suppress_defaults=True).parse_args(argv))
    sources = {name: f"recipe {recipe_path}" for name in recipe}
    sources.update({name: COMMAND_LINE for name in typed if name != "local_rank"})
    cfg = RunConfig(**slices_from(vars(namespace)), sources=sources)
    validate_run_config(cfg)
    return cfg


def _first_given(choices: list) -> tuple:
    """(value, where it came from) of the first choice whose value is given (the last one, the default, always is)."""
    return next((value, where) for value, where in choices if value)


def explain_inputs(cfg: RunConfig) -> list:
    """What the run reads, resolved: the model, the tokenizer and the data, where no flag names them the built-in
    defaults, each with where it came from."""
    model, data = cfg.model, cfg.data
    built = _first_given(
        [
            (model.model_name_or_path, "pretrained weights, --model_name_or_path"),
            (model.config_name, "its config, random init, --config_name"),
            (model.model_source, "the built-in tiny Llama's config, random init: default"),
        ]
    )
    train = _first_given(
        [
            (", ".join(data.store_paths), "prepared token stores, --data_path/--dataset_mix"),
            (data.dataset_name, "a Hugging Face dataset, --dataset_name"),
            (data.train_file, "--train_file"),
            (data.train_data_file, "the built-in sample: default"),
        ]
    )
    sample = "the built-in sample: default" if data.uses_default_data else "--validation_file"
    lines = [
        "  [inputs]",
        f"  model = {built[0]}  <- {built[1]}",
        f"  tokenizer = {model.tokenizer_source}  <- "
        + ("--tokenizer_name" if model.tokenizer_name else "the model's: default"),
        f"  train data = {train[0]}  <- {train[1]}",
    ]
    if data.validation_data_file:
        lines.append(f"  validation data = {data.validation_data_file}  <- {sample}")
    return lines


def explain_run_config(cfg: RunConfig) -> str:
    """What the run reads (explain_inputs), then every flag with its value and where it came from (command line,
    recipe, or default), by concern."""
    lines = explain_inputs(cfg)
    for slice_name in SLICES:
        lines.append(f"  [{slice_name}]")
        for f in dataclasses.fields(SLICES[slice_name]):
            source = cfg.source_of(f.name)
            source = f"--{f.name}" if source == COMMAND_LINE else source
            lines.append(f"  {f.name} = {getattr(getattr(cfg, slice_name), f.name)!r}  <- {source}")
    return "\n".join(lines)


def explain_resolved(
    cfg: RunConfig, *, ds: ResolvedDSConfig, block_size: int, n_params: int, dp_world_size: int
) -> str:
    """The resolved run and DeepSpeed configs with the source of every value (--print_config, config_sources.txt)."""
    return "\n".join(
        [
            f"run config (block_size = {block_size}, model {n_params / 1e6:.2f}M parameters):",
            explain_run_config(cfg),
            f"DeepSpeed config {cfg.engine.config}, resolved for {dp_world_size} data-parallel rank(s); "
            f"precision {ds.precision} ({ds.precision_reason}):",
            ds.explained(),
        ]
    )
