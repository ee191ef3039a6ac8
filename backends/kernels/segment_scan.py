"""Pass 2 of the exact split (backends/split/passes.py) as one Triton kernel: the chains that join
each sequence's segments (forwards for their start states, backwards with the maps transposed
for their end gradients), one program per (sequence, head, block of value columns, direction),
the carried state in fp32 registers.

Pass 1 (segment_maps.segment_pieces) leaves in `starts[n]` segment n - 1's end state from a zero
start over its warm-up window, and in `ends[n]` segment n + 1's start gradient from a zero end
gradient over its window. Where the plan says warm (docs/kernels.md, "The split") that is the
answer already and the chain only moves on; where it says exact the chain applies the map:
`starts[n] = M[n-1] starts[n-1] + starts[n]`, `ends[n] = M[n+1]^T ends[n+1] + ends[n]`. A head whose
segments all warm up costs a pass over a few flags; one that is exact throughout costs one K x K
product per segment. Products are 3xTF32 (`tf32x3`: tensor cores, fp32-level error; plain TF32's
10-bit mantissa would reach every gradient of the segments after it). Launch options measured on
the H200 for the exact chain (B1 T32768 H4, 32 segments): 16 value columns, 8 warps, 2 stages
0.116 ms for one direction; 16/8/1 0.133; 32/8/1 0.147; 32/8/2 0.146; 32/4/2 0.251; 64/8/2 0.218.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: value columns per program (the state block is K x BV fp32 in registers)
BV = 16
#: launch options, see the module docstring
NUM_WARPS, NUM_STAGES = 8, 2
#: Load the next exact link's map while the current one's product runs (a chain step waits on
#: its 64 KB map load, then on the product: ~3.4 us a step at B1 T32768 H4 /32). Off: on the H200
#: pass 2 at the mixed gate went 0.118 -> 0.144 ms with it at B1 T32768 H4 /32 (slower at every
#: shape measured; docs/kernels.md, the starved levers; `tools/profile_split.py --parts --chain-prefetch`).
PREFETCH = False
#: Whether the kernel's GPU tests (tests/test_gpu.py: the chain against float64, the split
#: oracle tests) have passed; while False, the split runs it only with GDR_ALLOW_UNVERIFIED=1.
GPU_VERIFIED = True


@triton.jit
def _chain(M, STARTS, ENDS, PLAN, SEG_OFF, S0, G_END, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
           NSEG: tl.constexpr, HAS_S0: tl.constexpr, HAS_G_END: tl.constexpr, FIRST_DIRECTION: tl.constexpr,
           PREFETCH: tl.constexpr = 0):
    """Sequence n's segments [SEG_OFF[n], SEG_OFF[n + 1]) (module docstring); grid axis 2 picks the
    direction (0: the start states, from S0[n] or 0; 1: the end gradients, from G_END[n] or 0),
    offset by FIRST_DIRECTION (1: the end gradients alone, where `h` is given)."""
    nh = tl.program_id(0)
    n = nh // H
    h = nh % H
    rk = tl.arange(0, K)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    first = tl.load(SEG_OFF + n)
    count = tl.load(SEG_OFF + n + 1) - first
    ri = tl.arange(0, NSEG)
    # 1 where a segment is joined exactly (the plan's window 0), read once for the whole chain
    exact = (tl.load(PLAN + ((first + ri) * H + h).to(tl.int64) * 2, mask=ri < count, other=1) == 0).to(tl.int32)
    some = rk[:, None] < tl.minimum(count, 1) * K  # a vector mask: the interpreter takes no scalar bools
    if tl.program_id(2) + FIRST_DIRECTION == 0:
        if HAS_S0:
            S = tl.load(S0 + ((n * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :])
        else:
            S = tl.zeros([K, BV], dtype=tl.float32)
        tl.store(STARTS + ((first * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :], S, mask=some)
        held = 1  # S holds segment i's start
        # with PREFETCH, `m` holds link i's map, loaded a step ahead (zeros where not exact: no traffic)
        if PREFETCH:
            ex0 = tl.sum(tl.where(ri == 0, exact, 0), axis=0)
            m = tl.load(M + ((first * H + h).to(tl.int64) * K + rk[:, None]) * K + rk[None, :],
                        mask=rk[:, None] < ex0 * K, other=0.0)
        for i in range(0, count - 1):
            if PREFETCH:
                ex1 = tl.sum(tl.where(ri == i + 1, exact, 0), axis=0) * (i + 1 < count - 1).to(tl.int32)
                m_next = tl.load(M + (((first + i + 1) * H + h).to(tl.int64) * K + rk[:, None]) * K + rk[None, :],
                                 mask=rk[:, None] < ex1 * K, other=0.0)
            if tl.sum(tl.where(ri == i, exact, 0), axis=0) != 0:
                row = ((first + i) * H + h).to(tl.int64)
                if held == 0:
                    S = tl.load(STARTS + (row * K + rk[:, None]) * V + rv[None, :])
                if not PREFETCH:
                    m = tl.load(M + (row * K + rk[:, None]) * K + rk[None, :])
                nxt = STARTS + ((row + H) * K + rk[:, None]) * V + rv[None, :]
                S = tl.dot(m, S, input_precision="tf32x3") + tl.load(nxt)
                tl.store(nxt, S)
                held = 1
            else:
                held = 0
            if PREFETCH:
                m = m_next
    else:
        if HAS_G_END:
            S = tl.load(G_END + ((n * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :])
        else:
            S = tl.zeros([K, BV], dtype=tl.float32)
        tl.store(ENDS + (((first + count - 1) * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :], S,
                 mask=some)
        held = 1  # S holds segment i's end gradient
        if PREFETCH:
            last = count - 1
            ex0 = tl.sum(tl.where(ri == last, exact, 0), axis=0) * (last > 0).to(tl.int32)
            mt = tl.load(M + (((first + last) * H + h).to(tl.int64) * K + rk[None, :]) * K + rk[:, None],
                         mask=rk[:, None] < ex0 * K, other=0.0)  # mt[a, b] = M[b, a]
        for step in range(0, count - 1):
            i = count - 1 - step
            if PREFETCH:
                ex1 = tl.sum(tl.where(ri == i - 1, exact, 0), axis=0) * (i - 1 > 0).to(tl.int32)
                mt_next = tl.load(M + (((first + i - 1) * H + h).to(tl.int64) * K + rk[None, :]) * K + rk[:, None],
                                  mask=rk[:, None] < ex1 * K, other=0.0)
            if tl.sum(tl.where(ri == i, exact, 0), axis=0) != 0:
                row = ((first + i) * H + h).to(tl.int64)
                if held == 0:
                    S = tl.load(ENDS + (row * K + rk[:, None]) * V + rv[None, :])
                if not PREFETCH:
                    mt = tl.load(M + (row * K + rk[None, :]) * K + rk[:, None])  # mt[a, b] = M[b, a]
                prv = ENDS + ((row - H) * K + rk[:, None]) * V + rv[None, :]
                S = tl.dot(mt, S, input_precision="tf32x3") + tl.load(prv)
                tl.store(prv, S)
                held = 1
            else:
                held = 0
            if PREFETCH:
                mt = mt_next


def not_supported_reason(K: int, V: int, dtype: torch.dtype, device: torch.device) -> str:
    """"" when the kernel takes a split's pieces, else why not (the torch chain runs then)."""
    if torch.device(device).type != "cuda":
        return f"maps on {torch.device(device).type} (the kernels run on CUDA)"
    if dtype != torch.float32:
        return f"maps in {dtype} (the kernels chain in fp32; float64 calls use the torch chain)"
    if K not in (16, 32, 64, 128) or V % BV:
        return f"K={K}, V={V} (the kernels take K in 16/32/64/128 and V a multiple of {BV})"
    return ""


