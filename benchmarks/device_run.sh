#!/usr/bin/env bash
# One device call: install the carried wheels, then run the given steps, logs under $OUT.
#   bash benchmarks/device_run.sh smoke gpu-tests tune bench
#   bash benchmarks/device_run.sh BENCH_TRIALS=36 bench10 BENCH_TRIALS=0 bench10   (NAME=VALUE: for the steps after it)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HGEMM_TUNE_CACHE=${HGEMM_TUNE_CACHE:-/tmp/cubins}
# Every runtime dependency must import before any step runs: a wheel missing from .whl/ would
# otherwise fail the steps that need it minutes in (session 17: jsonschema, 5 GPU tests).
python3 -c 'import jsonschema, optuna, jinja2, yaml, typer, rich, pandas, cupy, nvmath, openai' || {
  echo "device_run.sh: a runtime dependency is missing on the device; on the CPU machine run" \
       "'bash ../shared/device/wheels.sh optuna openai nvidia-cutlass nvmath-python jsonschema' and carry .whl"; exit 1; }
# Builds made on the CPU machine (bench_families.py --build-only) travel as runs/cubins.tar.xz:
#   tar cJf runs/cubins.tar.xz -C "$HGEMM_TUNE_CACHE" .   (xz: ~30 MB of CUTLASS builds -> ~1.5 MB)
# and are unpacked into the cache here, so this call spends no time in nvcc on them.
[[ -f runs/cubins.tar.xz ]] && mkdir -p "$HGEMM_TUNE_CACHE" && tar xJf runs/cubins.tar.xz -C "$HGEMM_TUNE_CACHE" \
  && echo "carried builds: $(find "$HGEMM_TUNE_CACHE" -name '*.so' -o -name '*.cubin' | wc -l)"
OUT=${OUT:-runs/out}; mkdir -p "$OUT" runs
# Every step's timeout is capped by what is left of DEVICE_BUDGET_S for the whole call, so the
# call always reaches the packing below (the device tool kills a command at 600 s).
END=${DEVICE_BUDGET_S:-570}
cap() { local left=$((END - SECONDS)); (( left < $1 )) && echo $((left > 1 ? left : 1)) || echo "$1"; }
# Session 5's best stored config at 16384x128x4096 (the probes' subject).
BEST_16384x128x4096='{"TILE_M":128,"TILE_N":64,"STAGES":8,"CLUSTER_M":1,"CLUSTER_N":2,"SCHEDULER":"streamk","RASTER":"along_n"}'
# which physical GPU this call got (the vendor-to-us ratio moves with it: NOTES.md, session 13)
nvidia-smi --query-gpu=name,uuid,serial,pci.bus_id,clocks.sm,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu --format=csv,noheader \
  | tee "$OUT/gpu.txt"
