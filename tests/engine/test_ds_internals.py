"""Every DeepSpeed internal scaletrain hooks resolves on the pinned DeepSpeed, and a moved one fails loudly.

The slow tests that prove the hooks still *act* are named beside each hook in scaletrain/engine/ds_internals/;
these check, in-process and fast, that each one is found on the installed DeepSpeed (so an upgrade that moves one fails
here first) and that a missing one raises DeepSpeedInternalsMoved naming it, instead of an AttributeError mid-run.
"""

from __future__ import annotations

import functools
import importlib
import logging
import subprocess
import sys

import pytest

from scaletrain.engine import ds_internals
from scaletrain.engine import ops
from scaletrain.engine.ds_internals import guard
from scaletrain.engine.ds_internals import (
    CHECKED_DEEPSPEED_VERSIONS,
    CHECKED_TORCH_VERSIONS,
    HOOKS,
    DeepSpeedInternalsMoved,
    SkipSwitch,
)
from tests.harness import REPO

STAGE3 = "deepspeed.runtime.zero.stage3"
STAGE12 = "deepspeed.runtime.zero.stage_1_and_2"
COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"


def _class(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _assert_names(err: pytest.ExceptionInfo, where: str, *also: str, checked=CHECKED_DEEPSPEED_VERSIONS) -> None:
    message = str(err.value)
    assert "\n" not in message
    for part in (where, *checked, "scaletrain/engine/ds_internals/", *also):
        assert part in message, f"{part!r} not in {message!r}"


def test_the_installed_deepspeed_is_a_checked_version_and_every_hook_resolves():
    import deepspeed

    assert deepspeed.__version__ in CHECKED_DEEPSPEED_VERSIONS
    assert ds_internals.check_hooks() == [hook.where for hook in HOOKS]


@pytest.mark.parametrize("hook", [h for h in HOOKS if h.name], ids=lambda h: h.name)
def test_each_missing_hook_raises_a_message_that_names_it(hook, monkeypatch):
    owner = hook.owner_object()
    monkeypatch.delattr(owner, hook.name)
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        ds_internals.check_hooks()
    checked = CHECKED_TORCH_VERSIONS if hook.where.startswith("torch.") else CHECKED_DEEPSPEED_VERSIONS
    _assert_names(err, hook.where, hook.purpose, checked=checked)


def test_a_missing_universal_converter_and_a_changed_checkpoint_version_are_refused(monkeypatch, tmp_path):
    command = ds_internals.universal_conversion_command(tmp_path / "step2", tmp_path / "out")
    assert command == [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(tmp_path / "step2"),
        "--output_folder",
        str(tmp_path / "out"),
        "--inject_missing_state",
    ]
    info = ds_internals.universal_checkpoint_info()
    assert info == {"universal_checkpoint_info": {"universal_checkpoint_version": 0.4}}

    constants = importlib.import_module("deepspeed.checkpoint.constants")
    monkeypatch.setattr(constants, "UNIVERSAL_CHECKPOINT_VERSION_VALUE", 0.5)
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        ds_internals.check_hooks()
    _assert_names(err, "UNIVERSAL_CHECKPOINT_VERSION_VALUE is 0.5")
    monkeypatch.undo()

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.endswith("ds_to_universal") else real_find_spec(name, *a),
    )
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        ds_internals.universal_conversion_command(tmp_path / "step2", tmp_path / "out")
    _assert_names(
        err,
        "deepspeed.checkpoint.ds_to_universal is missing",
        "resuming on another rank count",
        "resume with the rank count",
    )


def _bare(module: str, name: str, **attributes):
    """A real DeepSpeed ZeRO optimizer object without its __init__ (which needs a process group and a model)."""
    optimizer = object.__new__(_class(module, name))
    vars(optimizer).update(attributes)
    return optimizer


