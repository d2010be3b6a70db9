"""Load a DeepSpeed JSON, fill every "auto" from the run's flags, the model and the hardware, and assemble the
run's DeepSpeed config from it and the keys other concerns contribute (the layout's, the resume's).

The JSON is data: the numbers the run decides (batch sizes, learning rate, clipping, precision, bucket sizes)
are computed here, once, and each value remembers where it came from (the JSON file, a flag, a default, a
contribution) so that the printed and saved config explains itself. Imports no torch: the caller passes in the
facts about hardware and model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scaletrain.config.deepspeed_schema import check_ds_keys
from scaletrain.config.slices import NVME_PATH_ENV, EngineArgs, OptimArgs
from scaletrain.errors import UsageError

# A value of the DeepSpeed JSON: what json.loads returns.
JSONValue = dict | list | str | int | float | bool | None
AUTO = "auto"
DEFAULT_OPTIMIZER = {
    "type": "AdamW",
    "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO},
}
ADAM_TYPES = {"adam", "adamw"}


@dataclass(frozen=True)
class HardwareFacts:
    """What the resolver needs to know about the machine (gathered by the caller, which may import torch)."""

    accelerator: str  # "cuda" or "cpu" (DeepSpeed's accelerator name)
    bf16_fast: bool  # bf16 matrix products run at full speed here (CUDA with bf16 support)


@dataclass(frozen=True)
class LinkFacts:
    """A collective's cost model on the ranks' link: latency + bytes / bandwidth (bus bandwidth)."""

    latency_s: float
    bandwidth_bytes_per_s: float


# CUDA: NCCL within an H100/H200 node, ~50 us per collective and ~450 GB/s bus bandwidth on NVLink 4 (the binding
# case: across nodes, 400 Gb/s InfiniBand is ~50 GB/s per GPU, which needs a 9x smaller bucket). CPU: gloo between
# two ranks on this 2-core box, measured (2026-12-01: 0.4-1.2 ms for small all-reduces, 0.75-1.2 GB/s for 1-64 MB).
LINKS = {"cuda": LinkFacts(50e-6, 450e9), "cpu": LinkFacts(1e-3, 1.2e9)}
LATENCY_SHARE = 0.10  # a bucket spends at most this share of its collective's time on latency
MAX_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's own default, the memory bound (2 GB of fp32 per bucket buffer)


def bucket_elements(accelerator: str, precision: str, n_params: int | None, cap: str = "the model") -> tuple:
    """(elements, why) of a collective bucket (reduce, all-gather, ZeRO-3 prefetch).

    A collective of B bytes takes a + B / b on a link of latency a and bandwidth b; latency is at most a share s of
    it from B = a b (1 - s) / s = 9 a b (s = 10%). Bounded above by the model's parameter count (one bucket holds
    every gradient: larger buys nothing, and ZeRO-2 allocates its buckets whole) and by DeepSpeed's default of 5e8
    elements (memory). The "auto" rule it replaces (hidden^2) gave 65,536 elements on a hidden-256 model: a 256 KB
    all-reduce that gloo spends ~80% of in latency. Under tensor or pipeline parallelism `n_params` is one rank's share
    (`cap` names it): a rank reduces only its shards' and its stage's gradients, and ZeRO-1 and -3 allocate their
    bucket whole."""
    link = LINKS.get(accelerator, LINKS["cuda"])
    element_bytes = 4 if precision == "fp32" else 2
    amortised = int(link.latency_s * link.bandwidth_bytes_per_s * (1 - LATENCY_SHARE) / LATENCY_SHARE / element_bytes)
    elements = min(amortised, MAX_BUCKET_ELEMENTS, n_params or MAX_BUCKET_ELEMENTS)
    why = (
        f"{link.latency_s * 1e6:g} us x {link.bandwidth_bytes_per_s / 1e9:g} GB/s x 9 ({accelerator} link, "
        f"latency <= 10%) / {element_bytes} bytes = {amortised}"
    )
    if elements < amortised:
        why += f", capped at {cap if elements == n_params else 'DeepSpeed default'} ({elements})"
    return elements, why


@dataclass(frozen=True)
class DSKey:
    """One key a concern outside the JSON's own resolution contributes to the DeepSpeed config: the dotted key, its
    value, and why (shown beside it by --print_config)."""

    key: str
    value: JSONValue
    source: str


@dataclass(frozen=True)
class ResolvedDSConfig:
    config: dict
    sources: dict  # dotted key -> where its value came from, for each value not taken as written in `origin`
    precision: str  # "bf16", "fp16" or "fp32"
    precision_reason: str
    origin: str = "the DeepSpeed JSON"  # where the values without a recorded source were written (--config)

    @classmethod
    def saved(cls, config: dict, source: str) -> ResolvedDSConfig:
        """A run's resolved JSON as train.py saved it (ds_config.json): every value from `source`, the precision its
        bf16/fp16 sections enable."""
        precision = next((kind for kind in ("bf16", "fp16") if config.get(kind, {}).get("enabled") is True), "fp32")
        return cls(config, {}, precision, f"{source}: {precision}", origin=source)

    @property
    def zero_stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    @property
    def offload_devices(self) -> tuple[str, str]:
        """(the optimizer's, the parameters' offload device): "none", "cpu" or "nvme"."""
        zero = self.config.get("zero_optimization", {})
        optimizer, param = (zero.get(f"offload_{kind}", {}).get("device") or "none" for kind in ("optimizer", "param"))
        return optimizer, param

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_devices[0] != "none"

    @property
    def offloads_params(self) -> bool:
        return self.offload_devices[1] != "none"

    @property
    def offload_setting(self) -> str:
        """The offload devices as checkpoints record them: "optimizer=<device>,param=<device>"."""
        optimizer, param = self.offload_devices
        return f"optimizer={optimizer},param={param}"

    @property
    def micro_batch(self) -> int:
        return int(self.config["train_micro_batch_size_per_gpu"])

    @property
    def peak_lr(self) -> float:
        """The peak LR the optimizer gets: --learning_rate, or an explicit optimizer.params.lr of the JSON."""
        return float(self.config["optimizer"]["params"]["lr"])

    def with_values(self, values: dict, source: str) -> ResolvedDSConfig:
        """A copy with each dotted key of `values` set (its parents made where missing), all from `source`."""
        config, sources = copy.deepcopy(self.config), dict(self.sources)
        for dotted, value in values.items():
            *parents, leaf = dotted.split(".")
            node = config
            for part in parents:
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
            node[leaf] = value
            sources[dotted] = source
        return dataclasses.replace(self, config=config, sources=sources)

    def without(self, dotted: str) -> ResolvedDSConfig:
        """A copy without the dotted key (and its source), where it is set, and without the sections it leaves empty."""
        config, sources = copy.deepcopy(self.config), dict(self.sources)
        *parents, leaf = dotted.split(".")
        path = [config]
        for part in parents:
            child = path[-1].get(part)
            if not isinstance(child, dict):
                return self
            path.append(child)
        path[-1].pop(leaf, None)
        for part, parent in zip(reversed(parents), reversed(path[:-1]), strict=True):
            if parent[part]:
                break
            del parent[part]
        sources.pop(dotted, None)
        return dataclasses.replace(self, config=config, sources=sources)

    def summary(self) -> str:
        """One line of what decides a run's memory and speed; explained() has every value and its source."""
        config, zero = self.config, self.config.get("zero_optimization", {})
        offload = [
            kind
            for kind in ("optimizer", "param")
            if zero.get(f"offload_{kind}", {}).get("device") not in (None, "none")
        ]
        optimizer, accumulation = config.get("optimizer", {}), config["gradient_accumulation_steps"]
        parts = [
            f"ZeRO-{self.zero_stage}" + (f" with {' and '.join(offload)} offload" if offload else ""),
            self.precision,
            f"{optimizer.get('type', 'no optimizer')} lr {optimizer.get('params', {}).get('lr')}",
            f"global batch {config['train_batch_size']} = {self.micro_batch} micro x {accumulation} accumulation x "
            f"{config['train_batch_size'] // (self.micro_batch * accumulation)} data-parallel rank(s)",
            f"clipping {config.get('gradient_clipping', 0)}",
        ]
        return ", ".join(parts) + " (every value with its source: --log_level debug, or config_sources.txt)"

    def explained(self) -> str:
        """The resolved JSON followed by one line per value the pipeline decided, then the values taken as written."""
        lines = [json.dumps(self.config, indent=2, sort_keys=True), "where the decided values came from:"]
        lines += [
            f"  {key} = {json.dumps(_get(self.config, key))}  <- {src}" for key, src in sorted(self.sources.items())
        ]
        written = [key for key in _leaf_keys(self.config) if key not in self.sources]
        if written:
            lines.append(f"as written in {self.origin}:")
            lines += [f"  {key} = {json.dumps(_get(self.config, key))}" for key in written]
        return "\n".join(lines)


