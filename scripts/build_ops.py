"""Build DeepSpeed's compiled ops ahead of a job, once, so no rank spends minutes compiling inside its time limit.

    python scripts/build_ops.py                                # every config in ds_configs/
    python scripts/build_ops.py --config ds_configs/zero3_offload.json

The ops land in torch's extension cache ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), which the
ranks of later runs load from. On a cluster, run it where the cache is shared with the compute nodes (a login
node builds the CPU ops; GPU ops are best built on a GPU node of the same kind). The shm all-reduce op is built
when the accelerator is the CPU (several CPU ranks use it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from scaletrain.engine import ops

REPO = Path(__file__).resolve().parents[1]


def needed_ops(config_paths, accelerator: str) -> list:
    names = ops.comm_ops(accelerator, world_size=2)
    for path in config_paths:
        try:
            config = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            print(
                f"error: --config {path}: cannot read it as JSON ({err}); give a DeepSpeed config file", file=sys.stderr
            )
            raise SystemExit(2) from None  # the line above says it all: no traceback chain
        names += [name for name in ops.engine_ops(config, accelerator) if name not in names]
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="a DeepSpeed config (repeatable); default: ds_configs/*")
    args = parser.parse_args(argv)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    names = needed_ops(args.config or sorted(str(p) for p in (REPO / "ds_configs").glob("*.json")), accelerator)
    for name in names:
        started = time.perf_counter()
        module = ops.load_op(name, say=print)
        status = "ready" if module is not None else "not compatible with this machine (skipped)"
        print(f"{name}: {status} ({time.perf_counter() - started:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
