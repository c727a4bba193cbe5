"""The tell side: a measured (or rejected) trial's record and value into the study."""

from __future__ import annotations

import contextlib

import optuna

from tuner.search.records import Status, TrialRecord, mark_trial


def tell(study: optuna.Study, trial: optuna.Trial, rec: TrialRecord) -> bool:
    """Store the record and the value; False if another worker finished this trial first
    (SQLite cannot lock rows, so two processes may pop the same enqueued trial)."""
    rec.validate()
    told = False
    try:
        rec.write(trial)
        if rec.status == Status.OK and rec.time_us is not None:
            study.tell(trial, rec.time_us)
        elif rec.status == Status.INVALID:
            # PRUNED, not FAIL: TPE ignores failed trials but ranks pruned ones among the
            # bad, so it learns the shape of the constraints instead of re-proposing them.
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        told = True
    except optuna.exceptions.UpdateFinishedTrialError:
        told = True
        return False
    finally:
        if not told:  # interrupted (or a storage error) between the attributes and the tell
            with contextlib.suppress(Exception):  # the original error is the one to see
                fail_held(study, trial, Status.INTERRUPTED, "interrupted while its result was stored")
    return True


def tell_duplicate(study: optuna.Study, trial: optuna.Trial, prev: optuna.trial.FrozenTrial) -> None:
    """A config that `prev` measured, rejected or is measuring: its value (or state) again,
    never a second compile or timing."""
    mark_trial(trial, Status.DUPLICATE, duplicate_of=prev.number)
    if prev.state == optuna.trial.TrialState.COMPLETE:
        study.tell(trial, prev.value)
    elif prev.state == optuna.trial.TrialState.PRUNED:  # a repeat of an invalid one
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def fail_held(study: optuna.Study, trial: optuna.Trial, status: Status, reason: str | None = None) -> None:
    """Tell a trial this process holds as FAIL, unmeasured (`status`: interrupted, surplus). One that
    is finished already (told before the interrupt, or by another worker) is left as it is."""
    with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
        mark_trial(trial, status, reason)
    with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
        study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