def assemble_ds_config(filled: ResolvedDSConfig, *contributions: Sequence[DSKey]) -> ResolvedDSConfig:
    """The run's DeepSpeed config, assembled once: the JSON with every "auto" filled (`filled`, its values' sources
    recorded), then each contribution's keys in order (the layout's, the resume's), each recorded with its source.
    Two contributions setting one key is a bug in the concerns, not a user's mistake."""
    contributed: dict = {}
    assembled = filled
    for keys in contributions:
        for entry in keys:
            assert entry.key not in contributed, f"{entry.key}: set by {contributed[entry.key]} and {entry.source}"
            contributed[entry.key] = entry.source
            assembled = assembled.with_values({entry.key: entry.value}, entry.source)
    return assembled


def _leaf_keys(tree: dict, prefix: str = "") -> list:
    """The dotted key of every value that is not an object, in order."""
    keys: list[str] = []
    for name, value in sorted(tree.items()):
        dotted = f"{prefix}{name}"
        keys += _leaf_keys(value, f"{dotted}.") if isinstance(value, dict) and value else [dotted]
    return keys


def load_ds_config(path: str) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(
            f"--config {path}: cannot read it ({exc.strerror})", "check the path and its permissions"
        ) from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--config {path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    if not isinstance(raw, dict):
        raise UsageError(f"--config {path}: the top level must be a JSON object")
    return raw


def _get(tree: dict, dotted: str) -> JSONValue:
    node: Any = tree  # any JSON value: indexing a list or scalar raises TypeError, which explicit() relies on
    for part in dotted.split("."):
        node = node[part]
    return node


class _Resolver:
    def __init__(self, raw: dict, path: str):
        self.config = copy.deepcopy(raw)
        self.path = path
        self.sources: dict = {}

    def fill(self, dotted: str, value: JSONValue, source: str) -> None:
        """Set `dotted` to value where it is "auto" or absent; an explicit JSON value is kept."""
        *parents, leaf = dotted.split(".")
        node = self.config
        for part in parents:
            node = node.setdefault(part, {})
        if node.get(leaf, AUTO) != AUTO:
            return
        node[leaf] = value
        self.sources[dotted] = source

    def explicit(self, dotted: str) -> JSONValue:
        try:
            value = _get(self.config, dotted)
        except (KeyError, TypeError):
            return None
        return None if value == AUTO else value


def _resolve_precision(r: _Resolver, engine: EngineArgs, hw: HardwareFacts) -> tuple:
    json_bf16 = r.explicit("bf16.enabled")
    json_fp16 = r.explicit("fp16.enabled")
    if json_bf16 is True and json_fp16 is True:
        raise UsageError(f"--config {r.path}: bf16.enabled and fp16.enabled are both true", "enable one precision")
    if engine.bf16 and json_fp16 is True:
        raise UsageError(f"--bf16 contradicts fp16.enabled=true in {r.path}", 'drop the flag or set it to "auto"')
    if engine.fp16 and json_bf16 is True:
        raise UsageError(f"--fp16 contradicts bf16.enabled=true in {r.path}", 'drop the flag or set it to "auto"')
    if engine.bf16:
        precision, reason, source = "bf16", "--bf16 given", "--bf16"
    elif engine.fp16:
        precision, reason, source = "fp16", "--fp16 given (dynamic loss scaling)", "--fp16"
    elif json_bf16 is True:
        precision, reason, source = "bf16", f"bf16.enabled=true in {r.path}", "json"
    elif json_fp16 is True:
        precision, reason, source = "fp16", f"fp16.enabled=true in {r.path}", "json"
    elif json_bf16 is False and hw.bf16_fast:  # "auto" picks bf16 or fp32 here; the JSON ruled bf16 out
        precision, reason, source = "fp32", f"bf16.enabled=false in {r.path}", "json"
    elif hw.bf16_fast:
        precision, reason, source = "bf16", "auto: CUDA device with bf16 support", "auto: hardware"
    else:
        precision, reason, source = (
            "fp32",
            f"auto: no fast bf16 on this {hw.accelerator} (bf16 would be slower)",
            "auto: hardware",
        )
    if precision == "fp16" and hw.accelerator == "cpu":  # DeepSpeed's CPU accelerator has no fp16 training
        raise UsageError(
            f"{'--fp16' if engine.fp16 else f'fp16.enabled=true in {r.path}'}: fp16 training needs a "
            "GPU, and this machine's DeepSpeed accelerator is the CPU",
            "drop it: on a CPU the run trains in fp32",
        )
    for name, explicit in (("bf16", json_bf16), ("fp16", json_fp16)):
        r.config.setdefault(name, {})["enabled"] = precision == name
        if explicit is None:
            r.sources[f"{name}.enabled"] = source
    if precision == "fp16":
        r.fill("fp16.loss_scale", 0, "fp16 default: dynamic loss scaling")
    return precision, reason


# JSON key -> (flag, the flag's value as it would appear in the JSON)
_FLAG_FOR_KEY = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", lambda c: c.per_device_train_batch_size),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", lambda c: c.gradient_accumulation_steps),
    "gradient_clipping": ("max_grad_norm", lambda c: c.max_grad_norm),
    "optimizer.params.lr": ("learning_rate", lambda c: c.learning_rate),
    "optimizer.params.eps": ("adam_epsilon", lambda c: c.adam_epsilon),
    "optimizer.params.weight_decay": ("weight_decay", lambda c: c.weight_decay),
}


