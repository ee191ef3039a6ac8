"""The exact chunked backward in PyTorch, stage by stage: the math the `torch` backend runs.

It runs anywhere torch runs (CPU and CUDA), accumulates in fp32 (fp64 for fp64 inputs) and
is the per-stage oracle for the Triton and TileLang kernels: each stage below has the
inputs and outputs of the matching stage of fla's chain (docs/contract.md), in the
contract's conventions (natural-log G, ungated A) and in the padded chunk layout of
`gdr_dispatch.chunk_layout` (`[N, C, H, BT, D]`, D the feature dim; states `[N, C, H, K, V]`). Value heads are already expanded: q/k come in with H heads.

Notation per chunk (L valid rows, start state S, end-state gradient dS'):
    Gam = tril(exp(G_i - G_j)),  Ag = Gam * A  (the gated WY inverse)
    W = Ag diag(b e^G) K,  U0 = Ag diag(b) V,  U = U0 - W S  ("v_new")
    O = scale (diag(e^G) Q S + (Gam * Q K^T) U),  S' = e^{G_L} S + (K * e^{G_L - G})^T U

Only the first C chunks loop in Python (the two state recurrences); everything else is
batched over sequences, chunks and heads.
"""

from __future__ import annotations

import torch

from .chunk_layout import ChunkLayout
from .contract import GDRCall, GDRGrads, reduce_value_heads


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def gate_decay_matrix(G: torch.Tensor) -> torch.Tensor:
    """`Gam[..., i, j] = exp(G_i - G_j)` for i >= j, else 0. G: `[..., BT]`."""
    BT = G.shape[-1]
    lower = torch.ones(BT, BT, dtype=torch.bool, device=G.device).tril()
    diff = G[..., :, None] - G[..., None, :]
    # mask before exp: above the diagonal G_i - G_j can be large and positive
    return torch.exp(diff.masked_fill(~lower, float("-inf")))


def _last(G: torch.Tensor) -> torch.Tensor:
    """G at the chunk's last valid row (the layout pads G with that value)."""
    return G[..., -1]


def _gate_grad_from_decay(dgam: torch.Tensor) -> torch.Tensor:
    """dG from `d(loss)/d(Gam) * Gam` (Gam_ij = exp(G_i - G_j)): + row sums - column sums."""
    return dgam.sum(-1) - dgam.sum(-2)


def _fold_last_gate_grad(dG: torch.Tensor, dG_last: torch.Tensor, chunk_len: torch.Tensor) -> torch.Tensor:
    """Add the gradient w.r.t. G_L to the row of the chunk's last valid token."""
    last = (chunk_len - 1).clamp(min=0)[:, :, None, None].expand(-1, -1, dG.shape[2], 1)
    return dG.scatter_add(3, last, dG_last[..., None])


# ---------------------------------------------------------------------------------------
# stages (fla's chain, docs/contract.md); all tensors in the padded chunk layout
# ---------------------------------------------------------------------------------------
def recompute_w_u(k, v, b, A, G):
    """Stage 1: `W = Ag diag(b e^G) K`, `U0 = Ag diag(b) V`."""
    Ag = gate_decay_matrix(G) * A
    w = Ag @ (k * (b * torch.exp(G))[..., None])
    u = Ag @ (v * b[..., None])
    return w, u


def chunk_states(k, w, u, G, h0):
    """Stage 2: the forward state recurrence. Returns `h` (chunk-start states), `v_new`, `ht`.

    h0: `[N, H, K, V]` or None.
    """
    N, C, H, BT, K = k.shape
    V = u.shape[-1]
    S = torch.zeros(N, H, K, V, dtype=k.dtype, device=k.device) if h0 is None else h0.clone()
    h = torch.empty(N, C, H, K, V, dtype=k.dtype, device=k.device)
    v_new = torch.empty_like(u)
    gL = _last(G)
    for c in range(C):
        h[:, c] = S
        U = u[:, c] - w[:, c] @ S
        v_new[:, c] = U
        kd = k[:, c] * torch.exp(gL[:, c, :, None] - G[:, c])[..., None]
        S = torch.exp(gL[:, c])[..., None, None] * S + kd.transpose(-1, -2) @ U
    return h, v_new, S


