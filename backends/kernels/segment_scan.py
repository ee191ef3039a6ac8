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
#: Pass 2 as a parallel prefix where sequences have PREFIX_MIN_SEGMENTS segments or more: each
#: chain `x_q = A_q x_{q-1} + c_q` (A_q the link's map, or 0 where the plan says warm; c_q pass 1's
#: slot, c_0 the sequence's state) composed in ceil(log2(segments)) launches of independent
#: products (`(A_q, c_q) <- (A_q A_{q-d}, A_q c_{q-d} + c_q)`, d = 1, 2, 4, ..), instead of one
#: serial walk of ~3.4 us a step (0.1 ms at 32 segments where a head's links are exact: the mixed
#: gate's weak heads). Zero maps (warm links) are flags, never loaded or multiplied. PREFIX_BC
#: columns of `[A | c]` per program. Its GPU test passes (`PREFIX_GPU_VERIFIED`), but it is off:
#: every level composes all positions' maps (K + V columns, ~10x the serial chain's products), and
#: on the H200 pass 2 went 0.111 -> 0.170 ms at B1 T32768 H4 /32, mixed gate (docs/kernels.md).
PREFIX = False
PREFIX_MIN_SEGMENTS = 16
PREFIX_BC = 32
PREFIX_WARPS, PREFIX_STAGES = 8, 1
PREFIX_GPU_VERIFIED = True
#: Pass 2 blocked where sequences have BLOCKED_MIN_SEGMENTS segments or more: the c - 1 serial
#: links cut into groups of s (group_size): each group's links composed in parallel (`x_E' = Q x_E + d`,
#: K + V columns), one serial walk over the groups' ends, then each group's inner positions in
#: parallel: ~2s + c/s steps (15 at 32 segments) instead of c - 1 (31). Its GPU tests pass
#: (`BLOCKED_GPU_VERIFIED`), but it is off: on the H200 at B1 T32768 H4 /32, mixed gate, pass 2 went
#: 0.110 -> 0.100 ms (the whole split 0.524 -> 0.518), and at an all-warm plan (B1 T65536 H4 /32)
#: 0.020 -> 0.023 (three launches for one); with each group composed from its first link: 0.114 ->
#: 0.095 ms (whole 0.485 -> 0.466) and 0.018 -> 0.023 (whole 0.652 -> 0.665); docs/kernels.md.
BLOCKED = False
BLOCKED_MIN_SEGMENTS = 16
BLOCKED_GPU_VERIFIED = True
#: The serial chain on TMA for calls whose inputs are 16-bit (`_tma_chain`, sm_90 on): the loop runs
#: over the exact links only (warm links need nothing), each link's map loaded by TMA TMA_STAGES
#: links ahead into shared memory, the carried block transposed (`[BV, K]`, the product's left
#: operand) and the product plain TF32 (a 10-bit mantissa: ~5e-4 relative per link, which the
#: contracting maps do not accumulate). The backward direction reads the maps transposed (TF32
#: products take both operands K-major), one copy of M per call. Off: slower than the 3xTF32 chain
#: (H200, B1 H4 /32 mixed, pass 2 replayed: T32768 0.19 vs 0.11 ms, T65536 0.029 vs 0.011;
#: B1 T8192 H16 /8 0.065 vs 0.033; docs/kernels.md). Its GPU tests pass.
TMA_CHAIN = False
TMA_CHAIN_BV = 64
TMA_CHAIN_WARPS, TMA_CHAIN_STAGES = 8, 2
TMA_CHAIN_GPU_VERIFIED = True


@triton.jit
def _chain_program(PLAN, SEG_OFF, H, K: tl.constexpr, BV: tl.constexpr, NSEG: tl.constexpr):
    """A chain program's sequence n and head h (grid axis 0), its state rows `rk` and value columns
    `rv` (grid axis 1), the sequence's first segment and segment count, and `exact` `[NSEG]`: 1
    where a segment is joined exactly (the plan's window 0), read once for the whole chain."""
    nh = tl.program_id(0)
    n = nh // H
    h = nh % H
    rk = tl.arange(0, K)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    first = tl.load(SEG_OFF + n)
    count = tl.load(SEG_OFF + n + 1) - first
    ri = tl.arange(0, NSEG)
    exact = (tl.load(PLAN + ((first + ri) * H + h).to(tl.int64) * 2, mask=ri < count, other=1) == 0).to(tl.int32)
    return n, h, rk, rv, first, count, ri, exact


