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

Pass 1 runs on our two Triton kernels (segment_maps.py: W, U0 and the local dV formed per
chunk in registers) where they take the call (with `h=None` a third then writes pass 3's `h`
from the segments' start states, unless the backend recomputes them in a kernel of its own,
`Backend.own_state_recompute`), else on the kernels of the first registered backend that
offers them (`Backend.split_passes`; today fla's state kernels, which compose a
segment's `M` and `R` in one state pass and its `D` in one dh pass), else as batched tensor
products here
(any device, fp32 or fp64 accumulation; the per-chunk maps in one batch, each segment's
composition in log2(chunks) batched levels): exact, and what the CPU tests hold the split to.
Pass 2, the scans, runs as Triton kernels on CUDA for fp32 maps (segment_scan.py: one launch
each instead of ~150 small ops), else as log-depth prefixes of the segments' maps in batched
K x K products. `GDR_CP=<n>` forces at
most n segments per sequence, `GDR_CP=0` turns the split off; unset, the autotuner tries
`(backend, segments)` candidates (`SplitBackend`, __init__.py) on grids with fewer sequence x
head programs than SMs, and a table may store one as `<backend>@split<n>`.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import replace
from typing import Callable

import torch

from gdr_dispatch import chunked_math as cm
from gdr_dispatch.caches import first_time
from gdr_dispatch.contract import GDRCall, GDRGrads, chunk_counts, validate
from gdr_dispatch.graph_safe import device_constant
from gdr_dispatch.problem import Problem
from gdr_dispatch.registry import registered_backends, unverified_allowed, unverified_reason


def segment_length(seq_lens, chunk_size: int, segments: int) -> int:
    """Chunks per segment: the longest sequence's chunks over `segments`, rounded up (shorter
    sequences then have fewer non-empty segments)."""
    if segments < 1:
        raise ValueError(f"segments: expected >= 1, got {segments}")
    return max(1, -(-max(chunk_counts(seq_lens, chunk_size)) // segments))


def chunk_maps(call: GDRCall):
    """Per chunk of every sequence, in the padded layout `[N, C, H, ...]`: `M` (K x K), `R`
    (K x V), `D` (K x V) of the affine state maps, in the call's accumulation dtype."""
    acc = call.acc_dtype
    lay, q, k, v, do, A, b, G = cm.gather_call(call)
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


def _compose(M, R, D):
    """Fold the chunk axis (-4 of `[..., s, H, K, *]`) into one map per run of chunks, in
    log2(s) levels of batched products: (M2, R2) after (M1, R1) is (M2 M1, M2 R1 + R2), and
    the start gradient of the pair is M1^T D2 + D1."""
    while M.shape[-4] > 1:
        if M.shape[-4] % 2:  # pad with an identity chunk (M = I, R = D = 0)
            eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device).expand_as(M[..., :1, :, :, :])
            M = torch.cat([M, eye], dim=-4)
            R = torch.cat([R, torch.zeros_like(R[..., :1, :, :, :])], dim=-4)
            D = torch.cat([D, torch.zeros_like(D[..., :1, :, :, :])], dim=-4)
        M1, M2 = M[..., 0::2, :, :, :], M[..., 1::2, :, :, :]
        R1, R2 = R[..., 0::2, :, :, :], R[..., 1::2, :, :, :]
        D1, D2 = D[..., 0::2, :, :, :], D[..., 1::2, :, :, :]
        M, R, D = M2 @ M1, M2 @ R1 + R2, M1.transpose(-1, -2) @ D2 + D1
    return M[..., 0, :, :, :], R[..., 0, :, :, :], D[..., 0, :, :, :]


log = logging.getLogger("gdr_dispatch")
#: `pass_1_provider`'s name for our own kernels (segment_maps.py)
OUR_MAPS = "gdr_dispatch"


def _maps_kernels_refusal(seg_call: GDRCall) -> str:
    """Why pass 1 does not run on our Triton kernels (segment_maps.py) for the segments' call,
    "" when it does. Gated like a backend: while `segment_maps.GPU_VERIFIED` is False, only
    GDR_ALLOW_UNVERIFIED=1 runs them."""
    from ..kernels import segment_maps

    why = segment_maps.not_supported_reason(seg_call.K, seg_call.V, seg_call.q.dtype, seg_call.chunk_size,
                                            seg_call.q.device)
    if not why and not segment_maps.GPU_VERIFIED and not unverified_allowed():
        why = unverified_reason("the Triton maps")
    return why


def pass_1_provider(seg_call: GDRCall):
    """`(name, function)` of what runs pass 1 for the segments' call: our Triton kernels
    (segment_maps.py) where they take it, else the first registered backend whose kernels do,
    else `("torch products", None)`."""
    if not _maps_kernels_refusal(seg_call):
        from ..kernels import segment_maps

        return OUR_MAPS, segment_maps.segment_maps
    problem = Problem.from_call(seg_call)
    for name, backend in registered_backends().items():
        fn = backend.split_passes(problem)
        if fn is not None:
            return name, fn
    return "torch products", None


def segment_plan(call: GDRCall, segments: int):
    """Chunks per segment `s`, segments per sequence `n_seg`, and the non-empty segments in
    order: their token counts and `(sequence, segment)` indices."""
    s, n_seg, seg_lens, pick, _ = _plan(tuple(call.seq_lens), call.chunk_size, segments)
    return s, n_seg, list(seg_lens), list(pick)


@functools.lru_cache(maxsize=256)
def _plan(seq_lens: tuple, BT: int, segments: int):
    """`segment_plan`'s, once per lengths (a training run repeats a handful; the Python loop
    over the segments was ~50 us of the split's host time per call at 32 segments, on a CPU),
    and the index tuples the split's device constants hold: the segments' token offsets, each
    segment's sequence and its place in it."""
    s = segment_length(seq_lens, BT, segments)
    n_seg = -(-max(chunk_counts(seq_lens, BT)) // s)
    seg_lens, pick = [], []
    for n, length in enumerate(seq_lens):
        for j in range(n_seg):
            piece = min(max(length - j * s * BT, 0), s * BT)
            if piece > 0:
                seg_lens.append(piece)
                pick.append((n, j))
    indices = (tuple(itertools.accumulate([0] + seg_lens)), tuple(n for n, _ in pick), tuple(j for _, j in pick))
    return s, n_seg, tuple(seg_lens), tuple(pick), indices


def _segments_inputs(call: GDRCall, offsets: tuple) -> tuple[dict, torch.Tensor]:
    """The call's per-token tensors as one packed sequence, and the segments' `cu_seqlens` (a
    cached device constant: a fresh host-to-device copy, and `validate`'s read of a fresh
    cu_seqlens back to the host, stalled the stream on every split call): the inputs of pass 1's
    and pass 3's calls."""
    flat = {name: getattr(call, name).reshape(1, call.B * call.T, *getattr(call, name).shape[2:])
            for name in ("q", "k", "v", "a", "g", "b", "do")}
    return flat, device_constant(offsets, torch.int32, call.q.device)


def _state_dtype(call: GDRCall) -> torch.dtype:
    """The segments' `initial_state`/`dht` dtype: the accumulation dtype, at least fp32."""
    return call.acc_dtype if call.acc_dtype == torch.float64 else torch.float32


def split_backward(call: GDRCall, segments: int, run: Callable[[GDRCall], GDRGrads],
                   states_by_run: bool = False) -> GDRGrads:
    """The backward of `call` with each sequence cut into runs of whole chunks.

    Every sequence is cut at multiples of `segment_length(...)` chunks (at most `segments`
    runs; shorter sequences get fewer). `run(call)` computes one validated backward call (a
    backend's `run`, or the dispatcher's); it receives the non-empty segments as one varlen
    call with `initial_state` and `dht` set. Pass 1 on a backend's kernels (`pass_1_provider`) or as
    batched tensor products; pass 2 as log2(`segments`) levels of batched products.
    `states_by_run`: with `h=None`, `run`'s backend recomputes the segments' chunk states itself
    (`Backend.own_state_recompute`); else pass 1's Triton kernels write them where they ran.
    """
    acc = call.acc_dtype
    N, H, K, V, BT = call.N, call.H, call.K, call.V, call.chunk_size
    dev = call.q.device
    s, n_seg, _, pick, (token_offsets, seqs, places) = _plan(call.seq_lens, BT, segments)
    flat, offsets = _segments_inputs(call, token_offsets)
    # each non-empty segment's (sequence, segment) indices into the [N, n_seg, ...] maps
    seq_of = device_constant(seqs, torch.int64, dev)
    seg_of = device_constant(places, torch.int64, dev)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=BT)  # no states: pass 1's input
    provider, maps = pass_1_provider(seg_call)
    states = None if states_by_run else _states_kernel(call, seg_call, provider)
    problem = Problem.from_call(call)
    if first_time(("split passes", problem.table_key(), segments, provider, states_by_run)):
        log.info("gdr_dispatch: split pass 1 (the segments' composed state maps) on %s, pass 2 (the scans) on %s, "
                 "%sfor %s", (f"{provider}'s kernels" if maps is not None else provider)
                 + ("" if provider == OUR_MAPS else f" (our Triton maps: {_maps_kernels_refusal(seg_call)})"),
                 "Triton kernels" if _scan_kernels(K, V, acc, dev) is not None
                 else f"torch products ({_scan_kernels_refusal(K, V, acc, dev)})",
                 "pass 3's chunk states on gdr_dispatch's kernels (its backend takes h given), " if states
                 else "pass 3's chunk states by its backend, " if states_by_run and call.h is None else "",
                 problem.describe())
    if maps is not None:  # pass 1 on the provider's kernels, scattered to [N, n_seg, H, ...]
        m, r, d = maps(seg_call, need_r=call.h is None)  # with h given the starts come from h
        Ms = _to_grid(m.to(acc), pick, (seq_of, seg_of), N, n_seg, "eye")
        Ds = _to_grid(d.to(acc), pick, (seq_of, seg_of), N, n_seg, "zeros")
        Rs = None if r is None else _to_grid(r.to(acc), pick, (seq_of, seg_of), N, n_seg, "zeros")
    else:
        Ms, Rs, Ds = _torch_pass_1(call, s, n_seg)
    return _scan_and_run(call, s, pick, (seq_of, seg_of), seg_call, Ms, Rs, Ds, run, states)


def sequence_maps(call: GDRCall, need_r: bool = True):
    """Each sequence of a varlen `call` composed into one map: `(M, R or None, D)`, `[N, H, K, K]`,
    `[N, H, K, V]`, `[N, H, K, V]` in the call's accumulation dtype (K x V layout): on a pass-1
    provider's kernels where one takes the call, else as batched torch products (a sequence of no
    tokens is the identity). What the cross-rank split (ranks.py) exchanges."""
    acc = call.acc_dtype
    provider, maps = pass_1_provider(call)
    if maps is not None:
        m, r, d = maps(call, need_r=need_r)
        return m.to(acc), None if r is None else r.to(acc), d.to(acc)
    s = max(1, max(chunk_counts(call.seq_lens, call.chunk_size)))
    Ms, Rs, Ds = _torch_pass_1(call, s, 1)
    return Ms[:, 0], Rs[:, 0] if need_r else None, Ds[:, 0]


def _states_kernel(call: GDRCall, seg_call: GDRCall, provider: str):
    """With `h=None` and pass 1 on our kernels: the function that makes pass 3's `h` from the
    segments' start states on them too (segment_maps.segment_states; the backend then skips its
    own state recompute, fla's stages 1-2 for most). None otherwise."""
    if call.h is not None or provider != OUR_MAPS:
        return None
    from ..kernels import segment_maps

    return functools.partial(segment_maps.segment_states, seg_call, state_v_first=call.state_v_first)


def _full_grid(pick, N: int, n_seg: int) -> bool:
    """Every sequence cut into `n_seg` non-empty segments (`segment_plan` lists them in order)."""
    return len(pick) == N * n_seg


def _to_grid(x, pick, index, N: int, n_seg: int, fill: str):
    """The non-empty segments' `[segments, ...]` as `[N, n_seg, ...]`, `fill` ("eye" or "zeros")
    where a segment is empty: a reshape on a full grid, else a scatter. Eager, the split is bound
    by its host-side launches (docs/kernels.md, "The split"): the scatter's four
    (identity or zeros, repeat, index_put) are skipped where they move nothing."""
    if _full_grid(pick, N, n_seg):
        return x.reshape(N, n_seg, *x.shape[1:])
    if fill == "eye":
        out = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device).repeat(N, n_seg, *x.shape[1:-2], 1, 1)
    else:
        out = x.new_zeros(N, n_seg, *x.shape[1:])
    out[index] = x
    return out


def _from_grid(x, pick, index):
    """`[N, n_seg, ...]` -> the non-empty segments' `[segments, ...]` (`_to_grid`'s inverse)."""
    if _full_grid(pick, x.shape[0], x.shape[1]):
        return x.reshape(-1, *x.shape[2:])
    return x[index]


def _torch_pass_1(call: GDRCall, s: int, n_seg: int):
    """Pass 1 as batched tensor products: `(M, R, D)` of every segment, `[N, n_seg, H, ...]`."""
    acc = call.acc_dtype
    N, H, K, V, BT = call.N, call.H, call.K, call.V, call.chunk_size
    dev = call.q.device
    lay, M, R, D = chunk_maps(call)  # [N, C, H, ...]; chunks past a sequence's end are not maps yet
    counts = device_constant(tuple(chunk_counts(call.seq_lens, BT)), torch.int64, dev)
    C = M.shape[1]
    real = (torch.arange(C, device=dev)[None, :] < counts[:, None])[:, :, None, None, None]  # [N, C, 1, 1, 1]
    eye = torch.eye(K, dtype=acc, device=dev)
    M = torch.where(real, M, eye)  # identity past each sequence's end: exact padding
    R = torch.where(real, R, torch.zeros((), dtype=acc, device=dev))
    D = torch.where(real, D, torch.zeros((), dtype=acc, device=dev))
    pad = n_seg * s - C
    if pad:
        M = torch.cat([M, eye.expand(N, pad, H, K, K)], dim=1)
        R = torch.cat([R, R.new_zeros(N, pad, H, K, V)], dim=1)
        D = torch.cat([D, D.new_zeros(N, pad, H, K, V)], dim=1)
    return _compose(M.view(N, n_seg, s, H, K, K), R.view(N, n_seg, s, H, K, V), D.view(N, n_seg, s, H, K, V))


def _prefix_maps(M, X):
    """Inclusive prefix of affine maps along axis 1 (`M` `[N, n, H, K, K]`, `X` `[N, n, H, K, V]`,
    map j: x -> M_j x + X_j): `(A_j, B_j)` of map j after map j-1 ... after map 0, so applying
    the first j + 1 maps to x0 gives `A_j x0 + B_j`. Hillis-Steele: log2(n) levels of batched
    products instead of n dependent steps (at 64 segments the loop was 128 launches each way)."""
    A, B = M, X
    n, d = M.shape[1], 1
    while d < n:
        A, B = (torch.cat([A[:, :d], A[:, d:] @ A[:, :-d]], dim=1),
                torch.cat([B[:, :d], A[:, d:] @ B[:, :-d] + B[:, d:]], dim=1))
        d *= 2
    return A, B


def _scan_kernels_refusal(K: int, V: int, acc: torch.dtype, dev: torch.device) -> str:
    """Why pass 2 does not run on the Triton scans (segment_scan.py) here, "" when it does.
    Gated like a backend: while `segment_scan.GPU_VERIFIED` is False (their GPU tests in
    tests/test_gpu.py not yet passed), only GDR_ALLOW_UNVERIFIED=1 runs them."""
    if torch.device(dev).type != "cuda":
        return "not on CUDA"
    from ..kernels import segment_scan

    why = segment_scan.not_supported_reason(K, V, acc, dev)
    if not why and not segment_scan.GPU_VERIFIED and not unverified_allowed():
        why = unverified_reason("the Triton scans")
    return why


def _scan_kernels(K: int, V: int, acc: torch.dtype, dev: torch.device):
    """The Triton scan module (segment_scan.py) where it takes the maps here, else None (the
    torch scan; `_scan_kernels_refusal` says why)."""
    if _scan_kernels_refusal(K, V, acc, dev):
        return None
    from ..kernels import segment_scan

    return segment_scan


def _scan_and_run(call, s, pick, index, seg_call, Ms, Rs, Ds, run, states=None) -> GDRGrads:
    """Pass 2 (the scan over each sequence's segments) and pass 3 (the segments as one varlen
    call of `run`); `index` holds the non-empty segments' (sequence, segment) index tensors;
    `states` (`_states_kernel`), if given, makes pass 3's `h` from the segments' start states."""
    acc = call.acc_dtype
    N, H, K, V, BT = call.N, call.H, call.K, call.V, call.chunk_size
    dev = call.q.device
    # pass 2: the scans over the segments of every sequence at once
    h0 = cm.states_in(call.initial_state, call.state_v_first)
    dht = cm.states_in(call.dht, call.state_v_first)
    S0 = None if h0 is None else h0.to(acc)
    dS_end = None if dht is None else dht.to(acc)
    kernels = _scan_kernels(K, V, acc, dev)
    ends = None
    if call.h is not None:  # every non-empty segment starts on a real chunk: the caller's state there (as unsplit)
        first_chunk = list(itertools.accumulate([0] + chunk_counts(call.seq_lens, BT)))
        rows = device_constant(tuple(first_chunk[n] + j * s for n, j in pick), torch.int64, dev)
        init = cm.states_in(call.h, call.state_v_first).reshape(-1, H, K, V)[rows].to(acc)
    elif kernels is not None:  # both scans in one launch
        starts, ends, dh0 = kernels.both_scans(Ms, Rs, S0, Ds, dS_end)
        init = _from_grid(starts, pick, index)
    else:
        S0 = torch.zeros(N, H, K, V, dtype=acc, device=dev) if S0 is None else S0
        A, B = _prefix_maps(Ms, Rs)  # segment j's end state = A_j S0 + B_j
        starts = torch.cat([S0[:, None], (A[:, :-1] @ S0[:, None] + B[:, :-1])], dim=1)  # [N, n_seg, H, K, V]
        init = _from_grid(starts, pick, index)
    if ends is None and kernels is not None:
        ends, dh0 = kernels.backward_scan(Ms, Ds, dS_end)
    elif ends is None:
        dS_end = torch.zeros(N, H, K, V, dtype=acc, device=dev) if dS_end is None else dS_end
        # dS_j = M_j^T dS_{j+1} + D_j from dS_{n_seg} = dht, as a prefix over the reversed segments
        Ab, Bb = _prefix_maps(Ms.flip(1).transpose(-1, -2), Ds.flip(1))  # dS_{n_seg-1-i} = Ab_i dht + Bb_i
        dS = (Ab @ dS_end[:, None] + Bb).flip(1)  # dS[:, j]: the gradient at segment j's start
        ends = torch.cat([dS[:, 1:], dS_end[:, None]], dim=1)  # at segment j's end
        dh0 = dS[:, 0]  # the first segment's start gradient is the sequence's dh0
    grad_end = _from_grid(ends, pick, index)

    # pass 3: the non-empty segments as the sequences of one varlen call
    h = None if call.h is None else call.h.reshape(1, -1, *call.h.shape[2:])
    if states is not None:
        h = states(init)
    out_dt = _state_dtype(call)
    init, grad_end = init.to(out_dt), grad_end.to(out_dt)
    if call.state_v_first:
        init, grad_end = init.transpose(-1, -2).contiguous(), grad_end.transpose(-1, -2).contiguous()
    # pass 1's validated call with the states added: they are ours and right by construction, so
    # no second `validate` (~35 us of host time per split call, which is host-bound eager)
    grads = run(replace(seg_call, dht=grad_end, h=h, initial_state=init, state_v_first=call.state_v_first))

    def back(x):
        return x.reshape(call.B, call.T, *x.shape[2:])

    if call.initial_state is None:
        dh0 = None
    else:
        dh0 = (dh0.transpose(-1, -2) if call.state_v_first else dh0).to(out_dt).contiguous()
    return GDRGrads(back(grads.dq), back(grads.dk), back(grads.dv), back(grads.dg), back(grads.db), dh0)
