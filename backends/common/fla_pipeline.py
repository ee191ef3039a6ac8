"""fla-core's backward chain as a pipeline the backends call (docs/contract.md, "fla's chain").

Stages 1-4 (the WY recompute, the state recompute or `v_new` from a given `h`, the local
dv, the dh recurrence) are shared by the `fla`, `triton_wide` and `triton_transposed`
backends, and so are their limits (`CHAIN_LIMITS`); stages 1-2 alone recompute `h` for the
sm90 TileLang backend where our state kernel cannot (common/tilelang_sm90.recompute_states). The contract's inputs are
converted to fla's conventions here: `a` -> `Gam * a` and `g` -> `g / ln 2` in one pass
(kernels/gate_wy_inverse.py); a given `h` is not recomputed, `v_new = u - w h` comes from
one chunk-parallel kernel (kernels/corrected_values.py).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from gdr_dispatch.contract import GDRCall, GDRGrads, packed
from gdr_dispatch.problem import Problem
from gdr_dispatch.registry import Limits
from gdr_dispatch.toolchain import version_tuple

from ..kernels.chunk_grid import varlen_chunk_indices, varlen_chunk_offsets
from ..kernels.corrected_values import corrected_values
from ..kernels.gate_wy_inverse import gate_wy_inverse

#: fla-core 0.6 is the first with the grouped-value-head (GVA) chain this pipeline calls.
MIN_FLA = (0, 6, 0)


#: What fla's stages take: every backend that runs this pipeline inherits these limits.
CHAIN_LIMITS = Limits(
    devices=("cuda",), dtypes=("bfloat16", "float16"), K=range(16, 257), V=range(16, 1 << 16), chunk_sizes=(64,),
    libraries=("fla",),
    why={"devices": "fla-core's kernels are GPU kernels", "dtypes": "fla's training dtypes, the ones tested here",
         "K": "Triton dot tiles; fla's state kernels assert K <= 256", "V": "Triton dot tiles",
         "chunk_sizes": "the one size tested here against the oracle"})


def version_reasons(p: Problem) -> list[str]:
    """An fla-core too old for the GVA-aware chain this pipeline calls."""
    found = p.version("fla")
    if found is not None and version_tuple(found) < MIN_FLA:
        return [f"needs fla-core >= 0.6.0 (its GVA-aware chain), found {found}"]
    return []


class FlaStages(NamedTuple):
    """What stages 1-4 leave for stages 5 + 6 (fla's conventions)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    beta: torch.Tensor
    A: torch.Tensor  # gated WY inverse, k's dtype
    g2: torch.Tensor  # g / ln 2
    w: torch.Tensor
    h: torch.Tensor  # chunk-start states: the caller's, or recomputed (k's dtype)
    v_new: torch.Tensor
    dh: torch.Tensor  # gradient w.r.t. each chunk's end state
    dh0: Optional[torch.Tensor]  # None when the call has no initial_state
    du: torch.Tensor  # the full gradient w.r.t. v_new (fla's `dv` after stage 4)
    common: dict  # cu_seqlens, chunk_indices
    state: dict  # state_v_first, chunk_size


class _Stage1(NamedTuple):
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    A: torch.Tensor  # gated WY inverse, k's dtype
    g2: torch.Tensor  # g / ln 2
    w: torch.Tensor
    u: torch.Tensor
    h0: Optional[torch.Tensor]
    common: dict  # cu_seqlens, chunk_indices


def _lengths(cu_seqlens) -> list[int]:
    """The sequence lengths of `cu_seqlens`: the values the call's validation has just read (no
    second device sync), else a read."""
    from gdr_dispatch.graph_safe import offsets_of, remembered

    off = remembered(cu_seqlens) or offsets_of(cu_seqlens)
    return [e - s for s, e in zip(off[:-1], off[1:])]


def _with_offsets(common: dict, chunk_size: int, seq_lens=None) -> dict:
    """`common` plus fla's `chunk_offsets` for its state kernels (`chunk_gated_delta_rule_fwd_h`,
    `_bwd_dhu`) from the sequence lengths (a call's `seq_lens`, else read as `_lengths`): left to
    fla they come from its tensor cache, which a captured graph must not read
    (chunk_grid.varlen_chunk_offsets)."""
    cu = common["cu_seqlens"]
    if cu is None:
        return common
    lens = _lengths(cu) if seq_lens is None else seq_lens
    return {**common, "chunk_offsets": varlen_chunk_offsets(lens, chunk_size, cu.device)}


def _wy(k, v, beta, a, G, common: dict):
    """Stage 1 from the contract's `a` and `G`: fla's gated inverse `A`, its log2 gate, `w`, `u`."""
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    A, g2 = gate_wy_inverse(a, G, common["cu_seqlens"], common["chunk_indices"], out_dtype=k.dtype,
                            with_log2_gate=True)
    w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g2, **common)
    return A, g2, w, u


