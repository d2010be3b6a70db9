"""Pipeline stages built alone: the model on the meta device, then only this rank's stage given its values, since
otherwise every rank would first build the whole model in host memory (280 GB in fp32 for 70B). DeepSpeed calls
StageWeights.load_into on the stage before moving it to the device. A pretrained safetensors checkpoint gives each owned
tensor, read alone; a random init replays the whole model's construction with other stages' draws made into a scratch
buffer, so the random stream, and thus one-rank equality, is a whole build's. Details:
docs/parallelism.md#pipeline-parallelism.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
# The in-place random fills of torch.Tensor: on a meta tensor they draw nothing, so the replay draws for them.
RANDOM_FILLS = ("normal_", "uniform_", "random_", "exponential_", "bernoulli_", "log_normal_", "cauchy_", "geometric_")


def _checkpoint_file(source: str, name: str) -> Path | None:
    """`name` in a local model folder, or in the hub cache (None when the checkpoint has no such file)."""
    if Path(source).is_dir():
        path = Path(source) / name
        return path if path.is_file() else None
    from transformers.utils import cached_file

    found = cached_file(
        source, name, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False
    )
    return Path(found) if found else None


def safetensors_files(source: str) -> dict | None:
    """{tensor key: file} of a model's safetensors checkpoint (sharded with an index, or one file), or None."""
    index = _checkpoint_file(source, SAFETENSORS_INDEX)
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = {name: _checkpoint_file(source, name) for name in set(weight_map.values())}
        if any(path is None for path in shards.values()):
            return None
        return {key: shards[name] for key, name in weight_map.items()}
    single = _checkpoint_file(source, SAFETENSORS_SINGLE)
    if single is None:
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def _nan_like(tensor, parameter: bool):
    """A real CPU tensor for a meta one, filled with NaN: a value nothing sets is caught, not trained on."""
    import torch

    value = torch.full(tensor.shape, float("nan"), dtype=tensor.dtype, device="cpu")
    return torch.nn.Parameter(value, tensor.requires_grad) if parameter else value


def _has_nan(tensor) -> bool:
    """Whether a value was left NaN (by its sum, which a NaN anywhere makes NaN: no mask the tensor's size)."""
    import torch

    return bool(torch.isnan(tensor.detach().sum()))


def _meta_slots(module):
    """(slot, attr, tensor) of the module's own meta parameters and buffers."""
    for slot in ("_parameters", "_buffers"):
        for attr, tensor in getattr(module, slot).items():
            if tensor is not None and tensor.is_meta:
                yield slot, attr, tensor


class StageWeights:
    """Gives a stage of a meta-device Hugging Face model its values; `read(wanted)` supplies them, for
    {id(tensor): (its names in the model, its module, attr)}, as {id(tensor): value}."""

    def __init__(self, hf_model, read: Callable[[dict], dict]):
        self.hf_model, self.read = hf_model, read
        self.names = defaultdict(list)  # id(tensor) -> every name it has (a tied weight has two)
        for name, tensor in [
            *hf_model.named_parameters(remove_duplicate=False),
            *hf_model.named_buffers(remove_duplicate=False),
        ]:
            self.names[id(tensor)].append(name)

    def load_into(self, stage_module) -> None:
        """Give every meta tensor of `stage_module` (this rank's layers, wrapping the model's own modules) its
        value, in the meta tensor's dtype (a pretrained model is built in fp32, as from_pretrained builds it here;
        a random init in its config's dtype, as from_config does). A tensor shared by two modules stays one."""
        import torch

        slots = [(owner, slot, attr, t) for owner in stage_module.modules() for slot, attr, t in _meta_slots(owner)]
        wanted = {id(t): (self.names[id(t)], owner, attr) for owner, _, attr, t in slots}
        values = self.read(wanted)
        placed = {}
        for owner, slot, attr, tensor in slots:
            if id(tensor) not in placed:
                value = values[id(tensor)]
                value = value.data if isinstance(value, torch.nn.Parameter) else value
                if value.is_floating_point() and tensor.is_floating_point():
                    value = value.to(tensor.dtype)
                placed[id(tensor)] = torch.nn.Parameter(value, tensor.requires_grad) if slot == "_parameters" else value
            getattr(owner, slot)[attr] = placed[id(tensor)]


