"""Context parallelism across GPUs: one long sequence (or a varlen pack) over the ranks of a
`torch.distributed` process group, exact, through the same affine state maps as the intra-GPU
split (passes.py; docs/design.md, "Context parallelism across ranks").

Convention: each rank holds a contiguous slice of the packed tokens, in rank order (lengths may
differ; the ranks learn each other's from one small all-gather); `cu_seqlens`, when given, is the
global one, identical on every rank, and sequences may cross rank edges (without it, B = 1 and the
slices form one sequence); `initial_state` is the global `[N, H, K, V]`, identical everywhere.
A rank's *pieces* are the intersections of its slice with the sequences; each is a sequence of the
rank's local varlen call.

Forward: every rank composes its pieces' maps (`S_end = M S_start + R`), one all-gather of
`[N, H, K, K + V]` per rank (identity for the sequences a rank does not touch), then a scan over
the ranks gives each piece's start state and every sequence's final state on every rank, and the
local forward runs from the start states. Backward: the mirror: each piece's `D` (its start-state
gradient from a zero end gradient) and the rank's share of the final state's gradient, one
all-gather, a reverse scan gives each piece's end-state gradient, and the local `fused_gdr_bwd`
(any backend, the intra-GPU split included) runs with them. A rank's gradient for
`initial_state` is its share: the rank holding a sequence's first token returns it (rank 0 for a
sequence of no tokens), the others zeros.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from gdr_dispatch.caches import first_time
from gdr_dispatch.contract import (GDRGrads, _expect_tensor, check_cu_seqlens_form, check_forward_structure, check_state,
                                   validate)
from gdr_dispatch.graph_safe import offsets_of

from .forward import residuals
from .passes import sequence_maps

log = logging.getLogger("gdr_dispatch")


@dataclass(frozen=True)
class RankLayout:
    """Where this rank's tokens sit among all ranks' and which pieces of which sequences it holds."""

    world: int
    rank: int
    starts: tuple[int, ...]  # each rank's first token (world + 1 entries, the last the total)
    bounds: tuple[int, ...]  # the global cu_seqlens (N + 1)
    pieces: tuple[tuple[int, int, int], ...]  # (sequence, first token, end token), global positions

    @property
    def N(self) -> int:
        return len(self.bounds) - 1

    @property
    def local_cu(self) -> tuple[int, ...]:
        out = [0]
        for _, lo, hi in self.pieces:
            out.append(out[-1] + hi - lo)
        return tuple(out)

    def piece_index(self, device) -> torch.Tensor:
        """Each piece's global sequence, as an index into `[N, ...]` tensors."""
        return torch.tensor([n for n, _, _ in self.pieces], dtype=torch.long, device=device)

    def holds_start(self, n: int) -> bool:
        """Whether this rank holds sequence n's first token (rank 0 for a sequence of none)."""
        lo, hi = self.bounds[n], self.bounds[n + 1]
        if lo == hi:
            return self.rank == 0
        return self.starts[self.rank] <= lo < self.starts[self.rank + 1]


def _comm_device(group, device: torch.device) -> torch.device:
    import torch.distributed as dist

    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def check_group(group) -> None:
    """`cp_group` must be a `torch.distributed` process group."""
    import torch.distributed as dist

    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"cp_group: expected a torch.distributed process group (e.g. dist.group.WORLD), got "
                        f"{type(group).__name__}")


