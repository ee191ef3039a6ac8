"""Stages 5 + 6 as a transposed main kernel and a v-side kernel (seed 004's layout, GDR's gate).

The math is `wy_dqkg_wide.py`'s, re-arranged the way seed 004 re-arranged the KDA kernel
around its occupancy walls:

  * main, one program per (chunk, batch x value head): the V loop accumulates TRANSPOSED,
    `dq^T = h dO^T`, `dw^T = h dU^T`, `dk^T = dh v_new^T` (M = K), next to `dO v_new^T` and
    its transpose. At loop exit the raw accumulators are parked in global memory (`dq_buf`,
    `dk_buf` in fp32, `dw` in the input dtype) and the elementwise epilogue runs in K-strips
    of KS rows that re-read them (from L2), so the epilogue never holds a [BT, K] tile.
  * side, launched after main: the v-side work (d(Ag) = dU (b V)^T + dw (b e^G K)^T,
    dv = b Ag^T dU and db's V part) and the chain through the WY inverse (dM, dP, dkk).
    It finishes `dk`, `db` and `dG` on main's partials in place and then takes the reverse
    cumsum of dG, so it must run after main, exactly once: it is never autotuned.

Why that could pay on Blackwell is tmem: the accumulators leave the register file. On the
H200 a wgmma accumulator lives in registers either way, and the pair is slower than the
wide kernel at every grid size measured (docs/kernels.md).

Numerics: the same rounding points as the wide kernel (operands of every dot in the input
dtype, fp32 accumulation). On Hopper + Triton 3.6 the side kernel is wrong with strips of
32 or 64 (or 4 side warps): db and dg land 1-7e-3 off float64; strips of 16 and the whole
K are right (docs/kernels.md). The launcher refuses the wrong settings.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from gdr_dispatch.contract import reduce_value_heads

from .chunk_grid import chunk_bounds, chunk_gate_scalars, decay_to_chunk_end, masked_exp, state_strides


@triton.jit(do_not_specialize=["T"])
def wy_dqkg_t_main_kernel(
    q, k, v_new, du, do, a, g, b, h, dh,
    dq_buf, dk_buf, dw, dG_buf, db_buf,
    cu_seqlens, chunk_indices, scale, T, NT,
    H: tl.constexpr, Hg: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr, IS_VARLEN: tl.constexpr, STATE_V_FIRST: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hg = i_h // (H // Hg)
    i_chunk = (i_b * NT + i_t).to(tl.int64)
    i_t, bos, T = chunk_bounds(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)

    o_t = tl.arange(0, BT)
    rows = i_t * BT + o_t
    m_t = rows < T
    n_valid = tl.minimum(T - i_t * BT, BT)
    o_k = tl.arange(0, K)
    lower = (o_t[None, :] <= o_t[:, None]) & m_t[:, None] & m_t[None, :]  # [t, s]: s <= t
    upper = (o_t[:, None] <= o_t[None, :]) & m_t[:, None] & m_t[None, :]  # [s, t]: the transpose

    G, beta, eG = chunk_gate_scalars(g, b, bos, rows, m_t, i_h, H)
    g_last, decay_to_end = decay_to_chunk_end(G, o_t, m_t, n_valid)

    s_k, s_v = state_strides(K, V, STATE_V_FIRST)
    h_base = h + (i_chunk * H + i_h) * K * V
    dh_base = dh + (i_chunk * H + i_h) * K * V

    acc_qT = tl.zeros([K, BT], dtype=tl.float32)  # h dO^T
    acc_wT = tl.zeros([K, BT], dtype=tl.float32)  # h dU^T   (dw^T = -acc_wT)
    acc_kT = tl.zeros([K, BT], dtype=tl.float32)  # dh v_new^T
    ds = tl.zeros([BT, BT], dtype=tl.float32)  # dO v_new^T
    dsT = tl.zeros([BT, BT], dtype=tl.float32)  # v_new dO^T
    h_dh = tl.zeros([K], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        tok_v = ((bos + rows[:, None]) * H + i_h) * V + o_v[None, :]
        b_do = tl.load(do + tok_v, mask=m_tv, other=0.0)
        dt = b_do.dtype
        b_vn = tl.load(v_new + tok_v, mask=m_tv, other=0.0).to(dt)
        b_du = tl.load(du + tok_v, mask=m_tv, other=0.0).to(dt)
        st = o_k[:, None] * s_k + o_v[None, :] * s_v
        b_h32 = tl.load(h_base + st, mask=m_v[None, :], other=0.0).to(tl.float32)  # [K, BV]
        b_dh32 = tl.load(dh_base + st, mask=m_v[None, :], other=0.0).to(tl.float32)
        b_h = b_h32.to(dt)
        acc_qT += tl.dot(b_h, tl.trans(b_do))
        acc_wT += tl.dot(b_h, tl.trans(b_du))
        acc_kT += tl.dot(b_dh32.to(dt), tl.trans(b_vn))
        ds += tl.dot(b_do, tl.trans(b_vn))
        dsT += tl.dot(b_vn, tl.trans(b_do))
        h_dh += tl.sum(b_h32 * b_dh32, axis=1)

    # park the raw accumulators ([t, k] in memory, k contiguous), then re-read them in strips
    tok_kT = ((bos + rows[None, :]) * H + i_h) * K + o_k[:, None]  # [K, BT] addresses
    m_kT = m_t[None, :]
    tl.store(dq_buf + tok_kT, acc_qT, mask=m_kT)
    tl.store(dk_buf + tok_kT, acc_kT, mask=m_kT)
    tl.store(dw + tok_kT, (-acc_wT).to(dw.dtype.element_ty), mask=m_kT)
    tl.debug_barrier()  # the strips below read what other threads of this program stored

    gam = masked_exp(G[:, None] - G[None, :], lower)
    gamT = masked_exp(G[None, :] - G[:, None], upper)
    A = tl.load(a + ((bos + rows[:, None]) * H + i_h) * BT + o_t[None, :], mask=m_t[:, None] & m_t[None, :],
                other=0.0).to(tl.float32)
    Ag16 = (gam * A).to(dw.dtype.element_ty)
    ds_g = scale * ds * gam
    ds_gT = scale * dsT * gamT
    ds_g16 = ds_g.to(dw.dtype.element_ty)
    ds_gT16 = ds_gT.to(dw.dtype.element_ty)
    bg = beta * eG

    qk = tl.zeros([BT, BT], dtype=tl.float32)
    dG = tl.zeros([BT], dtype=tl.float32)
    kdkb = tl.zeros([BT], dtype=tl.float32)
    dkst_k = tl.zeros([BT], dtype=tl.float32)  # rows of (e^{G_L - G} v_new dh^T) * K
    for i_s in range(K // KS):
        o_s = i_s * KS + tl.arange(0, KS)
        qk_addr = ((bos + rows[None, :]) * Hg + i_hg) * K + o_s[:, None]  # [KS, BT]
        b_qT = tl.load(q + qk_addr, mask=m_kT, other=0.0)
        b_kT = tl.load(k + qk_addr, mask=m_kT, other=0.0)
        s_addr = ((bos + rows[None, :]) * H + i_h) * K + o_s[:, None]
        raw_q = tl.load(dq_buf + s_addr, mask=m_kT, other=0.0)
        raw_k = tl.load(dk_buf + s_addr, mask=m_kT, other=0.0)
        b_dwT = tl.load(dw + s_addr, mask=m_kT, other=0.0)
        qk += tl.dot(tl.trans(b_qT), b_kT)

        dq_inter = (scale * eG)[None, :] * raw_q
        dG += tl.sum(dq_inter * b_qT.to(tl.float32), axis=0)
        b_dqT = dq_inter + tl.dot(b_kT, ds_gT16)  # (ds_g K)^T = K^T ds_g^T
        dkst = decay_to_end[None, :] * raw_k
        dkst_k += tl.sum(dkst * b_kT.to(tl.float32), axis=0)
        dkbT = tl.dot(b_dwT, Ag16)  # (Ag^T dw)^T = dw^T Ag
        kdkb += tl.sum(b_kT.to(tl.float32) * dkbT, axis=0)
        b_dkT = dkst + tl.dot(b_qT, ds_g16) + dkbT * bg[None, :]  # + (ds_g^T Q)^T = Q^T ds_g
        # the strip is overwritten in place: no thread may store before every thread has
        # loaded (the loaded and the stored tiles need not share a layout)
        tl.debug_barrier()
        tl.store(dq_buf + s_addr, b_dqT, mask=m_kT)
        tl.store(dk_buf + s_addr, b_dkT, mask=m_kT)

    dsq = ds_g * qk
    dG += tl.sum(dsq, axis=1) - tl.sum(dsq, axis=0) - dkst_k + bg * kdkb
    dG_last = tl.sum(dkst_k, axis=0) + tl.exp(g_last) * tl.sum(h_dh, axis=0)
    dG += tl.where(o_t == n_valid - 1, dG_last, 0.0)
    tl.store(dG_buf + (bos + rows) * H + i_h, dG, mask=m_t)
    tl.store(db_buf + (bos + rows) * H + i_h, eG * kdkb, mask=m_t)


@triton.jit(do_not_specialize=["T"])
def wy_dqkg_t_side_kernel(
    k, v, du, a, g, b, dw,
    dk_buf, dG_buf, db_buf, dv, db, dg,
    cu_seqlens, chunk_indices, T,
    H: tl.constexpr, Hg: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """The v side and the WY-inverse chain; finishes main's dk, dG and db partials in place."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hg = i_h // (H // Hg)
    i_t, bos, T = chunk_bounds(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)

    o_t = tl.arange(0, BT)
    rows = i_t * BT + o_t
    m_t = rows < T
    lower = (o_t[None, :] <= o_t[:, None]) & m_t[:, None] & m_t[None, :]
    strict = (o_t[None, :] < o_t[:, None]) & m_t[:, None] & m_t[None, :]

    G, beta, eG = chunk_gate_scalars(g, b, bos, rows, m_t, i_h, H)
    gam = masked_exp(G[:, None] - G[None, :], lower)
    A = tl.load(a + ((bos + rows[:, None]) * H + i_h) * BT + o_t[None, :], mask=m_t[:, None] & m_t[None, :],
                other=0.0).to(tl.float32)
    AgT = tl.trans(gam * A)  # transposed from an elementwise value, not from a dot

    dAg = tl.zeros([BT, BT], dtype=tl.float32)
    db_v = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        tok_v = ((bos + rows[:, None]) * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + tok_v, mask=m_tv, other=0.0)
        dt = b_v.dtype
        b_du = tl.load(du + tok_v, mask=m_tv, other=0.0).to(dt)
        b_vf = b_v.to(tl.float32)
        dAg += tl.dot(b_du, tl.trans((b_vf * beta[:, None]).to(dt)))
        b_dvb = tl.dot(AgT.to(dt), b_du)  # Ag^T dU
        tl.store(dv + tok_v, (b_dvb * beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        db_v += tl.sum(b_vf * b_dvb, axis=1)

    # dw (b e^G K)^T and K K^T over K-strips: no [BT, K] tile stays live
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_s in range(K // KS):
        o_s = i_s * KS + tl.arange(0, KS)
        b_ks = tl.load(k + ((bos + rows[:, None]) * Hg + i_hg) * K + o_s[None, :], mask=m_t[:, None], other=0.0)
        dt = b_ks.dtype
        b_dws = tl.load(dw + ((bos + rows[:, None]) * H + i_h) * K + o_s[None, :], mask=m_t[:, None], other=0.0)
        kbs = b_ks.to(tl.float32) * (beta * eG)[:, None]
        dAg += tl.dot(b_dws.to(dt), tl.trans(kbs.to(dt)))
        kk += tl.dot(b_ks, tl.trans(b_ks))

    # through the WY inverse: Ag = M^-1, dM = -Ag^T dAg Ag^T on the strict lower triangle
    dM = -tl.dot(tl.dot(AgT, dAg), AgT)
    dM = tl.where(strict, dM, 0.0)
    P = tl.where(strict, kk * gam, 0.0)
    dP = dM * beta[:, None]
    dkk = dP * gam
    dPP = dP * P
    b_db = tl.load(db_buf + (bos + rows) * H + i_h, mask=m_t, other=0.0) + db_v + tl.sum(dM * P, axis=1)
    dG = tl.load(dG_buf + (bos + rows) * H + i_h, mask=m_t, other=0.0) + tl.sum(dPP, axis=1) - tl.sum(dPP, axis=0)
    dG = tl.where(m_t, dG, 0.0)
    b_dg = tl.sum(tl.where(o_t[None, :] >= o_t[:, None], dG[None, :], 0.0), axis=1)
    # dk += dkk K + dkk^T K, strip by strip, in place on main's partial
    for i_s in range(K // KS):
        o_s = i_s * KS + tl.arange(0, KS)
        b_ks = tl.load(k + ((bos + rows[:, None]) * Hg + i_hg) * K + o_s[None, :], mask=m_t[:, None], other=0.0)
        dt = b_ks.dtype
        addr = ((bos + rows[:, None]) * H + i_h) * K + o_s[None, :]
        b_dks = tl.load(dk_buf + addr, mask=m_t[:, None], other=0.0)
        b_dks += tl.dot(dkk.to(dt), b_ks) + tl.trans(tl.dot(tl.trans(b_ks), dkk.to(dt)))
        tl.debug_barrier()  # in place: every thread has loaded main's partial before any store
        tl.store(dk_buf + addr, b_dks, mask=m_t[:, None])
    tl.store(db + (bos + rows) * H + i_h, b_db.to(db.dtype.element_ty), mask=m_t)
    tl.store(dg + (bos + rows) * H + i_h, b_dg, mask=m_t)


def wy_dqkg_transposed(q, k, v, v_new, du, do, a, g, b, h, dh, scale: float, chunk_size: int = 64,
                       cu_seqlens: Optional[torch.Tensor] = None, chunk_indices: Optional[torch.Tensor] = None,
                       state_v_first: bool = False, BV: int = 32, KS: int = 16, num_warps: int = 8,
                       num_stages: int = 2, side_BV: int = 64, side_KS: Optional[int] = None, side_warps: int = 8,
                       main_maxnreg: Optional[int] = None, side_maxnreg: Optional[int] = None,
                       allow_measured_wrong: bool = False):
    """`wy_dqkg_wide`'s contract (same arguments and returns) through the main + side pair.

    Defaults: main BV 32 with strips of KS = 16, 8 warps, 2 stages; side BV 64 over the
    whole K (side_KS None), 8 warps: the configuration the GPU oracle tests ran (the sweep
    and the measured-wrong settings: docs/kernels.md). Those settings raise unless
    `allow_measured_wrong` (to reproduce the error).
    The side kernel finalises dk, db and dG in place on the main kernel's partials, so the
    pair is launched once per call and never autotuned.
    """
    side_KS = q.shape[-1] if side_KS is None else side_KS
    if not allow_measured_wrong and (side_KS not in (16, q.shape[-1]) or side_warps != 8):
        raise ValueError(
            f"wy_dqkg_transposed: side_KS={side_KS}, side_warps={side_warps}: the side kernel is only "
            f"correct on the H200 with side_KS 16 or K ({q.shape[-1]}) and 8 warps (strips of 32/64 or 4 warps "
            f"put db and dg 1-7e-3 off float64 there, Triton 3.6; docs/kernels.md)")
    B, T, Hg, K = q.shape
    H, V = v.shape[2], v.shape[3]
    if K & (K - 1) or K < 16:
        raise ValueError(f"wy_dqkg_transposed: K must be a power of two >= 16, got {K}")
    KS = min(KS, K)
    q, k, v, v_new, du, do, a, g, b, h, dh = (x.contiguous() for x in (q, k, v, v_new, du, do, a, g, b, h, dh))
    dq = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device)  # parked raw, then final
    dk = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device)  # parked raw, partial, then final
    dw = torch.empty(B, T, H, K, dtype=q.dtype, device=q.device)  # -dU h^T for the side kernel
    dG = torch.empty(B, T, H, dtype=torch.float32, device=q.device)  # main's partial dG (no cumsum)
    db_part = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(v)
    db = torch.empty_like(b)
    dg = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    NT = h.shape[1]
    grid = (NT if cu_seqlens is None else chunk_indices.shape[0], B * H)
    varlen = cu_seqlens is not None
    wy_dqkg_t_main_kernel[grid](
        q, k, v_new, du, do, a, g, b, h, dh, dq, dk, dw, dG, db_part, cu_seqlens, chunk_indices, scale, T, NT,
        H=H, Hg=Hg, K=K, V=V, BT=chunk_size, BV=max(16, min(BV, triton.next_power_of_2(V))), KS=KS,
        IS_VARLEN=varlen, STATE_V_FIRST=state_v_first, num_warps=num_warps, num_stages=num_stages,
        **({} if main_maxnreg is None else {"maxnreg": main_maxnreg}),
    )
    wy_dqkg_t_side_kernel[grid](
        k, v, du, a, g, b, dw, dk, dG, db_part, dv, db, dg, cu_seqlens, chunk_indices, T,
        H=H, Hg=Hg, K=K, V=V, BT=chunk_size, BV=max(16, min(side_BV, triton.next_power_of_2(V))), KS=side_KS,
        IS_VARLEN=varlen, num_warps=side_warps, **({} if side_maxnreg is None else {"maxnreg": side_maxnreg}),
    )
    return reduce_value_heads(dq, Hg, q.dtype), reduce_value_heads(dk, Hg, k.dtype), dv, db, dg
