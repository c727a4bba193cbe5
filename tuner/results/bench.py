"""`hgemm-tune bench`: re-verify and time every exported kernel against the vendor libraries.

One pipeline stage on plain data. In: an export (tuner.export JSON, schema-validated) and a
backend whose `compare(shape, candidates, modes=...)` verifies the candidates and times them
with cuBLAS, cuBLASLt (heuristic and autotuned) and torch.matmul interleaved in random order
in one worker process (tuner.gpu_worker). Out: one row (a plain dict) per exported kernel and
timing mode, then CSV, markdown and the geomean speedup per baseline and mode.

- offline: per contender a CUDA graph of back-to-back launches (host overhead excluded).
- server:  single launches, each after an L2 flush and a random idle gap (cold, from idle).

A kernel that fails re-verification (or does not build, load or run) is a row that says so
with the reason; it has no time and never counts as a win. Entries tuned on another GPU (or
arch, layout, accumulation) are skipped and listed.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuner.errors import UserError
from tuner.shapes import Shape, parse_shape

MODES = ("offline", "server")
BASELINES = ("cublas", "cublaslt", "cublaslt_auto", "torch")
LABELS = {"cublas": "cuBLAS", "cublaslt": "cuBLASLt", "cublaslt_auto": "cuBLASLt-auto", "torch": "torch"}
ROW_FIELDS = (["shape", "M", "N", "K", "mode", "family", "status", "verified", "reason",
               "ours_us", "ours_tflops", "roofline_pct"]
              + [f"{b}_us" for b in BASELINES] + [f"speedup_{b}" for b in BASELINES]
              + ["export_us", "pick", "knobs", "notes"])
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
    """Export entry -> the GPU worker's candidate {cubin, launch, variant}, compiled in a pool.

    `submit(entry)` starts the compile and returns a thunk; calling it waits and returns
    (candidate, warnings) or raises UserError with the reason the kernel cannot run."""

    def __init__(self, space, target, pool):
        self.space, self.target, self.pool = space, target, pool

    def submit(self, entry: dict[str, Any]) -> Callable[[], tuple[dict, list[str]]]:
        from tuner.loader import entry_build

        try:
            build = entry_build(self.space, entry, self.target)
            fam = self.space.family(build.family)
            why = fam.violations(build.config, parse_shape(entry["shape"]), self.target)
            if why:
                raise UserError(f"config no longer valid on {self.target.arch}: {'; '.join(why)}")
        except UserError as exc:
            err = str(exc)

            def failed() -> tuple[dict, list[str]]:
                raise UserError(err)

            return failed
        future = self.pool.submit(build.source, self.target.arch, build.artifact)
        warnings = [f"{build.template} changed since this entry was tuned: today's template is measured"
                    ] if build.template_changed else []

        def wait() -> tuple[dict, list[str]]:
            res = future.result()
            if not res.ok:
                first = (res.error or "").strip().splitlines()[:2]
                raise UserError(f"does not compile: {' '.join(first)}")
            return {"cubin": res.cubin, "launch": build.launch, "variant": build.variant}, warnings

        return wait


def _base_row(entry: dict[str, Any], mode: str) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in ROW_FIELDS}
    row.update(shape=entry["shape"], M=entry["M"], N=entry["N"], K=entry["K"], mode=mode, family=entry["family"],
               verified=False, export_us=entry.get("time_us"), pick=entry.get("pick"),
               knobs=json.dumps(entry["knobs"], sort_keys=True, separators=(",", ":")), notes="")
    return row


def _times(reply: dict[str, Any], mode: str) -> dict[str, float]:
    by_mode = reply.get("times_by_mode")
    if by_mode is not None:
        return by_mode.get(mode) or {}
    return reply.get("times", {}) if mode == "offline" else {}  # an older worker: offline only


def shape_rows(entries: dict[str, dict], reply: dict[str, Any], modes: list[str], target,
               failed: dict[str, str] | None = None, warnings: dict[str, list[str]] | None = None) -> list[dict]:
    """Rows for one shape from one compare reply. `entries`: candidate name -> export entry;
    `failed`: candidate name -> why it never reached the GPU (build/compile)."""
    failed = failed or {}
    warnings = warnings or {}
    notes = {k: v for k, v in (reply.get("notes") or {}).items()}
    baseline_notes = [f"{LABELS[b]}: {notes[b]}" for b in BASELINES if b in notes]
    rows = []
    for name, entry in entries.items():
        shape = parse_shape(entry["shape"])
        roof_us = target.roofline_us(shape.flops, shape.min_bytes)
        for mode in modes:
            row = _base_row(entry, mode)
            times = _times(reply, mode) if reply.get("status") == "ok" else {}
            for b in BASELINES:
                row[f"{b}_us"] = times.get(b)
            row["notes"] = "; ".join(warnings.get(name, []) + baseline_notes)
            report = (reply.get("verify") or {}).get(name)
            ours = times.get(name)
            if name in failed:
                row.update(status="failed", reason=failed[name])
            elif reply.get("status") != "ok":
                row.update(status="failed", reason=f"{reply.get('kind') or reply.get('status')}: {reply.get('reason')}")
            elif not report or not report.get("ok"):
                report = report or {}
                row.update(status="failed", reason=f"{report.get('kind', 'wrong')}: "
                                                   f"{report.get('reason', 'no verification report came back')}")
            elif ours is None:
                row.update(status="not_timed", verified=True, reason=notes.get(name, "verified, but no time came back"))
            elif ours < roof_us * ROOFLINE_SLACK:
                row.update(status="rejected", verified=True, ours_us=ours,
                           reason=f"{ours:.2f} us is under the roofline ({roof_us:.2f} us): a measurement bug")
            else:
                row.update(status="ok", verified=True, ours_us=ours, ours_tflops=shape.tflops(ours),
                           roofline_pct=100.0 * roof_us / ours)
                for b in BASELINES:
                    if row[f"{b}_us"]:
                        row[f"speedup_{b}"] = row[f"{b}_us"] / ours
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
                  timeout_s: float = 900.0,
                  on_shape: Callable[[int, int, str, list[dict]], None] | None = None) -> dict[str, Any]:
    """Every entry of `data` for this GPU: build, then per shape one `backend.compare` of all
    its kernels with the baselines in `modes`. Returns plain data: rows, geomeans, skipped
    entries and the worker's notes per shape."""
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
        reply = _compare(backend, shape, candidates, modes, torch, timeout_s) if candidates else {
            "status": "ok", "verify": {}, "times_by_mode": {}, "notes": {}}
        notes[shape_s] = dict(reply.get("notes") or {})
        new = shape_rows(named, reply, modes, target, failed, warnings)
        rows.extend(new)
        if on_shape:
            on_shape(i, len(groups), shape_s, new)
    return {"gpu": target.name, "arch": target.arch, "backend": getattr(backend, "name", ""),
            "modes": list(modes), "rows": rows, "geomeans": geomeans(rows, modes), "skipped": skipped,
            "notes": notes, "entries": len(data["entries"]), "simulated": bool(getattr(backend, "simulated", False))}


