"""Rebuild data/tiny-llama/: the default model config and its tokenizer (run once; the output is committed).

The folder holds no weights: `train.py` builds the model from its config.json with random initialisation and
loads the tokenizer from it, so `--config_name data/tiny-llama --tokenizer_name data/tiny-llama` is the default.
The tokenizer is a byte-level BPE trained on data/sample/train.jsonl with the `tokenizers` library.

    python data/build_tiny_llama.py
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

HERE = Path(__file__).parent
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


def tiny_llama_variant(folder: Path, **config_overrides) -> Path:
    """data/tiny-llama with some config values changed (a wider model for a benchmark or a test), written to
    `folder` with the same tokenizer; returns `folder`."""
    config = LlamaConfig.from_pretrained(HERE / "tiny-llama")
    for key, value in config_overrides.items():
        setattr(config, key, value)
    config.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HERE / "tiny-llama" / name, Path(folder) / name)
    return Path(folder)


def train_tokenizer(train_file: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    texts = [json.loads(line)["text"] for line in train_file.open(encoding="utf-8")]
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=256, **SPECIAL_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train_file", default=str(HERE / "sample" / "train.jsonl"))
    parser.add_argument("--output_dir", default=str(HERE / "tiny-llama"))
    parser.add_argument("--vocab_size", type=int, default=4096)
    args = parser.parse_args()

    tokenizer = train_tokenizer(Path(args.train_file), args.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    config.save_pretrained(out)
    print(f"wrote {out}: vocab {len(tokenizer)}, {config.num_hidden_layers} layers, hidden {config.hidden_size}")


if __name__ == "__main__":
    main()
