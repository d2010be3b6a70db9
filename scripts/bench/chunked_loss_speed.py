"""Time of the token loss through the LM head, forward and backward, in one process: train.py's chunked loss
(scaletrain/model/chunked_loss.py) against the whole-logits loss (the Hugging Face way: F.linear, F.cross_entropy on the
fp32 logits, autograd's backward). Both include the head's three matrix products. fp32 on the CPU, one thread;
the two alternate, --rounds times; medians.

    python scripts/bench/chunked_loss_speed.py [--tokens 1024] [--hidden 256] [--vocab 4096,32768] [--rounds 15]

The default shapes: one micro-batch of scripts/compare_hf_trainer.py --measure throughput (4 x 256 tokens, hidden 256,
vocabulary 4096), and the same with a 32k vocabulary. Run it in a checkout of an earlier commit to compare versions.
"""

from __future__ import annotations

import statistics
from functools import partial

import torch
import torch.nn.functional as F


from scaletrain.data.blocks import IGNORE_INDEX
from scaletrain.model.chunked_loss import chunked_token_loss
from scaletrain.observability.memory_planner import auto_loss_chunk
from scripts.bench.common import bench_parser, timed


def whole_logits_loss(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def timed_step(loss_fn, hidden, weight) -> float:
    hidden.grad = weight.grad = None
    return timed(lambda: loss_fn().backward())


def main() -> None:
    parser = bench_parser(__doc__, rounds=15)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", default="4096,32768")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| tokens x hidden x vocabulary | chunk | chunked loss (ms) | whole logits (ms) | chunked / whole |")
    print("|---|---|---|---|---|")
    for vocab in map(int, args.vocab.split(",")):
        torch.manual_seed(0)
        hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
        weight = (torch.randn(vocab, args.hidden) * 0.02).requires_grad_()
        targets = torch.randint(0, vocab, (args.tokens,))
        targets[-args.tokens // 256 :] = IGNORE_INDEX  # the last token of each block has no target
        chunk = auto_loss_chunk(vocab)
        sides = {
            "chunked": partial(chunked_token_loss, hidden, weight, None, targets, chunk),
            "whole": partial(whole_logits_loss, hidden, weight, targets),
        }
        times = {name: [] for name in sides}
        for fn in sides.values():  # warm-up
            timed_step(fn, hidden, weight)
        for _ in range(args.rounds):
            for name, fn in sides.items():
                times[name].append(timed_step(fn, hidden, weight))
        chunked, whole = (statistics.median(times[name]) * 1e3 for name in ("chunked", "whole"))
        print(
            f"| {args.tokens} x {args.hidden} x {vocab} | {min(chunk, args.tokens)} | {chunked:.1f} | {whole:.1f} "
            f"| {chunked / whole:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
