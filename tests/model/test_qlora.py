"""QLoRA (--use_peft --load_in_4bit): its refusals through train.py, the configuration the GPU path builds, and the
build path itself on bitsandbytes' CPU backend.

No GPU here: the GPU-only checks (bitsandbytes missing or too old) are called with a CUDA machine's facts given as
data, and the build test calls the build function directly on the CPU (see its docstring). Nothing here ran on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scaletrain.model import qlora
from scaletrain.config.cli import parse_run_config
from scaletrain.config.deepspeed_json import HardwareFacts, ModelSize, load_ds_config, resolve_ds_config
from scaletrain.errors import UsageError
from tests.harness import REPO
from tests.core.test_bad_input import assert_refused

TINY = REPO / "data" / "tiny-llama"
CONFIGS = REPO / "ds_configs"
H100 = HardwareFacts(accelerator="cuda", bf16_fast=True)  # a CUDA GPU's facts, as preflight.hardware_facts gathers
V100 = HardwareFacts(accelerator="cuda", bf16_fast=False)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """A pretrained folder: the tiny Llama with seeded random weights (no hub model can be downloaded here), its MLP
    width 384 instead of 352: bitsandbytes 0.50.2's AVX-512 CPU kernel dequantizes a weight whose rows are not a
    whole number of 64-weight blocks wrongly (352: 26% error against NF4's 9%, packed bits right; found here). Its
    CUDA kernels are other code, not run here."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("qlora_base")
    torch.manual_seed(1234)
    config = AutoConfig.from_pretrained(TINY)
    config.intermediate_size = 384
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def zero3_variants(tmp_path_factory) -> dict:
    """ds_configs/zero3.json with each ZeRO++ weight quantization switched on."""
    folder = tmp_path_factory.mktemp("qlora_configs")
    paths = {}
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        config = json.loads((CONFIGS / "zero3.json").read_text())
        config["zero_optimization"][key] = True
        paths[key] = folder / f"zero3_{key}.json"
        paths[key].write_text(json.dumps(config))
    return paths


# --- refusals through train.py: one line naming the flag, exit 2, nothing written ---------------------------------


def refusals(variants: dict) -> dict:
    # name: (DeepSpeed JSON, flags after the base model's, the flag the error names, text of the error, of the hint)
    qlora = ["--use_peft", "--load_in_4bit"]
    return {
        "without use_peft": (
            CONFIGS / "zero2.json",
            ["--load_in_4bit"],
            "--load_in_4bit",
            "--load_in_4bit: only acts with --use_peft",
            None,
        ),
        "tensor parallelism": (
            CONFIGS / "zero1.json",
            [*qlora, "--tensor_parallel_size", "2"],
            "--tensor_parallel_size",
            "--use_peft with --tensor_parallel_size 2: not supported",
            None,
        ),
        "pipeline parallelism": (
            CONFIGS / "zero1.json",
            [*qlora, "--pipeline_parallel_size", "2"],
            "--pipeline_parallel_size",
            "--use_peft with --pipeline_parallel_size 2",
            None,
        ),
        "zero3 parameter offload": (
            CONFIGS / "zero3_offload.json",
            qlora,
            "--load_in_4bit",
            "ZeRO-3 parameter offload to cpu saves no GPU memory for a 4-bit base",
            "use ds_configs/zero3.json (optimizer offload is fine: "
            "ds_configs/zero2_offload.json), or drop --load_in_4bit to offload "
            "full-precision weights",
        ),
        "zero++ quantized weights": (
            variants["zero_quantized_weights"],
            qlora,
            "--load_in_4bit",
            "zero_optimization.zero_quantized_weights re-quantizes the frozen weights",
            "set zero_quantized_weights to false, or drop --load_in_4bit",
        ),
        "zero++ quantized frozen weights": (
            variants["zero_quantized_nontrainable_weights"],
            qlora,
            "--load_in_4bit",
            "zero_optimization.zero_quantized_nontrainable_weights re-quantizes",
            None,
        ),
        # The refusal this machine gives to a QLoRA run that is right in every other way (and the one before it).
        "no cuda gpu": (
            CONFIGS / "zero3.json",
            qlora,
            "--load_in_4bit",
            "--load_in_4bit: QLoRA needs a CUDA GPU (bitsandbytes 4-bit weights); this machine trains on cpu",
            "drop --load_in_4bit: LoRA on full-precision weights runs",
        ),
    }


REFUSALS = list(refusals({"zero_quantized_weights": None, "zero_quantized_nontrainable_weights": None}))


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("name", REFUSALS)
def test_qlora_refusals_are_one_line_exit_2_and_touch_nothing(name, base_model, zero3_variants, tmp_path, capsys):
    ds_config, extra, culprit, expected, hint = refusals(zero3_variants)[name]
    out = tmp_path / "out"
    assert_refused(
        name,
        ["--config", str(ds_config), "--output_dir", str(out), "--model_name_or_path", str(base_model), *extra],
        out,
        capsys,
        culprit,
        expected,
        hint,
    )


# --- the checks a CUDA machine gets (its facts given as data) -----------------------------------------------------


def resolved(base: Path, config: str, *flags: str, hardware: HardwareFacts = H100):
    """(RunConfig, ResolvedDSConfig) of a QLoRA run, resolved by the pipeline's own resolver for `hardware`."""
    cfg = parse_run_config(
        ["--config", str(CONFIGS / config), "--model_name_or_path", str(base), "--use_peft", "--load_in_4bit", *flags]
    )
    ds = resolve_ds_config(
        load_ds_config(cfg.engine.config),
        engine=cfg.engine,
        optim=cfg.optim,
        explicit=cfg.explicit_flags,
        dp_world_size=1,
        hw=hardware,
        model=ModelSize(128, 1_000_000),
    )
    return cfg, ds


@pytest.mark.parametrize("config", ["zero1.json", "zero2.json", "zero3.json", "zero2_offload.json"])
def test_a_cuda_machine_with_bitsandbytes_passes_the_checks(config, base_model, monkeypatch):
    cfg, ds = resolved(base_model, config)
    # Stand-in: bitsandbytes' version as a CUDA machine with requirements.txt installed reports it.
    monkeypatch.setattr(qlora, "bitsandbytes_version", lambda: "0.50.2")
    qlora.check_qlora(cfg, ds, H100)  # ZeRO-1/2/3 and optimizer offload are fine


@pytest.mark.parametrize(
    "version, expected, hint",
    [
        (
            None,
            "--load_in_4bit: QLoRA needs bitsandbytes, which is not installed",
            "pip install bitsandbytes==0.50.2 (it is in requirements.txt)",
        ),
        (
            "0.45.5",
            "--load_in_4bit: bitsandbytes 0.45.5 is older than transformers needs (0.46.1)",
            "pip install bitsandbytes==0.50.2",
        ),
    ],
)
def test_a_cuda_machine_without_a_usable_bitsandbytes_is_refused_with_the_pip_line(
    version, expected, hint, base_model, monkeypatch
):
    cfg, ds = resolved(base_model, "zero3.json")
    # Stand-in: what bitsandbytes_version finds on a machine without bitsandbytes, or with an old one.
    monkeypatch.setattr(qlora, "bitsandbytes_version", lambda: version)
    with pytest.raises(UsageError) as err:
        qlora.check_qlora(cfg, ds, H100)
    assert err.value.message == expected and err.value.hint == hint


def test_the_pin_is_the_one_in_requirements_and_the_version_lookup_finds_the_installed_one():
    pins = [
        line.strip()
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if line.strip().startswith("bitsandbytes")
    ]
    assert pins == [qlora.BITSANDBYTES_PIN]
    pytest.importorskip("bitsandbytes", reason="not installed: pip install -r requirements.txt")
    import bitsandbytes

    assert qlora.bitsandbytes_version() == bitsandbytes.__version__


# --- the configuration the GPU path builds --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, flags, hardware, precision, compute, storage",
    [
        ("zero3.json", (), H100, "bf16", "bfloat16", "bfloat16"),  # "auto": bf16 on a GPU with fast bf16
        ("zero2.json", ("--fp16",), H100, "fp16", "bfloat16", "float16"),
        ("zero2.json", ("--fp16",), V100, "fp16", "float16", "float16"),  # no fast bf16: products in the run's dtype
        ("zero2.json", (), V100, "fp32", "float32", "float32"),  # "auto" without fast bf16: fp32
    ],
)
def test_the_4bit_weights_are_stored_in_the_dtype_deepspeed_runs_in(
    config, flags, hardware, precision, compute, storage, base_model
):
    """DeepSpeed's engine casts every floating-point parameter whose dtype differs from the run's (bf16/fp16) to it,
    which would destroy packed 4-bit weights held in another float dtype: the storage must be the run's dtype, as
    the resolved DeepSpeed config decides it."""
    from transformers import BitsAndBytesConfig

    cfg, ds = resolved(base_model, config, *flags, hardware=hardware)
    assert ds.precision == precision
    assert ds.config.get("bf16", {}).get("enabled", False) == (precision == "bf16")
    assert ds.config.get("fp16", {}).get("enabled", False) == (precision == "fp16")
    settings = qlora.quantization_settings(ds.precision, hardware.bf16_fast)
    assert settings == {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": compute,
        "bnb_4bit_quant_storage": storage,
    }
    kwargs = qlora.model_kwargs(cfg.model, ds.precision, hardware.bf16_fast, 3)
    bnb = kwargs["quantization_config"]
    assert isinstance(bnb, BitsAndBytesConfig) and bnb.load_in_4bit and not bnb.load_in_8bit
    assert (bnb.bnb_4bit_quant_type, bnb.bnb_4bit_use_double_quant) == ("nf4", True)
    assert bnb.bnb_4bit_compute_dtype == getattr(torch, compute)
    assert bnb.bnb_4bit_quant_storage == kwargs["dtype"] == getattr(torch, storage)
    assert kwargs["device_map"] == {"": 3}  # the whole base on this rank's GPU
    assert kwargs["trust_remote_code"] is False
    assert kwargs["attn_implementation"] is None  # unset: transformers chooses, as for the pre-flight's meta model