def _stage_1(call: GDRCall) -> _Stage1:
    """The contract's conventions -> fla's, then stage 1 (`w`, `u`)."""
    k, v, beta = packed(call.k), packed(call.v), packed(call.b)
    cu = call.cu_seqlens
    ci = None if cu is None else varlen_chunk_indices(call.seq_lens, call.chunk_size, k.device, cu.dtype)
    h0 = None if call.initial_state is None else packed(call.initial_state.float())
    common = dict(cu_seqlens=cu, chunk_indices=ci)
    A, g2, w, u = _wy(k, v, beta, packed(call.a), packed(call.g), common)
    return _Stage1(k, v, beta, A, g2, w, u, h0, common)


def recompute_states(call: GDRCall) -> torch.Tensor:
    """Stages 1-2 only: the chunk-start states `h` (k's dtype) from `initial_state`."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    s1 = _stage_1(call)
    h, _, _ = chunk_gated_delta_rule_fwd_h(k=s1.k, w=s1.w, u=s1.u, g=s1.g2, initial_state=s1.h0,
                                           output_final_state=False, save_new_value=False,
                                           **_with_offsets(s1.common, call.chunk_size, call.seq_lens),
                                           state_v_first=call.state_v_first, chunk_size=call.chunk_size)
    return h


def segment_maps(seg_call: GDRCall, need_r: bool = True):
    """Pass 1 of the exact split (backends/split/passes.py) on fla's state kernels: each
    sequence of `seg_call` is one segment; returns its composed `(M, R, D)` in fp32, `[N, H, K,
    K]`, `[N, H, K, V]`, `[N, H, K, V]` (K x V layout whatever `seg_call.state_v_first` says).

    The state recurrence is linear in (state, u): run on the values `[0 | u]` from the start
    state `[I | 0]` it ends at `[M | R]`, one pass of `V + K` value columns (K only, R None,
    without `need_r`: with `h` given the split takes the segments' start states from `h`). `D` is the dh
    recurrence from a zero end gradient: the segment's start gradient, `dh0`. Both kernels keep
    the state in fp32 and round it to k's dtype for their products, as the unsplit chain does.
    """
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    s1 = _stage_1(seg_call)
    N, H, K, V, BT = seg_call.N, seg_call.H, seg_call.K, seg_call.V, seg_call.chunk_size
    dev = seg_call.q.device
    cols = K + V if need_r else K
    u_aug = s1.u.new_zeros(*s1.u.shape[:-1], cols)
    if need_r:
        u_aug[..., K:] = s1.u
    start = torch.zeros(N, H, K, cols, dtype=torch.float32, device=dev)
    start[..., :K] = torch.eye(K, dtype=torch.float32, device=dev)
    with_offsets = _with_offsets(s1.common, BT, seg_call.seq_lens)
    _, _, end = chunk_gated_delta_rule_fwd_h(k=s1.k, w=s1.w, u=u_aug, g=s1.g2, initial_state=start,
                                             output_final_state=True, save_new_value=False, **with_offsets,
                                             state_v_first=False, chunk_size=BT)
    q, do = packed(seg_call.q), packed(seg_call.do)
    dv = chunk_bwd_dv_local(q=q, k=s1.k, g=s1.g2, do=do, scale=seg_call.scale, **s1.common, chunk_size=BT)
    _, D, _ = chunk_gated_delta_rule_bwd_dhu(q=q, k=s1.k, w=s1.w, g=s1.g2, do=do, dv=dv, scale=seg_call.scale,
                                             h0=torch.zeros(N, H, K, V, dtype=torch.float32, device=dev), dht=None,
                                             **with_offsets, state_v_first=False, chunk_size=BT)
    return end[..., :K], (end[..., K:] if need_r else None), D


def state_stages(call: GDRCall) -> FlaStages:
    """Stages 1-4 with the conversions."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    BT = call.chunk_size
    s1 = _stage_1(call)
    k, common = s1.k, s1.common
    q, do = packed(call.q), packed(call.do)
    dht = None if call.dht is None else packed(call.dht.float())
    state = dict(state_v_first=call.state_v_first, chunk_size=BT)

    with_offsets = _with_offsets(common, BT, call.seq_lens)
    if call.h is None:
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=s1.w, u=s1.u, g=s1.g2, initial_state=s1.h0,
                                                   output_final_state=False, **with_offsets, **state)
    else:
        h = packed(call.h)
        v_new = corrected_values(s1.u, s1.w, h, BT, common["cu_seqlens"], common["chunk_indices"],
                                 call.state_v_first)
    dv = chunk_bwd_dv_local(q=q, k=k, g=s1.g2, do=do, scale=call.scale, **common, chunk_size=BT)
    dh, dh0, du = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=s1.w, g=s1.g2, h0=s1.h0, dht=dht, do=do, dv=dv,
                                                 scale=call.scale, **with_offsets, **state)
    return FlaStages(q, k, s1.v, do, s1.beta, s1.A, s1.g2, s1.w, h, v_new, dh,
                     dh0 if call.initial_state is not None else None, du, common, state)


