"""Compile the TileLang kernels for several configurations at once, into TileLang's disk cache.

    python tools/precompile_tilelang.py --config 4,2,bfloat16 --config 32,16,bfloat16 ...

Each compile is one nvcc run of 20-40 s on one core; on the GPU machine (16 cores) the
tests and the bench would otherwise pay them one after another. Each configuration is
compiled in its own process (TileLang's cache writes through a staging folder and a
rename, so processes do not step on each other); a later process finds the kernel in the
cache. Prints the wall time of every compile (a user's first-call cost) and where its device
code came from: TileLang's kernel cache, its cubin cache (cubins built elsewhere, see
tools/prebuild_cubins.sh), or nvcc.
Scale is K^-0.5, the value the tests and the bench use (it is a compile-time constant).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor, as_completed


def _count_cubin_lookups() -> list:
    """Record, per device-code compile, whether TileLang's cross-host cubin cache had it (the
    cubins tools/prebuild_cubins.sh builds on a CPU machine): `[True, ...]` hits, `False` nvcc ran."""
    from tilelang.cache.cuda_binary_cache import CUDABinaryCache

    seen = []
    load = CUDABinaryCache.load.__func__

    def counted(cls, key, compile_format):
        out = load(cls, key, compile_format)
        seen.append(out is not None)
        return out

    CUDABinaryCache.load = classmethod(counted)
    return seen


def compile_one(H: int, Hg: int, dtype: str, schedule: str = "ws", K: int = 128) -> tuple[float, str]:
    seen = _count_cubin_lookups()
    t0 = time.perf_counter()
    words = schedule.split("-")
    if words[0] == "states":  # the state kernel (h=None): states[-vfirst][-timing]
        from gdr_dispatch.backends.kernels.tilelang_states import build_states

        if "timing" in words:
            build_states(H, Hg, dtype, "vfirst" in words, timing=True)
        else:
            build_states(H, Hg, dtype, "vfirst" in words)  # positional: the launcher's cache key
    elif words[0] == "ws":  # the fused backward: ws[-timing][-<mode>][-<form>] (tilelang_ws_bwd.build_keywords)
        from gdr_dispatch.backends.kernels.tilelang_ws_bwd import build_keywords, build_ws_bwd

        kw = build_keywords("-".join(words[1:]))
        if kw == build_keywords("default"):
            build_ws_bwd(H, Hg, float(K ** -0.5), dtype, dtype)  # positional: the launcher's cache key
        else:  # as tools/ws_probe.py passes them
            build_ws_bwd(H, Hg, float(K ** -0.5), dtype, dtype, **kw)
    elif words[0] == "flashqla":  # FlashQLA's backward as our backend calls it: flashqla[-varlen][-hnone]...
        unknown = set(words[1:]) - {"varlen", "hnone", "noh0", "nodht"}
        if unknown:
            raise ValueError(f"flashqla: unknown words {sorted(unknown)} (varlen, hnone, noh0, nodht)")
        _flashqla_backward(H, Hg, dtype, varlen="varlen" in words, h_none="hnone" in words, K=K,
                           h0="noh0" not in words, dht="nodht" not in words)
    else:
        raise ValueError(f"unknown schedule {schedule!r}: ws[-timing][-<mode>][-<form>], states[-vfirst][-timing] "
                         "or flashqla[-varlen][-hnone][-noh0][-nodht]")
    how = "kernel cache" if not seen else ("cubin cache" if all(seen) else "nvcc")
    return time.perf_counter() - t0, how


def _flashqla_module(name: str):
    """FlashQLA's sm90 kernel module `name` (fused_bwd, prepare_h). On a machine without a GPU its
    package's own import fails (its forward reads the device's SM count at import), so the two
    modules load from their files under a stand-in package (FLASHQLA_PATH, default the device
    bundle's /tmp/site/flash_qla)."""
    import importlib
    import importlib.util
    import os
    import sys
    import types

    try:
        return importlib.import_module(f"flash_qla.ops.gated_delta_rule.chunk.hopper.{name}")
    except Exception:  # noqa: BLE001 - no GPU here: load the file alone
        for m in [m for m in sys.modules if m == "flash_qla" or m.startswith("flash_qla.")]:
            del sys.modules[m]
    root = os.environ.get("FLASHQLA_PATH", "/tmp/site/flash_qla")
    pkg = types.ModuleType("flash_qla")
    pkg.__path__ = [root]
    sys.modules["flash_qla"] = pkg
    spec = importlib.util.spec_from_file_location(f"_flashqla_{name}",
                                                  os.path.join(root, "ops/gated_delta_rule/chunk/hopper", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flashqla_backward(H: int, Hg: int, dtype: str, varlen: bool, h_none: bool, K: int = 128, h0: bool = True,
                       dht: bool = True) -> None:
    """Build FlashQLA's fused backward (and with `h_none` its state kernel) with the arguments
    backends/flash_qla.py's run gives them (G in fp32, a and h in q's dtype, int32 lengths, the
    state in [K, V], scale K^-0.5; the backward takes a dht, zeros, wherever the call has h0 or
    dht): TileLang's cubin cache keys on the CUDA source these arguments generate. Other calls
    (int64 lengths, fp32 beta, `state_v_first`, another scale) build other kernels. The target is
    the one TileLang detects on an sm_90 device, set here for a machine without one."""
    import torch
    from tilelang.cuda.target import Target

    dt = getattr(torch, dtype)
    with Target({"kind": "cuda", "arch": "sm_90a"}):
        bwd = _flashqla_module("fused_bwd")
        bwd.tilelang_fused_chunk_gdr_bwd(H, Hg, K, K, 64, float(K ** -0.5), qkva_dtype=dt, g_dtype=torch.float32,
                                         b_dtype=dt, h_dtype=dt, o_dtype=dt, seqlen_dtype=torch.int32,
                                         accum_dtype="float32", is_varlen=varlen, use_dht=h0 or dht,
                                         state_v_first=False)
        if h_none:
            prep = _flashqla_module("prepare_h")
            prep.tilelang_prepare_h(H, Hg, K, K, 64, qkva_dtype=dt, g_dtype=torch.float32, b_dtype=dt,
                                    h0_dtype=torch.float32, ht_dtype=torch.float32, h_dtype=dt,
                                    seqlen_dtype=torch.int32, accum_dtype="float32", use_initial_state=h0,
                                    store_final_state=False, store_h=True, is_varlen=varlen, is_cp=False,
                                    state_v_first=False)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", required=True,
                   help="H,Hg,dtype[,ws[-timing][-<mode>][-<form>] | ,states[-vfirst][-timing] | "
                        ",flashqla[-varlen][-hnone][-noh0][-nodht]] (K = V = 128, chunk 64; ws, the default: the "
                        "fused backward as the backend builds it; -timing: with cycle counters; -<mode>: a build of "
                        "tilelang_ws_bwd.MODES; -<form>: the column sums' form and hoisted words as ws_probe's "
                        "--colsums spells them, e.g. ws-timing-warp+gam+scale; "
                        "states: the h=None state kernel; flashqla: FlashQLA's backward as our backend calls it)")
    p.add_argument("--jobs", type=int, default=8)
    args = p.parse_args()
    configs = []
    for c in args.config:
        h, hg, dt, *schedule = c.split(",")
        configs.append((int(h), int(hg), dt, *schedule))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(configs))) as pool:
        futures = {pool.submit(compile_one, *c): c for c in configs}
        for fut in as_completed(futures):
            c = futures[fut]
            try:
                seconds, how = fut.result()
                print(f"compiled H={c[0]} Hg={c[1]} {' '.join(c[2:])}: {seconds:.1f} s ({how})", flush=True)
            except Exception as e:  # noqa: BLE001 - report every config, go on
                print(f"FAILED H={c[0]} Hg={c[1]} {' '.join(c[2:])}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    print(f"all {len(configs)} configurations in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
