"""Training: the trainer (the loop over optimizer steps, the only place that calls engine.backward / engine.step)
and the interface its side concerns implement as callbacks; the step, evaluation, the train state, the non-finite
guard, preemption, the hang watch, and the preference objective with its reference log-probs.

This face re-exports what other parts of scaletrain use; inside the wing, modules import each other by path.
"""

from scaletrain.train.callbacks import Callback, Order, StepOutcome
from scaletrain.train.evaluation import BenchmarkEvaluation, PeriodicEvaluation, evaluate_sets
from scaletrain.train.hang import (
    HANG_DIR,
    HANG_NOTE_ENV,
    REPORT_FILE,
    HangWatch,
    enable_flight_recorder,
    start_hang_watch,
)
from scaletrain.train.nonfinite import NonFiniteGuard, NonFinitePolicy
from scaletrain.train.observers import (
    CommsWindow,
    GoodputBook,
    HangNotes,
    PipelineBubble,
    ProgressBar,
    StepProfiler,
    TrainingRecords,
)
from scaletrain.train.preemption import (
    PREEMPTION_RECORD_ENV,
    RANK_PREEMPTION_SIGNAL,
    PreemptionFlag,
    record_preemption_saved,
)
from scaletrain.train.preference import PreferenceObjective, preference_objective
from scaletrain.train.reference import check_reference_model, prepare_reference, reference_identity
from scaletrain.train.settings import loop_settings
from scaletrain.train.state import TrainState, seed_everything
from scaletrain.train.calibration_probe import probe_applies, probe_for_calibration
from scaletrain.train.step import PipelineStep
from scaletrain.train.trainer import EngineStep, Trainer

__all__ = [
    "BenchmarkEvaluation",
    "Callback",
    "Order",
    "CommsWindow",
    "EngineStep",
    "GoodputBook",
    "HANG_DIR",
    "HANG_NOTE_ENV",
    "HangNotes",
    "PipelineBubble",
    "PreferenceObjective",
    "HangWatch",
    "NonFiniteGuard",
    "NonFinitePolicy",
    "PREEMPTION_RECORD_ENV",
    "PeriodicEvaluation",
    "PipelineStep",
    "PreemptionFlag",
    "ProgressBar",
    "RANK_PREEMPTION_SIGNAL",
    "REPORT_FILE",
    "StepOutcome",
    "StepProfiler",
    "Trainer",
    "TrainState",
    "TrainingRecords",
    "check_reference_model",
    "enable_flight_recorder",
    "evaluate_sets",
    "loop_settings",
    "probe_applies",
    "probe_for_calibration",
    "preference_objective",
    "prepare_reference",
    "record_preemption_saved",
    "reference_identity",
    "seed_everything",
    "start_hang_watch",
]