@triton.jit
def _chain(M, STARTS, ENDS, PLAN, SEG_OFF, S0, G_END, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
           NSEG: tl.constexpr, HAS_S0: tl.constexpr, HAS_G_END: tl.constexpr, FIRST_DIRECTION: tl.constexpr,
           PREFETCH: tl.constexpr = 0):
    """Sequence n's segments [SEG_OFF[n], SEG_OFF[n + 1]) (module docstring); grid axis 2 picks the
    direction (0: the start states, from S0[n] or 0; 1: the end gradients, from G_END[n] or 0),
    offset by FIRST_DIRECTION (1: the end gradients alone, where `h` is given)."""
    n, h, rk, rv, first, count, ri, exact = _chain_program(PLAN, SEG_OFF, H, K, BV, NSEG)
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


@triton.jit
def _tma_chain(m_desc, STARTS, ENDS, PLAN, SEG_OFF, S0, G_END, S, H, K: tl.constexpr, V: tl.constexpr,
               BV: tl.constexpr, NSEG: tl.constexpr, HAS_S0: tl.constexpr, HAS_G_END: tl.constexpr,
               FIRST_DIRECTION: tl.constexpr, STAGES: tl.constexpr):
    """`_chain` over the exact links only, carried transposed: `X^T <- X^T B + slot^T` with B = M^T
    forwards and M backwards, read as the rows of M (`m_desc` rows [0, S H K)) and of M^T (rows
    from S H K on), so B is K-major; TF32; each link's map loaded by TMA STAGES links ahead. A
    link whose previous one was warm starts from pass 1's slot, one whose previous one was exact
    from the carried block (never re-read from memory this program wrote). One loop for both
    directions (separate ones would each hold their maps' buffers in shared memory)."""
    n, h, rk, rv, first, count, ri, exact = _chain_program(PLAN, SEG_OFF, H, K, BV, NSEG)
    back = tl.program_id(2) + FIRST_DIRECTION  # 0: start states, forwards; 1: end gradients, backwards
    at = rk[None, :] * V + rv[:, None]  # a `[BV, K]` block of a `[K, V]` state, transposed
    X = STARTS
    given = S0
    if back == 1:
        X = ENDS
        given = G_END
    has = tl.where(back == 1, HAS_G_END, HAS_S0)
    start = first + back * (count - 1)  # the sequence's first start or last end
    Xt = tl.load(given + (n * H + h).to(tl.int64) * K * V + at, mask=(rk[None, :] < has * K), other=0.0)
    tl.store(X + (start * H + h).to(tl.int64) * K * V + at, Xt, mask=rk[None, :] < tl.minimum(count, 1) * K)
    # the links, each segment whose map joins it to the next (forwards) or the previous (backwards)
    links = exact * tl.where(back == 1, (ri >= 1) & (ri < count), ri < count - 1).to(tl.int32)
    total = tl.sum(links, 0)
    upto = tl.cumsum(links, 0)
    order = tl.where(back == 1, total - upto + links, upto)  # 1 for the first link walked, ..
    step = 1 - 2 * back
    prev = start - first - step  # the carried block is segment prev + step's
    for j in tl.range(0, total, num_stages=STAGES):
        i = tl.sum(tl.where((order == j + 1) & (links != 0), ri, 0), 0)
        m = m_desc.load([((back * S + first + i) * H + h).to(tl.int32) * K, 0])
        mine = X + ((first + i) * H + h).to(tl.int64) * K * V + at
        Xt = tl.where(prev == i - step, Xt, tl.load(mine))
        out = mine + step * H * K * V
        Xt = tl.dot(Xt, tl.trans(m), input_precision="tf32") + tl.load(out)
        tl.store(out, Xt)
        prev = i


@triton.jit
def _slot_row(first, count, q, BACKWARD: tl.constexpr):
    """The segment row chain position q stands for: starts[first + q], or ends[first + count - 1 - q]."""
    if BACKWARD:
        seg = first + count - 1 - q
    else:
        seg = first + q
    return seg


@triton.jit
def _prefix_a(M, A_IN, first, count, q, h, H, rk, cols, K: tl.constexpr, FIRST: tl.constexpr,
              BACKWARD: tl.constexpr):
    """Columns `cols` of position q's map `A_q` (K x K; `cols = rk` for all of it): at the first
    level the link's M (transposed for the end gradients), later the composed one of the level
    before."""
    if FIRST:
        if BACKWARD:  # ends[p] = M[p + 1]^T ends[p + 1] + ends[p], p = count - 1 - q
            row = ((first + count - q) * H + h).to(tl.int64)
            a = tl.load(M + (row * K + cols[None, :]) * K + rk[:, None])
        else:  # starts[p] = M[p - 1] starts[p - 1] + starts[p], p = q
            row = ((first + q - 1) * H + h).to(tl.int64)
            a = tl.load(M + (row * K + rk[:, None]) * K + cols[None, :])
    else:
        a = tl.load(A_IN + (((first + q) * H + h).to(tl.int64) * K + rk[:, None]) * K + cols[None, :])
    return a


