#!/usr/bin/env bash
# One call on the GPU machine (bare, no network): unpack the package bundle, restore the
# autotune results of earlier calls, run the asked-for steps each under its own time limit,
# and leave logs and results under $OUT. Steps, in the order given:
#   precompile       (PRECOMPILE='H,Hg,dtype[,ws] ...' to choose; ws: the warp-specialised kernel) TileLang kernels, compiled in parallel in the
#                    background (tests wait for it before the tilelang_fused cases) -> $OUT/precompile.log
#   tests[=SECONDS]  tests/test_gpu.py, one line per test, tilelang_fused last -> $OUT/gpu_tests.log
#   diag[=SECONDS]   tools/diag_transposed.py (fused-stage numerics vs float64) -> $OUT/diag.log, bench/diag_transposed.json
#   repro[=SECONDS]  tools/repro_side_strips.py (the side kernel's strip products alone) -> $OUT/repro.log, bench/repro_side_strips.json
#   smoke[=SECONDS]  tools/ws_probe.py --only tiny --check --check-kernels ws --repeat 2 (WS_ARGS='--build <b>'): a new ws build's
#                    first launch, errors against the torch backend, under a short limit -> $OUT/smoke.log
#   race[=SECONDS]   compute-sanitizer racecheck + synccheck on both TileLang kernels (tiny shape), then
#                    20 repeated runs of each against the torch backend at B8 T4096 H32 -> $OUT/race.log
#   timing[=SECONDS] tools/ws_probe.py --timing (cycles per chunk, per group and phase; TIMING_SHAPES
#                    names the shapes, default B4T4096H16 B8T4096H32) -> $OUT/timing.log, $OUT/bench/timing.json
#   wsbench[=SECONDS] tools/ws_probe.py --plain (ws vs plain kernel launchers; WS_SHAPES; WS_BUILDS='default,nofst'
#                    times those ws builds side by side; WS_NO_PLAIN=' ' leaves the plain kernel out) -> $OUT/wsbench.log,
#                    ending with a markdown table of every shape's builds and peers (ws_probe.py --summarize)
#   stage56[=SECONDS] bench/bench_stage56.py (wide kernel configs, crossover) -> $OUT/stage56.log, bench/stage56.json
#   bench[=SECONDS]  bench/bench_gdr_bwd.py, h200-train      -> $OUT/bench/<device>.{json,md}
#   trainbench[=SECONDS] bench/bench_training_op.py (forward + backward of our op vs fla's and FlashQLA's ops;
#                    TRAIN_MATCH='<regex>' picks shapes, TRAIN_BACKENDS='a,b' adds our op forced to each, TRAIN_FORWARDS='a' with each forward provider; TRAIN_ARGS adds flags, e.g. '--compile-backends fla,flash_qla') -> $OUT/trainbench.log, $OUT/bench/<device>-training.{json,md}
#   tune[=SECONDS]   gdr-dispatch tune --preset h200-train (TUNE_ARGS replaces the preset, e.g. '--grid
#                    tools/tune_saturated.yaml --backends fla,tilelang_ws') -> $OUT/tune.log (TUNE_LOG), $OUT/<device>.yaml
#   profile[=SECONDS] tools/profile_fla_adapter.py           -> $OUT/profile.log
#   states[=SECONDS] bench/bench_states.py (the h=None state kernel beside fla's stages 1-2 and FlashQLA's fused_gdr_h;
#                    STATES_ARGS adds flags: --builds a,b --timing --no-peer --match B8) -> $OUT/states.log, $OUT/bench/states.{json,md}
#   statesrace[=SECONDS] compute-sanitizer racecheck + synccheck on the state kernel (bench_states.py --tiny;
#                    STATES_BUILDS='default,s3') -> $OUT/statesrace.log
#   splitprof[=SECONDS] tools/profile_split.py (a split call's GPU vs host time, top ops; --graph in SPLIT_ARGS adds CUDA-graph replays; SPLIT_ARGS, default
#                    B1 T32768 H4, 16 segments, tilelang_ws and fla) -> $OUT/splitprof.log
#   ncu[=SECONDS]    Nsight Compute, one launch of the ws kernel (NCU_SHAPE, default B4T4096H16; WS_ARGS
#                    picks the build), full set, clocks left alone -> $OUT/ncu-ws.log, $OUT/ncu-ws-details.csv,
#                    $OUT/ncu-ws-source.csv (SASS lines with warp-state samples; read with tools/ncu_groups.py);
#                    NCU_KERNEL=flashqla: FlashQLA's fused kernel instead, into $OUT/ncu-flashqla*
# e.g.  bash tools/device_run.sh precompile tests=240 bench=200 tune=120
# Env: PRECOMPILE_JOBS (default 8) compiles in parallel; BENCH_ARGS (with BENCH_MATCH/SKIP) adds bench flags; USER_TABLES=/tmp/tables lets the steps after a tune
# dispatch with its table; TESTS_K='<pytest -k expression>' runs only those GPU tests (one pytest, tilelang_fused not
# held back; TESTS_LOG names its log); RACE_KERNELS='ws' checks only that kernel; WS_ARGS='--build nofst'
# passes flags to tools/ws_probe.py in the race, timing and wsbench steps (its ws builds only); BENCH_MATCH='<regex>' benches only the matching shapes and merges them into the
# committed bench/results/<device>.json; BENCH_SKIP='a,b' leaves those runners out (merged, so
# their committed numbers stay, marked as from an earlier run).
# Prepare here first (both ignored by git, named in the run's carry; optional: the kernels' cubins
# built on this machine, tools/prebuild_cubins.sh -> .devcache/cubins.tar.xz):
#   mkdir -p .devbundle && cp ../shared/device/site-py312.tar.xz .devbundle/
#   .devcache/tcache/  <- optional: autotune.tgz of an earlier call, unpacked. Without it the
#                         committed tools/h200_autotune_cache.tgz is used (fla's autotuner takes
#                         one to two minutes per new head layout without any)
set -u
# (a second invocation in the same call finds the bundle unpacked)
[ -f /tmp/site/.unpacked ] || { mkdir -p /tmp/site && tar -xJf .devbundle/site-py312.tar.xz -C /tmp/site && touch /tmp/site/.unpacked; } || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache TILELANG_CACHE_DIR=/tmp/tlcache \
       GDR_TUNING_CACHE=${USER_TABLES:-/tmp/usertables}
