"""RunConfig: the slices composed, one field per concern, with where each value came from; SLICES, the order of
--help and --print_config; and the flags' names and types as the command line and the recipes see them.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scaletrain.config.guards import HangArgs, NonFiniteArgs
from scaletrain.config.harness import HarnessArgs
from scaletrain.config.planning import PlanningArgs
from scaletrain.config.preference import PreferenceArgs
from scaletrain.config.slices import (
    CheckpointArgs,
    DataArgs,
    EngineArgs,
    LoggingArgs,
    ModelArgs,
    OptimArgs,
    ParallelArgs,
    PeftArgs,
    RunArgs,
)

# Slice name -> its dataclass: the order of --help and of --print_config. A new concern adds a line here.
SLICES = {
    "run": RunArgs,
    "model": ModelArgs,
    "peft": PeftArgs,
    "data": DataArgs,
    "preference": PreferenceArgs,
    "optim": OptimArgs,
    "engine": EngineArgs,
    "parallel": ParallelArgs,
    "checkpoint": CheckpointArgs,
    "nonfinite": NonFiniteArgs,
    "hang": HangArgs,
    "logging": LoggingArgs,
    "lm_eval": HarnessArgs,
    "planning": PlanningArgs,
}
# Hugging Face's spellings: of the DeepSpeed JSON flag, and transformers 5's name for activation checkpointing.
FLAG_ALIASES = {"deepspeed": "config", "activation_checkpointing": "gradient_checkpointing"}


@dataclass(frozen=True)
class RunConfig:
    run: RunArgs = field(default_factory=RunArgs)
    model: ModelArgs = field(default_factory=ModelArgs)
    peft: PeftArgs = field(default_factory=PeftArgs)
    data: DataArgs = field(default_factory=DataArgs)
    preference: PreferenceArgs = field(default_factory=PreferenceArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    engine: EngineArgs = field(default_factory=EngineArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    nonfinite: NonFiniteArgs = field(default_factory=NonFiniteArgs)
    hang: HangArgs = field(default_factory=HangArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    lm_eval: HarnessArgs = field(default_factory=HarnessArgs)
    planning: PlanningArgs = field(default_factory=PlanningArgs)
    # Not flags: where each value that is not a default came from ("command line", or "recipe <file>").
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def explicit_flags(self) -> frozenset:
        """Flags the user set (typed, or in the recipe), as opposed to defaults."""
        return frozenset(self.sources)

    def to_dict(self) -> dict:
        """Every flag with its value, flat, as saved in run_config.json."""
        return {f.name: getattr(getattr(self, slice_name), f.name) for slice_name, f in flag_fields()}

    def source_of(self, name: str) -> str:
        return self.sources.get(name, "default")


def flag_fields(slices: Sequence[str] | None = None) -> list:
    """[(slice name, dataclass field)] of every flag, in --help order."""
    return [(name, f) for name in (slices or SLICES) for f in dataclasses.fields(SLICES[name])]


def _check_unique_flag_names() -> None:
    names = [f.name for _, f in flag_fields()]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    assert not duplicated, f"flags defined in two slices: {duplicated}"  # one flat command line needs unique names


_check_unique_flag_names()


@functools.cache
def _type_hints(owner: type) -> dict:
    """A slice's annotations, resolved once (every flag asks: resolving them per field took 0.4 s of each start)."""
    return typing.get_type_hints(owner)


def _field_hint(owner: type, f: dataclasses.Field):
    """The field's annotation with Optional[] removed."""
    hint = _type_hints(owner)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _value_type(owner: type, f: dataclasses.Field) -> type:
    """int, float, bool or str: the field's type, or its elements' for a fixed-length tuple flag."""
    hint = _field_hint(owner, f)
    return typing.get_args(hint)[0] if typing.get_origin(hint) is tuple else hint


def _nargs(owner: type, f: dataclasses.Field) -> int | None:
    """How many values a tuple flag takes (`--rampup_batch_size 16 16 1000`); None for a single value."""
    hint = _field_hint(owner, f)
    return len(typing.get_args(hint)) if typing.get_origin(hint) is tuple else None