@triton.jit
def _prefix_nz(PLAN, NZ_IN, first, count, q, h, H, FIRST: tl.constexpr, BACKWARD: tl.constexpr):
    """Whether position q's map is not zero: at the first level q >= 1 and its link exact."""
    if FIRST:
        if BACKWARD:
            link = first + count - q
        else:
            link = first + q - 1
        ok = q >= 1
        w = tl.load(PLAN + (tl.where(ok, link, first) * H + h).to(tl.int64) * 2)
        nz = (ok & (w == 0)).to(tl.int32)
    else:
        nz = tl.load(NZ_IN + ((first + q) * H + h).to(tl.int64))
    return nz


@triton.jit
def _prefix_c(SLOTS, STATE0, C_IN, n, first, count, q, h, H, rk, cols, K: tl.constexpr, V: tl.constexpr,
              FIRST: tl.constexpr, BACKWARD: tl.constexpr, HAS_STATE0: tl.constexpr):
    """Columns `cols` of position q's offset `c_q` (K x BC): at the first level the sequence's
    state (q = 0) or pass 1's slot, later the level before's."""
    if FIRST:
        seg = _slot_row(first, count, q, BACKWARD)
        slot = tl.load(SLOTS + ((seg * H + h).to(tl.int64) * K + rk[:, None]) * V + cols[None, :])
        if HAS_STATE0:
            s0 = tl.load(STATE0 + ((n * H + h).to(tl.int64) * K + rk[:, None]) * V + cols[None, :])
        else:
            s0 = tl.zeros_like(slot)
        c = tl.where((rk[:, None] * 0 + q) == 0, s0, slot)
    else:
        c = tl.load(C_IN + (((first + q) * H + h).to(tl.int64) * K + rk[:, None]) * V + cols[None, :])
    return c


