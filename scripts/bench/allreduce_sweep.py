"""All-reduce time against size: gloo against DeepSpeed's shared-memory kernel, on the ranks of one host.

    deepspeed --num_gpus 2 scripts/bench/allreduce_sweep.py [--sizes_kb 64,256,1024,4096,16384,65536] [--repeats 15]

Each rank uses one intra-op thread, as train.py gives two ranks on two cores. For every size, the two ways
alternate; each figure is the median over --repeats of one fp32 all-reduce (SUM) after a barrier. Checks that both
give every rank the same sum. Prints one Markdown row per size (rank 0): the figures behind --cpu_shm_allreduce
(its 1 MB threshold, scaletrain.distributed.world.SHM_MIN_BYTES, is for failure reports, not speed: see its comment).
"""

from __future__ import annotations

import statistics
from functools import partial


from scripts.bench.common import bench_parser, timed


def main() -> None:
    parser = bench_parser(__doc__, repeats=15)
    parser.add_argument("--sizes_kb", default="64,256,1024,2048,4096,8192,16384,65536")
    parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher appends it
    args = parser.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kernel = getattr(getattr(torch.ops, "deepspeed", None), "inference_all_reduce_", None)
    if kernel is None:
        raise SystemExit(
            "DeepSpeed's shared-memory all-reduce is not loaded (launch with the deepspeed launcher, "
            "on one host, several ranks)"
        )
    ways = {"gloo": lambda t: dist.all_reduce(t), "shared memory": kernel}
    if rank == 0:
        print(
            f"| size | gloo ms | shared memory ms | gloo / shared memory |  ({world} ranks, fp32, median of "
            f"{args.repeats})\n|---|---|---|---|"
        )
    for size_kb in map(int, args.sizes_kb.split(",")):
        n = size_kb * 1024 // 4
        times = {way: [] for way in ways}
        for _ in range(args.repeats):
            for way, all_reduce in ways.items():
                tensor = torch.full((n,), float(rank + 1))
                dist.barrier()
                times[way].append(timed(partial(all_reduce, tensor)))
                expected = world * (world + 1) / 2
                if not bool((tensor == expected).all()):
                    raise SystemExit(f"{way}: wrong sum at {size_kb} KB")
        gloo, shm = (statistics.median(times[way]) * 1e3 for way in ways)
        if rank == 0:
            print(f"| {size_kb} KB | {gloo:.2f} | {shm:.2f} | {gloo / shm:.2f} |", flush=True)


if __name__ == "__main__":
    main()
