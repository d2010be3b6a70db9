"""Training: the loop (the only place that calls engine.backward / engine.step), the train state, the non-finite
policy, preemption and the hang watch.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.train.hang import HANG_DIR, HANG_NOTE_ENV, REPORT_FILE, enable_flight_recorder, start_hang_watch
from scaletrain.train.loop import LoopHooks, LoopSettings, PipelineStep, evaluate_sets, train_loop
from scaletrain.train.nonfinite import NonFiniteGuard, NonFinitePolicy
from scaletrain.train.preemption import PREEMPTION_RECORD_ENV, PreemptionFlag, RANK_PREEMPTION_SIGNAL
from scaletrain.train.state import TrainState, seed_everything

__all__ = [
    "HANG_DIR",
    "HANG_NOTE_ENV",
    "REPORT_FILE",
    "enable_flight_recorder",
    "start_hang_watch",
    "LoopHooks",
    "LoopSettings",
    "NonFiniteGuard",
    "NonFinitePolicy",
    "PREEMPTION_RECORD_ENV",
    "PipelineStep",
    "PreemptionFlag",
    "RANK_PREEMPTION_SIGNAL",
    "TrainState",
    "evaluate_sets",
    "seed_everything",
    "train_loop",
]
