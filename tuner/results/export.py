"""Studies -> plain records -> JSON: the best configuration per (gpu, shape, layout, accumulate)."""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import optuna

import tuner
from tuner.errors import UserError
from tuner.search import NOT_MEASURED, current_ok, gpu_model
from tuner.shapes import parse_shape
from tuner.target import Target

SCHEMA_VERSION = 1


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """One plain dict per finished trial (user attributes + number + state)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if not t.state.is_finished():
            continue
        row = dict(t.user_attrs)
        row.update(number=t.number, state=t.state.name, value=t.value)
        rows.append(row)
    return rows


def study_gpu(study: optuna.Study) -> str | None:
    """The GPU model the study last ran on: its trials measured there rank (`current_ok`)."""
    return gpu_model(study.user_attrs.get("backend"))


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    done = current_ok(study.get_trials(deepcopy=False), study_gpu(study))
    return min(done, key=lambda t: t.value) if done else None


def best_per_family(study: optuna.Study) -> dict[str, optuna.trial.FrozenTrial]:
    out: dict[str, optuna.trial.FrozenTrial] = {}
    for t in current_ok(study.get_trials(deepcopy=False), study_gpu(study)):
        fam = t.user_attrs["family"]
        if fam not in out or t.value < out[fam].value:
            out[fam] = t
    return out


def study_stats(study: optuna.Study) -> dict[str, Any]:
    rows = trial_rows(study)
    measured = [r for r in rows if r.get("status") not in NOT_MEASURED]
    cold = [r["compile_s"] for r in measured if r.get("compile_s") and not r.get("cached")]
    cached = [r for r in measured if r.get("cached")]
    failures: dict[str, int] = {}
    for r in measured:
        if r.get("status") != "ok":
            kind = r.get("kind") or r.get("status")
            failures[kind] = failures.get(kind, 0) + 1
    cublas = [r["cublas_us"] for r in measured if r.get("cublas_us")]
    trials = study.get_trials(deepcopy=False)
    return {
        "trials": len(measured), "ok": sum(1 for r in measured if r.get("status") == "ok"),
        "invalid_rejected": sum(1 for r in rows if r.get("status") == "invalid"),
        "duplicates": sum(1 for r in rows if r.get("status") == "duplicate"),
        "surplus": sum(1 for r in rows if r.get("status") == "surplus"),
        "not_recorded": sum(1 for r in rows if r.get("status") == "not_recorded"),
        "failures": failures,
        "compile_s_cold_median": statistics.median(cold) if cold else None,
        "compile_cached": len(cached),
        "cublas_us_median": statistics.median(cublas) if cublas else None,
        # verified trials that current_ok leaves out for the GPU model of the study's last run
        "other_gpu": len(current_ok(trials)) - len(current_ok(trials, study_gpu(study))),
    }


def entry(study: optuna.Study, trial: optuna.trial.FrozenTrial, confirmed: dict | None = None) -> dict[str, Any]:
    """The export entry of one trial; `confirmed` (tuner.confirm.confirmation) replaces its
    in-study time and cuBLAS time with the medians of the confirmation runs."""
    from tuner.confirm import VENDORS

    attrs = study.user_attrs
    shape = parse_shape(attrs["shape"])
    target = Target(**attrs["target"])
    a = trial.user_attrs
    time_us, baselines, speedups = a["time_us"], {"cublas": a.get("cublas_us")}, {"cublas": a.get("speedup_cublas")}
    extra: dict[str, Any] = {}
    if confirmed is not None:
        extra["confirm"] = {k: confirmed[k] for k in ("runs", "top", "verified", "reason", "in_study_us", "times_us")}
        if confirmed["median_us"] is not None:
            time_us = confirmed["median_us"]
            baselines = {v: confirmed[f"{v}_us"] for v in VENDORS}
            speedups = {v: confirmed[f"speedup_{v}"] for v in VENDORS}
        else:  # failed re-verification: never the pick
            speedups = {"cublas": None}
    roof = target.roofline_us(shape.flops, shape.min_bytes)
    return {
        "gpu": target.name, "arch": target.arch, "shape": str(shape), "M": shape.M, "N": shape.N, "K": shape.K,
        "layout": "TN", "accumulate": attrs.get("accumulate", "fp32"),
        "family": a["family"], "template_hash": attrs.get("template_hashes", {}).get(a["family"]),
        "knobs": a["config"] | a.get("variant", {}), "source_hash": a.get("source_hash"),
        "time_us": time_us, "tflops": shape.tflops(time_us), "roofline_fraction": roof / time_us,
        "baselines_us": baselines, "speedup": speedups,
        "beats_vendor": bool(speedups["cublas"] and speedups["cublas"] > 1.0),
        "pick": a["family"] if (speedups["cublas"] or 0) > 1.0 else "cublas",
        "verification": a.get("verify", {}), "simulated": bool(a.get("simulated")),
        "study": study.study_name, "trial": trial.number, "measured_on": a.get("gpu"),
    } | extra


def exported_trial(study: optuna.Study) -> tuple[optuna.trial.FrozenTrial | None, dict | None]:
    """The trial export takes and its confirmation record: the confirmed winner while the
    study's confirmation holds, else the in-study best (and None)."""
    from tuner.confirm import confirmation

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
        "schema_version": SCHEMA_VERSION, "tool": "hgemm-tune", "tool_version": tuner.__version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "simulated": any(e["simulated"] for e in entries), "entries": entries,
    }


SCHEMA_PATH = Path(__file__).with_name("export_schema.json")


def validate(data: dict[str, Any], where: str = "export") -> None:
    """Check an export against export_schema.json; a UserError names the first problem."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(data), key=lambda e: list(e.path))
    if errors:
        err = errors[0]
        at = "/".join(str(p) for p in err.path) or "(top level)"
        raise UserError(f"{where}: {at}: {err.message}")


def write_json(data: dict[str, Any], path: str | Path) -> Path:
    """Validate, then write atomically: a crash never leaves half a JSON file behind."""
    validate(data, str(path))
    path = Path(path)
    if path.is_dir():
        raise UserError(f"cannot write {path}: it is a folder; give a file name such as {path / 'best.json'}")
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def load_studies(storage: str, names: list[str] | None = None) -> list[optuna.Study]:
    """Existing studies only: a missing storage file or study is a UserError, never created."""
    from tuner.storage import open_storage

    backing = open_storage(storage, create=False)
    try:
        summaries = optuna.get_all_study_summaries(storage=backing, include_best_trial=False)
    except Exception as exc:  # noqa: BLE001 - bad URL, missing file, wrong schema: all user errors
        raise UserError(f"cannot open storage {storage!r}: {exc}") from None
    available = [s.study_name for s in summaries]
    chosen = names or available
    missing = sorted(set(chosen) - set(available))
    if missing:
        raise UserError(f"storage {storage} has no study {missing[0]!r}; studies: {', '.join(available) or 'none'}")
    return [optuna.load_study(study_name=n, storage=backing) for n in chosen]


def read_json(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    except ValueError:  # not text at all, e.g. a SQLite file
        raise UserError(f"{path}: not a JSON file (a database? pass it as sqlite:///{path})") from None
    if not isinstance(data, dict) or "entries" not in data:
        raise UserError(f"{path}: not an hgemm-tune export (no 'entries')")
    validate(data, str(path))
    return data