def v_new_from_states(w, u, h):
    """`U = U0 - W S` for given chunk-start states (the `h`-given path, chunk-parallel)."""
    return u - w @ h


def chunk_output(q, k, v_new, G, h, scale):
    """Forward output `O` of each chunk (used by `prepare_residuals`)."""
    Gam = gate_decay_matrix(G)
    inter = (q * torch.exp(G)[..., None]) @ h
    intra = (Gam * (q @ k.transpose(-1, -2))) @ v_new
    return scale * (inter + intra)


def dv_local(q, k, G, do, scale):
    """Stage 3: intra-chunk part of dU, `scale (Gam * Q K^T)^T dO`."""
    Gam = gate_decay_matrix(G)
    return scale * (Gam * (q @ k.transpose(-1, -2))).transpose(-1, -2) @ do


def chunk_state_grads(q, k, w, G, dht, do, dv_loc, scale):
    """Stage 4: the reverse state-gradient recurrence.

    Returns `dh` `[N, C, H, K, V]` (the gradient w.r.t. each chunk's *end* state, fla's
    convention), `dh0` (w.r.t. the initial state) and the full `dU`.
    dht: `[N, H, K, V]` or None.
    """
    N, C, H, BT, K = k.shape
    V = do.shape[-1]
    dS = torch.zeros(N, H, K, V, dtype=k.dtype, device=k.device) if dht is None else dht.clone()
    dh = torch.empty(N, C, H, K, V, dtype=k.dtype, device=k.device)
    du = torch.empty_like(dv_loc)
    gL = _last(G)
    for c in range(C - 1, -1, -1):
        dh[:, c] = dS
        kd = k[:, c] * torch.exp(gL[:, c, :, None] - G[:, c])[..., None]
        dU = dv_loc[:, c] + kd @ dS
        du[:, c] = dU
        qe = q[:, c] * (scale * torch.exp(G[:, c]))[..., None]
        dS = torch.exp(gL[:, c])[..., None, None] * dS + qe.transpose(-1, -2) @ do[:, c] - w[:, c].transpose(-1, -2) @ dU
    return dh, dS, du


def dqkwg(q, k, v_new, w, G, h, du, do, dh, scale, chunk_len):
    """Stage 5: `dq`, `dk` (the q/k and state parts), `dw`, and `dG` of the O and S' terms."""
    Gam = gate_decay_matrix(G)
    gL = _last(G)
    eG = torch.exp(G)[..., None]
    decay_to_end = torch.exp(gL[..., None] - G)[..., None]
    ds = scale * (do @ v_new.transpose(-1, -2))  # d(Gam * Q K^T) before the Gam factor
    qk = q @ k.transpose(-1, -2)
    ds_g = ds * Gam
    dq_inter = scale * eG * (do @ h.transpose(-1, -2))
    dq = dq_inter + ds_g @ k
    dk_state = decay_to_end * (v_new @ dh.transpose(-1, -2))
    dk = dk_state + ds_g.transpose(-1, -2) @ q
    dw = -du @ h.transpose(-1, -2)
    dG = (dq_inter * q).sum(-1) + _gate_grad_from_decay(ds_g * qk) - (dk_state * k).sum(-1)
    dG_last = (dk_state * k).sum((-1, -2)) + torch.exp(gL) * (h * dh).sum((-1, -2))
    return dq, dk, dw, _fold_last_gate_grad(dG, dG_last, chunk_len)


def wy_bwd(k, v, b, A, G, dw, du, a_is_gated=False):
    """Stage 6: backward through `W`, `U0` and the gated WY inverse. Returns `dk2, dv, db, dG2`.

    `Ag = M^{-1}` with `M = I + StrictLower(diag(b) (K K^T * Gam))`, so
    `dM = -Ag^T dAg Ag^T`; `A` enters only through `Ag = Gam * A` (exact, see docs/contract.md).
    With `a_is_gated`, `A` already is `Ag` (fla's convention).
    """
    Gam = gate_decay_matrix(G)
    Ag = A if a_is_gated else Gam * A
    eG = torch.exp(G)
    kb = k * (b * eG)[..., None]
    vb = v * b[..., None]
    dAg = dw @ kb.transpose(-1, -2) + du @ vb.transpose(-1, -2)
    dkb = Ag.transpose(-1, -2) @ dw
    dvb = Ag.transpose(-1, -2) @ du
    dk2 = dkb * (b * eG)[..., None]
    dv = dvb * b[..., None]
    kdkb = (k * dkb).sum(-1)
    db = eG * kdkb + (v * dvb).sum(-1)
    dG2 = b * eG * kdkb

    BT = G.shape[-1]
    strict = torch.ones(BT, BT, dtype=torch.bool, device=G.device).tril(-1)
    dM = -(Ag.transpose(-1, -2) @ dAg @ Ag.transpose(-1, -2))
    dM = dM.masked_fill(~strict, 0.0)
    kk = k @ k.transpose(-1, -2)
    P = kk * Gam
    db = db + (dM * P).sum(-1)
    dP = dM * b[..., None]
    dkk = dP * Gam
    dk2 = dk2 + dkk @ k + dkk.transpose(-1, -2) @ k
    dG2 = dG2 + _gate_grad_from_decay(dP * P)
    return dk2, dv, db, dG2


