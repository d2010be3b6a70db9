"""Train a Hugging Face causal LM with DeepSpeed.

    deepspeed train.py --config ds_configs/zero3.json          # the built-in default: tiny Llama, sample data
    deepspeed --num_gpus 2 train.py --config ds_configs/zero2.json --model_name_or_path ... --train_file ...

The phases of a run, in order; each lives in its own module of scaletrain/.
"""

import sys

from scaletrain.config import UsageError
from scaletrain.distributed import read_launch_env
from scaletrain.logs import setup_logging


def main(argv=None) -> int:
    dist = read_launch_env()
    setup_logging(dist.rank)
    try:
        from scaletrain.run import Run

        run = Run.plan(argv, dist)  # flags, DeepSpeed JSON, model config, tokenizer: exit 2 on a mistake
    except UsageError as err:
        if dist.is_main:
            print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    if run.cfg.print_config:
        run.print_config()  # every "auto" filled, with where each value came from
        return 0
    try:
        run.prepare_data()  # token store: --data_path, or raw data tokenized once (no collective while waiting)
        run.init_distributed()  # process group for whichever launcher started us
        run.build_model()  # ZeRO-3: built sharded, never whole on one rank
        run.build_data()  # tokenize, pack, global order sharded by rank
        run.write_run_folder()  # resolved configs saved only after everything above succeeded
        run.build_engine()  # deepspeed.initialize with the resolved config and LR schedule
        run.train()  # the loop: forward, backward, step, metrics, eval, periodic saves
        run.finish()  # final eval, DeepSpeed checkpoint, Hugging Face export
    except UsageError as err:
        if dist.is_main:
            print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    finally:
        run.close()  # metrics sinks and the process group, on the error path too
    return 0


if __name__ == "__main__":
    sys.exit(main())
