"""Training: the loop (the only place that calls engine.backward / engine.step), the train state, the non-finite
policy, preemption, the hang watch, and the preference objective with its reference log-probs.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.train.hang import HANG_DIR, HANG_NOTE_ENV, REPORT_FILE, enable_flight_recorder, start_hang_watch
from scaletrain.train.loop import PipelineStep, evaluate_sets, train_loop
from scaletrain.train.settings import LoopHooks, loop_settings
from scaletrain.train.nonfinite import NonFiniteGuard, NonFinitePolicy
from scaletrain.train.preference import preference_objective
from scaletrain.train.reference import check_reference_model, prepare_reference
from scaletrain.train.preemption import PREEMPTION_RECORD_ENV, PreemptionFlag, RANK_PREEMPTION_SIGNAL
from scaletrain.train.state import TrainState, seed_everything

__all__ = [
    "HANG_DIR",
    "HANG_NOTE_ENV",
    "REPORT_FILE",
    "enable_flight_recorder",
    "start_hang_watch",
    "LoopHooks",
    "NonFiniteGuard",
    "NonFinitePolicy",
    "PREEMPTION_RECORD_ENV",
    "PipelineStep",
    "PreemptionFlag",
    "RANK_PREEMPTION_SIGNAL",
    "TrainState",
    "check_reference_model",
    "evaluate_sets",
    "loop_settings",
    "preference_objective",
    "prepare_reference",
    "seed_everything",
    "train_loop",
]
