"""`hgemm-tune bench`: re-verify and time every exported kernel against the vendor libraries.
(Over 400 lines on purpose: the rows and the files written from them share one row schema.)

One pipeline stage on plain data. In: an export (tuner.results.schema, validated) and a
backend whose `compare(shape, candidates, modes=...)` verifies the candidates and times them
with cuBLAS, cuBLASLt (heuristic and autotuned) and torch.matmul interleaved in random order
in one worker process (tuner.measure.worker). Out: one row (a plain dict) per exported kernel
and timing regime, one row per contender and regime (`contender_rows`), then CSV, markdown and
the geomean speedup per baseline and regime. The regimes (tuner.measure.regimes; `mode` in the
rows and files, for the older readers):

- sustained: per contender a CUDA graph of back-to-back launches, replayed in short slices
  round-robin over the contenders until steady (power-capped; host overhead excluded).
- isolated: single launches, each after an L2 flush and a random idle gap (cold, full clocks).

`offline` and `server`, their older names, are read wherever a regime is (--mode, bench.json).

With `repeats` R > 1 every shape is compared R times, each in a fresh worker process (new
CUDA context, new buffers): a row holds the median times, the median of the per-run ratios
and their range, and counts as verified only if every run verified it.

A kernel that fails re-verification (or does not build, load or run) is a row that says so
with the reason; it has no time and never counts as a win. Entries tuned on another GPU (or
arch, layout, accumulation) are skipped and listed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuner.errors import UserError
from tuner.measure import CandidateSpec, CompareReply
from tuner.measure.clocks import UNKNOWN, clock_cells, combine
from tuner.measure.protocol import MODES
from tuner.measure.regimes import (
    ALIASES,
    ISOLATED,
    ISOLATED_PLAN,
    SUSTAINED,
    SUSTAINED_BENCH,
    canonical_or_none,
    combine_reports,
)
from tuner.results.entries import entry_build
from tuner.space import Shape, parse_shape

BASELINES = ("cublas", "cublaslt", "cublaslt_auto", "torch")
CHECKPOINT_S = 30.0  # a long bench writes its results so far this often (a killed run keeps them)
# The clock regime of the row's timing section (tuner.measure.clocks), medians over the runs;
# `regime` is "unknown" where no run has a clock record (no NVML, an older worker).
CLOCK_FIELDS = ("sm_mhz_median", "sm_mhz_min", "power_w", "regime", "energy_per_gemm_mj")
CLOCK_HEAD = ("SM MHz med (min)", "power W", "clock regime", "mJ/GEMM (section)")
# Whether the regime's timing settled (tuner.measure.regimes): every run steady, after how many
# rounds at most, in how many runs; ours' own energy per GEMM from its sustained slices.
STEADY_FIELDS = ("steady", "steady_after", "steady_runs", "ours_mj_per_gemm")
LABELS = {"cublas": "cuBLAS", "cublaslt": "cuBLASLt", "cublaslt_auto": "cuBLASLt-auto", "torch": "torch"}
ROW_FIELDS = (["shape", "M", "N", "K", "mode", "family", "status", "verified", "reason",
               "ours_us", "ours_tflops", "roofline_pct"]
              + [f"{b}_us" for b in BASELINES] + [f"speedup_{b}" for b in BASELINES]
              + ["speedup_cublas_min", "speedup_cublas_max", "runs"]
              + list(CLOCK_FIELDS) + list(STEADY_FIELDS) + ["export_us", "pick", "knobs", "notes"])
# One row per contender (ours and every vendor) and regime: all of a shape's contenders ran in
# one section, so the clock and power columns are the same for them, which is the point.
CONTENDER_FIELDS = ["shape", "M", "N", "K", "mode", "contender", "family", "us", "tflops", "vs_cublas",
                    "sm_mhz_median", "sm_mhz_min", "power_w", "regime", "mj_per_gemm", "spread", "steady",
                    "steady_after", "rounds", "steady_runs", "runs"]
CONTENDER_HEAD = ("shape", "regime", "contender", "us", "TFLOP/s", "vs cuBLAS", "SM MHz med (min)", "power W",
                  "clock regime", "mJ/GEMM (own)", "spread %", "steady")
GEOMEAN_FIELDS = ["mode", "baseline", "geomean_speedup", "n", "wins", "ok_rows"]
# A time under the roofline (datasheet peak / bandwidth) by more than this is a measurement bug.
ROOFLINE_SLACK = 0.98


def parse_modes(mode: str) -> list[str]:
    """--mode sustained | isolated | both (or the older offline | server) -> the regimes to time."""
    m = mode.strip().lower()
    if m == "both":
        return list(MODES)
    if canonical_or_none(m) is not None:
        return [canonical_or_none(m)]
    raise UserError(f"--mode {mode!r}: use sustained, isolated or both (offline and server are their older names)")


def regimes_of(modes: list[str]) -> list[str]:
    """Regime names from a list that may hold the older ones (an older bench.json's `modes`)."""
    return [ALIASES.get(m, m) for m in modes]


def select_entries(data: dict[str, Any], target) -> tuple[list[dict], list[dict]]:
    """The entries this GPU can re-measure, and the skipped ones with the reason."""
    chosen, skipped = [], []
    for e in data["entries"]:
        why = None
        if e["gpu"] != target.name:
            why = f"tuned on {e['gpu']}, this GPU is {target.name}"
        elif e["arch"] != target.arch:
            why = f"built for {e['arch']}, this GPU is {target.arch}"
        elif e["layout"] != "TN" or e["accumulate"] != "fp32":
            why = f"layout {e['layout']} / {e['accumulate']} accumulation: the benchmark runs TN with fp32 accumulation"
        if why:
            skipped.append({"shape": e["shape"], "family": e["family"], "gpu": e["gpu"], "reason": why})
        else:
            chosen.append(e)
    return chosen, skipped


class Builder:
    """Export entry -> the GPU worker's CandidateSpec, compiled in a pool.

    `submit(entry)` starts the compile and returns a thunk; calling it waits and returns
    (candidate, warnings) or raises UserError with the reason the kernel cannot run."""

    def __init__(self, space, target, pool):
        self.space, self.target, self.pool = space, target, pool

    def submit(self, entry: dict[str, Any]) -> Callable[[], tuple[CandidateSpec, list[str]]]:
        try:
            build = entry_build(self.space, entry, self.target)
            fam = self.space.family(build.family)
            why = fam.violations(build.config, parse_shape(entry["shape"]), self.target)
            if why:
                raise UserError(f"config no longer valid on {self.target.arch}: {'; '.join(why)}")
        except UserError as exc:
            err = str(exc)

            def failed() -> tuple[CandidateSpec, list[str]]:
                raise UserError(err)

            return failed
        future = self.pool.submit(build.source, self.target.arch, build.artifact)
        warnings = [f"{build.template} changed since this entry was tuned: today's template is measured"
                    ] if build.template_changed else []

        def wait() -> tuple[CandidateSpec, list[str]]:
            res = future.result()
            if not res.ok:
                first = (res.error or "").strip().splitlines()[:2]
                raise UserError(f"does not compile: {' '.join(first)}")
            return CandidateSpec(res.cubin, build.launch, build.variant, res.digest), warnings

        return wait


def _base_row(entry: dict[str, Any], mode: str) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in ROW_FIELDS}
    row.update(shape=entry["shape"], M=entry["M"], N=entry["N"], K=entry["K"], mode=mode, family=entry["family"],
               verified=False, export_us=entry.get("time_us"), pick=entry.get("pick"),
               knobs=json.dumps(entry["knobs"], sort_keys=True, separators=(",", ":")), notes="",
               # bench.json only (the CSV has their CLOCK_FIELDS and STEADY_FIELDS): the full clock
               # record, the regime's report over the runs, the candidate's name in the worker
               clocks={}, regime_report={}, candidate=None)
    return row


