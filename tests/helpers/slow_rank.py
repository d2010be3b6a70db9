"""Test helper: train.py with one rank's forward slowed on purpose (a straggler).

    SCALETRAIN_TEST_SLOW_RANK="RANK:SECONDS" deepspeed tests/helpers/slow_rank.py <train.py flags>

sleeps SECONDS before each of RANK's micro-batch forwards (it wraps scaletrain.train.step.token_loss_sum, which the
step looks up at each call), as a slower GPU or a throttled node would.

    SCALETRAIN_TEST_SIGNAL_AT="RANK:STEP" deepspeed tests/helpers/slow_rank.py <train.py flags>

sends RANK a SIGUSR1 during the first forward of optimizer step STEP, as a scheduler's preemption arriving mid-step
(the ranks agree on it at that step's boundary); under pipeline parallelism, whose schedule does not call
token_loss_sum, as the step starts (it wraps PipelineStep.step). Without the variables it is plain train.py.
"""

import os
import signal
import sys
import time


SLOW_ENV = "SCALETRAIN_TEST_SLOW_RANK"
SIGNAL_ENV = "SCALETRAIN_TEST_SIGNAL_AT"


def main() -> int:
    import train
    from scaletrain.train import step
    from scaletrain.distributed.world import read_launch_env

    spec = os.environ.get(SLOW_ENV)
    if spec:
        rank, seconds = spec.split(":")
        if read_launch_env().rank == int(rank):
            forward = step.token_loss_sum

            def slow_forward(engine, batch):
                time.sleep(float(seconds))
                return forward(engine, batch)

            step.token_loss_sum = slow_forward
    spec = os.environ.get(SIGNAL_ENV)
    if spec:
        rank, at_step = map(int, spec.split(":"))
        if read_launch_env().rank == rank:
            forward_now, pipeline_step = step.token_loss_sum, step.PipelineStep.step
            signalled: list = []

            def signal_once(engine) -> None:
                if engine.global_steps == at_step - 1 and not signalled:
                    signalled.append(at_step)
                    os.kill(os.getpid(), signal.SIGUSR1)
                    # When it was sent, for scripts/bench/preemption.py's signal-to-exit time.
                    print(f"test helper: SIGUSR1 sent at {time.time():.3f}", file=sys.stderr, flush=True)

            def signalled_forward(engine, batch):
                signal_once(engine)
                return forward_now(engine, batch)

            def signalled_pipeline_step(self, engine, *args, **kwargs):
                signal_once(engine)
                return pipeline_step(self, engine, *args, **kwargs)

            step.token_loss_sum = signalled_forward
            step.PipelineStep.step = signalled_pipeline_step
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
