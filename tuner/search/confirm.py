"""Confirm: re-time a study's K best kernels in fresh runs and keep the fastest by median.

One pipeline stage between search and export. A trial's time is one measurement, and
near-equal configs swap places from run to run by a few percent (on the H200, 1-4% at
15-40 us: docs/decisions), so the in-study best is partly luck. Confirm takes the K
fastest distinct verified kernels of the study and, in R runs, each in a fresh GPU worker
(new CUDA context, new buffers), verifies them again and times them with cuBLAS and
cuBLASLt, interleaved (`backend.compare`). The winner is the kernel with the lowest median
time among those that passed verification in every run. The result is plain data, stored
on the study as its `confirm` user attribute; export takes the winner and its medians from
there while the confirmation still holds (`confirmation`).
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
from collections.abc import Callable, Iterable
from typing import Any

import optuna

from tuner.build import RenderError, render
from tuner.errors import UserError
from tuner.measure import CandidateSpec, CompareReply, candidate_spec
from tuner.measure.clocks import combine
from tuner.measure.regimes import SUSTAINED, combine_reports
from tuner.search.records import StudyMeta, TrialRecord, confirm_record, store_confirm_record
from tuner.search.studies import current_ok, gpu_model

VENDORS = ("cublas", "cublaslt", "cublaslt_auto")


class PairedRuns:
    """One contender's times over several runs, beside each run's vendor times: medians over
    the runs, and ratios paired within each run (None where a run had no time)."""

    def __init__(self, times: list | None = None, vendors: list | None = None):
        self.times = times if times is not None else []      # ours, one per run
        self.vendors = vendors if vendors is not None else []  # {vendor: us}, one per run

    def median(self, vendor: str | None = None) -> float | None:
        ts = [t for t in self.times if t] if vendor is None else [v.get(vendor) for v in self.vendors if v.get(vendor)]
        return statistics.median(ts) if ts else None

    def ratios(self, vendor: str) -> list[float]:
        return [v[vendor] / t for t, v in zip(self.times, self.vendors, strict=True) if t and v.get(vendor)]


def distinct_best(trials: Iterable[optuna.trial.FrozenTrial], k: int,
                  complete: Callable[[optuna.trial.FrozenTrial], dict] | None = None,
                  gpu: str | None = None) -> list:
    """The k fastest verified trials (`current_ok`, on GPU model `gpu` where it has any), one per
    distinct kernel (family, compile and run-time knobs). `complete` fills in knobs added since older
    studies were stored, so that the same kernel stored with and without a since-added default counts once."""
    ok = current_ok(trials, gpu)
    seen, out = set(), []
    for t in sorted(ok, key=lambda t: t.value):
        key = TrialRecord.of(t).family + json.dumps(complete(t) if complete else TrialRecord.of(t).kernel,
                                                    sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out[:k]


def _full_config(space, t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    rec = TrialRecord.of(t)
    return space.family(rec.family).complete_stored(rec.kernel)


def build_candidates(space, trials: list, shape, target, pool) -> tuple[dict[str, CandidateSpec], dict[str, str]]:
    """Render and compile each trial's kernel with today's templates: ({'#N': candidate}, {'#N': why not})
    where N is the trial number and a candidate is what `backend.compare` takes."""
    futures, failed = {}, {}
    for t in trials:
        name = f"#{t.number}"
        try:
            fam = space.family(TrialRecord.of(t).family)
            config = _full_config(space, t)
            why = fam.violations(config, shape, target)
            if why:
                raise UserError(f"no longer valid: {'; '.join(why)}")
            futures[name] = (fam, config, pool.submit(render(fam, config, target.arch), target.arch, fam.artifact))
        except (UserError, RenderError) as exc:
            failed[name] = str(exc)
    candidates = {}
    for name, (fam, config, future) in futures.items():
        res = future.result()
        if not res.ok:
            failed[name] = "does not compile: " + " ".join((res.error or "").strip().splitlines()[:2])
            continue
        candidates[name] = candidate_spec(fam, config, shape, target, res.cubin, res.digest)
    return candidates, failed


def summarize(trials: list, runs: list[CompareReply], failed: dict[str, str], gpu: str,
              objective: str = SUSTAINED) -> dict[str, Any]:
    """Compare replies (one per run) -> the confirmation record: per kernel its run times in the
    `objective` regime and medians, and the winner (lowest median among those verified and
    timed in every run)."""
    kernels = []
    for t in trials:
        name = f"#{t.number}"
        k: dict[str, Any] = {"trial": t.number, "family": TrialRecord.of(t).family, "in_study_us": t.value,
                             "times_us": [], "vendors_us": [], "verified": name not in failed,
                             "reason": failed.get(name)}
        for reply in runs:
            if not reply.ok:
                k["verified"], k["reason"] = False, k["reason"] or f"run failed: {reply.reason}"
                continue
            verdict = reply.verify.get(name, {"ok": False, "reason": "not measured"})
            if not verdict["ok"]:
                k["verified"], k["reason"] = False, k["reason"] or verdict.get("reason")
            times = reply.times_in(objective)
            k["times_us"].append(times.get(name) if verdict["ok"] else None)
            k["vendors_us"].append({v: times.get(v) for v in VENDORS})
        timed = k["verified"] and bool(runs) and all(k["times_us"])
        paired = PairedRuns(k["times_us"], k["vendors_us"])
        k["median_us"] = paired.median() if timed else None
        for v in VENDORS:
            k[f"{v}_us"] = paired.median(v)
            ratios = paired.ratios(v)
            k[f"speedup_{v}"] = statistics.median(ratios) if timed and ratios else None
        kernels.append(k)
    timed = [k for k in kernels if k["median_us"] is not None]
    winner = min(timed, key=lambda k: (k["median_us"], k["in_study_us"])) if timed else None
    return {"runs": len(runs), "top": len(trials), "gpu": gpu, "kernels": kernels,
            "winner": winner["trial"] if winner else None, "objective": objective,
            # each run's clock record of the objective's timing ({} from a failed run or an older worker)
            "clocks": [reply.clocks_in(objective) if reply.ok else {} for reply in runs],
            # and how that timing went (steady state, energy per contender)
            "regimes": [reply.regime_in(objective).to_dict() if reply.ok else {} for reply in runs],
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def confirmable(study: optuna.Study, backend) -> bool:
    """Whether confirming means anything here: real measurements (not replayed), and fp32
    accumulation (the vendors are timed with it only; see GpuBackend.compare)."""
    return not backend.simulated and StudyMeta.of(study).accumulate == "fp32"


def confirm(space, study: optuna.Study, backend, pool, *, top: int = 3, runs: int = 3,
            on_run: Callable[[int, CompareReply], None] | None = None) -> dict[str, Any] | None:
    """Re-time the study's `top` best kernels in `runs` fresh worker runs; store and return the
    record (None when there is nothing to confirm: no verified trial, or not `confirmable`)."""
    if top < 1 or runs < 1 or not confirmable(study, backend):
        return None

    def complete(t):
        try:
            return _full_config(space, t)
        except UserError:  # a family the space no longer has: compared as stored
            return TrialRecord.of(t).kernel

    trials = distinct_best(study.get_trials(deepcopy=False), top, complete, gpu_model(getattr(backend, "name", None)))
    if not trials:
        return None
    meta = StudyMeta.of(study)
    shape = meta.shape_record
    candidates, failed = build_candidates(space, trials, shape, backend.target, pool)
    replies = []
    for i in range(runs if candidates else 0):
        backend.restart()  # every run in a fresh worker: one allocation's luck is not every run's
        # in the regime the study minimized: its ranking is confirmed, not another regime's
        reply = backend.compare(shape, candidates, torch=False, modes=[meta.objective])
        replies.append(reply)
        if on_run:
            on_run(i, reply)
    record = summarize(trials, replies, failed, backend.name, meta.objective)
    store_confirm_record(study, record)
    return record


def confirmation(study: optuna.Study, in_study_best: optuna.trial.FrozenTrial | None) -> dict | None:
    """The kernel record export should use, while the study's confirmation holds (it included
    the study's current best; a study resumed past it is confirmed again by the next `tune`,
    and until then its in-study best is exported as measured in the study): the winner's, or,
    when no kernel passed every run, the in-study best's, which says why it failed."""
    record = confirm_record(study)
    if not record or in_study_best is None:
        return None
    kernels = {k["trial"]: k for k in record["kernels"]}
    if in_study_best.number not in kernels:
        return None
    chosen = kernels[record["winner"]] if record.get("winner") is not None else kernels[in_study_best.number]
    # The runs' clock regimes together ("unknown" for a record stored before they were kept).
    clocks = combine(record["clocks"]) if "clocks" in record else {
        "available": False, "reason": "confirmed before clock records were kept"}
    objective = record.get("objective", SUSTAINED)
    steady = combine_reports(record["regimes"], objective) if "regimes" in record else None
    return chosen | {"runs": record["runs"], "top": record["top"], "clocks": clocks, "steady_state": steady}
