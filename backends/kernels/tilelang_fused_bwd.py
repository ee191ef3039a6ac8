"""The fused GDR backward given `h`, in TileLang: one CTA per (sequence, value head).

Seed 000's design (FlashQLA, sm90) in its plainest form, before any warp specialisation:
each CTA walks its sequence's chunks from last to first with the state gradient `dh`
(`[K, V]` fp32) resident in registers, and per chunk does stages 3-6 of the chain
(docs/contract.md) plus the reverse cumsum of `dg`:

    forward recompute   Ag = Gam * a,  W = Ag (b e^G K),  v_new = Ag (b V) - W h
    dU                  scale (Gam * Q K^T)^T dO + (K e^{G_L - G}) dh
    dh <- e^{G_L} dh + scale (Q e^G)^T dO - W^T dU          (the next, earlier chunk's dS')
    stage 5             dq, dk (state and intra parts), dw = -dU h^T, the O and S' terms of dG
    stage 6             dAg, through Ag = M^-1: dk, dv, db, dG
    epilogue            dG_L to the last row, reverse cumsum -> dg w.r.t. the raw gate

Every call is laid out as packed sequences (`cu_seqlens`; a fixed-length batch is B
sequences of T tokens), so one compiled kernel serves both. dq/dk are written per value
head in fp32; the launcher reduces them over the heads that share a q/k head.

Shared memory: seven `[64, 128]` tiles, two `[128, 128]` (h and a 16-bit copy of dh) and
three `[64, 64]`, plus TileLang's reduction workspace: about 219 KiB of the H200's 227 KiB
per block (v is re-read from global/L2 where needed), hence K = V = 128 and chunk 64 only.
Operands of the `[64, 64]` products (P, ds, dAg, Ag^T dAg, dkk) are rounded to the input
dtype for the tensor cores, as fla and FlashQLA do. Every load, wgmma and reduction of a
chunk runs one after another behind block-wide barriers; where its time goes and what
the warp-specialised version must change: docs/measurements.md.
tests/fused_kernel_emulation.py is this kernel transcribed into torch.
"""


import functools

import tilelang
import tilelang.language as T

from .tilelang_common import cta_sequence
from .tilelang_launch import launch_packed, tl_dtype


