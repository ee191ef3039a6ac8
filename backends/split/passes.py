"""Exact intra-GPU context parallelism: a sequence cut into segments of whole chunks, each
segment run as an independent sequence of one varlen call.

The chunk-state map is affine (docs/contract.md): with `W = Ag diag(b e^G) K`,
`U0 = Ag diag(b) V` and `Kt = diag(e^{G_L - G}) K` for chunk c,

    S_{c+1}  = M_c S_c + R_c,          M_c = e^{G_L} I - Kt^T W,   R_c = Kt^T U0
    dS_c     = M_c^T dS_{c+1} + D_c,   D_c = scale (Q e^G)^T dO - W^T dV_local

where `dS_c` is the gradient w.r.t. chunk c's start state and `D_c` does not depend on any
state. So, per segment j of a sequence:

  1. its end state from a zero start (`R_j`), its start gradient from a zero end gradient (`D_j`),
     and its composed map `M_j`, all segments in parallel. Decay-aware: where the segment's
     summed log decay lies below the accumulation dtype's rounding (`threshold`: the term a
     warm-up drops is scaled by less than eps / 2) and every transition contracts, `R_j` needs
     only the segment's last few chunks and `D_j` its first few (their windows, `decay_plan`),
     and no `M_j` is formed: the next start state (previous end gradient) is that warm-up alone.
     Elsewhere the segment is joined exactly through `M_j`;
  2. per sequence, a chain over its segments: the start state of each (from `initial_state`, or
     the given `h`) and the end-state gradient (from `dht`), applying `M_j` only where exact;
  3. one varlen call of any backend over all segments, each with its start state as
     `initial_state` and its end gradient as `dht`; the sequence's `dh0` is its first segment's.

Pass 1 runs on our Triton kernels (segment_maps.py: the plan, then the windows and maps with W,
U0 and the local dV formed per chunk in registers; with `h=None` a third kernel writes pass 3's
`h` from the segments' start states, unless the backend recomputes them in a kernel of its own,
`Backend.own_state_recompute`) where they take the call, else on the kernels of the first
registered backend that offers them (`Backend.split_passes`, fla's state kernels: exact maps, no
windows), else as batched tensor products here (any device, fp32 or fp64 accumulation, decay-aware
as the kernels; what the CPU tests hold the split to). Pass 2 runs as one Triton kernel on CUDA
for fp32 maps (segment_scan.py), else as a loop over the segments' places in batched products.
`GDR_CP=<n>` forces at most n segments per sequence, `GDR_CP=0` turns the split off; unset, the
autotuner tries `(backend, segments)` candidates (`SplitBackend`, __init__.py) on grids with fewer
sequence x head programs than SMs, and a table may store one as `<backend>@split<n>`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from gdr_dispatch import chunked_math as cm
from gdr_dispatch.caches import first_time
from gdr_dispatch.contract import GDRCall, GDRGrads, chunk_counts, packed, validate
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


def _compose(M, R=None, D=None):
    """Fold the chunk axis (-4 of `[..., s, H, K, *]`) into one map per run of chunks, in
    log2(s) levels of batched products: (M2, R2) after (M1, R1) is (M2 M1, M2 R1 + R2), and
    the start gradient of the pair is M1^T D2 + D1. R or D None: not carried (None back)."""
    while M.shape[-4] > 1:
        if M.shape[-4] % 2:  # pad with an identity chunk (M = I, R = D = 0)
            eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device).expand_as(M[..., :1, :, :, :])
            M = torch.cat([M, eye], dim=-4)
            R = None if R is None else torch.cat([R, torch.zeros_like(R[..., :1, :, :, :])], dim=-4)
            D = None if D is None else torch.cat([D, torch.zeros_like(D[..., :1, :, :, :])], dim=-4)
        M1, M2 = M[..., 0::2, :, :, :], M[..., 1::2, :, :, :]
        if R is not None:
            R = M2 @ R[..., 0::2, :, :, :] + R[..., 1::2, :, :, :]
        if D is not None:
            D = M1.transpose(-1, -2) @ D[..., 1::2, :, :, :] + D[..., 0::2, :, :, :]
        M = M2 @ M1
    return tuple(None if x is None else x[..., 0, :, :, :] for x in (M, R, D))


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


@dataclass(frozen=True)
class Segments:
    """Every sequence cut into runs of `s` whole chunks (at most `n_seg` per sequence): the
    non-empty segments in order, each with its token count, sequence, place in the sequence and
    role (bit 0: the sequence's first, bit 1: its last); the token offsets of the segments' varlen
    call and each sequence's range of segments."""

    s: int
    n_seg: int
    lens: tuple
    seq: tuple
    place: tuple
    roles: tuple
    token_offsets: tuple  # S + 1
    seg_offsets: tuple  # N + 1
    first_chunks: tuple  # each segment's first chunk among all sequences' chunks (a row of `h`)

    @functools.cached_property
    def max_per_sequence(self) -> int:
        return max(b - a for a, b in zip(self.seg_offsets, self.seg_offsets[1:]))

    @functools.cached_property
    def firsts(self) -> tuple:
        """The first segment of each sequence that has one, and those sequences."""
        return (tuple(a for a, b in zip(self.seg_offsets, self.seg_offsets[1:]) if b > a),
                tuple(n for n, (a, b) in enumerate(zip(self.seg_offsets, self.seg_offsets[1:])) if b > a))

    @functools.cached_property
    def lasts(self) -> tuple:
        return (tuple(b - 1 for a, b in zip(self.seg_offsets, self.seg_offsets[1:]) if b > a),
                tuple(n for n, (a, b) in enumerate(zip(self.seg_offsets, self.seg_offsets[1:])) if b > a))

    @functools.cached_property
    def with_next(self) -> tuple:
        """The segments another of their sequence follows."""
        return tuple(j for j, role in enumerate(self.roles) if not role & 2)

    @functools.cached_property
    def with_prev(self) -> tuple:
        """The segments that follow another of their sequence."""
        return tuple(j for j, role in enumerate(self.roles) if not role & 1)

    def at_place(self, p: int, with_next: bool) -> tuple:
        """The segments at place `p` of their sequence (those followed by another, `with_next`)."""
        return tuple(j for j, (pl, r) in enumerate(zip(self.place, self.roles)) if pl == p and not (with_next and r & 2))


@functools.lru_cache(maxsize=256)
def segments_of(seq_lens: tuple, BT: int, segments: int) -> Segments:
    """`Segments` once per lengths (a training run repeats a handful; the Python loop over the
    segments was ~50 us of the split's host time per call at 32 segments, on a CPU)."""
    s = segment_length(seq_lens, BT, segments)
    n_seg = -(-max(chunk_counts(seq_lens, BT)) // s)
    lens, seq, place, roles, seg_offsets = [], [], [], [], [0]
    for n, length in enumerate(seq_lens):
        pieces = [min(max(length - j * s * BT, 0), s * BT) for j in range(n_seg)]
        pieces = [x for x in pieces if x > 0]
        for j, piece in enumerate(pieces):
            lens.append(piece)
            seq.append(n)
            place.append(j)
            roles.append((j == 0) | ((j == len(pieces) - 1) << 1))
        seg_offsets.append(len(lens))
    chunk0 = list(itertools.accumulate([0] + chunk_counts(seq_lens, BT)))
    return Segments(s, n_seg, tuple(lens), tuple(seq), tuple(place), tuple(roles),
                    tuple(itertools.accumulate([0] + lens)), tuple(seg_offsets),
                    tuple(chunk0[n] + j * s for n, j in zip(seq, place)))


def segment_plan(call: GDRCall, segments: int):
    """Chunks per segment `s`, segments per sequence `n_seg`, and the non-empty segments in
    order: their token counts and `(sequence, segment)` indices."""
    segs = segments_of(tuple(call.seq_lens), call.chunk_size, segments)
    return segs.s, segs.n_seg, list(segs.lens), list(zip(segs.seq, segs.place))


def threshold(acc: torch.dtype) -> float:
    """The summed log decay below which a warm-up's dropped term is under the accumulation dtype's
    rounding: ln(eps / 2), -16.6 for fp32 (e^-16.6 = 2^-24), -36.7 for fp64."""
    return math.log(torch.finfo(acc).eps / 2)


def _segments_inputs(call: GDRCall, offsets: tuple) -> tuple[dict, torch.Tensor]:
    """The call's per-token tensors as one packed sequence (a strided view copied once here, not by
    each pass's kernels), and the segments' `cu_seqlens` (a
    cached device constant: a fresh host-to-device copy, and `validate`'s read of a fresh
    cu_seqlens back to the host, stalled the stream on every split call): the inputs of pass 1's
    and pass 3's calls."""
    flat = {name: packed(getattr(call, name).reshape(1, call.B * call.T, *getattr(call, name).shape[2:]))
            for name in ("q", "k", "v", "a", "g", "b", "do")}
    return flat, device_constant(offsets, torch.int32, call.q.device)


def _state_dtype(call: GDRCall) -> torch.dtype:
    """The segments' `initial_state`/`dht` dtype: the accumulation dtype, at least fp32."""
    return call.acc_dtype if call.acc_dtype == torch.float64 else torch.float32


def _pieces_kernels_refusal(seg_call: GDRCall) -> str:
    """Why pass 1 does not run on our decay-aware kernels (segment_maps.segment_pieces), "" when
    it does: our maps' own refusal, or, while `segment_maps.PIECES_GPU_VERIFIED` is False, the
    unverified gate."""
    from ..kernels import segment_maps

    why = _maps_kernels_refusal(seg_call)
    if not why and not segment_maps.PIECES_GPU_VERIFIED and not unverified_allowed():
        why = unverified_reason("the decay-aware Triton pass 1")
    return why


def split_backward(call: GDRCall, segments: int, run: Callable[[GDRCall], GDRGrads],
                   states_by_run: bool = False, carried: tuple = ()) -> GDRGrads:
    """The backward of `call` with each sequence cut into runs of whole chunks.

    Every sequence is cut at multiples of `segment_length(...)` chunks (at most `segments`
    runs; shorter sequences get fewer). `run(call)` computes one validated backward call (a
    backend's `run`, or the dispatcher's); it receives the non-empty segments as one varlen
    call with `initial_state` and `dht` set. Pass 1 on our decay-aware kernels, a backend's maps
    (`pass_1_provider`) or batched tensor products; pass 2 the chains (`chain`).
    `states_by_run`: with `h=None`, `run`'s backend recomputes the segments' chunk states itself
    (`Backend.own_state_recompute`); else pass 1's Triton kernels write them where they ran.
    `carried`: the op's split forward's `(plan, M, starts)` on the same segments (carry.py): pass 1
    then walks only backwards, pass 2 chains only the end gradients.
    """
    segs = segments_of(tuple(call.seq_lens), call.chunk_size, segments)
    flat, offsets = _segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=call.chunk_size)  # no states
    need_starts = call.h is None and not carried  # with h given the starts come from h
    provider, decay_aware, plan, M, starts, ends = pass_1(call, segs, seg_call, need_starts, carried=carried)
    states = None if states_by_run else _states_kernel(call, seg_call, provider)
    problem = Problem.from_call(call)
    if first_time(("split passes", problem.table_key(), segments, provider, decay_aware, states_by_run,
                   bool(carried))):
        log.info("gdr_dispatch: split pass 1 (each segment's warm-up windows or exact maps) on %s, pass 2 (the "
                 "chains) on %s, %s%sfor %s", pass_1_words(seg_call, provider, decay_aware),
                 chain_words(call.K, call.V, call.acc_dtype, call.q.device),
                 "pass 3's chunk states on gdr_dispatch's kernels (its backend takes h given), " if states
                 else "pass 3's chunk states by its backend, " if states_by_run and call.h is None else "",
                 "the op's forward's start states carried (and its plan and maps where pass 1 is ours: "
                 "backward walks and chains only), " if carried else "", problem.describe())
    pass_2(call, segs, plan, M, starts, ends)
    if carried:  # complete already: the forward's chain ran from the same initial state
        starts = carried[2]
    return _run_segments(call, segs, seg_call, starts, ends, run, states)


def pass_1(call: GDRCall, segs: Segments, seg_call: GDRCall, need_starts: bool, need_ends: bool = True,
           carried: tuple = ()):
    """Pass 1 for `call` cut into `segs` (`seg_call`: the segments as one varlen call):
    `(provider, decay_aware, plan, M, starts, ends)` in `segment_maps.segment_pieces`' layout, on
    our decay-aware kernels, else a backend's exact maps, else tensor products (decay-aware).
    Without `need_ends` (the op's forward: `call.do` is a stand-in) the kernels skip the backward
    walk and `ends` is None; the other providers form it anyway, from the stand-in, unread.
    `carried` (the op's forward's `(plan, M, starts)`): our kernels take its plan and maps and walk
    only backwards; a backend's exact maps and the tensor products ignore it (their plan is
    their own)."""
    acc, dev = call.acc_dtype, call.q.device
    provider, maps = pass_1_provider(seg_call)
    decay_aware = provider == OUR_MAPS and not _pieces_kernels_refusal(seg_call)
    if decay_aware:
        from ..kernels import segment_maps

        roles = device_constant(segs.roles, torch.int32, dev)
        if carried:  # the forward's plan and maps: only the backward walk runs
            plan, M = carried[0], carried[1]
            _, starts, ends = segment_maps.segment_pieces(seg_call, plan, roles, False, need_ends, segs.s,
                                                          need_m=False)
        else:
            plan = segment_maps.decay_plan(seg_call, threshold(torch.float32), segs)
            M, starts, ends = segment_maps.segment_pieces(seg_call, plan, roles, need_starts, need_ends, segs.s)
    elif maps is not None:  # exact maps on the provider's kernels: every segment joined through M
        m, r, d = maps(seg_call, need_r=need_starts)
        plan = torch.zeros(len(segs.lens), call.H, 2, dtype=torch.int32, device=dev)
        M = m.to(acc)
        starts, ends = _shifted(segs, None if r is None else r.to(acc), d.to(acc))
    else:
        plan, M, starts, ends = _torch_pieces(call, segs, need_starts)
    return provider, decay_aware, plan, M, starts, ends


def pass_1_words(seg_call: GDRCall, provider: str, decay_aware: bool) -> str:
    """What ran pass 1, for the log line."""
    if decay_aware:
        return "our decay-aware Triton kernels"
    return (f"{provider}'s kernels, every segment exact" if provider != "torch products"
            else "torch products (decay-aware)") + f" (our Triton kernels: {_pieces_kernels_refusal(seg_call)})"


def chain_words(K: int, V: int, acc: torch.dtype, dev: torch.device) -> str:
    """What runs pass 2, for the log line."""
    why = _chain_kernels_refusal(K, V, acc, dev)
    return "a Triton kernel" if not why else f"torch products ({why})"


def pass_2(call: GDRCall, segs: Segments, plan, M, starts, ends) -> None:
    """The chains over every sequence's segments, completing `starts` and `ends` (either may be
    None) in place, from the call's `initial_state` and `dht`."""
    acc, dev = call.acc_dtype, call.q.device
    h0 = cm.states_in(call.initial_state, call.state_v_first)
    dht = cm.states_in(call.dht, call.state_v_first)
    S0 = None if h0 is None or starts is None else h0.to(acc)
    G_end = None if dht is None or ends is None else dht.to(acc)
    kernels = _chain_kernels(call.K, call.V, acc, dev)
    if kernels is not None:
        kernels.chain(M, starts, ends, plan, device_constant(segs.seg_offsets, torch.int32, dev),
                      segs.max_per_sequence, S0, G_end, tf32=call.q.dtype in (torch.float16, torch.bfloat16))
    else:
        _chain_torch(segs, plan, M, starts, ends, S0, G_end)


def _shifted(segs: Segments, r, d):
    """Each segment's end state from a zero start (`r`, None when unwanted) and start gradient from
    a zero end gradient (`d`) moved to where the chain completes them: `starts[j + 1]` and
    `ends[j - 1]` within a sequence."""
    dev = d.device
    starts = None
    if r is not None:
        starts = torch.empty(r.shape, dtype=r.dtype, device=dev)  # contiguous: the chain completes it in place
        if segs.with_next:
            src = device_constant(segs.with_next, torch.int64, dev)
            starts[src + 1] = r[src]
    ends = torch.empty(d.shape, dtype=d.dtype, device=dev)
    if segs.with_prev:
        src = device_constant(segs.with_prev, torch.int64, dev)
        ends[src - 1] = d[src]
    return starts, ends


def _windows(gend, real, bad, thr: float, s: int, cross: int, cap: int):
    """`decay_plan` in tensor ops (segment_maps._decay_plan's rule): per segment of `s` chunks and
    head, from each sequence's chunks' summed log decays `gend` `[N, L, H]` (L = segments x s),
    which chunks are real `[N, L]` and which break the contraction `bad` `[N, L, H]`: the windows
    `(n_f, n_b)` `[N, L / s, H]`, 0 where exact. A window may reach `cross` segments past its own
    (the chunks before its segment's end back to the start of the `cross`-th segment before, those
    from its start on to the end of the `cross`-th after; segment_maps.CROSS), `cap` chunks at most."""
    N, L, H = gend.shape
    n_seg, W, dev = L // s, (1 + cross) * s, gend.device
    j = torch.arange(n_seg, device=dev)[:, None]
    r = torch.arange(min(W, cap), device=dev)[None, :]
    W = r.shape[-1]
    nc = real.view(N, n_seg, s).sum(-1)[..., None]  # [N, n_seg, 1]
    count = real.sum(-1)[:, None, None]
    # back from each segment's end (down to its reach) and on from its start (up to its reach)
    pos_f = j * s + nc - 1 - r
    ok_f = (pos_f >= ((j - cross) * s).clamp(min=0)) & (nc > 0)
    pos_b = (j * s + r).expand(N, n_seg, W)
    ok_b = (pos_b < torch.minimum(count, (j + 1 + cross) * s)) & (nc > 0)

    def along(x, pos, ok):  # [N, L, H] at pos [N, n_seg, W] -> [N, n_seg, W, H], 0 where not ok
        got = x.gather(1, pos.clamp(0, L - 1).reshape(N, -1, 1).expand(N, n_seg * W, H)).view(N, n_seg, W, H)
        return torch.where(ok[..., None], got, torch.zeros((), dtype=x.dtype, device=dev))

    tail = along(gend, pos_f, ok_f).cumsum(-2)  # each from its own end of the segment (as the kernel)
    head = along(gend, pos_b, ok_b).cumsum(-2)
    rr = r[..., None]
    c_f = torch.where(ok_f[..., None] & (tail < thr), rr, W).amin(-2)
    c_b = torch.where(ok_b[..., None] & (head < thr), rr, W).amin(-2)
    n_f = torch.where(c_f < W, c_f + 1, 0)
    n_b = torch.where(c_b < W, c_b + 1, 0)
    broken = ((along(bad, pos_f, ok_f) & (rr < n_f[..., None, :])).any(-2)
              | (along(bad, pos_b, ok_b) & (rr < n_b[..., None, :])).any(-2))
    warm = (n_f > 0) & (n_b > 0) & ~broken
    return torch.where(warm, n_f, 0), torch.where(warm, n_b, 0)


def _torch_pieces(call: GDRCall, segs: Segments, need_starts: bool):
    """Pass 1 as batched tensor products, decay-aware as the kernels: `(plan, M, starts, ends)` in
    `segment_maps.segment_pieces`' layout. A segment's windows are compositions over the chunks
    before its end (forward) and from its start (backward) with the chunks outside the window
    replaced by zero maps; an exact segment's are over its own chunks."""
    from ..kernels import segment_maps

    acc = call.acc_dtype
    N, H, K, BT = call.N, call.H, call.K, call.chunk_size
    s, n_seg = segs.s, segs.n_seg
    dev = call.q.device
    cross = segment_maps.window_reach(dev)
    L, W = n_seg * s, (1 + cross) * s
    lay, M, R, D = chunk_maps(call)  # [N, C, H, ...]; chunks past a sequence's end are not maps yet
    counts = device_constant(tuple(chunk_counts(call.seq_lens, BT)), torch.int64, dev)
    C = M.shape[1]
    real = torch.arange(L, device=dev)[None, :] < counts[:, None]  # [N, L]
    eye = torch.eye(K, dtype=acc, device=dev)
    zero = torch.zeros((), dtype=acc, device=dev)
    pad = L - C

    def flat(x, fill):  # [N, C, H, ...] -> [N, L, H, ...], `fill` past each sequence's end
        if pad:
            x = torch.cat([x, fill.expand(N, pad, *x.shape[2:]) if fill.dim() else x.new_zeros(N, pad, *x.shape[2:])], 1)
        return torch.where(real.view(N, L, *([1] * (x.dim() - 2))), x, fill)

    M, R, D = flat(M, eye), flat(R, zero), flat(D, zero)
    # each chunk's summed log decay and whether a token of it breaks the contraction (b |k|^2 outside [0, 2])
    gates = lay.gather_gate(call.g, acc)  # [N, C, H, BT], padded rows repeat the last value
    gend = flat(gates[..., -1], zero)  # [N, L, H]
    # a (sequence, head) whose log decay rises anywhere (g > 0, or NaN) is joined exactly throughout:
    # its state can grow, so no window's summed decay bounds what it drops (as the kernels' plan)
    inc = torch.diff(gates, dim=-1, prepend=torch.zeros_like(gates[..., :1]))
    grows = ((inc > 0) | inc.isnan()).any(-1).any(1)  # [N, H]
    k = cm.expand_heads(lay.gather(call.k, acc), H)
    x = lay.gather(call.b, acc) * (k * k).sum(-1)
    bad = flat((~((x >= 0) & (x <= 2))).any(-1), torch.zeros((), dtype=torch.bool, device=dev))  # (NaN: bad)
    n_f, n_b = _windows(gend, real, bad, threshold(acc), s, cross,
                        segment_maps.window_cap(s, segs.max_per_sequence, cross))  # [N, n_seg, H]
    n_f, n_b = (torch.where(grows[:, None, :], 0, n) for n in (n_f, n_b))
    # an exact segment's maps over its own chunks; a window's over the W chunks ending at its
    # segment's end (forward) or starting at its start (backward), zero maps outside it
    Mf, _, _ = _compose(M.view(N, n_seg, s, *M.shape[2:]))  # the forward windows' R, the backward's D: below
    j = torch.arange(n_seg, device=dev)[None, :, None, None]
    w = torch.arange(W, device=dev)[None, None, :, None]
    nc = real.view(N, n_seg, s).sum(-1)[:, :, None, None]
    end = j * s + nc
    pos_f = end - W + w  # [N, n_seg, W, 1]
    keep_f = pos_f >= end - torch.where(n_f[:, :, None, :] > 0, n_f[:, :, None, :], nc)  # [N, n_seg, W, H]
    pos_b = j * s + w
    keep_b = (w < torch.where(n_b[:, :, None, :] > 0, n_b[:, :, None, :], nc)) & (pos_b < L)

    def window(x, pos, keep):  # [N, L, H, a, b] -> [N, n_seg, W, H, a, b], zero maps outside `keep`
        got = x[torch.arange(N, device=dev)[:, None, None], pos[..., 0].clamp(0, L - 1)]
        return torch.where(keep[..., None, None], got, zero)

    index = (device_constant(segs.seq, torch.int64, dev), device_constant(segs.place, torch.int64, dev))
    Rf = _compose(window(M, pos_f, keep_f), R=window(R, pos_f, keep_f))[1][index] if need_starts else None
    _, _, Db = _compose(window(M, pos_b, keep_b), D=window(D, pos_b, keep_b))
    plan = torch.stack([n_f, n_b], -1)[index].to(torch.int32)
    starts, ends = _shifted(segs, Rf, Db[index])
    return plan, Mf[index], starts, ends


def _chain_torch(segs: Segments, plan, M, starts, ends, S0, G_end) -> None:
    """`segment_scan.chain` in batched products, one step per place in the sequences."""
    dev = plan.device
    exact = (plan[..., 0] == 0)[..., None, None]  # [S, H, 1, 1]
    for slots, lasts in ((starts, False), (ends, True)):
        if slots is None:
            continue
        j, n = segs.lasts if lasts else segs.firsts
        edge = S0 if not lasts else G_end
        j = device_constant(j, torch.int64, dev)
        slots[j] = torch.zeros_like(slots[j]) if edge is None else edge[device_constant(n, torch.int64, dev)]
    if starts is not None:
        for p in range(segs.n_seg - 1):
            j = device_constant(segs.at_place(p, with_next=True), torch.int64, dev)
            nxt = starts[j + 1]
            starts[j + 1] = torch.where(exact[j], M[j] @ starts[j] + nxt, nxt)
    for p in range(segs.n_seg - 1, 0, -1) if ends is not None else ():
        j = device_constant(segs.at_place(p, with_next=False), torch.int64, dev)
        prv = ends[j - 1]
        ends[j - 1] = torch.where(exact[j], M[j].transpose(-1, -2) @ ends[j] + prv, prv)


def _run_segments(call: GDRCall, segs: Segments, seg_call: GDRCall, starts, ends, run, states) -> GDRGrads:
    """Pass 3: the segments as the sequences of one varlen call of `run`, from their start states
    (`starts`, or the caller's `h` at their first chunks) and end gradients; `states`, if given,
    makes pass 3's `h` from the start states."""
    acc = call.acc_dtype
    H, K, V = call.H, call.K, call.V
    dev = call.q.device
    if call.h is not None:  # every segment starts on a real chunk: the caller's state there (as unsplit)
        rows = device_constant(segs.first_chunks, torch.int64, dev)
        init = cm.states_in(call.h, call.state_v_first).reshape(-1, H, K, V)[rows].to(acc)
    else:
        init = starts
    h = None if call.h is None else call.h.reshape(1, -1, *call.h.shape[2:])
    if states is not None:
        h = states(init)
    out_dt = _state_dtype(call)
    init, grad_end = init.to(out_dt), ends.to(out_dt)
    if call.state_v_first:
        init, grad_end = init.transpose(-1, -2).contiguous(), grad_end.transpose(-1, -2).contiguous()
    # pass 1's validated call with the states added: they are ours and right by construction, so
    # no second `validate` (~35 us of host time per split call, which is host-bound eager)
    grads = run(replace(seg_call, dht=grad_end, h=h, initial_state=init, state_v_first=call.state_v_first))

    def back(x):
        return x.reshape(call.B, call.T, *x.shape[2:])

    dh0 = None
    if call.initial_state is not None:  # each sequence's first segment's; a sequence of no tokens passes dht on
        j, n = segs.firsts
        dh0 = grads.dh0[device_constant(j, torch.int64, dev)]
        if len(n) < call.N:
            whole = (torch.zeros(call.state_shape(), dtype=out_dt, device=dev) if call.dht is None
                     else call.dht.to(out_dt).clone())
            whole[device_constant(n, torch.int64, dev)] = dh0
            dh0 = whole
        dh0 = dh0.to(out_dt).contiguous()
    return GDRGrads(back(grads.dq), back(grads.dk), back(grads.dv), back(grads.dg), back(grads.db), dh0)


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


def _torch_pass_1(call: GDRCall, s: int, n_seg: int):
    """Pass 1 as batched tensor products, exact: `(M, R, D)` of every segment, `[N, n_seg, H, ...]`."""
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


def _chain_kernels_refusal(K: int, V: int, acc: torch.dtype, dev: torch.device) -> str:
    """Why pass 2 does not run on the Triton chain (segment_scan.py) here, "" when it does.
    Gated like a backend: while `segment_scan.GPU_VERIFIED` is False (its GPU tests in
    tests/test_gpu.py not yet passed), only GDR_ALLOW_UNVERIFIED=1 runs it."""
    if torch.device(dev).type != "cuda":
        return "not on CUDA"
    from ..kernels import segment_scan

    why = segment_scan.not_supported_reason(K, V, acc, dev)
    if not why and not segment_scan.GPU_VERIFIED and not unverified_allowed():
        why = unverified_reason("the Triton chain")
    return why


def _chain_kernels(K: int, V: int, acc: torch.dtype, dev: torch.device):
    """The Triton chain's module (segment_scan.py) where it takes the pieces here, else None (the
    torch chain; `_chain_kernels_refusal` says why)."""
    if _chain_kernels_refusal(K, V, acc, dev):
        return None
    from ..kernels import segment_scan

    return segment_scan