@triton.jit
def _prefix_level(M, SLOTS, STATE0, PLAN, SEG_OFF, A_IN, C_IN, NZ_IN, A_OUT, C_OUT, NZ_OUT, d, H,
                  K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                  BACKWARD: tl.constexpr, HAS_STATE0: tl.constexpr):
    """One level of pass 2's prefix (PREFIX) for one direction: program (sequence x head, position
    q, column block of `[A | c]`) forms `(A_q A_{q-d}, A_q c_{q-d} + c_q)` (q >= d; else keeps
    c_q, A_q being zero there) into the OUT buffers, indexed first + q; the last level forms only c and writes
    it into SLOTS at the segment position q stands for (starts[first + q], or ends[first + count -
    1 - q] for the end gradients)."""
    nh = tl.program_id(0)
    n = nh // H
    h = nh % H
    q = tl.program_id(1)
    cb = tl.program_id(2) + LAST * (K // BC)  # the last level forms c only
    first = tl.load(SEG_OFF + n)
    count = tl.load(SEG_OFF + n + 1) - first
    rk = tl.arange(0, K)
    rc = tl.arange(0, BC)
    if q < count:
        nz = _prefix_nz(PLAN, NZ_IN, first, count, q, h, H, FIRST, BACKWARD)
        r = tl.maximum(q - d, 0)  # the partner (read only where q >= d)
        pair = (q >= d).to(tl.int32)
        nz_r = _prefix_nz(PLAN, NZ_IN, first, count, r, h, H, FIRST, BACKWARD) * pair
        if cb < K // BC:  # a block of A's columns: A_q A_r where both are not zero
            # (where q < d, A_q is zero: its window reaches position 0, whose map is zero)
            if (nz * nz_r) != 0:
                cols = cb * BC + rc
                a = _prefix_a(M, A_IN, first, count, q, h, H, rk, rk, K, FIRST, BACKWARD)
                x = _prefix_a(M, A_IN, first, count, r, h, H, rk, cols, K, FIRST, BACKWARD)
                tl.store(A_OUT + (((first + q) * H + h).to(tl.int64) * K + rk[:, None]) * K + cols[None, :],
                         tl.dot(a, x, input_precision="tf32x3"))
            if cb == 0:
                tl.store(NZ_OUT + ((first + q) * H + h).to(tl.int64), tl.where(pair != 0, nz * nz_r, nz))
        else:  # a block of c's columns: A_q c_r + c_q, or c_q where q < d or A_q is zero
            cols = (cb - K // BC) * BC + rc
            c = _prefix_c(SLOTS, STATE0, C_IN, n, first, count, q, h, H, rk, cols, K, V, FIRST, BACKWARD,
                          HAS_STATE0)
            if (nz * pair) != 0:
                a = _prefix_a(M, A_IN, first, count, q, h, H, rk, rk, K, FIRST, BACKWARD)
                cr = _prefix_c(SLOTS, STATE0, C_IN, n, first, count, r, h, H, rk, cols, K, V, FIRST, BACKWARD,
                               HAS_STATE0)
                c = tl.dot(a, cr, input_precision="tf32x3") + c
            if LAST:
                seg = _slot_row(first, count, q, BACKWARD)
                tl.store(SLOTS + ((seg * H + h).to(tl.int64) * K + rk[:, None]) * V + cols[None, :], c)
            else:
                tl.store(C_OUT + (((first + q) * H + h).to(tl.int64) * K + rk[:, None]) * V + cols[None, :], c)


@triton.jit
def _compose_body(M, SLOTS, PLAN, Q, D, NZ, first, count, lo, hi, h, H, row, cb, K: tl.constexpr,
                  V: tl.constexpr, BC: tl.constexpr, BACKWARD: tl.constexpr):
    """`_blocked_compose` for one direction: column block cb of `[Q | d]` of the links (lo, hi]."""
    rk = tl.arange(0, K)
    if cb < K // BC:  # Q's columns: the first link's map (no product by the identity), then each
        # link's product; zero from a warm link on (a flag, no products)
        cols = cb * BC + tl.arange(0, BC)
        x = tl.zeros([K, BC], dtype=tl.float32)
        nzq = _prefix_nz(PLAN, PLAN, first, count, lo + 1, h, H, True, BACKWARD)
        if nzq != 0:
            x = _prefix_a(M, M, first, count, lo + 1, h, H, rk, cols, K, True, BACKWARD)
        for q in range(lo + 2, hi + 1):
            if _prefix_nz(PLAN, PLAN, first, count, q, h, H, True, BACKWARD) * nzq != 0:
                a = _prefix_a(M, M, first, count, q, h, H, rk, rk, K, True, BACKWARD)
                x = tl.dot(a, x, input_precision="tf32x3")
            else:
                nzq = 0
        tl.store(Q + (row * K + rk[:, None]) * K + cols[None, :], x)
        if cb == 0:
            tl.store(NZ + row, nzq)
    else:  # d's columns: from zero at lo, so the first link's slot as it stands (no product by zero)
        cols = (cb - K // BC) * BC + tl.arange(0, BC)
        seg = _slot_row(first, count, lo + 1, BACKWARD)
        x = tl.load(SLOTS + ((seg * H + h).to(tl.int64) * K + rk[:, None]) * V + cols[None, :])
        for q in range(lo + 2, hi + 1):
            seg = _slot_row(first, count, q, BACKWARD)
            c = tl.load(SLOTS + ((seg * H + h).to(tl.int64) * K + rk[:, None]) * V + cols[None, :])
            if _prefix_nz(PLAN, PLAN, first, count, q, h, H, True, BACKWARD) != 0:
                a = _prefix_a(M, M, first, count, q, h, H, rk, rk, K, True, BACKWARD)
                x = tl.dot(a, x, input_precision="tf32x3") + c
            else:
                x = c
        tl.store(D + (row * K + rk[:, None]) * V + cols[None, :], x)


@triton.jit
def _blocked_compose(M, STARTS, ENDS, PLAN, SEG_OFF, Q, D, NZ, s, S, NH, H, K: tl.constexpr, V: tl.constexpr,
                     BC: tl.constexpr, FIRST_DIRECTION: tl.constexpr):
    """Pass 2 blocked (BLOCKED), step 1 of 3: program (direction x sequence x head, group j, column
    block of `[Q | d]`) composes group j's links, the chain positions (E_j, E_j+1] with E_j = j s:
    `x_E_j+1 = Q_j x_E_j + d_j`, Q_j the product of the links' maps (NZ: whether it is not zero),
    d_j the chain from zero at E_j, at row first + j of the direction's buffers. A group whose last
    link is warm is skipped: its end is pass 1's slot as it stands."""
    direction = tl.program_id(0) // NH + FIRST_DIRECTION
    nh = tl.program_id(0) % NH
    n = nh // H
    h = nh % H
    j = tl.program_id(1)
    first = tl.load(SEG_OFF + n)
    count = tl.load(SEG_OFF + n + 1) - first
    lo = j * s
    hi = tl.minimum(lo + s, count - 1)
    if lo < hi:
        row = ((first + j) * H + h).to(tl.int64)
        at = direction.to(tl.int64) * S * H  # the direction's half of the buffers
        if direction == 0:
            if _prefix_nz(PLAN, PLAN, first, count, hi, h, H, True, False) != 0:
                _compose_body(M, STARTS, PLAN, Q + at * K * K, D + at * K * V, NZ + at, first, count, lo, hi, h, H,
                              row, tl.program_id(2), K, V, BC, False)
        else:
            if _prefix_nz(PLAN, PLAN, first, count, hi, h, H, True, True) != 0:
                _compose_body(M, ENDS, PLAN, Q + at * K * K, D + at * K * V, NZ + at, first, count, lo, hi, h, H,
                              row, tl.program_id(2), K, V, BC, True)


@triton.jit
def _groups_body(PLAN, SLOTS, STATE0, Q, D, NZ, n, first, count, s, h, H, rv, K: tl.constexpr, V: tl.constexpr,
                 HAS_STATE0: tl.constexpr, BACKWARD: tl.constexpr):
    """`_blocked_groups` for one direction: position 0 from the sequence's state, then every group's end."""
    rk = tl.arange(0, K)
    if HAS_STATE0:
        x = tl.load(STATE0 + ((n * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :])
    else:
        x = tl.zeros([K, rv.shape[0]], dtype=tl.float32)
    some = rk[:, None] < tl.minimum(count, 1) * K  # a vector mask: the interpreter takes no scalar bools
    seg0 = _slot_row(first, count, 0, BACKWARD)
    tl.store(SLOTS + ((seg0 * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :], x, mask=some)
    held = 1  # x holds the previous group's end
    for j in range(0, tl.cdiv(tl.maximum(count - 1, 0), s)):
        hi = tl.minimum(j * s + s, count - 1)
        seg = _slot_row(first, count, hi, BACKWARD)
        out = SLOTS + ((seg * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :]
        if _prefix_nz(PLAN, PLAN, first, count, hi, h, H, True, BACKWARD) != 0:  # else: the slot stands
            row = ((first + j) * H + h).to(tl.int64)
            dj = tl.load(D + (row * K + rk[:, None]) * V + rv[None, :])
            if tl.load(NZ + row) != 0:
                if held == 0:
                    lo_seg = _slot_row(first, count, j * s, BACKWARD)
                    x = tl.load(SLOTS + ((lo_seg * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :])
                qj = tl.load(Q + (row * K + rk[:, None]) * K + rk[None, :])
                x = tl.dot(qj, x, input_precision="tf32x3") + dj
            else:
                x = dj
            tl.store(out, x)
            held = 1
        else:
            held = 0


@triton.jit
def _blocked_groups(STARTS, ENDS, PLAN, SEG_OFF, S0, G_END, Q, D, NZ, s, S, NH, H, K: tl.constexpr,
                    V: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr, HAS_G_END: tl.constexpr,
                    FIRST_DIRECTION: tl.constexpr):
    """Pass 2 blocked, step 2 of 3: program (direction x sequence x head, block of value columns)
    walks the groups serially, `x_E_j+1 = Q_j x_E_j + d_j`, writing each sequence's first start
    (last end) and every group's end into the slots."""
    direction = tl.program_id(0) // NH + FIRST_DIRECTION
    nh = tl.program_id(0) % NH
    n = nh // H
    h = nh % H
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    first = tl.load(SEG_OFF + n)
    count = tl.load(SEG_OFF + n + 1) - first
    at = direction.to(tl.int64) * S * H
    if direction == 0:
        _groups_body(PLAN, STARTS, S0, Q + at * K * K, D + at * K * V, NZ + at, n, first, count, s, h, H, rv, K, V,
                     HAS_S0, False)
    else:
        _groups_body(PLAN, ENDS, G_END, Q + at * K * K, D + at * K * V, NZ + at, n, first, count, s, h, H, rv, K, V,
                     HAS_G_END, True)


@triton.jit
def _fill_body(M, PLAN, SLOTS, first, count, lo, hi, h, H, rv, K: tl.constexpr, V: tl.constexpr,
               BACKWARD: tl.constexpr):
    """`_blocked_fill` for one direction: the positions (lo, hi) from the true x at lo."""
    rk = tl.arange(0, K)
    x = tl.zeros([K, rv.shape[0]], dtype=tl.float32)
    held = 0  # x holds the position before q (loaded when a link needs it)
    for q in range(lo + 1, hi):
        if _prefix_nz(PLAN, PLAN, first, count, q, h, H, True, BACKWARD) != 0:
            if held == 0:
                prev = _slot_row(first, count, q - 1, BACKWARD)
                x = tl.load(SLOTS + ((prev * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :])
            seg = _slot_row(first, count, q, BACKWARD)
            out = SLOTS + ((seg * H + h).to(tl.int64) * K + rk[:, None]) * V + rv[None, :]
            a = _prefix_a(M, M, first, count, q, h, H, rk, rk, K, True, BACKWARD)
            x = tl.dot(a, x, input_precision="tf32x3") + tl.load(out)
            tl.store(out, x)
            held = 1
        else:
            held = 0


@triton.jit
def _blocked_fill(M, STARTS, ENDS, PLAN, SEG_OFF, s, NH, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                  FIRST_DIRECTION: tl.constexpr):
    """Pass 2 blocked, step 3 of 3: program (direction x sequence x head, group j, block of value
    columns) completes group j's inner positions (E_j, E_j+1) from its start's true value."""
    direction = tl.program_id(0) // NH + FIRST_DIRECTION
    nh = tl.program_id(0) % NH
    n = nh // H
    h = nh % H
    j = tl.program_id(1)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    first = tl.load(SEG_OFF + n)
    count = tl.load(SEG_OFF + n + 1) - first
    lo = j * s
    hi = tl.minimum(lo + s, count - 1)
    if lo + 1 < hi:
        if direction == 0:
            _fill_body(M, PLAN, STARTS, first, count, lo, hi, h, H, rv, K, V, False)
        else:
            _fill_body(M, PLAN, ENDS, first, count, lo, hi, h, H, rv, K, V, True)


def group_size(max_segments: int) -> int:
    """BLOCKED's group size s: the fewest serial steps `s + ceil((c - 1) / s) + s - 1` at c segments."""
    links = max(1, max_segments - 1)
    return min(range(1, links + 1), key=lambda g: 2 * g - 1 + -(-links // g))


def _form_on(on: bool, least: int, verified: bool, max_segments: int, device) -> bool:
    """Whether one of pass 2's other forms runs: switched `on`, at `least` segments or more, CUDA;
    while not `verified` only with GDR_ALLOW_UNVERIFIED=1."""
    from gdr_dispatch.registry import unverified_allowed

    return (on and max_segments >= least and torch.device(device).type == "cuda"
            and (verified or unverified_allowed()))


def use_blocked(max_segments: int, device) -> bool:
    """Whether pass 2 runs blocked (`BLOCKED`, at BLOCKED_MIN_SEGMENTS segments or more, CUDA;
    while BLOCKED_GPU_VERIFIED is False only with GDR_ALLOW_UNVERIFIED=1)."""
    return _form_on(BLOCKED, BLOCKED_MIN_SEGMENTS, BLOCKED_GPU_VERIFIED, max_segments, device)


def chain_blocked(M: torch.Tensor, starts, ends, plan: torch.Tensor, seg_offsets: torch.Tensor,
                  max_segments: int, S0=None, G_end=None) -> None:
    """`chain` blocked (BLOCKED), called by it after its checks: the same in-place completion in
    three launches of ~s, c / s and s serial steps (group_size) instead of one of c - 1."""
    M, plan = M.contiguous(), plan.contiguous()
    N = seg_offsets.shape[0] - 1
    some = ends if ends is not None else starts
    S, H, K, V = some.shape
    bv = min(BV, V)
    bc = bv  # dividing both K and V (not_supported_reason: K and V multiples of BV)
    s = group_size(max_segments)
    groups = -(-max(1, max_segments - 1) // s)
    directions = (starts is not None) + (ends is not None)
    first_direction = 1 if starts is None else 0
    dev = some.device
    # each direction's half: row first + j holds group j's composite (directions run side by side)
    Q = torch.empty(2, S, H, K, K, dtype=torch.float32, device=dev)
    D = torch.empty(2, S, H, K, V, dtype=torch.float32, device=dev)
    NZ = torch.empty(2, S, H, dtype=torch.int32, device=dev)
    starts_, ends_ = (some if starts is None else starts), (some if ends is None else ends)
    NH = N * H
    _blocked_compose[(directions * NH, groups, (K + V) // bc)](
        M, starts_, ends_, plan, seg_offsets, Q, D, NZ, s, S, NH, H, K=K, V=V, BC=bc,
        FIRST_DIRECTION=first_direction, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _blocked_groups[(directions * NH, V // bv)](
        starts_, ends_, plan, seg_offsets, some if S0 is None else S0.float().contiguous(),
        some if G_end is None else G_end.float().contiguous(), Q, D, NZ, s, S, NH, H, K=K, V=V, BV=bv,
        HAS_S0=S0 is not None, HAS_G_END=G_end is not None, FIRST_DIRECTION=first_direction,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if s > 1:
        _blocked_fill[(directions * NH, groups, V // bv)](
            M, starts_, ends_, plan, seg_offsets, s, NH, H, K=K, V=V, BV=bv, FIRST_DIRECTION=first_direction,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def use_prefix(max_segments: int, device) -> bool:
    """Whether pass 2 runs as the parallel prefix (`PREFIX`, at PREFIX_MIN_SEGMENTS segments or
    more, CUDA; while PREFIX_GPU_VERIFIED is False only with GDR_ALLOW_UNVERIFIED=1)."""
    return _form_on(PREFIX, PREFIX_MIN_SEGMENTS, PREFIX_GPU_VERIFIED, max_segments, device)


def chain_prefix(M: torch.Tensor, starts, ends, plan: torch.Tensor, seg_offsets: torch.Tensor,
                 max_segments: int, S0=None, G_end=None) -> None:
    """`chain` as the parallel prefix (PREFIX), called by it after its checks: the same in-place
    completion of `starts` and `ends` in ceil(log2(max_segments)) launches per direction (at least
    one: it writes each sequence's first start and last end)."""
    M, plan = M.contiguous(), plan.contiguous()
    N = seg_offsets.shape[0] - 1
    some = ends if ends is not None else starts
    S, H, K, V = some.shape
    bc = PREFIX_BC if K % PREFIX_BC == 0 and V % PREFIX_BC == 0 else BV  # dividing both (V: a multiple of BV)
    levels = max(1, (max(1, max_segments) - 1).bit_length())
    # one level (two segments at most) reads and writes the slots in one launch: its only partner is
    # position 0, the sequence's state, never read from them
    assert levels > 1 or max_segments <= 2
    dev = some.device
    # the levels between the first and the last ping-pong between two sets, shared by the directions
    # (their launches run one after the other on one stream)
    bufs = [(torch.empty(S, H, K, K, dtype=torch.float32, device=dev),
             torch.empty(S, H, K, V, dtype=torch.float32, device=dev),
             torch.empty(S, H, dtype=torch.int32, device=dev)) for _ in range(min(2, levels - 1))]
    for slots, state0, backward in ((starts, S0, False), (ends, G_end, True)):
        if slots is None:
            continue
        state0 = None if state0 is None else state0.float().contiguous()
        for level in range(levels):
            first, last = level == 0, level == levels - 1
            a_in, c_in, nz_in = bufs[(level - 1) % 2] if not first else (M, slots, plan)  # stand-ins at level 0
            a_out, c_out, nz_out = (M, slots, plan) if last else bufs[level % 2]  # stand-ins at the last
            blocks = (V if last else K + V) // bc
            _prefix_level[(N * H, max(1, max_segments), blocks)](
                M, slots, slots if state0 is None else state0, plan, seg_offsets, a_in, c_in, nz_in, a_out, c_out,
                nz_out, 1 << level, H, K=K, V=V, BC=bc, FIRST=first, LAST=last, BACKWARD=backward,
                HAS_STATE0=state0 is not None, num_warps=PREFIX_WARPS, num_stages=PREFIX_STAGES)


def not_supported_reason(K: int, V: int, dtype: torch.dtype, device: torch.device) -> str:
    """"" when the kernel takes a split's pieces, else why not (the torch chain runs then)."""
    if torch.device(device).type != "cuda":
        return f"maps on {torch.device(device).type} (the kernels run on CUDA)"
    if dtype != torch.float32:
        return f"maps in {dtype} (the kernels chain in fp32; float64 calls use the torch chain)"
    if K not in (16, 32, 64, 128) or V % BV:
        return f"K={K}, V={V} (the kernels take K in 16/32/64/128 and V a multiple of {BV})"
    return ""


def some_device(starts, ends):
    return (starts if starts is not None else ends).device


def use_tma_chain(device) -> bool:
    """Whether a 16-bit call's chain runs on `_tma_chain`: `TMA_CHAIN`, a GPU with TMA, and, until
    its GPU tests pass (`TMA_CHAIN_GPU_VERIFIED`), GDR_ALLOW_UNVERIFIED=1."""
    from gdr_dispatch.registry import unverified_allowed

    from .segment_maps import tma_capable

    return TMA_CHAIN and (TMA_CHAIN_GPU_VERIFIED or unverified_allowed()) and tma_capable(torch.device(device))


def _chain_on_tma(M, starts, ends, plan, seg_offsets, max_segments, S0, G_end, some, N, H, K, V) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    # the backward direction's right operand is M itself, K-major only as M^T's rows: M's rows, then
    # M^T's (at row S H K of the descriptor: S = 0 where only the backward direction runs)
    if ends is None:
        rows, second = M, 0
    elif starts is None:
        rows, second = M.mT.contiguous(), 0
    else:
        rows, second = torch.cat([M, M.mT]), M.shape[0]
    m_desc = TensorDescriptor.from_tensor(rows.view(-1, K), [K, K])
    bv = min(TMA_CHAIN_BV, V & -V)  # a power of two dividing V
    directions = (starts is not None) + (ends is not None)
    _tma_chain[(N * H, V // bv, directions)](
        m_desc, some if starts is None else starts, some if ends is None else ends, plan, seg_offsets,
        some if S0 is None else S0.contiguous(), some if G_end is None else G_end.contiguous(), second, H, K=K,
        V=V, BV=bv,
        NSEG=triton.next_power_of_2(max(1, max_segments)), HAS_S0=S0 is not None, HAS_G_END=G_end is not None,
        FIRST_DIRECTION=1 if starts is None else 0, STAGES=TMA_CHAIN_STAGES, num_warps=TMA_CHAIN_WARPS)


def chain(M: torch.Tensor, starts, ends, plan: torch.Tensor, seg_offsets: torch.Tensor,
          max_segments: int, S0=None, G_end=None, tf32: bool = False) -> None:
    """Completes pass 1's `starts` and `ends` (`[S, H, K, V]` fp32, module docstring) in place:
    every segment's exact start state (None: not wanted, `h` is given) and end-state gradient
    (None: not wanted, the op's forward; not both None).
    `M` `[S, H, K, K]` (read where `plan` `[S, H, 2]` says exact), `seg_offsets` int32 `[N + 1]`
    (sequence n's segments), `max_segments` the most any sequence has, `S0` / `G_end` `[N, H,
    K, V]` fp32 the sequences' initial states and final-state gradients (None: 0). `tf32`: the
    call's inputs are 16-bit, so plain TF32 products are within their rounding (`_tma_chain`, where
    `use_tma_chain`); else 3xTF32."""
    for name, x in (("starts", starts), ("ends", ends)):
        if x is not None and not x.is_contiguous():
            raise ValueError(f"chain: {name} must be contiguous (it is completed in place)")
    if starts is None and ends is None:
        raise ValueError("chain: nothing to complete (starts and ends both None)")
    if use_prefix(max_segments, some_device(starts, ends)):
        return chain_prefix(M, starts, ends, plan, seg_offsets, max_segments, S0, G_end)
    if use_blocked(max_segments, some_device(starts, ends)):
        return chain_blocked(M, starts, ends, plan, seg_offsets, max_segments, S0, G_end)
    M, plan = M.contiguous(), plan.contiguous()  # a provider's M may be a slice of its [M | R]
    N = seg_offsets.shape[0] - 1
    some = ends if ends is not None else starts
    H, K, V = some.shape[1], some.shape[2], some.shape[3]
    if tf32 and use_tma_chain(some.device):
        return _chain_on_tma(M, starts, ends, plan, seg_offsets, max_segments, S0, G_end, some, N, H, K, V)
    bv = min(BV, V)
    directions = (starts is not None) + (ends is not None)
    # absent tensors: `some` stands in as a pointer never read
    _chain[(N * H, V // bv, directions)](
        M, some if starts is None else starts, some if ends is None else ends, plan, seg_offsets,
        some if S0 is None else S0.contiguous(), some if G_end is None else G_end.contiguous(), H, K=K, V=V, BV=bv,
        NSEG=triton.next_power_of_2(max(1, max_segments)), HAS_S0=S0 is not None, HAS_G_END=G_end is not None,
        FIRST_DIRECTION=1 if starts is None else 0, PREFETCH=int(PREFETCH), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
