"""Pass 2 of the exact split (backends/split/passes.py) as Triton kernels: the two scans over each
sequence's segments (one kernel, forward, and in reverse with the maps transposed), one program
per (sequence, head, block of value columns), the state in fp32 registers, one K x K product
per segment.

Why kernels: the torch version (log-depth prefixes of batched products) issues ~150 small ops
per call; on the H200 the split's timings at B1 T32768 H4 spread by up to 50 % between rounds
and sat ~3 ms above their kernels (bench/results/nvidia-h200-sm90-starved.md), the mark of a
host-bound call. Here each scan is one launch. Products are 3xTF32 (`tf32x3`: tensor cores,
fp32-level error; plain TF32's 10-bit mantissa would reach every gradient of the segments after
it). Resources for sm_90a (Triton 3.9 AOT, K = V = 128): `ieee` products lowered to FMA loops
spilled 8-12 KB of stack per thread. Launch options measured on the H200 (backward scan, B1
T32768 H4, 32 segments; tools/profile_split.py --scan-configs): 16 value columns, 8 warps, 2
stages 0.116 ms; 16/8/1 0.133; 32/8/1 0.147; 32/8/2 0.146; 32/4/2 0.251; 64/8/2 0.218. The carried state needs the last step but the maps' loads do not, so the
second stage overlaps them once the state block is small. With `h=None` the split needs both
scans; `both_scans` runs them as one launch (0.089 ms at B1 T32768 H4 in 32 segments, as much
as each scan alone).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: value columns per program (the state block is K x BV fp32 in registers)
BV = 16
#: launch options, see the module docstring
NUM_WARPS, NUM_STAGES = 8, 2
#: Whether the kernels' GPU tests (tests/test_gpu.py: the scans against float64, the split
#: oracle tests) have passed; while False, the split runs them only with
#: GDR_ALLOW_UNVERIFIED=1.
GPU_VERIFIED = True


@triton.jit
def _scan_body(M, X, START, EACH, LAST, n_seg, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
               HAS_START: tl.constexpr, REVERSE: tl.constexpr):
    """Through the segments of sequence n in order (last to first with REVERSE): EACH[n, j] = the
    carried state before segment j, then state = M_j state + X_j (M_j^T with REVERSE); LAST[n] =
    the state after the last. The state starts at START[n] (0 without HAS_START)."""
    nh = tl.program_id(0)
    n = nh // H
    h = nh % H
    rk = tl.arange(0, K)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    if HAS_START:
        S = tl.load(START + ((n * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :])
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for i in range(n_seg):
        if REVERSE:
            j = n_seg - 1 - i
        else:
            j = i
        base = ((n * n_seg + j) * H + h).to(tl.int64)
        tl.store(EACH + (base * K + rk[:, None]) * V + rv[None, :], S)
        if REVERSE:
            m = tl.load(M + (base * K + rk[None, :]) * K + rk[:, None])  # m[a, b] = M[b, a]
        else:
            m = tl.load(M + (base * K + rk[:, None]) * K + rk[None, :])
        x = tl.load(X + (base * K + rk[:, None]) * V + rv[None, :])
        S = tl.dot(m, S, input_precision="tf32x3") + x
    tl.store(LAST + ((n * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :], S)


@triton.jit
def _scan(M, X, START, EACH, LAST, n_seg, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
          HAS_START: tl.constexpr, REVERSE: tl.constexpr):
    """One scan (`_scan_body`): the backward one, where `h` is given."""
    _scan_body(M, X, START, EACH, LAST, n_seg, H, K, V, BV, HAS_START, REVERSE)


@triton.jit
def _scans(M, R, S0, STARTS, S_LAST, D, G_END, ENDS, FIRST, n_seg, H, K: tl.constexpr, V: tl.constexpr,
           BV: tl.constexpr, HAS_S0: tl.constexpr, HAS_G_END: tl.constexpr):
    """Both scans in one launch: grid axis 2 picks the direction (they share only the maps; each
    alone fills 32 programs at B1 H4, so one after the other they took twice one's time)."""
    if tl.program_id(2) == 0:
        _scan_body(M, R, S0, STARTS, S_LAST, n_seg, H, K, V, BV, HAS_S0, False)
    else:
        _scan_body(M, D, G_END, ENDS, FIRST, n_seg, H, K, V, BV, HAS_G_END, True)


def not_supported_reason(K: int, V: int, dtype: torch.dtype, device: torch.device) -> str:
    """"" when the kernels take a split's maps, else why not (the torch scan runs then)."""
    if torch.device(device).type != "cuda":
        return f"maps on {torch.device(device).type} (the kernels run on CUDA)"
    if dtype != torch.float32:
        return f"maps in {dtype} (the kernels scan in fp32; float64 calls use the torch scan)"
    if K not in (16, 32, 64, 128) or V % BV:
        return f"K={K}, V={V} (the kernels take K in 16/32/64/128 and V a multiple of {BV})"
    return ""


def both_scans(Ms: torch.Tensor, Rs: torch.Tensor, S0, Ds: torch.Tensor, G_end):
    """The forward scan and `backward_scan` in one launch (the split with `h=None` needs both):
    `(starts, ends, first)`. `starts` `[N, n_seg, H, K, V]`: each segment's start state from the
    maps `Ms` `[N, n_seg, H, K, K]`, `Rs` `[N, n_seg, H, K, V]` and the sequences' start states
    `S0` `[N, H, K, V]` (None: 0), S_0 = S0, S_{j+1} = M_j S_j + R_j; `ends` and `first` as
    `backward_scan`'s."""
    N, n_seg, H, K, V = Rs.shape
    bv = min(BV, V)
    r, d = Rs.contiguous(), Ds.contiguous()
    starts, ends = torch.empty_like(r), torch.empty_like(d)
    last, first = (torch.empty(N, H, K, V, dtype=r.dtype, device=r.device) for _ in range(2))
    # r and d: placeholder pointers where a start is absent (never read then)
    _scans[(N * H, V // bv, 2)](Ms.contiguous(), r, r if S0 is None else S0.contiguous(), starts, last,
                                d, d if G_end is None else G_end.contiguous(), ends, first, n_seg, H,
                                K=K, V=V, BV=bv, HAS_S0=S0 is not None, HAS_G_END=G_end is not None,
                                num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return starts, ends, first


def backward_scan(Ms: torch.Tensor, Ds: torch.Tensor, G_end) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ends, first)`: the state gradient at each segment's end `[N, n_seg, H, K, V]` and at
    each sequence's start `[N, H, K, V]` (its dh0), from `Ms`, `Ds` and the sequences' end
    gradients `G_end` `[N, H, K, V]` (None: 0): dS_{n_seg} = G_end, dS_j = M_j^T dS_{j+1} + D_j."""
    N, n_seg, H, K, V = Ds.shape
    bv = min(BV, V)
    d = Ds.contiguous()
    ends = torch.empty_like(d)
    first = torch.empty(N, H, K, V, dtype=d.dtype, device=d.device)
    _scan[(N * H, V // bv)](Ms.contiguous(), d, d if G_end is None else G_end.contiguous(), ends, first, n_seg, H,
                            K=K, V=V, BV=bv, HAS_START=G_end is not None, REVERSE=True,
                            num_warps=NUM_WARPS, num_stages=NUM_STAGES)  # d: a placeholder pointer without G_end
    return ends, first
