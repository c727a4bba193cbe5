"""Reading studies: which trials rank, the best, the counts, and the replay records of real ones.

Every function takes Optuna studies or trials and reads them through `TrialRecord` and
`StudyMeta`; none writes.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import optuna

from tuner.errors import UserError
from tuner.measure import Measurement, config_key
from tuner.search.owners import gone
from tuner.search.records import (
    NOT_EVALUATED,
    NOT_MEASURED,
    Status,
    StudyMeta,
    TrialRecord,
    holds_kernel,
    is_telling,
    study_backend,
    trial_owner,
)
from tuner.search.storage import open_storage
from tuner.space import Shape, parse_shape


def open_study(name: str, storage, sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
    if isinstance(storage, str):
        storage = open_storage(storage)
    try:
        return optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                   sampler=sampler, load_if_exists=True)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - storage errors are input errors here
        raise UserError(f"cannot open study {name!r} in {storage!r}: {type(exc).__name__}: {exc}") from None


def existing_study(name: str, storage: optuna.storages.BaseStorage) -> optuna.Study | None:
    """The study if the storage holds it, else None; never creates one."""
    if name not in optuna.get_all_study_names(storage):
        return None
    return optuna.load_study(study_name=name, storage=storage)


def _listed(storage: str, read_only: bool = False) -> tuple[optuna.storages.BaseStorage, list]:
    """An existing storage and its studies' names and attributes, no trials (get_all_study_summaries
    would read every study's trials first; a grid storage holds a thousand studies)."""
    backing = open_storage(storage, create=False, read_only=read_only)
    try:
        return backing, backing.get_all_studies()
    except Exception as exc:  # noqa: BLE001 - bad URL, missing file, wrong schema: all user errors
        raise UserError(f"cannot open storage {storage!r}: {type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0]}") from None


def load_studies(storage: str, names: list[str] | None = None, read_only: bool = False) -> list[optuna.Study]:
    """Existing studies only: a missing storage file or study is a UserError, never created.
    read_only (commands that only read): the storage is opened so that nothing can write it."""
    backing, summaries = _listed(storage, read_only)
    available = [s.study_name for s in summaries]
    chosen = names or available
    missing = sorted(set(chosen) - set(available))
    if missing:
        raise UserError(f"storage {storage} has no study {missing[0]!r}; studies: {', '.join(available) or 'none'}")
    return [optuna.load_study(study_name=n, storage=backing) for n in chosen]


def nearest_studies(storage: str, shape: Shape, k: int) -> list[optuna.Study]:
    """The `k` studies of other shapes nearest to `shape` (Shape.distance), in the order
    `sampler.nearest_picks` would rank them, found from the study list's attributes instead of a
    load per study (a sweep asks this for every shape). A missing storage is a UserError."""
    backing, summaries = _listed(storage)
    scored = []
    for s in summaries:
        text = s.user_attrs.get("shape")
        if not isinstance(text, str) or text == str(shape):
            continue  # not a study of ours, or this shape's own
        try:
            scored.append((parse_shape(text).distance(shape), s.study_name))
        except UserError:
            continue
    return [optuna.load_study(study_name=n, storage=backing) for _, n in sorted(scored, key=lambda x: x[0])[:k]]


def gpu_model(backend_name: str | None) -> str | None:
    """The GPU model a measurement ran on, from a backend name ('gpu:NVIDIA H200#1' -> 'NVIDIA H200');
    None for replayed or unknown measurements."""
    if not backend_name or not backend_name.startswith("gpu:"):
        return None
    return backend_name[len("gpu:"):].split("#")[0]


def current_ok(trials: Iterable[optuna.trial.FrozenTrial], gpu: str | None = None,
               screened: bool = False) -> list[optuna.trial.FrozenTrial]:
    """The verified trials whose time still describes their kernel's code. A resumed study measures
    a config again when the template now renders other code for it (`tune`); the older trial of
    that config keeps its old time, so it must not rank: where the same kernel (family and stored
    config) has trials with different source hashes, only those with the latest one count.
    With `gpu` (a model, `gpu_model`): only the trials measured on that model, where there are any.
    Picks do not carry between cards (an H100 study's best ran 5% behind on an H200, and an H200
    study's 8% behind on an H100: docs/decisions), so times from two models must not be ranked together.
    screened: the verified trials a batch's screen left behind (Status.SCREENED) count too. Optuna
    gives such a PRUNED trial its screen time as `value`: never rank them by it beside full times
    (rank.order_time says which time a trial ranks by)."""
    finished = []
    for t in trials:
        if t.state.is_finished() and holds_kernel(t):
            rec = TrialRecord.of(t)
            finished.append((t, rec, config_key(rec.family, rec.kernel)))
    latest: dict[str, tuple[Any, str]] = {}  # kernel -> (when, source hash) of its latest trial
    for t, rec, key in finished:
        when = t.datetime_complete or t.datetime_start
        if rec.source_hash and when and (key not in latest or when > latest[key][0]):
            latest[key] = (when, rec.source_hash)
    ok = [t for t, rec, key in finished
          if ((t.state == optuna.trial.TrialState.COMPLETE and rec.status == Status.OK)
              or (screened and rec.status == Status.SCREENED))
          and (not rec.source_hash or key not in latest or latest[key][1] == rec.source_hash)]
    here = [t for t in ok if gpu and gpu_model(TrialRecord.of(t).gpu) == gpu]
    return here or ok


def study_gpu(study: optuna.Study) -> str | None:
    """The GPU model the study last ran on: its trials measured there rank (`current_ok`)."""
    return gpu_model(study_backend(study))


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    done = current_ok(study.get_trials(deepcopy=False), study_gpu(study))
    return min(done, key=lambda t: t.value) if done else None


