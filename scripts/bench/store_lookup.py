"""Start-up cost of finding the cached token store: what every rank computes at every start of train.py on raw
data (the store's fingerprint and its cache path), on a --train_file of --size_gib GiB written here.

    python scripts/bench/store_lookup.py --size_gib 1

Run it from another checkout (PYTHONPATH) to compare versions; the file is read once before timing (page cache warm,
the lookup's best case: a cold read from a network file system is slower).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from scripts.bench.common import bench_parser, timed

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = bench_parser(__doc__, repeats=3)
    parser.add_argument("--size_gib", type=float, default=1.0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from scaletrain.config.cli import parse_run_config
    from scaletrain.data.preparation import default_store_path, store_fingerprint

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        line = json.dumps({"text": "lorem ipsum dolor sit amet " * 40}) + "\n"
        with open(corpus, "w") as f:
            for _ in range(int(args.size_gib * 2**30) // (len(line) * 1000)):
                f.write(line * 1000)
        data = parse_run_config(
            ["--config", str(REPO / "ds_configs/zero2.json"), "--output_dir", tmp, "--train_file", str(corpus)]
        ).data
        tokenizer = AutoTokenizer.from_pretrained(REPO / "data" / "tiny-llama")
        corpus.read_bytes()  # into the page cache
        times = [timed(lambda: default_store_path(store_fingerprint(data, tokenizer, 64))) for _ in range(args.repeats)]
        each = ", ".join(f"{t * 1000:.1f}" for t in times)
        print(
            f"store lookup, {corpus.stat().st_size / 2**30:.2f} GiB --train_file: median "
            f"{statistics.median(times) * 1000:.1f} ms over {args.repeats} ({each})"
        )


if __name__ == "__main__":
    main()