def _run_outcome(name: str, reply: CompareReply, mode: str, roof_us: float) -> tuple[str, str | None, float | None]:
    """One run's verdict on one candidate: (status, reason, our time)."""
    if not reply.ok:
        return "failed", f"{reply.kind or reply.status}: {reply.reason}", None
    report = reply.verify.get(name)
    if not report or not report.get("ok"):
        report = report or {}
        why = report.get("reason", "no verification report came back")
        return "failed", f"{report.get('kind', 'wrong')}: {why}", None
    ours = reply.times_in(mode).get(name)
    if ours is None:
        return "not_timed", reply.notes.get(name, "verified, but no time came back"), None
    if ours < roof_us * ROOFLINE_SLACK:
        return "rejected", f"{ours:.2f} us is under the roofline ({roof_us:.2f} us): a measurement bug", ours
    return "ok", None, ours


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v]
    return statistics.median(vals) if vals else None


def shape_rows(entries: dict[str, dict], replies: list[CompareReply], modes: list[str], target,
               failed: dict[str, str] | None = None, warnings: dict[str, list[str]] | None = None) -> list[dict]:
    """Rows for one shape from its compare replies (one per run). `entries`: candidate name ->
    export entry; `failed`: candidate name -> why it never reached the GPU (build/compile)."""
    failed = failed or {}
    warnings = warnings or {}
    notes: dict[str, str] = {}
    for reply in replies:
        notes.update(reply.notes)
    baseline_notes = [f"{LABELS[b]}: {notes[b]}" for b in BASELINES if b in notes]
    rows = []
    for name, entry in entries.items():
        shape = parse_shape(entry["shape"])
        roof_us = target.roofline_us(shape.flops, shape.min_bytes)
        for mode in modes:
            row = _base_row(entry, mode)
            row["runs"] = len(replies)
            runs = [reply.times_in(mode) if reply.ok else {} for reply in replies]
            clocks = combine([reply.clocks_in(mode) if reply.ok else {} for reply in replies])
            row.update(clock_cells(clocks), clocks=clocks, candidate=name)
            report = combine_reports([reply.regime_in(mode).to_dict() if reply.ok else {} for reply in replies], mode)
            said = report["steady"] is not None
            row.update(regime_report=report, steady=report["steady"], steady_after=report["steady_after"],
                       steady_runs=f"{report['steady_runs']}/{report['runs']}" if said else None,
                       ours_mj_per_gemm=report["energy_mj"].get(name))
            for b in BASELINES:
                row[f"{b}_us"] = _median([t.get(b) for t in runs])
            row["notes"] = "; ".join(warnings.get(name, []) + baseline_notes)
            outcomes = [_run_outcome(name, reply, mode, roof_us) for reply in replies]
            bad = next((o for o in outcomes if o[0] != "ok"), None)
            if name in failed:
                row.update(status="failed", reason=failed[name])
            elif not replies:
                row.update(status="failed", reason="not measured")
            elif bad is not None:
                status, reason, ours = bad
                row.update(status=status, reason=reason, verified=status in ("not_timed", "rejected"), ours_us=ours)
            else:
                ours = statistics.median(o[2] for o in outcomes)
                row.update(status="ok", verified=True, ours_us=ours, ours_tflops=shape.tflops(ours),
                           roofline_pct=100.0 * roof_us / ours)
                for b in BASELINES:
                    ratios = [t[b] / o[2] for t, o in zip(runs, outcomes, strict=True) if t.get(b)]
                    if ratios:
                        row[f"speedup_{b}"] = statistics.median(ratios)
                        if b == "cublas":
                            row["speedup_cublas_min"], row["speedup_cublas_max"] = min(ratios), max(ratios)
            rows.append(row)
    return rows


def geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


# The CUDA-L2 paper's FLOP buckets (2*M*N*K), the form of its results table.
FLOP_EDGES = (1.7e7, 2.7e8, 4.3e9, 6.9e10, 1.1e12)


def bucket_index(flops: float) -> int:
    """Which of the CUDA-L2 FLOP buckets (0: the smallest) a GEMM of `flops` falls in; its order."""
    return sum(flops >= h for h in FLOP_EDGES)


def flop_bucket(flops: float) -> str:
    lo = 0.0
    for hi in FLOP_EDGES:
        if flops < hi:
            return f"<{hi:.1e}" if lo == 0 else f"{lo:.1e}-{hi:.1e}"
        lo = hi
    return f">{FLOP_EDGES[-1]:.1e}"


def bucket_geomeans(rows: list[dict], modes: list[str]) -> list[dict]:
    """The CUDA-L2 paper's table from bench rows: per regime and FLOP bucket, the shapes, the geomean
    speedup of our best kernel per shape over each baseline (the vendor fallback not counted), and
    the share of shapes where cuBLAS stays the pick (our best is not faster than it)."""
    out = []
    for mode in modes:
        best: dict[str, dict] = {}  # shape -> its fastest verified row (an export may hold several kernels)
        for r in rows:
            if (r["mode"] == mode and r["status"] == "ok" and r["ours_us"]
                    and (r["shape"] not in best or r["ours_us"] < best[r["shape"]]["ours_us"])):
                best[r["shape"]] = r
        groups: dict[int, list[dict]] = {}
        for r in best.values():
            groups.setdefault(bucket_index(2.0 * r["M"] * r["N"] * r["K"]), []).append(r)
        for b in sorted(groups):
            sub = groups[b]
            row = {"mode": mode, "bucket": flop_bucket(2.0 * sub[0]["M"] * sub[0]["N"] * sub[0]["K"]),
                   "shapes": len(sub)}
            for base in BASELINES:
                row[base] = geomean([r[f"speedup_{base}"] for r in sub if r[f"speedup_{base}"]])
            row["vendor_keeps"] = sum(1 for r in sub if not (r["speedup_cublas"] or 0) > 1.0) / len(sub)
            out.append(row)
    return out