n=0
BENCH_DBS=()
for step in "$@"; do
  # NAME=VALUE between steps sets a variable for the steps after it:
  #   bash benchmarks/device_run.sh BENCH_TRIALS=36 bench10 BENCH_TRIALS=0 BENCH_SHAPES= bench10
  if [[ $step =~ ^[A-Z_][A-Z0-9_]*= ]]; then export "${step?}"; echo "=== set $step"; continue; fi
  n=$((n + 1))
  echo "=== $step $(date +%T)"
  case $step in
    smoke) timeout "$(cap 300)" python3 benchmarks/smoke.py --out "$OUT" 2>&1 | tee "$OUT/smoke.log" | tail -45 ;;
    smoke90) timeout "$(cap 300)" python3 benchmarks/smoke.py --out "$OUT" --families cute_sm90 \
               --shapes 4096x4096x8192,3000x5000x1000,64x8192x4096,17x24x40,8192x8192x8192 2>&1 \
               | tee "$OUT/smoke90.log" | tail -45 ;;
    tune90) timeout "$(cap 240)" python3 -m tuner.cli --shape 4096x4096x8192 --trials 30 --seed 0 --families cute_sm90 --timeout "$(cap 150)" \
              2>&1 | tee "$OUT/tune90.log" | grep -v "tuning" | tail -12 ;;
    benchq) timeout "$(cap 120)" python3 benchmarks/bench_families.py --out "$OUT" --trials 0 --shapes 4096x4096x8192 \
              --families cute_sm90 2>&1 | tee "$OUT/benchq.log" | tail -8 ;;
    tune200) timeout "$(cap 570)" python3 -m tuner.cli --shape 4096x4096x8192 --trials 200 --seed 0 --timeout "$(cap ${TUNE_TIMEOUT:-330})" \
               --storage sqlite:///runs/tune200.db --record "$OUT/replay_tune200.jsonl" -o "$OUT/best_4096x4096x8192.json" 2>&1 \
               | tee "$OUT/tune200.log" | grep -v "tuning" | tail -14 ;;
    bench90) timeout "$(cap ${BENCH_TIMEOUT:-540})" python3 benchmarks/bench_families.py --out "$OUT" --families cute_sm90 \
               --time-per-family "${BENCH_TUNE_S:-40}" --trials 200 ${BENCH_SHAPES:+--shapes $BENCH_SHAPES} 2>&1 \
               | tee "$OUT/bench90.log" | tail -16 ;;
    bench10) # BENCH_VARIANTS='L2_HINT=stream_a;SCHEDULER=persistent': A/B contenders (--variant), ';'-separated
             VARIANT_ARGS=(); IFS=';' read -ra _variants <<< "${BENCH_VARIANTS:-}"
             for v in "${_variants[@]}"; do VARIANT_ARGS+=(--variant "$v"); done
             # each bench10 step of a call writes its own bench10_<step number> folder and log
             [[ ${BENCH_STORAGE:-} == sqlite:///* ]] && BENCH_DBS+=("${BENCH_STORAGE#sqlite:///}")
             timeout "$(cap ${BENCH_TIMEOUT:-560})" python3 benchmarks/bench_families.py --out "$OUT/bench10_$n" --families cute_sm90 \
               --trials "${BENCH_TRIALS:-10}" --time-per-family "${BENCH_TUNE_S:-600}" ${BENCH_SHAPES:+--shapes $BENCH_SHAPES} \
               ${BENCH_STORAGE:+--storage $BENCH_STORAGE} ${BENCH_SEED:+--seed $BENCH_SEED} ${BENCH_TAG:+--study-tag $BENCH_TAG} ${BENCH_TAGGED_ONLY:+--tagged-only} \
               ${BENCH_TOP:+--top $BENCH_TOP} ${BENCH_SELECT_RUNS:+--select-runs $BENCH_SELECT_RUNS} ${BENCH_REPEATS:+--repeats $BENCH_REPEATS} ${BENCH_PDL:+--pdl} \
               "${VARIANT_ARGS[@]}" 2>&1 | tee "$OUT/bench10_$n.log" | tail -40 ;;
    pdlprobe) # do cuBLAS / cuBLASLt / torch launch back-to-back GEMMs with PDL, and which kernels? (benchmarks/pdl_probe.py)
              # PDL_SHAPE, PDL_CONFIG (JSON); appends to pdl_probe.log
              timeout "$(cap 200)" python3 benchmarks/pdl_probe.py --shape "${PDL_SHAPE:-16384x128x4096}" \
                --config "${PDL_CONFIG:-$BEST_16384x128x4096}" 2>&1 | tee -a "$OUT/pdl_probe.log" | tail -12 ;;
    ksweep) # fixed cost or bandwidth: each KSWEEP_SHAPES shape's stored best and the vendors over K (benchmarks/k_sweep.py)
            # KSWEEP_VARIANTS='SCHEDULER=persistent;...' applies to every shape
            VARIANT_ARGS=(); IFS=';' read -ra _variants <<< "${KSWEEP_VARIANTS:-}"
            for v in "${_variants[@]}"; do VARIANT_ARGS+=(--variant "$v"); done
            for s in ${KSWEEP_SHAPES:-16384x128x4096}; do
              timeout "$(cap ${KSWEEP_TIMEOUT:-200})" python3 benchmarks/k_sweep.py --shape "$s" --ks "${KSWEEP_KS:-1024,2048,4096,8192,16384}" \
                --storage "${BENCH_STORAGE:-sqlite:///runs/hgemm.db}" "${VARIANT_ARGS[@]}" 2>&1 | tee -a "$OUT/k_sweep.log" | tail -14
            done ;;
    timeline) # per-CTA clock stamps (benchmarks/timeline_probe.py): TIMELINE_SHAPE, TIMELINE_CONFIGS (';'-separated JSON)
              CONFIG_ARGS=(); IFS=';' read -ra _configs <<< "${TIMELINE_CONFIGS:-$BEST_16384x128x4096}"
              for c in "${_configs[@]}"; do CONFIG_ARGS+=(--config "$c"); done
              timeout "$(cap ${TIMELINE_TIMEOUT:-300})" python3 benchmarks/timeline_probe.py --shape "${TIMELINE_SHAPE:-16384x128x4096}" \
                "${CONFIG_ARGS[@]}" --runs "${TIMELINE_RUNS:-7}" --out "$OUT" 2>&1 | tee "$OUT/timeline.log" | tail -60 ;;
    sweep27) # issue 4: sweep the {256,2048,8192}^3 sub-grid, bench its export in both modes, plot
             timeout "$(cap ${SWEEP_TIMEOUT:-400})" python3 -m tuner.cli sweep space.yaml --shapes subgrid27 --families cute_sm90 \
               --trials-per-shape "${SWEEP_TRIALS:-12}" --budget "${SWEEP_BUDGET:-360}" --seed 0 \
               --storage sqlite:///runs/sweep27.db -o "$OUT/sweep27.json" 2>&1 | tee "$OUT/sweep27.log" | tail -40
             timeout "$(cap ${SWEEP_BENCH_TIMEOUT:-170})" python3 -m tuner.cli bench "$OUT/sweep27.json" --mode both \
               --out "$OUT/sweep27_bench" 2>&1 | tee "$OUT/sweep27_bench.log" | tail -12
             python3 -m tuner.cli report "$OUT/sweep27_bench/bench.json" --out "$OUT/sweep27_report"
             python3 -m tuner.cli report "$OUT/sweep27.json" --out "$OUT/sweep27_report" ;;
    gpu-tests) timeout "$(cap ${GPU_TESTS_TIMEOUT:-300})" python3 -m pytest -q -m gpu tests -ra ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15 ;;
    confirm) # hgemm-tune's confirm stage on stored studies (no new trials): CONFIRM_SHAPES, CONFIRM_TOP, CONFIRM_RUNS
             for s in ${CONFIRM_SHAPES:-16384x128x4096}; do
               start=$SECONDS
               timeout "$(cap ${CONFIRM_TIMEOUT:-200})" python3 -m tuner.cli --shape "$s" --families cute_sm90 --trials 1 \
                 --storage "${BENCH_STORAGE:-sqlite:///runs/hgemm.db}" --confirm "${CONFIRM_TOP:-3}" \
                 --confirm-runs "${CONFIRM_RUNS:-3}" -o "$OUT/confirm_$s.json" 2>&1 | tee -a "$OUT/confirm.log" | tail -12
               echo "confirm $s: $((SECONDS - start)) s" | tee -a "$OUT/confirm.log"
             done ;;
    tuneshape) # one cute_sm90 study: TUNE_SHAPE, TUNE_TRIALS, TUNE_TIMEOUT
               timeout "$(cap 570)" python3 -m tuner.cli --shape "${TUNE_SHAPE:-256x256x8192}" --trials "${TUNE_TRIALS:-8}" --seed 0 \
                 --families cute_sm90 --timeout "$(cap ${TUNE_TIMEOUT:-150})" 2>&1 | tee "$OUT/tuneshape.log" | grep -v "tuning" | tail -14 ;;
    tune) timeout "$(cap 420)" python3 -m tuner.cli --shape 4096x4096x8192 --trials 100 --seed 0 \
            --record "$OUT/replay_4096x4096x8192.jsonl" -o "$OUT/best_4096x4096x8192.json" 2>&1 \
            | tee "$OUT/tune.log" | grep -v "tuning" | tail -30 ;;
    bench) timeout "$(cap 540)" python3 benchmarks/bench_families.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -25 ;;
    readbw) # the read-bandwidth ceiling of the skinny shapes' big operands (benchmarks/read_bandwidth.cu)
            nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/read_bw benchmarks/read_bandwidth.cu \
              && timeout "$(cap 120)" /tmp/read_bw 2>&1 | tee "$OUT/read_bandwidth.log" ;;
    clusterocc) # how many clusters of each shape the driver can make resident at once (benchmarks/cluster_occupancy.cu)
                nvcc -O2 -gencode arch=compute_90a,code=sm_90a -o /tmp/cluster_occ benchmarks/cluster_occupancy.cu \
                  && timeout "$(cap 60)" /tmp/cluster_occ 2>&1 | tee "$OUT/cluster_occupancy.log" ;;
    tmastream) # a TMA pipeline streaming 16384xK fp16 with no GEMM around it (benchmarks/tma_stream.cu), per TMASTREAM_KS, TMASTREAM_SET
               nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/tma_stream benchmarks/tma_stream.cu \
                 && for k in ${TMASTREAM_KS:-4096 16384}; do timeout "$(cap 120)" /tmp/tma_stream "$k" ${TMASTREAM_SET:-base} 2>&1 | tee -a "$OUT/tma_stream.log"; done ;;
    ncu) # DRAM and L2 bytes and throughput of session 5's best skinny kernels and of cuBLAS's
         NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
         METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum
         METRICS=$METRICS,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
         declare -A CASES=(
           [16384x128x4096]="$BEST_16384x128x4096"
           [128x16384x16384]='{"TILE_M":64,"TILE_N":256,"STAGES":5,"CLUSTER_M":1,"SCHEDULE":"pingpong","RASTER":"along_m","SWIZZLE":8}')
         for s in "${!CASES[@]}"; do python3 benchmarks/ncu_probe.py --shape "$s" --config "${CASES[$s]}" --build-only & done; wait
         for s in "${!CASES[@]}"; do
           timeout "$(cap 120)" "$NCU" --clock-control none --csv --metrics "$METRICS" \
             python3 benchmarks/ncu_probe.py --shape "$s" --config "${CASES[$s]}" > "$OUT/ncu_$s.csv" 2>&1
           grep -v '"curand\|"generate' "$OUT/ncu_$s.csv" | cut -c1-400 | tail -30
         done ;;
    issue3) # issue 3's ten-shape table on this card: each shape's H200 study pick (s7; s13 at 64x8192x4096; s14 at
            # the other two skinny shapes) with the session 16/19 seeds as variants, BENCH_REPEATS runs (default 5).
            # Prebuild on the CPU machine with the same lines and --build-only --arch sm_90a (HGEMM_TUNE_CACHE).
            timeout "$(cap ${ISSUE3_TIMEOUT:-560})" bash benchmarks/issue3_table.sh "$OUT/issue3" "${BENCH_REPEATS:-5}" 2>&1 | tee "$OUT/issue3.log" | tail -40 ;;
    doctor) python3 -m tuner.cli doctor 2>&1 | tee "$OUT/doctor.log" ;;
    broken) timeout "$(cap ${BROKEN_TIMEOUT:-300})" python3 -m tuner.cli --shape 1024x1024x1024 --trials 60 --families wmma,broken \
              --space tests/data/space_broken.yaml --seed 0 --storage sqlite:///runs/broken.db 2>&1 \
              | tee "$OUT/broken.log" | grep -v "tuning" | tail -12
            python3 benchmarks/failure_table.py sqlite:///runs/broken.db | tee -a "$OUT/broken.log" ;;
    workers) timeout "$(cap 300)" python3 -m tuner.cli --shape 2048x2048x2048 --trials 30 --families wmma --workers 2 \
               --storage sqlite:///runs/workers.db 2>&1 | tee "$OUT/workers.log" | grep -v "workers" | tail -8
             python3 benchmarks/failure_table.py sqlite:///runs/workers.db --by gpu | tee -a "$OUT/workers.log" ;;
    propose) timeout "$(cap ${PROPOSE_TIMEOUT:-300})" python3 benchmarks/propose_demo.py --out "$OUT/propose" \
               --trials "${PROPOSE_TRIALS:-8}" ${PROPOSE_SHAPES:+--shape $PROPOSE_SHAPES} 2>&1 \
               | tee "$OUT/propose.log" | tail -60 ;;
    *) echo "unknown step $step" ;;
  esac
done
cp runs/hgemm.db runs/tune200.db runs/sweep27.db "$OUT/" 2>/dev/null
# every bench step's study database (BENCH_STORAGE=sqlite:///PATH) comes back too: trials tuned here
for db in "${BENCH_DBS[@]}"; do cp "$db" "$OUT/" 2>/dev/null; done
# The device tool brings back at most 8 files: pack everything into one archive.
tar czf /tmp/device_results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/device_results.tgz "$OUT/"
echo "=== done $(date +%T)"
