"""Benchmark: the tuned best of each family against cuBLAS, same process, same run.

    python benchmarks/bench_families.py [--shapes 4096x4096x8192,...] [--trials 24] [--out DIR]

For each shape and family it tunes (or resumes) a short study, takes the best verified
config, then verifies again and times all families' bests, cuBLAS, cuBLASLt's heuristic
pick and cuBLASLt autotuned (fastest of its top 16 on the shape) interleaved in random
order (CUDA-graph replays, median). Prints a markdown table with TFLOP/s and ratios, and
writes it to DIR/bench_families.md, and as data to DIR/bench_families.json. --trials 0 skips
tuning and re-measures the stored bests.
--pdl adds each library contender (best and variants) once more, launched with programmatic
dependent launch: its prologue overlaps the tail of the launch before it in the graph.
--variant [SHAPE:]KNOB=VALUE[,KNOB=VALUE] (repeatable) adds, for each shape (or only SHAPE), the
best config with those knobs changed as one more contender in the same timing run: an A/B test
of a kernel change on the configs that won without it.

Near-equal configs swap places from run to run (a few percent at 15-40 us), so a study's best is
partly luck. --top K re-measures each family's K best stored configs in --select-runs S selection
runs of their own (default 3, each in a fresh worker) and keeps the lowest median; --repeats R then
times the kept ones against the vendors in R more runs, each in a fresh worker process (new
buffers), and reports median times and the median and range of the per-run ratios. No selection
run is one of the reported runs, so picking the luckiest of K does not flatter the table.

--build-only needs no GPU: it compiles every contender the same arguments would time (for --arch),
and with --trials N the seeds a fresh study tries first, into the compile cache and stops. Build on a
CPU machine, carry the cache (HGEMM_TUNE_CACHE) to the GPU machine, and its run spends no GPU time
waiting for nvcc on those builds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from tuner.bench import GpuBackend
from tuner.compile import CompilePool
from tuner.confirm import VENDORS, PairedRuns, distinct_best, stored_config
from tuner.export import load_studies
from tuner.render import render
from tuner.search import compare_candidate, gpu_model, prepare, seed_configs, study_name, tune
from tuner.shapes import parse_shape
from tuner.space import UserError, load_space
from tuner.target import target_for_arch

# Issue 3's shapes: big squares, skinny (M or N <= 256) and odd sizes (tails).
SHAPES = ("4096x4096x8192,8192x8192x8192,16384x16384x16384,1024x1024x1024,256x4096x4096,64x8192x4096,"
          "8192x512x2048,128x16384x16384,16384x128x4096,3000x5000x1000")


def best_of_family(storage: str, shape: str, family: str):
    """The best verified trial of `family` for `shape` over every study in the storage
    (the per-family benchmark studies and any earlier `hgemm-tune` study of the shape)."""
    top = top_of_family(storage, shape, family, 1)
    return top[0] if top else None


def top_of_family(storage: str, shape: str, family: str, k: int, complete=None, study: str | None = None,
                  gpu: str | None = None) -> list:
    """The `k` best verified trials of `family` for `shape` over every study in the storage
    (or only the study named `study`), one per distinct config (compile and run-time knobs);
    with `gpu` (a model) only those measured on it, where there are any (`current_ok`).
    `complete` (the family's `complete_stored`) fills in knobs that older studies did not have,
    so that the same kernel stored with and without a since-added default counts once."""
    trials = []
    for st in load_studies(storage):
        if st.user_attrs.get("shape") == shape and study in (None, st.study_name):
            trials += [t for t in st.get_trials(deepcopy=False) if t.user_attrs.get("family") == family]
    return distinct_best(trials, k, (lambda t: complete(stored_config(t))) if complete else None, gpu)


def parse_overrides(text: str) -> dict:
    """'L2_HINT=stream_a,STAGES=6' -> {'L2_HINT': 'stream_a', 'STAGES': 6}
    (values that read as integers become integers, as in space.yaml)."""
    out = {}
    for part in filter(None, text.split(",")):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--variant {text!r}: expected KNOB=VALUE[,KNOB=VALUE], got {part!r}")
        value = value.strip()
        out[name.strip()] = int(value) if value.lstrip("-").isdigit() else value
    return out


class Row(PairedRuns):
    """One contender's line of the table: its runs (medians, per-run ratios to each vendor)."""

    def __init__(self, shape, name: str, note: str, times: list | None = None, vendors: list | None = None,
                 ok: bool | None = None):
        super().__init__(times, vendors)
        self.shape, self.name, self.note, self.ok = shape, name, note, ok


def table(rows: list[Row], target, runs: int = 1) -> str:
    """The markdown table of every row so far."""
    lines = [f"GPU: {target.name} ({target.arch}); fp16 in/out, fp32 accumulate, TN; CUDA-graph timed, "
             "median of 7 interleaved replays, all contenders in one process and run. cuBLAS = "
             "cublasGemmEx(COMPUTE_32F); Lt = cublasLtMatmul heuristic #1; Lt-auto = fastest of Lt's top 16."]
    if runs > 1:
        lines.append(f"{runs} runs, each in a fresh worker process: times are medians over the runs, ratios the "
                     "median of the per-run ratios; `cuBLAS range` is the lowest and highest per-run ratio.")
    lines += ["", "| shape | family | us | TFLOP/s | cuBLAS us | Lt us | Lt-auto us | vs cuBLAS | vs Lt | vs Lt-auto "
              + ("| cuBLAS range " if runs > 1 else "") + "| verified | config |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if runs > 1 else "") + "---|---|"]

    def us(t):
        return f"{t:.2f}" if t else "-"

    def ratio(r: Row, vendor: str) -> str:
        rs = r.ratios(vendor)
        return f"{statistics.median(rs):.3f}" if rs else "-"

    for r in rows:
        t = r.median()
        spread = ""
        if runs > 1:
            rs = r.ratios("cublas")
            spread = f"| {min(rs):.3f}-{max(rs):.3f} " if rs else "| - "
        if t is None:
            lines.append(f"| {r.shape} | {r.name} | - | - | - | - | - | - | - | - {spread}| {r.ok} | {r.note} |")
            continue
        lines.append(f"| {r.shape} | {r.name} | {t:.2f} | {r.shape.tflops(t):.1f} | {us(r.median('cublas'))} | "
                     f"{us(r.median('cublaslt'))} | {us(r.median('cublaslt_auto'))} | {ratio(r, 'cublas')} | "
                     f"{ratio(r, 'cublaslt')} | {ratio(r, 'cublaslt_auto')} {spread}| {r.ok} | `{r.note}` |")
    return "\n".join(lines)


def results(rows: list[Row], target, runs: int = 1) -> dict:
    """The table as plain data (bench_families.json), for scripts that check it (issue3_check.py)."""
    return {"gpu": target.name, "arch": target.arch, "runs": runs, "rows": [
        {"shape": str(r.shape), "contender": r.name, "verified": r.ok, "us": r.median(),
         "vendor_us": {v: r.median(v) for v in VENDORS}, "ratios": {v: r.ratios(v) for v in VENDORS},
         "config": json.loads(r.note) if r.ok and r.note.startswith("{") else None,
         "note": "" if r.ok else r.note} for r in rows]}


def write_results(out: Path, rows: list[Row], target, runs: int) -> str:
    """Write the table (bench_families.md) and its data (bench_families.json); return the table."""
    text = table(rows, target, runs)
    (out / "bench_families.md").write_text(text + "\n")
    (out / "bench_families.json").write_text(json.dumps(results(rows, target, runs), indent=1) + "\n")
    return text


def select(backend, shape, candidates: dict, configs: dict, rows: list, runs: int = 1) -> None:
    """--top: each family's K best ('FAMILY#i' names) timed in `runs` selection runs, a fresh worker
    for each after the first; the one with the lowest median that verified in every run takes the family's name, the
    others leave `candidates`. One run is a coin flip when the K are within 1-2% of each other (session
    11: 42.28 against 42.30 us picked a kernel 3% slower over the next five runs)."""
    timed: dict[str, list[float] | None] = {name: [] for name in candidates}  # None: failed a run
    for run in range(runs):
        if run:
            backend.restart()
        reply = backend.compare(shape, candidates, torch=False)
        if reply.get("status") != "ok":
            rows.append(Row(shape, "-", f"selection run {run + 1} failed: {reply.get('reason')}"))
            return
        for name, so_far in timed.items():
            if so_far is not None:
                ok = reply["verify"][name]["ok"] and reply["times"].get(name)
                timed[name] = so_far + [reply["times"][name]] if ok else None
    groups: dict[str, list[str]] = {}
    for name in candidates:
        if "#" in name and "+" not in name:
            groups.setdefault(name.partition("#")[0], []).append(name)
    for fam_name, names in groups.items():
        ok = [n for n in names if timed[n]]
        best = min(ok, key=lambda n: statistics.median(timed[n])) if ok else None
        for n in names:
            cand, cfg = candidates.pop(n), configs.pop(n)
            if n == best:
                candidates[fam_name], configs[fam_name] = cand, cfg
        line = ", ".join(f"#{n.partition('#')[2]} {statistics.median(timed[n]):.2f}" for n in ok)
        print(f"{shape} {fam_name}: top {len(names)}, median of {runs} selection run(s) (us): {line}; "
              f"kept {'#' + best.partition('#')[2] if best else 'none'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--families", default="cute_sm90,cute_sm80")
    ap.add_argument("--trials", type=int, default=24, help="trials per (shape, family) study")
    ap.add_argument("--storage", default="sqlite:///runs/hgemm.db")
    ap.add_argument("--out", default="runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--study-tag", default="",
                    help="tune into a new study named '<shape's study>-TAG' (fresh: the seeds run first) "
                         "instead of resuming the shape's study; the best is still taken over all studies")
    ap.add_argument("--tagged-only", action="store_true",
                    help="with --study-tag: take the best (or --top K) from that study only. Stored times of "
                         "different sessions were measured on different GPUs (one kernel moved 4%% between "
                         "two H200s), so the fair pool is one study from one machine")
    ap.add_argument("--pdl", action="store_true",
                    help="also time each library family's best launched with programmatic dependent launch")
    ap.add_argument("--variant", action="append", default=[], metavar="[SHAPE:]KNOB=VALUE[,KNOB=VALUE]",
                    help="also time each family's best (for SHAPE only, if given) with these knobs changed "
                         "(repeatable)")
    ap.add_argument("--top", type=int, default=1,
                    help="re-measure each family's K best stored configs in --select-runs runs, keep the lowest median")
    ap.add_argument("--select-runs", type=int, default=3,
                    help="with --top: selection runs (each in a fresh worker); the lowest median is kept")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time the kept contenders and the vendors in R runs, each in a fresh worker")
    ap.add_argument("--time-per-family", type=float, default=40.0,
                    help="seconds of search per (shape, cute family); wmma gets a third")
    ap.add_argument("--build-only", action="store_true",
                    help="compile the contenders (and with --trials N the study's seeds) into the cache and "
                         "stop (no GPU needed)")
    ap.add_argument("--arch", default="sm_90a", help="with --build-only: the GPU arch to build for")
    args = ap.parse_args()
    if args.tagged_only and not args.study_tag:
        raise SystemExit("--tagged-only: name the study with --study-tag TAG")
    for text in args.variant:
        only = text.rpartition(":")[0]
        try:
            parse_shape(only) if only else None
        except UserError as e:
            raise SystemExit(f"--variant {text!r}: {e}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    space = load_space("space.yaml")
    backend = None if args.build_only else GpuBackend(log_path=out / "bench_worker.log")
    pool = CompilePool()
    target = target_for_arch(args.arch) if args.build_only else backend.target
    rows = []
    t0 = time.perf_counter()
    # Phase 1: tune (unless --trials 0) and pick every shape's bests, starting their builds
    # at once so that nvcc runs on every core while earlier shapes tune or are timed.
    picked = []  # (shape, {contender: (family, compile future, full config, pdl)})
    for shape_s in args.shapes.split(","):
        shape = parse_shape(shape_s)
        builds = {}
        for fam_name in args.families.split(","):
            fam = space.family(fam_name)
            name = study_name(shape, [fam], target.arch) + (f"-{args.study_tag}" if args.study_tag else "")
            if args.trials > 0 and args.build_only:  # the seeds a fresh study measures first
                cpu = SimpleNamespace(target=target, needs_cubin=True)
                for i, seed in enumerate(seed_configs(fam, shape)[:args.trials]):
                    pending = prepare(fam, seed, shape, cpu, pool)
                    if pending.future:  # None: the seed cannot run this shape
                        builds[f"{fam_name}:seed{i}"] = (fam_name, pending.future, seed, False)
            elif args.trials > 0:
                tune(space, [fam_name], shape, backend, trials=args.trials, storage=args.storage, name=name,
                     seed=args.seed, pool=pool,
                     # wmma compiles in a second, CuTe in 20-50 s: give the slow families the time
                     timeout_s=args.time_per_family / (3 if fam_name == "wmma" else 1))
            try:
                top = top_of_family(args.storage, str(shape), fam_name, max(args.top, 1), fam.complete_stored,
                                    study=name if args.tagged_only else None,
                                    gpu=gpu_model(backend.name) if backend else None)
            except UserError:
                if not (args.build_only and args.trials > 0):
                    raise
                top = []  # building a fresh study's seeds before its storage exists
            if not top:
                rows.append(Row(shape, fam_name, "no verified kernel"))
                continue
            # older studies hold ACCUM and lack knobs added since: complete_stored
            stored = [fam.complete_stored(t.user_attrs["config"] | t.user_attrs["variant"]) for t in top]
            for i, config in enumerate(stored):
                future = pool.submit(render(fam, config, target.arch), target.arch, fam.artifact)
                builds[fam_name + (f"#{i}" if args.top > 1 else "")] = (fam_name, future, config, False)
            full = stored[0]  # --variant and --pdl apply to the stored best (#0 with --top), not the other top-K
            twin_sources = [fam_name + ("#0" if args.top > 1 else "")]
            for text in args.variant:
                only, _, knobs = text.rpartition(":")
                if only and parse_shape(only) != shape:
                    continue
                try:
                    changed = fam.complete(full | parse_overrides(knobs))
                except UserError as e:
                    raise SystemExit(f"--variant {text!r}: {e}") from None
                why = (["the best already has these values"] if changed == full
                       else fam.violations(changed, shape, target))
                if why:  # said, not dropped silently: a missing row reads as a lost result
                    print(f"{shape} {fam_name}+{text}: skipped: {'; '.join(why)}", flush=True)
                    continue
                future = pool.submit(render(fam, changed, target.arch), target.arch, fam.artifact)
                builds[f"{fam_name}+{text}"] = (fam_name, future, changed, False)
                twin_sources.append(f"{fam_name}+{text}")
            if args.pdl and fam.artifact == "library":  # the same builds, launched with PDL
                for name in twin_sources:
                    builds[f"{name}+PDL"] = builds[name][:3] + (True,)
        picked.append((shape, builds))
    if args.build_only:
        for shape, builds in picked:
            for name, (_, future, _, _) in builds.items():
                cres = future.result()
                if not cres.ok:
                    status = f"build failed: {(cres.error or '')[:200]}"
                else:
                    status = ("cached" if cres.cached else f"built in {cres.seconds:.0f} s") + \
                        f", {cres.registers} registers, {cres.spill_bytes} spill bytes"
                print(f"{shape} {name}: {status}", flush=True)
        pool.close()
        return
    # Phase 2: verify again and time each shape's bests against the vendor libraries.
    for shape, builds in picked:
        candidates, configs = {}, {}
        for fam_name, (fam_of, future, full, pdl) in builds.items():
            cres = future.result()
            if not cres.ok:
                rows.append(Row(shape, fam_name, f"build failed: {(cres.error or '')[:200]}"))
                continue
            candidates[fam_name] = compare_candidate(space.family(fam_of), full, shape, target, cres.cubin, pdl)
            configs[fam_name] = full
        selected = args.top > 1 and bool(candidates)
        if selected:
            select(backend, shape, candidates, configs, rows, args.select_runs)
        if not candidates:
            continue
        shape_rows = {name: Row(shape, name, "", ok=True) for name in candidates}
        for run in range(args.repeats):
            if run or selected:  # the reported runs share no worker with the selection
                backend.restart()
            reply = backend.compare(shape, candidates)
            if reply.get("status") != "ok":
                rows.append(Row(shape, "-", f"compare failed (run {run + 1}): {reply.get('reason')}"))
                continue
            times = reply["times"]
            for name, row in shape_rows.items():
                verdict = reply["verify"][name]
                row.ok = row.ok and verdict["ok"]
                row.note = json.dumps(configs[name], separators=(",", ":")) if row.ok else verdict["reason"]
                row.times.append(times.get(name) if verdict["ok"] else None)
                row.vendors.append({v: times.get(v) for v in VENDORS})
            print(f"{shape}: run {run + 1} done at {time.perf_counter() - t0:.0f} s {reply.get('notes', {})}",
                  flush=True)
        for name, row in shape_rows.items():
            if args.repeats > 1:  # the table shows medians; the log keeps every run's ratio
                print(f"{shape} {name}: per-run vs cuBLAS " + ", ".join(f"{r:.3f}" for r in row.ratios("cublas")))
        rows += shape_rows.values()
        write_results(out, rows, target, args.repeats)  # a cut-off run keeps its rows
    backend.close()
    pool.close()
    print(write_results(out, rows, target, args.repeats))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
