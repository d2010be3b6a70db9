"""FLOPs per token against a hand count, the peak table, and the CPU calibration."""

import dataclasses

import pytest
from transformers import AutoConfig

from scaletrain.observability.flops import calibrate_cpu_tflops, model_flops, peak_from_name, peak_tflops
from scaletrain.model.build import meta_model
from tests.harness import REPO


def test_flops_per_token_match_a_hand_count_of_the_tiny_llama():
    config = AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")
    flops = model_flops(meta_model(config, False), config, seq_len=256)
    d, ff, layers, heads, kv_heads, head_dim, vocab = 128, 352, 4, 4, 2, 32, 4096
    per_layer = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d + 3 * d * ff
    matmul = layers * per_layer + vocab * d  # q, k, v, o, gate, up, down per layer; the output head
    assert flops.matmul_params == matmul
    attention = layers * heads * head_dim * 256
    assert flops.per_token() == 6 * matmul + 12 * attention
    assert flops.per_token(recompute=True) == 8 * matmul + 16 * attention


def test_peak_table_override_and_unknown_devices():
    assert peak_from_name("NVIDIA H200", "bf16") == 989.0
    assert peak_from_name("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert peak_from_name("Tesla K80", "bf16") is None
    assert peak_tflops("cuda", "bf16", override=123.0) == (123.0, "--peak_tflops")
    assert peak_tflops("xpu", "bf16", override=None)[0] is None  # unknown: no MFU, never an invented one


def test_cpu_calibration_measures_a_positive_rate():
    rate = calibrate_cpu_tflops(seconds=0.2, size=256)
    assert 1e-4 < rate < 100
    peak, source = peak_tflops("cpu", "fp32", override=None)
    assert peak > 0 and source.startswith("measured")


def test_the_cpu_calibration_leaves_the_global_rng_alone():
    """It runs after a resume restored the RNG: a draw from the global generator would shift the resumed run's
    dropout masks away from the uninterrupted run's (test_lora's kill-and-resume caught it)."""
    import torch

    torch.manual_seed(7)
    before = torch.get_rng_state()
    calibrate_cpu_tflops(seconds=0.01, size=64)
    assert torch.equal(torch.get_rng_state(), before)


def test_the_attention_probe_measures_a_positive_rate_and_leaves_the_global_rng_alone():
    """The fused attention's rate a run measures after its last step (for --plan_calibration): positive, and drawn
    from a generator of its own, like the matmul calibration."""
    import torch

    from scaletrain.observability import measured_attention_tflops

    torch.manual_seed(7)
    before = torch.get_rng_state()
    rate = measured_attention_tflops("cpu", dtype=torch.float32, batch=2, heads=2, seq_len=64, head_dim=16, repeats=1)
    assert 1e-5 < rate < 100
    assert torch.equal(torch.get_rng_state(), before)


def test_lora_flops_per_token_match_a_counted_training_step():
    """A real LoRA model's forward and backward, its matmuls counted by torch's FlopCounterMode (eager attention, so
    the attention products are counted too): the frozen base costs 4 per parameter, not 6. The formula ignores that
    the first layer's frozen projections need no input gradient either (about 1% here); 6 per parameter would be
    over by more than 25%."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from scaletrain.config.slices import PeftArgs
    from scaletrain.model.lora import apply_lora, meta_lora_model

    config = AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")
    args, seq = PeftArgs(use_peft=True, lora_r=16, lora_target_modules="all-linear"), 128
    flops = model_flops(meta_lora_model(config, args, "base", False), config, seq_len=seq)
    base = model_flops(meta_model(config, False), config, seq_len=seq)
    assert flops.frozen_matmul_params == base.matmul_params < flops.matmul_params
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(config, attn_implementation="eager"), args)
    ids = torch.randint(0, config.vocab_size, (1, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = counter.get_total_flops() / seq
    assert counted == pytest.approx(flops.per_token(), rel=0.03)
    assert dataclasses.replace(flops, frozen_matmul_params=0).per_token() > 1.25 * counted  # every weight trained
    assert flops.per_token(recompute=True) - flops.per_token() == 2 * flops.matmul_params + 4 * (
        flops.layers * flops.heads * flops.head_dim * seq
    )  # the recomputed forward, frozen weights included


# Tiny configs of the dense families the pipeline trains (their own config classes, as transformers builds them).
_DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
_GQA = dict(_DECODER, num_key_value_heads=2, intermediate_size=128)
FAMILIES = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "gpt_neox": dict(_DECODER, intermediate_size=128),
    "opt": dict(_DECODER, ffn_dim=128, word_embed_proj_dim=64),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
                   num_kv_heads=2),
    "llama": _GQA,
    "mistral": _GQA,
    "qwen2": _GQA,
    "qwen3": dict(_GQA, head_dim=32),  # a head dimension of its own, not hidden / heads
    "gemma": dict(_GQA, head_dim=32),
    "gemma2": dict(_GQA, head_dim=32),
    "phi3": _GQA,
    "olmo2": _GQA,
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_counted_flops_match_torchs_flop_counter_over_a_real_forward_and_backward(family):
    """The model FLOPs per token (6 N + 12 L H Q T) equal what torch.utils.flop_counter counts over a real forward and
    backward of a tiny model of each dense family (eager attention: plain matrix products over the full T x T square,
    as the formula counts it): fused QKV (GPT-NeoX, BLOOM, Falcon, Phi-3), grouped-query K/V, tied and untied heads,
    head dimensions of their own (Qwen3, Gemma), and GPT-2's Conv1D layers, which are no nn.Linear. Mixture-of-experts
    models are not among them: the counter does not see transformers' stacked experts either."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    seq_len, batch = 32, 2
    config = AutoConfig.for_model(
        family, vocab_size=512, bos_token_id=0, eos_token_id=0, pad_token_id=0, **FAMILIES[family]
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids = torch.randint(1, config.vocab_size, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = model_flops(model, config, seq_len=seq_len).per_token() * batch * seq_len
    assert counted == pytest.approx(counter.get_total_flops(), rel=0.05)
    if family == "gpt2":  # without Conv1D only the head (tied to the embedding) would count: a quarter here
        from transformers.pytorch_utils import Conv1D

        assert sum(isinstance(m, Conv1D) for m in model.modules()) == 4 * config.n_layer


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_counts_its_router_and_the_top_k_experts_a_token_runs(family):
    """transformers keeps the experts in stacked 3-D weights and the router in a class of its own (neither an
    nn.Linear): a token runs the router and its top-k of the E experts, which the count takes, hand-counted here."""
    import torch
    from transformers import AutoModelForCausalLM

    hidden, ff, experts, top_k, layers, vocab = 64, 96, 4, 2, 2, 512
    config = AutoConfig.for_model(
        family,
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=ff,
        moe_intermediate_size=ff,
        num_local_experts=experts,
        num_experts=experts,
        num_experts_per_tok=top_k,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config)
    attention = hidden * 4 * 16 + 2 * hidden * 2 * 16 + 4 * 16 * hidden  # q, k, v, o
    expert = 3 * hidden * ff  # gate, up and down of one expert
    matmul = layers * (attention + experts * hidden + top_k * expert) + vocab * hidden  # router, routed experts; head
    flops = model_flops(model, config, seq_len=32)
    assert flops.matmul_params == matmul
    linear_only = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear_only == layers * attention + vocab * hidden  # what nn.Linear alone would have counted
