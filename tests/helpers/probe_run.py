"""Test helper: run the real pipeline phases (as train.py does), then save the trained engine's logits on a
fixed probe input, so a test can compare them with the exported Hugging Face model's logits.

Launched like train.py (deepspeed / torchrun / python) with train.py's flags.
"""

import sys
from pathlib import Path

import torch


from tests.helpers.phases import trained_run

from scaletrain.distributed.world import communication_threads

PROBE_FILE = "probe_logits.pt"


def probe_input(vocab_size: int) -> torch.Tensor:
    return (torch.arange(2 * 24).reshape(2, 24) * 37 + 5) % vocab_size


def main() -> None:
    with trained_run(sys.argv[1:]) as run:
        run.engine.eval()
        with torch.no_grad():
            probe = probe_input(run.resolved.model_config.vocab_size).to(run.engine.device)
            logits = run.engine(input_ids=probe).logits.float().cpu()
        if run.dist.is_main:
            torch.save({"input_ids": probe.cpu(), "logits": logits}, Path(run.cfg.run.output_dir) / PROBE_FILE)
        rank = run.dist.rank
        del run  # nothing of the run may outlive its close below
    # closed (the process groups freed, as train.py's main does): none of gloo's threads may be left for the
    # interpreter to tear down at exit (tests/e2e/test_pipeline.py reads this line, one per rank)
    print(f"probe: rank {rank}: {communication_threads()} communication threads after close", flush=True)


if __name__ == "__main__":
    main()
