#!/usr/bin/env bash
# Compile the TileLang kernels' device code on this machine (nvcc, no GPU needed) for the GPU
# machine, so a device call spends seconds on each instead of nvcc's minute.
#
# TileLang 0.1.15 keeps a cross-host cubin cache keyed on the CUDA source, the target and the
# nvcc options; the options carry -I paths to where tilelang is installed. Here those paths are
# made the GPU machine's (/tmp/site/tilelang, a link to the local package; the headers are
# byte-identical to the bundle's), and the cubins are packed into .devcache/cubins.tar.xz, which
# tools/device_run.sh unpacks into the device's TileLang cache (it sets the same two paths).
#
#   bash tools/prebuild_cubins.sh '16,16,bfloat16,ws 32,32,bfloat16,ws-timing-warp+gam'   # precompile's configs
set -eu
configs=${1:?configs as for tools/device_run.sh PRECOMPILE}
pkg=$(.venv/bin/python -c "import os, tilelang; print(os.path.dirname(tilelang.__file__))" 2>/dev/null | tail -n 1)
mkdir -p /tmp/site && ln -sfn "$pkg" /tmp/site/tilelang
export TL_TEMPLATE_PATH=/tmp/site/tilelang/3rdparty/../src TL_CUTLASS_PATH=/tmp/site/tilelang/3rdparty/cutlass/include
export TILELANG_CACHE_DIR=${PREBUILD_DIR:-/tmp/prebuild-tlcache}
.venv/bin/python tools/precompile_tilelang.py --jobs "${JOBS:-2}" $(printf -- '--config %s ' $configs) 2>&1 | grep -v TileLang
mkdir -p .devcache
tar -cJf .devcache/cubins.tar.xz -C "$TILELANG_CACHE_DIR" "$(basename "$(ls -d "$TILELANG_CACHE_DIR"/*/cuda-binaries | head -n 1 | xargs dirname)")/cuda-binaries"
ls -la .devcache/cubins.tar.xz
