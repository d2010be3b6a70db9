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
        from scaletrain.run import Run

        run = Run.from_flags(argv, dist)  # flags, recipe, DeepSpeed JSON, model config, tokenizer: exit 2 on a mistake
    except RunEnded as err:
        from scaletrain.distributed import stop_with_the_others

        return report(stop_with_the_others(err, dist, argv), dist)  # the other ranks learn of it at the rendezvous
    if run.cfg.run.print_config:
        run.print_config()  # every "auto" filled, with where each value came from
        return 0
    if run.cfg.planning.plan:
        run.print_memory_plan()  # per-GPU memory of each ZeRO stage and offload option, from the meta model
        return 0
    exit_code = 1  # a crash, unless the run ends otherwise
    try:
        run.init_distributed()  # process group; the ranks share their pre-flight verdicts and compare what they found
        run.prepare_inputs()  # checkpoint checksums (a damaged one: fall back), universal conversion, token store
        run.build_model()  # ZeRO-3: built sharded, never whole on one rank
        run.build_data()  # packed blocks from the store, the global order read by this rank
        run.write_run_folder()  # resolved configs saved only after everything above succeeded
        run.build_engine()  # deepspeed.initialize with the resolved config and LR schedule
        run.resume()  # newest committed checkpoint (or none): weights, optimizer, schedule, RNG, data position
        run.reference_log_probs()  # preference pairs: the starting model's log-probs of each pair, once (or read)
        run.watch_for_hangs()  # heartbeats: a run stuck for --hang_timeout ends naming the ranks that stopped (86)
        run.train()  # the loop: forward, backward, step, metrics, eval, periodic and preemption saves
        run.finish()  # final eval, DeepSpeed checkpoint, Hugging Face export
        exit_code = 0
    except RunEnded as err:  # usage (2), failed save or preparation (1), non-finite stop (3), preempted (85)
        exit_code = report(err, dist)
        return exit_code
    except BaseException as err:  # a crash: its traceback still holds the loop's frames, and so the engine
        traceback.clear_frames(err.__traceback__.tb_next)  # (the lines stay printable); close() can free it
        raise
    finally:
        run.close(exit_code)  # metrics sinks (wandb marks a non-zero end failed) and the process group
    return run.publish()  # --push_to_hub: rank 0 uploads the export, no collective left to wait on


if __name__ == "__main__":
    exit_code = main()
    # Everything the run wrote is closed by now: spare the interpreter's last garbage collection of the objects
    # torch, transformers and DeepSpeed hold (1-2 s of CPU per process at every exit; the OS frees the memory).
    gc.freeze()
    sys.exit(exit_code)
