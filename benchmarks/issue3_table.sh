#!/usr/bin/env bash
# Issue 3's ten shapes in one call on one GPU: each shape's stored H200 study pick and the seeds found
# since (NOTES.md, sessions 16 and 19) as variants, against cuBLAS and cuBLASLt in the same runs.
#   bash benchmarks/issue3_table.sh OUT_DIR [REPEATS] [--build-only --arch sm_90a]
# It ends with benchmarks/issue3_check.py: each shape's best verified contender against the issue's bar.
# With --build-only (no GPU) it compiles every contender into HGEMM_TUNE_CACHE and stops.
set -uo pipefail
out=${1:?usage: issue3_table.sh OUT_DIR [REPEATS] [extra bench_families.py args]}
repeats=${2:-5}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p runs
cp benchmarks/results/2026-12-03_h200_s7_studies.db runs/issue3_s7.db
cp benchmarks/results/2026-12-04_h200_s13_skinny_studies.db runs/issue3_s13.db
cp benchmarks/results/2026-12-04_h200_s14_skinny_studies.db runs/issue3_s14.db
bench() { python3 benchmarks/bench_families.py --families cute_sm90 --trials 0 --top 1 --repeats "$repeats" "$@"; }
bench --out "$out/s7" --storage sqlite:///runs/issue3_s7.db \
  --shapes 4096x4096x8192,8192x8192x8192,16384x16384x16384,1024x1024x1024,256x4096x4096,8192x512x2048,3000x5000x1000 \
  --variant 1024x1024x1024:TILE_M=128,TILE_N=64,SCHEDULE=cooperative,PROLOGUE=early_load \
  --variant 8192x512x2048:SCHEDULE=pingpong,SCHEDULER=persistent \
  --variant 8192x512x2048:SCHEDULE=pingpong,SCHEDULER=persistent,EPI_TILE_N=64 \
  --variant 3000x5000x1000:EPI_TILE_N=64,STAGES=4 "$@"
bench --out "$out/s13" --storage sqlite:///runs/issue3_s13.db --study-tag s13 --tagged-only --shapes 64x8192x4096 "$@"
bench --out "$out/s14" --storage sqlite:///runs/issue3_s14.db --study-tag s14 --tagged-only \
  --shapes 128x16384x16384,16384x128x4096 "$@"
# One line per shape against the issue's bars (exit 1 with the reasons where one is not met).
[[ " $* " == *" --build-only "* ]] || python3 benchmarks/issue3_check.py "$out"