def _check_flag_contradictions(r: _Resolver, optim: OptimArgs, explicit: frozenset) -> None:
    """A value set both in the JSON and by a typed flag must agree: silently preferring one hides a mistake."""
    for key, (flag, value_of) in _FLAG_FOR_KEY.items():
        json_value = r.explicit(key)
        if json_value is None or flag not in explicit:
            continue
        # A JSON number (or numeric string) here; a list or object is not checked first, float() raises as it did
        if float(json_value) != float(value_of(optim)):  # type: ignore[arg-type]
            raise UsageError(
                f"--{flag} {value_of(optim)} contradicts {key}={json_value} in {r.path}",
                f'set {key} to "auto" in the JSON, or drop --{flag}',
            )


_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _check_zero_and_offload(r: _Resolver) -> None:
    zero = r.config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage == AUTO:
        raise UsageError(f'zero_optimization.stage in {r.path} cannot be "auto"', "set 0, 1, 2 or 3")
    if stage not in (0, 1, 2, 3):
        raise UsageError(f"zero_optimization.stage {stage!r} in {r.path} is not a ZeRO stage", "use 0, 1, 2 or 3")
    for section, min_stage in (("offload_optimizer", 1), ("offload_param", 3)):
        offload = zero.get(section)
        if not isinstance(offload, dict):
            continue
        device = offload.get("device", "none")
        if device not in _OFFLOAD_DEVICES:
            raise UsageError(
                f'zero_optimization.{section}.device "{device}" in {r.path}',
                f"use one of {', '.join(_OFFLOAD_DEVICES)}",
            )
        if device != "none" and stage < min_stage:
            what = "parameter offload" if section == "offload_param" else "optimizer offload"
            raise UsageError(
                f"zero_optimization.{section} in {r.path}: {what} needs ZeRO stage {min_stage}"
                f"{' or higher' if min_stage < 3 else ''}, this config has stage {stage}",
                "raise zero_optimization.stage or remove the offload section",
            )
    checkpointing = r.config.get("activation_checkpointing", {})
    for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
        if checkpointing.get(key):
            raise UsageError(
                f"activation_checkpointing.{key} in {r.path} only acts on models that call deepspeed.checkpointing, "
                "which Hugging Face models do not",
                "remove the section and pass --gradient_checkpointing",
            )


