"""Baseline for scripts/bench/overhead.py: the smallest correct DeepSpeed training loop.

Same model config, same packed blocks, same resolved DeepSpeed JSON (read from the pipeline's run folder) and
same batch as train.py, with nothing else: no metrics, no progress bar, no loss normalisation across ranks.
Prints one JSON line from rank 0 with the wall-clock time at each step.

    deepspeed --num_gpus 2 scripts/bench/minimal_ds_loop.py <pipeline_run_dir> <steps>
"""

import json
import sys
import time
from pathlib import Path

import deepspeed
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from scaletrain.config.cli import parse_run_config
from scaletrain.data.blocks import blocks_from_store
from scaletrain.data.preparation import ensure_token_store
from scaletrain.data.token_store import open_store


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    run_dir, steps = Path(args[0]), int(args[1])
    run_config = json.loads((run_dir / "run_config.json").read_text())
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(run_config["seed"])

    cfg = parse_run_config(
        [
            "--config",
            run_config["config"],
            "--config_name",
            run_config["config_name"],
            "--output_dir",
            str(run_dir / "minimal"),
            "--validation_split_percentage",
            "0",
        ]
    )
    tokenizer = AutoTokenizer.from_pretrained(run_config["config_name"])
    # The same token store the pipeline run prepared (found by its fingerprint, so nothing is re-tokenized).
    store = ensure_token_store(cfg.data, tokenizer, run_config["config_name"], run_config["block_size"], 1, False)
    blocks = blocks_from_store(open_store(store), "train", run_config["block_size"], False)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run_config["config_name"]))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    micro, gas = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    order = np.random.default_rng(run_config["seed"]).permutation(len(blocks))
    times = []
    cursor = rank * micro
    for _ in range(steps):
        for _ in range(gas):
            idx = order[np.arange(cursor, cursor + micro) % len(order)]
            cursor += micro * world
            ids = blocks.batch(idx)["input_ids"]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        times.append(time.time())
    if rank == 0:
        tokens_per_step = micro * gas * world * run_config["block_size"]
        print("MINIMAL " + json.dumps({"times": times, "tokens_per_step": tokens_per_step}), flush=True)


if __name__ == "__main__":
    main()