def test_the_skip_switch_sets_overflow_where_zero3_computes_it(monkeypatch):
    calls = []
    monkeypatch.setattr(
        _class(STAGE3, "DeepSpeedZeroOptimizer_Stage3"),
        "_overflow_check_and_loss_scale_update",
        lambda self, update_scale=True: calls.append(update_scale) or False,
    )
    optimizer = _bare(STAGE3, "DeepSpeedZeroOptimizer_Stage3", overflow=False)
    switch = SkipSwitch(optimizer)
    assert optimizer._overflow_check_and_loss_scale_update(False) is False and calls == [False]
    switch.skip = True
    assert optimizer._overflow_check_and_loss_scale_update(update_scale=False) is True
    assert optimizer.overflow is True and calls == [False]  # DeepSpeed's own check did not run


def test_the_skip_switch_sets_overflow_where_zero12_computes_it():
    optimizer = _bare(STAGE12, "DeepSpeedZeroOptimizer", overflow=False, check_grad_overflow=False)
    switch = SkipSwitch(optimizer)
    assert optimizer.check_grad_overflow is True  # now consulted on every step
    optimizer.check_overflow()  # not skipping, and DeepSpeed's own check was off: nothing happens
    assert optimizer.overflow is False
    switch.skip = True
    optimizer.check_overflow()
    assert optimizer.overflow is True


@pytest.mark.parametrize(
    "module, name, attributes, missing",
    [
        (STAGE3, "DeepSpeedZeroOptimizer_Stage3", {"overflow": False}, "_loss_scale_update_and_overflow_cleanup"),
        (STAGE3, "DeepSpeedZeroOptimizer_Stage3", {}, "overflow"),
        (STAGE12, "DeepSpeedZeroOptimizer", {"overflow": False}, "check_grad_overflow"),
        (STAGE12, "DeepSpeedZeroOptimizer", {"check_grad_overflow": True}, "overflow"),
    ],
)
def test_the_skip_switch_refuses_an_optimizer_whose_hook_moved(module, name, attributes, missing, monkeypatch):
    cls = _class(module, name)
    if missing in vars(cls):
        monkeypatch.delattr(cls, missing)
    optimizer = _bare(module, name, **attributes)
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        SkipSwitch(optimizer)
    _assert_names(err, f"{module}.{name}.{missing} is missing", "--on_nonfinite skip", "--on_nonfinite stop")
    assert vars(optimizer) == attributes  # nothing was half-installed


def test_the_skip_switch_replaces_a_torch_optimizers_step_and_refuses_others():
    import torch

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    switch = SkipSwitch(optimizer)
    weight.grad = torch.ones(2)
    switch.skip = True
    optimizer.step()
    assert optimizer.overflow is True and weight.grad is None and weight.tolist() == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="cannot skip updates of a object optimizer") as err:
        SkipSwitch(object())
    assert not isinstance(err.value, DeepSpeedInternalsMoved)


class _EngineStandIn:
    """Stands in for DeepSpeedEngine.was_step_applied (the one engine method the self-check reads)."""

    def __init__(self, applied: bool):
        self.applied = applied

    def was_step_applied(self) -> bool:
        return self.applied


def test_a_skip_the_hook_did_not_make_stops_the_run():
    import torch

    from scaletrain.engine.ds_internals import NonFiniteSkipBroken

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    switch = SkipSwitch(optimizer)
    switch.skip = True
    weight.grad = torch.ones(2)
    optimizer.step()  # through the hook: skipped
    switch.confirm_skipped(_EngineStandIn(applied=False))
    # A DeepSpeed that reaches the update another way (here: the class's own step) bypasses the hook: the update
    # lands, and the check says so instead of training on.
    weight.grad = torch.ones(2)
    torch.optim.SGD.step(optimizer)
    assert weight.tolist() == [0.0, 0.0]
    with pytest.raises(
        NonFiniteSkipBroken,
        match="was not intercepted .the hook never ran.: DeepSpeed .* checked with .0.19.8.; use --on_nonfinite stop",
    ):
        switch.confirm_skipped(_EngineStandIn(applied=True))
    # A DeepSpeed that calls the hook but ignores the overflow flag applies the update: stopped too.
    optimizer.step()
    with pytest.raises(NonFiniteSkipBroken, match="was applied .the hook ran."):
        switch.confirm_skipped(_EngineStandIn(applied=True))


