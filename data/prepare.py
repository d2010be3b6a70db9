"""Tokenize a Hugging Face dataset once into a memory-mapped token store that train.py reads with --data_path.

    python data/prepare.py --train_file 'corpus/*.jsonl' --tokenizer_name data/tiny-llama --block_size 256 \
        --output_dir stores/corpus --num_proc 8
    deepspeed train.py --config ds_configs/zero3.json --data_path stores/corpus

Sources: --dataset_name (hub name, or a save_to_disk folder) with --dataset_config_name, or --train_file /
--validation_file (json, jsonl, csv, txt, parquet; globs and comma-separated lists). Running it again on the same
input reuses the store; a store made from different input is refused. Flags are spelled as in train.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


from scaletrain.config.slices import DataArgs, ModelArgs, OptimArgs
from scaletrain.config.cli import _Parser, add_flags, slices_from
from scaletrain.errors import PrepareError, UsageError
from scaletrain.logs import setup_logging, silence_library_logs

# train.py's data flags that only concern reading a prepared store (a store is what this script makes).
TRAINING_ONLY = tuple(name for name, f in DataArgs.__dataclass_fields__.items() if f.metadata.get("training_only"))
TOKENIZER_FLAGS = ("tokenizer_name", "trust_remote_code")


def parse(argv) -> tuple:
    """(DataArgs, ModelArgs with the tokenizer flags, the seed, store folder): the data slice, the tokenizer and the
    seed, parsed by the same flag definitions as train.py's."""
    parser = _Parser(
        prog="data/prepare.py",
        description=__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(parser, ["data"], exclude=TRAINING_ONLY + ("preprocessing_num_workers",))
    tokenizer = parser.add_argument_group("tokenizer")
    for name in TOKENIZER_FLAGS:
        f = ModelArgs.__dataclass_fields__[name]
        if name == "trust_remote_code":
            tokenizer.add_argument(f"--{name}", action="store_true", help=f.metadata["help"])
        else:
            tokenizer.add_argument(f"--{name}", default=None, help=f.metadata["help"])
    seed = OptimArgs.__dataclass_fields__["seed"]
    parser.add_argument(
        "--seed",
        type=int,
        default=seed.default,
        help="Seed of the held-out validation documents (--validation_split_percentage), as train.py's --seed.",
    )
    parser.add_argument("--output_dir", required=True, help="Folder of the token store to write (or reuse).")
    parser.add_argument(
        "--num_proc",
        "--preprocessing_num_workers",
        dest="preprocessing_num_workers",
        type=int,
        default=None,
        metavar="N",
        help="Tokenizer parallelism (default: the CPU count): up to 8 as "
        "Rust threads in one process, more as worker processes.",
    )
    values = vars(parser.parse_args(argv))
    if values["preprocessing_num_workers"] is not None and values["preprocessing_num_workers"] < 1:
        raise UsageError(f"--num_proc {values['preprocessing_num_workers']}: must be at least 1")
    slices = slices_from(values, ["data", "model"])
    slices["data"].validate()
    return slices["data"], slices["model"], values["seed"], Path(values["output_dir"])


def main(argv=None) -> int:
    setup_logging(0)
    try:
        data, model, seed, store = parse(argv)
        from scaletrain.model.build import load_model_config, load_tokenizer, max_positions
        from scaletrain.data.raw import check_data_files
        from scaletrain.data.preparation import prepare_token_store
        from scaletrain.data.chat_store import prepare_chat_store, resolve_chat_data

        silence_library_logs()
        tokenizer = load_tokenizer(model)
        limit = max_positions(load_model_config(model)) if model.tokenizer_name is None else None
        block_size = data.block_size or min(1024, limit or 1024)
        if limit is not None and block_size > limit:
            raise UsageError(f"--block_size {block_size}: above the model's maximum positions ({limit})")
        chat = resolve_chat_data(data, tokenizer)
        if chat is not None:  # a messages or prompt/completion dataset: tokens and a loss mask
            prepare_chat_store(data, tokenizer=tokenizer, block_size=block_size, store=store, chat=chat)
        else:
            check_data_files(data)
            prepare_token_store(data, tokenizer, model.tokenizer_source, block_size, store, seed=seed)
    except (UsageError, PrepareError) as err:
        print(f"prepare.py: error: {err}", file=sys.stderr)
        return err.exit_code
    logging.getLogger("scaletrain").info("token store ready: %s", store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