def autotune_sample(shapes: list[str], n: int, seed: int = 34) -> set[str]:
    """A stratified sample of `n` of `shapes` for the autotuned-cuBLASLt baseline (issue 34 allows one
    on a grid): per FLOP bucket, a share proportional to its size (at least one), drawn with
    random.Random(seed) from the bucket's shapes in sorted order: the same population always
    draws the same sample (draw it from the whole grid, not from what a partial export holds)."""
    import random

    buckets: dict[int, list[str]] = {}
    for s in sorted(set(shapes)):
        buckets.setdefault(bucket_index(parse_shape(s).flops), []).append(s)
    total = sum(len(v) for v in buckets.values())
    if n >= total:
        return set(shapes)
    rng = random.Random(seed)
    out: set[str] = set()
    for b in sorted(buckets):
        take = max(1, round(n * len(buckets[b]) / total))
        out |= set(rng.sample(buckets[b], min(take, len(buckets[b]))))
    return out


def geomeans(rows: list[dict], modes: list[str]) -> list[dict]:
    """Geomean of (baseline us / ours us) over the verified, timed rows, per mode and baseline."""
    out = []
    for mode in modes:
        ok = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        for b in BASELINES:
            vals = [r[f"speedup_{b}"] for r in ok if r[f"speedup_{b}"]]
            out.append({"mode": mode, "baseline": b, "geomean_speedup": geomean(vals), "n": len(vals),
                        "wins": sum(1 for v in vals if v > 1.0), "ok_rows": len(ok)})
    return out


def run_benchmark(data: dict[str, Any], backend, builder, modes: list[str], *, torch: bool = True,
                  timeout_s: float = 900.0, repeats: int = 1,
                  on_shape: Callable[[int, int, str, list[dict]], None] | None = None,
                  earlier: dict[str, Any] | None = None, deadline: float | None = None,
                  checkpoint: Callable[[dict[str, Any]], None] | None = None,
                  checkpoint_s: float = CHECKPOINT_S, autotune_shapes: set[str] | None = None) -> dict[str, Any]:
    """Every entry of `data` for this GPU: build, then per shape `repeats` runs of one
    `backend.compare` of all its kernels with the baselines in `modes` (each run after the
    first in a fresh worker). Returns plain data: rows, geomeans, skipped entries and the
    worker's notes per shape. A long bench (a grid) resumes: `earlier` is an unfinished run's
    result (`bench --resume`), whose shapes are kept, not timed again; no shape starts after
    `deadline` (time.perf_counter); `checkpoint` gets the result so far every `checkpoint_s`.
    `left` counts the shapes not yet benched. `autotune_shapes`: the shapes where cuBLASLt is
    also autotuned (cuBLASLt-auto; `autotune_sample`); None: every shape."""
    target = backend.target
    modes = regimes_of(modes)
    entries, skipped = select_entries(data, target)
    now = {(e["shape"], e["family"], json.dumps(e["knobs"], sort_keys=True, separators=(",", ":")))
           for e in entries}
    by_shape: dict[str, list[dict]] = {}
    for r in (earlier or {}).get("rows", []):
        by_shape.setdefault(r["shape"], []).append(r)
    # An earlier shape is kept only if every row of it is a kernel the export still holds there, and
    # the export holds no other kernel there (a grid's export grows and re-picks between calls).
    kept = {shape for shape, rs in by_shape.items()
            if {(r["shape"], r["family"], r["knobs"]) for r in rs} == {k for k in now if k[0] == shape}}
    rows: list[dict] = [r for shape in kept for r in by_shape[shape]]
    notes: dict[str, dict[str, str]] = {k: v for k, v in (earlier or {}).get("notes", {}).items() if k in kept}
    groups: dict[str, list[dict]] = {}
    for e in sorted(entries, key=lambda e: (e["M"] * e["N"] * e["K"], e["shape"])):
        if e["shape"] not in kept:
            groups.setdefault(e["shape"], []).append(e)
    order = list(groups.items())
    built = [e for _, group in order for e in group]
    thunks = [(e, builder.submit(e)) for e in built]  # every compile starts now, in parallel
    build_of = {id(e): thunk for e, thunk in thunks}

    def result(left: int) -> dict[str, Any]:
        return {"gpu": target.name, "arch": target.arch, "backend": getattr(backend, "name", ""),
                "modes": list(modes), "repeats": repeats, "rows": rows, "geomeans": geomeans(rows, modes),
                "buckets": bucket_geomeans(rows, modes), "contenders": contender_rows(rows),
                "skipped": skipped, "notes": notes, "entries": len(data["entries"]), "left": left,
                "torch": torch, "autotune_shapes": sorted(autotune_shapes) if autotune_shapes is not None else None,
                "simulated": bool(getattr(backend, "simulated", False))}

    last = time.perf_counter()
    for i, (shape_s, group) in enumerate(order):
        if deadline is not None and time.perf_counter() >= deadline:
            return result(len(order) - i)
        if checkpoint is not None and time.perf_counter() - last >= checkpoint_s:
            checkpoint(result(len(order) - i))
            last = time.perf_counter()
        shape = parse_shape(shape_s)
        named = {f"ours{j}": e for j, e in enumerate(group)}
        candidates, failed, warnings = {}, {}, {}
        for name, e in named.items():
            try:
                candidates[name], warnings[name] = build_of[id(e)]()
            except UserError as exc:
                failed[name] = f"build: {exc}"
        replies = []
        for r in range(repeats if candidates else 0):
            if r:
                backend.restart()  # a fresh worker: one allocation's luck is not every run's
            replies.append(_compare(backend, shape, candidates, modes, torch, timeout_s,
                                    autotune_shapes is None or shape_s in autotune_shapes))
        notes[shape_s] = {k: v for reply in replies for k, v in reply.notes.items()}
        new = shape_rows(named, replies, modes, target, failed, warnings)
        rows.extend(new)
        if on_shape:
            on_shape(i, len(groups), shape_s, new)
    return result(0)


