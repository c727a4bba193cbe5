"""`hgemm-tune bench`: re-verify and time every exported kernel against the vendor libraries.
(Over 400 lines on purpose: the rows and the files written from them share one row schema.)

One pipeline stage on plain data. In: an export (tuner.results.schema, validated) and a
backend whose `compare(shape, candidates, modes=...)` verifies the candidates and times them
with cuBLAS, cuBLASLt (heuristic and autotuned) and torch.matmul interleaved in random order
in one worker process (tuner.measure.worker). Out: one row (a plain dict) per exported kernel
and timing mode, then CSV, markdown and the geomean speedup per baseline and mode.

- offline: per contender a CUDA graph of back-to-back launches (host overhead excluded).
- server:  single launches, each after an L2 flush and a random idle gap (cold, from idle).

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
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuner.errors import UserError
from tuner.measure import CandidateSpec, CompareReply
from tuner.measure.clocks import UNKNOWN, clock_cells, combine
from tuner.measure.protocol import MODES
from tuner.results.entries import entry_build
from tuner.space import Shape, parse_shape

BASELINES = ("cublas", "cublaslt", "cublaslt_auto", "torch")
# The clock regime of the row's timing section (tuner.measure.clocks), medians over the runs;
# `regime` is "unknown" where no run has a clock record (no NVML, an older worker).
CLOCK_FIELDS = ("sm_mhz_median", "sm_mhz_min", "power_w", "regime", "energy_per_gemm_mj")
CLOCK_HEAD = ("SM MHz med (min)", "power W", "clock regime", "mJ/GEMM (section)")
LABELS = {"cublas": "cuBLAS", "cublaslt": "cuBLASLt", "cublaslt_auto": "cuBLASLt-auto", "torch": "torch"}
ROW_FIELDS = (["shape", "M", "N", "K", "mode", "family", "status", "verified", "reason",
               "ours_us", "ours_tflops", "roofline_pct"]
              + [f"{b}_us" for b in BASELINES] + [f"speedup_{b}" for b in BASELINES]
              + ["speedup_cublas_min", "speedup_cublas_max", "runs"]
              + list(CLOCK_FIELDS) + ["export_us", "pick", "knobs", "notes"])
GEOMEAN_FIELDS = ["mode", "baseline", "geomean_speedup", "n", "wins", "ok_rows"]
# A time under the roofline (datasheet peak / bandwidth) by more than this is a measurement bug.
ROOFLINE_SLACK = 0.98


def parse_modes(mode: str) -> list[str]:
    """--mode offline | server | both -> the list of modes to time."""
    m = mode.strip().lower()
    if m == "both":
        return list(MODES)
    if m in MODES:
        return [m]
    raise UserError(f"--mode {mode!r}: use offline, server or both")


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
               clocks={})  # the full clock record: bench.json only (the CSV has its CLOCK_FIELDS)
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
            row.update(clock_cells(clocks), clocks=clocks)
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
                  on_shape: Callable[[int, int, str, list[dict]], None] | None = None) -> dict[str, Any]:
    """Every entry of `data` for this GPU: build, then per shape `repeats` runs of one
    `backend.compare` of all its kernels with the baselines in `modes` (each run after the
    first in a fresh worker). Returns plain data: rows, geomeans, skipped entries and the
    worker's notes per shape."""
    target = backend.target
    entries, skipped = select_entries(data, target)
    groups: dict[str, list[dict]] = {}
    for e in sorted(entries, key=lambda e: (e["M"] * e["N"] * e["K"], e["shape"])):
        groups.setdefault(e["shape"], []).append(e)
    thunks = [(e, builder.submit(e)) for e in entries]  # every compile starts now, in parallel
    build_of = {id(e): thunk for e, thunk in thunks}
    rows: list[dict] = []
    notes: dict[str, dict[str, str]] = {}
    for i, (shape_s, group) in enumerate(groups.items()):
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
            replies.append(_compare(backend, shape, candidates, modes, torch, timeout_s))
        notes[shape_s] = {k: v for reply in replies for k, v in reply.notes.items()}
        new = shape_rows(named, replies, modes, target, failed, warnings)
        rows.extend(new)
        if on_shape:
            on_shape(i, len(groups), shape_s, new)
    return {"gpu": target.name, "arch": target.arch, "backend": getattr(backend, "name", ""),
            "modes": list(modes), "repeats": repeats, "rows": rows, "geomeans": geomeans(rows, modes),
            "skipped": skipped, "notes": notes, "entries": len(data["entries"]),
            "simulated": bool(getattr(backend, "simulated", False))}


