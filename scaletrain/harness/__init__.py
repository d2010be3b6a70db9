"""Benchmark scores with EleutherAI's lm-evaluation-harness: the tasks looked up before training (tasks.py), the live
model as lm-eval's Hugging Face LM over the run's ranks (live_model.py, hflm.py, lockstep.py), one evaluation with the
run left untouched (scoring.py), and its results as metrics, JSON and a log line (results.py). lm-eval itself is
imported only where a run or scripts/evaluate.py asks for an evaluation.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.harness.live_scores import LiveScores
from scaletrain.harness.tasks import HarnessTasks, resolve_tasks

__all__ = ["HarnessTasks", "LiveScores", "resolve_tasks"]
