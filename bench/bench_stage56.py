"""Stages 5 + 6 alone: our full-K kernel (`wy_dqkg_wide`) against fla's two kernels, side by side.

    python bench/bench_stage56.py --out bench/results            # on the GPU machine

Stages 1-4 run once per shape (fla's, `h` given); then, on the same products, the timed
runners are fla's `chunk_bwd_dqkwg` + `prepare_wy_repr_bwd` + its reverse cumsum (what the
`fla` backend runs) and `wy_dqkg_wide` under each launch configuration of the sweep.
Two parts:
  * `sweep`: the launch configurations in CONFIGS at B8 T4096 H32, with the compiled
    kernel's registers, spills and shared memory, so the pinned configuration has its
    measurement;
  * `crossover`: the same head layout at a falling number of programs (chunks x heads), fla
    against the default configuration and the sweep's best, for the CTA floor in
    `triton_wide.supported`.
Errors are relative Frobenius errors of each output against fla's. Writes stage56.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gdr_dispatch.backends.fla_chain import fla_stages_5_6, fla_state_stages  # noqa: E402
from gdr_dispatch.backends.kernels import wy_dqkg_transposed as transposed_mod  # noqa: E402
from gdr_dispatch.backends.kernels import wy_dqkg_wide as wide_mod  # noqa: E402
from gdr_dispatch.contract import validate  # noqa: E402
from gdr_dispatch.dispatch import measure_ms, relative_error  # noqa: E402
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs  # noqa: E402

# (launcher, its jit kernels) per fused-stage kernel
KERNELS = {
    "wide": (wide_mod.wy_dqkg_wide, (wide_mod.wy_dqkg_wide_kernel,)),
    "transposed": (transposed_mod.wy_dqkg_transposed,
                   (transposed_mod.wy_dqkg_t_main_kernel, transposed_mod.wy_dqkg_t_side_kernel)),
}
# wide, 8 warps only: on the H200 (2026-11-29) every 4-warp configuration (BV 32/64, 1-3
# stages) spilled 844-888 registers and took 8.9-12.6 ms at B8 T4096 H32, against 4.2-5.4 ms
# with 8 warps, of which these two were the best and the tested default. transposed: not yet
# measured; compiled here with Triton 3.6 for sm_90a its main kernel needs 255 registers with
# 764 bytes of spill stores at BV 32 / KS 32 (the wide kernel: 3.9-5.6 KB), 2.4 KB when capped
# at 128 registers for two CTAs per SM.
CONFIGS = [dict(kernel="wide", BV=32, num_warps=8, num_stages=3), dict(kernel="wide", BV=64, num_warps=8, num_stages=2)]
_T = dict(kernel="transposed", BV=32, KS=32, num_warps=8, num_stages=2)
CONFIGS += [_T, {**_T, "num_stages": 3}, {**_T, "BV": 64}, {**_T, "KS": 64}, {**_T, "main_maxnreg": 128},
            {**_T, "main_maxnreg": 128, "side_maxnreg": 128}, {**_T, "side_warps": 4}]
NAMES = ("dq", "dk", "dv", "db", "dg")


def compiled_stats(kernel: str):
    """(registers, spills, shared bytes) of the newest compile of each of `kernel`'s jit kernels."""
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
    st = fla_state_stages(call)
    fla = lambda: fla_stages_5_6(st, call.scale)  # noqa: E731

    def wide(kernel="wide", **cfg):
        return lambda: KERNELS[kernel][0](
            st.q, st.k, st.v, st.v_new, st.du, st.do, call.a, call.g, st.beta, st.h, st.dh, call.scale,
            call.chunk_size, st.common["cu_seqlens"], st.common["chunk_indices"], call.state_v_first, **cfg)
    return fla, wide, call


def errors(got, ref):
    return {n: float(f"{relative_error(a, b):.2e}") for n, a, b in zip(NAMES, got, ref)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
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
    fla_ms = measure_ms(fla, "cuda", warmup=3, reps=args.reps)
    doc["sweep_shape"], doc["fla_ms"] = spec.label(), round(fla_ms, 4)
    print(f"{spec.label()}: fla stages 5+6 {fla_ms:.3f} ms", flush=True)
    best = (float("inf"), dict(kernel="wide", BV=64, num_warps=8, num_stages=2))
    configs = [] if args.skip_sweep else CONFIGS
    for cfg in configs:
        t0 = time.perf_counter()
        try:
            run = wide(**cfg)
            err = errors(run(), ref)
            ms = measure_ms(run, "cuda", warmup=3, reps=args.reps)
            row = {**cfg, "ms": round(ms, 4), "speedup_vs_fla": round(fla_ms / ms, 3), "err_vs_fla": err,
                   "regs_spills_smem": compiled_stats(cfg["kernel"])}
            best = min(best, (ms, cfg), key=lambda t: t[0])
        except Exception as e:  # noqa: BLE001 - a config out of resources is a result too
            row = {**cfg, "failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        doc["sweep"].append(row)
        print(f"  {row}  [{time.perf_counter() - t0:.1f} s]", flush=True)
        save()
        if "illegal memory access" in row.get("failed", ""):
            # the CUDA context is gone: every later launch in this process would fail too
            # (2026-11-29: one crash took the whole remaining sweep with it)
            doc["aborted"] = f"CUDA context lost at {cfg}"
            save()
            print(doc["aborted"], flush=True)
            return 1
    doc["best"] = best[1]
    del fla, wide, ref
    torch.cuda.empty_cache()

    # same head layout (H32), falling program counts: chunks x B x H
    for B, T in ((8, 4096), (2, 4096), (1, 4096), (1, 2048), (1, 1024), (1, 512), (1, 256)):
        spec = ShapeSpec(B=B, T=T, H=32, h="given")
        fla, wide, call = setup(spec)
        ref = fla()
        row = {"shape": spec.label(), "programs": B * (-(-T // 64)) * 32,
               "fla_ms": round(measure_ms(fla, "cuda", warmup=3, reps=args.reps), 4)}
        for tag, cfg in (("default", {}), ("transposed_default", {"kernel": "transposed"}), ("best", best[1])):
            run = wide(**cfg)
            row[f"wide_{tag}_err"] = errors(run(), ref)
            row[f"wide_{tag}_ms"] = round(measure_ms(run, "cuda", warmup=3, reps=args.reps), 4)
        doc["crossover"].append(row)
        print(f"  {row}", flush=True)
        save()
        del fla, wide, ref
        torch.cuda.empty_cache()

    lines = [f"stages 5+6 at {doc['sweep_shape']}: fla {doc['fla_ms']:.3f} ms", "",
             "| kernel | BV | KS | warps | stages | ms | vs fla | regs, spills, smem |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["sweep"]:
        lines.append(f"| {r['kernel']} | {r['BV']} | {r.get('KS', '-')} | {r['num_warps']} | {r['num_stages']} | "
                     f"{r.get('ms', 'failed')} | "
                     f"{r.get('speedup_vs_fla', '-')} | {r.get('regs_spills_smem', r.get('failed'))} |")
    lines += ["", f"best: {doc['best']}", "",
              "| shape | programs | fla ms | wide default ms | transposed default ms | best ms |",
              "|---|---|---|---|---|---|"]
    for r in doc["crossover"]:
        lines.append(f"| {r['shape']} | {r['programs']} | {r['fla_ms']} | {r['wide_default_ms']} | "
                     f"{r['wide_transposed_default_ms']} | {r['wide_best_ms']} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
