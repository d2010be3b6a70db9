"""Pipeline parallelism: a Hugging Face causal LM as a `deepspeed.pipe.PipelineModule`, its stages the model's own
modules (embedding, decoder layers, final norm, head) wrapped to take and return one tensor, so weights, initialisation
and checkpointing stay transformers'. Only the hidden state crosses a stage: each decoder layer computes its positions
and rotary table, and attention is causal through SDPA's `is_causal`, so no mask travels. The pipe engine divides each
micro-batch's backward by the accumulation steps, so `TokenLoss` scales the summed token losses by data-parallel size x
accumulation / global targets to give the mean over the global batch's targets (train/step.py). Layout and what is
tested: docs/parallelism.md#pipeline-parallelism.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from scaletrain.data import IGNORE_INDEX
from scaletrain.errors import UsageError

log = logging.getLogger(__name__)

# Causal LMs whose modules map onto stages, by Hugging Face model_type: where each part lives.
ROTARY = ("llama", "mistral", "qwen2", "qwen3")
LEARNED_POSITIONS = ("gpt2",)
SUPPORTED = ROTARY + LEARNED_POSITIONS
SUPPORTED_NAMES = "Llama, Mistral, Qwen2, Qwen3 (rotary) and GPT-2"
# Stages AutoTP splits by name under tensor x pipeline parallelism (layout.TENSOR_STAGE_PARTITION): separate q/k/v
# and gate/up/down projections. Qwen3's per-head q/k norms would need their gradients summed over the tensor group,
# GPT-2's fused c_attn a split per q/k/v.
TENSOR_STAGES = ("llama", "mistral", "qwen2")
# Attention that is causal with no mask tensor (SDPA's and flash attention's is_causal); eager needs a mask.
CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")


def uses_sliding_window(model_config, block_size: int) -> bool:
    """Whether some layer attends through a sliding window narrower than the block (Mistral v0.1, Qwen with
    use_sliding_window, layer_types with "sliding_attention"): the stages' plain causal attention would not."""
    window = getattr(model_config, "sliding_window", None)
    if not window or window >= block_size or getattr(model_config, "use_sliding_window", True) is False:
        return False
    layer_types = getattr(model_config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


def check_pipeline_model(pp: int, *, model_config, attn_implementation: str, block_size: int = 0, tp: int = 1) -> None:
    """Before anything is built: the model maps onto stages (and, with tensor parallelism, its stages split by
    name), and its layers split evenly over them."""
    if pp == 1:
        return
    model_type = getattr(model_config, "model_type", None)
    if model_type not in SUPPORTED:
        raise UsageError(
            f"--pipeline_parallel_size {pp}: the model type {model_type!r} has no pipeline mapping "
            f"here (supported: {SUPPORTED_NAMES})",
            "use a supported model, or no pipeline parallelism",
        )
    if tp > 1 and model_type not in TENSOR_STAGES:
        raise UsageError(
            f"--tensor_parallel_size {tp} with --pipeline_parallel_size {pp}: the model type {model_type!r} has no "
            "tensor split of its stages here (supported: Llama, Mistral, Qwen2)",
            "use one of them, or either kind of parallelism alone",
        )
    layers = model_config.num_hidden_layers
    if layers % pp:
        raise UsageError(
            f"--pipeline_parallel_size {pp} does not divide the model's {layers} decoder layers (num_hidden_layers)",
            f"choose a size that divides {layers}",
        )
    if uses_sliding_window(model_config, block_size):
        raise UsageError(
            f"--pipeline_parallel_size {pp}: the model attends through a sliding window of "
            f"{model_config.sliding_window} tokens, shorter than the block ({block_size}); the "
            "pipeline's stages attend causally over the whole block",
            f"use --block_size {model_config.sliding_window} or less, or no pipeline parallelism",
        )
    if attn_implementation not in CAUSAL_WITHOUT_MASK:
        raise UsageError(
            f"--pipeline_parallel_size {pp}: the model's attention is {attn_implementation!r}; the "
            "pipeline's stages rely on SDPA's (or flash attention's) causal mode, eager attention "
            "would need a mask tensor between stages",
            "use a model whose attention is sdpa",
        )


def _nn():
    import torch.nn as nn

    return nn


def _positions(hidden):
    import torch

    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _wrapper_classes():
    """The stage modules (built lazily: importing this file needs no torch)."""
    nn = _nn()

    class TokenEmbedding(nn.Module):
        """input ids -> hidden states (the model's token embedding; also the tied head's weight)."""

        def __init__(self, embedding):
            super().__init__()
            self.embedding = embedding

        def forward(self, input_ids):
            return self.embedding(input_ids)

    class LearnedPositions(nn.Module):
        """GPT-2: hidden + position embedding, then the embedding dropout."""

        def __init__(self, wpe, drop):
            super().__init__()
            self.wpe, self.drop = wpe, drop

        def forward(self, hidden):
            return self.drop(hidden + self.wpe(_positions(hidden)))

    class RotaryDecoderLayer(nn.Module):
        """One Llama-family decoder layer, with the rotary table computed from the block's positions."""

        def __init__(self, layer, rotary):
            super().__init__()
            self.layer = layer
            self.rotary = rotary  # non-persistent buffers only: nothing of it lands in a checkpoint

        def forward(self, hidden):
            positions = _positions(hidden)
            out = self.layer(
                hidden,
                attention_mask=None,
                position_ids=positions,
                position_embeddings=self.rotary(hidden, positions),
                use_cache=False,
            )
            return out[0] if isinstance(out, tuple) else out

    class PlainDecoderLayer(nn.Module):
        """One GPT-2 block (positions were added at the embedding)."""

        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, hidden):
            out = self.layer(hidden, attention_mask=None, use_cache=False)
            return out[0] if isinstance(out, tuple) else out

    class FinalNorm(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def forward(self, hidden):
            return self.norm(hidden)

    class Head(nn.Module):
        """The LM head; with the chunked loss the stage returns the hidden states and the loss applies the head."""

        def __init__(self, head, in_loss: bool = False):
            super().__init__()
            self.head = head
            self.in_loss = in_loss

        def forward(self, hidden):
            return hidden if self.in_loss else self.head(hidden)

    return TokenEmbedding, LearnedPositions, RotaryDecoderLayer, PlainDecoderLayer, FinalNorm, Head


def _tied_head_forward(embedding_module, hidden):
    """The tied head on the last stage: logits = hidden @ embedding^T."""
    import torch.nn.functional as F

    return F.linear(hidden, embedding_module.embedding.weight)


def _tied_head_in_loss(embedding_module, hidden):
    """The tied head on the last stage under the chunked loss: the hidden states (the loss applies the head)."""
    return hidden


@dataclass(frozen=True)
class StageLayer:
    """Where a pipeline layer's checkpoint keys go in the Hugging Face state dict: its keys start with `strip`,
    which becomes `prefix` (a tied head's layer holds nothing of its own: `prefix` None)."""

    strip: str
    prefix: str | None


def layer_specs(hf_model, head_in_loss: bool = False) -> tuple:
    """(DeepSpeed layer specs in order, the StageLayer of each, the decoder wrapper's class name). `head_in_loss`:
    the last layer passes the hidden states through, for the loss to apply the head in chunks (TokenLoss)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    TokenEmbedding, LearnedPositions, RotaryDecoderLayer, PlainDecoderLayer, FinalNorm, Head = _wrapper_classes()
    config = hf_model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    specs, places = [], []
    if config.model_type in ROTARY:
        base, base_prefix = hf_model.model, "model."
        embedding, layers, norm = base.embed_tokens, base.layers, base.norm
        embedding_prefix, norm_prefix = "model.embed_tokens.", "model.norm."
    else:  # GPT-2
        base, base_prefix = hf_model.transformer, "transformer."
        embedding, layers, norm = base.wte, base.h, base.ln_f
        embedding_prefix, norm_prefix = "transformer.wte.", "transformer.ln_f."
    if tied:
        specs.append(TiedLayerSpec("embedding", TokenEmbedding, embedding, tied_weight_attr="embedding.weight"))
    else:
        specs.append(LayerSpec(TokenEmbedding, embedding))
    places.append(StageLayer("embedding.", embedding_prefix))
    if config.model_type in LEARNED_POSITIONS:
        specs.append(LayerSpec(LearnedPositions, base.wpe, base.drop))
        places.append(StageLayer("wpe.", f"{base_prefix}wpe."))
    decoder = RotaryDecoderLayer if config.model_type in ROTARY else PlainDecoderLayer
    layer_prefix = "model.layers." if config.model_type in ROTARY else "transformer.h."
    for i, layer in enumerate(layers):
        extra = (base.rotary_emb,) if decoder is RotaryDecoderLayer else ()
        specs.append(LayerSpec(decoder, layer, *extra))
        places.append(StageLayer("layer.", f"{layer_prefix}{i}."))
    specs.append(LayerSpec(FinalNorm, norm))
    places.append(StageLayer("norm.", norm_prefix))
    if tied:
        specs.append(
            TiedLayerSpec(
                "embedding",
                TokenEmbedding,
                embedding,
                forward_fn=_tied_head_in_loss if head_in_loss else _tied_head_forward,
                tied_weight_attr="embedding.weight",
            )
        )
        places.append(StageLayer("", None))
    else:
        specs.append(LayerSpec(Head, hf_model.lm_head, head_in_loss))
        places.append(StageLayer("head.", "lm_head."))
    return specs, places, decoder.__name__


class TokenLoss:
    """The pipe engine's loss_fn: the micro-batch's summed token cross-entropy, scaled for the global batch.

    `scale` is set before each step (data-parallel size x accumulation / the global targets); `loss_sum` collects
    the unscaled sums of this rank's micro-batches (non-zero on the last stage only), which the loop reports. With
    `chunk` (the chunked loss) the last stage's outputs are the hidden states and the loss applies `head` (its
    module holding `weight`, and `bias` if any: the LM head, or the tied embedding) `chunk` tokens at a time
    (model/chunked_loss.py), so the pipe engine keeps hidden states, not logits, in its output buffers."""

    def __init__(self, chunk: int | None = None):
        self.scale = 1.0
        self.loss_sum = 0.0
        self.chunk = chunk
        self.head = None  # set on the last stage when chunked

    def __call__(self, outputs, targets):
        import torch.nn.functional as F

        from scaletrain.model import chunked_token_loss

        if self.chunk is not None:
            bias = getattr(self.head, "bias", None)
            summed = chunked_token_loss(outputs, weight=self.head.weight, bias=bias, targets=targets, chunk=self.chunk)
        else:
            summed = F.cross_entropy(
                outputs.reshape(-1, outputs.size(-1)).float(),
                targets.reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        self.loss_sum = self.loss_sum + summed.detach()
        return summed * self.scale


def pipeline_loss_chunk(hf_model, chunk_size: int | None) -> int | None:
    """Tokens per chunk of the pipeline's chunked loss (--loss_chunk_size; auto from the vocabulary), or None: the
    whole logits (--loss_chunk_size 0, or a model that changes its head's output)."""
    from scaletrain.model import logit_transforms
    from scaletrain.observability import auto_loss_chunk

    transforms = logit_transforms(hf_model)
    if chunk_size == 0 or transforms:
        why = "--loss_chunk_size 0" if chunk_size == 0 else f"its config sets {', '.join(transforms)}"
        log.info("loss: from the whole logits (%s)", why)
        return None
    tokens = chunk_size or auto_loss_chunk(hf_model.config.vocab_size)
    log.info("loss: the last stage applies the LM head in chunks of %d tokens (the whole logits never exist)", tokens)
    return tokens


def build_pipeline_module(hf_model, layout, partition: str, loss_chunk_size: int | None = None):
    """The PipelineModule of `hf_model` over the layout's pipeline stages; this rank builds only its own stage's
    layers (and, for a model on the meta device, reads only their weights: model/stage_weights.py). Under tensor x
    pipeline parallelism the module's grid has a tensor axis (DeepSpeed's PipeModelDataParallelTopology: the ranks
    numbered as parts.ParallelLayout numbers them), which AutoTP splits each stage over when the engine is built.
    Needs the process group. `loss_chunk_size` as --loss_chunk_size (None: auto). Returns (module, loss)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from scaletrain.engine import pipeline_module_class, release_other_stages

    weights = getattr(hf_model, "stage_weights", None)
    PipelineModule = pipeline_module_class(weights.load_into if weights is not None else None)
    chunk = pipeline_loss_chunk(hf_model, loss_chunk_size)
    specs, places, decoder_name = layer_specs(hf_model, head_in_loss=chunk is not None)
    loss = TokenLoss(chunk)
    # "uniform": the same number of decoder layers per stage; "parameters": DeepSpeed balances parameter counts
    # (the embedding and the head weigh in).
    method = f"type:{decoder_name}" if partition == "uniform" else "parameters"
    sizes = [_spec_parameters(spec) for spec in specs]  # before the other stages' specs are emptied
    pp = layout.pp
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=layout.tp, num_dp=layout.dp) if layout.tp > 1 else None
    module = PipelineModule(layers=specs, num_stages=pp, topology=topology, loss_fn=loss, partition_method=method)
    release_other_stages(module)
    log.info(
        "pipeline stages (--pipeline_partition %s): %s",
        partition,
        "; ".join(
            describe_stage(stage, places[start:stop], sizes[start:stop])
            for stage, (start, stop) in enumerate(zip(module.parts[:-1], module.parts[1:], strict=True))
        ),
    )
    if chunk is not None and module.stage_id == pp - 1:
        loss.head = _last_stage_head(module)
    module.scaletrain_layers = places  # how its layer files map back to Hugging Face names
    module.hf_config = hf_model.config
    if layout.tp > 1:
        module.config = hf_model.config  # AutoTP reads the head counts from the model's config
    return module, loss


def _last_stage_head(module):
    """The module whose weight is the LM head on the last stage: the head, or the tied embedding."""
    if "embedding" in module.tied_modules:  # TiedLayerSpec("embedding", ...): the last stage holds the tied head
        return module.tied_modules["embedding"].embedding
    heads = [layer for layer in module.forward_funcs if type(layer).__name__ == "Head"]
    if len(heads) != 1:
        raise RuntimeError(f"pipeline: the last stage holds {len(heads)} LM heads, expected one")
    return heads[0].head


def _spec_parameters(spec) -> int:
    import torch.nn as nn

    if getattr(spec, "forward_fn", None) is not None:  # the tied head: the embedding's weight, held again
        return 0
    return sum(p.numel() for arg in spec.module_args if isinstance(arg, nn.Module) for p in arg.parameters())


def describe_stage(stage: int, places: list, sizes: list) -> str:
    """ "stage 0: embedding + 2 decoder layers (0.89M parameters)"."""
    decoders = sum(1 for p in places if p.strip == "layer.")
    parts = [
        name
        for name, present in (
            ("embedding", any(p.strip == "embedding." for p in places)),
            ("positions", any(p.strip == "wpe." for p in places)),
            (f"{decoders} decoder layer{'s' if decoders != 1 else ''}", decoders),
            ("norm", any(p.strip == "norm." for p in places)),
            ("head", any(p.strip in ("head.", "") for p in places)),
        )
        if present
    ]
    return f"stage {stage}: {' + '.join(parts)} ({sum(sizes) / 1e6:.2f}M parameters)"


def pipe_micro_batches(micro_batches: list) -> list:
    """Our micro-batches as the pipe engine reads them: (inputs for the first stage, labels for the last).
    The labels are already shifted: position t holds the target of token t (the last one ignored)."""
    import torch.nn.functional as F

    return [(batch["input_ids"], F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)) for batch in micro_batches]


LAYER_MAP = "pipeline_layers.json"


def hf_parameter_name(pipe_name: str, places: list) -> str:
    """The Hugging Face name of a PipelineModule parameter: `<layer index>.<key>`, or `tied_modules.<tie key>.<key>`
    for a tied embedding (layer 0's module)."""
    head, _, key = pipe_name.partition(".")
    if head == "tied_modules":
        _, _, key = key.partition(".")
        index = 0
    else:
        index = int(head)
    name = _hf_key(places[index], key)
    if name is None:
        raise ValueError(f"pipeline parameter {pipe_name!r} does not map onto the model's names")
    return name


def _hf_key(place: dict, key: str):
    """`key` of a pipeline layer's module under its Hugging Face name, or None where the layer's map does not
    cover it (a tied head holds nothing of its own; a key outside the wrapped module's prefix)."""
    if place["prefix"] is None or not key.startswith(place["strip"]):
        return None
    return place["prefix"] + key[len(place["strip"]) :]


def rename_universal_parameters(universal_dir, places: list) -> None:
    """A universal checkpoint of a pipeline names each parameter's folder (zero/<name>/) by pipeline layer; rename
    them to the Hugging Face model's names, so the model without pipeline parallelism loads it."""
    zero = universal_dir / "zero"
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        new = zero / hf_parameter_name(folder.name, places)
        if new != folder:
            folder.rename(new)


def layer_map(module) -> list:
    """The JSON-able map of each pipeline layer to its Hugging Face names, saved beside a checkpoint."""
    return [{"strip": p.strip, "prefix": p.prefix} for p in module.scaletrain_layers]


def hf_state_dict_from_layer_files(ckpt, places: list, full_shapes: dict) -> dict:
    """A Hugging Face state dict from a pipeline checkpoint's layer files, written by each stage's first
    data-parallel rank: `layer_XX-model_states.pt`, or under tensor x pipeline parallelism one per tensor rank
    (`layer_XX-model_YY-model_states.pt`), whose shards are joined along the dimension AutoTP split (the one where a
    shard is 1/T of the model's shape in `full_shapes`; a weight every tensor rank holds whole is taken once)."""
    import re
    from collections import defaultdict

    import torch

    shards: defaultdict[int, dict[int, dict]] = defaultdict(dict)  # layer index -> tensor rank -> its state dict
    files = sorted(ckpt.glob("layer_*-model_states.pt"))
    if not files:
        raise FileNotFoundError(f"{ckpt}: no pipeline layer files (layer_XX-model_states.pt)")
    for path in files:
        found = re.match(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt$", path.name)
        assert found is not None, f"{path}: not a DeepSpeed pipeline layer file name"
        index, tensor_rank = int(found.group(1)), int(found.group(2) or 0)
        if places[index]["prefix"] is not None:
            shards[index][tensor_rank] = torch.load(path, map_location="cpu", weights_only=True)
    state = {}
    for index, by_rank in sorted(shards.items()):
        place, ranks = places[index], [by_rank[r] for r in sorted(by_rank)]
        for key in ranks[0]:
            name = _hf_key(place, key)
            if name is None:
                raise ValueError(f"{ckpt}: layer {index}'s key {key!r} does not start with {place['strip']!r}")
            state[name] = _joined([shard[key] for shard in ranks], full_shapes.get(name), name)
    return state


def _joined(pieces: list, full_shape, name: str):
    """One weight from its tensor-parallel shards: concatenated along the dimension that is split, or the first
    piece where every rank holds it whole."""
    import torch

    if len(pieces) == 1:
        return pieces[0]
    if full_shape is None:  # nothing to tell a split weight from a whole one by
        raise ValueError(f"{name}: {len(pieces)} tensor-parallel shards of a weight the model does not have")
    if tuple(pieces[0].shape) == tuple(full_shape):
        return pieces[0]
    split = [
        d
        for d, (part, whole) in enumerate(zip(pieces[0].shape, full_shape, strict=True))
        if part * len(pieces) == whole
    ]
    if len(split) != 1:
        raise ValueError(
            f"{name}: {len(pieces)} tensor-parallel shards of {tuple(pieces[0].shape)} do not make "
            f"the model's {tuple(full_shape)}"
        )
    return torch.cat(pieces, dim=split[0])
