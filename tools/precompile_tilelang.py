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
    elif words[0] == "ws":  # the fused backward: ws[-timing][-reconly|-nowait] (the prototype builds)
        from gdr_dispatch.backends.kernels.tilelang_ws_bwd import MODES, build_ws_bwd

        mode = next((w for w in words[1:] if w in MODES), "full")
        if "timing" in words or mode != "full":  # keywords as tools/ws_probe.py passes them
            build_ws_bwd(H, Hg, float(K ** -0.5), dtype, dtype, timing="timing" in words, mode=mode)
        else:
            build_ws_bwd(H, Hg, float(K ** -0.5), dtype, dtype)
    else:
        raise ValueError(f"unknown schedule {schedule!r}: ws[-timing][-reconly|-nowait] or states[-vfirst][-timing]")
    how = "kernel cache" if not seen else ("cubin cache" if all(seen) else "nvcc")
    return time.perf_counter() - t0, how


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", required=True,
                   help="H,Hg,dtype[,ws[-timing][-reconly|-nowait] | ,states[-vfirst][-timing]] (K = V = 128, chunk 64; ws, "
                        "the default: the fused backward; -timing: with cycle counters; -reconly/-nowait: the "
                        "prototype builds; states: the h=None state kernel)")
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
