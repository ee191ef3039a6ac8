"""Exact intra-GPU context parallelism: a sequence cut into segments of whole chunks, each
segment run as an independent sequence of one varlen call.

The chunk-state map is affine (docs/contract.md): with `W = Ag diag(b e^G) K`,
`U0 = Ag diag(b) V` and `Kt = diag(e^{G_L - G}) K` for chunk c,

    S_{c+1}  = M_c S_c + R_c,          M_c = e^{G_L} I - Kt^T W,   R_c = Kt^T U0
    dS_c     = M_c^T dS_{c+1} + D_c,   D_c = scale (Q e^G)^T dO - W^T dV_local

where `dS_c` is the gradient w.r.t. chunk c's start state and `D_c` does not depend on any
state. So:

  1. per segment (all in parallel): its composed `M` (K x K), its `R` (end state from a zero
     start) and its `D` (start gradient from a zero end gradient);
  2. per sequence, a short scan over its segments: the exact start state of each segment
     (from `initial_state`, or the given `h`) and the exact end-state gradient (from `dht`);
  3. one varlen call of any backend over all segments, each with its start state as
     `initial_state` and its end gradient as `dht`. Per-token gradients come out exact; the
     first segment's `dh0` is the sequence's, inner ones are dropped.

Conditioning: the scan multiplies `M`s whose decay factor `e^{G_L}` is <= 1 and whose rank-64
update is the delta rule's projection, so products shrink towards zero (underflow), never grow.

This module is the torch version of passes 1 and 2 (any device, fp32 or fp64 accumulation):
exact, and what the CPU tests hold the split to. GPU kernels for them are still to come
(issue 15); `GDR_CP=<n>` forces n segments per sequence through `fused_gdr_bwd`.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import chunked_math as cm
from .chunk_layout import ChunkLayout
from .contract import GDRCall, GDRGrads, chunk_counts


def segment_chunks(seq_lens, chunk_size: int, segments: int) -> list[list[int]]:
    """Chunks per segment for each sequence: `segments` near-equal runs of whole chunks (fewer
    when a sequence has fewer chunks; a sequence of zero tokens keeps one empty segment)."""
    if segments < 1:
        raise ValueError(f"segments: expected >= 1, got {segments}")
    plan = []
    for n_chunks in chunk_counts(seq_lens, chunk_size):
        parts = max(1, min(segments, n_chunks))
        base, extra = divmod(n_chunks, parts)
        plan.append([base + (1 if j < extra else 0) for j in range(parts)])
    return plan


def chunk_maps(call: GDRCall):
    """Per chunk of every sequence, in the padded layout `[N, C, H, ...]`: `M` (K x K), `R`
    (K x V), `D` (K x V) of the affine state maps, in the call's accumulation dtype."""
    acc = call.acc_dtype
    lay = ChunkLayout.build(call.B, call.T, call.seq_lens, call.chunk_size, call.q.device)
    H = call.H
    q = cm.expand_heads(lay.gather(call.q, acc), H)
    k = cm.expand_heads(lay.gather(call.k, acc), H)
    v, do, A, b = (lay.gather(x, acc) for x in (call.v, call.do, call.a, call.b))
    G = lay.gather_gate(call.g, acc)
    w, u0 = cm.recompute_w_u(k, v, b, A, G)
    gL = G[..., -1]
    kt = k * torch.exp(gL[..., None] - G)[..., None]
    eye = torch.eye(call.K, dtype=acc, device=q.device)
    M = torch.exp(gL)[..., None, None] * eye - kt.transpose(-1, -2) @ w
    R = kt.transpose(-1, -2) @ u0
    dv_loc = cm.dv_local(q, k, G, do, call.scale)
    qe = q * (call.scale * torch.exp(G))[..., None]
    D = qe.transpose(-1, -2) @ do - w.transpose(-1, -2) @ dv_loc
    return lay, M, R, D


def _states_in(x, v_first):
    return None if x is None else (x.transpose(-1, -2) if v_first else x)