def best_per_family(study: optuna.Study) -> dict[str, optuna.trial.FrozenTrial]:
    out: dict[str, optuna.trial.FrozenTrial] = {}
    for t in current_ok(study.get_trials(deepcopy=False), study_gpu(study)):
        fam = TrialRecord.of(t).family
        if fam not in out or t.value < out[fam].value:
            out[fam] = t
    return out


def ranked_per_family(study: optuna.Study, top: int) -> dict[str, list[optuna.trial.FrozenTrial]]:
    """Per family, its `top` fastest current trials of distinct compile configs, fastest first
    (a config measured twice counts once, at its best)."""
    out: dict[str, list[optuna.trial.FrozenTrial]] = {}
    seen: set[str] = set()
    for t in sorted(current_ok(study.get_trials(deepcopy=False), study_gpu(study)), key=lambda t: t.value):
        rec = TrialRecord.of(t)
        key = config_key(rec.family, rec.config)
        if key in seen or len(out.get(rec.family, [])) >= top:
            continue
        seen.add(key)
        out.setdefault(rec.family, []).append(t)
    return out


def current_best(study: optuna.Study, gpu: str | None) -> tuple[float | None, float | None]:
    """(time in us, TFLOP/s) of the study's best trial that still describes its code on this GPU
    model (`current_ok`)."""
    ok = current_ok(study.get_trials(deepcopy=False), gpu)
    if not ok:
        return None, None
    best = min(ok, key=lambda t: t.value)
    return best.value, TrialRecord.of(best).tflops


def _finished_records(study: optuna.Study) -> list[TrialRecord]:
    return [TrialRecord.of(t) for t in study.get_trials(deepcopy=False) if t.state.is_finished()]


def evaluated_trials(study: optuna.Study) -> int:
    """Trials that count toward --trials: everything evaluated, not configs rejected before nvcc."""
    return sum(1 for r in _finished_records(study) if r.status not in NOT_EVALUATED)


def slot_claims(study: optuna.Study, exclude: int) -> tuple[int, int]:
    """(evaluated trials, running trials of live workers other than `exclude` that claim a slot
    to be told in): one read of the study, for Search.claim_slot."""
    evaluated = claims = 0
    for t in study.get_trials(deepcopy=False):
        if t.state.is_finished():
            evaluated += TrialRecord.of(t).status not in NOT_EVALUATED
        elif t.number != exclude and is_telling(t) and not gone(trial_owner(t)):
            claims += 1
    return evaluated, claims


def measured_trials(study: optuna.Study) -> int:
    """Evaluated trials with a measurement (not a replay file's not-recorded configs): what reports count."""
    return sum(1 for r in _finished_records(study) if r.status not in NOT_MEASURED)


def study_stats(study: optuna.Study) -> dict[str, Any]:
    rows = _finished_records(study)
    measured = [r for r in rows if r.status not in NOT_MEASURED]
    cold = [r.compile_s for r in measured if r.compile_s and not r.cached]
    failures: dict[str, int] = {}
    for r in measured:
        if r.status not in (Status.OK, Status.SCREENED):
            kind = r.kind or str(r.status)
            failures[kind] = failures.get(kind, 0) + 1
    cublas = [r.cublas_us for r in measured if r.cublas_us]
    trials = study.get_trials(deepcopy=False)
    count = lambda status: sum(1 for r in rows if r.status == status)  # noqa: E731
    return {
        "trials": len(measured), "ok": count(Status.OK), "screened": count(Status.SCREENED),
        "invalid_rejected": count(Status.INVALID),
        "duplicates": count(Status.DUPLICATE), "surplus": count(Status.SURPLUS),
        "not_recorded": count(Status.NOT_RECORDED), "failures": failures,
        "compile_s_cold_median": statistics.median(cold) if cold else None,
        "compile_cached": sum(1 for r in measured if r.cached),
        "cublas_us_median": statistics.median(cublas) if cublas else None,
        # verified trials that current_ok leaves out for the GPU model of the study's last run
        "other_gpu": len(current_ok(trials)) - len(current_ok(trials, study_gpu(study))),
    }


def replay_records(study: optuna.Study) -> list[dict]:
    """Replay records (and one baseline per shape) from the real trials of a study: the lines
    `hgemm-tune record` writes for `--backend replay`."""
    skip = (*NOT_MEASURED, Status.COMPILE_ERROR)  # nothing was measured on a GPU
    meta = StudyMeta.of(study)
    tag = {} if meta.accumulate == "fp32" else {"accumulate": meta.accumulate}
    out: list[dict] = []
    cublas = []
    for t in study.get_trials(deepcopy=False):
        r = TrialRecord.of(t)
        if not t.state.is_finished() or r.simulated or r.status in skip:
            continue
        m = Measurement(status=str(r.status), kind=r.kind, reason=r.reason, times_us=r.variant_times_us,
                        baselines_us={"cublas": r.cublas_us} if r.cublas_us else {},
                        verify=r.verify, gpu=r.gpu, gpu_state=r.gpu_state, clocks=r.clocks)
        out.append({"shape": meta.shape, "family": r.family, "config": r.config, "measurement": m.to_dict(), **tag})
        if r.cublas_us:
            cublas.append(r.cublas_us)
    if cublas:
        cublas.sort()
        out.insert(0, {"type": "baseline", "shape": meta.shape, "baselines_us": {"cublas": cublas[len(cublas) // 2]},
                       **tag})
    return out
