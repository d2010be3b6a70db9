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
import dataclasses
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scaletrain.config import RunConfig, UsageError, _Parser, validate_data_flags  # noqa: E402
from scaletrain.logs import setup_logging, silence_library_logs  # noqa: E402
from scaletrain.tokenstore import PrepareError  # noqa: E402

FLAGS = ("dataset_name", "dataset_config_name", "train_file", "validation_file", "validation_split_percentage",
         "text_column", "tokenizer_name", "block_size", "trust_remote_code")


def parse(argv) -> tuple:
    parser = _Parser(prog="data/prepare.py", description=__doc__, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    for name in FLAGS:
        f = fields[name]
        if f.type in ("bool", bool):
            parser.add_argument(f"--{name}", action="store_true", help=f.metadata["help"])
        else:
            kind = {"int": int, "Optional[int]": int}.get(f.type, str)
            parser.add_argument(f"--{name}", type=kind, default=f.default, help=f.metadata["help"])
    parser.add_argument("--output_dir", required=True, help="Folder of the token store to write (or reuse).")
    parser.add_argument("--num_proc", type=int, default=None,
                        help="Tokenizer parallelism (default: the CPU count): up to 8 as Rust threads in one process, "
                             "more as worker processes.")
    args = parser.parse_args(argv)
    cfg = RunConfig(**{name: getattr(args, name) for name in FLAGS})
    validate_data_flags(cfg)
    return cfg, Path(args.output_dir), args.num_proc


def main(argv=None) -> int:
    setup_logging(0)
    try:
        cfg, store, num_proc = parse(argv)
        if num_proc is not None and num_proc < 1:
            raise UsageError(f"--num_proc {num_proc}: must be at least 1")
        from scaletrain.data import check_data_files, prepare_token_store
        from scaletrain.model import load_model_config, load_tokenizer, max_positions

        silence_library_logs()
        tokenizer = load_tokenizer(cfg)
        limit = max_positions(load_model_config(cfg)) if (cfg.tokenizer_name is None) else None
        block_size = cfg.block_size or min(1024, limit or 1024)
        if block_size < 2:
            raise UsageError(f"--block_size {block_size}: must be at least 2")
        if limit is not None and block_size > limit:
            raise UsageError(f"--block_size {block_size}: above the model's maximum positions ({limit})")
        check_data_files(cfg)
        prepare_token_store(cfg, tokenizer, cfg.tokenizer_source, block_size, store, num_proc)
    except UsageError as err:
        print(f"prepare.py: error: {err}", file=sys.stderr)
        return 2
    except PrepareError as err:
        print(f"prepare.py: error: {err}", file=sys.stderr)
        return 1
    logging.getLogger("scaletrain").info("token store ready: %s", store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