def split_backward(call: GDRCall, segments: int, run: Callable[..., GDRGrads]) -> GDRGrads:
    """The backward of `call` with each sequence cut into `segments` runs of whole chunks.

    `run(**kwargs)` computes one backward call (e.g. `fused_gdr_bwd` or a backend's `run`
    through `validate`); it receives the segments as one varlen call with `initial_state`
    and `dht` set.
    """
    plan = segment_chunks(call.seq_lens, call.chunk_size, segments)
    acc = call.acc_dtype
    lay, M, R, D = chunk_maps(call)
    N, H, K, V, BT = call.N, call.H, call.K, call.V, call.chunk_size
    dev = call.q.device
    h0 = _states_in(call.initial_state, call.state_v_first)
    dht = _states_in(call.dht, call.state_v_first)
    h_rows = None
    if call.h is not None:
        h_rows = _states_in(call.h, call.state_v_first).reshape(-1, H, K, V)  # chunk order, all sequences

    starts, ends, seg_lens, first_seg = [], [], [], []
    chunk_base = 0
    for n, sizes in enumerate(plan):
        # pass 1: each segment's composed maps (a loop over its chunks, vectorised over heads)
        maps, c = [], 0
        for size in sizes:
            Mseg = torch.eye(K, dtype=acc, device=dev).expand(H, K, K).clone()
            Rseg = torch.zeros(H, K, V, dtype=acc, device=dev)
            Dseg = torch.zeros(H, K, V, dtype=acc, device=dev)
            for cc in range(c, c + size):
                Mseg = M[n, cc] @ Mseg
                Rseg = M[n, cc] @ Rseg + R[n, cc]
            for cc in range(c + size - 1, c - 1, -1):
                Dseg = M[n, cc].transpose(-1, -2) @ Dseg + D[n, cc]
            maps.append((c, size, Mseg, Rseg, Dseg))
            c += size
        # pass 2: the scan over this sequence's segments
        S = torch.zeros(H, K, V, dtype=acc, device=dev) if h0 is None else h0[n].to(acc)
        seg_starts = []
        for c0, size, Mseg, Rseg, _ in maps:
            if h_rows is not None and size > 0:
                S = h_rows[chunk_base + c0].to(acc)
            seg_starts.append(S)
            S = Mseg @ S + Rseg
        dS = torch.zeros(H, K, V, dtype=acc, device=dev) if dht is None else dht[n].to(acc)
        seg_ends = [None] * len(maps)
        for j in range(len(maps) - 1, -1, -1):
            seg_ends[j] = dS
            dS = maps[j][2].transpose(-1, -2) @ dS + maps[j][4]
        length = call.seq_lens[n]
        first_seg.append(len(seg_lens))
        for j, (c0, size, *_rest) in enumerate(maps):
            seg_lens.append(min(size * BT, max(length - c0 * BT, 0)))
        starts += seg_starts
        ends += seg_ends
        chunk_base += sum(sizes)

    # pass 3: every segment an independent sequence of one varlen call
    offsets = torch.tensor([0] + seg_lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
    init = torch.stack(starts)
    grad_end = torch.stack(ends)
    if call.state_v_first:
        init, grad_end = init.transpose(-1, -2).contiguous(), grad_end.transpose(-1, -2).contiguous()
    flat = {name: getattr(call, name).reshape(1, call.B * call.T, *getattr(call, name).shape[2:])
            for name in ("q", "k", "v", "a", "g", "b", "do")}
    h = None if call.h is None else call.h.reshape(1, -1, *call.h.shape[2:])
    grads = run(**flat, dht=grad_end.to(torch.float32 if acc == torch.float32 else acc), h=h,
                scale=call.scale, initial_state=init.to(torch.float32 if acc == torch.float32 else acc),
                cu_seqlens=offsets, chunk_size=BT, state_v_first=call.state_v_first)

    def back(x):
        return x.reshape(call.B, call.T, *x.shape[2:])

    dh0 = None
    if call.initial_state is not None:
        dh0 = grads.dh0[torch.tensor(first_seg, device=dev)].contiguous()
    return GDRGrads(back(grads.dq), back(grads.dk), back(grads.dv), back(grads.dg), back(grads.db), dh0)
