"""QLoRA: LoRA on a base whose linear layers are stored in 4 bits (bitsandbytes NF4); a way of building the model. The
packed weights are stored in the run's dtype (bnb_4bit_quant_storage) because DeepSpeed 0.19.8's engine casts every
floating-point parameter of another dtype to the run's (_cast_module_mixed_precision), which would silently destroy
4-bit weights held as fp32. Under ZeRO-3 transformers builds no quantized model inside deepspeed.zero.Init, so each rank
loads the whole 4-bit base (~5 GB for 8B) and deepspeed.initialize partitions it (bitsandbytes#1249, DeepSpeed#5660).
Details: docs/fine-tuning.md#qlora.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from typing import TYPE_CHECKING

from packaging.version import Version

from scaletrain.config import HardwareFacts, ModelArgs, ResolvedDSConfig, RunConfig
from scaletrain.errors import UsageError
from scaletrain.model.build import install_memory_features

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

BITSANDBYTES_PIN = "bitsandbytes==0.50.2"  # requirements.txt; one wheel for the CPU and CUDA 11.8-13.x
BITSANDBYTES_MIN = "0.46.1"  # transformers 5.24's minimum for 4-bit loading (BITSANDBYTES_MIN_VERSION)
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # run precision -> torch dtype name


def check_qlora(cfg: RunConfig, ds: ResolvedDSConfig, hardware: HardwareFacts) -> None:
    """Before anything heavy. Combinations that cannot work are refused on any machine (a mistake in the flags or the
    JSON is said wherever it is made); then QLoRA needs a CUDA GPU and bitsandbytes. --load_in_4bit without
    --use_peft, and LoRA with tensor, sequence or pipeline parallelism, are refused earlier (config._check_peft_run)."""
    zero = ds.config.get("zero_optimization", {})
    if ds.zero_stage == 3 and ds.offloads_params:
        device = zero["offload_param"]["device"]
        raise UsageError(
            f"--load_in_4bit with --config {cfg.engine.config}: ZeRO-3 parameter offload to {device} "
            "saves no GPU memory for a 4-bit base (transformers loads a quantized base whole onto each "
            "GPU before DeepSpeed partitions it; peft documents that offload then uses more GPU memory) "
            "and is untested here",
            "use ds_configs/zero3.json (optimizer offload is fine: "
            "ds_configs/zero2_offload.json), or drop --load_in_4bit to offload full-precision weights",
        )
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if zero.get(key):
            raise UsageError(
                f"--load_in_4bit with --config {cfg.engine.config}: zero_optimization.{key} "
                "re-quantizes the frozen weights to int8 as numbers, and the 4-bit base's weights are "
                "packed bits (they would be corrupted)",
                f"set {key} to false, or drop --load_in_4bit",
            )
    if hardware.accelerator != "cuda":
        raise UsageError(
            f"--load_in_4bit: QLoRA needs a CUDA GPU (bitsandbytes 4-bit weights); this machine "
            f"trains on {hardware.accelerator}",
            "drop --load_in_4bit: LoRA on full-precision weights runs",
        )
    version = bitsandbytes_version()
    if version is None:
        raise UsageError(
            "--load_in_4bit: QLoRA needs bitsandbytes, which is not installed",
            f"pip install {BITSANDBYTES_PIN} (it is in requirements.txt)",
        )
    if Version(version) < Version(BITSANDBYTES_MIN):
        raise UsageError(
            f"--load_in_4bit: bitsandbytes {version} is older than transformers needs ({BITSANDBYTES_MIN})",
            f"pip install {BITSANDBYTES_PIN}",
        )


def bitsandbytes_version() -> str | None:
    """The installed bitsandbytes' version, or None; found without importing it (its import loads CUDA libraries)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    try:
        return importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None


def quantization_settings(precision: str, bf16_fast: bool) -> dict:
    """BitsAndBytesConfig's arguments for a run in `precision` ("bf16", "fp16" or "fp32"): QLoRA's NF4 with double
    quantization (the paper's choice), the storage in the run's dtype (see the module docstring), and products in bf16
    where the GPU does them at full speed, else in the run's dtype (an fp16 or fp32 run on a GPU without bf16)."""
    storage = TORCH_DTYPES[precision]
    return {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "bfloat16" if bf16_fast else storage,
        "bnb_4bit_quant_storage": storage,
    }


def model_kwargs(
    model_args: ModelArgs, precision: str, bf16_fast: bool, device: torch.device | int | str | None
) -> dict:
    """from_pretrained's arguments for the 4-bit base: the quantization, the weights' dtype equal to the storage
    (every other weight then arrives in the run's dtype too), and the whole base on this rank's device (without a
    device map, transformers would pick the current CUDA device; naming it keeps rank and GPU paired)."""
    import torch
    from transformers import BitsAndBytesConfig

    settings = quantization_settings(precision, bf16_fast)
    return {
        "quantization_config": BitsAndBytesConfig(**settings),
        "dtype": getattr(torch, settings["bnb_4bit_quant_storage"]),
        "device_map": {"": device},
        "trust_remote_code": model_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
    }


def build_qlora_model(
    model_args: ModelArgs,
    model_config,
    ds: ResolvedDSConfig,
    device: torch.device | int | str | None = None,
    bf16_fast: bool | None = None,
) -> tuple:
    """(model, keepalive) as model.build_model returns them: the pretrained base in 4 bits, prepared for training by
    peft (every base weight frozen; activation checkpointing, non-reentrant, with --gradient_checkpointing). `device`
    and `bf16_fast` default to this rank's CUDA device and what it can do; only tests pass others."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    if device is None:
        device = torch.cuda.current_device()  # set to the local rank by distributed.init_distributed
    if bf16_fast is None:
        bf16_fast = torch.cuda.is_bf16_supported()
    # Alive under ZeRO-3 as for any run (generation's synced_gpus reads it); transformers skips zero.Init for a
    # quantized model, so this base is loaded whole and partitioned by deepspeed.initialize.
    keepalive = HfDeepSpeedConfig(ds.config) if ds.zero_stage == 3 else None
    kwargs = model_kwargs(model_args, ds.precision, bf16_fast, device)
    # --load_in_4bit needs --use_peft, which needs --model_name_or_path (config._check_peft_run).
    assert model_args.model_name_or_path is not None
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=model_config, **kwargs)
    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=model_args.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    if model_args.gradient_checkpointing:
        model.config.use_cache = False
    install_memory_features(model, model_args)
    settings = kwargs["quantization_config"]
    n_4bit = sum(1 for module in model.modules() if type(module).__name__ == "Linear4bit")
    log.info(
        f"QLoRA base: {model_args.model_name_or_path} in 4 bits ({settings.bnb_4bit_quant_type}, double quantization, "
        f"compute {_dtype_name(settings.bnb_4bit_compute_dtype)}, storage "
        f"{_dtype_name(settings.bnb_4bit_quant_storage)}) on {device}, {n_4bit} linear layers quantized"
        f"{'; ZeRO-3 partitions it at deepspeed.initialize' if ds.zero_stage == 3 else ''}"
    )
    return model, keepalive


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")
