"""Quick GPU smoke run: verify and time a few configs of every family on awkward shapes.

    python benchmarks/smoke.py [--out DIR]
Prints one row per (family, config, shape): status, time, TFLOP/s, cuBLAS time, ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tuner.bench import GpuBackend, record_baseline, record_measurement
from tuner.compile import CompilePool
from tuner.search import finish, prepare
from tuner.shapes import parse_shape
from tuner.space import load_space

CONFIGS = {
    "cute_sm80": [
        {},
        {"BM": 128, "BN": 256, "BK": 32, "WARP_M": 2, "WARP_N": 4, "STAGES": 4},
        {"BM": 256, "BN": 128, "BK": 32, "WARP_M": 4, "WARP_N": 2, "STAGES": 4},
        {"BM": 128, "BN": 128, "BK": 64, "STAGES": 3, "REG_PREFETCH": 2, "STAGGER": 1},
        {"BM": 160, "BN": 128, "BK": 64, "WARP_M": 2, "WARP_N": 2, "STAGES": 3, "REG_PREFETCH": 0,
         "EPILOGUE": "direct"},
        {"BM": 128, "BN": 128, "BK": 32, "STAGES": 2, "STAGGER": 1, "REG_PREFETCH": 0},
        {"BM": 64, "BN": 64, "BK": 64, "WARP_M": 2, "WARP_N": 2, "STAGES": 5, "REG_PREFETCH": 1},
    ],
    "cute_sm90": [
        {},
        {"CLUSTER_M": 1},
        {"TILE_N": 128, "STAGES": 6, "SCHEDULE": "pingpong", "CLUSTER_M": 1},
        {"TILE_M": 64, "TILE_N": 256, "SCHEDULE": "pingpong", "CLUSTER_M": 1, "CLUSTER_N": 2},
        {"TILE_M": 256, "TILE_N": 128, "CLUSTER_M": 1, "CLUSTER_N": 2},
        {"TILE_N": 128, "STAGES": 5, "SCHEDULER": "streamk", "CLUSTER_M": 1},
        {"EPILOGUE": "nosmem"},
        {"TILE_N": 192, "STAGES": 5, "TILE_K": 64},
    ],
    "wmma": [
        {},
        {"BM": 128, "BN": 128, "BK": 32, "WARP_M": 2, "WARP_N": 4, "STAGES": 2},
        {"BM": 32, "BN": 32, "BK": 16, "WARP_M": 1, "WARP_N": 1, "STAGES": 1, "PAD": 0},
        {"BM": 16, "BN": 64, "BK": 64, "WARP_M": 1, "WARP_N": 2, "STAGES": 2},
    ],
}
SHAPES = ["4096x4096x8192", "1x8x8", "127x136x72", "1000x1000x1000", "333x200x1001", "64x8192x4096",
          "3000x5000x1000", "17x19x23"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--families", default="cute_sm80,wmma")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    out = Path(args.out)
    space = load_space("space.yaml")
    backend = GpuBackend(log_path=out / "worker.log")
    pool = CompilePool()
    record = out / "smoke_measurements.jsonl"
    rows = []
    pend = []
    t0 = time.perf_counter()
    for shape_s in args.shapes.split(","):
        shape = parse_shape(shape_s)
        record_baseline(record, shape, backend.baseline(shape))
        for fam_name in args.families.split(","):
            fam = space.family(fam_name)
            for cfg in CONFIGS[fam_name]:
                full = fam.compile_config(fam.defaults() | cfg)
                pend.append((shape, fam, full, prepare(fam, full, shape, backend, pool)))
    for shape, fam, full, p in pend:
        rec = finish(p, shape, backend, 60.0)
        if p.request is not None and rec.status not in ("invalid", "compile_error"):
            from tuner.bench import Measurement
            record_measurement(record, p.request, Measurement(
                status="ok" if rec.status == "ok" else rec.status, kind=rec.kind, reason=rec.reason,
                times_us=rec.variant_times_us, baselines_us={"cublas": rec.cublas_us} if rec.cublas_us else {},
                verify=rec.verify, gpu=rec.gpu))
        rows.append((fam.name, json.dumps(full, separators=(",", ":")), str(shape), rec.status,
                     rec.time_us, rec.tflops, rec.cublas_us, rec.speedup_cublas, rec.compile_s, rec.registers,
                     rec.spill_bytes, (rec.reason or "")[:160]))
        print(*rows[-1], sep=" | ", flush=True)
    print(f"\nworker restarts: {backend.restarts}; wall {time.perf_counter() - t0:.0f} s")
    print(f"{'family':10} {'shape':16} {'status':14} {'us':>9} {'TFLOP/s':>8} {'cuBLAS us':>9} {'ratio':>6} cfg")
    for r in rows:
        fmt = lambda v, f: (f % v) if v is not None else "-"  # noqa: E731
        print(f"{r[0]:10} {r[2]:16} {r[3]:14} {fmt(r[4], '%9.2f'):>9} {fmt(r[5], '%8.1f'):>8} "
              f"{fmt(r[6], '%9.2f'):>9} {fmt(r[7], '%6.3f'):>6} {r[1]} {r[11][:80]}")
    backend.close()
    pool.close()


if __name__ == "__main__":
    main()