def _compare(backend, shape: Shape, candidates: dict[str, CandidateSpec], modes: list[str], torch: bool,
             timeout_s: float, autotune: bool = True) -> CompareReply:
    """One compare; if it fails as a whole (a fault restarts the worker), each candidate alone,
    so one bad kernel does not take the others' rows with it."""
    reply = backend.compare(shape, candidates, timeout_s=timeout_s, modes=modes, torch=torch, autotune=autotune)
    if reply.ok or len(candidates) < 2:
        return reply
    merged = CompareReply(modes=list(modes), times_by_mode={m: {} for m in modes})
    sections: dict[str, list[dict]] = {m: [] for m in modes}
    reports: dict[str, list[dict]] = {m: [] for m in modes}
    for name, cand in candidates.items():
        one = backend.compare(shape, {name: cand}, timeout_s=timeout_s, modes=modes, torch=torch, autotune=autotune)
        for m in modes:
            sections[m].append(one.clocks_in(m) if one.ok else {})
            reports[m].append(one.regime_in(m).to_dict() if one.ok else {})
        if not one.ok:
            merged.verify[name] = {"ok": False, "kind": one.kind or one.status,
                                   "reason": f"compare failed: {one.reason}"}
            continue
        merged.verify.update(one.verify)
        merged.notes.update(one.notes)
        for m in modes:
            for k, v in one.times_in(m).items():
                if k == name or k not in merged.times_by_mode[m]:
                    merged.times_by_mode[m][k] = v  # baselines: from the first run that timed them
    # One record per mode for the separate compares together (each row's regime spans them all).
    merged.clocks_by_mode = {m: combine(recs) for m, recs in sections.items()}
    merged.regimes_by_mode = {m: combine_reports(reps, m) for m, reps in reports.items()}
    return merged


def contender_rows(rows: list[dict]) -> list[dict]:
    """Per shape and regime, one row per contender: ours (each exported kernel that verified and
    was timed) and every vendor baseline, with its time, TFLOP/s, ratio to cuBLAS (cuBLAS us /
    its us), the section's SM clock and power (shared: all of them ran interleaved in it), its
    own energy per GEMM (sustained, where the counter resolved its slices), the spread of its
    reported window and whether the regime's timing settled. Built from the kernel rows alone,
    so an older bench.json gives the same table (energy and steady state unknown)."""
    out: list[dict] = []
    seen: set[tuple[str, str, str]] = set()
    for r in rows:
        report = r.get("regime_report") or {}
        mode = ALIASES.get(r["mode"], r["mode"])
        shape = _shape_of(r)
        ours = r.get("candidate")
        named = [(f"ours ({r['family']})", ours, r["ours_us"] if r["status"] == "ok" else None)]
        named += [(LABELS[b], b, r.get(f"{b}_us")) for b in BASELINES]
        for label, key, us in named:
            if key in BASELINES and (r["shape"], mode, key) in seen:
                continue  # a shape's baselines once, however many of its kernels were exported
            seen.add((r["shape"], mode, str(key)))
            if key in BASELINES and us is None:
                continue  # not measured: the notes say why
            cublas = r.get("cublas_us")
            out.append({"shape": r["shape"], "M": r["M"], "N": r["N"], "K": r["K"], "mode": mode, "contender": label,
                        "family": r["family"] if key not in BASELINES else None, "us": us,
                        "tflops": shape.tflops(us) if us else None,
                        "vs_cublas": cublas / us if cublas and us else None,
                        "sm_mhz_median": r.get("sm_mhz_median"), "sm_mhz_min": r.get("sm_mhz_min"),
                        "power_w": r.get("power_w"), "regime": r.get("regime") or UNKNOWN,
                        "mj_per_gemm": (report.get("energy_mj") or {}).get(key) if key else None,
                        "spread": (report.get("spread") or {}).get(key) if key else None,
                        "steady": report.get("steady"), "steady_after": report.get("steady_after"),
                        "rounds": report.get("rounds"), "steady_runs": r.get("steady_runs"), "runs": r.get("runs")})
    return out


