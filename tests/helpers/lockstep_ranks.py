"""Two ranks of a ZeRO-3 engine that need different numbers of forwards: rank 0 runs three, rank 1 one, then each
joins scaletrain.harness's ForwardLockstep (tests/lm_eval/test_lm_eval.py). Without it rank 1 would leave while rank
0's second forward waits for its all-gathers forever. Writes <out>/rank<r>.json: the forwards each ran, the
stand-ins, and the logits of the first input (the same on both ranks).

    deepspeed --num_gpus 2 tests/helpers/lockstep_ranks.py OUT_DIR
"""

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from scaletrain.distributed import init_distributed, read_launch_env, teardown_distributed
    from scaletrain.harness.lockstep import ForwardLockstep

    dist = init_distributed(read_launch_env())
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    keep = HfDeepSpeedConfig(config)  # noqa: F841 (alive while the model is built: sharded)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(Path(__file__).parents[2] / "data/tiny-llama"))
    engine, *_ = deepspeed.initialize(model=model, config=config)
    module = engine.module.eval()
    lockstep = ForwardLockstep(module, torch.device("cpu"), idle_token=0)
    inputs = [torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10]]), torch.tensor([[11, 12, 13]])]
    mine = inputs if dist.rank == 0 else inputs[:1]
    with torch.no_grad():
        first = [module(input_ids=ids).logits for ids in mine][0]
    lockstep.join()
    lockstep.close()
    report = {"forwards": lockstep.forwards, "stand_ins": lockstep.stand_ins, "first": first[0, -1, :8].tolist()}
    (out / f"rank{dist.rank}.json").write_text(json.dumps(report))
    teardown_distributed(dist.rank)


if __name__ == "__main__":
    main(Path(sys.argv[-1]))