# --- the build path, for real, on bitsandbytes' CPU backend ---------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_qlora_build_path_quantizes_the_base_and_trains_only_the_adapter(precision, base_model):
    """The GPU check is bypassed explicitly: qlora.build_qlora_model is called directly with device="cpu" (the run's
    preflight, qlora.check_qlora, refuses a CPU), and bitsandbytes' CPU backend computes the 4-bit products. The
    rest is the real path: from_pretrained with the BitsAndBytesConfig, prepare_model_for_kbit_training with
    activation checkpointing, lora.apply_lora, one forward and backward (no DeepSpeed)."""
    pytest.importorskip("bitsandbytes", reason="not installed: pip install -r requirements.txt")
    from bitsandbytes.functional import dequantize_4bit
    from bitsandbytes.nn import Linear4bit
    from transformers import AutoConfig, AutoModelForCausalLM

    from scaletrain.model import lora
    from scaletrain.config.deepspeed_json import ResolvedDSConfig

    cfg = parse_run_config(
        [
            "--config",
            str(CONFIGS / "zero2.json"),
            "--model_name_or_path",
            str(base_model),
            "--use_peft",
            "--load_in_4bit",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
            "--gradient_checkpointing",
        ]
    )
    ds = ResolvedDSConfig(
        config={"zero_optimization": {"stage": 2}},
        sources={},
        precision=precision,
        precision_reason="given by the test",
    )
    model, keepalive = qlora.build_qlora_model(
        cfg.model, AutoConfig.from_pretrained(base_model), ds, device="cpu", bf16_fast=False
    )
    assert keepalive is None and model.is_loaded_in_4bit
    assert model.is_gradient_checkpointing and model.config.use_cache is False
    storage = getattr(torch, qlora.TORCH_DTYPES[precision])
    full = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    full_linears = {name: m for name, m in full.named_modules() if isinstance(m, torch.nn.Linear)}
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, Linear4bit)}
    assert set(quantized) == set(full_linears) - {"lm_head"}  # every linear layer but the head, in 4 bits
    for name, module in quantized.items():
        weight = module.weight
        assert weight.dtype == storage and not weight.requires_grad
        assert weight.numel() * weight.element_size() * 2 == full_linears[name].weight.numel()  # 4 bits a weight
        restored = dequantize_4bit(weight.data, weight.quant_state).float()
        error = (restored - full_linears[name].weight).norm() / full_linears[name].weight.norm()
        assert 0 < error < 0.15, (name, error)  # NF4's rounding: real, and small

    peft_model = lora.apply_lora(model, cfg.peft)
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert sum(".lora_B." in name for name in trainable) == len(quantized)  # an adapter on each 4-bit layer
    ids = torch.randint(0, full.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    peft_model.train()
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        reference = full(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and abs(loss.item() - reference.item()) < 0.02 * reference.item()
    for name, param in peft_model.named_parameters():
        if ".lora_B." in name:  # B starts at zero, so its gradient is the first to move
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        elif not param.requires_grad:
            assert param.grad is None, name
