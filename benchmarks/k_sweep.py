"""Fixed cost or bandwidth? Time one shape's stored best and the vendor libraries over K.

    python benchmarks/k_sweep.py --shape 16384x128x4096 --ks 1024,2048,4096,8192,16384 \\
        --storage sqlite:///runs/final_bench.db [--variant SCHEDULER=persistent]

For a memory-bound skinny GEMM the time is close to t = t0 + bytes / BW: a fixed cost t0
(launch, prologue, pipeline fill, epilogue, tail) plus the operand bytes streamed at a
steady bandwidth BW. The stored best of the base shape (and any --variant of it) is built
once and timed, in one run with cuBLAS, cuBLASLt and cuBLASLt autotuned, at M x N x K for
every K; a least-squares line through each contender's times gives its t0 and BW. Whether
ours trails cuBLAS by a constant (t0) or by a rate (BW) says where a kernel change must go
(NOTES.md, session 7). Every kernel is verified at every K before it is timed.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_families import best_of_family, parse_overrides  # this script's folder

from tuner.bench import GpuBackend
from tuner.compile import CompilePool
from tuner.confirm import VENDORS
from tuner.render import render
from tuner.search import compare_candidate
from tuner.shapes import Shape, parse_shape
from tuner.space import load_space


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(t0 in us, BW in TB/s) of the least-squares line t = t0 + bytes / BW."""
    x = np.array([b for b, _ in points], dtype=float)
    y = np.array([t for _, t in points], dtype=float)
    slope, t0 = np.polyfit(x, y, 1)
    return float(t0), float(1e-6 / slope) if slope > 0 else float("inf")  # bytes/us -> TB/s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, help="base shape MxNxK whose stored best is swept over K")
    ap.add_argument("--ks", default="1024,2048,4096,8192,16384")
    ap.add_argument("--storage", default="sqlite:///runs/hgemm.db")
    ap.add_argument("--family", default="cute_sm90")
    ap.add_argument("--variant", action="append", default=[], metavar="KNOB=VALUE[,KNOB=VALUE]",
                    help="also sweep the best with these knobs changed (repeatable)")
    args = ap.parse_args()
    base = parse_shape(args.shape)
    space = load_space("space.yaml")
    fam = space.family(args.family)
    backend = GpuBackend()
    target = backend.target
    best = best_of_family(args.storage, str(base), args.family)
    if best is None:
        raise SystemExit(f"no verified {args.family} trial for {base} in {args.storage}")
    a = best.user_attrs
    configs = {"ours": fam.complete_stored(a["config"] | a["variant"])}
    for text in args.variant:
        configs[f"ours+{text}"] = fam.complete(configs["ours"] | parse_overrides(text))
    pool = CompilePool()
    builds = {name: pool.submit(render(fam, full, target.arch), target.arch, fam.artifact)
              for name, full in configs.items()}
    shapes = [Shape(base.M, base.N, int(k)) for k in args.ks.split(",")]
    times: dict[str, list[tuple[Shape, float]]] = {}
    for shape in shapes:
        candidates = {}
        for name, full in configs.items():
            built = builds[name].result()
            if not built.ok:
                raise SystemExit(f"{name}: build failed: {(built.error or '')[:300]}")
            if fam.violations(full, shape, target):
                continue
            candidates[name] = compare_candidate(fam, full, shape, target, built.cubin)
        reply = backend.compare(shape, candidates, torch=False)
        if reply.get("status") != "ok":
            raise SystemExit(f"{shape}: compare failed: {reply.get('reason')}")
        for name in list(candidates) + list(VENDORS):
            verified = name in VENDORS or reply["verify"][name]["ok"]
            t = reply["times"].get(name)
            if verified and t:
                times.setdefault(name, []).append((shape, t))
            elif not verified:
                print(f"{shape} {name}: FAILED verification: {reply['verify'][name].get('reason')}")
        print(f"{shape}: done", flush=True)
    backend.close()
    pool.close()
    print(f"\nGPU: {target.name}; fp16 TN, fp32 accumulate; CUDA-graph timed, median of interleaved replays; "
          f"{args.family} best of {base}:")
    for name, full in configs.items():
        print(f"  {name}: {full}")
    print("\n| contender | " + " | ".join(f"K={s.K} us" for s in shapes) + " | t0 us | BW TB/s |")
    print("|---|" + "---:|" * (len(shapes) + 2))
    for name, pts in times.items():
        by_k = {s.K: t for s, t in pts}
        t0, bw = fit([(s.min_bytes, t) for s, t in pts]) if len(pts) >= 2 else (float("nan"),) * 2
        cells = " | ".join(f"{by_k[s.K]:.2f}" if s.K in by_k else "-" for s in shapes)
        print(f"| {name} | {cells} | {t0:.2f} | {bw:.2f} |")


if __name__ == "__main__":
    main()
