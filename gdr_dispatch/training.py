"""`chunk_gated_delta_rule`: the training drop-in, differentiable, with the backward dispatched.

    o, final_state = gdr_dispatch.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                         output_final_state=True)

fla-core 0.6's semantics for the arguments it shares with fla's op (`g` the per-token natural-log
decay, not cumulated; `beta` already in (0, 1); varlen through `cu_seqlens` with `B == 1`).
The forward saves exactly the contract's residuals (docs/contract.md: the chunk cumsum `G`, the
ungated inverse `a`, and `h` or not) and the backward is `fused_gdr_bwd`, so the tuning tables and
`GDR_BACKEND` decide which backend runs it. The forward comes from a backend that offers one
(`Backend.forward`): `GDR_FORWARD=<name>` picks it, else the lowest `forward_rank` that takes the
call (FlashQLA's fused forward where flash-qla is installed, else fla-core's kernels on a GPU, the
torch reference elsewhere); a log line names it.

Both halves are `torch.library` custom ops with fake implementations, so `torch.compile(...,
fullgraph=True)` traces a model that uses them without a graph break.

Memory, per layer call (bf16 inputs, K = V = 128, chunk 64): `G` is 4 bytes and `a` 128 bytes
per token and value head, always saved. `save_states=True` (or `GDR_SAVE_STATES=1`) also keeps
`h`: K x V x 2 bytes per chunk and value head, i.e. 512 bytes per token and head (4x what `a`
costs); the backward then skips the state recompute. The default recomputes it (on sm90 with the
TileLang backends our state kernel, ~0.36 ms at B8 T4096 H32, docs/tilelang_states.md; else fla's
stages 1-2, about a fifth of the backward's time at the h200-train shapes, docs/measurements.md).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from typing import Optional

import torch

from .contract import (ACTIVATION_DTYPES, GATE_DTYPES, _expect_dtype, _expect_shape, _expect_tensor,
                       check_cu_seqlens_form, check_sizes, check_state)
from .graph_safe import offsets_of
from .registry import (Problem, device_info, env_flag, first_time, get_backend, library_versions,
                       registered_backends)

CHUNK = 64
SAVE_STATES_ENV = "GDR_SAVE_STATES"
FORWARD_ENV = "GDR_FORWARD"
log = logging.getLogger("gdr_dispatch")

def _empty(ref: torch.Tensor) -> torch.Tensor:
    return ref.new_empty(0)


# ---------------------------------------------------------------------------------------
# forward: the residuals and o, from the backend that offers the forward for this call
# ---------------------------------------------------------------------------------------
def forward_problem(q, v, beta, initial_state, cu_seqlens, state_v_first) -> Problem:
    """What a forward provider's `forward_supported` reads (no `h`, no `dht`)."""
    B, T, Hg, K = q.shape
    H, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        lens = [T] * B
    else:
        off = offsets_of(cu_seqlens)  # read once per tensor: a captured step reads nothing (graph_safe.py)
        lens = [e - s for s, e in zip(off[:-1], off[1:])]

    def dt(x):
        return None if x is None else str(x.dtype).replace("torch.", "")

    return Problem(B=B, T=T, H=H, Hg=Hg, K=K, V=V, N=len(lens), chunk_size=CHUNK,
                   num_chunks=sum(-(-n // CHUNK) for n in lens), max_seqlen=max(lens, default=0),
                   dtype=dt(q), a_dtype=dt(q), b_dtype=dt(beta), h_dtype=None, state_dtype=dt(initial_state),
                   varlen=cu_seqlens is not None, h_given=False, has_dht=False,
                   has_initial_state=initial_state is not None, state_v_first=state_v_first,
                   device=device_info(q.device), versions=tuple(library_versions().items()))


def forward_choice(problem: Problem):
    """`(backend, how)`: the backend whose `forward` runs and how it was chosen. The one
    `GDR_FORWARD` names (an error, with its reasons, if it cannot take the call), else the lowest
    `forward_rank` that can; `how` names the ones ranked before it and why they refused. Read
    per call."""
    forced = os.environ.get(FORWARD_ENV, "").strip()
    if forced:
        backend = get_backend(forced)
        ok, why = backend.forward_supported(problem)
        if not ok:
            raise ValueError(f"{FORWARD_ENV}={forced}: its forward cannot take {problem.describe()}: {why}")
        return backend, FORWARD_ENV
    refusals = []
    offers = [b for b in registered_backends().values() if b.forward_rank is not None]
    for backend in sorted(offers, key=lambda b: b.forward_rank):
        ok, why = backend.forward_supported(problem)
        if ok:
            return backend, "lowest forward_rank that takes it" + (
                f"; passed over {'; '.join(refusals)}" if refusals else "")
        refusals.append(f"{backend.name}: {why}")
    raise RuntimeError(f"no backend's forward takes {problem.describe()}: " + "; ".join(refusals))


def select_forward(problem: Problem):
    """The backend whose `forward` runs for `problem` (`forward_choice`)."""
    return forward_choice(problem)[0]


def forward_view(problem: Problem) -> Problem:
    """A backward call's problem as the training op's forward sees it: no `h`, no `dht`, `a`
    still to be made (in q's dtype)."""
    return replace(problem, h_given=False, h_dtype=None, has_dht=False, a_dtype=problem.dtype)


@torch.library.custom_op("gdr_dispatch::chunk_gdr_fwd", mutates_args=())
def chunk_gdr_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                  output_final_state: bool, state_v_first: bool, save_states: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(o, final_state or [], G, a, h or [])`: the output and the backward's residuals."""
    problem = forward_problem(q, v, beta, initial_state, cu_seqlens, state_v_first)
    backend, how = forward_choice(problem)
    if first_time(("forward", problem, backend.name)):
        log.info("gdr_dispatch: forward %s for %s (%s)", backend.name, problem.describe(), how)
    o, ht, G, a, h = backend.forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first,
                                     output_final_state, CHUNK, need_states=save_states)
    if save_states:
        h = h.to(q.dtype) if h.dtype != q.dtype and q.dtype in (torch.bfloat16, torch.float16) else h
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (o.to(q.dtype).contiguous(), ht.to(acc).contiguous() if output_final_state else _empty(q), G.contiguous(),
            a.contiguous(), h.contiguous() if save_states else _empty(q))


@chunk_gdr_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, state_v_first, save_states):
    B, T, Hg, K = q.shape
    H, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = (N, H, V, K) if state_v_first else (N, H, K, V)
    o = v.new_empty(B, T, H, V, dtype=q.dtype)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    ht = q.new_empty(state, dtype=acc) if output_final_state else q.new_empty(0)
    G = q.new_empty(B, T, H, dtype=acc)
    a = k.new_empty(B, T, H, CHUNK)
    if save_states:
        nt = torch.library.get_ctx().new_dynamic_size() if cu_seqlens is not None else math.ceil(T / CHUNK)
        h = q.new_empty((B, nt, H) + state[2:], dtype=q.dtype if q.dtype in (torch.bfloat16, torch.float16)
                        else G.dtype)
    else:
        h = q.new_empty(0)
    return o, ht, G, a, h


# ---------------------------------------------------------------------------------------
# backward: fused_gdr_bwd, whichever backend the dispatcher picks
# ---------------------------------------------------------------------------------------
@torch.library.custom_op("gdr_dispatch::chunk_gdr_bwd", mutates_args=())
def chunk_gdr_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, G: torch.Tensor,
                  beta: torch.Tensor, do: torch.Tensor, dht: Optional[torch.Tensor], h: Optional[torch.Tensor],
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                  state_v_first: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dq, dk, dv, dg, dbeta, dh0 or [])` through `fused_gdr_bwd`."""
    from .dispatch import fused_gdr_bwd

    grads = fused_gdr_bwd(q, k, v, a, G, beta, do.contiguous(), dht, h, scale=scale, initial_state=initial_state,
                          cu_seqlens=cu_seqlens, chunk_size=CHUNK, state_v_first=state_v_first)
    dh0 = grads.dh0 if grads.dh0 is not None else _empty(q)
    return grads.dq, grads.dk, grads.dv, grads.dg, grads.db, dh0


@chunk_gdr_bwd.register_fake
def _(q, k, v, a, G, beta, do, dht, h, initial_state, cu_seqlens, scale, state_v_first):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dh0 = initial_state.new_empty(initial_state.shape, dtype=acc) if initial_state is not None else q.new_empty(0)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), G.new_empty(G.shape, dtype=acc),
            torch.empty_like(beta), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, state_v_first, save_states = inputs
    o, ht, G, a, h = output
    ctx.mark_non_differentiable(G, a, h)
    ctx.save_for_backward(q, k, v, beta, G, a, h, initial_state, cu_seqlens)
    ctx.scale, ctx.state_v_first, ctx.save_states, ctx.g_dtype = scale, state_v_first, save_states, g.dtype


def _backward(ctx, do, dht, dG, da, dh):
    q, k, v, beta, G, a, h, initial_state, cu_seqlens = ctx.saved_tensors
    if do is None:
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    dht = dht if dht is not None and dht.numel() > 0 else None
    dq, dk, dv, dg, db, dh0 = torch.ops.gdr_dispatch.chunk_gdr_bwd(
        q, k, v, a, G, beta, do.to(q.dtype), dht, h if ctx.save_states else None, initial_state, cu_seqlens,
        ctx.scale, ctx.state_v_first)
    return (dq, dk, dv, dg.to(ctx.g_dtype), db, dh0 if initial_state is not None else None,
            None, None, None, None, None)


torch.library.register_autograd("gdr_dispatch::chunk_gdr_fwd", _backward, setup_context=_setup_context)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, state_v_first=False, save_states=None):
    """The gated delta rule's chunked forward with a dispatched backward: `(o, final_state)`.

    q, k `[B, T, Hg, K]`; v `[B, T, H, V]` with `H % Hg == 0`; g `[B, T, H]` the per-token
    natural-log decay (not cumulated); beta `[B, T, H]` in (0, 1); initial_state `[N, H, K, V]`
    (`[N, H, V, K]` with `state_v_first`); cu_seqlens `[N + 1]` for varlen (`B == 1`).
    `final_state` is None unless `output_final_state`. Differentiable in q, k, v, g, beta and
    initial_state. `save_states` (default: `GDR_SAVE_STATES`, else False) keeps the chunk states
    for the backward instead of recomputing them; the module docstring says what each costs.
    """
    if save_states is None:
        save_states = env_flag(SAVE_STATES_ENV, False)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    # the backward's own checks, applied up front: a bad call fails here, naming the argument
    _check_forward_call(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
    o, ht, _, _, _ = torch.ops.gdr_dispatch.chunk_gdr_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                                         bool(output_final_state), bool(state_v_first),
                                                         bool(save_states))
    return o, (ht if output_final_state else None)


def _check_forward_call(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first):
    """The checks `validate` applies to the backward, on the forward's own arguments (`g` is the
    per-token decay here), so that a bad call fails before any work, naming the argument."""
    if torch.compiler.is_compiling():
        return  # traced tensors are fakes; the eager call ran these checks
    names = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in names.items():
        _expect_tensor(name, x)
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims [B, T, Hg, K], got {list(q.shape)}")
    if v.dim() != 4:
        raise ValueError(f"v: expected 4 dims [B, T, H, V], got {list(v.shape)}")
    B, T, Hg, K = q.shape
    H, V = v.shape[2], v.shape[3]
    _expect_shape("v", v, (B, T, H, V), "[B, T, H, V] with B, T of q")
    check_sizes(B, T, H, Hg, K, V, CHUNK)
    _expect_shape("k", k, (B, T, Hg, K), "same as q: [B, T, Hg, K]")
    _expect_shape("g", g, (B, T, H), "[B, T, H], the per-token log decay")
    _expect_shape("beta", beta, (B, T, H), "[B, T, H]")
    _expect_dtype("q", q, ACTIVATION_DTYPES)
    for name in ("k", "v"):
        if names[name].dtype != q.dtype:
            raise TypeError(f"{name}: expected the dtype of q ({q.dtype}), got {names[name].dtype}")
    _expect_dtype("g", g, GATE_DTYPES, "the log decay is kept in fp32")
    _expect_dtype("beta", beta, ACTIVATION_DTYPES)
    for name, x in (*names.items(), ("initial_state", initial_state), ("cu_seqlens", cu_seqlens)):
        if x is not None and x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (the device of q), got {x.device}")
    if cu_seqlens is not None:
        check_cu_seqlens_form(cu_seqlens, B)
    if initial_state is not None:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        check_state("initial_state", initial_state, N, H, K, V, state_v_first)