def reverse_chunk_cumsum(dG: torch.Tensor) -> torch.Tensor:
    """Stage 7: dG w.r.t. the chunk-local cumsum -> dg w.r.t. the raw gate (padded rows are 0)."""
    return dG.flip(-1).cumsum(-1).flip(-1)


# ---------------------------------------------------------------------------------------
# the whole backward
# ---------------------------------------------------------------------------------------
def states_in(x, v_first):
    """A state tensor as `[..., K, V]` (transposed back from `state_v_first`); None stays None."""
    return None if x is None else (x.transpose(-1, -2) if v_first else x)


def expand_heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """q/k `[..., Hg, BT, D]` layout (head dim 2) -> H value heads (head i uses i // (H // Hg))."""
    Hg = x.shape[2]
    return x if Hg == H else x.repeat_interleave(H // Hg, dim=2)


def gather_call(call: GDRCall):
    """A call's per-token tensors in the padded chunk layout, in its accumulation dtype, q/k
    expanded to the value heads: `(layout, q, k, v, do, A, b, G)`."""
    acc = call.acc_dtype
    lay = ChunkLayout.build(call.B, call.T, call.seq_lens, call.chunk_size, call.q.device)
    q = expand_heads(lay.gather(call.q, acc), call.H)
    k = expand_heads(lay.gather(call.k, acc), call.H)
    v, do, A, b = (lay.gather(x, acc) for x in (call.v, call.do, call.a, call.b))
    return lay, q, k, v, do, A, b, lay.gather_gate(call.g, acc)


def chunked_backward(call: GDRCall) -> GDRGrads:
    """The whole backward of a validated call, in the contract's output form."""
    acc = call.acc_dtype
    lay, q, k, v, do, A, b, G = gather_call(call)
    h0 = states_in(call.initial_state, call.state_v_first)
    h0 = None if h0 is None else h0.to(acc)
    dht = states_in(call.dht, call.state_v_first)
    dht = None if dht is None else dht.to(acc)

    w, u = recompute_w_u(k, v, b, A, G)
    if call.h is None:
        h, v_new, _ = chunk_states(k, w, u, G, h0)
    else:
        h = lay.gather_chunks(states_in(call.h, call.state_v_first), acc)
        v_new = v_new_from_states(w, u, h)
    dv_loc = dv_local(q, k, G, do, call.scale)
    dh, dh0, du = chunk_state_grads(q, k, w, G, dht, do, dv_loc, call.scale)
    dq, dk, dw, dG = dqkwg(q, k, v_new, w, G, h, du, do, dh, call.scale, lay.chunk_len)
    dk2, dv, db, dG2 = wy_bwd(k, v, b, A, G, dw, du)
    dg = reverse_chunk_cumsum(dG + dG2)

    Hg = call.Hg
    dq = reduce_value_heads(lay.scatter(dq, acc), Hg, call.q.dtype)
    dk = reduce_value_heads(lay.scatter(dk + dk2, acc), Hg, call.k.dtype)
    dv = lay.scatter(dv, call.v.dtype)
    dg = lay.scatter(dg, acc)
    db = lay.scatter(db, call.b.dtype)
    if call.initial_state is None:
        dh0 = None
    else:
        dh0 = (dh0.transpose(-1, -2) if call.state_v_first else dh0).contiguous()
    return GDRGrads(dq, dk, dv, dg, db, dh0)
