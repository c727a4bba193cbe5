"""The tell side: a measured (or rejected) trial's record and value into the study."""

from __future__ import annotations

import contextlib
import datetime as dt
import os

import optuna

from tuner.search.owners import gone
from tuner.search.records import Status, TrialRecord, mark_trial, trial_owner
from tuner.search.storage import requeue_failed


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
        elif rec.status == Status.SCREENED:
            # PRUNED with its screen time as the intermediate value: TPE ranks pruned trials by
            # their last reported value, so a near miss counts as nearer than a far one.
            screen = (rec.regime_report or {}).get("screen_us") or {}
            if screen:
                trial.report(min(screen.values()), step=0)
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
    elif prev.state == optuna.trial.TrialState.PRUNED:  # a repeat of an invalid or a screened-out one
        if prev.value is not None:  # screened out: its screen time, as the original reported it
            trial.report(prev.value, step=0)
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


# A running trial with neither an owner nor params is one whose process died between asking it
# and recording itself (or a live process in those milliseconds): failed once it is this old.
OWNERLESS_GRACE_S = float(os.environ.get("HGEMM_TUNE_OWNERLESS_GRACE_S", "10"))


def _orphaned(t: optuna.trial.FrozenTrial) -> bool:
    owner = trial_owner(t)
    if owner is not None:
        return gone(owner)
    if t.params or t.datetime_start is None:  # a trial of an older version of the tool: the heartbeat's
        return False
    return (dt.datetime.now() - t.datetime_start).total_seconds() > OWNERLESS_GRACE_S


def fail_orphans(study: optuna.Study) -> list[int]:
    """Fail the running trials whose owner process is gone from this host (killed with SIGKILL,
    or the machine rebooted) as "interrupted", and queue their configs again: they are measured
    next. Works on every storage (the journal has no heartbeats; an RDB heartbeat would wait out
    its grace period). Returns the ids of the re-queued (WAITING) trials, which the caller asks
    before anything else queued (`Search.ask`). A trial another process fails first is left to
    it, so a config is re-queued once."""
    requeued = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if not _orphaned(t):
            continue
        owner = trial_owner(t) or {}
        try:
            mark_trial(optuna.Trial(study, t._trial_id), Status.INTERRUPTED,
                       f"its worker (pid {owner.get('pid', '?')} on {owner.get('host', '?')}) died before "
                       "telling it; re-queued")
            if not study._storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another process failed (or its owner told) it first
        new = requeue_failed(study, study._storage.get_trial(t._trial_id))
        if new is not None:
            requeued.append(new)
    return requeued
