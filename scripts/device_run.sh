#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels, then run the given steps, logs under $OUT.
#   bash scripts/device_run.sh gpu-tests tune-bench
#   bash scripts/device_run.sh llama-sweep package check-package bench-model   (issue: a real client)
#   CATALOGUE=runs/catalogue.zip bash scripts/device_run.sh small   (small shapes: sweep, bench both regimes, ncu)
#   CATALOGUE=runs/catalogue.zip bash scripts/device_run.sh grid    (the cuda_l2 grid, a slice per call: carry runs/grid.tar.xz)
#   bash scripts/device_run.sh epi-ksweep   (issue 37's per-tile cost: carry runs/cat_epi32.zip and runs/cat_epi64.zip, built here)
# Carry .whl (made here by `bash ../shared/device/wheels.sh optuna openai nvidia-cutlass nvmath-python
# jsonschema hypothesis`) and, if there is one, runs/cubins.tar.xz (a compile cache packed here after
# `hgemm-tune prebuild ...`: `tar cJf runs/cubins.tar.xz -C "$HGEMM_TUNE_CACHE" .`).
set -uo pipefail
# Private folders (mktemp, ~/.cache), never a predictable shared /tmp path: a file planted there would be imported
# or loaded. The compile cache checks each binary's recorded digest before loading it as well.
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 HGEMM_TUNE_CACHE=${HGEMM_TUNE_CACHE:-$HOME/.cache/hgemm-tune/cubins}
python3 -c 'import jsonschema, optuna, jinja2, yaml, typer, rich, pandas, cupy, nvmath, openai' || {
  echo "device_run.sh: a runtime dependency is missing on the device; rebuild .whl here (see the header)"; exit 1; }
[[ -f runs/cubins.tar.xz ]] && mkdir -p "$HGEMM_TUNE_CACHE" && tar xJf runs/cubins.tar.xz -C "$HGEMM_TUNE_CACHE"
OUT=${OUT:-runs/out}; mkdir -p "$OUT" runs
[[ -f runs/dist.tgz && ! -d runs/dist ]] && tar xzf runs/dist.tgz -C runs  # packages built by an earlier call
END=${DEVICE_BUDGET_S:-570}  # every step's timeout is capped by what is left of the call
cap() { local left=$((END - SECONDS)); (( left < $1 )) && echo $((left > 1 ? left : 1)) || echo "$1"; }
nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv \
  | tee "$OUT/gpu.txt"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    doctor) python3 -m tuner.cli doctor 2>&1 | tee "$OUT/doctor.log" ;;
    gpu-tests) timeout "$(cap ${GPU_TESTS_TIMEOUT:-420})" python3 -m pytest -m gpu -q -ra -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} tests \
                 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25 ;;
    tune-bench)  # the product end to end: tune, confirm, export, then bench the export in fresh workers
      timeout "$(cap 300)" python3 -m tuner.cli tune --shape "${SHAPE:-4096x4096x8192}" --trials "${TRIALS:-12}" \
        --families "${FAMILIES:-cute_sm90}" --confirm 2 --confirm-runs 2 --storage sqlite:///runs/device.db \
        ${CATALOGUE:+--catalogue "$CATALOGUE"} \
        -o runs/device_best.json 2>&1 | tee runs/tune.log | tail -30
      timeout "$(cap 240)" python3 -m tuner.cli bench runs/device_best.json --repeats "${REPEATS:-3}" \
        --out runs/bench 2>&1 | tee "$OUT/bench.log" | tail -40; cp runs/bench/bench.md "$OUT/" ;;
    llama-sweep)  # M buckets of a Llama-3-8B's Linear layers, from the catalogue, into an export
      timeout "$(cap ${SWEEP_TIMEOUT:-260})" python3 -m tuner.cli sweep space.yaml --shapes "${SHAPES:-llama8b_buckets}" \
        --families cute_sm90 --trials-per-shape "${TRIALS_PER_SHAPE:-8}" --confirm "${CONFIRM:-0}" \
        --budget "${SWEEP_BUDGET:-200}" \
        ${CATALOGUE:+--catalogue "$CATALOGUE"} --storage sqlite:///runs/llama.db -o runs/llama.json 2>&1 \
        | tee "$OUT/sweep.log" | tail -45; cp runs/llama.json "$OUT/" ;;
    small)  # a shape set (issue 35: small3; SET=large for issue 37's): tune from the catalogue, bench both
      # regimes, then ncu over one isolated bench per shape (NCU_SHAPES of them, NCU_SECTIONS)
      S=${SET:-small}
      [[ $S != small && -z ${SMALL_SHAPES:-} ]] && { echo "small: SET=$S needs SMALL_SHAPES (a shape list)"; continue; }
      # --budget stops the sweep between shapes and still writes its export; the timeout is the backstop
      t=$(cap ${SMALL_TIMEOUT:-200})
      timeout "$t" python3 -m tuner.cli sweep space.yaml --shapes "${SMALL_SHAPES:-small3}" --budget $((t > 40 ? t - 25 : (t > 10 ? t - 5 : t))) \
        --families "${SMALL_FAMILIES:-cute_sm90}" --trials-per-shape "${SMALL_TRIALS:-24}" --patience 0 --confirm 0 \
        --objective "${OBJECTIVE:-sustained}" \
        ${CATALOGUE:+--catalogue "$CATALOGUE"} --storage sqlite:///runs/$S.db -o runs/$S.json 2>&1 \
        | tee "$OUT/${S}_sweep.log" | tail -12; cp runs/$S.json runs/$S.db "$OUT/"
      timeout "$(cap ${BENCH_TIMEOUT:-200})" python3 -m tuner.cli bench runs/$S.json --mode both --repeats "${REPEATS:-3}" \
        --out runs/bench_$S 2>&1 | tee "$OUT/${S}_bench.log" | tail -40; cp runs/bench_$S/bench.md "$OUT/${S}_bench.md"
      # ncu, one shape at a time: the first GEMM launches of an isolated bench run (verification, then
      # timing: ours is CUTLASS's device_kernel, cuBLAS's are nvjet/sm90 kernels): name, grid, duration
      rm -f runs/${S}_[0-9]*.json  # an earlier call's on a warm machine
      python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