# the include paths TileLang passes nvcc, spelled out: its cubin cache keys on them, and
# tools/prebuild_cubins.sh builds cubins here with the same spelling (unpacked below)
export TL_TEMPLATE_PATH=/tmp/site/tilelang/3rdparty/../src TL_CUTLASS_PATH=/tmp/site/tilelang/3rdparty/cutlass/include
[ -f .devcache/cubins.tar.xz ] && mkdir -p /tmp/tlcache && tar -xJf .devcache/cubins.tar.xz -C /tmp/tlcache
# compiled kernels of an earlier call (Triton's and TileLang's caches), else fla's autotune results only
if [ -f .devcache/caches.tar.xz ]; then tar -xJf .devcache/caches.tar.xz -C /;
elif [ -d .devcache/tcache ]; then cp -r .devcache/tcache /tmp/; else tar -xzf tools/h200_autotune_cache.tgz -C /tmp; fi
mkdir -p "$OUT/bench" /tmp/tables
# (a second invocation keeps the table a first one tuned)
[ -f tuning_cache/nvidia-h200-sm90.yaml ] && cp -n tuning_cache/nvidia-h200-sm90.yaml /tmp/tables/

for arg in "$@"; do
  step=${arg%%=*}; limit=${arg#*=}; [ "$limit" = "$arg" ] && limit=300
  start=$(date +%s)
  case $step in
    precompile)
             configs=${PRECOMPILE:-4,2,bfloat16 4,4,bfloat16 4,2,float16 4,4,float16 16,16,bfloat16 32,32,bfloat16 32,16,bfloat16}
             python3 tools/precompile_tilelang.py --jobs "${PRECOMPILE_JOBS:-8}" $(printf -- '--config %s ' $configs) > "$OUT/precompile.log" 2>&1 &
             precompile_pid=$! ;;
    tests)   if [ -n "${TESTS_K:-}" ]; then  # no wait for precompile: a test compiles what it needs first
               timeout "$(( limit - ($(date +%s) - start) ))" python3 -m pytest -v tests/test_gpu.py -p no:cacheprovider -W ignore -rfEs --durations=8 \
                 -n 8 --dist loadgroup -k "$TESTS_K" > "$OUT/${TESTS_LOG:-gpu_tests.log}" 2>&1
               echo "$step: exit $? after $(( $(date +%s) - start )) s"; continue
             fi
             pytest_gpu=(python3 -m pytest -v tests/test_gpu.py -p no:cacheprovider -W ignore -rfEs --durations=8
                         -n 8 --dist loadgroup)
             timeout "$(( limit * 6 / 10 ))" "${pytest_gpu[@]}" -k "not tilelang_fused" > "$OUT/gpu_tests.log" 2>&1
             [ -n "${precompile_pid:-}" ] && wait "$precompile_pid"
             timeout "$(( limit - ($(date +%s) - start) ))" "${pytest_gpu[@]}" -k tilelang_fused >> "$OUT/gpu_tests.log" 2>&1 ;;
    diag)    timeout "$limit" python3 tools/diag_transposed.py "$OUT/bench/diag_transposed.json" > "$OUT/diag.log" 2>&1 ;;
    repro)   timeout "$limit" python3 tools/repro_side_strips.py "$OUT/bench/repro_side_strips.json" > "$OUT/repro.log" 2>&1 ;;
    smoke)   [ -n "${precompile_pid:-}" ] && wait "$precompile_pid"  # a new build's first run: a hang costs only the limit
             timeout "$limit" python3 tools/ws_probe.py --only tiny --check --check-kernels ws --repeat 2 ${WS_ARGS:-} 2>&1 | grep -v TileLang > "$OUT/smoke.log" ;;
    race)    [ -n "${precompile_pid:-}" ] && wait "$precompile_pid"
             RACE_KERNELS=${RACE_KERNELS:-ws plain} WS_ARGS=${WS_ARGS:-} timeout "$limit" bash -c 'for kern in $RACE_KERNELS; do for tool in racecheck synccheck; do
                 echo "== $tool $kern"; compute-sanitizer --tool $tool --print-limit 20 \
                   python3 tools/ws_probe.py --only tiny --once --kernel $kern $WS_ARGS 2>&1 | grep -v TileLang | tail -n 25
               done; done; python3 tools/ws_probe.py --only B8T4096H32 --check --repeat 20 $WS_ARGS 2>&1 | grep -v TileLang' \
               > "$OUT/race.log" 2>&1 ;;
    states)  # the state kernel (issue 14): STATES_ARGS for bench/bench_states.py, e.g. '--builds default,s3 --timing'
             timeout "$limit" python3 bench/bench_states.py ${STATES_ARGS:-} --out "$OUT/bench/states.json" 2>&1 \
               | grep -v TileLang > "$OUT/states.log" ;;
    statesrace) timeout "$limit" bash -c 'for tool in racecheck synccheck; do echo "== $tool"; compute-sanitizer --tool $tool \
                  --print-limit 20 python3 bench/bench_states.py --tiny --builds "${STATES_BUILDS:-default}" 2>&1 \
                  | grep -v TileLang | tail -n 25; done' > "$OUT/statesrace.log" 2>&1 ;;
    timing)  [ -n "${precompile_pid:-}" ] && wait "$precompile_pid"
             for shape in ${TIMING_SHAPES:-B4T4096H16 B8T4096H32}; do
               timeout "$(( limit - ($(date +%s) - start) ))" python3 tools/ws_probe.py --only "$shape" --timing ${WS_ARGS:-} ${WS_BUILDS:+--builds "$WS_BUILDS"} \
                 --out "$OUT/bench/timing-$shape.json" 2>&1 | grep -v TileLang
             done > "$OUT/timing.log" 2>&1 ;;
    wsbench) [ -n "${precompile_pid:-}" ] && wait "$precompile_pid"
             case " ${WS_ARGS:-} " in  # --peer: FlashQLA's kernels for every shape at once, not in turn
               *" --peer "*) timeout "$limit" python3 tools/ws_probe.py --warm-peer 8 --shapes "${WS_SHAPES:-B4T4096H16 B8T4096H32}" \
                               2>&1 | grep -v 'TileLang\|Warning\|dk_fragment\|--> \|Initialize the' > "$OUT/wsbench-warm.log" ;;
             esac
             for shape in ${WS_SHAPES:-B4T4096H16 B8T4096H32}; do
               timeout "$(( limit - ($(date +%s) - start) ))" python3 tools/ws_probe.py --only "$shape" ${WS_NO_PLAIN:---plain} ${WS_ARGS:-} ${WS_BUILDS:+--builds "$WS_BUILDS"} \
                 --out "$OUT/bench/wsbench-$shape.json" 2>&1 | grep -v TileLang
             done > "$OUT/wsbench.log" 2>&1
             python3 tools/ws_probe.py --summarize "$OUT"/bench/wsbench-*.json >> "$OUT/wsbench.log" 2>&1 ;;
    stage56) timeout "$limit" python3 bench/bench_stage56.py --out "$OUT/bench" > "$OUT/stage56.log" 2>&1 ;;
    bench)   if [ -n "${BENCH_MATCH:-}${BENCH_SKIP:-}" ]; then
               cp bench/results/nvidia-h200-sm90.json "$OUT/bench/" 2>/dev/null
               timeout "$limit" python3 bench/bench_gdr_bwd.py --preset h200-train --unverified --out "$OUT/bench" \
                 --match "${BENCH_MATCH:-.}" --skip "${BENCH_SKIP:-}" --merge ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
             else
               timeout "$limit" python3 bench/bench_gdr_bwd.py --preset h200-train --unverified --out "$OUT/bench" \
                 > "$OUT/bench.log" 2>&1
             fi ;;
    trainbench) timeout "$limit" python3 bench/bench_training_op.py --preset h200-train --match "${TRAIN_MATCH:-.}" \
               --backends "${TRAIN_BACKENDS:-}" --forwards "${TRAIN_FORWARDS:-}" ${TRAIN_ARGS:-} --out "$OUT/bench" > "$OUT/trainbench.log" 2>&1 ;;
    tune)    timeout "$limit" python3 -m gdr_dispatch tune ${TUNE_ARGS:---preset h200-train} --out /tmp/tables \
               > "$OUT/${TUNE_LOG:-tune.log}" 2>&1; cp /tmp/tables/*.yaml "$OUT/" ;;
    ncu)     [ -n "${precompile_pid:-}" ] && wait "$precompile_pid"
             # NCU_KERNEL=flashqla profiles FlashQLA's fused kernel at the same shape instead (its name:
             # tilelang_fused_chunk_gdr_bwd); the files carry the kernel's tag, so both can run in one call
             tag=${NCU_KERNEL:-ws}
             case $tag in flashqla) kre=regex:tilelang_fused_chunk_gdr_bwd ;; *) kre=regex:gdr_bwd_ws ;; esac
             timeout "$limit" ncu --clock-control none --set full -k "$kre" --launch-skip 1 --launch-count 1 \
               -f -o /tmp/ncu-$tag python3 tools/ws_probe.py --only "${NCU_SHAPE:-B4T4096H16}" --once \
               --kernel "$tag" ${WS_ARGS:-} > "$OUT/ncu-$tag.log" 2>&1
             ncu -i /tmp/ncu-$tag.ncu-rep --page details --csv > "$OUT/ncu-$tag-details.csv" 2>> "$OUT/ncu-$tag.log"
             ncu -i /tmp/ncu-$tag.ncu-rep --page source --csv --print-source sass > "$OUT/ncu-$tag-source.csv" 2>> "$OUT/ncu-$tag.log"
             if [ "$tag" = ws ]; then
               python3 tools/ncu_groups.py "$OUT/ncu-ws-source.csv" >> "$OUT/ncu-ws.log" 2>&1
             elif [ -f "$OUT/ncu-ws-source.csv" ]; then  # after both: ours beside FlashQLA's, group by group
               python3 tools/ncu_groups.py "$OUT/ncu-ws-source.csv" --top 0 --peer "$OUT/ncu-$tag-source.csv" \
                 >> "$OUT/ncu-$tag.log" 2>&1
             fi ;;
    profile) timeout "$limit" python3 tools/profile_fla_adapter.py --B 8 --T 4096 --H 32 --rounds 3 > "$OUT/profile.log" 2>&1 ;;
    splitprof) timeout "$limit" python3 tools/profile_split.py ${SPLIT_ARGS:-} > "$OUT/splitprof.log" 2>&1 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  echo "$step: exit $? after $(( $(date +%s) - start )) s"
done
# fla's autotune results for the next call (unpack into .devcache/ here). The whole compiled-kernel
# caches did not fit the 16 MiB a returned file may have (xz took ~100 s to find that out), so they
# are packed only with KEEP_CACHES=1 (then unpack into .devcache/caches.tar.xz).
(cd /tmp && find tcache -name '*.autotune.json' 2>/dev/null | tar -czf "$OUT/autotune.tgz" -T -)
if [ -n "${KEEP_CACHES:-}" ]; then tar -cJf /tmp/caches.tar.xz -C / tmp/tcache tmp/tlcache 2>/dev/null
  [ "$(stat -c %s /tmp/caches.tar.xz)" -lt 16000000 ] && cp /tmp/caches.tar.xz "$OUT/"; fi
tail -n 3 "$OUT"/*.log 2>/dev/null | grep -v TileLang
