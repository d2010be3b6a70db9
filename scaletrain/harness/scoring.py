"""One lm-eval evaluation of a model: lm-eval's simple_evaluate on an LM, the tasks built afresh, with the training
run left as it was (the module's train/eval mode, and every random generator lm-eval reseeds), then its results as
metrics, a JSON file and a line of the log."""

from __future__ import annotations

import io
import logging
import os
import random
import re
import sys
import time
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import HarnessArgs
from scaletrain.harness.results import flatten, summary, write_results, write_samples
from scaletrain.harness.tasks import HarnessTasks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scores:
    """One evaluation on rank 0: lm-eval's results, their flat metrics, the JSON file and the seconds it took."""

    results: dict
    metrics: dict
    path: Path | None
    seconds: float


@contextmanager
def training_untouched(module):
    """The module in eval mode for the evaluation, and afterwards the mode and random state it had (lm-eval reseeds
    Python's, NumPy's and torch's generators at every call: a run that evaluates must train as one that does not)."""
    import numpy as np
    import torch

    was_training = module.training
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    module.eval()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        module.train(was_training)


@contextmanager
def _environment(**values: str):
    """Environment variables lm-eval and tqdm read, set for the evaluation only."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _bars_only_where_watched(show: bool):
    """lm-eval opens progress bars whatever its disable_tqdm says (building requests, rolling windows): where nobody
    watches (a log file) they are dropped, and anything else written to stderr meanwhile is passed on."""
    if show:
        yield
        return
    captured = io.StringIO()
    try:
        with redirect_stderr(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines() if line.strip() and not _BAR.search(line)]
        if kept:
            print("\n".join(kept), file=sys.stderr)


_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\r")


def score(
    lm,
    *,
    tasks: HarnessTasks,
    args: HarnessArgs,
    out_dir: Path | None,
    name: str,
    step: int | None = None,
    show_bars: bool = False,
) -> Scores | None:
    """Evaluate `tasks` with `lm` on every rank (collectives), with --lm_eval_limit, --lm_eval_num_fewshot and
    --lm_eval_log_samples; rank 0 writes lm-eval's JSON to out_dir/lm_eval/`name`.json (and each task's samples
    beside it; out_dir None: nothing written) and gets the Scores, the other ranks None."""
    import lm_eval

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task INFO lines, on every rank
    started = time.perf_counter()
    # lm-eval's bootstrapped stderrs start a multiprocessing pool unless DISABLE_MULTIPROC is set: no forks of a
    # process that holds a process group and a GPU context.
    with training_untouched(lm.model), _environment(DISABLE_MULTIPROC="1"), _bars_only_where_watched(show_bars):
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks.specs),
            task_manager=tasks.manager,
            num_fewshot=args.lm_eval_num_fewshot,
            limit=args.lm_eval_limit,
            log_samples=args.lm_eval_log_samples,
        )
    seconds = time.perf_counter() - started
    if results is None:  # not rank 0: lm-eval gathered the metrics there
        return None
    samples = results.pop("samples", None)
    results["total_evaluation_time_seconds"] = str(seconds)  # as lm_eval's own command writes it
    metrics = flatten(results)
    path = write_results(out_dir, name, results) if out_dir is not None else None
    if samples and out_dir is not None:
        write_samples(out_dir, name, samples)
    log.info("%s", summary(metrics, step, seconds) + (f"; {path}" if path else ""))
    return Scores(results, metrics, path, seconds)