def layout(group, T_local: int, cu_seqlens: Optional[torch.Tensor], chunk_size: Optional[int],
           device: torch.device, local_error: Optional[BaseException] = None) -> RankLayout:
    """The ranks' offsets (one all-gather of an int64 and a flag) and this rank's pieces.
    `local_error`: this rank's own arguments failed their checks; every rank then raises (the
    failing one its own error), so no rank waits in a collective the others never reach.
    `chunk_size`: the rank edges inside a sequence must fall on whole chunks of it
    (`fused_gdr_bwd`'s `a` and `g` are chunk-local); None: anywhere (the op chunks each piece)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.tensor([T_local, int(local_error is not None)], dtype=torch.int64, device=_comm_device(group, device))
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=group)
    if local_error is not None:
        raise local_error
    failed = [r for r, s in enumerate(sizes) if int(s[1])]
    if failed:
        raise ValueError(f"cp_group: rank(s) {failed} refused their arguments (their own errors name them)")
    empty = [r for r, s in enumerate(sizes) if int(s[0]) == 0]
    if empty:
        raise ValueError(f"cp_group: every rank holds at least one token of the packed sequences; rank(s) {empty} "
                         f"hold none")
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + int(s[0].item()))
    total = starts[-1]
    if cu_seqlens is None:
        bounds = (0, total)
    else:
        check_cu_seqlens_form(cu_seqlens, 1)
        bounds = offsets_of(cu_seqlens)
        if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
            raise ValueError(f"cu_seqlens: with cp_group the global offsets, from 0 to the ranks' {total} tokens in "
                             f"all, non-decreasing; got {list(bounds)}")
    lo_r, hi_r = starts[rank], starts[rank + 1]
    pieces = []
    for n in range(len(bounds) - 1):
        lo, hi = max(bounds[n], lo_r), min(bounds[n + 1], hi_r)
        if lo < hi:
            pieces.append((n, lo, hi))
    if chunk_size is not None:
        for r in range(1, world):
            edge = starts[r]
            for n in range(len(bounds) - 1):
                if bounds[n] < edge < bounds[n + 1] and (edge - bounds[n]) % chunk_size:
                    raise ValueError(f"cp_group: rank {r} starts at token {edge}, inside sequence {n} (tokens "
                                     f"{bounds[n]}-{bounds[n + 1]}) off its {chunk_size}-token chunk grid; with `a` "
                                     f"and `g` per chunk the rank edges inside a sequence fall on whole chunks")
    return RankLayout(world, rank, tuple(starts), tuple(bounds), tuple(pieces))


def _gather(group, x: torch.Tensor) -> torch.Tensor:
    """`[world, *x.shape]`: every rank's `x` (the one collective of a direction)."""
    import torch.distributed as dist

    dev = _comm_device(group, x.device)
    mine = x.to(dev).contiguous()
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return torch.stack(parts).to(x.device)


def _dense(lay: RankLayout, per_piece: torch.Tensor, fill: str) -> torch.Tensor:
    """`[pieces, H, ...]` -> `[N, H, ...]` by global sequence; identity or zeros elsewhere."""
    shape = (lay.N,) + tuple(per_piece.shape[1:])
    if fill == "eye":
        out = torch.eye(shape[-1], dtype=per_piece.dtype, device=per_piece.device).expand(shape).clone()
    else:
        out = per_piece.new_zeros(shape)
    for i, (n, _, _) in enumerate(lay.pieces):
        out[n] = per_piece[i]
    return out


def _forward_scan(M, R, S0):
    """Per rank r, the states entering it (`[world, N, H, K, V]`) and every sequence's end state:
    `S <- M_r S + R_r` over the ranks in order, from `S0`."""
    starts = []
    S = S0
    for r in range(M.shape[0]):
        starts.append(S)
        S = M[r] @ S + R[r]
    return torch.stack(starts), S


def _backward_scan(M, D, G_end):
    """Per rank r, the gradient at its pieces' ends (`[world, N, H, K, V]`) and at every
    sequence's start: `G <- M_r^T G + D_r` over the ranks in reverse, from `G_end`."""
    ends = [None] * M.shape[0]
    G = G_end
    for r in range(M.shape[0] - 1, -1, -1):
        ends[r] = G
        G = M[r].transpose(-1, -2) @ G + D[r]
    return torch.stack(ends), G


def _kv(x, v_first: bool):
    return None if x is None else (x.transpose(-1, -2) if v_first else x)


def _start_states(initial_state, v_first: bool, shape: tuple, acc, device) -> torch.Tensor:
    """The global initial state in K x V layout and the accumulation dtype, zeros without one."""
    h0 = _kv(initial_state, v_first)
    return torch.zeros(shape, dtype=acc, device=device) if h0 is None else h0.to(acc)


def _check_tensors(q, named) -> None:
    """The optional tensors `named` (name -> tensor or None): tensors, on q's device."""
    for name, x in named:
        if x is not None and _expect_tensor(name, x).device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (the device of q), got {x.device}")


def _say(what: str, lay: RankLayout, nbytes: int) -> None:
    if first_time(("cp", what, lay.world, lay.N, nbytes)):
        log.info("gdr_dispatch: cp %s over %d ranks: %d sequences, this rank %d pieces; one all-gather of %.2f MiB "
                 "per rank", what, lay.world, lay.N, len(lay.pieces), nbytes / 2 ** 20)


