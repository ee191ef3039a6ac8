"""Pass 1 of the exact split (backends/split/passes.py) as Triton kernels: every segment's
composed state maps `(M, R, D)` from the call's own inputs, with `W`, `U0` and the local dV
formed per chunk in registers inside the walks, or (`FACTORS`) formed for every visited chunk
at once by `_factors` first and read by the walks. Another walks the states from the segments'
start states for pass 3's `h` when the call has none.

Why: on fla's kernels pass 1 is stage 1 with its conversions, the state pass and the dh pass,
about eight launches with fla's Python around each (~0.32 of the split's 0.71 ms replayed from a
CUDA graph at B1 T32768 H4 in 32 segments), and its launches are most of the split's host time.
Here: two launches, three with the factors (docs/kernels.md, "The split").

- `_forward_maps`: one program per (segment, head, block of BC state columns) walks the
  segment's chunks forwards. The state recurrence is linear in (state, values), so run from the
  start state `[I | 0]` on the values `[0 | U0]` it ends at `[M | R]` (as fla's provider does).
- `_backward_maps`: one program per (segment, head, block of BC value columns) walks them
  backwards from a zero end gradient: `dS <- e^{G_L} dS + (scale Q e^G)^T dO - W^T (dV_loc +
  Kt dS)`; the segment's start gradient is its `D`.
- `_forward_states`: the forward walk from each segment's true start state (pass 2's result),
  writing every chunk's start state: with `h=None` pass 3's backend then takes `h` given
  instead of recomputing the states (fla's stages 1-2, four launches, for most backends).

Products take 16-bit operands (the state, U and the inner products of W's two factors rounded
to k's dtype, as fla's chain rounds its state and W) with fp32 accumulation; the carried state
stays fp32. Segments are whole chunks of
their sequence (backends/split/passes.segment_plan), so `g`'s chunk-local cumsums hold as given.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading

import torch
import triton
import triton.language as tl

#: state columns per program (the carried block is K x BC fp32) and launch options: 64/4/1, memcheck
#: clean at 32 segments of 1024 tokens and on a ragged call (tools/memcheck_segment_maps.py), 0.130
#: + 0.130 ms for the two maps at B1 T32768 H4 in 32 segments against 64/8/1's 0.255 + 0.221 (H200,
#: tools/profile_split.py). BC 32 with one stage reads shared memory out of bounds in the backward
#: walk's products under Triton 3.6 (compute-sanitizer). Resources (tools/triton_report.py,
#: Triton 3.6, 8 warps): 255 registers each, stack 8 / 744 / 72 bytes (forward maps / backward
#: maps / states).
BC = 64
NUM_WARPS, NUM_STAGES = 4, 1
#: An exact segment's walks in at most PIECES pieces of at least MIN_PIECE_CHUNKS chunks each,
#: run by more programs and composed after (`_maps`); the composition's launch options are the
#: chain's (segment_scan.py). Off (1): at the mixed gate on the H200 pass 1 went 0.213 -> 0.191 ms
#: with 4 at B1 T32768 H4 /32 and 0.204 -> 0.280 ms at B1 T8192 H16 /8, where the warm heads'
#: windows, not the exact walks, set its time (docs/kernels.md, "Exact walks in pieces").
PIECES, MIN_PIECE_CHUNKS = 1, 2
COMPOSE_CB, COMPOSE_WARPS, COMPOSE_STAGES = 16, 8, 2
#: The walks read each visited chunk's factors, formed for all of them at once by `_factors`
#: (a launch more, parallel over chunks), instead of forming them inside the serial walk: a
#: forward step is then two products, a backward step two on its chain and one off it, the
#: loads independent of the walk (docs/kernels.md, "The split", the lever table: an earlier form
#: with fp32 per-block `Z` made the walks 2.4x / 1.4x faster on the H200 but cost 247 us itself).
#: FACTOR_BYTES_MAX bounds their buffers (sized for every chunk: the plan is on the device);
#: above it the walks form the chunks.
FACTORS = True
FACTOR_BYTES_MAX = 1 << 30
FACTOR_WARPS = 4
#: Whether the factors' GPU tests (tests/test_gpu.py: the maps against float64 and the split
#: against the unsplit call with them) have passed in this form; while False they run only with
#: GDR_ALLOW_UNVERIFIED=1.
FACTORS_GPU_VERIFIED = True
#: The factored walks as `_tma_forward_maps` / `_tma_backward_maps` where the GPU has a tensor memory
#: accelerator (sm_90 on): the carried block transposed, so it is the left operand of both of a
#: step's products from registers, and the factors (with diag(e^{G_L - G}) K, a buffer more) loaded
#: by TMA STAGES chunks ahead, where the Triton walks above wait on their loads every step. H200, B1
#: T32768 H4 /32 mixed gate: the walks 61.5 / 64.8 -> 31.5 / 39.5 us, `_factors` 37.8 -> 46.3 us,
#: pass 1 replayed 0.126 -> 0.097 ms (docs/kernels.md, "The split"). While `TMA_WALKS_GPU_VERIFIED`
#: is False only with GDR_ALLOW_UNVERIFIED=1.
TMA_WALKS = True
TMA_STAGES = 2
TMA_WALKS_GPU_VERIFIED = True
#: Whether the pieces' GPU tests (tests/test_gpu.py: the decay-aware split against the unsplit
#: call with them) have passed; while False they run only with GDR_ALLOW_UNVERIFIED=1.
PIECES_WALK_GPU_VERIFIED = True
#: Whether the kernels' GPU tests (tests/test_gpu.py: the maps against float64, the split
#: oracle tests with them) have passed; while False, the split uses them only with
#: GDR_ALLOW_UNVERIFIED=1 (fla's kernels or the torch products otherwise).
GPU_VERIFIED = True
#: The same for the decay-aware pass 1 (`decay_plan`, `segment_pieces`; tests/test_gpu.py: the
#: pieces against the tensor products, the split against the unsplit call at strong, weak and
#: mixed gates). While False the split runs our exact maps (or the gate's alternatives) instead.
PIECES_GPU_VERIFIED = True
#: Pass 1's two walks (`_forward_maps`, `_backward_maps`) read nothing of each other: on a GPU
#: the backward walk runs on a second stream beside the forward one (a fork and a join, captured
#: into the split's graphs as two branches), so pass 1 takes about the longer walk instead of
#: both. Where segments are exact (the mixed gate) each walk's time is its longest programs',
#: with SM slots to spare (docs/kernels.md, "The split"; H200, B1 T32768 H4 /32, mixed gate: pass 1
#: 0.157 -> 0.128 ms replayed). Its GPU test (the walks on two streams equal them on one, eager and
#: captured) passes (`CONCURRENT_WALKS_GPU_VERIFIED`; while False only GDR_ALLOW_UNVERIFIED=1 forks).
CONCURRENT_WALKS = True
CONCURRENT_WALKS_GPU_VERIFIED = True
#: The decay plan's serial chunk loads (the windows' keys for the contraction test, every token's
#: log decay for the rise test) spread over up to PLAN_MAX_PROGRAMS programs per (segment, head),
#: PLAN_CHUNKS chunks each (off: one program each), the exact segments zeroed by `_plan_combine`.
#: H200, mixed gate, replayed, against one program per segment finished by four tensor ops: 0.032
#: -> 0.013 ms at B1 T32768 H4 /32, 0.061 -> 0.018 at B1 T65536 H4 /32, 0.049 -> 0.016 at B1 T8192
#: H16 /8 (docs/kernels.md, "The split"). Its GPU test passes (`PLAN_SPREAD_GPU_VERIFIED`; while
#: False the GPU plan spreads only with GDR_ALLOW_UNVERIFIED=1).
PLAN_SPREAD = True
PLAN_CHUNKS, PLAN_MAX_PROGRAMS = 2, 16
PLAN_SPREAD_GPU_VERIFIED = True
#: Segments a warm-up window may reach past its own (a start state's into the segments before,
#: an end gradient's into those after, within the sequence): a weakly decaying head whose summed
#: log decay needs more than a segment to pass the threshold warms up over its neighbours' chunks
#: instead of being joined exactly (a serial chain link per segment). A window's chunks are also
#: capped where a warm-up costs more than the exact join it replaces (`window_cap`: a walk step
#: ~2 us, a chain link ~3.4 us on the H200; docs/kernels.md, "The split"). The walks take any plan
#: whose windows reach at most CROSS segments; `decay_plan` forms them once their GPU tests pass
#: (`CROSS_GPU_VERIFIED`, or GDR_ALLOW_UNVERIFIED=1; always on the CPU). H200, mixed gate, replayed:
#: the whole backward 0.481 -> 0.435 ms at B1 T32768 H4 /32 (its weak head warm), 0.399 -> 0.391 at
#: B1 T8192 H16 /8, 0.652 -> 0.650 at B1 T65536 H4 /32 (every head warm either way).
CROSS = 2
CROSS_GPU_VERIFIED = True
LINK_CHUNKS = 1.5


@triton.jit
def _chunk(k_ptr, a_ptr, g_ptr, b_ptr, t0, eos, hg, h, Hg, H, K: tl.constexpr, BT: tl.constexpr,
           TRANSPOSED: tl.constexpr):
    """A chunk's rows from t0: k `[BT, K]`, G `[BT]` (padded with the last valid G), G_L (the
    last valid G), b, Gam and
    Gam * A `[BT, BT]` (the latter rounded to k's dtype: a product operand only), both
    transposed with TRANSPOSED (formed so, not moved: the backward walk reads them only so).
    Here W = (Gam * A) diag(b e^G) K is never formed, nor any other scaled copy of k or q: W X =
    (Gam * A) diag(b e^G) (K X) and W^T Y = K^T diag(b e^G) (Gam * A)^T Y, and every diagonal
    scales the rows of a `[BT, BC]` product instead of a `[BT, K]` operand (fewer products,
    registers and elementwise work)."""
    rt = tl.arange(0, BT)
    rk = tl.arange(0, K)
    t = t0 + rt
    valid = t < eos
    k = tl.load(k_ptr + (t[:, None].to(tl.int64) * Hg + hg) * K + rk[None, :], mask=valid[:, None], other=0.0)
    G = tl.load(g_ptr + tl.minimum(t, eos - 1).to(tl.int64) * H + h)
    b = tl.load(b_ptr + t.to(tl.int64) * H + h, mask=valid, other=0.0).to(tl.float32)
    # mask before exp: above the diagonal G_i - G_j can be large and positive
    if TRANSPOSED:  # [i, j] holds Gam[j, i], A[j, i]
        a = tl.load(a_ptr + (t[None, :].to(tl.int64) * H + h) * BT + rt[:, None], mask=valid[None, :], other=0.0)
        gam = tl.exp(tl.where(rt[None, :] >= rt[:, None], G[None, :] - G[:, None], float("-inf")))
    else:
        a = tl.load(a_ptr + (t[:, None].to(tl.int64) * H + h) * BT + rt[None, :], mask=valid[:, None], other=0.0)
        gam = tl.exp(tl.where(rt[:, None] >= rt[None, :], G[:, None] - G[None, :], float("-inf")))
    ag = (gam * a.to(tl.float32)).to(k.dtype)
    gL = tl.sum(tl.where(rt == tl.minimum(eos - t0, BT) - 1, G, 0.0), axis=0)
    return k, G, gL, b, gam, ag


@triton.jit
def _rows_t(x_ptr, t, valid, hg, Hg, K: tl.constexpr):
    """A chunk's q or k rows `t` as the transposed tile `[K, BT]`."""
    return tl.load(x_ptr + (t[None, :].to(tl.int64) * Hg + hg) * K + tl.arange(0, K)[:, None],
                   mask=valid[None, :], other=0.0)


@triton.jit
def _program(cu_ptr, Hg, H, BC: tl.constexpr):
    """This program's (segment x head) index, its value head and q/k head, its first state
    column, and its segment's token range [bos, eos)."""
    nh = tl.program_id(0)
    h = nh % H
    bos = tl.load(cu_ptr + nh // H)
    eos = tl.load(cu_ptr + nh // H + 1)
    return nh, h, h // (H // Hg), tl.program_id(1) * BC, bos, eos


@triton.jit
def _values(v_ptr, t0, eos, h, H, col, ag, b, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Columns [col, col + BC) of the chunk's U0 = (Gam * A) diag(b) V, fp32 `[BT, BC]`."""
    rt = tl.arange(0, BT)
    t = t0 + rt
    v = tl.load(v_ptr + (t[:, None].to(tl.int64) * H + h) * V + (col + tl.arange(0, BC))[None, :],
                mask=(t < eos)[:, None], other=0.0)
    return tl.dot(ag, (v.to(tl.float32) * b[:, None]).to(ag.dtype))


@triton.jit
def _state_step(S, k, G, gL, b, ag, u0):
    """One chunk of the state recurrence on a block of columns: S <- e^{G_L} S + (diag(e^{G_L -
    G}) K)^T (U0 - W S), W S = (Gam * A) diag(b e^G) (K S)."""
    ks = tl.dot(k, S.to(k.dtype)) * (b * tl.exp(G))[:, None]
    u = u0 - tl.dot(ag, ks.to(k.dtype))
    return tl.exp(gL) * S + tl.dot(tl.trans(k), (u * tl.exp(gL - G)[:, None]).to(k.dtype))


@triton.jit
def _walk_forward(S, k_ptr, v_ptr, a_ptr, g_ptr, b_ptr, lo, hi, eos, hg, h, Hg, H, c0, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """The state recurrence over the chunks from lo to hi (whole chunks of a segment ending at
    eos) on columns [c0, c0 + BC) of `[M | R]`: M's columns take no values, R's the values U0."""
    for t0 in range(lo, hi, BT):
        k, G, gL, b, gam, ag = _chunk(k_ptr, a_ptr, g_ptr, b_ptr, t0, eos, hg, h, Hg, H, K, BT, False)
        if c0 >= K:  # R's columns: the values U0
            u0 = _values(v_ptr, t0, eos, h, H, c0 - K, ag, b, V, BT, BC)
        else:  # M's: none
            u0 = tl.zeros([BT, BC], dtype=tl.float32)
        S = _state_step(S, k, G, gL, b, ag, u0)
    return S


@triton.jit
def _walk_backward(dS, q_ptr, k_ptr, a_ptr, g_ptr, b_ptr, do_ptr, lo, n_chunks, eos, hg, h, Hg, H, c0, scale,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """The dh recurrence over `n_chunks` chunks from lo, walked back from the last, on value
    columns [c0, c0 + BC)."""
    rt = tl.arange(0, BT)
    rc = tl.arange(0, BC)
    for i in range(n_chunks):
        t0 = lo + (n_chunks - 1 - i) * BT
        k, G, gL, b, gamt, agt = _chunk(k_ptr, a_ptr, g_ptr, b_ptr, t0, eos, hg, h, Hg, H, K, BT, True)
        t = t0 + rt
        valid = t < eos
        # Q^T and K^T as tiles of their own (not `tl.trans` views of q and k): the form the GPU
        # tests passed (the out-of-bounds reads at BC 32, `BC` above, came with either form)
        qt = _rows_t(q_ptr, t, valid, hg, Hg, K)
        kt = _rows_t(k_ptr, t, valid, hg, Hg, K)
        do = tl.load(do_ptr + (t[:, None].to(tl.int64) * H + h) * V + (c0 + rc)[None, :],
                     mask=valid[:, None], other=0.0)
        pt = gamt * tl.dot(k, qt)  # (Gam * Q K^T)^T = Gam^T * K Q^T
        # dU = dV_loc + diag(e^{G_L - G}) K dS
        du = scale * tl.dot(pt.to(k.dtype), do) + tl.dot(k, dS.to(k.dtype)) * tl.exp(gL - G)[:, None]
        y = tl.dot(agt, du.to(k.dtype)) * (b * tl.exp(G))[:, None]  # W^T dU = K^T y
        dS = (tl.exp(gL) * dS + tl.dot(qt, (do.to(tl.float32) * (scale * tl.exp(G))[:, None]).to(k.dtype))
              - tl.dot(kt, y.to(k.dtype)))
    return dS


@triton.jit
def _visits(plan_ptr, role_ptr, cu_ptr, n, nh, H, c, nc, BT: tl.constexpr, PLAN: tl.constexpr,
            NEED_R: tl.constexpr, CROSS: tl.constexpr):
    """Whether chunk c (of nc) of segment n is walked (as `_forward_maps` and `_backward_maps`
    decide under PLAN): (forward: M's columns or, with NEED_R, R's; backward), its own segment's
    walks or a window of one of the CROSS segments after it (forward) or before it (backward)."""
    fwd = 1
    bwd = 1
    if PLAN:
        n_f = tl.load(plan_ptr + nh * 2)
        n_b = tl.load(plan_ptr + nh * 2 + 1)
        role = tl.load(role_ptr + n)
        walk_m = ((n_f == 0) & (role != 3)).to(tl.int32)
        walk_r = (((role & 2) == 0) & ((n_f == 0) | (c >= nc - n_f))).to(tl.int32)
        bwd = (((role & 1) == 0) & ((n_b == 0) | (c < n_b))).to(tl.int32)
        h = nh - n * H
        m_f = n
        m_b = n
        on_f = 1
        on_b = 1
        dist_f = nc - c  # chunks from c to the end of segment m_f
        dist_b = c + 1  # chunks from the start of segment m_b to c
        for _ in tl.static_range(CROSS):
            on_f = on_f * ((tl.load(role_ptr + m_f) & 2) == 0).to(tl.int32)
            m_f = m_f + on_f
            dist_f = dist_f + on_f * tl.cdiv(tl.load(cu_ptr + m_f + 1) - tl.load(cu_ptr + m_f), BT)
            n_m = tl.load(plan_ptr + (m_f * H + h) * 2)
            reach = (on_f != 0) & ((tl.load(role_ptr + m_f) & 2) == 0) & (n_m >= dist_f)
            walk_r = tl.maximum(walk_r, reach.to(tl.int32))
            on_b = on_b * ((tl.load(role_ptr + m_b) & 1) == 0).to(tl.int32)
            m_b = m_b - on_b
            dist_b = dist_b + on_b * tl.cdiv(tl.load(cu_ptr + m_b + 1) - tl.load(cu_ptr + m_b), BT)
            n_m = tl.load(plan_ptr + (m_b * H + h) * 2 + 1)
            reach = (on_b != 0) & ((tl.load(role_ptr + m_b) & 1) == 0) & (n_m >= dist_b)
            bwd = tl.maximum(bwd, reach.to(tl.int32))
        fwd = tl.maximum(walk_m, walk_r * NEED_R)
    return fwd, bwd


@triton.jit
def _factors(q_ptr, k_ptr, v_ptr, a_ptr, g_ptr, b_ptr, cu_ptr, ci_ptr, plan_ptr, role_ptr, w_ptr, u_ptr, x_ptr, kd_ptr,
             scale, Hg, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, PLAN: tl.constexpr,
             NEED_R: tl.constexpr, NEED_D: tl.constexpr, TMA: tl.constexpr = 0, CROSS: tl.constexpr = 0):
    """Chunk i (a row of `ci`: its segment and chunk there) of head h, where a walk visits it
    (`_visits`), as `[BT, K]` / `[BT, V]` tiles in k's dtype (`[NT, H, BT, *]`; padded rows 0):
    W = (Gam * A) diag(b e^G) K (`w`), U0 = (Gam * A) diag(b) V (`u`, with NEED_R) and
    X = scale diag(e^G) Q - scale (Gam * Q K^T) W (`x`, with NEED_D). The walks then run
    S <- e^{G_L} S + K^T diag(e^{G_L - G}) (U0 - W S) and
    dS <- e^{G_L} dS + X^T dO - W^T diag(e^{G_L - G}) K dS: X^T dO is the dh step's part that does
    not depend on the gradient, (scale Q e^G)^T dO - W^T dV_loc, dV_loc = scale (Gam * Q K^T)^T dO.
    W's and U0's diagonals scale the `[BT, BT]` factor's columns, not a `[BT, K]` operand's rows.
    With TMA (for `_tma_forward_maps` / `_tma_backward_maps`) also diag(e^{G_L - G}) K (`kd`, `[NT,
    H, BT, K]`), and U0 transposed (`u` `[NT, H, V, BT]`)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(ci_ptr + i * 2)
    c = tl.load(ci_ptr + i * 2 + 1)
    hg = h // (H // Hg)
    bos = tl.load(cu_ptr + n)
    eos = tl.load(cu_ptr + n + 1)
    fwd, bwd = _visits(plan_ptr, role_ptr, cu_ptr, n, n * H + h, H, c, tl.cdiv(eos - bos, BT), BT, PLAN, NEED_R,
                       CROSS)
    bwd = bwd * NEED_D
    if (fwd + bwd) > 0:
        t0 = bos + c * BT
        rt = tl.arange(0, BT)
        rk = tl.arange(0, K)
        t = t0 + rt
        valid = t < eos
        k, G, gL, b, gam, ag = _chunk(k_ptr, a_ptr, g_ptr, b_ptr, t0, eos, hg, h, Hg, H, K, BT, False)
        w = tl.dot((ag.to(tl.float32) * (b * tl.exp(G))[None, :]).to(k.dtype), k).to(k.dtype)
        base = i.to(tl.int64) * H + h
        tl.store(w_ptr + (base * BT + rt[:, None]) * K + rk[None, :], w)
        if TMA:  # padded rows: k is 0 there
            kd = k.to(tl.float32) * tl.exp(gL - G)[:, None]
            tl.store(kd_ptr + (base * BT + rt[:, None]) * K + rk[None, :], kd.to(k.dtype))
        if NEED_R:
            if fwd > 0:
                rv = tl.arange(0, V)
                v = tl.load(v_ptr + (t[:, None].to(tl.int64) * H + h) * V + rv[None, :], mask=valid[:, None], other=0.0)
                u0 = tl.dot((ag.to(tl.float32) * b[None, :]).to(k.dtype), v)
                if TMA:
                    tl.store(u_ptr + (base * V + rv[None, :]) * BT + rt[:, None], u0.to(k.dtype))
                else:
                    tl.store(u_ptr + (base * BT + rt[:, None]) * V + rv[None, :], u0.to(k.dtype))
        if bwd > 0:
            q = tl.load(q_ptr + (t[:, None].to(tl.int64) * Hg + hg) * K + rk[None, :], mask=valid[:, None], other=0.0)
            p = (scale * gam) * tl.dot(q, tl.trans(k))  # scale (Gam * Q K^T)
            x = q.to(tl.float32) * (scale * tl.exp(G))[:, None] - tl.dot(p.to(k.dtype), w)
            tl.store(x_ptr + (base * BT + rt[:, None]) * K + rk[None, :], x.to(k.dtype))


@triton.jit
def _decays(g_ptr, t0, eos, h, H, BT: tl.constexpr):
    """A chunk's e^{G_L - G} `[BT]` (1 on padded rows, whose k is 0) and e^{G_L}."""
    t = t0 + tl.arange(0, BT)
    G = tl.load(g_ptr + tl.minimum(t, eos - 1).to(tl.int64) * H + h)
    gL = tl.load(g_ptr + (tl.minimum(t0 + BT, eos) - 1).to(tl.int64) * H + h)
    return tl.exp(gL - G), tl.exp(gL)


@triton.jit
def _factored_forward(S, k_ptr, w_ptr, u_ptr, g_ptr, row0, lo, hi, bos, eos, hg, h, Hg, H, c0, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """`_walk_forward` on `_factors`' chunks (segment chunk 0 at row `row0` of theirs)."""
    rt = tl.arange(0, BT)
    rk = tl.arange(0, K)
    rc = tl.arange(0, BC)
    for t0 in range(lo, hi, BT):
        t = t0 + rt
        base = (row0 + (t0 - bos) // BT) * H + h
        w = tl.load(w_ptr + (base * BT + rt[:, None]) * K + rk[None, :])
        kt = _rows_t(k_ptr, t, t < eos, hg, Hg, K)
        d, dL = _decays(g_ptr, t0, eos, h, H, BT)
        u = -tl.dot(w, S.to(w.dtype))
        if c0 >= K:  # R's columns: the values U0
            u += tl.load(u_ptr + (base * BT + rt[:, None]) * V + c0 - K + rc[None, :]).to(tl.float32)
        S = dL * S + tl.dot(kt, (u * d[:, None]).to(w.dtype))
    return S


@triton.jit
def _factored_backward(dS, k_ptr, w_ptr, x_ptr, do_ptr, g_ptr, row0, lo, n_chunks, bos, eos, hg, h, Hg, H, c0,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """`_walk_backward` on `_factors`' chunks."""
    rt = tl.arange(0, BT)
    rk = tl.arange(0, K)
    rc = tl.arange(0, BC)
    for j in range(n_chunks):
        t0 = lo + (n_chunks - 1 - j) * BT
        t = t0 + rt
        valid = t < eos
        base = (row0 + (t0 - bos) // BT) * H + h
        k = tl.load(k_ptr + (t[:, None].to(tl.int64) * Hg + hg) * K + rk[None, :], mask=valid[:, None], other=0.0)
        wt = tl.load(w_ptr + (base * BT + rt[None, :]) * K + rk[:, None])  # [K, BT]
        xt = tl.load(x_ptr + (base * BT + rt[None, :]) * K + rk[:, None])  # [K, BT]
        do = tl.load(do_ptr + (t[:, None].to(tl.int64) * H + h) * V + (c0 + rc)[None, :], mask=valid[:, None],
                     other=0.0)
        d, dL = _decays(g_ptr, t0, eos, h, H, BT)
        du = tl.dot(k, dS.to(k.dtype)) * d[:, None]
        dS = dL * dS + tl.dot(xt, do) - tl.dot(wt, du.to(k.dtype))
    return dS


@triton.jit
def _forward_range(plan_ptr, role_ptr, nh, H, c0, bos, eos, K: tl.constexpr, BT: tl.constexpr, PLAN: tl.constexpr,
                   SKIP_EXACT: tl.constexpr):
    """A forward walk's tokens [lo, hi), the row of `m` / `r` it stores to and whether it stores
    (`work`: 0 or 1, an int, not a bool: the interpreter's masks need vectors), as
    `_forward_maps` says under PLAN."""
    lo = bos
    hi = eos
    row = nh
    work = 1
    if PLAN:
        n_f = tl.load(plan_ptr + nh * 2)
        role = tl.load(role_ptr + nh // H)
        if c0 >= K:
            work = ((role & 2) == 0).to(tl.int32)
            if SKIP_EXACT:  # an exact segment's walk is `_forward_pieces`' (composed after)
                work = work * (n_f > 0).to(tl.int32)
            row = nh + H
            lo = tl.where(n_f > 0, bos + (tl.cdiv(eos - bos, BT) - n_f) * BT, bos)
        else:
            work = (n_f == 0).to(tl.int32) * (role != 3).to(tl.int32) * (1 - SKIP_EXACT)
        hi = tl.where(work != 0, eos, lo)
    return lo, hi, row, work


@triton.jit
def _backward_range(plan_ptr, role_ptr, nh, H, bos, eos, BT: tl.constexpr, PLAN: tl.constexpr,
                    SKIP_EXACT: tl.constexpr):
    """A backward walk's chunk count from the segment's start, the row of `out` it stores to and
    whether it stores, as `_backward_maps` says under PLAN."""
    n_chunks = tl.cdiv(eos - bos, BT)
    row = nh
    work = 1
    if PLAN:
        n_b = tl.load(plan_ptr + nh * 2 + 1)
        work = 1 - (tl.load(role_ptr + nh // H) & 1)
        if SKIP_EXACT:  # an exact segment's walk is `_backward_pieces`' (composed after)
            work = work * (n_b > 0).to(tl.int32)
        row = nh - H
        n_chunks = tl.where(work == 0, 0, tl.where(n_b > 0, n_b, n_chunks))
    return n_chunks, row, work


@triton.jit
def _forward_maps(k_ptr, v_ptr, a_ptr, g_ptr, b_ptr, cu_ptr, m_ptr, r_ptr, plan_ptr, role_ptr, w_ptr, u_ptr, co_ptr,
                  Hg, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                  PLAN: tl.constexpr, SKIP_EXACT: tl.constexpr = 0, FACTORED: tl.constexpr = 0):
    """Columns [c0, c0 + BC) of segment n's `[M | R]` (`m` `[S, H, K, K]`, `r` `[S, H, K, V]`;
    the grid's column blocks cover M, or M then R): the state recurrence from `[I | 0]` on the
    values `[0 | U0]`.

    With PLAN (`decay_plan`'s `plan` `[S, H, 2]`, `role` `[S]`: bit 0 the sequence's first segment,
    bit 1 its last): R's columns walk only the segment's last `plan[n, h, 0]` chunks where that is
    set (the next segment's start up to a term below rounding) and go to row n + 1 of `r` (the
    next segment's start, which `segment_scan.chain` completes in place), none for a sequence's
    last segment; M's columns run only where the plan says exact (0) and the sequence has more
    than one segment. With SKIP_EXACT (1) the exact segments are left to `_forward_pieces`. With
    FACTORED the walk reads `_factors`' chunks (`w`, `u`; `co[n]` segment n's first chunk row
    there) instead of forming them."""
    nh, h, hg, c0, bos, eos = _program(cu_ptr, Hg, H, BC)
    rk = tl.arange(0, K)
    rc = tl.arange(0, BC)
    # [I | 0]: a block lies wholly in M (columns < K) or wholly in R (BC divides K)
    S = tl.where(rk[:, None] == c0 + rc[None, :], 1.0, 0.0)
    lo, hi, row, work = _forward_range(plan_ptr, role_ptr, nh, H, c0, bos, eos, K, BT, PLAN, SKIP_EXACT)
    if FACTORED:
        S = _factored_forward(S, k_ptr, w_ptr, u_ptr, g_ptr, tl.load(co_ptr + nh // H), lo, hi, bos, eos, hg, h, Hg,
                              H, c0, K, V, BT, BC)
    else:
        S = _walk_forward(S, k_ptr, v_ptr, a_ptr, g_ptr, b_ptr, lo, hi, eos, hg, h, Hg, H, c0, K, V, BT, BC)
    row64 = row.to(tl.int64)
    if c0 >= K:  # M and R apart: the scans read each whole (a slice of one [M | R] cost two copies)
        tl.store(r_ptr + (row64 * K + rk[:, None]) * V + c0 - K + rc[None, :], S, mask=rk[:, None] < work * K)
    else:
        tl.store(m_ptr + (row64 * K + rk[:, None]) * K + c0 + rc[None, :], S, mask=rk[:, None] < work * K)


@triton.jit
def _forward_states(k_ptr, v_ptr, a_ptr, g_ptr, b_ptr, cu_ptr, co_ptr, init_ptr, h_ptr, Hg, H,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                    V_FIRST: tl.constexpr):
    """Columns [c0, c0 + BC) of every chunk-start state of segment n from its start state
    `init` `[S, H, K, V]` (fp32): `h` `[NT, H, K, V]` (`[NT, H, V, K]` with V_FIRST) in h's dtype,
    the segment's chunks from `co[n]` on."""
    nh, h, hg, c0, bos, eos = _program(cu_ptr, Hg, H, BC)
    rk = tl.arange(0, K)
    rc = tl.arange(0, BC)
    S = tl.load(init_ptr + (nh.to(tl.int64) * K + rk[:, None]) * V + c0 + rc[None, :])
    c = tl.load(co_ptr + nh // H).to(tl.int64)
    for t0 in range(bos, eos, BT):
        if V_FIRST:
            tl.store(h_ptr + ((c * H + h) * V + c0 + rc[None, :]) * K + rk[:, None], S.to(h_ptr.dtype.element_ty))
        else:
            tl.store(h_ptr + ((c * H + h) * K + rk[:, None]) * V + c0 + rc[None, :], S.to(h_ptr.dtype.element_ty))
        k, G, gL, b, gam, ag = _chunk(k_ptr, a_ptr, g_ptr, b_ptr, t0, eos, hg, h, Hg, H, K, BT, False)
        S = _state_step(S, k, G, gL, b, ag, _values(v_ptr, t0, eos, h, H, c0, ag, b, V, BT, BC))
        c += 1


@triton.jit
def _backward_maps(q_ptr, k_ptr, a_ptr, g_ptr, b_ptr, do_ptr, cu_ptr, out_ptr, plan_ptr, role_ptr, w_ptr, x_ptr,
                   co_ptr, scale, Hg, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, PLAN: tl.constexpr, SKIP_EXACT: tl.constexpr = 0, FACTORED: tl.constexpr = 0,
                   CROSS: tl.constexpr = 0):
    """Columns [c0, c0 + BC) of segment n's `D` (`out` `[S, H, K, V]`): the dh recurrence
    from a zero gradient at the segment's end, walked back to its start. With PLAN (as
    `_forward_maps`): only the segment's first `plan[n, h, 1]` chunks where that is set (the
    previous segment's end gradient up to a term below rounding; past the segment's end they are
    the next segments', up to CROSS of them), into row n - 1 of `out` (the previous segment's end,
    completed in place by `segment_scan.chain`); none for a sequence's first segment. With
    SKIP_EXACT (1) the exact segments are left to `_backward_pieces`. With FACTORED the walk reads
    `_factors`' chunks (`w`, `x`, `co` as `_forward_maps`)."""
    nh, h, hg, c0, bos, eos = _program(cu_ptr, Hg, H, BC)
    rk = tl.arange(0, K)
    rc = tl.arange(0, BC)
    dS = tl.zeros([K, BC], dtype=tl.float32)
    n_chunks, row, work = _backward_range(plan_ptr, role_ptr, nh, H, bos, eos, BT, PLAN, SKIP_EXACT)
    end = eos
    if PLAN:  # a window may run on into the next segments: their tokens are real up to `_reach`'s end
        _, end = _reach(cu_ptr, role_ptr, nh // H, bos, eos, CROSS)
    if FACTORED:
        dS = _factored_backward(dS, k_ptr, w_ptr, x_ptr, do_ptr, g_ptr, tl.load(co_ptr + nh // H), bos, n_chunks,
                                bos, end, hg, h, Hg, H, c0, K, V, BT, BC)
    else:
        dS = _walk_backward(dS, q_ptr, k_ptr, a_ptr, g_ptr, b_ptr, do_ptr, bos, n_chunks, end, hg, h, Hg, H, c0,
                            scale, K, V, BT, BC)
    row64 = row.to(tl.int64)
    tl.store(out_ptr + (row64 * K + rk[:, None]) * V + c0 + rc[None, :], dS, mask=rk[:, None] < work * K)


@triton.jit
def _tma_forward_maps(w_desc, kd_desc, ut_desc, g_ptr, cu_ptr, m_ptr, r_ptr, plan_ptr, role_ptr, co_ptr, Hg, H,
                      K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PLAN: tl.constexpr,
                      NEED_R: tl.constexpr, STAGES: tl.constexpr):
    """`_forward_maps` on `_factors`' chunks (with TMA), the block of columns carried transposed:
    `S^T <- e^{G_L} S^T + (U0^T - S^T W^T) (diag(e^{G_L - G}) K)`. The carried `[BC, K]` block is
    both products' left operand, from registers; their right operands (W, diag(e^{G_L - G}) K) and
    U0^T are tensor-memory tiles loaded ahead of the walk (`STAGES`), so a step waits on its two
    products only (docs/kernels.md, "The split"). Padded rows are 0 in every factor."""
    nh, h, hg, c0, bos, eos = _program(cu_ptr, Hg, H, BC)
    rk = tl.arange(0, K)
    rc = tl.arange(0, BC)
    St = tl.where(c0 + rc[:, None] == rk[None, :], 1.0, 0.0)  # [I | 0]^T's rows c0..
    lo, hi, row, work = _forward_range(plan_ptr, role_ptr, nh, H, c0, bos, eos, K, BT, PLAN, 0)
    row0 = tl.load(co_ptr + nh // H)
    has_u = c0 >= K
    for t0 in tl.range(lo, hi, BT, num_stages=STAGES):
        base = ((row0 + (t0 - bos) // BT) * H + h).to(tl.int32)  # TMA coordinates are 32-bit
        w = w_desc.load([base * BT, 0])
        kd = kd_desc.load([base * BT, 0])
        gL = tl.load(g_ptr + (tl.minimum(t0 + BT, eos) - 1).to(tl.int64) * H + h)
        ut = -tl.dot(St.to(w.dtype), tl.trans(w))  # [BC, BT]
        if NEED_R:  # R's columns: the values U0 (M's block loads a tile it drops)
            u0t = ut_desc.load([base * V + tl.maximum(c0 - K, 0), 0])
            ut += tl.where(has_u, u0t.to(tl.float32), 0.0)
        St = tl.exp(gL) * St + tl.dot(ut.to(w.dtype), kd)
    row64 = row.to(tl.int64)
    if c0 >= K:
        tl.store(r_ptr + (row64 * K + rk[None, :]) * V + c0 - K + rc[:, None], St, mask=rk[None, :] < work * K)
    else:
        tl.store(m_ptr + (row64 * K + rk[None, :]) * K + c0 + rc[:, None], St, mask=rk[None, :] < work * K)


@triton.jit
def _tma_backward_maps(kd_desc, w_desc, x_desc, do_ptr, g_ptr, cu_ptr, out_ptr, plan_ptr, role_ptr, co_ptr, Hg, H,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PLAN: tl.constexpr,
                       STAGES: tl.constexpr, CROSS: tl.constexpr = 0):
    """`_backward_maps` on `_factors`' chunks (with TMA), carried transposed as
    `_tma_forward_maps`: `dS^T <- e^{G_L} dS^T + dO^T X - (dS^T (diag(e^{G_L - G}) K)^T) W`. dO is
    read from the caller's tensor, masked (past a segment's end lies another sequence): a copy of
    its chunks by `_factors` for TMA cost that kernel more than it saved the walk (H200, B1 T32768
    H4 /32 mixed: `_factors` 46.3 -> 54.4 us, the walk 39.5 -> 37.0)."""
    nh, h, hg, c0, bos, eos = _program(cu_ptr, Hg, H, BC)
    rk = tl.arange(0, K)
    rc = tl.arange(0, BC)
    rt = tl.arange(0, BT)
    dSt = tl.zeros([BC, K], dtype=tl.float32)
    n_chunks, row, work = _backward_range(plan_ptr, role_ptr, nh, H, bos, eos, BT, PLAN, 0)
    row0 = tl.load(co_ptr + nh // H)
    if PLAN:  # as `_backward_maps`
        _, eos = _reach(cu_ptr, role_ptr, nh // H, bos, eos, CROSS)
    for j in tl.range(0, n_chunks, num_stages=STAGES):
        t0 = bos + (n_chunks - 1 - j) * BT
        base = ((row0 + (t0 - bos) // BT) * H + h).to(tl.int32)
        kd = kd_desc.load([base * BT, 0])
        w = w_desc.load([base * BT, 0])
        x = x_desc.load([base * BT, 0])
        t = t0 + rt
        dot = tl.load(do_ptr + (t[None, :].to(tl.int64) * H + h) * V + (c0 + rc)[:, None], mask=(t < eos)[None, :],
                      other=0.0)  # dO^T `[BC, BT]`
        gL = tl.load(g_ptr + (tl.minimum(t0 + BT, eos) - 1).to(tl.int64) * H + h)
        dut = tl.dot(dSt.to(kd.dtype), tl.trans(kd))  # [BC, BT]
        dSt = tl.exp(gL) * dSt + tl.dot(dot, x) - tl.dot(dut.to(kd.dtype), w)
    row64 = row.to(tl.int64)
    tl.store(out_ptr + (row64 * K + rk[None, :]) * V + c0 + rc[:, None], dSt, mask=rk[None, :] < work * K)


@triton.jit
def _compact(plan_ptr, role_ptr, list_ptr, count_ptr, n_pairs, H, BLOCK: tl.constexpr):
    """The (segment x head) pairs the pieces walk, in order: exact (the plan's window 0) in a
    sequence of more than one segment; their count in `count_ptr`. One program."""
    base = tl.full([], 0, tl.int32)
    for start in range(0, n_pairs, BLOCK):
        i = start + tl.arange(0, BLOCK)
        valid = i < n_pairs
        n_f = tl.load(plan_ptr + i * 2, mask=valid, other=1)
        role = tl.load(role_ptr + i // H, mask=valid, other=3)
        flag = ((n_f == 0) & (role != 3) & valid).to(tl.int32)
        pos = base + tl.cumsum(flag, axis=0) - 1
        tl.store(list_ptr + pos, i, mask=flag != 0)
        base += tl.sum(flag, axis=0)
    tl.store(count_ptr, base)


@triton.jit
def _piece(list_ptr, cu_ptr, w, H, Hg, P: tl.constexpr, NCOL: tl.constexpr, BT: tl.constexpr,
           BC: tl.constexpr):
    """Work item w of a pieces kernel: its slot in the list, the pair's (segment x head) index,
    head, q/k head, first column, the segment's end and the piece's chunk range [lo, hi): piece p
    of P takes `ceil(chunks / P)` chunks (the last ones none where the segment is short)."""
    slot = w // (P * NCOL)
    rem = w % (P * NCOL)
    p = rem // NCOL
    c0 = (rem % NCOL) * BC
    nh = tl.load(list_ptr + slot)
    h = nh % H
    bos = tl.load(cu_ptr + nh // H)
    eos = tl.load(cu_ptr + nh // H + 1)
    span = tl.cdiv(tl.cdiv(eos - bos, BT), P) * BT
    lo = tl.minimum(bos + p * span, eos)
    hi = tl.minimum(lo + span, eos)
    return slot, p, nh, h, h // (H // Hg), c0, eos, lo, hi


@triton.jit
def _forward_pieces(k_ptr, v_ptr, a_ptr, g_ptr, b_ptr, cu_ptr, list_ptr, count_ptr, pm_ptr, pr_ptr, Hg, H,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, P: tl.constexpr,
                    NCOL: tl.constexpr):
    """The listed exact segments' forward walks cut into P pieces of whole chunks, each from
    `[I | 0]`: piece p's `[M_p | R_p]` into `pm` `[L, P, K, K]` / `pr` `[L, P, K, V]` at the
    pair's slot. Persistent: the programs stride over (slot, piece, column block) items, as many
    as the list holds (read on the device)."""
    rk = tl.arange(0, K)
    rc = tl.arange(0, BC)
    total = tl.load(count_ptr) * (P * NCOL)
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        slot, p, nh, h, hg, c0, eos, lo, hi = _piece(list_ptr, cu_ptr, w, H, Hg, P, NCOL, BT, BC)
        S = tl.where(rk[:, None] == c0 + rc[None, :], 1.0, 0.0)
        S = _walk_forward(S, k_ptr, v_ptr, a_ptr, g_ptr, b_ptr, lo, hi, eos, hg, h, Hg, H, c0, K, V, BT, BC)
        at = slot.to(tl.int64) * P + p
        if c0 >= K:
            tl.store(pr_ptr + (at * K + rk[:, None]) * V + c0 - K + rc[None, :], S)
        else:
            tl.store(pm_ptr + (at * K + rk[:, None]) * K + c0 + rc[None, :], S)


@triton.jit
def _backward_pieces(q_ptr, k_ptr, a_ptr, g_ptr, b_ptr, do_ptr, cu_ptr, list_ptr, count_ptr, pd_ptr, scale, Hg, H,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, P: tl.constexpr,
                     NCOL: tl.constexpr):
    """The listed exact segments' backward walks in the same pieces, each from a zero end
    gradient: piece p's `D_p` into `pd` `[L, P, K, V]` (persistent, as `_forward_pieces`)."""
    rk = tl.arange(0, K)
    rc = tl.arange(0, BC)
    total = tl.load(count_ptr) * (P * NCOL)
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        slot, p, nh, h, hg, c0, eos, lo, hi = _piece(list_ptr, cu_ptr, w, H, Hg, P, NCOL, BT, BC)
        dS = tl.zeros([K, BC], dtype=tl.float32)
        dS = _walk_backward(dS, q_ptr, k_ptr, a_ptr, g_ptr, b_ptr, do_ptr, lo, tl.cdiv(hi - lo, BT), eos, hg, h, Hg,
                            H, c0, scale, K, V, BT, BC)
        at = slot.to(tl.int64) * P + p
        tl.store(pd_ptr + (at * K + rk[:, None]) * V + c0 + rc[None, :], dS)


@triton.jit
def _composed(list_ptr, w, P: tl.constexpr, NCOL: tl.constexpr, CB: tl.constexpr):
    """Work item w of a composition kernel: the listed pair's (segment x head) index, its first
    column and its pieces' first row in the pieces' buffers."""
    slot = w // NCOL
    return tl.load(list_ptr + slot), (w % NCOL) * CB, slot.to(tl.int64) * P


@triton.jit
def _compose_forward(list_ptr, count_ptr, role_ptr, pm_ptr, pr_ptr, m_ptr, r_ptr, H, K: tl.constexpr,
                     V: tl.constexpr, P: tl.constexpr, CB: tl.constexpr, NCOL: tl.constexpr):
    """Each listed segment's `[M | R]` from its pieces' (`_forward_pieces`): `X = [M_0 | R_0]`,
    then `X = M_p X + [0 | R_p]` for p = 1..P-1 (3xTF32), into `m` row n and `r` row n + 1 (the
    next segment's start slot; none for a sequence's last segment), as `_forward_maps` stores."""
    rk = tl.arange(0, K)
    rc = tl.arange(0, CB)
    total = tl.load(count_ptr) * NCOL
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        nh, c0, base = _composed(list_ptr, w, P, NCOL, CB)
        if c0 >= K:
            X = tl.load(pr_ptr + (base * K + rk[:, None]) * V + c0 - K + rc[None, :])
        else:
            X = tl.load(pm_ptr + (base * K + rk[:, None]) * K + c0 + rc[None, :])
        for p in range(1, P):
            m = tl.load(pm_ptr + ((base + p) * K + rk[:, None]) * K + rk[None, :])
            X = tl.dot(m, X, input_precision="tf32x3")
            if c0 >= K:
                X += tl.load(pr_ptr + ((base + p) * K + rk[:, None]) * V + c0 - K + rc[None, :])
        role = tl.load(role_ptr + nh // H)
        row = nh.to(tl.int64)
        if c0 >= K:
            work = ((role & 2) == 0).to(tl.int32)
            tl.store(r_ptr + ((row + H) * K + rk[:, None]) * V + c0 - K + rc[None, :], X, mask=rk[:, None] < work * K)
        else:
            tl.store(m_ptr + (row * K + rk[:, None]) * K + c0 + rc[None, :], X)


@triton.jit
def _compose_backward(list_ptr, count_ptr, role_ptr, pm_ptr, pd_ptr, out_ptr, H, K: tl.constexpr, V: tl.constexpr,
                      P: tl.constexpr, CB: tl.constexpr, NCOL: tl.constexpr):
    """Each listed segment's `D` from its pieces': `Y = D_{P-1}`, then `Y = M_p^T Y + D_p` for
    p = P-2..0 (the forward pieces' maps, transposed; 3xTF32), into row n - 1 of `out` (none for a
    sequence's first segment), as `_backward_maps` stores."""
    rk = tl.arange(0, K)
    rc = tl.arange(0, CB)
    total = tl.load(count_ptr) * NCOL
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        nh, c0, base = _composed(list_ptr, w, P, NCOL, CB)
        Y = tl.load(pd_ptr + ((base + P - 1) * K + rk[:, None]) * V + c0 + rc[None, :])
        for i in range(1, P):
            p = P - 1 - i
            mt = tl.load(pm_ptr + ((base + p) * K + rk[None, :]) * K + rk[:, None])  # mt[a, b] = M_p[b, a]
            Y = tl.dot(mt, Y, input_precision="tf32x3") + tl.load(pd_ptr + ((base + p) * K + rk[:, None]) * V + c0
                                                                  + rc[None, :])
        work = 1 - (tl.load(role_ptr + nh // H) & 1)
        row = nh.to(tl.int64) - H
        tl.store(out_ptr + (row * K + rk[:, None]) * V + c0 + rc[None, :], Y, mask=rk[:, None] < work * K)


@triton.jit
def _breaks_contraction(k_ptr, b_ptr, t0, eos, hg, h, Hg, H, K: tl.constexpr, BT: tl.constexpr):
    """1 where a token of the chunk from t0 has b |k|^2 outside [0, 2] or NaN (its transition
    e^g (I - b k k^T) then grows some state by more than e^g, or poisons it), else 0."""
    t = t0 + tl.arange(0, BT)
    valid = t < eos
    k = tl.load(k_ptr + (t[:, None].to(tl.int64) * Hg + hg) * K + tl.arange(0, K)[None, :], mask=valid[:, None],
                other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t.to(tl.int64) * H + h, mask=valid, other=0.0).to(tl.float32)
    x = b * tl.sum(k * k, axis=1)
    return tl.max(1 - ((x >= 0.0) & (x <= 2.0)).to(tl.int32), axis=0)


@triton.jit
def _reach(cu_ptr, role_ptr, n, bos, eos, CROSS: tl.constexpr):
    """The tokens a window of segment n may cover, `[lo, hi)`: from the start of the CROSS-th
    segment before it to the end of the CROSS-th after it, within its sequence (`role` bit 0: a
    sequence's first segment, bit 1: its last). Every chunk in it but the sequence's last is whole."""
    lo = bos
    hi = eos
    a = n
    b = n
    for _ in tl.static_range(CROSS):
        a = a - ((tl.load(role_ptr + a) & 1) == 0).to(tl.int32)
        lo = tl.load(cu_ptr + a)
        b = b + ((tl.load(role_ptr + b) & 2) == 0).to(tl.int32)
        hi = tl.load(cu_ptr + b + 1)
    return lo, hi


@triton.jit
def _windows(g_ptr, bos, eos, lo, hi, h, H, threshold, cap, BT: tl.constexpr, CMAX: tl.constexpr):
    """A segment's chunk count and its warm-up windows: the fewest chunks back from its end
    (`n_f`, down to `lo`) and forward from its start (`n_b`, up to `hi`), at most `cap`, whose
    summed log decay is below `threshold`, 0 where none is (`_reach`: past its own chunks they
    are its neighbours')."""
    nc = tl.cdiv(eos - bos, BT)
    rc = tl.arange(0, CMAX)
    # each chunk's summed log decay: g (chunk-local cumsums) at its last token, in order from the
    # segment's start and back from its end; each window's sum runs from its own end of the
    # segment (`total - head` would round a reset token's -1e9 into the others' sums by 64)
    ahead = (bos + rc * BT < hi) & (rc < cap)
    last = tl.minimum(bos + (rc + 1) * BT, hi) - 1
    ge = tl.load(g_ptr + last.to(tl.int64) * H + h, mask=ahead, other=0.0)
    behind = (bos + (nc - 1 - rc) * BT >= lo) & (rc < cap)  # chunk nc - 1 - r (negative: a segment before)
    back = tl.minimum(bos + (nc - rc) * BT, eos) - 1  # its last token
    ge_back = tl.load(g_ptr + back.to(tl.int64) * H + h, mask=behind, other=0.0)
    head = tl.cumsum(ge, axis=0)  # over chunks [0, r]
    tail = tl.cumsum(ge_back, axis=0)  # over chunks [nc - 1 - r, nc)
    r_f = tl.min(tl.where(behind & (tail < threshold), rc, CMAX), axis=0)
    c_b = tl.min(tl.where(ahead & (head < threshold), rc, CMAX), axis=0)
    return nc, tl.where(r_f < CMAX, r_f + 1, 0), tl.where(c_b < CMAX, c_b + 1, 0)


@triton.jit
def _rises(g_ptr, t0, eos, h, H, BT: tl.constexpr):
    """1 where a token of the chunk from t0 has a positive or NaN log decay (G minus the previous
    token's in its chunk; G itself at the chunk's start), else 0."""
    rt = tl.arange(0, BT)
    t = t0 + rt
    ok = t < eos
    G = tl.load(g_ptr + t.to(tl.int64) * H + h, mask=ok, other=0.0)
    before = tl.load(g_ptr + (t - 1).to(tl.int64) * H + h, mask=ok & (rt > 0), other=0.0)
    return tl.max((ok & ((G > before) | (G != G))).to(tl.int32), axis=0)


@triton.jit
def _decay_plan(k_ptr, g_ptr, b_ptr, cu_ptr, role_ptr, plan_ptr, flag_ptr, threshold, cap, Hg, H, K: tl.constexpr,
                BT: tl.constexpr, CMAX: tl.constexpr, CROSS: tl.constexpr):
    """Per (segment, head) (grid axis 0), program p of P (axis 1): the segment's windows
    (`_windows`, reaching CROSS segments past its own and at most `cap` chunks; program 0 writes
    `plan[n, h] = (n_f, n_b)`)
    and `flag[n, h, p]`: bit 0 where a
    window is missing (program 0) or a token of the windows' chunks p, p + P, .. breaks the
    contraction (`_breaks_contraction`), bit 1 where a token's log decay rises in the segment's
    chunks p, p + P, .. (the state can grow there, so no window bounds what it drops). P > 1
    spreads a segment's serial chunk loads over programs (`plan_programs`); `_plan_combine` then
    zeroes the plan where the flags say exact. docs/kernels.md, "The split"."""
    nh = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    h = nh % H
    hg = h // (H // Hg)
    bos = tl.load(cu_ptr + nh // H)
    eos = tl.load(cu_ptr + nh // H + 1)
    lo, hi = _reach(cu_ptr, role_ptr, nh // H, bos, eos, CROSS)
    nc, n_f, n_b = _windows(g_ptr, bos, eos, lo, hi, h, H, threshold, cap, BT, CMAX)
    missing = ((n_f == 0) | (n_b == 0)).to(tl.int32)
    bad = missing * (p == 0).to(tl.int32)
    for i in range(p, n_f * (1 - missing), P):  # the last window: chunks nc - n_f .. (from before bos on)
        bad = tl.maximum(bad, _breaks_contraction(k_ptr, b_ptr, bos + (nc - n_f + i) * BT, hi, hg, h, Hg, H, K, BT))
    for c in range(p, n_b * (1 - missing), P):  # the first window (on past eos)
        bad = tl.maximum(bad, _breaks_contraction(k_ptr, b_ptr, bos + c * BT, hi, hg, h, Hg, H, K, BT))
    up = 0
    for c in range(p, nc, P):
        up = tl.maximum(up, _rises(g_ptr, bos + c * BT, eos, h, H, BT))
    tl.store(flag_ptr + nh * P + p, bad + 2 * up)
    if p == 0:
        tl.store(plan_ptr + nh * 2, n_f)
        tl.store(plan_ptr + nh * 2 + 1, n_b)


@triton.jit
def _plan_combine(plan_ptr, flag_ptr, seg_off_ptr, H, P, NSEG: tl.constexpr, PB: tl.constexpr):
    """Per (sequence, head): every segment's plan zeroed (exact) where a flag of its says a window
    is missing or broken (bit 0), and all of the sequence's where any of its segments' log decay
    rises (bit 1)."""
    nh = tl.program_id(0)
    n = nh // H
    h = nh % H
    first = tl.load(seg_off_ptr + n)
    count = tl.load(seg_off_ptr + n + 1) - first
    ri = tl.arange(0, NSEG)
    rp = tl.arange(0, PB)
    row = (first + ri) * H + h
    seg = ri < count
    fl = tl.load(flag_ptr + row[:, None] * P + rp[None, :], mask=seg[:, None] & (rp < P)[None, :], other=0)
    grows = tl.max(tl.max((fl >> 1) & 1, axis=1), axis=0)
    kill = tl.maximum(tl.max(fl & 1, axis=1), grows)
    for j in tl.static_range(2):
        x = tl.load(plan_ptr + row * 2 + j, mask=seg, other=0)
        tl.store(plan_ptr + row * 2 + j, tl.where(kill != 0, 0, x), mask=seg)


def _call_reason(K: int, V: int, dtype: torch.dtype, chunk_size: int) -> str:
    why = []
    if dtype not in (torch.bfloat16, torch.float16):
        why.append(f"inputs in {dtype} (the kernels take bf16/fp16, the torch products keep fp32/fp64 exact)")
    if chunk_size != 64:
        why.append(f"chunk_size={chunk_size} (the kernels walk chunks of 64)")
    bc = min(BC, K, V)
    if K not in (16, 32, 64, 128) or V > 128 or V % bc or K % bc:
        why.append(f"K={K}, V={V} (the kernels take K in 16/32/64/128 and V <= 128 a multiple of min({BC}, K, V))")
    return "; ".join(why)


def not_supported_reason(K: int, V: int, dtype: torch.dtype, chunk_size: int, device: torch.device) -> str:
    """"" when the kernels take a segments' call, else every reason why not."""
    why = [] if torch.device(device).type == "cuda" else [f"inputs on {torch.device(device).type} (the kernels run on CUDA)"]
    return "; ".join(filter(None, why + [_call_reason(K, V, dtype, chunk_size)]))


def _check_segments_call(seg_call, what: str) -> None:
    why = _call_reason(seg_call.K, seg_call.V, seg_call.q.dtype, seg_call.chunk_size)
    if why:  # (the device is the caller's gate: tests run the interpreter)
        raise ValueError(f"{what}: {why}")
    if seg_call.B != 1 or seg_call.cu_seqlens is None:
        raise ValueError(f"{what}: expects the segments as one varlen call (B == 1, cu_seqlens set)")


def segment_maps(seg_call, need_r: bool = True):
    """Pass 1 on the kernels: each sequence of `seg_call` (the segments as one varlen call, K x V
    state layout) is one segment; returns `(M, R, D)` fp32, `[S, H, K, K]`, `[S, H, K, V]` (None
    without `need_r`: with `h` given the split takes the start states from `h`), `[S, H, K, V]`.
    The interface of `Backend.split_passes`' functions (and the maps the ranks exchange)."""
    _check_segments_call(seg_call, "segment_maps")
    return _maps(seg_call, None, None, need_r)


def decay_plan(seg_call, threshold: float, segs) -> torch.Tensor:
    """`_decay_plan` for every (segment, head) of `seg_call`: int32 `[S, H, 2]`, each segment's
    warm-up window in chunks, forwards and backwards (reaching `window_reach` segments past its
    own, at most `window_cap` chunks), or 0 where it is joined exactly; every segment of a
    (sequence, head) whose log decay rises anywhere (g > 0, or NaN) exact: there the state can
    grow, so a window's summed decay bounds nothing (`_plan_combine`). `segs`: the segments
    (backends/split/passes.Segments: their chunks `s`, roles and each sequence's range)."""
    from gdr_dispatch.graph_safe import device_constant

    _check_segments_call(seg_call, "decay_plan")
    H, Hg, K, BT = seg_call.H, seg_call.Hg, seg_call.K, seg_call.chunk_size
    dev = seg_call.q.device
    cross = window_reach(dev)
    P = plan_programs(segs.s) if plan_spread(dev) else 1
    plan = torch.empty(seg_call.N, H, 2, dtype=torch.int32, device=dev)
    flags = torch.empty(seg_call.N, H, P, dtype=torch.int32, device=dev)
    _decay_plan[(seg_call.N * H, P)](seg_call.k.contiguous(), seg_call.g.float().contiguous(), seg_call.b.contiguous(),
                                     seg_call.cu_seqlens.to(torch.int32).contiguous(),
                                     device_constant(segs.roles, torch.int32, dev), plan, flags, float(threshold),
                                     window_cap(segs.s, segs.max_per_sequence, cross), Hg, H, K=K, BT=BT,
                                     CMAX=triton.next_power_of_2(max(1, (1 + cross) * segs.s)), CROSS=cross,
                                     num_warps=4)
    _plan_combine[((len(segs.seg_offsets) - 1) * H,)](plan, flags, device_constant(segs.seg_offsets, torch.int32, dev),
                                                      H, P, NSEG=triton.next_power_of_2(segs.max_per_sequence),
                                                      PB=triton.next_power_of_2(P), num_warps=1)
    return plan


def plan_spread(dev: torch.device) -> bool:
    """Whether `decay_plan` spreads a segment's chunks over `plan_programs` programs (else one per
    segment and head): `PLAN_SPREAD` and, until its GPU test passes (`PLAN_SPREAD_GPU_VERIFIED`),
    GDR_ALLOW_UNVERIFIED=1. On the CPU (the interpreter) it follows `PLAN_SPREAD`."""
    from gdr_dispatch.registry import unverified_allowed

    return PLAN_SPREAD and (PLAN_SPREAD_GPU_VERIFIED or torch.device(dev).type != "cuda" or unverified_allowed())


def window_reach(dev: torch.device) -> int:
    """Segments past its own a window of `decay_plan` may reach: `CROSS` on the CPU (the
    interpreter) and, once its GPU tests pass (`CROSS_GPU_VERIFIED`) or with
    GDR_ALLOW_UNVERIFIED=1, on a GPU; else 0."""
    from gdr_dispatch.registry import unverified_allowed

    return CROSS if CROSS_GPU_VERIFIED or torch.device(dev).type != "cuda" or unverified_allowed() else 0


def window_cap(max_chunks: int, most_segments: int, cross: int) -> int:
    """The most chunks a window of `decay_plan` may hold: `cross` segments past its own, and no
    more than the longest segment's chunks (`max_chunks`) plus `LINK_CHUNKS` a link of the longest
    chain (`most_segments` a sequence; a window past that costs more walk steps than the exact
    join's walk and chain links)."""
    return min((1 + cross) * max_chunks, max_chunks + int(LINK_CHUNKS * (most_segments - 1)))


def plan_programs(max_chunks: int) -> int:
    """Programs per (segment, head) of the spread plan: PLAN_CHUNKS chunks each, at most
    PLAN_MAX_PROGRAMS."""
    return max(1, min(PLAN_MAX_PROGRAMS, -(-max_chunks // PLAN_CHUNKS)))


def segment_pieces(seg_call, plan: torch.Tensor, roles: torch.Tensor, need_starts: bool = True,
                   need_ends: bool = True, max_chunks: int = 0, need_m: bool = True):
    """Pass 1 of the decay-aware split (docs/kernels.md, "The split") on the kernels, for the
    segments of `seg_call` with `plan` (`decay_plan`) and `roles` (int32 `[S]`: bit 0 a sequence's
    first segment, bit 1 its last): `(M, starts, ends)` fp32. `starts[n]` holds segment n - 1's end
    state from a zero start over its window (none for a sequence's first segment; not computed
    without `need_starts`, then None), `ends[n]` segment n + 1's start gradient from a zero end
    gradient over its window (none for a sequence's last; not computed without `need_ends`: the
    op's forward, whose `do` does not exist yet, then None), `M[n]` segment n's map where the plan
    says exact. `segment_scan.chain` then completes both in place. `max_chunks` (the longest
    segment's chunks) lets the exact segments' walks run in pieces (`walk_pieces`). Without
    `need_m` or `need_starts` (the backward on the op's forward's carried maps and starts:
    backends/split/carry.py) no forward walk runs and `M` is None."""
    _check_segments_call(seg_call, "segment_pieces")
    M, starts, ends = _maps(seg_call, plan, roles, need_starts, need_ends, walk_pieces(max_chunks),
                            need_m=need_m or need_starts)
    return (M if need_m or need_starts else None), starts, ends


def use_factors(seg_call, need_r: bool, need_d: bool) -> bool:
    """Whether the walks read `_factors`' chunks: `FACTORS`, V a power of two, their buffers
    within `FACTOR_BYTES_MAX`, and, until their GPU tests pass (`FACTORS_GPU_VERIFIED`),
    GDR_ALLOW_UNVERIFIED=1."""
    from gdr_dispatch.contract import chunk_counts
    from gdr_dispatch.registry import unverified_allowed

    if not FACTORS or not (FACTORS_GPU_VERIFIED or unverified_allowed()):
        return False
    K, V, BT = seg_call.K, seg_call.V, seg_call.chunk_size
    if V & (V - 1):  # `_factors` forms U0's V columns in one tile (a power of two in Triton)
        return False
    tma = use_tma_walks(seg_call)
    per_chunk = (1 + need_d + tma) * BT * K + need_r * BT * V
    return sum(chunk_counts(seg_call.seq_lens, BT)) * seg_call.H * per_chunk * seg_call.k.element_size() \
        <= FACTOR_BYTES_MAX


def use_tma_walks(seg_call) -> bool:
    """Whether the factored walks are `_tma_forward_maps` / `_tma_backward_maps`: `TMA_WALKS`, a GPU
    with TMA (`tma_capable`), and, until their GPU tests pass (`TMA_WALKS_GPU_VERIFIED`),
    GDR_ALLOW_UNVERIFIED=1."""
    from gdr_dispatch.registry import unverified_allowed

    return TMA_WALKS and (TMA_WALKS_GPU_VERIFIED or unverified_allowed()) and tma_capable(seg_call.q.device)


def tma_capable(dev: torch.device) -> bool:
    """A CUDA device of compute capability 9 or more (Hopper's tensor memory accelerator)."""
    from gdr_dispatch import problem

    return dev.type == "cuda" and problem.device_info(dev).capability[0] >= 9


def walk_pieces(max_chunks: int) -> int:
    """How many pieces an exact segment's walk runs in (1: whole): `PIECES`, fewer where a piece
    would hold under `MIN_PIECE_CHUNKS` chunks; 1 until the pieces' GPU tests pass
    (`PIECES_WALK_GPU_VERIFIED`) unless GDR_ALLOW_UNVERIFIED=1."""
    from gdr_dispatch.registry import unverified_allowed

    if not (PIECES_WALK_GPU_VERIFIED or unverified_allowed()):
        return 1
    return max(1, min(PIECES, max_chunks // MIN_PIECE_CHUNKS))


def concurrent_walks(dev: torch.device) -> bool:
    """Whether pass 1's backward walk runs on a second stream beside the forward walk
    (`CONCURRENT_WALKS`, CUDA devices only)."""
    from gdr_dispatch.registry import unverified_allowed

    return dev.type == "cuda" and CONCURRENT_WALKS and (CONCURRENT_WALKS_GPU_VERIFIED or unverified_allowed())


_walk_streams: dict = {}


def _walk_stream(dev: torch.device):
    """The second stream for the backward walk, one per device and thread, kept (a stream made
    per call costs host time; a stream can be in one capture at a time, and two threads may each
    capture a split). torch hands streams out round-robin from a pool per device, so it may be
    the caller's own stream or another kept one: the fork then runs the walks one after the
    other, or waits on unrelated work, and never races."""
    key = (dev.index if dev.index is not None else torch.cuda.current_device(), threading.get_ident())
    if key not in _walk_streams:
        _walk_streams[key] = torch.cuda.Stream(torch.device("cuda", key[0]))
    return _walk_streams[key]


@contextlib.contextmanager
def _beside(dev: torch.device, fork: bool):
    """Pass 1's fork and join: yields what to enter around the backward walk's launch, the second
    stream (`_walk_stream`, after it waits for the caller's) with `fork`, else nothing; the join
    runs on leaving, whatever raised (what follows pass 1, and every free of this call's tensors,
    waits for it)."""
    if not fork:
        yield contextlib.nullcontext
        return
    main, side = torch.cuda.current_stream(dev), _walk_stream(dev)
    side.wait_stream(main)
    try:
        yield lambda: torch.cuda.stream(side)
    finally:
        main.wait_stream(side)


def _persistent_programs(dev: torch.device, items: int) -> int:
    """A persistent kernel's grid: two programs per SM (255 registers each), no more than items."""
    return max(1, min(items, 2 * _sm_count(dev.type, dev.index)))


@functools.lru_cache(maxsize=None)
def _sm_count(kind: str, index) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count if kind == "cuda" else 4


def _maps(seg_call, plan, roles, need_r: bool, need_d: bool = True, pieces: int = 1, need_m: bool = True):
    """Both walks over every segment (the backward one only with `need_d`): `(M, R or None, D or
    None)`, exact without a `plan`, else as `segment_pieces` says (R then holds the next segments'
    starts, D the previous ends). With a plan and `pieces` > 1 the exact segments' walks run in
    that many pieces each (`_forward_pieces`, `_backward_pieces`), composed after
    (`_compose_forward`, `_compose_backward`): more programs for the serial walk where few
    (segment, head) pairs are exact (docs/kernels.md, "The split"). Without `need_m` (and
    `need_r`) no whole forward walk runs (M is left unset; the pieces' walks still run: the backward
    pieces' composition reads their maps)."""
    K, V, H, Hg, BT = seg_call.K, seg_call.V, seg_call.H, seg_call.Hg, seg_call.chunk_size
    n_seg = seg_call.N
    dev = seg_call.q.device
    bc = min(BC, K, V)
    k, v, a = (x.contiguous() for x in (seg_call.k, seg_call.v, seg_call.a))
    g, b = seg_call.g.float().contiguous(), seg_call.b.contiguous()
    cu = seg_call.cu_seqlens.to(torch.int32).contiguous()
    M = torch.empty(n_seg, H, K, K, dtype=torch.float32, device=dev)
    R = torch.empty(n_seg, H, K, V, dtype=torch.float32, device=dev) if need_r else None
    D = torch.empty(n_seg, H, K, V, dtype=torch.float32, device=dev) if need_d else None
    # stand-in pointers, never used: M for R where no program stores R, and for the plan without one
    with_plan = plan is not None
    plan, roles = (plan, roles) if with_plan else (M, M)
    ncol = K + V if need_r else K
    P = pieces if with_plan else 1
    skip = int(P > 1)
    q, do = (seg_call.q.contiguous(), seg_call.do.contiguous()) if need_d else (k, k)
    # the factors' buffers, or stand-ins (M) where the walks form them
    fw = fu = fx = fkd = co = M
    factored = P == 1 and use_factors(seg_call, need_r, need_d)
    tma = factored and use_tma_walks(seg_call)
    if factored:
        from .chunk_grid import varlen_chunk_indices, varlen_chunk_offsets

        lens = seg_call.seq_lens
        ci = varlen_chunk_indices(lens, BT, dev)
        co = varlen_chunk_offsets(lens, BT, dev)
        nt = ci.shape[0]
        fw = torch.empty(nt, H, BT, K, dtype=k.dtype, device=dev)
        fu = torch.empty((nt, H) + ((V, BT) if tma else (BT, V)), dtype=k.dtype, device=dev) if need_r else M
        fx = torch.empty_like(fw) if need_d else M
        fkd = torch.empty_like(fw) if tma else M
        _factors[(nt, H)](q, k, v, a, g, b, cu, ci, plan, roles, fw, fu, fx, fkd, float(seg_call.scale), Hg, H, K=K,
                          V=V, BT=BT, PLAN=with_plan, NEED_R=int(need_r), NEED_D=int(need_d), TMA=int(tma),
                          CROSS=CROSS, num_warps=FACTOR_WARPS, num_stages=1)
    if tma:
        return _tma_maps(seg_call, plan, roles, with_plan, need_r, need_d, need_m, M, R, D, fw, fu, fx, fkd, co, g, cu,
                         do, bc)
    walk_forward = need_m or need_r
    # the backward walk beside the forward one (no pieces: their composition reads both walks' maps)
    fork = walk_forward and need_d and P == 1 and concurrent_walks(dev)
    with _beside(dev, fork) as beside:
        if fork:
            with beside():
                _backward_maps[(n_seg * H, V // bc)](q, k, a, g, b, do, cu, D, plan, roles, fw, fx, co,
                                                     float(seg_call.scale), Hg, H, K=K, V=V, BT=BT, BC=bc,
                                                     PLAN=with_plan, SKIP_EXACT=skip, FACTORED=int(factored),
                                                     CROSS=CROSS, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
        if walk_forward:
            _forward_maps[(n_seg * H, ncol // bc)](k, v, a, g, b, cu, M, M if R is None else R, plan, roles, fw,
                                                   fu, co, Hg, H, K=K, V=V, BT=BT, BC=bc, PLAN=with_plan,
                                                   SKIP_EXACT=skip, FACTORED=int(factored), num_warps=NUM_WARPS,
                                                   num_stages=NUM_STAGES)
    if P > 1:
        pairs = n_seg * H
        listed = torch.empty(pairs, dtype=torch.int32, device=dev)
        count = torch.empty(1, dtype=torch.int32, device=dev)
        _compact[(1,)](plan, roles, listed, count, pairs, H, BLOCK=min(1024, triton.next_power_of_2(pairs)))
        pm = torch.empty(pairs, P, K, K, dtype=torch.float32, device=dev)  # sized for every pair exact
        pr = torch.empty(pairs, P, K, V, dtype=torch.float32, device=dev) if need_r else pm
        _forward_pieces[(_persistent_programs(dev, pairs * P * (ncol // bc)),)](
            k, v, a, g, b, cu, listed, count, pm, pr, Hg, H, K=K, V=V, BT=BT, BC=bc, P=P, NCOL=ncol // bc,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES)
        cb = min(COMPOSE_CB, K, V)
        _compose_forward[(_persistent_programs(dev, pairs * (ncol // cb)),)](
            listed, count, roles, pm, pr, M, M if R is None else R, H, K=K, V=V, P=P, CB=cb, NCOL=ncol // cb,
            num_warps=COMPOSE_WARPS, num_stages=COMPOSE_STAGES)
    if need_d and not fork:
        _backward_maps[(n_seg * H, V // bc)](q, k, a, g, b, do, cu, D, plan, roles, fw, fx, co,
                                             float(seg_call.scale), Hg, H, K=K, V=V, BT=BT, BC=bc, PLAN=with_plan,
                                             SKIP_EXACT=skip, FACTORED=int(factored), CROSS=CROSS,
                                             num_warps=NUM_WARPS, num_stages=NUM_STAGES)
        if P > 1:
            pd = torch.empty(pairs, P, K, V, dtype=torch.float32, device=dev)
            _backward_pieces[(_persistent_programs(dev, pairs * P * (V // bc)),)](
                q, k, a, g, b, do, cu, listed, count, pd, float(seg_call.scale), Hg, H, K=K, V=V, BT=BT, BC=bc, P=P,
                NCOL=V // bc, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
            _compose_backward[(_persistent_programs(dev, pairs * (V // cb)),)](
                listed, count, roles, pm, pd, D, H, K=K, V=V, P=P, CB=cb, NCOL=V // cb,
                num_warps=COMPOSE_WARPS, num_stages=COMPOSE_STAGES)
    return M, R, D


def _tma_maps(seg_call, plan, roles, with_plan, need_r, need_d, need_m, M, R, D, fw, fu, fx, fkd, co, g, cu, do, bc):
    """`_maps`' walks on the factors with TMA (`use_tma_walks`), the backward one beside the
    forward one as there."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    K, V, H, Hg, BT = seg_call.K, seg_call.V, seg_call.H, seg_call.Hg, seg_call.chunk_size
    dev = seg_call.q.device
    n_seg = seg_call.N

    def tiles(x, cols, block_rows):
        return TensorDescriptor.from_tensor(x.view(-1, cols), [block_rows, cols])

    w_desc, kd_desc = tiles(fw, K, BT), tiles(fkd, K, BT)
    walk_forward = need_m or need_r
    fork = walk_forward and need_d and concurrent_walks(dev)
    with _beside(dev, fork) as beside:
        if need_d:
            with beside():
                _tma_backward_maps[(n_seg * H, V // bc)](kd_desc, w_desc, tiles(fx, K, BT), do, g, cu, D, plan, roles,
                                                         co, Hg, H, K=K, V=V, BT=BT, BC=bc, PLAN=with_plan,
                                                         STAGES=TMA_STAGES, CROSS=CROSS, num_warps=NUM_WARPS)
        if walk_forward:
            ut_desc = tiles(fu, BT, bc) if need_r else w_desc
            ncol = K + V if need_r else K
            _tma_forward_maps[(n_seg * H, ncol // bc)](w_desc, kd_desc, ut_desc, g, cu, M, M if R is None else R, plan,
                                                       roles, co, Hg, H, K=K, V=V, BT=BT, BC=bc, PLAN=with_plan,
                                                       NEED_R=int(need_r), STAGES=TMA_STAGES, num_warps=NUM_WARPS)
    return M, R, D


def segment_states(seg_call, init: torch.Tensor, state_v_first: bool = False) -> torch.Tensor:
    """Every chunk-start state of a call (the split's: the segments as one varlen call) from each
    sequence's start state `init` (`[N, H, K, V]`, fp32, K x V): the contract's `h`, `[B, NT,
    H, K, V]` (`[B, NT, H, V, K]` with `state_v_first`) in q's dtype, for pass 3 (so its
    backend takes `h` given instead of recomputing the states with fla's stages 1-2). One
    launch."""
    from gdr_dispatch.contract import chunk_counts
    from gdr_dispatch.graph_safe import device_constant

    K, V, H, Hg, BT = seg_call.K, seg_call.V, seg_call.H, seg_call.Hg, seg_call.chunk_size
    why = _call_reason(K, V, seg_call.q.dtype, BT)
    if why:
        raise ValueError(f"segment_states: {why}")
    counts = chunk_counts(seg_call.seq_lens, BT)
    dev = seg_call.q.device
    starts = device_constant(tuple([0] + list(itertools.accumulate(counts))[:-1]), torch.int32, dev)
    if seg_call.cu_seqlens is None:  # B sequences of T tokens, laid out one after another
        cu = device_constant(tuple(itertools.accumulate([0] + list(seg_call.seq_lens))), torch.int32, dev)
    else:
        cu = seg_call.cu_seqlens.to(torch.int32).contiguous()
    bc = min(BC, K, V)
    h = torch.empty((seg_call.B, sum(counts) // seg_call.B, H) + ((V, K) if state_v_first else (K, V)),
                    dtype=seg_call.q.dtype, device=dev)
    k, v, a = (x.contiguous() for x in (seg_call.k, seg_call.v, seg_call.a))
    _forward_states[(seg_call.N * H, V // bc)](k, v, a, seg_call.g.float().contiguous(), seg_call.b.contiguous(), cu,
                                               starts, init.float().contiguous(), h, Hg, H, K=K, V=V, BT=BT, BC=bc,
                                               V_FIRST=state_v_first, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return h
