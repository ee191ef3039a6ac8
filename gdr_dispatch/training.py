"""`chunk_gated_delta_rule`: the training drop-in, differentiable, with the backward dispatched.

    o, final_state = gdr_dispatch.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                         output_final_state=True)

fla-core 0.6's semantics for the arguments it shares with fla's op (`g` the per-token natural-log
decay, not cumulated; `beta` already in (0, 1); varlen through `cu_seqlens` with `B == 1`).
The forward saves exactly the contract's residuals (docs/contract.md: the chunk cumsum `G`, the
ungated inverse `a`, and `h` or not) and the backward is `fused_gdr_bwd`, so the tuning tables and
`GDR_BACKEND` decide which backend runs it.

Both halves are `torch.library` custom ops with fake implementations, so `torch.compile(...,
fullgraph=True)` traces a model that uses them without a graph break.

Memory, per layer call (bf16 inputs, K = V = 128, chunk 64): `G` is 4 bytes and `a` 128 bytes
per token and value head, always saved. `save_states=True` (or `GDR_SAVE_STATES=1`) also keeps
`h`: K x V x 2 bytes per chunk and value head, i.e. 512 bytes per token and head (4x what `a`
costs); the backward then skips the state recompute. The default recomputes it (fla's stages 1-2,
about a fifth of the backward's time at the h200-train shapes; docs/measurements.md).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .contract import (ACTIVATION_DTYPES, GATE_DTYPES, _expect_dtype, _expect_shape, _expect_tensor,
                       check_cu_seqlens_form, check_sizes, check_state)
from .registry import env_flag

CHUNK = 64
SAVE_STATES_ENV = "GDR_SAVE_STATES"

def _empty(ref: torch.Tensor) -> torch.Tensor:
    return ref.new_empty(0)


# ---------------------------------------------------------------------------------------
# forward: the residuals and o, on the CPU (torch) or the GPU (fla-core's kernels)
# ---------------------------------------------------------------------------------------
def _forward_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first):
    from .reference import prepare_residuals

    res = prepare_residuals(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                            chunk_size=CHUNK, state_v_first=state_v_first, scale=scale)
    return res.o, res.ht, res.g, res.a, res.h


def _forward_fla(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, need_final):
    """fla-core's forward, with the ungated inverse built directly (never by dividing fla's gated
    `A` by the decay, which underflows to 0/0 under strong decay)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.solve_tril import solve_tril

    from .backends.kernels.chunk_grid import varlen_chunk_indices
    from .backends.kernels.gate_wy_inverse import gate_wy_inverse
    from .graph_safe import offsets_of

    ci = None
    if cu_seqlens is not None:
        off = offsets_of(cu_seqlens)  # read once per tensor: a captured step reads nothing (graph_safe.py)
        ci = varlen_chunk_indices([e - s for s, e in zip(off[:-1], off[1:])], CHUNK, q.device, cu_seqlens.dtype)
    common = dict(cu_seqlens=cu_seqlens, chunk_indices=ci)
    G = chunk_local_cumsum(g.float(), chunk_size=CHUNK, **common)  # natural log: no scale
    kkt = chunk_scaled_dot_kkt_fwd(k=k, g=None, beta=beta, chunk_size=CHUNK, output_dtype=torch.float32, **common)
    a = solve_tril(kkt, output_dtype=k.dtype, **common)  # ungated (I + StrictLower(diag(b) K K^T))^-1
    A, g2 = gate_wy_inverse(a, G, cu_seqlens, ci, out_dtype=k.dtype, with_log2_gate=True)
    w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g2, **common)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g2, initial_state=h0, output_final_state=need_final,
                                                state_v_first=state_v_first, chunk_size=CHUNK, **common)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g2, scale=scale, state_v_first=state_v_first, chunk_size=CHUNK,
                    **common)
    return o, ht, G, a, h


@torch.library.custom_op("gdr_dispatch::chunk_gdr_fwd", mutates_args=())
def chunk_gdr_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                  output_final_state: bool, state_v_first: bool, save_states: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(o, final_state or [], G, a, h or [])`: the output and the backward's residuals."""
    if q.device.type == "cuda":  # verified on the H200 by tests/test_gpu.py's training tests
        o, ht, G, a, h = _forward_fla(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first,
                                      output_final_state)
    else:
        o, ht, G, a, h = _forward_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
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
