"""Reference math: the token-by-token recurrence, its autograd (the oracle), and the residuals.

`oracle_grads` is what every backend is tested against: float64 autograd of the recurrence
in docs/contract.md, one token at a time, with no chunking to share a bug with the backends.
`prepare_residuals` makes a backward call's inputs (g, a, h) from forward inputs with the
chunked torch math, and also returns o and ht so that tests can hold it to the recurrence.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import chunked_math as ex
from .chunk_layout import ChunkLayout
from .contract import GDRGrads, _expect_shape, _expect_tensor, check_state, chunk_counts, validate_forward


def _sequences(B: int, T: int, cu_seqlens: Optional[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of each sequence."""
    if cu_seqlens is None:
        return [(i, 0, T) for i in range(B)]
    off = cu_seqlens.tolist()
    return [(0, off[i], off[i + 1]) for i in range(len(off) - 1)]


def recurrent_forward(q, k, v, g_raw, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                      state_v_first=False):
    """The forward, token by token, in the inputs' dtype (call it with fp64 tensors).

    Returns `(o [B, T, H, V], ht [N, H, K, V] or [N, H, V, K])`. Differentiable. Arguments are
    checked as the op checks its own (contract.validate_forward).
    """
    scale, _ = validate_forward(q, k, v, g_raw, beta, scale, initial_state, cu_seqlens, state_v_first, chunk_size=1)
    B, T, Hg, K = q.shape
    H, V = v.shape[2], v.shape[3]
    rep = H // Hg
    qh = q.repeat_interleave(rep, dim=2)
    kh = k.repeat_interleave(rep, dim=2)
    pieces, ht = [], []  # pieces: [len, H, V] per sequence, in token order
    for n, (row, start, end) in enumerate(_sequences(B, T, cu_seqlens)):
        if initial_state is None:
            S = q.new_zeros(H, K, V)
        else:
            S = initial_state[n].transpose(-1, -2) if state_v_first else initial_state[n]
        outs = []
        for t in range(start, end):
            decay = torch.exp(g_raw[row, t])[:, None, None]  # [H, 1, 1]
            kt = kh[row, t]  # [H, K]
            S = decay * S
            u = beta[row, t][:, None] * (v[row, t] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * u[:, None, :]
            outs.append(scale * torch.einsum("hkv,hk->hv", S, qh[row, t]))
        pieces.append(torch.stack(outs) if outs else v.new_zeros(0, H, V))
        ht.append(S.transpose(-1, -2) if state_v_first else S)
    # built by stacking, not by writing into a buffer, so autograd sees every token
    o = torch.stack(pieces) if cu_seqlens is None else torch.cat(pieces)[None]
    return o, torch.stack(ht)


def oracle_grads(q, k, v, g_raw, beta, do, dht=None, *, scale=None, initial_state=None,
                 cu_seqlens=None, state_v_first=False) -> GDRGrads:
    """float64 autograd of `<o, do> + <ht, dht>` through `recurrent_forward`.

    Returns the contract's gradients in float64 (dh0 None when initial_state is None).
    """
    validate_forward(q, k, v, g_raw, beta, scale, initial_state, cu_seqlens, state_v_first, chunk_size=1)
    _expect_shape("do", _expect_tensor("do", do), tuple(v.shape), "same as v: [B, T, H, V]")
    if dht is not None:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        check_state("dht", _expect_tensor("dht", dht), N, v.shape[2], q.shape[3], v.shape[3], state_v_first)
    f64 = torch.float64
    leaves = [x.detach().to(f64).requires_grad_(True) for x in (q, k, v, g_raw, beta)]
    h0 = None if initial_state is None else initial_state.detach().to(f64).requires_grad_(True)
    o, ht = recurrent_forward(*leaves, scale=scale, initial_state=h0, cu_seqlens=cu_seqlens,
                              state_v_first=state_v_first)
    loss = (o * do.to(f64)).sum()
    if dht is not None:
        loss = loss + (ht * dht.to(f64)).sum()
    inputs = leaves + ([h0] if h0 is not None else [])
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip(inputs, grads)]
    dq, dk, dv, dg, db = grads[:5]
    return GDRGrads(dq, dk, dv, dg, db, grads[5] if h0 is not None else None)


class Residuals(NamedTuple):
    g: torch.Tensor  # [B, T, H] chunk-local cumsum of g_raw
    a: torch.Tensor  # [B, T, H, BT] ungated WY inverse
    h: torch.Tensor  # [B, NT, H, K, V] (or V, K) chunk-start states
    o: torch.Tensor  # [B, T, H, V]
    ht: torch.Tensor  # [N, H, K, V] (or V, K)


def prepare_residuals(q, k, v, g_raw, beta, initial_state=None, cu_seqlens=None, chunk_size=64,
                      state_v_first=False, scale=None) -> Residuals:
    """Chunked forward in the contract's conventions: `g`, `a`, `h`, `o`, `ht`.

    Computes in fp32 (fp64 for fp64 inputs). `g`, `h`, `ht` come back in that dtype, `a` and
    `o` in q's dtype; cast `h` to q's dtype to mimic a forward that stores it narrowed. Arguments
    are checked as the op checks its own (contract.validate_forward).
    """
    scale, _ = validate_forward(q, k, v, g_raw, beta, scale, initial_state, cu_seqlens, state_v_first, chunk_size)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, Hg, K = q.shape
    H = v.shape[2]
    seqs = _sequences(B, T, cu_seqlens)
    seq_lens = [e - s for _, s, e in seqs]
    lay = ChunkLayout.build(B, T, seq_lens, chunk_size, q.device)

    gr = lay.gather(g_raw, acc)  # zero on padded rows, so the cumsum repeats the last value there
    G = gr.cumsum(-1)
    qc = ex.expand_heads(lay.gather(q, acc), H)
    kc = ex.expand_heads(lay.gather(k, acc), H)
    vc = lay.gather(v, acc)
    bc = lay.gather(beta, acc)

    BT = chunk_size
    strict = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril(-1)
    M = torch.eye(BT, dtype=acc, device=q.device) + (bc[..., None] * (kc @ kc.transpose(-1, -2))).masked_fill(~strict, 0)
    eye = torch.eye(BT, dtype=acc, device=q.device).expand_as(M)
    A = torch.linalg.solve_triangular(M, eye, upper=False, unitriangular=True)
    A = A * lay.valid[:, :, None, None, :]  # columns past the chunk's valid length are 0

    h0 = None if initial_state is None else initial_state.to(acc)
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2)
    w, u = ex.recompute_w_u(kc, vc, bc, A, G)
    h, v_new, ht = ex.chunk_states(kc, w, u, G, h0)
    o = ex.chunk_output(qc, kc, v_new, G, h, scale)

    NT = max(chunk_counts(seq_lens, chunk_size)) if cu_seqlens is None else sum(chunk_counts(seq_lens, chunk_size))
    lead = (B, NT) if cu_seqlens is None else (1, NT)
    h_out = lay.scatter_chunks(h, lead, acc)
    if state_v_first:
        h_out = h_out.transpose(-1, -2).contiguous()
        ht = ht.transpose(-1, -2)
    return Residuals(
        g=lay.scatter(G, acc), a=lay.scatter(A, q.dtype), h=h_out,
        o=lay.scatter(o, q.dtype), ht=ht.contiguous(),
    )
