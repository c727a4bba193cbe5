"""Search: Optuna ask/tell over the compile-time knobs, one study per shape, and confirmation.

records (what a trial and a study hold) < storage < studies (queries) < sampler (ask) <
compile_queue (build) < tell < loop (Search: ask_batch, measure_next, tell) < confirm < workers.
"""

from tuner.search.confirm import confirm, confirmable, confirmation, distinct_best
from tuner.search.interrupts import INTERRUPTS
from tuner.search.loop import Progress, Search, tune
from tuner.search.records import NOT_EVALUATED, NOT_MEASURED, Status, StudyMeta, TrialRecord
from tuner.search.sampler import SAMPLERS, check_accumulate, check_objective, nearest_winners, study_name
from tuner.search.storage import open_storage
from tuner.search.studies import (
    best_per_family,
    best_trial,
    current_ok,
    evaluated_trials,
    existing_study,
    gpu_model,
    load_studies,
    measured_trials,
    open_study,
    study_stats,
)

__all__ = [
    "INTERRUPTS", "NOT_EVALUATED", "NOT_MEASURED", "SAMPLERS", "Progress", "Search", "Status", "StudyMeta",
    "TrialRecord", "best_per_family", "best_trial", "check_accumulate", "check_objective", "confirm", "confirmable",
    "confirmation", "current_ok", "distinct_best", "evaluated_trials", "existing_study", "gpu_model", "load_studies",
    "measured_trials", "nearest_winners", "open_storage", "open_study", "study_name", "study_stats", "tune",
]
