"""Test helpers' shared start: plan a run from argv and take it through training, as train.py does."""

from contextlib import contextmanager


from scaletrain.distributed.world import read_launch_env
from scaletrain.logs import setup_logging
from scaletrain.run import Run


@contextmanager
def trained_run(argv, finish: bool = True, before_train=None):
    """The Run after train() (and finish(), unless finish=False); closed on exit. before_train(engine) runs
    after the engine is built, before training."""
    dist = read_launch_env()
    setup_logging(dist.rank)
    run = Run.from_flags(argv, dist)
    try:
        run.init_distributed()
        run.prepare_inputs()
        run.build_model()
        run.build_data()
        run.write_run_folder()
        run.build_engine()
        run.resume()
        if before_train:
            before_train(run.engine)
        run.train()
        if finish:
            run.finish()
        yield run
    finally:
        run.close()