def stages_5_6(st: FlaStages, scale: float):
    """fla's stages 5 + 6 and the reverse cumsum -> `(dq, dk, dv, db, dg)`."""
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
    from fla.ops.utils import chunk_local_cumsum

    h = st.h.to(st.q.dtype)  # fla's TileLang chunk_bwd_dqkwg takes h in q's dtype only
    dq, dk, dw, dg = chunk_bwd_dqkwg(q=st.q, k=st.k, v=st.v_new, w=st.w, g=st.g2, h=h, dv=st.du, do=st.do,
                                     dh=st.dh, scale=scale, **st.common, **st.state)
    dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=st.k, v=st.v, beta=st.beta, g=st.g2, A=st.A, dw=dw, du=st.du,
                                           **st.common)
    dk.add_(dk2)  # fresh tensors of fla's own: nothing of the caller's is written
    dg.add_(dg2)
    dg = chunk_local_cumsum(dg, chunk_size=st.state["chunk_size"], reverse=True, **st.common)
    return dq, dk, dv, db, dg


def fused_stage_args(call: GDRCall, st: FlaStages) -> tuple:
    """The positional arguments of a fused stage-5+6 launcher (`wy_dqkg_wide`'s signature)."""
    return (st.q, st.k, st.v, st.v_new, st.du, st.do, packed(call.a), packed(call.g), st.beta, st.h, st.dh, call.scale,
            call.chunk_size, st.common["cu_seqlens"], st.common["chunk_indices"], call.state_v_first)


def run_with_fused_stage(call: GDRCall, fused_stage_5_6) -> GDRGrads:
    """Stages 1-4, then `fused_stage_5_6` (wy_dqkg_wide's arguments and returns)."""
    st = state_stages(call)
    dq, dk, dv, db, dg = fused_stage_5_6(*fused_stage_args(call, st))
    return GDRGrads(dq, dk, dv, dg, db, st.dh0)


def forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, need_final, chunk_size):
    """The training op's forward on fla-core's kernels: `(o, final_state or None, G, a, h)`.

    The ungated inverse `a` is built directly (fla's KK^T stage without the gate, then its
    triangular solve), never by dividing fla's gated `A` by the decay: under strong decay that
    decay underflows in fp32 and the division gives 0/0 (docs/contract.md, "Known hazards")."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o

    q, k, v, beta = packed(q), packed(k), packed(v), packed(beta)  # fla's kernels index packed tensors
    G, a, common = residuals(k, beta, g, cu_seqlens, chunk_size)
    _, g2, w, u = _wy(k, v, beta, a, G, common)
    h0 = None if initial_state is None else packed(initial_state.float())
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g2, initial_state=h0, output_final_state=need_final,
                                                state_v_first=state_v_first, chunk_size=chunk_size,
                                                **_with_offsets(common, chunk_size))
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g2, scale=scale, state_v_first=state_v_first, chunk_size=chunk_size,
                    **common)
    return o, ht, G, a, h


def residuals(k, beta, g, cu_seqlens, chunk_size):
    """The contract's `G` (natural-log chunk cumsum, fp32) and ungated inverse `a` (k's dtype) on
    fla-core's kernels, and fla's varlen arguments: the forward's first stages, also what the
    cross-rank split composes its maps from before any state is known (backends/split/ranks.py)."""
    from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.solve_tril import solve_tril

    ci = None if cu_seqlens is None else varlen_chunk_indices(_lengths(cu_seqlens), chunk_size, k.device,
                                                              cu_seqlens.dtype)
    common = dict(cu_seqlens=cu_seqlens, chunk_indices=ci)
    k, beta = packed(k), packed(beta)
    G = chunk_local_cumsum(packed(g.float()), chunk_size=chunk_size, **common)  # natural log: no scale
    kkt = chunk_scaled_dot_kkt_fwd(k=k, g=None, beta=beta, chunk_size=chunk_size, output_dtype=torch.float32, **common)
    a = solve_tril(kkt, output_dtype=k.dtype, **common)  # ungated (I + StrictLower(diag(b) K K^T))^-1
    return G, a, common