def _check_nvme_folder(section: str, path: str, source: str) -> None:
    if not os.path.isdir(path):
        raise UsageError(
            f"NVMe folder {path} (zero_optimization.{section}.nvme_path, from {source}) does not exist",
            "create it on a local NVMe disk or point --nvme_path at one",
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(
            f"NVMe folder {path} (zero_optimization.{section}.nvme_path, from {source}) is not writable",
            "fix its permissions or point --nvme_path at a writable folder",
        )


def _resolve_nvme(r: _Resolver, engine: EngineArgs) -> None:
    zero = r.config.get("zero_optimization", {})
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section)
        if not isinstance(offload, dict) or offload.get("device") != "nvme":
            continue
        if offload.get("nvme_path", AUTO) == AUTO:
            path = engine.resolved_nvme_path
            if not path:
                raise UsageError(
                    f'zero_optimization.{section}.nvme_path in {r.path} is "auto" and no NVMe folder was given',
                    f"pass --nvme_path /local/nvme/folder or set ${NVME_PATH_ENV}",
                )
            source = "--nvme_path" if engine.nvme_path else f"${NVME_PATH_ENV}"
            r.fill(f"zero_optimization.{section}.nvme_path", path, source)
        _check_nvme_folder(
            section, offload["nvme_path"], r.sources.get(f"zero_optimization.{section}.nvme_path", r.path)
        )


