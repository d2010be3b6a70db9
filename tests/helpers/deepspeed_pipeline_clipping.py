"""Test helper: train.py with DeepSpeed's own ZeRO-0 pipeline clipping, scaletrain's fix left out.

    deepspeed tests/helpers/deepspeed_pipeline_clipping.py <train.py flags>

ds_internals.fix_pipeline_stage0_clipping becomes a no-op, so the engine clips as DeepSpeed 0.19.8 does
under pipeline parallelism with ZeRO-0 (every stage by stage 0's gradient norm). The test that runs it proves the
fix is still needed: once an upgrade fixes DeepSpeed, this run matches the reference and that test fails.
"""

import sys


def main() -> int:
    import train
    from scaletrain.engine import ds_internals

    ds_internals.fix_pipeline_stage0_clipping = lambda engine: None
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
