"""The TileLang fused kernel's algorithm, transcribed step by step into torch.

TileLang kernels cannot run without a GPU. This transcription follows
`backends/kernels/tilelang_fused_bwd.py` statement by statement (same buffers, same order,
same rounding to the input dtype wherever the kernel stores into a 16-bit shared tile), so
on the CPU it checks the kernel's algebra and order, and how far its rounding points move
the result, before any GPU time is spent. What it cannot check is TileLang itself (layouts,
the semantics of `T.gemm`'s transpose flags, synchronisation).
"""

import torch


def emulate_fused_bwd(q, k, v, do, a, g, b, h, dht, scale, seq_lens, BT=64, round_to=None, state_v_first=False):
    """Per-sequence, per-head reverse walk; returns (dq, dk, dv, dg, db, dh0) like the launcher.

    Inputs in the contract's layout (fixed-length batches as B sequences); `round_to` is the
    dtype of the kernel's shared tiles (None: no rounding, fp64 throughout).
    """
    f = torch.float64

    def r(x):  # a store into a 16-bit shared tile
        return x if round_to is None else x.to(round_to).to(f)

    B, T_, Hg, K = q.shape
    H, V = v.shape[2], v.shape[3]
    TT = B * T_
    qf, kf = q.reshape(TT, Hg, K).to(f), k.reshape(TT, Hg, K).to(f)
    vf, dof = v.reshape(TT, H, V).to(f), do.reshape(TT, H, V).to(f)
    af, gf, bf = a.reshape(TT, H, BT).to(f), g.reshape(TT, H).to(f), b.reshape(TT, H).to(f)
    hf = h.reshape(-1, *h.shape[2:]).to(f)
    if state_v_first:
        hf = hf.transpose(-1, -2)
    N = len(seq_lens)
    dq = torch.zeros(TT, H, K, dtype=f)
    dk = torch.zeros(TT, H, K, dtype=f)
    dv = torch.zeros(TT, H, V, dtype=f)
    dg = torch.zeros(TT, H, dtype=f)
    db = torch.zeros(TT, H, dtype=f)
    dh0 = torch.zeros(N, H, K, V, dtype=f)
    ii = torch.arange(BT)
    lower = ii[None, :] <= ii[:, None]
    strict = ii[None, :] < ii[:, None]
    bos, c0 = 0, 0
    for n, length in enumerate(seq_lens):
        n_chunks = -(-length // BT)
        for hh in range(H):
            hg = hh // (H // Hg)
            if dht is None:
                dh_f = torch.zeros(K, V, dtype=f)
            else:
                dh_f = (dht[n, hh].transpose(-1, -2) if state_v_first else dht[n, hh]).to(f).clone()
            for ci in range(n_chunks):
                c = n_chunks - 1 - ci
                t0 = bos + c * BT
                L = min(BT, bos + length - t0)
                valid = ii < L

                def tile(x, cols):
                    out = torch.zeros(BT, cols, dtype=f)
                    out[:L] = x[t0:t0 + L]
                    return out

                q_s, k_s = r(tile(qf[:, hg], K)), r(tile(kf[:, hg], K))
                do_s = r(tile(dof[:, hh], V))
                v_g = tile(vf[:, hh], V)
                G = torch.zeros(BT, dtype=f)
                G[:L] = gf[t0:t0 + L, hh]
                bb = torch.zeros(BT, dtype=f)
                bb[:L] = bf[t0:t0 + L, hh]
                h_s = r(hf[c0 + c, hh])
                dh_s = r(dh_f)
                g_last = G[L - 1]
                eG = torch.where(valid, torch.exp(G), torch.zeros_like(G))
                dec = torch.where(valid, torch.exp(g_last - G), torch.zeros_like(G))

                gam = torch.where(lower & valid[:, None], torch.exp(G[:, None] - G[None, :]), torch.zeros(BT, BT, dtype=f))
                A = torch.zeros(BT, BT, dtype=f)
                A[:L, :L] = af[t0:t0 + L, hh, :L]
                ag_s = r(gam * A)
                kx_s = r(k_s * (bb * torch.exp(G))[:, None])
                w_s = r(ag_s @ kx_s)
                vn_s = r(v_g * bb[:, None])
                u0 = ag_s @ vn_s
                wh = w_s @ h_s
                vn_s = r(u0 - wh)

                qk = q_s @ k_s.T
                t1_s = r(scale * gam * qk)
                kx_s = r(k_s * dec[:, None])
                du = t1_s.T @ do_s + kx_s @ dh_s
                du_s = r(du)

                hdh = (dh_f * h_s).sum()
                kx_s = r(scale * q_s * torch.exp(G)[:, None])
                w_s = -w_s
                dh_f = dh_f * torch.exp(g_last) + kx_s.T @ do_s + w_s.T @ du_s

                dsg = scale * (do_s @ vn_s.T) * gam
                t2_s = r(dsg)
                dsqk = dsg * qk
                dG = dsqk.sum(1) - dsqk.sum(0)
                dq_c = (do_s @ h_s.T) * (scale * eG)[:, None]
                dG = dG + (dq_c * q_s).sum(1)
                dq_c = dq_c + t2_s @ k_s
                dq[t0:t0 + L, hh] = dq_c[:L]
                dk_f = (vn_s @ dh_s.T) * dec[:, None]
                rk = (dk_f * k_s).sum(1)
                dG = dG - rk
                parked = rk
                dk_f = dk_f + t2_s.T @ q_s
                w_s = r(-(du_s @ h_s.T))

                kx_s = r(k_s * (bb * torch.exp(G))[:, None])
                vn_s = r(v_g * bb[:, None])
                dAg = w_s @ kx_s.T + du_s @ vn_s.T
                t1_s = r(dAg)
                dkb = ag_s.T @ w_s
                dk_f = dk_f + dkb * (bb * torch.exp(G))[:, None]
                rkdkb = (dkb * k_s).sum(1)
                dG = dG + bb * torch.exp(G) * rkdkb
                dbv = torch.exp(G) * rkdkb
                dG[L - 1] += parked.sum() + torch.exp(g_last) * hdh
                dvb = ag_s.T @ du_s
                dv[t0:t0 + L, hh] = (dvb * bb[:, None])[:L]
                dbv = dbv + (dvb * v_g).sum(1)
                t2_s = r(ag_s.T @ t1_s)
                dM = torch.where(strict & valid[:, None], -(t2_s @ ag_s.T), torch.zeros(BT, BT, dtype=f))
                P = torch.where(strict, (k_s @ k_s.T) * gam, torch.zeros(BT, BT, dtype=f))
                dbv = dbv + (dM * P).sum(1)
                dpp = dM * P * bb[:, None]
                t1_s = r(dM * bb[:, None] * gam)
                dG = dG + dpp.sum(1) - dpp.sum(0)
                dk_f = dk_f + t1_s @ k_s + t1_s.T @ k_s
                dk[t0:t0 + L, hh] = dk_f[:L]
                rev = torch.where((ii[None, :] >= ii[:, None]) & (ii[None, :] < L), dG[None, :], torch.zeros(BT, BT, dtype=f))
                dg[t0:t0 + L, hh] = rev.sum(1)[:L]
                db[t0:t0 + L, hh] = dbv[:L]
            dh0[n, hh] = dh_f
        bos += length
        c0 += n_chunks
    dq = dq.view(B, T_, Hg, H // Hg, K).sum(3)
    dk = dk.view(B, T_, Hg, H // Hg, K).sum(3)
    if state_v_first:
        dh0 = dh0.transpose(-1, -2)
    return dq, dk, dv.view(B, T_, H, V), dg.view(B, T_, H), db.view(B, T_, H), dh0