def chain(M: torch.Tensor, starts, ends, plan: torch.Tensor, seg_offsets: torch.Tensor,
          max_segments: int, S0=None, G_end=None) -> None:
    """Completes pass 1's `starts` and `ends` (`[S, H, K, V]` fp32, module docstring) in place:
    every segment's exact start state (None: not wanted, `h` is given) and end-state gradient
    (None: not wanted, the op's forward; not both None).
    `M` `[S, H, K, K]` (read where `plan` `[S, H, 2]` says exact), `seg_offsets` int32 `[N + 1]`
    (sequence n's segments), `max_segments` the most any sequence has, `S0` / `G_end` `[N, H,
    K, V]` fp32 the sequences' initial states and final-state gradients (None: 0)."""
    for name, x in (("starts", starts), ("ends", ends)):
        if x is not None and not x.is_contiguous():
            raise ValueError(f"chain: {name} must be contiguous (it is completed in place)")
    if starts is None and ends is None:
        raise ValueError("chain: nothing to complete (starts and ends both None)")
    M, plan = M.contiguous(), plan.contiguous()  # a provider's M may be a slice of its [M | R]
    N = seg_offsets.shape[0] - 1
    some = ends if ends is not None else starts
    H, K, V = some.shape[1], some.shape[2], some.shape[3]
    bv = min(BV, V)
    directions = (starts is not None) + (ends is not None)
    # absent tensors: `some` stands in as a pointer never read
    _chain[(N * H, V // bv, directions)](
        M, some if starts is None else starts, some if ends is None else ends, plan, seg_offsets,
        some if S0 is None else S0.contiguous(), some if G_end is None else G_end.contiguous(), H, K=K, V=V, BV=bv,
        NSEG=triton.next_power_of_2(max(1, max_segments)), HAS_S0=S0 is not None, HAS_G_END=G_end is not None,
        FIRST_DIRECTION=1 if starts is None else 0, PREFETCH=int(PREFETCH), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