@functools.lru_cache(maxsize=None)
def build_fused_bwd(H: int, Hg: int, K: int, V: int, BT: int, scale: float, dtype: str, h_dtype: str,
                    b_dtype: str, threads: int = 256):
    """Compile (once per configuration) the kernel; returns the TileLang kernel object.

    Optional inputs and layouts are not compile-time switches (a `dht` of zeros stands for
    none, `dh0` is always written, `state_v_first` states are transposed by the launcher):
    each TileLang compile costs 30-40 s, so fewer variants mean fewer first-call stalls.
    """
    accum = "float32"
    TT = T.dynamic("num_tokens")
    NC = T.dynamic("num_chunks")
    N = T.dynamic("num_seqs")
    NP1 = T.dynamic("num_seqs_plus_1")
    state = (K, V)
    G_ = H // Hg

    @tilelang.jit(target={"kind": "cuda", "arch": "sm_90a"}, out_idx=None)
    def kernel_factory():
        @T.prim_func
        def fused_gdr_bwd(
            q: T.Tensor((TT, Hg, K), dtype),
            k: T.Tensor((TT, Hg, K), dtype),
            v: T.Tensor((TT, H, V), dtype),
            do: T.Tensor((TT, H, V), dtype),
            a: T.Tensor((TT, H, BT), dtype),
            g: T.Tensor((TT, H), accum),
            b: T.Tensor((TT, H), b_dtype),
            h: T.Tensor((NC, H) + state, h_dtype),
            dht: T.Tensor((N, H) + state, accum),
            cu_seqlens: T.Tensor((NP1,), "int32"),
            chunk_offsets: T.Tensor((NP1,), "int32"),
            dq: T.Tensor((TT, H, K), accum),
            dk: T.Tensor((TT, H, K), accum),
            dv: T.Tensor((TT, H, V), dtype),
            dg: T.Tensor((TT, H), accum),
            db: T.Tensor((TT, H), accum),
            dh0: T.Tensor((N, H) + state, accum),
        ):
            with T.Kernel(N * H, threads=threads) as bx:
                n, hh, hg, bos, eos, n_chunks, c0 = cta_sequence(bx, H, G_, cu_seqlens, chunk_offsets, BT)

                q_s = T.alloc_shared((BT, K), dtype)
                k_s = T.alloc_shared((BT, K), dtype)
                do_s = T.alloc_shared((BT, V), dtype)
                w_s = T.alloc_shared((BT, K), dtype)  # W, then -W, then dw
                vn_s = T.alloc_shared((BT, V), dtype)  # b V, then v_new, then b V again
                du_s = T.alloc_shared((BT, V), dtype)
                kx_s = T.alloc_shared((BT, K), dtype)  # K scaled per row: b e^G, e^{G_L - G}, scale e^G Q
                h_s = T.alloc_shared((K, V), dtype)
                dh_s = T.alloc_shared((K, V), dtype)
                ag_s = T.alloc_shared((BT, BT), dtype)
                t1_s = T.alloc_shared((BT, BT), dtype)  # P = scale Gam*QK^T, then dAg, then dkk
                t2_s = T.alloc_shared((BT, BT), dtype)  # ds * Gam * scale, then Ag^T dAg
                G_s = T.alloc_shared((BT,), accum)
                b_s = T.alloc_shared((BT,), accum)
                dG_s = T.alloc_shared((BT,), accum)
                db_s = T.alloc_shared((BT,), accum)
                hdh_s = T.alloc_shared((K,), accum)

                dh_f = T.alloc_fragment((K, V), accum)  # [K, V] inside whatever the layout outside
                kv_f = T.alloc_fragment((K, V), accum)
                gam_f = T.alloc_fragment((BT, BT), accum)
                sq_f = T.alloc_fragment((BT, BT), accum)  # square scratch
                sq2_f = T.alloc_fragment((BT, BT), accum)
                big_f = T.alloc_fragment((BT, K), accum)  # [BT, 128] scratch
                big2_f = T.alloc_fragment((BT, K), accum)
                dk_f = T.alloc_fragment((BT, K), accum)
                # one reduction target per reduction: a fragment's layout follows its source
                r_dsqk = T.alloc_fragment((BT,), accum)
                c_dsqk = T.alloc_fragment((BT,), accum)
                r_dq = T.alloc_fragment((BT,), accum)
                r_dk = T.alloc_fragment((BT,), accum)
                r_kdkb = T.alloc_fragment((BT,), accum)
                r_last = T.alloc_fragment((BT,), accum)
                r_vdvb = T.alloc_fragment((BT,), accum)
                r_dmp = T.alloc_fragment((BT,), accum)
                r_dpp = T.alloc_fragment((BT,), accum)
                c_dpp = T.alloc_fragment((BT,), accum)
                r_cum = T.alloc_fragment((BT,), accum)
                hdh_f = T.alloc_fragment((K,), accum)
                hdh_b = T.alloc_fragment((BT, K), accum)
                hdh_tot = T.alloc_fragment((BT,), accum)

                T.copy(dht[n, hh, :, :], dh_f)

                for ci in T.serial(n_chunks):
                    c = n_chunks - 1 - ci
                    t0 = bos + c * BT
                    L = T.min(BT, eos - t0)
                    # ---- loads (rows past the sequence's end read as 0) ----
                    for i, j in T.Parallel(BT, K):
                        q_s[i, j] = T.if_then_else(i < L, q[t0 + i, hg, j], T.cast(0, dtype))
                        k_s[i, j] = T.if_then_else(i < L, k[t0 + i, hg, j], T.cast(0, dtype))
                    for i, j in T.Parallel(BT, V):
                        do_s[i, j] = T.if_then_else(i < L, do[t0 + i, hh, j], T.cast(0, dtype))
                    for i in T.Parallel(BT):
                        G_s[i] = T.if_then_else(i < L, g[t0 + i, hh], T.cast(0, accum))
                        b_s[i] = T.if_then_else(i < L, T.cast(b[t0 + i, hh], accum), T.cast(0, accum))
                    for i, j in T.Parallel(K, V):
                        h_s[i, j] = T.cast(h[c0 + c, hh, i, j], dtype)
                        dh_s[i, j] = T.cast(dh_f[i, j], dtype)
                    g_last = G_s[L - 1]

                    # ---- Gam, Ag = Gam * a ----
                    for i, j in T.Parallel(BT, BT):
                        gam_f[i, j] = T.if_then_else((j <= i) and (i < L), T.exp(G_s[i] - G_s[j]), T.cast(0, accum))
                    for i, j in T.Parallel(BT, BT):
                        ag_s[i, j] = T.cast(gam_f[i, j] * T.if_then_else((i < L) and (j < L),
                                                                          T.cast(a[t0 + i, hh, j], accum),
                                                                          T.cast(0, accum)), dtype)
                    # ---- forward recompute: W = Ag (b e^G K), v_new = Ag (b V) - W h ----
                    for i, j in T.Parallel(BT, K):
                        kx_s[i, j] = T.cast(T.cast(k_s[i, j], accum) * b_s[i] * T.exp(G_s[i]), dtype)
                    T.gemm(ag_s, kx_s, big_f, clear_accum=True)
                    T.copy(big_f, w_s)
                    # v is read from global (L2) where needed rather than kept in shared memory
                    for i, j in T.Parallel(BT, V):
                        vn_s[i, j] = T.if_then_else(i < L, T.cast(T.cast(v[t0 + i, hh, j], accum) * b_s[i], dtype),
                                                    T.cast(0, dtype))
                    T.gemm(ag_s, vn_s, big_f, clear_accum=True)  # U0
                    T.gemm(w_s, h_s, big2_f, clear_accum=True)  # W h
                    for i, j in T.Parallel(BT, V):
                        vn_s[i, j] = T.cast(big_f[i, j] - big2_f[i, j], dtype)

                    # ---- dU = scale (Gam*QK^T)^T dO + (K e^{G_L - G}) dh ----
                    T.gemm(q_s, k_s, sq_f, transpose_B=True, clear_accum=True)  # QK^T, kept for dG
                    for i, j in T.Parallel(BT, BT):
                        t1_s[i, j] = T.cast(scale * gam_f[i, j] * sq_f[i, j], dtype)
                    for i, j in T.Parallel(BT, K):
                        kx_s[i, j] = T.cast(T.cast(k_s[i, j], accum)
                                            * T.if_then_else(i < L, T.exp(g_last - G_s[i]), T.cast(0, accum)), dtype)
                    T.gemm(t1_s, do_s, big_f, transpose_A=True, clear_accum=True)
                    T.gemm(kx_s, dh_s, big_f)
                    T.copy(big_f, du_s)

                    # ---- <h, dh> for dG_L, then dh <- e^{G_L} dh + scale (Q e^G)^T dO - W^T dU ----
                    for i, j in T.Parallel(K, V):
                        kv_f[i, j] = dh_f[i, j] * T.cast(h_s[i, j], accum)
                    T.reduce_sum(kv_f, hdh_f, dim=1)
                    for i in T.Parallel(K):
                        hdh_s[i] = hdh_f[i]  # through shared: a fragment broadcast has no layout
                    for i, j in T.Parallel(BT, K):
                        hdh_b[i, j] = hdh_s[j]
                    T.reduce_sum(hdh_b, hdh_tot, dim=1)  # every row holds <h, dh>
                    for i, j in T.Parallel(BT, K):
                        kx_s[i, j] = T.cast(scale * T.cast(q_s[i, j], accum) * T.exp(G_s[i]), dtype)
                    for i, j in T.Parallel(BT, K):
                        w_s[i, j] = -w_s[i, j]
                    for i, j in T.Parallel(K, V):
                        dh_f[i, j] = dh_f[i, j] * T.exp(g_last)
                    T.gemm(kx_s, do_s, dh_f, transpose_A=True)
                    T.gemm(w_s, du_s, dh_f, transpose_A=True)

                    # ---- stage 5 ----
                    T.gemm(do_s, vn_s, sq2_f, transpose_B=True, clear_accum=True)  # dO v_new^T
                    for i, j in T.Parallel(BT, BT):
                        sq2_f[i, j] = scale * sq2_f[i, j] * gam_f[i, j]  # ds_g
                        t2_s[i, j] = T.cast(sq2_f[i, j], dtype)
                    for i, j in T.Parallel(BT, BT):
                        sq_f[i, j] = sq2_f[i, j] * sq_f[i, j]  # ds_g * QK^T
                    T.reduce_sum(sq_f, r_dsqk, dim=1)
                    T.reduce_sum(sq_f, c_dsqk, dim=0)
                    # one fragment per loop: row and column reductions have different layouts
                    for i in T.Parallel(BT):
                        dG_s[i] = r_dsqk[i]
                    for i in T.Parallel(BT):
                        dG_s[i] = dG_s[i] - c_dsqk[i]
                    # dq = scale e^G dO h^T + ds_g K
                    T.gemm(do_s, h_s, big_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(BT, K):
                        big_f[i, j] = big_f[i, j] * scale * T.if_then_else(i < L, T.exp(G_s[i]), T.cast(0, accum))
                        big2_f[i, j] = big_f[i, j] * T.cast(q_s[i, j], accum)
                    T.reduce_sum(big2_f, r_dq, dim=1)
                    for i in T.Parallel(BT):
                        dG_s[i] = dG_s[i] + r_dq[i]
                    T.gemm(t2_s, k_s, big_f)
                    for i, j in T.Parallel(BT, K):
                        if i < L:
                            dq[t0 + i, hh, j] = big_f[i, j]
                    # dk = e^{G_L - G} v_new dh_old^T + ds_g^T Q
                    T.gemm(vn_s, dh_s, dk_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(BT, K):
                        dk_f[i, j] = dk_f[i, j] * T.if_then_else(i < L, T.exp(g_last - G_s[i]), T.cast(0, accum))
                        big2_f[i, j] = dk_f[i, j] * T.cast(k_s[i, j], accum)
                    T.reduce_sum(big2_f, r_dk, dim=1)
                    for i in T.Parallel(BT):
                        dG_s[i] = dG_s[i] - r_dk[i]
                        db_s[i] = r_dk[i]  # parked: the sum of these rows goes to dG_L
                    T.gemm(t2_s, q_s, dk_f, transpose_A=True)
                    # dw = -dU h^T
                    T.gemm(du_s, h_s, big_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(BT, K):
                        w_s[i, j] = T.cast(-big_f[i, j], dtype)

                    # ---- stage 6 ----
                    for i, j in T.Parallel(BT, K):
                        kx_s[i, j] = T.cast(T.cast(k_s[i, j], accum) * b_s[i] * T.exp(G_s[i]), dtype)
                    for i, j in T.Parallel(BT, V):
                        vn_s[i, j] = T.if_then_else(i < L, T.cast(T.cast(v[t0 + i, hh, j], accum) * b_s[i], dtype),
                                                    T.cast(0, dtype))
                    T.gemm(w_s, kx_s, sq_f, transpose_B=True, clear_accum=True)
                    T.gemm(du_s, vn_s, sq_f, transpose_B=True)  # dAg
                    T.copy(sq_f, t1_s)
                    # dkb = Ag^T dw
                    T.gemm(ag_s, w_s, big_f, transpose_A=True, clear_accum=True)
                    for i, j in T.Parallel(BT, K):
                        big2_f[i, j] = big_f[i, j] * T.cast(k_s[i, j], accum)
                        dk_f[i, j] = dk_f[i, j] + big_f[i, j] * b_s[i] * T.exp(G_s[i])
                    T.reduce_sum(big2_f, r_kdkb, dim=1)  # rows of K * dkb
                    # dG_L, parked in db_s, is summed before db_s is reused
                    for i, j in T.Parallel(BT, BT):
                        sq2_f[i, j] = db_s[j]
                    T.reduce_sum(sq2_f, r_last, dim=1)  # every row: the sum over the chunk
                    for i in T.Parallel(BT):
                        dG_s[i] = dG_s[i] + b_s[i] * T.exp(G_s[i]) * r_kdkb[i]
                        db_s[i] = T.exp(G_s[i]) * r_kdkb[i]
                    for i in T.Parallel(BT):
                        if i == L - 1:
                            dG_s[i] = dG_s[i] + r_last[i]
                    for i in T.Parallel(BT):
                        if i == L - 1:
                            dG_s[i] = dG_s[i] + T.exp(g_last) * hdh_tot[i]
                    # dvb = Ag^T dU; dv = b dvb; db += rows of V * dvb
                    T.gemm(ag_s, du_s, big_f, transpose_A=True, clear_accum=True)
                    for i, j in T.Parallel(BT, V):
                        big2_f[i, j] = big_f[i, j] * T.if_then_else(i < L, T.cast(v[t0 + i, hh, j], accum),
                                                                    T.cast(0, accum))
                        if i < L:
                            dv[t0 + i, hh, j] = T.cast(big_f[i, j] * b_s[i], dtype)
                    T.reduce_sum(big2_f, r_vdvb, dim=1)
                    for i in T.Parallel(BT):
                        db_s[i] = db_s[i] + r_vdvb[i]
                    # through Ag = M^-1: dM = -Ag^T dAg Ag^T (strict lower)
                    T.gemm(ag_s, t1_s, sq2_f, transpose_A=True, clear_accum=True)
                    T.copy(sq2_f, t2_s)
                    T.gemm(t2_s, ag_s, sq2_f, transpose_B=True, clear_accum=True)
                    T.gemm(k_s, k_s, sq_f, transpose_B=True, clear_accum=True)  # K K^T
                    for i, j in T.Parallel(BT, BT):
                        sq2_f[i, j] = T.if_then_else((j < i) and (i < L), -sq2_f[i, j], T.cast(0, accum))  # dM
                        sq_f[i, j] = T.if_then_else(j < i, sq_f[i, j] * gam_f[i, j], T.cast(0, accum))  # P
                    for i, j in T.Parallel(BT, BT):
                        sq_f[i, j] = sq2_f[i, j] * sq_f[i, j]  # dM * P
                    T.reduce_sum(sq_f, r_dmp, dim=1)
                    for i in T.Parallel(BT):
                        db_s[i] = db_s[i] + r_dmp[i]
                    for i, j in T.Parallel(BT, BT):
                        sq_f[i, j] = sq_f[i, j] * b_s[i]  # dP * P
                        t1_s[i, j] = T.cast(sq2_f[i, j] * b_s[i] * gam_f[i, j], dtype)  # dkk
                    T.reduce_sum(sq_f, r_dpp, dim=1)
                    T.reduce_sum(sq_f, c_dpp, dim=0)
                    for i in T.Parallel(BT):
                        dG_s[i] = dG_s[i] + r_dpp[i]
                    for i in T.Parallel(BT):
                        dG_s[i] = dG_s[i] - c_dpp[i]
                    T.gemm(t1_s, k_s, dk_f)
                    T.gemm(t1_s, k_s, dk_f, transpose_A=True)
                    for i, j in T.Parallel(BT, K):
                        if i < L:
                            dk[t0 + i, hh, j] = dk_f[i, j]

                    # ---- epilogue: reverse cumsum of dG inside the chunk ----
                    for i, j in T.Parallel(BT, BT):
                        sq_f[i, j] = T.if_then_else((j >= i) and (j < L), dG_s[j], T.cast(0, accum))
                    T.reduce_sum(sq_f, r_cum, dim=1)
                    for i in T.Parallel(BT):
                        if i < L:
                            dg[t0 + i, hh] = r_cum[i]
                            db[t0 + i, hh] = db_s[i]

                T.copy(dh_f, dh0[n, hh, :, :])

        return fused_gdr_bwd

    return kernel_factory()


def fused_config(q, v, b, h_dtype, scale: float, chunk_size: int) -> tuple:
    """`build_fused_bwd`'s arguments for a call: one source for the launcher and for
    precompile jobs (backends' `compile_jobs`)."""
    H, Hg, K, V = v.shape[2], q.shape[2], q.shape[3], v.shape[3]
    return (H, Hg, K, V, chunk_size, float(scale), tl_dtype(q.dtype), tl_dtype(h_dtype), tl_dtype(b.dtype))


def fused_bwd_given_h(q, k, v, do, a, g, b, h, dht, scale: float, seq_lens, chunk_size: int = 64,
                      cu_seqlens=None, has_h0: bool = False, state_v_first: bool = False):
    """Run the fused kernel; returns `(dq, dk, dv, dg, db, dh0)` in the contract's form.

    The calling convention (packed sequences, dq/dk per value head in fp32) is
    `tilelang_launch.launch_packed`'s.
    """
    import torch

    kern = build_fused_bwd(*fused_config(q, v, b, h.dtype, scale, chunk_size))
    return launch_packed(kern, q, k, v, do, a, g, b, h, dht, seq_lens, chunk_size, cu_seqlens, has_h0,
                         state_v_first, dq_dtype=torch.float32, db_dtype=torch.float32)
