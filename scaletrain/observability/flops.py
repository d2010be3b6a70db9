"""Model FLOPs per token, the device's peak, and from them MFU and HFU. Per token (PaLM, appendix B, the formula most
MFU figures use), N the matmul parameters (nn.Linear and transformers' Conv1D; head included, embeddings not), L
layers, H heads, Q head dim, T block size:
    model FLOPs    = 6 * N + 12 * L * H * Q * T      (forward + backward = 3 x forward)
    hardware FLOPs = 8 * N + 16 * L * H * Q * T      (activation checkpointing recomputes the forward)
The attention term covers the full T x T square, as PaLM (and the MFU train.py logs); causal=True counts half
(6 * L * H * Q * T), as Megatron-LM and FlashAttention's benchmarks do, to compare with theirs. F frozen parameters
(LoRA's base) skip their weight gradient: 6 * (N - F) + 4 * F (hardware: 8 * (N - F) + 6 * F) replaces 6 * N (8 * N).
The peak is a dense tensor-core table (--peak_tflops overrides it), a CPU calibration, or, for an unknown accelerator,
absent rather than invented. Summary: docs/observability.md#flops-and-mfu.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Dense peak TFLOP/s per device (vendor datasheets, SXM parts). fp32 means plain fp32 matmuls (no TF32).
PEAK_TFLOPS = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
}


@dataclass(frozen=True)
class ModelFlops:
    matmul_params: int
    layers: int
    heads: int
    head_dim: float  # hidden / heads where a shape names no head dimension of its own
    seq_len: int
    frozen_matmul_params: int = 0  # of matmul_params, those that train no weight gradient (LoRA's base)

    def per_token(self, recompute: bool = False, causal: bool = False) -> float:
        """Training FLOPs per token: model FLOPs (recompute=False) or hardware FLOPs (recompute=True); with
        causal=True the attention term counts the causal half of the T x T square only."""
        attention = self.layers * self.heads * self.head_dim * self.seq_len / (2 if causal else 1)
        trained, frozen = self.matmul_params - self.frozen_matmul_params, self.frozen_matmul_params
        if recompute:
            return 8 * trained + 6 * frozen + 16 * attention
        return 6 * trained + 4 * frozen + 12 * attention


def matmul_modules(model) -> list:
    """The modules whose weight is a matrix product: torch's nn.Linear, and transformers' Conv1D (GPT-2's layers,
    and every model built from a GPT2Config: a linear layer with its weight stored transposed)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))]


def routed_matmul_weights(model, model_config) -> list:
    """A mixture-of-experts model's matrix products that matmul_modules does not see, as (weight, the share of it a
    token runs through): each MoE block's router (every token) and its experts' stacked 3-D weights, of which a token
    runs its top-k of the E experts. Empty for a dense model."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    top_k = getattr(text, "num_experts_per_tok", None)
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    if not (isinstance(top_k, int) and isinstance(experts, int) and experts > 1):
        return []
    linear = {id(m) for m in matmul_modules(model)}
    routed = []
    for block in model.modules():
        stacked, gate = getattr(block, "experts", None), getattr(block, "gate", None)
        if stacked is None or gate is None:
            continue
        routed += [(w, top_k / experts) for w in stacked.parameters(recurse=False) if w.dim() == 3]
        if id(gate) not in linear:  # a router of its own class (an nn.Linear one is counted already)
            routed += [(w, 1.0) for w in gate.parameters(recurse=False) if w.dim() == 2]
    return routed


def model_flops(meta_model, model_config, seq_len: int) -> ModelFlops:
    """The model's FLOPs per token at `seq_len`: its matrix products (matmul_modules, and an MoE model's router and
    routed experts), its attention's shape."""
    linear = [(m.weight, 1.0) for m in matmul_modules(meta_model)] + routed_matmul_weights(meta_model, model_config)
    matmul = round(sum(w.numel() * share for w, share in linear))
    frozen = round(sum(w.numel() * share for w, share in linear if not w.requires_grad))
    heads, head_dim = attention_heads(model_config)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", 0) or 0
    return ModelFlops(
        matmul, layers=layers, heads=heads, head_dim=head_dim, seq_len=seq_len, frozen_matmul_params=frozen
    )


