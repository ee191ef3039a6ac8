"""Smallest kernels around the side kernel's strip loop, to pin the Hopper + Triton 3.6 error.

    python tools/repro_side_strips.py         # on the GPU machine (CPU: TRITON_INTERPRET=1, fp16)

On the H200 (2026-11-29) `wy_dqkg_t_side_kernel` with strips of 32 or 64 over K = 128 gave
db and dg 1-7e-3 off float64 while dk was exact; strips of 16 and 128 were exact
(bench/results/nvidia-h200-sm90-stage56.md). The strip loop makes two products:
`dAg += dw_s (kb_s)^T` (feeds dk, which matched) and `kk += k_s k_s^T` (feeds db and dg
only): the suspect. Each variant here computes one [64, 64] product per program over strips
of KS and compares it with torch in fp32:
  * `kk`:      kk += dot(k_s, trans(k_s)), alone in the loop;
  * `kk+dAg`:  the side kernel's loop as written: dAg = dw_s (k_s * r)^T with the row
               scale r (beta e^G there) applied to the loaded k strip in registers, then kk;
  * `kk+dAg_ld`: the same with the scaled strip loaded as its own tensor;
  * `kk_2ld`:  kk from two separate loads of the strip (no tile used as both operands).
A row per (variant, KS, warps) with the relative error; anything above ~1e-6 (fp32
accumulation of bf16 products, same order as torch's up to summation order) is the bug.
Not yet run on a GPU.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def strip_products(k, dw, kb, r, out_kk, out_dag, K: tl.constexpr, KS: tl.constexpr, VARIANT: tl.constexpr):
    i = tl.program_id(0)
    o_t = tl.arange(0, 64)
    base = i * 64 * K
    kk = tl.zeros([64, 64], dtype=tl.float32)
    dag = tl.zeros([64, 64], dtype=tl.float32)
    for i_s in range(K // KS):
        o_s = i_s * KS + tl.arange(0, KS)
        addr = base + o_t[:, None] * K + o_s[None, :]
        b_k = tl.load(k + addr)
        if VARIANT == 1:  # kk+dAg, the scaled strip made in registers from b_k
            b_dw = tl.load(dw + addr)
            b_r = tl.load(r + i * 64 + o_t)
            b_kb = (b_k.to(tl.float32) * b_r[:, None]).to(b_k.dtype)
            dag += tl.dot(b_dw, tl.trans(b_kb))
        if VARIANT == 3:  # kk+dAg_ld
            b_dw = tl.load(dw + addr)
            b_kb = tl.load(kb + addr)
            dag += tl.dot(b_dw, tl.trans(b_kb))
        if VARIANT == 2:  # kk_2ld: the transposed operand loaded on its own
            b_kT = tl.load(k + base + o_t[None, :] * K + o_s[:, None])
            kk += tl.dot(b_k, b_kT)
        else:
            kk += tl.dot(b_k, tl.trans(b_k))
    o = i * 64 * 64 + o_t[:, None] * 64 + o_t[None, :]
    tl.store(out_kk + o, kk)
    tl.store(out_dag + o, dag)


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # the interpreter's bf16 dot is garbage
    n, K = 512, 128
    g = torch.Generator().manual_seed(0)
    k, dw = (torch.randn(n, 64, K, generator=g).to(dev, dtype) for _ in range(2))
    r = torch.rand(n, 64, generator=g).to(dev)
    kb = (k.float() * r[..., None]).to(dtype)  # what variant 1 makes in registers
    ref_kk = k.float() @ k.float().transpose(-1, -2)
    ref_dag = dw.float() @ kb.float().transpose(-1, -2)
    rows = []
    for variant, name in enumerate(("kk", "kk+dAg", "kk_2ld", "kk+dAg_ld")):
        for KS in (16, 32, 64, 128):
            for warps in ((8, 4) if dev == "cuda" else (4,)):
                out_kk = torch.empty(n, 64, 64, device=dev)
                out_dag = torch.zeros(n, 64, 64, device=dev)
                try:
                    strip_products[(n,)](k, dw, kb, r, out_kk, out_dag, K=K, KS=KS, VARIANT=variant, num_warps=warps)
                    err = ((out_kk - ref_kk).norm() / ref_kk.norm()).item()
                    err_dag = ((out_dag - ref_dag).norm() / ref_dag.norm()).item() if variant in (1, 3) else None
                    row = {"variant": name, "KS": KS, "warps": warps, "kk_err": float(f"{err:.2e}"),
                           "dAg_err": None if err_dag is None else float(f"{err_dag:.2e}")}
                except Exception as e:  # noqa: BLE001 - a compile failure is a result here
                    row = {"variant": name, "KS": KS, "warps": warps, "failed": f"{type(e).__name__}: {e}"[:200]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu interpreter",
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
