"""Stages 5 + 6 alone: our fused kernels (`wy_dqkg_wide`, the `wy_dqkg_transposed` pair)
against fla's two kernels, side by side.

    python bench/bench_stage56.py --out bench/results            # on the GPU machine

Stages 1-4 run once per shape (fla's, `h` given); then, on the same products, the timed
runners are fla's `chunk_bwd_dqkwg` + `prepare_wy_repr_bwd` + its reverse cumsum (what the
`fla` backend runs) and our kernels under each launch configuration of the sweep.
Three parts:
  * `sweep`: the launch configurations in CONFIGS at B8 T4096 H32, with each compiled jit
    kernel's registers, spills and shared memory, so a pinned configuration has its
    measurement;
  * `kernel_ms`: a torch.profiler pass over fla and each kernel's best configuration, the
    device time per launched kernel (where the time goes: main vs side, the casts);
  * `crossover`: the same head layout at a falling number of programs (chunks x heads), fla
    against each kernel's default and best configuration.
Errors are relative Frobenius errors of each output against fla's. Writes stage56.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from gdr_dispatch.backends.common.fla_pipeline import fused_stage_args, stages_5_6, state_stages
from gdr_dispatch.backends.kernels import wy_dqkg_transposed as transposed_mod
from gdr_dispatch.backends.kernels import wy_dqkg_wide as wide_mod
from gdr_dispatch.contract import validate
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs
from timing import measure_ms, relative_error

RESULTS = Path(__file__).resolve().parent / "results"

# (launcher, its jit kernels) per fused-stage kernel
KERNELS = {
    "wide": (wide_mod.wy_dqkg_wide, (wide_mod.wy_dqkg_wide_kernel,)),
    "transposed": (transposed_mod.wy_dqkg_transposed,
                   (transposed_mod.wy_dqkg_t_main_kernel, transposed_mod.wy_dqkg_t_side_kernel)),
}
# wide, 8 warps only (4 warps spilled 844-888 registers and ran 2-3x slower on the H200:
# docs/kernels.md); these two were the best and the tested default.
CONFIGS = [dict(kernel="wide", BV=32, num_warps=8, num_stages=3), dict(kernel="wide", BV=64, num_warps=8, num_stages=2)]
# transposed: the launcher's default (main strips of 16, the side kernel's whole K) and the
# knobs around it; the side settings measured wrong on the H200 are refused by the launcher,
# and register caps only spilled (docs/kernels.md).
_T = dict(kernel="transposed", BV=32, KS=16, num_warps=8, num_stages=2)
CONFIGS += [_T, {**_T, "KS": 32}, {**_T, "num_stages": 3}, {**_T, "BV": 64}, {**_T, "side_KS": 16}]
NAMES = ("dq", "dk", "dv", "db", "dg")
CONFIG_KEYS = {k for cfg in CONFIGS for k in cfg}


def compiled_stats(kernel: str):
    """(registers, spills, shared bytes) of the newest compile of each of `kernel`'s jit kernels.

    A launch served from the compile cache adds no compile, so its row repeats the figures of
    the last configuration that did compile that kernel (e.g. the side kernel when only the
    main kernel's knobs changed)."""
    out = []
    for fn in KERNELS[kernel][1]:
        try:
            newest = [ck for cache in fn.device_caches.values() for ck in cache[0].values()][-1]
            out.append((newest.n_regs, newest.n_spills, newest.metadata.shared))
        except Exception as e:  # noqa: BLE001 - Triton internals differ between versions
            out.append(f"unavailable: {type(e).__name__}: {e}")
    return out


def setup(spec):
    x = make_inputs(spec, "cuda", seed=1)
    call = validate(**call_kwargs(x))
    st = state_stages(call)
    fla = lambda: stages_5_6(st, call.scale)  # noqa: E731

    args = fused_stage_args(call, st)

    def wide(kernel="wide", **cfg):
        return lambda: KERNELS[kernel][0](*args, **cfg)
    return fla, wide, call


def kernel_times(run, reps=5):
    """{kernel name: mean device ms per call} over `reps` calls, from torch.profiler: where a
    runner's time goes (e.g. the transposed pair's main kernel, its side kernel, the casts)."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            out[ev.key[:80]] = round(t / 1000 / reps, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


def errors(got, ref):
    return {n: float(f"{relative_error(a, b):.2e}") for n, a, b in zip(NAMES, got, ref)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--skip-sweep", action="store_true")
    args = p.parse_args()
    doc = {"device": torch.cuda.get_device_name(), "sweep": [], "crossover": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / "stage56.json").write_text(json.dumps(doc, indent=1) + "\n")

    spec = ShapeSpec(B=8, T=4096, H=32, h="given")
    fla, wide, _ = setup(spec)
    ref = fla()
    wide_ref = wide()()  # the wide kernel's default: what the transposed pair must reproduce
    fla_ms = measure_ms(fla, "cuda", warmup=3, reps=args.reps)
    doc["sweep_shape"], doc["fla_ms"] = spec.label(), round(fla_ms, 4)
    print(f"{spec.label()}: fla stages 5+6 {fla_ms:.3f} ms", flush=True)
    configs = [] if args.skip_sweep else CONFIGS
    for cfg in configs:
        t0 = time.perf_counter()
        try:
            run = wide(**cfg)
            got = run()
            err = errors(got, ref)
            vs_wide = {n: ("bit-identical" if torch.equal(a, b) else float(f"{relative_error(a, b):.2e}"))
                       for n, a, b in zip(NAMES, got, wide_ref)}
            ms = measure_ms(run, "cuda", warmup=3, reps=args.reps)
            row = {**cfg, "ms": round(ms, 4), "speedup_vs_fla": round(fla_ms / ms, 3), "err_vs_fla": err,
                   "vs_wide_default": vs_wide, "regs_spills_smem": compiled_stats(cfg["kernel"])}
        except Exception as e:  # noqa: BLE001 - a config out of resources is a result too
            row = {**cfg, "failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        doc["sweep"].append(row)
        print(f"  {row}  [{time.perf_counter() - t0:.1f} s]", flush=True)
        save()
        if "illegal memory access" in row.get("failed", ""):
            # the CUDA context is gone: every later launch in this process would fail too
            # (one crash took the whole remaining sweep with it)
            doc["aborted"] = f"CUDA context lost at {cfg}"
            save()
            print(doc["aborted"], flush=True)
            return 1
    doc["best_of"] = {}
    for kernel in KERNELS:
        rows = [r for r in doc["sweep"] if r.get("kernel") == kernel and "ms" in r]
        if rows:
            doc["best_of"][kernel] = {k: v for k, v in min(rows, key=lambda r: r["ms"]).items() if k in CONFIG_KEYS}
    for tag, cfg in (("fla", None), *((f"{kn}_best", c) for kn, c in doc["best_of"].items())):
        try:
            doc.setdefault("kernel_ms", {})[tag] = kernel_times(fla if cfg is None else wide(**cfg))
        except Exception as e:  # noqa: BLE001 - the profile is a diagnostic, not the measurement
            doc.setdefault("kernel_ms", {})[tag] = f"unavailable: {type(e).__name__}: {e}"[:300]
        print(f"  kernels of {tag} ({cfg}): {doc['kernel_ms'][tag]}", flush=True)
    save()
    del fla, wide, ref, wide_ref
    torch.cuda.empty_cache()

    # same head layout (H32), falling program counts: chunks x B x H
    for B, T in ((8, 4096), (2, 4096), (1, 4096), (1, 2048), (1, 1024), (1, 512), (1, 256)):
        spec = ShapeSpec(B=B, T=T, H=32, h="given")
        fla, wide, call = setup(spec)
        ref = fla()
        row = {"shape": spec.label(), "programs": B * (-(-T // 64)) * 32,
               "fla_ms": round(measure_ms(fla, "cuda", warmup=3, reps=args.reps), 4)}
        for tag, cfg in (("default", {}), ("transposed_default", {"kernel": "transposed"}),
                         *((f"{kn}_best", c) for kn, c in doc.get("best_of", {}).items())):
            try:
                run = wide(**cfg)
                row[f"wide_{tag}_err"] = errors(run(), ref)
                row[f"wide_{tag}_ms"] = round(measure_ms(run, "cuda", warmup=3, reps=args.reps), 4)
            except Exception as e:  # noqa: BLE001 - reported in the row; a lost context ends the loop below
                row[f"wide_{tag}_ms"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        doc["crossover"].append(row)
        print(f"  {row}", flush=True)
        save()
        if any("illegal memory access" in str(v) for v in row.values()):
            doc["aborted"] = f"CUDA context lost at {spec.label()}"
            save()
            return 1
        del fla, wide, ref
        torch.cuda.empty_cache()

    lines = [f"stages 5+6 at {doc['sweep_shape']}: fla {doc['fla_ms']:.3f} ms", "",
             "| kernel | config | ms | vs fla | regs, spills, smem per jit kernel |", "|---|---|---|---|---|"]
    for r in doc["sweep"]:
        knobs = ", ".join(f"{k}={v}" for k, v in r.items() if k in CONFIG_KEYS - {"kernel"})
        lines.append(f"| {r['kernel']} | {knobs} | {r.get('ms', 'failed')} | {r.get('speedup_vs_fla', '-')} | "
                     f"{r.get('regs_spills_smem', r.get('failed'))} |")
    lines += ["", f"best of each kernel: {doc.get('best_of')}", "", f"kernel times: {doc.get('kernel_ms')}", "",
              "| shape | programs | fla ms | wide default | transposed default | wide best | transposed best |",
              "|---|---|---|---|---|---|---|"]
    for r in doc["crossover"]:
        cells = [r.get(f"wide_{t}_ms", "-") for t in ("default", "transposed_default", "wide_best", "transposed_best")]
        lines.append(f"| {r['shape']} | {r['programs']} | {r['fla_ms']} | " + " | ".join(map(str, cells)) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