for i, e in enumerate(d["entries"][:int(sys.argv[3])]): json.dump(d | {"entries": [e]}, open(f"runs/{sys.argv[2]}_{i}.json", "w"))' \
        runs/$S.json "$S" "${NCU_SHAPES:-99}"
      sections=(); for sec in ${NCU_SECTIONS:-SpeedOfLight LaunchStats}; do sections+=(--section "$sec"); done
      for f in runs/${S}_[0-9]*.json; do
        [[ -f $f ]] || continue  # NCU_SHAPES=0: no ncu
        timeout "$(cap ${NCU_TIMEOUT:-60})" ncu --clock-control none --target-processes all -k "regex:device_kernel|nvjet|gemm|xmma" \
          "${sections[@]}" --launch-count "${NCU_LAUNCHES:-40}" --csv --page details \
          python3 -m tuner.cli bench "$f" --mode isolated --out runs/bench_ncu >> "$OUT/${S}_ncu.csv" 2>> "$OUT/${S}_ncu.err"
      done; [[ -f "$OUT/${S}_ncu.err" ]] && tail -3 "$OUT/${S}_ncu.err"
      python3 -m tuner.cli rank-check sqlite:///runs/$S.db --top 5 2>&1 | tee "$OUT/${S}_rank.log" | tail -20 ;;
    grid)  # issue 34: the cuda_l2 grid from the catalogue, resumable across calls and sessions. To continue, copy an
      # earlier call's $OUT/grid.tar.xz to runs/ and carry it (the storage and the bench so far, compressed ~15x).
      [[ -f runs/grid.tar.xz && ! -f runs/grid.db ]] && tar xJf runs/grid.tar.xz -C runs
      t=$(cap ${GRID_SWEEP_S:-300})
      timeout "$t" python3 -m tuner.cli sweep space.yaml --shapes "${GRID_SHAPES:-cuda_l2}" --families cute_sm90 \
        --trials-per-shape "${GRID_TRIALS:-6}" --patience 0 --confirm 0 --budget $((t > 40 ? t - 25 : t)) \
        ${CATALOGUE:+--catalogue "$CATALOGUE"} --storage sqlite:///runs/grid.db -o runs/grid.json 2>&1 \
        | tee "$OUT/grid_sweep.log" | tail -6
      t=$(cap ${GRID_BENCH_S:-240})
      [[ -f runs/grid.json ]] && timeout "$t" python3 -m tuner.cli bench runs/grid.json --mode both --resume \
        --budget $((t > 40 ? t - 30 : t)) --autotune-sample "${GRID_AUTOTUNE:-100}" --out runs/bench_grid 2>&1 \
        | tee "$OUT/grid_bench.log" | tail -25
      tar cJf "$OUT/grid.tar.xz" -C runs grid.db $(cd runs && ls -d grid.json bench_grid 2>/dev/null)
      python3 -m tuner.cli catalogue curve sqlite:///runs/grid.db --out "$OUT/curve" 2>&1 | tail -4 ;;
    epi-ksweep)  # issue 37's per-tile fixed cost (0041): cuBLAS's 128x256 s4 2x1 cooperative tile with 32- and
      # 64-column epilogue subtiles, one catalogue each (built here: `hgemm-tune catalogue build --kernels
      # experiments/epilogue_ksweep_32.json -o runs/cat_epi32.zip`, the same for 64; carry both). Per kernel: the
      # `epilogue_ksweep` shapes (K = 768..6144) timed in full with cuBLAS (a one-kernel catalogue, one trial a
      # shape), bench of both regimes, ncu's per-SASS stall samples at K = 1536; then cuBLAS's kernel the same
      # way. Everything lands in $OUT/epi.tar.xz (one file: the call returns at most 8). Best run alone in a call.
      mkdir -p runs/epi_out; rm -rf runs/epi_out/* runs/epi[0-9]*.json runs/epi[0-9]*.db runs/epi_*.ncu-rep
      for e in 32 64; do
        t=$(cap ${EPI_SWEEP_S:-110})
        timeout "$t" python3 -m tuner.cli sweep space.yaml --shapes epilogue_ksweep --families cute_sm90 \
          --catalogue runs/cat_epi$e.zip --trials-per-shape 1 --patience 0 --confirm 0 --budget $((t > 40 ? t - 25 : t)) \
          --objective "${OBJECTIVE:-isolated}" --storage sqlite:///runs/epi$e.db -o runs/epi$e.json 2>&1 \
          | tee runs/epi_out/sweep$e.log | tail -4
        [[ -f runs/epi$e.json ]] || { echo "epi-ksweep: no export for EPI_TILE_N=$e"; continue; }
        timeout "$(cap ${EPI_BENCH_S:-90})" python3 -m tuner.cli bench runs/epi$e.json --mode both --repeats "${REPEATS:-2}" \
          --out runs/bench_epi$e 2>&1 | tee runs/epi_out/bench$e.log | tail -12
        cp runs/bench_epi$e/bench.md runs/bench_epi$e/bench.json runs/epi$e.db runs/epi_out/ 2>/dev/null
        python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
json.dump(d | {"entries": [e for e in d["entries"] if e["K"] == 1536]}, open(sys.argv[2], "w"))' runs/epi$e.json runs/epi${e}_1536.json
        for who in "ours$e:device_kernel" $([[ $e == 32 ]] && echo "cublas:nvjet"); do
          timeout "$(cap ${NCU_TIMEOUT:-60})" ncu --clock-control none --target-processes all -k "regex:${who#*:}" \
            --section SourceCounters --section WarpStateStats --launch-skip 1 --launch-count 2 --kill yes \
            -o "runs/epi_${who%%:*}" -f python3 -m tuner.cli bench runs/epi${e}_1536.json --mode isolated --repeats 1 \
            --out runs/bench_epi_ncu > /dev/null 2>> runs/epi_out/ncu.err
          ncu -i "runs/epi_${who%%:*}.ncu-rep" --page details --csv > "runs/epi_out/${who%%:*}_details.csv" 2>> runs/epi_out/ncu.err
          ncu -i "runs/epi_${who%%:*}.ncu-rep" --page source --print-source sass --csv \
            > "runs/epi_out/${who%%:*}_sass.csv" 2>> runs/epi_out/ncu.err
        done
      done
      tail -3 runs/epi_out/ncu.err 2>/dev/null; tar cJf "$OUT/epi.tar.xz" -C runs epi_out ;;
    screen-ab)  # issue 34's trial screen and batches (0036 addendum), fresh storages: AB_MODES of batch (the
      # default with a catalogue: 8 binaries per shared screen), screen (one binary a trial), noscreen (every variant in full)
      for mode in ${AB_MODES:-batch screen noscreen}; do
        extra=(); envs=()
        [[ $mode != batch ]] && extra=(--batch 1)
        [[ $mode == noscreen ]] && envs=(HGEMM_TUNE_SCREEN=0)
        env "${envs[@]}" timeout "$(cap ${AB_TIMEOUT:-150})" python3 -m tuner.cli sweep space.yaml \
          --shapes "${AB_SHAPES:-small3}" --families cute_sm90 --trials-per-shape "${AB_TRIALS:-12}" --patience 0 --confirm 0 \
          ${CATALOGUE:+--catalogue "$CATALOGUE"} "${extra[@]}" --storage sqlite:///runs/ab_$mode.db -o runs/ab_$mode.json 2>&1 \
          | tee "$OUT/ab_$mode.log" | tail -14; cp runs/ab_$mode.db "$OUT/"
      done ;;
    package)  # the export -> one library (nvcc here: 16 cores) and the PyTorch shim for this torch
      # and, for check-package, the same export with our kernel forced at every bucket (correctness at every M)
      python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); [e.update(pick=e["family"]) for e in d["entries"]]
json.dump(d, open(sys.argv[2], "w"))' "${EXPORT:-runs/llama.json}" runs/forced.json
      for d in dist $([[ ${FORCED:-1} == 1 ]] && echo forced); do
        src=${EXPORT:-runs/llama.json}; [[ $d == forced ]] && src=runs/forced.json
        ( timeout "$(cap 300)" python3 -m tuner.cli package "$src" -o runs/$d --jobs 8 > "$OUT/package_$d.log" 2>&1 &&
          timeout "$(cap 200)" python3 -c 'import sys; from tuner.runtime import torch_op; print(torch_op.build(sys.argv[1]))' \
            runs/$d >> "$OUT/package_$d.log" 2>&1 ) &
      done; wait; tail -12 "$OUT"/package_*.log
      # for a later call's check-package / bench-model (carry runs/dist.tgz)
      tar czf "$OUT/dist.tgz" -C runs $(cd runs && ls -d dist forced 2>/dev/null) ;;
    check-package|bench-model)  # a fresh process with nvcc off PATH and without the CUTLASS wheel
      NOCUDA_PATH=$(echo "$PATH" | tr ':' '\n' | grep -v -i cuda | paste -sd:)
      SITE2=$(mktemp -d)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE2" \
        $(ls .whl/*.whl | grep -v -i cutlass) || exit 1
      args=(runs/dist); [[ $step == check-package ]] && args=("runs/${CHECK_DIST:-forced}" --layers "${CHECK_LAYERS:-4096x4096,14336x4096}")
      [[ $step == bench-model ]] && args+=(--layers "${MODEL_LAYERS:-2}" --repeats "${MODEL_REPEATS:-10}")
      env -u CUDA_HOME -u HGEMM_TUNE_CACHE PATH="$NOCUDA_PATH" PYTHONPATH="$SITE2:$PWD" \
        timeout "$(cap 300)" python3 -m tuner.cli "$step" "${args[@]}" 2>&1 \
        | tee "$OUT/$step.log" | tail -30 ;;
    *) echo "unknown step $step" ;;
  esac
done
# The call returns at most 8 files: past that, everything but the archives already there goes into one more
# archive, named for this run (a command may run this script more than once).
if (( $(find "$OUT" -type f | wc -l) > 8 )); then
  packed=$(cd "$OUT" && find . -type f ! -name '*.tar.xz' | sort)
  (cd "$OUT" && tar cJf "out-$$.tar.xz" $packed && rm -f $packed && find . -mindepth 1 -type d -empty -delete)
  echo "device_run.sh: more than 8 files under \$OUT, packed into out-$$.tar.xz"
fi
