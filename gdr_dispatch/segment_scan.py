"""Pass 2 of the exact split (context_parallel.py) as two Triton kernels: the scans over each
sequence's segments, one program per (sequence, head, block of value columns), the state in
fp32 registers, one K x K product per segment.

Why kernels: the torch version (log-depth prefixes of batched products) issues ~150 small ops
per call; on the H200 the split's timings at B1 T32768 H4 spread by up to 50 % between rounds
and sat ~3 ms above their kernels (bench/results/nvidia-h200-sm90-starved.md), the mark of a
host-bound call. Here each scan is one launch. Products are 3xTF32 (`tf32x3`: tensor cores,
fp32-level error; plain TF32's 10-bit mantissa would reach every gradient of the segments after
it). Resources for sm_90a (Triton 3.9 AOT, K = V = 128): `ieee` products lowered to FMA loops
spilled 8-12 KB of stack per thread; `tf32x3` with 8 warps and no pipelining: 242-255 registers,
no stack, 64 KB shared (3 stages would take 160 KB for nothing: each step needs the last).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: value columns per program (the state block is K x BV fp32 in registers)
BV = 32
#: launch options, see the module docstring
NUM_WARPS, NUM_STAGES = 8, 1


@triton.jit
def _forward_scan(M, R, S0, OUT, n_seg, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                  HAS_S0: tl.constexpr):
    """OUT[n, j] = the state at segment j's start: S_0 = S0[n], S_{j+1} = M_j S_j + R_j."""
    nh = tl.program_id(0)
    n = nh // H
    h = nh % H
    rk = tl.arange(0, K)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    if HAS_S0:
        S = tl.load(S0 + ((n * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :])
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for j in range(n_seg):
        base = ((n * n_seg + j) * H + h).to(tl.int64)
        tl.store(OUT + (base * K + rk[:, None]) * V + rv[None, :], S)
        m = tl.load(M + (base * K + rk[:, None]) * K + rk[None, :])
        r = tl.load(R + (base * K + rk[:, None]) * V + rv[None, :])
        S = tl.dot(m, S, input_precision="tf32x3") + r


@triton.jit
def _backward_scan(M, D, G_END, ENDS, FIRST, n_seg, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                   HAS_END: tl.constexpr):
    """ENDS[n, j] = the state gradient at segment j's end: dS_{n_seg} = G_END[n],
    dS_j = M_j^T dS_{j+1} + D_j; FIRST[n] = dS_0 (the sequence's dh0)."""
    nh = tl.program_id(0)
    n = nh // H
    h = nh % H
    rk = tl.arange(0, K)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    if HAS_END:
        G = tl.load(G_END + ((n * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :])
    else:
        G = tl.zeros([K, BV], dtype=tl.float32)
    for i in range(n_seg):
        base = ((n * n_seg + n_seg - 1 - i) * H + h).to(tl.int64)
        tl.store(ENDS + (base * K + rk[:, None]) * V + rv[None, :], G)
        mt = tl.load(M + (base * K + rk[None, :]) * K + rk[:, None])  # mt[a, b] = M[b, a]
        d = tl.load(D + (base * K + rk[:, None]) * V + rv[None, :])
        G = tl.dot(mt, G, input_precision="tf32x3") + d
    tl.store(FIRST + ((n * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :], G)


def not_supported_reason(K: int, V: int, dtype: torch.dtype, device: torch.device) -> str:
    """"" when the kernels take a split's maps, else why not (the torch scan runs then)."""
    if torch.device(device).type != "cuda":
        return f"maps on {torch.device(device).type} (the kernels run on CUDA)"
    if dtype != torch.float32:
        return f"maps in {dtype} (the kernels scan in fp32; float64 calls use the torch scan)"
    if K not in (16, 32, 64, 128) or not (V % BV == 0 or V == 16):
        return f"K={K}, V={V} (the kernels take K in 16/32/64/128 and V = 16 or a multiple of {BV})"
    return ""


def forward_scan(Ms: torch.Tensor, Rs: torch.Tensor, S0) -> torch.Tensor:
    """Segment start states `[N, n_seg, H, K, V]` from the maps `Ms` `[N, n_seg, H, K, K]`,
    `Rs` `[N, n_seg, H, K, V]` and the sequences' start states `S0` `[N, H, K, V]` (None: 0)."""
    N, n_seg, H, K, V = Rs.shape
    bv = min(BV, V)
    out = torch.empty_like(Rs)
    s0 = Rs if S0 is None else S0.contiguous()  # a placeholder pointer when absent
    _forward_scan[(N * H, V // bv)](Ms.contiguous(), Rs.contiguous(), s0, out, n_seg, H, K=K, V=V, BV=bv,
                                    HAS_S0=S0 is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def backward_scan(Ms: torch.Tensor, Ds: torch.Tensor, G_end) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ends, first)`: the state gradient at each segment's end `[N, n_seg, H, K, V]` and at
    each sequence's start `[N, H, K, V]`, from `Ms`, `Ds` and the sequences' end gradients
    `G_end` `[N, H, K, V]` (None: 0)."""
    N, n_seg, H, K, V = Ds.shape
    bv = min(BV, V)
    ends = torch.empty_like(Ds)
    first = torch.empty(N, H, K, V, dtype=Ds.dtype, device=Ds.device)
    g = Ds if G_end is None else G_end.contiguous()
    _backward_scan[(N * H, V // bv)](Ms.contiguous(), Ds.contiguous(), g, ends, first, n_seg, H, K=K, V=V, BV=bv,
                                     HAS_END=G_end is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return ends, first
