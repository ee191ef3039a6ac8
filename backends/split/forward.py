"""The training op's forward on a starved grid, split as the backward is (passes.py; docs/kernels.md,
"The split"): `<provider>@split<n>` runs a forward provider on each sequence cut into segments of
whole chunks, from the segments' exact start states.

1. The residuals `G` and `a` of the whole call (per chunk, so the segments' are the same).
2. Pass 1 forwards only: the decay plan, each warm segment's next start state from a zero start
   over its window, the maps of the exact ones (no backward walk: there is no `do` yet).
3. Pass 2 forwards only: the chain completes every segment's start state from `initial_state`.
4. The provider's forward over the segments as one varlen call, each from its start state; a
   sequence's final state is its last segment's.

A provider that offers its forward in two halves (`Backend.residual_forward`: FlashQLA's) computes
the residuals on its own kernels and its forward takes them; any other recomputes `G` and `a` for
the segments (the same values) and the residuals it returns are the call's.
"""

from __future__ import annotations

import torch

from gdr_dispatch.contract import packed, sequence_lengths, validate
from gdr_dispatch.graph_safe import device_constant, remember, remembered

from . import passes


def residuals(q, k, v, g, beta, cu_seqlens, chunk_size: int):
    """`(G, a)` of a call, before any state is known: fla-core's kernels on CUDA in 16 bits, the
    reference's tensor math elsewhere."""
    if k.device.type == "cuda" and k.dtype in (torch.bfloat16, torch.float16):
        from ..common import fla_pipeline

        G, a, _ = fla_pipeline.residuals(k, beta, g, cu_seqlens, chunk_size)
        return G, a
    from gdr_dispatch.reference import prepare_residuals

    res = prepare_residuals(q, k, v, g, beta, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    return res.g, res.a


def lengths(cu_seqlens, B: int, T: int) -> tuple:
    """The sequences' token counts: what the op's forward read of `cu_seqlens` just now (no
    second device read), else a read."""
    if cu_seqlens is None:
        return (T,) * B
    off = remembered(cu_seqlens)
    return tuple(b - a for a, b in zip(off, off[1:])) if off is not None else sequence_lengths(cu_seqlens, B, T)


def halves(inner) -> bool:
    """Whether the split forward runs `inner` in its two halves (`Backend.residual_forward`): the
    residuals once, on its kernels, then the rest from them."""
    from gdr_dispatch.registry import unverified_allowed

    return inner.residual_forward and (inner.residual_forward_verified or unverified_allowed())


def split_forward(inner, segments: int, q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first,
                  need_final, chunk_size, need_states=True, carry=False):
    """`inner`'s forward (a provider, `Backend.forward`, or its two halves) over every sequence cut
    into at most `segments` runs of whole chunks (module docstring): `(o, final_state or None, G,
    a, h)` as `inner.forward` returns them for the whole call; with `carry`, then pass 1's plan,
    the exact segments' maps and the completed start states (carry.py: what the backward reuses)."""
    B, T, H = q.shape[0], q.shape[1], v.shape[2]
    dev = q.device
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    segs = passes.segments_of(lengths(cu_seqlens, B, T), chunk_size, segments)
    offsets = device_constant(segs.token_offsets, torch.int32, dev)
    remember(offsets, segs.token_offsets)

    def flat(x):
        return x.reshape(1, B * T, *x.shape[2:])

    fq, fk, fv, fg, fb = (packed(flat(x)) for x in (q, k, v, g, beta))  # a strided view copied once
    # the segments' residuals are the whole call's (both per chunk): computed once on the segments
    two = halves(inner)
    G, a = (inner.forward_residuals if two else residuals)(fq, fk, fv, fg, fb, offsets, chunk_size)
    G, a = G.to(acc), a.to(q.dtype)
    seg_call = validate(fq, fk, fv, a, G, fb, fv, scale=scale, cu_seqlens=offsets, chunk_size=chunk_size)
    # the call in its own layout (pass 2 reads its initial_state; the tensor products its
    # sequences); `do` is a stand-in nothing reads
    call = validate(q, k, v, a.view(B, T, H, -1), G.view(B, T, H), beta, v, scale=scale,
                    initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                    state_v_first=state_v_first)
    _, _, plan, M, starts, _ = passes.pass_1(call, segs, seg_call, need_starts=True, need_ends=False)
    passes.pass_2(call, segs, plan, M, starts, None)
    carried = (plan, M, starts) if carry else ()
    init = starts.to(passes._state_dtype(call))
    if state_v_first:
        init = init.transpose(-1, -2)
    if two:
        o, ht, h = inner.forward_from_residuals(fq, fk, fv, G, a, fb, scale, init.contiguous(), offsets, state_v_first,
                                                need_final, chunk_size, need_states=need_states)
    else:
        o, ht, G, a, h = inner.forward(fq, fk, fv, fg, fb, scale, init.contiguous(), offsets, state_v_first,
                                       need_final, chunk_size, need_states=need_states)
    final = None
    if need_final:  # each sequence's last segment's; a sequence of no tokens keeps its initial state
        j, n = segs.lasts
        final = ht[device_constant(j, torch.int64, dev)]
        if len(n) < len(segs.seg_offsets) - 1:
            whole = (torch.zeros((len(segs.seg_offsets) - 1,) + tuple(ht.shape[1:]), dtype=ht.dtype, device=dev)
                     if initial_state is None else initial_state.to(ht.dtype).clone())
            whole[device_constant(n, torch.int64, dev)] = final
            final = whole
    if h is not None and h.numel():
        h = h.reshape(B, -1, *h.shape[2:])
    return (o.reshape(B, T, *o.shape[2:]), final, G.reshape(B, T, *G.shape[2:]), a.reshape(B, T, *a.shape[2:]), h,
            *carried)