def test_releasing_zero3_references_empties_the_stack_and_the_class_cache(monkeypatch):
    import torch

    parameter_offload = importlib.import_module("deepspeed.runtime.zero.parameter_offload")
    coordinator = _class(COORDINATOR, "PartitionedParameterCoordinator")
    mangled = "_PartitionedParameterCoordinator__params_to_release"
    cached = functools.lru_cache(maxsize=None)(lambda submodule, step: {step})  # stands in for DeepSpeed's
    monkeypatch.setattr(coordinator, mangled, cached)
    model, other = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2)
    monkeypatch.setattr(parameter_offload, "FWD_MODULE_STACK", [model, model[0], other])
    cached(model, 1)
    ds_internals.release_zero3_references(model)
    assert parameter_offload.FWD_MODULE_STACK == [other] and cached.cache_info().currsize == 0

    monkeypatch.setattr(coordinator, mangled, lambda submodule, step: {step})
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        ds_internals.release_zero3_references(model)
    _assert_names(err, f"{COORDINATOR}.PartitionedParameterCoordinator.{mangled} no longer carries a functools cache")
    monkeypatch.delattr(parameter_offload, "FWD_MODULE_STACK")
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        ds_internals.release_zero3_references(model)
    _assert_names(err, "deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK is missing")


def test_op_loading_hooks_fail_loudly_when_moved(monkeypatch):
    from deepspeed.accelerator import get_accelerator
    from torch.utils import cpp_extension

    builder = ds_internals.create_op_builder("CPUAdamBuilder")
    assert builder.name == "cpu_adam" and ds_internals.op_preinstalled(builder) is False
    assert ops.build_directory("cpu_adam").rstrip("/").endswith("cpu_adam")

    monkeypatch.delattr(importlib.import_module("deepspeed.git_version_info"), "installed_ops")
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        ds_internals.op_preinstalled(builder)
    _assert_names(err, "deepspeed.git_version_info.installed_ops is missing")
    monkeypatch.delattr(cpp_extension, "_get_build_directory")
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        ops.build_directory("cpu_adam")
    _assert_names(
        err,
        "torch.utils.cpp_extension._get_build_directory is missing",
        "install torch==2.13.0",
        checked=CHECKED_TORCH_VERSIONS,
    )
    for cls in type(get_accelerator()).__mro__:
        if "create_op_builder" in vars(cls):
            monkeypatch.delattr(cls, "create_op_builder")
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        ops.load_op("CPUAdamBuilder")
    _assert_names(err, "create_op_builder is missing")


def test_the_shm_build_is_skipped_through_its_hook(monkeypatch):
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    monkeypatch.setattr(comm_torch, "build_shm_op", comm_torch.build_shm_op)  # restored afterwards
    ds_internals.skip_shm_op_build()
    assert comm_torch.build_shm_op() is None
    monkeypatch.delattr(comm_torch, "build_shm_op")
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        ds_internals.skip_shm_op_build()
    _assert_names(err, "deepspeed.comm.torch.build_shm_op is missing")


