"""Studies -> plain records -> JSON: the best configuration per (gpu, shape, layout, accumulate)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import optuna

from tuner.measure.regimes import combine_reports
from tuner.results.schema import SCHEMA_VERSION
from tuner.search import StudyMeta, TrialRecord, best_trial, confirmation
from tuner.search.confirm import VENDORS
from tuner.version import __version__


def entry(study: optuna.Study, trial: optuna.trial.FrozenTrial, confirmed: dict | None = None) -> dict[str, Any]:
    """The export entry of one trial; `confirmed` (tuner.search.confirmation) replaces its
    in-study time and cuBLAS time with the medians of the confirmation runs, and its clock
    record with those runs' records together. `clocks` is the clock regime the time was
    measured in (tuner.measure.clocks), `{"available": false, "reason": ...}` where unknown.
    `objective` is the timing regime time_us was taken in (the study's, tuner.measure.regimes)
    and `steady_state` how that timing went (steady, after how many rounds; unknown: null)."""
    meta = StudyMeta.of(study)
    shape, target = meta.shape_record, meta.target_record
    a = TrialRecord.of(trial)
    assert a.time_us is not None, f"trial {trial.number} has no time"
    time_us, baselines, speedups = a.time_us, {"cublas": a.cublas_us}, {"cublas": a.speedup_cublas}
    clocks: dict[str, Any] = a.clocks or {"available": False, "reason": "no clock record (measured before "
                                                                      "clocks were recorded, or without NVML)"}
    steady = combine_reports([a.regime_report], meta.objective)
    extra: dict[str, Any] = {}
    if confirmed is not None:
        extra["confirm"] = {k: confirmed[k] for k in ("runs", "top", "verified", "reason", "in_study_us", "times_us")}
        if confirmed["median_us"] is not None:
            time_us = confirmed["median_us"]
            baselines = {v: confirmed[f"{v}_us"] for v in VENDORS}
            speedups = {v: confirmed[f"speedup_{v}"] for v in VENDORS}
            clocks = confirmed.get("clocks") or clocks
            steady = confirmed.get("steady_state") or steady
        else:  # failed re-verification: never the pick
            speedups = {"cublas": None}
    roof = target.roofline_us(shape.flops, shape.min_bytes)
    return {
        "gpu": target.name, "arch": target.arch, "shape": str(shape), "M": shape.M, "N": shape.N, "K": shape.K,
        "layout": "TN", "accumulate": meta.accumulate,
        "family": a.family, "template_hash": meta.template_hashes.get(a.family),
        "knobs": a.kernel, "source_hash": a.source_hash or None,
        "time_us": time_us, "tflops": shape.tflops(time_us), "roofline_fraction": roof / time_us,
        "baselines_us": baselines, "speedup": speedups,
        "beats_vendor": bool(speedups["cublas"] and speedups["cublas"] > 1.0),
        "pick": a.family if (speedups["cublas"] or 0) > 1.0 else "cublas",
        "verification": a.verify, "simulated": bool(a.simulated), "clocks": clocks,
        "objective": meta.objective, "steady_state": _steady_state(steady),
        "study": study.study_name, "trial": trial.number, "measured_on": a.gpu or None,
    } | extra


def _steady_state(report: dict[str, Any]) -> dict[str, Any]:
    """The export's summary of a regime report: whether the timing settled, and how."""
    keys = ("steady", "steady_after", "rounds", "warmup_rounds", "window", "tol", "runs", "steady_runs")
    return {k: report.get(k) for k in keys}


def exported_trial(study: optuna.Study) -> tuple[optuna.trial.FrozenTrial | None, dict | None]:
    """The trial export takes and its confirmation record: the confirmed winner while the
    study's confirmation holds, else the in-study best (and None)."""
    best = best_trial(study)
    confirmed = confirmation(study, best)
    if confirmed is None:
        return best, None
    return study.get_trials(deepcopy=False)[confirmed["trial"]], confirmed


def export_studies(studies: list[optuna.Study]) -> dict[str, Any]:
    entries = []
    for study in studies:
        trial, confirmed = exported_trial(study)
        if trial is not None:
            entries.append(entry(study, trial, confirmed))
    return {
        "schema_version": SCHEMA_VERSION, "tool": "hgemm-tune", "tool_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "simulated": any(e["simulated"] for e in entries), "entries": entries,
    }
