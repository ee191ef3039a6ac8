"""Stages 5 + 6 of the chain fused at full K ("wide"), for the GDR's scalar gate.

fla runs `chunk_bwd_dqkwg` (stage 5, which walks K in slabs of BK and re-reads the V-shaped
tiles once per slab) and then `prepare_wy_repr_bwd` (stage 6), which reads the same chunk
tiles again (docs/contract.md). Here one program per (chunk, batch x value head) reads each
V-shaped tile once, keeps the three `[BT, K]` accumulators (`dO h^T`, `v_new dh^T`,
`dU h^T`) at full K, and finishes both stages and the reverse chunk-local cumsum of `dg`
in its epilogue (the cumsum never leaves the chunk). Seed 004's `bwd_wy.py` did the same for
KDA's per-channel gate; GDR's gate is one scalar per token, so the epilogue is simpler.

It works in the contract's conventions (natural-log `G`, *ungated* `a`; the gated inverse
`Gam * a` is made in registers), so it needs none of fla's conversions. Its inputs are the
products of stages 1-4, which carry no convention: `v_new`, `dU` (fla's `dv` after stage
4), and `dh`, the gradient w.r.t. each chunk's end state.

Hopper + Triton [3.4, 3.7.1) miscompiles `tl.dot(tl.trans(acc), ...)` when `acc` comes
from another `tl.dot` (fla issue 640): no dot here takes a transposed accumulator; `X^T Y`
with `X` from a dot is `tl.trans(tl.dot(tl.trans(Y), X))`. Registers, spills and timings on
the H200: docs/kernels.md.

Outputs are stored, never accumulated into (autotuning re-runs kernels): `dq`/`dk` per
value head in fp32 when heads are grouped, reduced by the launcher (`reduce_value_heads`).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from gdr_dispatch.contract import reduce_value_heads

from .chunk_grid import chunk_bounds, chunk_gate_scalars, decay_to_chunk_end, masked_exp, state_strides


@triton.jit(do_not_specialize=["T"])
def wy_dqkg_wide_kernel(
    q, k, v, v_new, du, do, a, g, b, h, dh,
    dq, dk, dv, db, dg,
    cu_seqlens, chunk_indices, scale, T, NT,
    H: tl.constexpr, Hg: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, STATE_V_FIRST: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hg = i_h // (H // Hg)
    i_chunk = (i_b * NT + i_t).to(tl.int64)  # row of h/dh (varlen: B == 1, rows in chunk order)
    i_t, bos, T = chunk_bounds(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)

    o_t = tl.arange(0, BT)
    rows = i_t * BT + o_t
    m_t = rows < T
    n_valid = tl.minimum(T - i_t * BT, BT)
    o_k = tl.arange(0, K)
    lower = (o_t[None, :] <= o_t[:, None]) & m_t[:, None] & m_t[None, :]
    strict = (o_t[None, :] < o_t[:, None]) & m_t[:, None] & m_t[None, :]

    # per-token scalars of this chunk and head
    G, beta, eG = chunk_gate_scalars(g, b, bos, rows, m_t, i_h, H)
    g_last, decay_to_end = decay_to_chunk_end(G, o_t, m_t, n_valid)
    gam = masked_exp(G[:, None] - G[None, :], lower)
    A = tl.load(a + ((bos + rows[:, None]) * H + i_h) * BT + o_t[None, :], mask=m_t[:, None] & m_t[None, :],
                other=0.0).to(tl.float32)
    Ag = gam * A  # the gated WY inverse
    AgT = tl.trans(Ag)  # transposed from an elementwise value, not from a dot

    s_k, s_v = state_strides(K, V, STATE_V_FIRST)
    h_base = h + (i_chunk * H + i_h) * K * V
    dh_base = dh + (i_chunk * H + i_h) * K * V

    ds = tl.zeros([BT, BT], dtype=tl.float32)  # dO v_new^T
    dAg = tl.zeros([BT, BT], dtype=tl.float32)  # dU (b V)^T, the v part of d(Ag)
    acc_q = tl.zeros([BT, K], dtype=tl.float32)  # dO h^T
    acc_k = tl.zeros([BT, K], dtype=tl.float32)  # v_new dh^T
    acc_w = tl.zeros([BT, K], dtype=tl.float32)  # dU h^T  (dw = -acc_w)
    db_v = tl.zeros([BT], dtype=tl.float32)
    h_dh = tl.zeros([K], dtype=tl.float32)  # <h, dh> per row of the state, summed at the end
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        tok_v = ((bos + rows[:, None]) * H + i_h) * V + o_v[None, :]
        b_do = tl.load(do + tok_v, mask=m_tv, other=0.0)
        b_vn = tl.load(v_new + tok_v, mask=m_tv, other=0.0)
        b_du = tl.load(du + tok_v, mask=m_tv, other=0.0)
        b_v = tl.load(v + tok_v, mask=m_tv, other=0.0).to(tl.float32)
        st = o_k[:, None] * s_k + o_v[None, :] * s_v
        b_h32 = tl.load(h_base + st, mask=m_v[None, :], other=0.0).to(tl.float32)  # [K, BV]
        b_dh32 = tl.load(dh_base + st, mask=m_v[None, :], other=0.0).to(tl.float32)
        b_h = b_h32.to(b_do.dtype)

        ds += tl.dot(b_do, tl.trans(b_vn.to(b_do.dtype)))
        acc_q += tl.dot(b_do, tl.trans(b_h))
        acc_k += tl.dot(b_vn.to(b_do.dtype), tl.trans(b_dh32.to(b_do.dtype)))
        acc_w += tl.dot(b_du.to(b_do.dtype), tl.trans(b_h))
        b_vb = b_v * beta[:, None]
        dAg += tl.dot(b_du.to(b_do.dtype), tl.trans(b_vb.to(b_do.dtype)))
        b_dvb = tl.dot(AgT.to(b_do.dtype), b_du.to(b_do.dtype))  # Ag^T dU
        tl.store(dv + tok_v, (b_dvb * beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        db_v += tl.sum(b_v * b_dvb, axis=1)
        h_dh += tl.sum(b_h32 * b_dh32, axis=1)

    # the K-wide epilogue: stage 5, then stage 6
    tok_k = ((bos + rows[:, None]) * Hg + i_hg) * K + o_k[None, :]
    b_q = tl.load(q + tok_k, mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + tok_k, mask=m_t[:, None], other=0.0)
    qk = tl.dot(b_q, tl.trans(b_k))
    kk = tl.dot(b_k, tl.trans(b_k))
    b_qf = b_q.to(tl.float32)
    b_kf = b_k.to(tl.float32)

    ds_g = scale * ds * gam
    dq_inter = (scale * eG)[:, None] * acc_q
    b_dq = dq_inter + tl.dot(ds_g.to(b_k.dtype), b_k)
    dk_state = decay_to_end[:, None] * acc_k
    b_dk = dk_state + tl.trans(tl.dot(tl.trans(b_q), ds_g.to(b_q.dtype)))  # ds_g^T q
    dsq = ds_g * qk
    dG = tl.sum(dq_inter * b_qf, axis=1) + tl.sum(dsq, axis=1) - tl.sum(dsq, axis=0) - tl.sum(dk_state * b_kf, axis=1)
    dG_last = tl.sum(tl.sum(dk_state * b_kf, axis=1), axis=0)

    dw = -acc_w
    bg = beta * eG
    kb = b_kf * bg[:, None]
    dAg += tl.dot(dw.to(b_k.dtype), tl.trans(kb.to(b_k.dtype)))
    dkb = tl.dot(AgT.to(b_k.dtype), dw.to(b_k.dtype))  # Ag^T dw
    kdkb = tl.sum(b_kf * dkb, axis=1)
    b_db = db_v + eG * kdkb
    dG += bg * kdkb
    b_dk += dkb * bg[:, None]

    # through the WY inverse: Ag = M^-1, dM = -Ag^T dAg Ag^T on the strict lower triangle
    x = tl.dot(AgT, dAg)
    dM = -tl.dot(x, AgT)
    dM = tl.where(strict, dM, 0.0)
    P = tl.where(strict, kk * gam, 0.0)
    b_db += tl.sum(dM * P, axis=1)
    dP = dM * beta[:, None]
    dkk = dP * gam
    b_dk += tl.dot(dkk.to(b_k.dtype), b_k) + tl.trans(tl.dot(tl.trans(b_k), dkk.to(b_k.dtype)))  # dkk k + dkk^T k
    dPP = dP * P
    dG += tl.sum(dPP, axis=1) - tl.sum(dPP, axis=0)

    # G_L's gradient goes to the last valid row; then dg w.r.t. the raw gate: reverse cumsum
    dG_last += tl.exp(g_last) * tl.sum(h_dh, axis=0)
    dG += tl.where(o_t == n_valid - 1, dG_last, 0.0)
    dG = tl.where(m_t, dG, 0.0)
    b_dg = tl.sum(tl.where(o_t[None, :] >= o_t[:, None], dG[None, :], 0.0), axis=1)

    tok_hk = ((bos + rows[:, None]) * H + i_h) * K + o_k[None, :]
    tl.store(dq + tok_hk, b_dq.to(dq.dtype.element_ty), mask=m_t[:, None])
    tl.store(dk + tok_hk, b_dk.to(dk.dtype.element_ty), mask=m_t[:, None])
    tl.store(db + (bos + rows) * H + i_h, b_db.to(db.dtype.element_ty), mask=m_t)
    tl.store(dg + (bos + rows) * H + i_h, b_dg, mask=m_t)


def wy_dqkg_wide(q, k, v, v_new, du, do, a, g, b, h, dh, scale: float, chunk_size: int = 64,
                 cu_seqlens: Optional[torch.Tensor] = None, chunk_indices: Optional[torch.Tensor] = None,
                 state_v_first: bool = False, BV: int = 64, num_warps: int = 8, num_stages: int = 2):
    """Stages 5 + 6 and the reverse cumsum -> `(dq, dk, dv, db, dg)` in the contract's form.

    q, k `[B, T, Hg, K]`; v, v_new, du, do `[B, T, H, V]`; a `[B, T, H, BT]` ungated; g
    `[B, T, H]` natural-log chunk cumsum; b `[B, T, H]`; h, dh `[B, NT, H, K, V]` (or V, K):
    chunk-start states and the gradients w.r.t. chunk-end states. `dq`/`dk` come back at the
    q/k head count in q's dtype, `dv` in v's, `db` in b's, `dg` fp32 w.r.t. the raw gate.

    BV = 64, 8 warps, 2 stages: the configuration the GPU oracle tests ran (other
    configurations measured on the H200: docs/kernels.md).
    """
    B, T, Hg, K = q.shape
    H, V = v.shape[2], v.shape[3]
    if K & (K - 1) or K < 16:
        raise ValueError(f"wy_dqkg_wide: K must be a power of two >= 16, got {K}")
    tensors = [x.contiguous() for x in (q, k, v, v_new, du, do, a, g, b, h, dh)]
    grouped = H != Hg
    acc_dt = torch.float32 if grouped else q.dtype
    dq = torch.empty(B, T, H, K, dtype=acc_dt, device=q.device)
    dk = torch.empty(B, T, H, K, dtype=acc_dt, device=q.device)
    dv = torch.empty_like(v)
    db = torch.empty_like(b)
    dg = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    NT = h.shape[1]
    grid = (NT if cu_seqlens is None else chunk_indices.shape[0], B * H)
    BV = max(16, min(BV, triton.next_power_of_2(V)))
    wy_dqkg_wide_kernel[grid](
        *tensors, dq, dk, dv, db, dg, cu_seqlens, chunk_indices, scale, T, NT,
        H=H, Hg=Hg, K=K, V=V, BT=chunk_size, BV=BV, IS_VARLEN=cu_seqlens is not None,
        STATE_V_FIRST=state_v_first, num_warps=num_warps, num_stages=num_stages,
    )
    return reduce_value_heads(dq, Hg, q.dtype), reduce_value_heads(dk, Hg, k.dtype), dv, db, dg