def test_another_deepspeed_version_is_warned_about_once_and_named_in_errors(monkeypatch, caplog):
    import deepspeed

    monkeypatch.setattr(guard, "_version_checked", False)  # guard.py holds the once-per-process flag
    with caplog.at_level(logging.WARNING, logger=guard.__name__):
        assert ds_internals.check_version() is None
    assert not caplog.records

    monkeypatch.setattr(deepspeed, "__version__", "0.99.1")
    monkeypatch.setattr(guard, "_version_checked", False)
    with caplog.at_level(logging.WARNING, logger=guard.__name__):
        ds_internals.check_version()
        ds_internals.check_hooks()  # every hook checks the version, and does not warn again
    assert len(caplog.records) == 1
    assert "DeepSpeed 0.99.1 is not a version" in caplog.text and "deepspeed==0.19.8" in caplog.text

    monkeypatch.delattr(_class(STAGE12, "DeepSpeedZeroOptimizer"), "check_overflow")
    with pytest.raises(DeepSpeedInternalsMoved) as err:
        ds_internals.check_hooks()
    _assert_names(err, "DeepSpeed 0.99.1: ", "install deepspeed==0.19.8")


def test_importing_the_module_imports_neither_torch_nor_deepspeed():
    code = "import sys, scaletrain.engine.ds_internals; print(sorted({'torch', 'deepspeed'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_json_key_check_reads_deepspeed_config_models_through_ds_internals():
    """DeepSpeed's pydantic config models are hooks like the others (checked by check_hooks, so by the pre-flight),
    and the schema module imports nothing from DeepSpeed itself."""
    import ast

    from scaletrain.engine.ds_internals.checklist import HOOKS
    from scaletrain.engine.ds_internals.config_models import CONFIG_MODELS, deepspeed_config_models

    assert set(CONFIG_MODELS.values()) <= set(HOOKS)
    models = deepspeed_config_models()
    assert (
        models["zero_optimization"].__name__ == "DeepSpeedZeroConfig"
        and "stage" in models["zero_optimization"].model_fields
    )
    schema = REPO / "scaletrain" / "config" / "deepspeed_schema.py"
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(schema.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not {m for m in imported if m and m.split(".")[0] == "deepspeed"}, imported
    assert "scaletrain.engine" in imported


def test_the_stages_universal_records_merge_into_one_that_names_every_stages_split():
    """TP x PP: each stage's module records only its own parameters' splits (as DeepSpeed 0.19.8's AutoTP writes
    them, shortened from a real TP 2 x PP 2 run); the merged record holds both stages' patterns and maps, once, and
    marks the tied modules as pipeline-replicated."""
    from scaletrain.engine.ds_internals.checkpoints import merged_universal_info

    def stage(layers: range, whole: list) -> dict:
        row = [rf"^{i}\.layer\.self_attn\.o_proj\.weight$" for i in layers]
        replicated = [rf"^{i}\.layer\.input_layernorm\.weight$" for i in layers] + whole
        return {
            "universal_checkpoint_version": 0.4,
            "parameter_with_row_parallelism_patterns": row,
            "tp_replicated_parameter_patterns": replicated,
            "vocabulary_parameter_patterns": [],
            "parameter_with_sub_params": [],
            "autotp_unsupported_parameter_patterns": {},
            "affine_map": {"version": 1, "params": {pattern: {"kind": "replicated"} for pattern in replicated}},
        }

    first, last = stage(range(1, 3), [r"^0\.embedding\.weight$"]), stage(range(3, 5), [r"^6\.head\.weight$"])
    merged = merged_universal_info([first, last, first, last], "pipeline_replicated_parameter_patterns")
    assert merged["parameter_with_row_parallelism_patterns"] == sorted(
        first["parameter_with_row_parallelism_patterns"] + last["parameter_with_row_parallelism_patterns"]
    )
    assert r"^6\.head\.weight$" in merged["tp_replicated_parameter_patterns"]  # the last stage's, kept
    assert len(merged["tp_replicated_parameter_patterns"]) == 6
    assert set(merged["affine_map"]["params"]) == set(merged["tp_replicated_parameter_patterns"])
    assert merged["affine_map"]["version"] == 1 and merged["universal_checkpoint_version"] == 0.4
    assert merged["pipeline_replicated_parameter_patterns"] == [r"^tied_modules\."]