def _compare(backend, shape: Shape, candidates: dict[str, CandidateSpec], modes: list[str], torch: bool,
             timeout_s: float) -> CompareReply:
    """One compare; if it fails as a whole (a fault restarts the worker), each candidate alone,
    so one bad kernel does not take the others' rows with it."""
    reply = backend.compare(shape, candidates, timeout_s=timeout_s, modes=modes, torch=torch)
    if reply.ok or len(candidates) < 2:
        return reply
    merged = CompareReply(modes=list(modes), times_by_mode={m: {} for m in modes})
    sections: dict[str, list[dict]] = {m: [] for m in modes}
    for name, cand in candidates.items():
        one = backend.compare(shape, {name: cand}, timeout_s=timeout_s, modes=modes, torch=torch)
        for m in modes:
            sections[m].append(one.clocks_in(m) if one.ok else {})
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
    return merged


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
    """The report: per shape and mode ours vs every baseline; geomeans; skipped; notes."""
    modes = result["modes"]
    sim = "  [SIMULATED]" if result.get("simulated") else ""
    lines = [f"# hgemm-tune bench{(': ' + source) if source else ''}{sim}", "",
             f"GPU: {result['gpu']} ({result['arch']}); fp16 in/out, fp32 accumulate, TN (C = A·Bᵀ). Every "
             "kernel re-verified, then timed with the baselines interleaved in random order in one worker "
             "process. cuBLAS = cublasGemmEx(COMPUTE_32F); cuBLASLt = cublasLtMatmul, heuristic's first "
             "algorithm; cuBLASLt-auto = fastest of its top 16 on the shape; torch = torch.matmul(A, B.t(), "
             "out=C) on the same buffers and stream. vs X = X us / ours us (above 1: ours is faster).", ""]
    if "offline" in modes:
        lines.append("- offline: per contender a CUDA graph of back-to-back launches; median of 7 interleaved "
                     "replays.")
    if result.get("repeats", 1) > 1:
        lines.append(f"- {result['repeats']} runs, each in a fresh worker process: median times, median of the "
                     "per-run ratios (vs cuBLAS: with their range); a row counts only if every run verified it.")
    if "server" in modes:
        lines.append("- server: single launches (one-launch CUDA graphs), each after an L2 flush (a buffer of "
                     "2x the L2 overwritten) and a random 20-500 us idle gap; median.")
    lines.append("- clocks: NVML sampled every 15 ms while each mode's timing ran (all contenders of the shape "
                 "together): SM MHz median (min); power W, the mean from the energy counter (where the card has "
                 "none, the median of NVML's power readings, which average over about a second and lag a short "
                 "section); the regime (power-capped: the software power cap held the clock in >= 20% of the busy "
                 "samples; thermal; full clocks; unknown: no clock record); and the section's energy per GEMM over "
                 "every contender's launches (offline only; not split between contenders).")
    head = (["shape", "mode", "family", "ours us", "TFLOP/s", "% roofline"]
            + [f"{LABELS[b]} us" for b in BASELINES] + [f"vs {LABELS[b]}" for b in BASELINES] + ["verified"]
            + list(CLOCK_HEAD))
    left = ("shape", "mode", "family", "verified", "clock regime")
    lines += ["", "| " + " | ".join(head) + " |",
              "|" + "|".join("---" if h in left else "---:" for h in head) + "|"]
    for r in result["rows"]:
        cells = [r["shape"], r["mode"], r["family"], _f(r["ours_us"], ".2f"), _f(r["ours_tflops"], ".1f"),
                 _f(r["roofline_pct"], ".1f")]
        cells += [_f(r[f"{b}_us"], ".2f") for b in BASELINES]
        cells += [_speedup_cell(r, b) for b in BASELINES]
        cells.append(_verified(r))
        cells += clock_texts(r)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if not result["rows"]:
        lines.append("| " + " | ".join(["-"] * len(head)) + " |")
    lines += ["", "## Geomean speedup (baseline us / ours us) over the verified shapes", "",
              "| baseline | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    by = {(g["mode"], g["baseline"]): g for g in result["geomeans"]}
    for b in BASELINES:
        lines.append(f"| {LABELS[b]} | " + " | ".join(geomean_text(by[(m, b)]) for m in modes) + " |")
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


# Per-shape details that stay in bench.json only (the table would repeat them for every shape).
QUIET_NOTES = ("cublaslt_algos", "torch_check")


def note_lines(notes: dict[str, dict[str, str]]) -> list[str]:
    """The worker's notes, each distinct (key, text) once with the shapes it holds for: a
    baseline that was not measured, how torch was timed, what server mode did. Candidates'
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
    """bench.csv (one row per kernel and mode), bench_geomean.csv, bench.md, bench.json."""
    out.mkdir(parents=True, exist_ok=True)
    files = [write_csv(result["rows"], ROW_FIELDS, out / "bench.csv"),
             write_csv(result["geomeans"], GEOMEAN_FIELDS, out / "bench_geomean.csv")]
    md = out / "bench.md"
    md.write_text(markdown(result, source))
    js = out / "bench.json"
    js.write_text(json.dumps(result | {"source": source}, indent=1) + "\n")
    return files + [md, js]
