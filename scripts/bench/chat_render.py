"""Chat rendering throughput: one process against N worker processes on the same rows.

    python scripts/bench/chat_render.py [--copies 2000] [--workers 2]

Rows: the 24 conversations of tests/fixtures/chat/messages.jsonl repeated --copies times, rendered with the
Mistral v0.2 template fixture and the tiny tokenizer, with --assistant_only_loss masks (prefix by prefix), through
scaletrain.data.chat_store.render_split. Prints conversations/s for each and the ratio. Both include the workers' start.
"""

import json
from functools import partial
from pathlib import Path

from scripts.bench.common import bench_parser, timed

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    import datasets
    from transformers import AutoTokenizer

    from scaletrain.data.chat_render import load_chat_template
    from scaletrain.data.chat_store import ChatData, render_split

    parser = bench_parser(__doc__)
    parser.add_argument("--copies", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(REPO / "data" / "tiny-llama")
    template = load_chat_template(tokenizer, str(REPO / "tests/fixtures/chat_templates/mistral-7b-instruct-v0.2.jinja"))
    rows = [json.loads(line) for line in (REPO / "tests/fixtures/chat/messages.jsonl").read_text().splitlines()]
    ds = datasets.Dataset.from_list(rows * args.copies)
    chat = ChatData("messages", template, "assistant_only")
    rates = {}
    for workers in (1, args.workers):
        seconds = timed(partial(render_split, ds, tokenizer, chat, "train", False, workers=workers))
        rates[workers] = len(ds) / seconds
        print(f"workers={workers}: {len(ds)} conversations, {rates[workers]:.0f}/s")
    print(f"ratio {args.workers} workers / 1 process: {rates[args.workers] / rates[1]:.2f}")


if __name__ == "__main__":
    main()
