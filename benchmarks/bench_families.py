"""Benchmark: the tuned best of each family against cuBLAS, same process, same run.

    python benchmarks/bench_families.py [--shapes 4096x4096x8192,...] [--trials 24] [--out DIR]

For each shape and family it tunes (or resumes) a short study, takes the best verified
config, then verifies again and times all families' bests, cuBLAS, cuBLASLt's heuristic
pick and cuBLASLt autotuned (fastest of its top 16 on the shape) interleaved in random
order (CUDA-graph replays, median). Prints a markdown table with TFLOP/s and ratios, and
writes it to DIR/bench_families.md. --trials 0 skips tuning and re-measures the stored bests.
--pdl adds each library contender (best and variants) once more, launched with programmatic
dependent launch: its prologue overlaps the tail of the launch before it in the graph.
--variant KNOB=VALUE[,KNOB=VALUE] (repeatable) adds, for each shape, the best config with those
knobs changed as one more contender in the same timing run: an A/B test of a kernel change on
the configs that won without it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tuner.bench import GpuBackend
from tuner.compile import CompilePool
from tuner.export import best_per_family, load_studies
from tuner.render import render
from tuner.search import launch_spec, tune
from tuner.shapes import parse_shape
from tuner.space import UserError, load_space

# Issue 3's shapes: big squares, skinny (M or N <= 256) and odd sizes (tails).
SHAPES = ("4096x4096x8192,8192x8192x8192,16384x16384x16384,1024x1024x1024,256x4096x4096,64x8192x4096,"
          "8192x512x2048,128x16384x16384,16384x128x4096,3000x5000x1000")
VENDORS = ("cublas", "cublaslt", "cublaslt_auto")


def best_of_family(storage: str, shape: str, family: str):
    """The best verified trial of `family` for `shape` over every study in the storage
    (the per-family benchmark studies and any earlier `hgemm-tune` study of the shape)."""
    best = None
    for st in load_studies(storage):
        if st.user_attrs.get("shape") != shape:
            continue
        t = best_per_family(st).get(family)
        if t is not None and (best is None or t.value < best.value):
            best = t
    return best


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


def table(rows: list, target) -> str:
    """The markdown table of every (shape, family) row so far."""
    lines = [f"GPU: {target.name} ({target.arch}); fp16 in/out, fp32 accumulate, TN; CUDA-graph timed, "
             "median of 7 interleaved replays, all contenders in one process and run. cuBLAS = "
             "cublasGemmEx(COMPUTE_32F); Lt = cublasLtMatmul heuristic #1; Lt-auto = fastest of Lt's top 16.", "",
             "| shape | family | us | TFLOP/s | cuBLAS us | Lt us | Lt-auto us | vs cuBLAS | vs Lt | vs Lt-auto "
             "| verified | config |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]

    def us(t):
        return f"{t:.2f}" if t else "-"

    def ratio(vendor_t, t):
        return f"{vendor_t / t:.3f}" if vendor_t and t else "-"

    for shape, fam, t, vendor, ok, note in rows:
        if t is None or vendor is None:
            lines.append(f"| {shape} | {fam} | - | - | - | - | - | - | - | - | {ok} | {note} |")
            continue
        lines.append(f"| {shape} | {fam} | {t:.2f} | {shape.tflops(t):.1f} | {us(vendor['cublas'])} | "
                     f"{us(vendor['cublaslt'])} | {us(vendor['cublaslt_auto'])} | {ratio(vendor['cublas'], t)} | "
                     f"{ratio(vendor['cublaslt'], t)} | {ratio(vendor['cublaslt_auto'], t)} | {ok} | `{note}` |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--families", default="cute_sm90,cute_sm80")
    ap.add_argument("--trials", type=int, default=24, help="trials per (shape, family) study")
    ap.add_argument("--storage", default="sqlite:///runs/hgemm.db")
    ap.add_argument("--out", default="runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pdl", action="store_true",
                    help="also time each library family's best launched with programmatic dependent launch")
    ap.add_argument("--variant", action="append", default=[], metavar="KNOB=VALUE[,KNOB=VALUE]",
                    help="also time each family's best with these knobs changed (repeatable)")
    ap.add_argument("--time-per-family", type=float, default=40.0,
                    help="seconds of search per (shape, cute family); wmma gets a third")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    space = load_space("space.yaml")
    backend = GpuBackend(log_path=out / "bench_worker.log")
    pool = CompilePool()
    target = backend.target
    rows = []
    t0 = time.perf_counter()
    # Phase 1: tune (unless --trials 0) and pick every shape's bests, starting their builds
    # at once so that nvcc runs on every core while earlier shapes tune or are timed.
    picked = []  # (shape, {contender: (family, compile future, run-time variant, full config, pdl)})
    for shape_s in args.shapes.split(","):
        shape = parse_shape(shape_s)
        builds = {}
        for fam_name in args.families.split(","):
            fam = space.family(fam_name)
            if args.trials > 0:
                tune(space, [fam_name], shape, backend, trials=args.trials, storage=args.storage,
                     seed=args.seed, pool=pool,
                     # wmma compiles in a second, CuTe in 20-50 s: give the slow families the time
                     timeout_s=args.time_per_family / (3 if fam_name == "wmma" else 1))
            best = best_of_family(args.storage, str(shape), fam_name)
            if best is None:
                rows.append((shape, fam_name, None, None, None, "no verified kernel"))
                continue
            a = best.user_attrs
            full = fam.complete_stored(a["config"] | a["variant"])  # older studies hold ACCUM
            future = pool.submit(render(fam, full, target.arch), target.arch, fam.artifact)
            builds[fam_name] = (fam_name, future, a["variant"], full, False)
            for text in args.variant:
                try:
                    changed = fam.complete(full | parse_overrides(text))
                except UserError as e:
                    raise SystemExit(f"--variant {text!r}: {e}") from None
                if changed == full or fam.violations(changed, shape, target):
                    continue  # the best already has these values, or they cannot run this shape
                runtime = {k.name: changed[k.name] for k in fam.runtime_knobs}
                future = pool.submit(render(fam, changed, target.arch), target.arch, fam.artifact)
                builds[f"{fam_name}+{text}"] = (fam_name, future, runtime, changed, False)
            if args.pdl and fam.artifact == "library":  # the same builds, launched with PDL
                for name, (fam_of, future, variant, config, _) in list(builds.items()):
                    if fam_of == fam_name:
                        builds[f"{name}+PDL"] = (fam_of, future, variant, config, True)
        picked.append((shape, builds))
    # Phase 2: verify again and time each shape's bests against the vendor libraries.
    for shape, builds in picked:
        candidates, configs = {}, {}
        for fam_name, (fam_of, future, variant, full, pdl) in builds.items():
            cres = future.result()
            if not cres.ok:
                rows.append((shape, fam_name, None, None, None, f"build failed: {(cres.error or '')[:200]}"))
                continue
            launch = launch_spec(space.family(fam_of), full, shape, target) | {"pdl": pdl}
            candidates[fam_name] = {"cubin": cres.cubin, "variant": variant, "launch": launch}
            configs[fam_name] = full
        if not candidates:
            continue
        reply = backend.compare(shape, candidates)
        if reply.get("status") != "ok":
            rows.append((shape, "-", None, None, None, f"compare failed: {reply.get('reason')}"))
            continue
        times = reply["times"]
        vendor = {v: times.get(v) for v in VENDORS}
        for fam_name in candidates:
            ok = reply["verify"][fam_name]["ok"]
            rows.append((shape, fam_name, times.get(fam_name), vendor, ok,
                         json.dumps(configs[fam_name], separators=(",", ":")) if ok
                         else reply["verify"][fam_name]["reason"]))
        print(f"{shape}: done at {time.perf_counter() - t0:.0f} s {reply.get('notes', {})}", flush=True)
        (out / "bench_families.md").write_text(table(rows, target) + "\n")  # a cut-off run keeps its rows
    backend.close()
    pool.close()
    text = table(rows, target)
    (out / "bench_families.md").write_text(text + "\n")
    print(text)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
