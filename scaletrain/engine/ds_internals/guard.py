"""The version guard over every DeepSpeed (and torch) internal scaletrain hooks: the versions they were checked
against, the warning for another DeepSpeed (once per process), the one-line DeepSpeedInternalsMoved error, and Hook,
which finds an internal and checks it before anything uses it. The area modules beside this one declare their hooks
with it; checklist.py resolves them all.

Importing this module imports neither torch nor DeepSpeed; each function imports what it touches.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any  # an internal found by name at run time is whatever DeepSpeed made it

log = logging.getLogger(__name__)

CHECKED_DEEPSPEED_VERSIONS = ("0.19.8",)
CHECKED_TORCH_VERSIONS = ("2.13.0",)  # only for torch.utils.cpp_extension._get_build_directory

_CHECKED = {"deepspeed": ("DeepSpeed", CHECKED_DEEPSPEED_VERSIONS), "torch": ("torch", CHECKED_TORCH_VERSIONS)}
_MISSING = object()
# Warn once per process: the one module global that says whether check_version has run (tests reset it here).
_version_checked = False


class DeepSpeedInternalsMoved(RuntimeError):
    """A DeepSpeed (or torch) internal that scaletrain hooks is gone or changed: the installed version differs."""


def check_version() -> str | None:
    """Warn once per process when the installed DeepSpeed is not one the hooks were checked against; the warning."""
    global _version_checked
    if _version_checked:
        return None
    _version_checked = True
    import deepspeed

    installed = deepspeed.__version__
    if installed.split("+")[0] in CHECKED_DEEPSPEED_VERSIONS:
        return None
    message = (
        f"DeepSpeed {installed} is not a version scaletrain's DeepSpeed hooks were checked against "
        f"({', '.join(CHECKED_DEEPSPEED_VERSIONS)}): a hook that moved stops the run with "
        f"DeepSpeedInternalsMoved; pin deepspeed=={CHECKED_DEEPSPEED_VERSIONS[-1]} to be safe"
    )
    log.warning(message)
    return message


def _dotted(obj: object) -> str:
    if isinstance(obj, type(sys)):
        return obj.__name__
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def moved(where: str, problem: str, purpose: str, instead: str = "") -> DeepSpeedInternalsMoved:
    """The one-line error for the internal `where` (a dotted name); `problem` says what is wrong ("is missing")."""
    library = where.split(".")[0]
    if library not in _CHECKED:  # e.g. DeepSpeed's op builders, importable as a top-level `op_builder` package
        library = "deepspeed"
    label, checked = _CHECKED[library]
    installed = getattr(sys.modules.get(library), "__version__", "(not importable)")
    todo = f"install {library}=={checked[-1]}" + (f", or {instead}" if instead else "")
    return DeepSpeedInternalsMoved(
        f"{label} {installed}: {where} {problem}, which scaletrain needs for {purpose} (checked against {label} "
        f"{', '.join(checked)}); {todo}, or update scaletrain/engine/ds_internals/"
    )


def require(owner: object, name: str, purpose: str, instead: str = "") -> Any:
    """`owner.name` (owner: a module, class or instance), or DeepSpeedInternalsMoved naming it and its purpose."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        raise moved(f"{_dotted(owner)}.{name}", "is missing", purpose, instead)
    return value


@dataclass(frozen=True)
class Hook:
    """One internal: `owner` is "package.module" or "package.module:Class"; `name` its attribute, or None when the
    owner is a module that must exist to be run with `python -m`. `problem` tells what is wrong with a found value."""

    owner: str
    name: str | None
    purpose: str
    instead: str = ""
    problem: Callable[[object], str | None] | None = None

    @property
    def where(self) -> str:
        return self.owner.replace(":", ".") + (f".{self.name}" if self.name else "")

    def resolve(self) -> Any:
        """The attribute, looked up from its owner (importing it), checked."""
        if self.name is None:
            return self._find_module()
        return self.on(self.owner_object())

    def owner_object(self) -> Any:
        """The owner module or class (imported): whatever DeepSpeed made it, its attributes found by name."""
        module_name, _, class_name = self.owner.partition(":")
        if module_name.split(".")[0] == "deepspeed":
            check_version()
        try:
            owner = importlib.import_module(module_name)
        except ImportError as err:
            raise moved(module_name, f"cannot be imported ({err})", self.purpose, self.instead) from err
        return require(owner, class_name, self.purpose, self.instead) if class_name else owner

    def on(self, obj: object) -> Any:
        """The attribute looked up on `obj` (an instance of the owner class, or the owner itself), checked."""
        assert self.name is not None, f"{self.owner}: a module hook has no attribute to look up"
        value = require(obj, self.name, self.purpose, self.instead)
        problem = self.problem(value) if self.problem else None
        if problem:
            raise moved(f"{_dotted(obj)}.{self.name}", problem, self.purpose, self.instead)
        return value

    def _find_module(self) -> str:
        module_name = self.owner
        if module_name.split(".")[0] == "deepspeed":
            check_version()
        try:
            found = importlib.util.find_spec(module_name) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            raise moved(module_name, "is missing", self.purpose, self.instead)
        return module_name