def _shape_of(row: dict) -> Shape:
    return Shape(int(row["M"]), int(row["N"]), int(row["K"]))


# ---- outputs ------------------------------------------------------------------------------

def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def write_csv(rows: list[dict], fields: list[str], path: Path) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in fields})
    return path


def _f(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def clock_texts(row: dict) -> list[str]:
    """The row's clock cells as tables print them: SM MHz "median (min)", power W, regime, mJ per
    GEMM of the section. "unknown" where the row has no clock record: a time is never shown
    without saying which clock regime it came from."""
    if row.get("regime") in (None, UNKNOWN):
        return [UNKNOWN] * len(CLOCK_HEAD)
    sm = _f(row.get("sm_mhz_median"), ".0f")
    if row.get("sm_mhz_median") is not None and row.get("sm_mhz_min") is not None:
        sm += f" ({row['sm_mhz_min']:.0f})"
    return [sm, _f(row.get("power_w"), ".0f"), str(row["regime"]), _f(row.get("energy_per_gemm_mj"), ".3g")]


def steady_words(steady: bool | None, after: int | None, rounds: int | None, steady_runs: str | None = None) -> str:
    """"yes (9 rounds)", "NO (60 rounds)", over several runs with ", 2/3 runs steady"; "unknown"
    where no run said (an older worker or file)."""
    if steady is None:
        return UNKNOWN
    text = f"yes ({after} rounds" if steady else f"NO ({rounds if rounds is not None else '?'} rounds"
    if steady_runs and not steady_runs.endswith("/1"):  # one run: nothing to add
        text += f", {steady_runs} runs steady"
    return text + ")"


def steady_cell(row: dict) -> str:
    """Whether the row's regime timing settled (every run), after how many rounds."""
    return steady_words(row.get("steady"), row.get("steady_after"), (row.get("regime_report") or {}).get("rounds"),
                        row.get("steady_runs"))


def contender_texts(c: dict) -> list[str]:
    """A contender row's cells as tables print them (CONTENDER_HEAD)."""
    sm = _f(c.get("sm_mhz_median"), ".0f")
    if c.get("sm_mhz_median") is not None and c.get("sm_mhz_min") is not None:
        sm += f" ({c['sm_mhz_min']:.0f})"
    steady = steady_words(c.get("steady"), c.get("steady_after"), c.get("rounds"), c.get("steady_runs"))
    spread = _f(100.0 * c["spread"], ".2f") if c.get("spread") is not None else "-"
    return [c["shape"], c["mode"], c["contender"], _f(c["us"], ".2f"), _f(c["tflops"], ".1f"),
            _f(c["vs_cublas"], ".3f"), sm if c.get("regime") != UNKNOWN else UNKNOWN,
            _f(c.get("power_w"), ".0f") if c.get("regime") != UNKNOWN else UNKNOWN, str(c.get("regime") or UNKNOWN),
            _f(c.get("mj_per_gemm"), ".3g"), spread, steady]


def _verified(row: dict) -> str:
    if row["status"] == "ok":
        return "yes"
    label = {"failed": "FAILED", "not_timed": "yes, NOT TIMED", "rejected": "yes, TIME REJECTED"}[row["status"]]
    return f"{label}: {row['reason']}".replace("|", "\\|")


def _speedup_cell(row: dict, baseline: str) -> str:
    """The median ratio; over several runs, cuBLAS's with the range of the per-run ratios."""
    text = _f(row[f"speedup_{baseline}"], ".3f")
    if baseline == "cublas" and (row.get("runs") or 1) > 1 and row.get("speedup_cublas_min") is not None:
        text += f" ({row['speedup_cublas_min']:.3f}-{row['speedup_cublas_max']:.3f})"
    return text


def geomean_text(g: dict) -> str:
    if g["geomean_speedup"] is None:
        return "-"
    return f"{g['geomean_speedup']:.3f}x ({g['wins']}/{g['n']} faster)"


def markdown(result: dict[str, Any], source: str = "") -> str:
    """The report: per shape and regime ours vs every baseline; per contender and regime;
    geomeans; skipped; notes."""
    modes = regimes_of(result["modes"])
    sim = "  [SIMULATED]" if result.get("simulated") else ""
    lines = [f"# hgemm-tune bench{(': ' + source) if source else ''}{sim}", "",
             f"GPU: {result['gpu']} ({result['arch']}); fp16 in/out, fp32 accumulate, TN (C = A·Bᵀ). Every "
             "kernel re-verified, then timed with the baselines interleaved in one worker process, in the same "
             "thermal and power state (docs/decisions/0036). cuBLAS = cublasGemmEx(COMPUTE_32F); cuBLASLt = "
             "cublasLtMatmul, heuristic's first algorithm; cuBLASLt-auto = fastest of its top 16 on the shape; "
             "torch = torch.matmul(A, B.t(), out=C) on the same buffers and stream. vs X = X us / ours us "
             "(above 1: ours is faster).", ""]
    sp, ip = SUSTAINED_BENCH, ISOLATED_PLAN
    if SUSTAINED in modes:
        lines.append(f"- sustained: per contender a CUDA graph of back-to-back launches, replayed in slices of about "
                     f"{sp.slice_ms:g} ms round-robin over the contenders (a new random order every round, no gap: "
                     f"the same power state for all) after {sp.warmup_rounds} warm-up rounds each, until the last "
                     f"{sp.window} rounds agree within {100 * sp.tol:g}% for every contender (steady; at least "
                     f"{sp.min_rounds}, at most {sp.max_rounds} rounds or {sp.max_s:g} s); median of those "
                     f"{sp.window} rounds. The power-capped regime.")
    if ISOLATED in modes:
        lines.append(f"- isolated: single launches (one-launch CUDA graphs), each after an L2 flush (a buffer of "
                     f"2x the L2 overwritten) and a random 20-500 us idle gap, interleaved per launch (a new random "
                     f"order every round) after {ip.warmup_rounds} warm-up rounds; median. Steady: the medians of "
                     f"blocks of {ip.block} rounds agree within {100 * ip.tol:g}% over the last {ip.window} blocks. "
                     "The full-clock regime.")
    if result.get("repeats", 1) > 1:
        lines.append(f"- {result['repeats']} runs, each in a fresh worker process: median times, median of the "
                     "per-run ratios (vs cuBLAS: with their range); a row counts only if every run verified it, and "
                     "is steady only if every run was.")
    lines.append("- clocks: NVML sampled every 15 ms while each regime's timing ran (all contenders of the shape "
                 "together): SM MHz median (min); power W, the mean from the energy counter (where the card has "
                 "none, the median of NVML's power readings, which average over about a second and lag a short "
                 "section); the clock regime (power-capped: the software power cap held the clock in >= 20% of the "
                 "busy samples; thermal; full clocks; unknown: no clock record); the section's energy per GEMM over "
                 "every contender's launches (sustained only); and each contender's own energy per GEMM, read "
                 "from the energy counter at its slices' boundaries (sustained only, where the counter moved in at "
                 "least 90% of the slices; '-' otherwise).")
    head = (["shape", "regime", "family", "ours us", "TFLOP/s", "% roofline"]
            + [f"{LABELS[b]} us" for b in BASELINES] + [f"vs {LABELS[b]}" for b in BASELINES] + ["verified"]
            + list(CLOCK_HEAD) + ["steady"])
    left = ("shape", "regime", "family", "verified", "clock regime", "steady")
    lines += ["", "| " + " | ".join(head) + " |",
              "|" + "|".join("---" if h in left else "---:" for h in head) + "|"]
    for r in result["rows"]:
        cells = [r["shape"], ALIASES.get(r["mode"], r["mode"]), r["family"], _f(r["ours_us"], ".2f"),
                 _f(r["ours_tflops"], ".1f"), _f(r["roofline_pct"], ".1f")]
        cells += [_f(r[f"{b}_us"], ".2f") for b in BASELINES]
        cells += [_speedup_cell(r, b) for b in BASELINES]
        cells.append(_verified(r))
        cells += clock_texts(r)
        cells.append(steady_cell(r))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if not result["rows"]:
        lines.append("| " + " | ".join(["-"] * len(head)) + " |")
    lines += ["", "## Per contender and regime", "",
              "Every contender of a shape ran interleaved in one section per regime: the SM clock and power are "
              "that section's, the same for all of them; mJ/GEMM (own) is the contender's own; vs cuBLAS = "
              "cuBLAS us / its us; spread = (max - min) / median of its reported rounds.", ""]
    lines += contender_markdown(result.get("contenders") or contender_rows(result["rows"]))
    lines += ["", "## Geomean speedup (baseline us / ours us) over the verified shapes", "",
              "| baseline | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    by = {(ALIASES.get(g["mode"], g["mode"]), g["baseline"]): g for g in result["geomeans"]}
    for b in BASELINES:
        lines.append(f"| {LABELS[b]} | " + " | ".join(geomean_text(by[(m, b)]) for m in modes) + " |")
    buckets = result.get("buckets") or bucket_geomeans(result["rows"], result["modes"])
    if buckets:
        lines += ["", "## By FLOP bucket (CUDA-L2's table form: our best kernel per shape, the vendor fallback not "
                  "counted)", "",
                  "| regime | FLOPs | shapes | " + " | ".join(f"vs {LABELS[b]}" for b in BASELINES)
                  + " | cuBLAS stays the pick |", "|---|---|---:|" + "---:|" * (len(BASELINES) + 1)]
        lines += [f"| {ALIASES.get(g['mode'], g['mode'])} | {g['bucket']} | {g['shapes']} | "
                  + " | ".join(_f(g[b], ".3f") for b in BASELINES) + f" | {100 * g['vendor_keeps']:.0f}% |"
                  for g in buckets]
    if result.get("left"):
        lines += ["", f"**Unfinished:** {result['left']} shape(s) not benched yet; `hgemm-tune bench --resume` "
                  "with the same export and --out continues."]
    bad = [r for r in result["rows"] if r["status"] != "ok"]
    if bad:
        lines += ["", f"{len(bad)} row(s) not counted: " + ", ".join(
            sorted({f"{r['shape']} {r['family']} ({r['status']})" for r in bad})) + "."]
    if result["skipped"]:
        lines += ["", "## Skipped entries", ""]
        lines += [f"- {s['shape']} {s['family']}: {s['reason']}" for s in result["skipped"]]
    noted = note_lines(result["notes"])
    if noted:
        lines += ["", "## Notes from the GPU worker", ""] + noted
    return "\n".join(lines) + "\n"


def contender_markdown(contenders: list[dict]) -> list[str]:
    """The per-contender table (CONTENDER_HEAD) as markdown lines."""
    left = ("shape", "regime", "contender", "clock regime", "steady")
    lines = ["| " + " | ".join(CONTENDER_HEAD) + " |",
             "|" + "|".join("---" if h in left else "---:" for h in CONTENDER_HEAD) + "|"]
    for c in contenders:
        lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in contender_texts(c)) + " |")
    if not contenders:
        lines.append("| " + " | ".join(["-"] * len(CONTENDER_HEAD)) + " |")
    return lines


