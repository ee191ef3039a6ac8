#!/usr/bin/env bash
# One call on the GPU machine (bare, no network): unpack the package bundle, restore the caches
# of earlier calls, run the named steps in order, each under its own limit (`step=SECONDS`,
# default 300), with logs and results under $OUT. The steps and their variables: tools/README.md.
#   e.g.  bash tools/device_run.sh precompile tests=300 hf=120 firstcall=240
set -u
[ -f /tmp/site/.unpacked ] || { mkdir -p /tmp/site && tar -xJf .devbundle/site-py312.tar.xz -C /tmp/site && touch /tmp/site/.unpacked; } || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache TILELANG_CACHE_DIR=/tmp/tlcache \
       GDR_TUNING_CACHE=${USER_TABLES:-/tmp/usertables}
# the include paths TileLang passes nvcc, spelled out: its cubin cache keys on them, and
# tools/prebuild_cubins.sh builds cubins with the same spelling
export TL_TEMPLATE_PATH=/tmp/site/tilelang/3rdparty/../src TL_CUTLASS_PATH=/tmp/site/tilelang/3rdparty/cutlass/include
[ -f .devcache/cubins.tar.xz ] && mkdir -p /tmp/tlcache && tar -xJf .devcache/cubins.tar.xz -C /tmp/tlcache
# TileLang's disk cache of earlier calls (or ../shared/device's); what this call adds goes back into $OUT at the end
for c in .devcache/tlcache.tar.xz .devcache/tilelang-cache-h200.tar.xz; do [ -f "$c" ] && tar -xJf "$c" -C /tmp; done
# what a call adds to TileLang's cache is packed back, not what it restored (a call brings back
# files of at most 16 MiB; tools/merge_devcache.sh folds it into .devcache here); a second run in
# the same call keeps the first run's mark, so its archive holds what both added
[ -f /tmp/.restored ] || touch /tmp/.restored
if [ -d .devcache/tcache ]; then cp -r .devcache/tcache /tmp/; else tar -xzf tools/h200_autotune_cache.tgz -C /tmp; fi
mkdir -p "$OUT/bench" /tmp/tables
# WS_HOIST: the fused kernel's hoist words for this call (tilelang_ws_bwd.HOIST rewritten in this
# disposable copy of the tree), so the GPU tests and benches run a build before it is the default
if [ -n "${WS_HOIST:-}" ]; then
  sed -i "s/^HOIST = \".*\"\$/HOIST = \"$WS_HOIST\"/" backends/kernels/tilelang_ws_bwd.py
  grep -qx "HOIST = \"$WS_HOIST\"" backends/kernels/tilelang_ws_bwd.py \
    || { echo "WS_HOIST=$WS_HOIST: tilelang_ws_bwd.HOIST not rewritten" | tee "$OUT/ws_hoist.log"; exit 1; }
  python3 -c "from gdr_dispatch.backends.kernels.tilelang_ws_bwd import HOIST, hoist_form; assert hoist_form(HOIST.split('+')) == HOIST, HOIST" \
    > "$OUT/ws_hoist.log" 2>&1 || { echo "WS_HOIST=$WS_HOIST: not a hoist of HOIST_WORDS' order" >> "$OUT/ws_hoist.log"; exit 1; }
fi
[ -f tuning_cache/nvidia-h200-sm90.yaml ] && cp -n tuning_cache/nvidia-h200-sm90.yaml /tmp/tables/

