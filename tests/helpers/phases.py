"""Test helpers' shared start: plan a run from argv and take it through training, as train.py does."""

from contextlib import contextmanager

from scaletrain.distributed.world import read_launch_env
from scaletrain.logs import setup_logging
from scaletrain.run import Lifetime, build_run, plan_run


@contextmanager
def trained_run(argv, finish: bool = True, before_train=None):
    """The built Run after train() (and finish(), unless finish=False); its lifetime closed on exit.
    before_train(engine) runs after the engine is built, before training. Like train.py, keep no reference to the
    run past the block: what it holds would outlive the process group."""
    dist = read_launch_env()
    setup_logging(dist.rank)
    plan = plan_run(argv, dist)
    lifetime = Lifetime()
    try:
        run = build_run(plan, lifetime=lifetime)
        if before_train:
            before_train(run.engine)
        run.train(finish=finish)
        yield run
    finally:
        run = None  # the caller's name for it is the last one
        lifetime.close(0)