def attention_heads(model_config) -> tuple:
    """(query heads, head dimension) of a Hugging Face config (0 where it names neither)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", 0)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", 0)
    return heads, getattr(text, "head_dim", None) or (hidden // heads if heads else 0)


def calibrate_cpu_tflops(seconds: float = 0.5, size: int = 1024) -> float:
    """Measured fp32 matrix-product rate of this CPU (all its threads), in TFLOP/s."""
    return measured_matmul_tflops("cpu", "fp32", seconds, size)


def measured_matmul_tflops(device: str, precision: str, seconds: float = 0.5, size: int = 1024) -> float:
    """The matrix-product rate measured on `device` ("cpu" or "cuda") in `precision`, in TFLOP/s: the peak that a
    card reaches in practice, beside its datasheet's (an H100 SXM measures well below its 989 bf16 TFLOP/s)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # A generator of its own: the calibration runs after a resume restored the RNG, and drawing from the global one
    # would shift every later random draw (dropout) away from the uninterrupted run's.
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device, dtype) for _ in range(2))
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm up
    synchronize()
    burst = 10 if device == "cuda" else 1  # a GPU queues products: time ten between synchronisations
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(burst):
            torch.mm(a, b)
        synchronize()
        runs += burst
    return 2 * size**3 * runs / (time.perf_counter() - started) / 1e12


def measured_attention_tflops(
    device, *, dtype, batch: int, heads: int, seq_len: int, head_dim: int, repeats: int = 3
) -> float:
    """The rate of causal fused attention (torch's scaled_dot_product_attention, forward and backward) on `device`
    for one layer's shape, in TFLOP/s as the time model counts it: 2 x batch x seq_len^2 x heads x head_dim forward
    (the causal half of QK^T and AV), twice that backward. The median of `repeats` after one that warms up."""
    import statistics

    import torch
    import torch.nn.functional as F
    from deepspeed.accelerator import get_accelerator

    generator = torch.Generator().manual_seed(0)  # the run's RNG left alone (measured_matmul_tflops says why)
    q, k, v = (
        torch.randn(batch, heads, seq_len, head_dim, generator=generator).to(device, dtype).requires_grad_()
        for _ in range(3)
    )
    times = []
    for _ in range(repeats + 1):
        get_accelerator().synchronize()
        started = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        get_accelerator().synchronize()
        times.append(time.perf_counter() - started)
    return 3 * 2 * batch * seq_len**2 * heads * head_dim / statistics.median(times[1:]) / 1e12


def peak_from_name(device_name: str, precision: str) -> float | None:
    for key, table in PEAK_TFLOPS.items():
        if key in device_name:
            return table[precision]
    return None


def peak_tflops(accelerator: str, precision: str, override: float | None) -> tuple:
    """(peak TFLOP/s per device or None, where it came from)."""
    if override:
        return override, "--peak_tflops"
    if accelerator == "cpu":
        return calibrate_cpu_tflops(), "measured: fp32 matrix-product calibration on this CPU"
    if accelerator == "cuda":
        import torch

        name = torch.cuda.get_device_name()
        peak = peak_from_name(name, precision)
        if peak is not None:
            return peak, f"table: {name} {precision}"
        log.warning("no peak FLOPs known for %s: MFU is not reported (pass --peak_tflops to set it)", name)
        return None, f"unknown device {name}"
    log.warning("no peak FLOPs known for accelerator %s: MFU is not reported (pass --peak_tflops)", accelerator)
    return None, f"unknown accelerator {accelerator}"


def throughput_model(
    flops: ModelFlops,
    *,
    accelerator: str,
    precision: str,
    override: float | None,
    recompute: bool,
    world_size: int,
    is_main: bool,
):
    """FLOPs per token and the device peak, for TFLOP/s, MFU and HFU (the peak is calibrated on rank 0 only: the
    figures are reported from there, and calibrating on every rank at once would share the cores). Per device:
    every rank of the world, tensor-parallel ones included (the model's FLOPs count once)."""
    from scaletrain.observability.metrics import ThroughputModel

    peak, source = (None, "not measured on this rank")
    if is_main:
        peak, source = peak_tflops(accelerator, precision, override)
        log.info(
            "peak %s TFLOP/s per device (%s); %.3g model FLOPs per token",
            "unknown" if peak is None else f"{peak:.3g}",
            source,
            flops.per_token(),
        )
    return ThroughputModel(flops.per_token(), flops.per_token(recompute=recompute), peak, world_size)
