"""What a prompt tells the model about a family's record, read (never written) from a study
storage: its best results with TFLOP/s and fraction of the roofline, its biggest losses to
cuBLAS, and its latest compile and verification errors."""

from __future__ import annotations

import json
from typing import Any

import optuna

from proposer.validate import candidate_errors, terminal_safe
from tuner.errors import UserError
from tuner.search import Status, StudyMeta, TrialRecord, load_studies
from tuner.space import Shape

# Trial kinds that mean "compiled, ran, and was wrong or crashed" (see tuner.measure.verify / worker).
FAILURE_KINDS = ("wrong", "unwritten", "out_of_bounds", "accumulate", "fault", "hang", "impossible", "compile")


def _config(cfg: dict[str, Any]) -> str:
    return json.dumps(cfg, separators=(",", ":"))


def gather(storage: str, family: str, shapes: list[Shape] | None = None, limit: int = 6) -> list[str]:
    """Prompt sections (each a few lines) about `family`; empty when the storage holds nothing on it."""
    from tuner.results.export import entry

    try:
        studies = load_studies(storage)  # read only: a missing storage file is an error, never created
    except UserError:
        return []  # nothing was measured there
    best: dict[str, dict[str, Any]] = {}
    errors: list[tuple[Any, str, dict[str, Any]]] = []
    for st in studies:
        try:
            meta = StudyMeta.of(st)
        except UserError:
            continue  # not a study of ours
        if family not in meta.families or meta.accumulate != "fp32":
            continue  # another family, or fp16 accumulation (another problem)
        trials = [t for t in st.get_trials(deepcopy=False)
                  if t.state.is_finished() and TrialRecord.of(t).family == family]
        ok = [t for t in trials
              if t.state == optuna.trial.TrialState.COMPLETE and TrialRecord.of(t).status == Status.OK]
        if ok:
            try:
                e = entry(st, min(ok, key=lambda t: t.value))
            except (KeyError, TypeError, UserError):
                continue  # a study from an older tool version: skip it rather than guess
            if e["shape"] not in best or e["time_us"] < best[e["shape"]]["time_us"]:
                best[e["shape"]] = e
        for t in trials:
            r = TrialRecord.of(t)
            if r.status == Status.COMPILE_ERROR or r.kind in FAILURE_KINDS:
                errors.append((t.datetime_complete, meta.shape, r))
    sections = []
    targets = [str(s) for s in shapes or []]
    rows = sorted(best.values(), key=lambda e: (e["shape"] not in targets, -e["roofline_fraction"]))[:limit]
    if rows:
        lines = [f"Best measured results of {family} per shape (time, TFLOP/s, fraction of the roofline, "
                 "cuBLAS timed in the same run):"]
        for e in rows:
            cublas = e["baselines_us"].get("cublas")
            vs = f"; cuBLAS {cublas:.2f} us -> {cublas / e['time_us']:.3f}x" if cublas else ""
            sim = " (replayed measurement)" if e["simulated"] else ""
            lines.append(f"- {e['shape']}: {e['time_us']:.2f} us, {e['tflops']:.1f} TFLOP/s, "
                         f"{100 * e['roofline_fraction']:.1f}% of roofline{vs}{sim}; config {_config(e['knobs'])}")
        sections.append("\n".join(lines))
    losses = sorted((e for e in best.values() if e["speedup"].get("cublas")), key=lambda e: e["speedup"]["cublas"])
    if losses:
        lines = ["Biggest losses to cuBLAS (speedup = cuBLAS time / our time, below 1 = slower; worst first):"]
        for e in losses[:limit]:
            lines.append(f"- {e['shape']}: {e['speedup']['cublas']:.3f}x of cuBLAS speed ({e['time_us']:.2f} us vs "
                         f"{e['baselines_us']['cublas']:.2f} us); config {_config(e['knobs'])}")
        sections.append("\n".join(lines))
    if errors:
        errors.sort(key=lambda x: x[0].timestamp() if x[0] else 0.0, reverse=True)
        lines = ["Latest compile and verification errors of its configs:"]
        for _, shape, r in errors[:3]:
            reason = r.reason or ""
            if r.status == Status.COMPILE_ERROR or r.kind == "compile":
                reason = candidate_errors(reason)  # nvcc's lines about other files may quote those files
            lines.append(f"- {shape} {_config(r.config)}: {r.status}/{r.kind}: {terminal_safe(reason)[:400]}")
        sections.append("\n".join(lines))
    return sections