for arg in "$@"; do
  step=${arg%%=*}; limit=${arg#*=}; [ "$limit" = "$arg" ] && limit=300
  start=$(date +%s)
  left() { local l=$(( limit - ($(date +%s) - start) )); [ "$l" -gt 1 ] || l=1; echo "$l"; }  # (timeout takes no negative)
  case $step in
    precompile)
      configs=${PRECOMPILE:-4,2,bfloat16,ws 4,4,bfloat16,ws 4,2,float16,ws 4,4,float16,ws}
      python3 tools/precompile_tilelang.py --jobs "${PRECOMPILE_JOBS:-8}" $(printf -- '--config %s ' $configs) \
        > "$OUT/precompile.log" 2>&1 &
      precompile_pid=$! ;;
    tests)
      [ -n "${precompile_pid:-}" ] && wait "$precompile_pid"
      timeout "$(left)" python3 -m pytest -v tests/test_gpu.py -p no:cacheprovider -W ignore -rfEs --durations=10 \
        -n "${TESTS_JOBS:-8}" --dist loadgroup ${TESTS_K:+-k "$TESTS_K"} > "$OUT/${TESTS_LOG:-gpu_tests.log}" 2>&1 ;;
    bench)
      timeout "$(left)" python3 bench/bench_gdr_bwd.py --unverified --out "$OUT/bench" ${BENCH_ARGS:---preset h200-train} \
        > "$OUT/bench.log" 2>&1 ;;
    starved)
      timeout "$(left)" python3 bench/bench_gdr_bwd.py --preset h200-starved --h none \
        --gates "${STARVED_GATES:-logsigmoid,logsigmoid16,mixed}" --splits auto \
        --split-backends "${STARVED_BACKENDS:-tilelang_fused,flash_qla}" --only-splits --out "$OUT/bench/starved" \
        ${STARVED_ARGS:-} > "$OUT/starved.log" 2>&1 ;;
    parts)
      # PARTS='B,T,H,segments,gate ...': each part of the split timed alone (tools/profile_split.py --parts)
      for shape in ${PARTS:-1,32768,4,32,logsigmoid 1,8192,16,8,logsigmoid}; do
        IFS=, read -r B T H n gate <<< "$shape"
        echo "== B$B T$T H$H split$n gate=$gate"
        timeout "$(left)" python3 tools/profile_split.py --parts --B "$B" --T "$T" --H "$H" --segments "$n" \
          --gate "$gate" --h none --backends "${PARTS_BACKEND:-tilelang_fused}" ${PARTS_ARGS:-} 2>&1 | grep -v TileLang
      done > "$OUT/parts.log" 2>&1 ;;
    firstcall)
      timeout "$(left)" python3 bench/bench_gdr_bwd.py --first-call ${FIRSTCALL_FULL:+--first-call-full} --out "$OUT/bench" \
        ${FIRSTCALL_ARGS:-} > "$OUT/firstcall.log" 2>&1 ;;
    training)
      timeout "$(left)" python3 bench/bench_training_op.py --out "$OUT/bench/training" ${TRAINING_ARGS:---preset h200-train} \
        > "$OUT/training.log" 2>&1 ;;
    hf)
      timeout "$(left)" python3 bench/bench_hf_qwen3_next.py --out "$OUT/bench/hf.json" ${HF_ARGS:-} > "$OUT/hf.log" 2>&1 ;;
    tune)
      timeout "$(left)" python3 -m gdr_dispatch tune ${TUNE_ARGS:---preset h200-train} --out /tmp/tables \
        > "$OUT/${TUNE_LOG:-tune.log}" 2>&1; cp /tmp/tables/*.yaml "$OUT/" ;;
    wsbench)
      timeout "$(left)" python3 tools/ws_probe.py --peer --rounds 3 ${WS_SHAPE:+--only "$WS_SHAPE"} \
        --out "$OUT/bench/wsbench.json" > "$OUT/wsbench.log" 2>&1 ;;
    timing)
      # each mode's cycle counters per shape (TIMING_MODES='reconly nowait full'), and with TIMING_PLAIN=1
      # the plain build's wall time too
      for mode in ${TIMING_MODES:-full}; do
        for shape in ${TIMING_SHAPES:-B4T4096H16 B8T4096H32}; do
          timeout "$(left)" python3 tools/ws_probe.py --only "$shape" --timing --mode "$mode" ${TIMING_ARGS:-} 2>&1 | grep -v TileLang
          if [ -n "${TIMING_PLAIN:-}" ]; then
            timeout "$(left)" python3 tools/ws_probe.py --only "$shape" --mode "$mode" ${TIMING_ARGS:-} 2>&1 | grep -v TileLang
          fi
        done
      done > "$OUT/timing.log" 2>&1 ;;
    splitprof)
      # SPLIT_ARGS: one run's arguments; several runs' separated by ';;' (e.g. --parts, then --peer)
      IFS=$'\n' read -r -d '' -a runs < <(printf '%s' "${SPLIT_ARGS:-}" | sed 's/;;/\n/g'; printf '\0')
      for run_args in "${runs[@]:-}"; do
        echo "== profile_split.py $run_args"
        timeout "$(left)" python3 tools/profile_split.py $run_args 2>&1 | grep -v TileLang
      done > "$OUT/splitprof.log" 2>&1 ;;
    probe)
      # PROBE_ARGS: tools/ws_probe.py runs, separated by ';;' (e.g. --only tiny --check;; --only B4T4096H16 --timing),
      # each under PROBE_RUN_S (default 120) and what is left of the step
      [ -n "${PROBE_ARGS:-}" ] || { echo "probe: PROBE_ARGS is empty" > "$OUT/probe.log"; continue; }
      IFS=$'\n' read -r -d '' -a runs < <(printf '%s' "${PROBE_ARGS:-}" | sed 's/;;/\n/g'; printf '\0')
      for run_args in "${runs[@]:-}"; do
        echo "== ws_probe.py $run_args"
        run_s=${PROBE_RUN_S:-120}
        timeout "$(( $(left) < run_s ? $(left) : run_s ))" python3 tools/ws_probe.py $run_args 2>&1 | grep -v TileLang
        echo "== exit ${PIPESTATUS[0]}"
      done > "$OUT/probe.log" 2>&1 ;;
    sanitize)
      # racecheck and synccheck of the fused kernel at `tiny`, one launch per form (SANITIZE_FORMS,
      # ws_probe --colsums spellings; default the backend's own)
      for form in ${SANITIZE_FORMS:-default}; do
        for tool in racecheck synccheck; do
          echo "== $tool $form"
          colsums=$([ "$form" = default ] || echo "--colsums $form")
          timeout "$(left)" compute-sanitizer --tool "$tool" python3 tools/ws_probe.py --only tiny --once $colsums 2>&1 \
            | grep -v TileLang | tail -n 3
        done
      done > "$OUT/sanitize.log" 2>&1 ;;
    hotpath)
      timeout "$(left)" python3 bench/bench_hot_path.py ${HOTPATH_ARGS:-} --out "$OUT/bench" 2>&1 \
        | grep -v TileLang > "$OUT/hotpath.log" ;;
    states)
      timeout "$(left)" python3 bench/bench_states.py ${STATES_ARGS:-} --out "$OUT/bench/states.json" 2>&1 \
        | grep -v TileLang > "$OUT/states.log" ;;
    hfsteps)
      # tools/hf_step_profile.py (HFSTEP_ARGS, e.g. --layers 3 --variants default,ours --rounds 3 --profile none);
      # HFSTEP_TRACE=1 writes the profiled variants' Chrome traces into $OUT/bench/traces
      timeout "$(left)" python3 tools/hf_step_profile.py ${HFSTEP_ARGS:-} ${HFSTEP_TRACE:+--trace "$OUT/bench/traces"} 2>&1 \
        | grep -v "TileLang\|causal_conv1d" > "$OUT/hfsteps.log" ;;
    l2probe)
      timeout "$(left)" python3 tools/l2norm_probe.py ${L2PROBE_ARGS:-} > "$OUT/l2probe.log" 2>&1 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  echo "$step: exit $? after $(( $(date +%s) - start )) s"
done
# compiles a step left behind (its background builds run in their own process groups, out of
# `timeout`'s reach) stop before the caches are packed: a cache written while packed comes back torn
pkill -f 'gdr_dispatch.autotune|precompile_tilelang' 2>/dev/null; pkill -x nvcc 2>/dev/null; pkill -x cicc 2>/dev/null
pkill -x ptxas 2>/dev/null; sleep 1
# fla's autotune results for the next call (unpack into .devcache/tcache here)
(cd /tmp && find tcache -name '*.autotune.json' 2>/dev/null | tar -czf "$OUT/autotune.tgz" -T -)
[ -d /tmp/tlcache ] && (cd /tmp && find tlcache -type f -newer /tmp/.restored | tar -I "xz -T0 -6" -cf "$OUT/tlcache.tar.xz" -T -)
# the folders under $OUT (bench results, per-process logs) as one archive: only 8 files come back
dirs=$(cd "$OUT" && find . -mindepth 1 -maxdepth 1 -type d -printf '%P\n')
[ -n "$dirs" ] && (cd "$OUT" && tar -czf results.tgz $dirs && rm -rf $dirs)
tail -n 3 "$OUT"/*.log 2>/dev/null | grep -v TileLang
