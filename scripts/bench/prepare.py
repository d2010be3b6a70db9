"""Preparation benchmark: data/prepare.py's token store against the Hugging Face run_clm.py recipe and against the
tokenizer alone, on the same corpus, tokenizer and process count, in one command.

Corpus: the Python standard library's source files, one document per file (real, varied-length text, offline),
tokenized with an 8k byte-level BPE trained on it here. Three measurements, each end to end from the JSONL file:
  recipe     datasets.load_dataset + .map(tokenize, num_proc) + .map(group_texts, num_proc)   (run_clm.py)
  store      prepare_token_store (read, tokenize, pack, write the memory-mapped store)         (data/prepare.py)
  tokenizer  tokenizers' encode_batch over the same documents, already in memory               (the ceiling)
             and encode_batch_fast (no character offsets, what the store calls): the tokenizing alone, nothing else
and the share of corpus tokens each packing keeps for training.

    python scripts/bench/prepare.py --num_proc 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from itertools import chain
from pathlib import Path

from scripts.bench.common import bench_parser

REPO = Path(__file__).resolve().parents[2]


def build_corpus(folder: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = folder / "stdlib_sources.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for source in sorted(stdlib.glob("**/*.py")):
            if "site-packages" in source.parts or "test" in source.parts:
                continue
            try:
                text = source.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            f.write(json.dumps({"text": text}) + "\n")
    return path


def build_tokenizer(corpus: Path, folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in corpus.open()]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(vocab_size=8192, special_tokens=["<s>", "</s>", "<pad>", "<unk>"], show_progress=False),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=1 << 30,
    )
    fast.save_pretrained(folder)
    return folder


def run_recipe(corpus: Path, tokenizer_dir: Path, block_size: int, num_proc: int, cache: Path) -> tuple:
    """run_clm.py's tokenize_function and group_texts, as written there (the remainder of each map batch dropped)."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    started = time.perf_counter()
    raw = datasets.load_dataset("json", data_files={"train": str(corpus)}, cache_dir=str(cache))["train"]
    tokenized = raw.map(lambda b: tokenizer(b["text"]), batched=True, num_proc=num_proc, remove_columns=["text"])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)] for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    grouped = tokenized.map(group_texts, batched=True, num_proc=num_proc)
    seconds = time.perf_counter() - started
    tokens = sum(len(x) for x in tokenized["input_ids"])
    return seconds, tokens, len(grouped) * block_size


def run_store(corpus: Path, tokenizer_dir: Path, block_size: int, num_proc: int, out: Path) -> tuple:
    from scaletrain.config.slices import DataArgs
    from scaletrain.data.preparation import prepare_token_store
    from scaletrain.data.token_store import open_store
    from transformers import AutoTokenizer

    os.environ["HF_DATASETS_CACHE"] = str(out / "hf_cache")
    import datasets  # noqa: F401 - imported before the clock starts, as run_recipe does (half a second)

    data = DataArgs(train_file=str(corpus), validation_split_percentage=0, preprocessing_num_workers=num_proc)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    started = time.perf_counter()
    store = prepare_token_store(data, tokenizer, str(tokenizer_dir), block_size, out / "store", show_progress=False)
    seconds = time.perf_counter() - started
    split = open_store(store)["splits"]["train"]
    return seconds, split.n_tokens, split.n_tokens  # every token is in a block (the last one padded)


def run_tokenizer_alone(corpus: Path, tokenizer_dir: Path, method: str) -> tuple:
    from transformers import AutoTokenizer

    texts = [json.loads(line)["text"] for line in corpus.open()]
    backend = AutoTokenizer.from_pretrained(tokenizer_dir).backend_tokenizer
    started = time.perf_counter()
    encodings = getattr(backend, method)(texts)
    seconds = time.perf_counter() - started
    return seconds, sum(len(e.ids) for e in encodings)


def measure(which: str, corpus: Path, tokenizer_dir: Path, block_size: int, num_proc: int, work: Path) -> dict:
    if which in ("tokenizer", "tokenizer_fast"):
        seconds, tokens = run_tokenizer_alone(
            corpus, tokenizer_dir, "encode_batch" if which == "tokenizer" else "encode_batch_fast"
        )
        kept = tokens
    elif which == "recipe":
        seconds, tokens, kept = run_recipe(corpus, tokenizer_dir, block_size, num_proc, work / "recipe_cache")
    else:
        seconds, tokens, kept = run_store(corpus, tokenizer_dir, block_size, num_proc, work / "store_run")
    return {"seconds": seconds, "tokens": tokens, "kept": kept}


def main() -> None:
    parser = bench_parser(__doc__, block_size=1024)
    parser.add_argument("--num_proc", type=int, default=2)
    parser.add_argument("--only", choices=["tokenizer", "tokenizer_fast", "recipe", "store"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:  # one measurement in a fresh process (see below)
        work = Path(args.work)
        print(
            "RESULT "
            + json.dumps(
                measure(
                    args.only, work / "stdlib_sources.jsonl", work / "tokenizer", args.block_size, args.num_proc, work
                )
            )
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = build_corpus(work)
        build_tokenizer(corpus, work / "tokenizer")
        results = {}
        # Each in its own process: a fork inside datasets.map turns the Rust tokenizer's threads off for the rest
        # of the process that forked, which would handicap whatever ran after the recipe. Each process gets
        # num_proc Rust threads at most, so "N" means N cores' worth of tokenizing for all three.
        env = {**os.environ, "RAYON_NUM_THREADS": str(args.num_proc)}
        env.pop("TOKENIZERS_PARALLELISM", None)
        for which in ("tokenizer", "tokenizer_fast", "recipe", "store"):
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--only",
                    which,
                    "--work",
                    str(work),
                    "--num_proc",
                    str(args.num_proc),
                    "--block_size",
                    str(args.block_size),
                ],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
            results[which] = json.loads(line.split(" ", 1)[1])
    alone, recipe, store = results["tokenizer"], results["recipe"], results["store"]
    rate = {k: v["tokens"] / v["seconds"] for k, v in results.items()}
    print(
        json.dumps(
            {
                "corpus_tokens": alone["tokens"],
                "tokenizer_alone_tokens_per_s": round(rate["tokenizer"]),
                "tokenizer_alone_fast_tokens_per_s": round(rate["tokenizer_fast"]),
                "recipe_tokens_per_s": round(rate["recipe"]),
                "store_tokens_per_s": round(rate["store"]),
                "store_vs_recipe": round(rate["store"] / rate["recipe"], 2),
                "store_vs_tokenizer_alone": round(rate["store"] / rate["tokenizer"], 3),
                "recipe_x2_5_vs_tokenizer_alone_fast": round(2.5 * rate["recipe"] / rate["tokenizer_fast"], 3),
                "recipe_tokens_kept": round(recipe["kept"] / recipe["tokens"], 4),
                "store_tokens_kept": round(store["kept"] / store["tokens"], 4),
                "num_proc": args.num_proc,
            }
        )
    )


if __name__ == "__main__":
    main()