# ---------------------------------------------------------------------------------------
# fused_gdr_bwd(..., cp_group=...)
# ---------------------------------------------------------------------------------------
def backward(q, k, v, a, g, b, do, dht, h, *, scale, initial_state, cu_seqlens, chunk_size, state_v_first,
             group, run) -> GDRGrads:
    """`fused_gdr_bwd` of a rank's slice with the other ranks' (module docstring): `dht` is this
    rank's share of the final state's gradient; `h`, when given, this rank's chunks of it (the
    rank edges fall on whole chunks of their sequences). `run(call)` is the dispatcher's backward
    of one validated local call."""
    from dataclasses import replace

    check_group(group)
    error, base = None, None
    try:
        _check_tensors(q, (("dht", dht), ("h", h), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens)))
        base = validate(q, k, v, a, g, b, do, scale=scale, chunk_size=chunk_size, state_v_first=state_v_first)
        if base.B != 1:
            raise ValueError(f"q: with cp_group the ranks' slices are packed tokens, B == 1; got B={base.B}")
    except (TypeError, ValueError) as e:
        error = e
    lay = layout(group, 0 if base is None else base.T, cu_seqlens, chunk_size, q.device, local_error=error)
    acc = base.acc_dtype
    N, H, K, V = lay.N, base.H, base.K, base.V
    for name, x in (("initial_state", initial_state), ("dht", dht)):
        if x is not None:
            check_state(name, x, N, H, K, V, state_v_first)
    cu = torch.tensor(lay.local_cu, dtype=torch.int32, device=q.device)
    pc = validate(q, k, v, a, g, b, do, h=h, scale=base.scale, cu_seqlens=cu, chunk_size=chunk_size,
                  state_v_first=state_v_first)
    M, R, D = sequence_maps(replace(pc, h=None), need_r=h is None)
    state = _kv(dht, state_v_first)
    share = torch.zeros(N, H, K, V, dtype=acc, device=q.device) if state is None else state.to(acc)
    parts = [_dense(lay, M, "eye").flatten(2), _dense(lay, D, "zeros").flatten(2), share.flatten(2)]
    if h is None:
        parts.append(_dense(lay, R, "zeros").flatten(2))
    msg = torch.cat(parts, dim=-1)
    _say("backward", lay, msg.numel() * msg.element_size())
    got = _gather(group, msg)  # [world, N, H, ...]
    split = got.split([K * K, K * V, K * V] + ([K * V] if h is None else []), dim=-1)
    Mw = split[0].reshape(lay.world, N, H, K, K)
    G_end = split[2].reshape(lay.world, N, H, K, V).sum(0)
    ends, _ = _backward_scan(Mw, split[1].reshape(lay.world, N, H, K, V), G_end)
    idx = lay.piece_index(q.device)
    if h is None:
        S0 = _start_states(initial_state, state_v_first, (N, H, K, V), acc, q.device)
        starts, _ = _forward_scan(Mw, split[3].reshape(lay.world, N, H, K, V), S0)
        init = starts[lay.rank][idx]
    else:  # each piece starts on one of the caller's chunks: its state there
        first = [0]
        for _, lo, hi in lay.pieces:
            first.append(first[-1] + -(-(hi - lo) // chunk_size))
        rows = torch.tensor(first[:-1], dtype=torch.long, device=q.device)
        init = _kv(h, state_v_first).reshape(-1, H, K, V)[rows].to(acc)
    state_dt = acc if acc == torch.float64 else torch.float32
    grads = run(replace(pc, dht=_kv(ends[lay.rank][idx], state_v_first).to(state_dt).contiguous(),
                        initial_state=_kv(init, state_v_first).to(state_dt).contiguous()))
    return grads._replace(dh0=_dh0_share(lay, grads.dh0, G_end, state_v_first, acc) if initial_state is not None
                          else None)


def _dh0_share(lay: RankLayout, dh0_pieces, G_end, v_first: bool, acc):
    """This rank's share of the gradient w.r.t. the global initial state (module docstring)."""
    H, K, V = G_end.shape[1:]
    dh0 = torch.zeros((lay.N, H, V, K) if v_first else (lay.N, H, K, V), dtype=acc, device=G_end.device)
    for i, (n, lo, _) in enumerate(lay.pieces):
        if lo == lay.bounds[n]:
            dh0[n] = dh0_pieces[i]
    for n in range(lay.N):
        if lay.bounds[n] == lay.bounds[n + 1] and lay.rank == 0:
            dh0[n] = _kv(G_end[n], v_first)
    return dh0


# ---------------------------------------------------------------------------------------
# chunk_gated_delta_rule(..., cp_group=...)
# ---------------------------------------------------------------------------------------
class _CPOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, state_v_first,
                save_states, group, chunk):
        check_group(group)
        error = None
        try:
            check_forward_structure(q, k, v, g, beta, None, None, state_v_first, chunk)
            _check_tensors(q, (("initial_state", initial_state), ("cu_seqlens", cu_seqlens)))
            if q.shape[0] != 1:
                raise ValueError(f"q: with cp_group the ranks' slices are packed tokens, B == 1; got B={q.shape[0]}")
        except (TypeError, ValueError) as e:
            error = e
        lay = layout(group, 0 if error is not None else q.shape[1], cu_seqlens, None,
                     q.device if isinstance(q, torch.Tensor) else torch.device("cpu"), local_error=error)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        H, K, V = v.shape[2], q.shape[3], v.shape[3]
        if initial_state is not None:
            check_state("initial_state", initial_state, lay.N, H, K, V, state_v_first)
        cu = torch.tensor(lay.local_cu, dtype=torch.int32, device=q.device)
        G, a = residuals(q, k, v, g, beta, cu, chunk)
        pc = validate(q, k, v, a.to(q.dtype), G.to(acc), beta, torch.zeros_like(v), scale=scale, cu_seqlens=cu,
                      chunk_size=chunk)
        M, R, _ = sequence_maps(pc, need_r=True)
        msg = torch.cat([_dense(lay, M, "eye").flatten(2), _dense(lay, R, "zeros").flatten(2)], dim=-1)
        _say("forward", lay, msg.numel() * msg.element_size())
        got = _gather(group, msg)
        Mw, Rw = got.split([K * K, K * V], dim=-1)
        Mw, Rw = Mw.reshape(lay.world, lay.N, H, K, K), Rw.reshape(lay.world, lay.N, H, K, V)
        starts, finals = _forward_scan(Mw, Rw, _start_states(initial_state, state_v_first, (lay.N, H, K, V), acc,
                                                             q.device))
        init = _kv(starts[lay.rank][lay.piece_index(q.device)], state_v_first).to(acc).contiguous()
        o, _, G, a, h = torch.ops.gdr_dispatch.chunk_gdr_fwd(q, k, v, g, beta, init, cu, scale, False,
                                                             state_v_first, save_states)
        ctx.save_for_backward(q, k, v, beta, G, a, h, init, cu, Mw)
        ctx.lay, ctx.scale, ctx.v_first, ctx.save_states, ctx.group = lay, scale, state_v_first, save_states, group
        ctx.g_dtype, ctx.h0_dtype, ctx.has_h0 = g.dtype, None if initial_state is None else initial_state.dtype, \
            initial_state is not None
        ht = _kv(finals, state_v_first).contiguous() if output_final_state else q.new_empty(0)
        ctx.mark_non_differentiable(*(() if output_final_state else (ht,)))
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        from gdr_dispatch.dispatch import fused_gdr_bwd

        q, k, v, beta, G, a, h, init, cu, Mw = ctx.saved_tensors
        lay, v_first = ctx.lay, ctx.v_first
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        N, H, K, V = lay.N, v.shape[2], q.shape[3], v.shape[3]
        do = torch.zeros_like(v) if do is None else do.to(q.dtype)
        pc = validate(q, k, v, a, G, beta, do, scale=ctx.scale, cu_seqlens=cu, chunk_size=a.shape[-1])
        _, _, D = sequence_maps(pc, need_r=False)
        share = torch.zeros(N, H, K, V, dtype=acc, device=q.device)
        if dht is not None and dht.numel() > 0:
            share = _kv(dht, v_first).to(acc)
        msg = torch.cat([_dense(lay, D, "zeros").flatten(2), share.flatten(2)], dim=-1)
        _say("backward", lay, msg.numel() * msg.element_size())
        got = _gather(ctx.group, msg)
        Dw, shares = got.split([K * V, K * V], dim=-1)
        G_end = shares.reshape(lay.world, N, H, K, V).sum(0)
        ends, _ = _backward_scan(Mw, Dw.reshape(lay.world, N, H, K, V), G_end)
        end_grad = _kv(ends[lay.rank][lay.piece_index(q.device)], v_first).to(init.dtype).contiguous()
        grads = fused_gdr_bwd(q, k, v, a, G, beta, do, end_grad, h if ctx.save_states else None, scale=ctx.scale,
                              initial_state=init, cu_seqlens=cu, chunk_size=a.shape[-1], state_v_first=v_first)
        dh0 = _dh0_share(lay, grads.dh0, G_end, v_first, acc).to(ctx.h0_dtype) if ctx.has_h0 else None
        return (grads.dq, grads.dk, grads.dv, grads.dg.to(ctx.g_dtype), grads.db, dh0,
                None, None, None, None, None, None, None)


def op(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, state_v_first, save_states, group,
       chunk: int):
    """The training op's forward and backward across the ranks of `group` (eager: the collectives
    run in a torch.autograd.Function)."""
    return _CPOp.apply(q, k, v, g, beta, initial_state, cu_seqlens, scale, bool(output_final_state),
                       bool(state_v_first), bool(save_states), group, chunk)