def _compare(backend, shape: Shape, candidates: dict[str, dict], modes: list[str], torch: bool,
             timeout_s: float) -> dict[str, Any]:
    """One compare; if it fails as a whole (a fault restarts the worker), each candidate alone,
    so one bad kernel does not take the others' rows with it."""
    reply = backend.compare(shape, candidates, timeout_s=timeout_s, modes=modes, torch=torch)
    if reply.get("status") == "ok" or len(candidates) < 2:
        return reply
    merged: dict[str, Any] = {"status": "ok", "verify": {}, "times_by_mode": {m: {} for m in modes},
                              "notes": {}}
    for name, cand in candidates.items():
        one = backend.compare(shape, {name: cand}, timeout_s=timeout_s, modes=modes, torch=torch)
        if one.get("status") != "ok":
            merged["verify"][name] = {"ok": False, "kind": one.get("kind") or one.get("status"),
                                      "reason": f"compare failed: {one.get('reason')}"}
            continue
        merged["verify"].update(one.get("verify", {}))
        merged["notes"].update(one.get("notes", {}))
        for m in modes:
            for k, v in _times(one, m).items():
                if k == name or k not in merged["times_by_mode"][m]:
                    merged["times_by_mode"][m][k] = v  # baselines: from the first run that timed them
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


def _verified(row: dict) -> str:
    if row["status"] == "ok":
        return "yes"
    label = {"failed": "FAILED", "not_timed": "yes, NOT TIMED", "rejected": "yes, TIME REJECTED"}[row["status"]]
    return f"{label}: {row['reason']}".replace("|", "\\|")


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
    if "server" in modes:
        lines.append("- server: single launches (one-launch CUDA graphs), each after an L2 flush (a buffer of "
                     "2x the L2 overwritten) and a random 20-500 us idle gap; median.")
    head = (["shape", "mode", "family", "ours us", "TFLOP/s", "% roofline"]
            + [f"{LABELS[b]} us" for b in BASELINES] + [f"vs {LABELS[b]}" for b in BASELINES] + ["verified"])
    lines += ["", "| " + " | ".join(head) + " |",
              "|" + "|".join("---" if h in ("shape", "mode", "family", "verified") else "---:" for h in head) + "|"]
    for r in result["rows"]:
        cells = [r["shape"], r["mode"], r["family"], _f(r["ours_us"], ".2f"), _f(r["ours_tflops"], ".1f"),
                 _f(r["roofline_pct"], ".1f")]
        cells += [_f(r[f"{b}_us"], ".2f") for b in BASELINES]
        cells += [_f(r[f"speedup_{b}"], ".3f") for b in BASELINES]
        cells.append(_verified(r))
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
