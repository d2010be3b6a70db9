"""Train a Hugging Face causal LM with DeepSpeed.

    deepspeed train.py --config ds_configs/zero3.json          # the built-in default: tiny Llama, sample data
    deepspeed --num_gpus 2 train.py --config ds_configs/zero2.json --model_name_or_path ... --train_file ...

The phases of a run, in order; each lives in its own module of scaletrain/.
"""

import gc
import sys
import traceback

from scaletrain.distributed import read_launch_env
from scaletrain.errors import RunEnded
from scaletrain.logs import setup_logging
from scaletrain.parts import DistInfo


def report(err: RunEnded, dist: DistInfo) -> int:
    """A planned end: its message from the ranks that should say it (a usage error once, not once per rank)."""
    if err.reports_here(dist):
        print(f"train.py: {err.prefix}: {f'[{err.node}] ' if err.node else ''}{err}", file=sys.stderr)
    return err.exit_code


def main(argv=None) -> int:
    dist = read_launch_env()
    setup_logging(dist.rank)
    try:
        from scaletrain.preflight import print_config
        from scaletrain.run import Lifetime, build_run, plan_run, print_plan, publish

        plan = plan_run(argv, dist)  # flags, recipe, DeepSpeed JSON, model config, tokenizer: exit 2 on a mistake
    except RunEnded as err:
        from scaletrain.distributed import stop_with_the_others

        return report(stop_with_the_others(err, dist, argv), dist)  # the other ranks learn of it at the rendezvous
    if plan.cfg.run.print_config:
        print_config(plan)  # every "auto" filled, with where each value came from
        return 0
    if plan.cfg.planning.plan:
        print_plan(plan)  # per-GPU memory of each ZeRO stage, offload option and layout, from the meta model
        return 0
    lifetime = Lifetime()  # what the build acquires, released below on every path
    exit_code = 1  # a crash, unless the run ends otherwise
    try:
        # Built in one straight line (process group, inputs, model, data, run folder, engine, resume, reference
        # log-probs, hang watch), then trained and ended (final eval, checkpoint, Hugging Face export). The built
        # run is not kept in this frame, so nothing here holds the engine past the release below.
        build_run(plan, lifetime=lifetime).train()
        exit_code = 0
    except RunEnded as err:  # usage (2), failed save or preparation (1), non-finite stop (3), preempted (85)
        exit_code = report(err, dist)
        return exit_code
    except BaseException as err:  # a crash: its traceback still holds the loop's frames, and so the engine
        traceback.clear_frames(err.__traceback__.tb_next)  # (the lines stay printable); close() can free it
        raise
    finally:
        lifetime.close(exit_code)  # metrics sinks (wandb marks a non-zero end failed), engines, the process group
    return publish(plan)  # --push_to_hub: rank 0 uploads the export, no collective left to wait on


if __name__ == "__main__":
    exit_code = main()
    # Everything the run wrote is closed by now: spare the interpreter's last garbage collection of the objects
    # torch, transformers and DeepSpeed hold (1-2 s of CPU per process at every exit; the OS frees the memory).
    gc.freeze()
    sys.exit(exit_code)
