"""Recipes: `--recipe run.yaml` supplies flag values from a YAML file, checked like typed flags; a flag typed on the
command line wins over it. PyYAML is imported only when a recipe is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Sequence
from pathlib import Path

from scaletrain.config.run_config import FLAG_ALIASES, SLICES, _nargs, _value_type, flag_fields
from scaletrain.errors import UsageError


def _recipe_flag(argv: Sequence[str] | None) -> str | None:
    """The --recipe value, read before the full parse (its values become the parser's defaults)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--recipe", default=None)
    known, _ = pre.parse_known_args(argv)
    return known.recipe


def load_recipe(path: str) -> dict:
    """A recipe: a YAML mapping of flag names to values, checked like the flags: {flag: typed value}."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--recipe {path}: no such file", "recipes/ holds examples")
    try:
        content = yaml.safe_load(file.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"--recipe {path}: cannot read it ({err})") from err
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise UsageError(
            f"--recipe {path}: not valid YAML{line} ({getattr(err, 'problem', None) or err})",
            "write one `flag_name: value` per line",
        ) from err
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise UsageError(
            f"--recipe {path}: must be a mapping of flag names to values, not a {type(content).__name__}",
            "write one `flag_name: value` per line",
        )
    fields = {f.name: (SLICES[slice_name], f) for slice_name, f in flag_fields()}
    values = {}
    for key, value in content.items():
        name = FLAG_ALIASES.get(str(key), str(key))
        if name == "recipe":
            raise UsageError(f"--recipe {path}: a recipe cannot name another recipe", "merge the two files")
        if name not in fields:
            close = difflib.get_close_matches(str(key), list(fields) + list(FLAG_ALIASES), n=1)
            raise UsageError(
                f'--recipe {path}: unknown key "{key}"',
                f"did you mean {close[0]}?" if close else "keys are train.py's flag names, without --",
            )
        values[name] = _recipe_value(path, name, value, *fields[name])
    return values


def _recipe_value(path: str, name: str, value, owner: type, f: dataclasses.Field):
    """A recipe value converted to the flag's type, as argparse converts a typed one (same choices)."""
    kind = _value_type(owner, f)
    where = f"--recipe {path}: {name}"
    if value is None:
        if f.default is None:
            return None
        raise UsageError(f'{where}: needs a value (it has no "unset")', f"remove the key for the default {f.default}")
    if kind is bool:
        if not isinstance(value, bool):
            raise UsageError(f"{where}: {value!r} is not true or false")
        return value
    count = _nargs(owner, f)
    if count:  # a tuple flag: a YAML list of `count` values, each converted like one typed value
        if not isinstance(value, list) or len(value) != count:
            raise UsageError(f"{where}: {value!r} is not a list of {count} values")
        return tuple(_recipe_scalar(where, v, kind, f.metadata.get("choices")) for v in value)
    if isinstance(value, list) and kind is str:  # a comma-separated flag written as a YAML list
        value = ",".join(str(v) for v in value)
    converted = _recipe_scalar(where, value, kind, f.metadata.get("choices"))
    if "type" not in f.metadata:
        return converted
    try:
        return f.metadata["type"](converted)  # the flag's own converter: Hugging Face's names too
    except UsageError as err:  # named as the recipe's key, not as a typed flag
        raise UsageError(f"{where}: {converted!r}: {err.message.split(': ', 1)[1]}", err.hint) from None


def _recipe_scalar(where: str, value, kind: type, choices):
    if isinstance(value, (bool, list, dict)):
        raise UsageError(f"{where}: {value!r} is not a single {kind.__name__}")
    try:
        converted = kind(value)  # YAML reads 1e-3 (no dot) as a string: float() takes it, as argparse would
    except ValueError:
        raise UsageError(f"{where}: {value!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is int and isinstance(value, float) and converted != value:
        raise UsageError(f"{where}: {value!r} is not an integer")
    if choices and converted not in choices:
        raise UsageError(f"{where}: {converted!r} is not one of {', '.join(choices)}")
    return converted