# Per-shape details that stay in bench.json only (the table would repeat them for every shape).
QUIET_NOTES = ("cublaslt_algos", "torch_check")


def note_lines(notes: dict[str, dict[str, str]]) -> list[str]:
    """The worker's notes, each distinct (key, text) once with the shapes it holds for: a
    baseline that was not measured, how torch was timed, what the isolated regime did. Candidates'
    own notes are in their rows' reasons."""
    shapes_of: dict[tuple[str, str], list[str]] = {}
    for shape, n in notes.items():
        for key, text in n.items():
            if key in QUIET_NOTES or key.startswith("ours"):
                continue
            shapes_of.setdefault((key, str(text)), []).append(shape)
    lines = []
    for (key, text), shapes in shapes_of.items():
        where = "all shapes" if len(shapes) == len(notes) and len(notes) > 1 else ", ".join(shapes)
        lines.append(f"- {LABELS.get(key, key)}: {text} ({where})")
    return lines


def write_outputs(result: dict[str, Any], out: Path, source: str = "") -> list[Path]:
    """bench.csv (one row per kernel and regime), bench_geomean.csv, bench_contenders.csv (one row
    per contender and regime), bench.md, bench.json."""
    out.mkdir(parents=True, exist_ok=True)
    files = [write_csv(result["rows"], ROW_FIELDS, out / "bench.csv"),
             write_csv(result["geomeans"], GEOMEAN_FIELDS, out / "bench_geomean.csv"),
             write_csv(result.get("contenders") or contender_rows(result["rows"]), CONTENDER_FIELDS,
                       out / "bench_contenders.csv")]
    md = _replace(out / "bench.md", markdown(result, source))
    # bench.json last and whole (written aside, then renamed): a bench killed mid-checkpoint keeps the
    # previous one, which `--resume` reads
    js = _replace(out / "bench.json", json.dumps(result | {"source": source}, indent=1) + "\n")
    return files + [md, js]


def _replace(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
