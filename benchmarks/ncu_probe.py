"""Run one cute_sm90 config and cuBLAS on one shape, a few launches each, for a profiler.

    ncu --metrics dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,... \\
        python benchmarks/ncu_probe.py --shape 16384x128x4096 --config '{"TILE_M": 128, ...}'

Nothing is timed here: the profiler measures. It answers questions the timings cannot,
such as how many DRAM bytes each kernel really reads and what share of peak DRAM
bandwidth it sustains (NOTES.md, session 5: are the skinny shapes at the DRAM ceiling?).
"""

from __future__ import annotations

import argparse
import json

from tuner.compile import compile_source
from tuner.gpu_worker import Buffers, Cublas, _cp, load_candidate
from tuner.render import render
from tuner.search import launch_spec
from tuner.shapes import parse_shape
from tuner.space import load_space
from tuner.target import target_for_arch


def build_config(shape_text: str, config_json: str):
    """One cute_sm90 config for sm_90a, built (or taken from the compile cache):
    (family, full config, shape, target, build result). Shared with pdl_probe.py."""
    shape = parse_shape(shape_text)
    target = target_for_arch("sm_90a")
    fam = load_space("space.yaml").family("cute_sm90")
    full = fam.complete(json.loads(config_json))
    built = compile_source(render(fam, full, target.arch), target.arch, artifact=fam.artifact)
    if not built.ok:
        raise SystemExit(f"build failed: {built.error}")
    return fam, full, shape, target, built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True)
    ap.add_argument("--config", required=True, help="a cute_sm90 config as JSON (compile and run-time knobs)")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--build-only", action="store_true", help="compile into the cache and stop (run before profiling)")
    args = ap.parse_args()
    cp = _cp()
    fam, full, shape, target, built = build_config(args.shape, args.config)
    if args.build_only:
        return
    sm_count = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    kernel = load_candidate(built.cubin, launch_spec(fam, full, shape, target) | {"sm_count": sm_count})
    buf = Buffers(shape.M, shape.N, shape.K)
    buf.A[...] = cp.random.standard_normal(buf.A.shape, dtype=cp.float32).astype(cp.float16)
    buf.B[...] = cp.random.standard_normal(buf.B.shape, dtype=cp.float32).astype(cp.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    cublas = Cublas(stream)
    variant = fam.runtime_config(full)
    ours = kernel.launcher(variant)
    with stream:
        for _ in range(args.launches):
            ours(buf, stream)
        stream.synchronize()
        ref = buf.C.copy()
        for _ in range(args.launches):
            cublas(buf, stream)
        stream.synchronize()
    diff = float(cp.abs(ref.astype(cp.float32) - buf.C.astype(cp.float32)).max())
    print(f"{shape}: ours then cuBLAS, {args.launches} launches each; max |ours - cuBLAS| = {diff:.4g}")


if __name__ == "__main__":
    main()