class CheckpointTensors:
    """StageWeights.read from a safetensors checkpoint: each wanted tensor read by its key, the non-persistent
    buffers computed by the model's `_init_weights`."""

    def __init__(self, hf_model, files: dict):
        self.hf_model, self.files = hf_model, files
        prefix = getattr(hf_model, "base_model_prefix", "")
        self._prefix = f"{prefix}." if prefix else None
        # A tied weight (a head sharing the embedding's tensor) is one tensor of several names: a checkpoint holds it
        # under one of them (Hugging Face leaves the tied lm_head.weight out), and it is missing only if under none.
        names = defaultdict(list)
        for name, tensor in hf_model.state_dict(keep_vars=True).items():
            names[id(tensor)].append(name)
        self.missing = sorted(group[0] for group in names.values() if self.key(group) is None)

    def key(self, names: list) -> str | None:
        """The checkpoint key of a tensor: one of its names, or one without the base model's prefix (GPT-2's
        original checkpoints say "h.0..." for "transformer.h.0...")."""
        for name in names:
            if name in self.files:
                return name
            if self._prefix and name.startswith(self._prefix) and name[len(self._prefix) :] in self.files:
                return name[len(self._prefix) :]
        return None

    def __call__(self, wanted: dict) -> dict:
        from safetensors import safe_open

        keys = {ident: self.key(names) for ident, (names, _, _) in wanted.items()}
        by_file = defaultdict(set)
        for key in filter(None, keys.values()):
            by_file[self.files[key]].add(key)
        read: dict[str, torch.Tensor] = {}
        for path, file_keys in by_file.items():
            with safe_open(str(path), framework="pt") as handle:
                read.update((key, handle.get_tensor(key)) for key in file_keys)
        values = {ident: read[key] for ident, key in keys.items() if key is not None}
        for ident, (names, owner, attr) in wanted.items():
            if ident not in values:
                values[ident] = self._computed(owner, attr, names)
        log.info(
            "pipeline stage: %d tensors read from %d safetensors file(s), %d computed",
            len(read),
            len(by_file),
            len(wanted) - sum(1 for key in keys.values() if key is not None),
        )
        return values

    def _computed(self, owner, attr: str, names: list):
        """A tensor the checkpoint lacks, as the model initialises it: `_init_weights` on its module, made real
        (NaN-filled) on the CPU first."""
        import torch

        for slot, other_attr, other in list(_meta_slots(owner)):
            getattr(owner, slot)[other_attr] = _nan_like(other, slot == "_parameters")
        with torch.no_grad():
            self.hf_model._init_weights(owner)
        value = getattr(owner, attr)
        if not value.is_floating_point() or _has_nan(value):
            raise RuntimeError(
                f"pipeline stage: {names[0]} is neither in the checkpoint nor set by the model's _init_weights"
            )
        return value


class ReplayedInit:
    """StageWeights.read for a random init: the whole model built again on the meta device with every random
    draw replayed on the CPU, the wanted tensors made real (NaN-filled) just before their modules' `_init_weights`
    runs, so they get exactly the values a whole-model build gives them (see the module docstring)."""

    def __init__(self, outer_class: type, build: Callable):
        self.outer_class, self.build = outer_class, build

    def __call__(self, wanted: dict) -> dict:
        owned = {name for names, _, _ in wanted.values() for name in names}
        with _draws_replayed_on_meta_tensors(), _init_weights_on_meta(owned, self.outer_class):
            replay = self.build()
        found = {}
        for name, tensor in [
            *replay.named_parameters(remove_duplicate=False),
            *replay.named_buffers(remove_duplicate=False),
        ]:
            found[name] = tensor
        values = {}
        for ident, (names, _, _) in wanted.items():
            value = next((found[n] for n in names if n in found and not found[n].is_meta), None)
            if value is None or (value.is_floating_point() and _has_nan(value)):
                raise RuntimeError(f"pipeline stage: the replayed init did not set {names[0]}")
            values[ident] = value
        log.info("pipeline stage: %d tensors initialised as a whole-model build does (draws replayed)", len(values))
        return values


