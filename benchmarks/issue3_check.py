"""Issue 3's bars, checked on a benchmark run: one line per shape, its best verified contender.

    python benchmarks/issue3_check.py DIR [DIR ...]

Reads every bench_families.json under the DIRs (benchmarks/issue3_table.sh writes three) and prints,
for each of the issue's ten shapes, the contender with the highest median ratio to cuBLAS among those
that passed verification in every run, beside the issue's bar: at least 0.97x cuBLAS at 4096x4096x8192
and 8192^3, at least 1.0x at the skinny shapes (M or N <= 256), no bar at the others. The contenders
(a study pick and its seed variants) are ranked on the reported runs themselves, so a shape with several
contenders is a best-of-N: the table says N. Exit status 0 only if every shape is there, verified and
at its bar, on an H200 (the card the issue names); 1 otherwise, with the reasons.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_families  # noqa: E402  (beside this script)

from tuner.shapes import parse_shape  # noqa: E402

SHAPES = bench_families.SHAPES.split(",")  # the ten, as bench_families.py runs them by default


def bar(shape: str) -> float | None:
    """The issue's minimum ratio to cuBLAS for this shape, or None where it sets none."""
    s = parse_shape(shape)
    if min(s.M, s.N) <= 256:
        return 1.0
    return 0.97 if shape in ("4096x4096x8192", "8192x8192x8192") else None


def load(dirs: list[Path]) -> tuple[set[str], list[dict]]:
    """Every bench_families.json under `dirs`: (the GPU names, all rows)."""
    gpus, rows = set(), []
    for d in dirs:
        for f in sorted(d.rglob("bench_families.json")):
            data = json.loads(f.read_text())
            gpus.add(data["gpu"])
            rows += data["rows"]
    return gpus, rows


def check(gpus: set[str], rows: list[dict]) -> tuple[str, list[str]]:
    """(the markdown table, the reasons the issue's check fails; empty when it passes)."""
    problems = []
    if not gpus:
        return "", ["no bench_families.json found"]
    if not all("H200" in g for g in gpus):
        problems.append(f"the issue is checked on an H200; these runs are on {', '.join(sorted(gpus))}")
    lines = ["| shape | contender | us | TFLOP/s | vs cuBLAS | range | vs Lt | vs Lt-auto | runs | of N | bar | met |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for shape in SHAPES:
        here = [r for r in rows if r["shape"] == shape and r["us"]]
        ok = [r for r in here if r["verified"] and r["ratios"]["cublas"]]
        floor = bar(shape)
        if not ok:
            problems.append(f"{shape}: no verified contender" if here else f"{shape}: not measured")
            lines.append(f"| {shape} | - | - | - | - | - | - | - | - | {len(here)} | {floor or '-'} | no |")
            continue
        best = max(ok, key=lambda r: statistics.median(r["ratios"]["cublas"]))
        rs = best["ratios"]
        ratio = statistics.median(rs["cublas"])
        met = floor is None or ratio >= floor
        if not met:
            problems.append(f"{shape}: {ratio:.3f}x cuBLAS, under the bar of {floor}")
        if len(ok) < len(here):
            problems.append(f"{shape}: {len(here) - len(ok)} contender(s) failed verification")
        lt, lt_auto = (f"{statistics.median(rs[v]):.3f}" if rs[v] else "-" for v in ("cublaslt", "cublaslt_auto"))
        tflops = parse_shape(shape).tflops(best["us"])
        lines.append(f"| {shape} | {best['contender']} | {best['us']:.2f} | {tflops:.1f} | "
                     f"{ratio:.3f} | {min(rs['cublas']):.3f}-{max(rs['cublas']):.3f} | {lt} | "
                     f"{lt_auto} | {len(rs['cublas'])} | {len(here)} | {floor if floor else '-'} | "
                     f"{'-' if floor is None else 'yes' if met else '**no**'} |")
    return "\n".join(lines), problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="benchmark output folders (searched for bench_families.json)")
    args = ap.parse_args()
    gpus, rows = load(args.dirs)
    text, problems = check(gpus, rows)
    print(f"GPU: {', '.join(sorted(gpus)) or '-'}\n\n{text}\n")
    print("\n".join(f"NOT MET: {p}" for p in problems) if problems else "issue 3's bars: all met")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