def _leftover_autos(tree: JSONValue, prefix: str = "") -> list:
    if isinstance(tree, dict):
        return [k for key, v in tree.items() for k in _leftover_autos(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if tree == AUTO else []


def _refuse_owned_sections(r: _Resolver, config_path: str) -> None:
    """Sections the pipeline owns itself: the LR schedule and the communication log."""
    if "scheduler" in r.config:
        raise UsageError(
            f'--config {config_path}: has a "scheduler" section; this pipeline owns the LR schedule',
            "remove the section and use --lr_scheduler_type, --warmup_steps/--warmup_ratio, --min_lr_ratio",
        )
    if "comms_logger" in r.config:  # DeepSpeed 0.19.8's own logger reports cumulative latencies (each op's
        raise UsageError(  # figure includes every earlier one); --comms_log corrects them and reports per window
            f'--config {config_path}: has a "comms_logger" section; the pipeline reports communication itself',
            "remove the section and pass --comms_log",
        )


def _resolve_batch(r: _Resolver, optim: OptimArgs, dp_world_size: int, config_path: str) -> None:
    """Micro batch, accumulation and global batch, which must agree; and the gradient clipping."""
    micro = optim.per_device_train_batch_size
    gas = optim.gradient_accumulation_steps
    r.fill("train_micro_batch_size_per_gpu", micro, "--per_device_train_batch_size")
    r.fill("gradient_accumulation_steps", gas, "--gradient_accumulation_steps")
    micro = r.config["train_micro_batch_size_per_gpu"]
    gas = r.config["gradient_accumulation_steps"]
    r.fill(
        "train_batch_size",
        micro * gas * dp_world_size,
        f"micro batch {micro} x accumulation {gas} x data-parallel size {dp_world_size}",
    )
    global_batch = r.config["train_batch_size"]
    if global_batch != micro * gas * dp_world_size:
        raise UsageError(
            f"train_batch_size {global_batch} in {config_path} != micro batch {micro} x accumulation {gas} "
            f"x data-parallel size {dp_world_size} = {micro * gas * dp_world_size}",
            'set train_batch_size to "auto" or change the batch flags',
        )
    r.fill("gradient_clipping", optim.max_grad_norm, "--max_grad_norm")


def _resolve_optimizer(r: _Resolver, optim: OptimArgs) -> None:
    """The optimizer section (AdamW when the JSON has none) and its hyperparameters from the flags."""
    if "optimizer" not in r.config:
        r.config["optimizer"] = copy.deepcopy(DEFAULT_OPTIMIZER)
        r.sources["optimizer.type"] = "default: AdamW"
    r.fill("optimizer.params.lr", optim.learning_rate, "--learning_rate")
    r.fill("optimizer.params.betas", [optim.adam_beta1, optim.adam_beta2], "--adam_beta1/--adam_beta2")
    r.fill("optimizer.params.eps", optim.adam_epsilon, "--adam_epsilon")
    r.fill("optimizer.params.weight_decay", optim.weight_decay, "--weight_decay")


def _resolve_zero(r: _Resolver, *, engine: EngineArgs, hw: HardwareFacts, precision: str, model: ModelSize) -> None:
    """The ZeRO section: collective bucket sizes, the ZeRO-3 persistence threshold, and NVMe offload."""
    r.fill("zero_optimization.stage", 0, "default: no ZeRO (the JSON sets no zero_optimization.stage)")
    hidden_size = model.hidden_size
    if model.rank_params:
        bucket, why = bucket_elements(hw.accelerator, precision, model.rank_params, "a rank's share of the model")
    else:
        bucket, why = bucket_elements(hw.accelerator, precision, model.n_params)
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
        r.fill(f"zero_optimization.{key}", bucket, why)
    r.fill(
        "zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size, f"10 x hidden_size ({hidden_size})"
    )
    _resolve_nvme(r, engine)


def _resolve_cpu_adam(r: _Resolver, hw: HardwareFacts, resolved: ResolvedDSConfig) -> None:
    """On a CPU without optimizer offload, Adam is torch's fused AdamW rather than DeepSpeed's GPU kernel."""
    optimizer_type = str(r.config["optimizer"].get("type", "")).lower()
    if hw.accelerator == "cpu" and optimizer_type in ADAM_TYPES and not resolved.offloads_optimizer:
        # DeepSpeed's default Adam is FusedAdam, a JIT-built GPU kernel; on a CPU torch's AdamW does the same
        # update without a multi-minute build. Offload keeps DeepSpeedCPUAdam, the optimizer offload is made for.
        r.fill("optimizer.params.torch_adam", True, "cpu without offload: torch AdamW, no FusedAdam build")
        if "foreach" not in r.config["optimizer"].get("params", {}):
            # torch's default for CPU tensors is its per-tensor loop: ~13x slower than the fused kernel on a ZeRO
            # partition (14.7 against 1.1 ms for 2.5M fp32 elements on one core here), about 4% of a small step.
            r.fill("optimizer.params.fused", True, "cpu: torch's fused AdamW kernel (its default is a Python loop)")


@dataclass(frozen=True)
class ModelSize:
    """What the ZeRO section is sized by."""

    hidden_size: int
    n_params: int | None = None
    # the parameters of one rank under tensor or pipeline parallelism (its shards, on the largest stage)
    rank_params: int | None = None


def resolve_ds_config(
    raw: dict,
    *,
    engine: EngineArgs,
    optim: OptimArgs,
    explicit: frozenset,
    dp_world_size: int,
    hw: HardwareFacts,
    model: ModelSize,
) -> ResolvedDSConfig:
    """Fill every "auto" of a DeepSpeed JSON from the engine and optimisation flags (`explicit`: the flags the user
    set, which must agree with an explicit JSON value). Raises UsageError naming the key when something cannot be
    decided."""
    check_ds_keys(raw, engine.config)
    r = _Resolver(raw, engine.config)
    _check_zero_and_offload(r)
    _check_flag_contradictions(r, optim, explicit)
    _refuse_owned_sections(r, engine.config)
    _resolve_batch(r, optim, dp_world_size, engine.config)
    _resolve_optimizer(r, optim)
    precision, reason = _resolve_precision(r, engine, hw)
    _resolve_zero(r, engine=engine, hw=hw, precision=precision, model=model)

    resolved = ResolvedDSConfig(r.config, r.sources, precision, reason, origin=engine.config)
    _resolve_cpu_adam(r, hw, resolved)
    r.fill("steps_per_print", 2**31 - 1, "default: the pipeline logs its own metrics")

    leftover = _leftover_autos(r.config)
    if leftover:
        raise UsageError(
            f'{leftover[0]} in {engine.config} is "auto" but the pipeline does not decide it',
            "set an explicit value there",
        )
    return resolved