@contextmanager
def _draws_replayed_on_meta_tensors():
    """Every in-place random fill of a meta tensor draws the same numbers into a scratch CPU tensor of its shape
    instead: a view of one buffer per dtype, as large as the largest tensor (fresh tensors, freed at once, would
    leave the allocator holding memory it does not give back)."""
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in RANDOM_FILLS}
    buffers = {}

    def scratch(like):
        numel = like.numel()
        buffer = buffers.get(like.dtype)
        if buffer is None or buffer.numel() < numel:
            buffers[like.dtype] = buffer = None  # the smaller one goes before the larger one is made
            buffers[like.dtype] = buffer = torch.empty(numel, dtype=like.dtype, device="cpu")
        return buffer[:numel].view(like.shape)

    def replayed(original):
        def fill(self, *args, **kwargs):
            if self.is_meta:
                original(scratch(self), *args, **kwargs)
                return self
            return original(self, *args, **kwargs)

        return fill

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, replayed(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextmanager
def _init_weights_on_meta(owned: set, outer_class: type):
    """transformers' post_init initialises the weights on the meta device too (it skips them there), and the modules
    holding an `owned` tensor (by its full name in an `outer_class` model) get real tensors first, initialised on
    the CPU."""
    import torch
    from transformers import PreTrainedModel, modeling_utils

    original_device = modeling_utils.get_torch_context_manager_or_global_device
    original_init = PreTrainedModel._initialize_weights
    # id(meta tensor) -> (it, its real tensor): a tensor shared by two modules becomes one real tensor; the meta
    # tensor is kept alive, or a tensor created later could reuse its id
    real = {}
    prefixes = {}  # id(initialising model) -> {id(module): its name prefix in the outermost model}

    def initialize(model, module, is_custom_code=False):
        if getattr(module, "_is_hf_initialized", False):
            return original_init(model, module, is_custom_code)
        if id(model) not in prefixes:  # a base model is built (and initialised) inside the outer one, under its prefix
            base = "" if isinstance(model, outer_class) else f"{outer_class.base_model_prefix}."
            prefixes[id(model)] = {id(m): f"{base}{n}." if n else base for n, m in model.named_modules()}
        name = prefixes[id(model)][id(module)]
        made_real = False
        for slot, attr, tensor in list(_meta_slots(module)):
            if id(tensor) not in real and f"{name}{attr}" in owned:
                real[id(tensor)] = (tensor, _nan_like(tensor, slot == "_parameters"))
            if id(tensor) in real:
                getattr(module, slot)[attr] = real[id(tensor)][1]
                made_real = True
        if not made_real:
            return original_init(model, module, is_custom_code)
        with torch.device("cpu"):
            return original_init(model, module, is_custom_code)

    try:
        modeling_utils.get_torch_context_manager_or_global_device = lambda: torch.device("cpu")
        PreTrainedModel._initialize_weights = initialize  # type: ignore[method-assign]  # while a stage is built
        yield
    finally:
        modeling_utils.get_torch_context_manager_or_global_device = original_device
        PreTrainedModel._initialize_weights = original_init  # type: ignore[method-assign]  # transformers' own, back


def stage_weights_model(args, model_config):
    """The model on the meta device, with `model.stage_weights` (a StageWeights) to give a pipeline stage its
    values; or None (the reason logged) when a pretrained checkpoint is not in safetensors or lacks a tensor."""
    import torch
    from transformers import AutoModelForCausalLM

    def meta_build():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(
                model_config,
                trust_remote_code=args.trust_remote_code,
                attn_implementation=args.attn_implementation,
                **({"dtype": torch.float32} if args.model_name_or_path else {}),
            )

    if not args.model_name_or_path:
        model = meta_build()
        model.stage_weights = StageWeights(model, ReplayedInit(type(model), meta_build))
        return model
    files = safetensors_files(args.model_name_or_path)
    model = meta_build()
    if files is None:
        convert = "convert it (save_pretrained(..., safe_serialization=True)) to build each stage alone"
        _whole_build(f"{args.model_source} has no safetensors checkpoint", model, convert)
        return None
    checkpoint = CheckpointTensors(model, files)
    if checkpoint.missing:
        missing = ", ".join(checkpoint.missing[:3]) + (", ..." if len(checkpoint.missing) > 3 else "")
        lacks = f"the checkpoint lacks {len(checkpoint.missing)} of the model's tensors ({missing})"
        _whole_build(lacks, model, "check that the checkpoint matches the model's config")
        return None
    model.stage_weights = StageWeights(model, checkpoint)
    return model


def _whole_build(reason: str, meta_model, hint: str) -> None:
    """The fallback said loudly: what forces it, the host memory every rank's whole build will take, what to do."""
    n_bytes = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    size = f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.0f} MB"
    log.warning(
        "pipeline: %s; every rank builds the whole model first (%s of host memory per rank, where its stage alone "
        "would hold about 1/pipeline_parallel_size of it): %s",
        reason,
        size,
        hint,
    )
