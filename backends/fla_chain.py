"""Backend `fla`: fla-core's gated-delta-rule backward chain behind the contract.

The fallback that takes every GPU call the fast backends refuse, so it has to be right
everywhere: varlen, grouped heads, `state_v_first`, every optional input. It converts the
contract's inputs to fla's conventions inside (GDR_MATH.md, "Other libraries' conventions"):

  * `a` -> `Gam * a`, the gated inverse fla's WY stages take, and `g` -> `g / ln 2`
    (fla's kernels use exp2 of a log2 cumsum), both in one pass (kernels/gate_wy_inverse.py);
  * `h` given -> it is not recomputed: `v_new = u - w h` comes from one chunk-parallel
    kernel (kernels/corrected_values.py) instead of fla's state recurrence;
    `h` None -> fla's `chunk_gated_delta_rule_fwd_h` recomputes it from `initial_state`.

fla's chain already returns `dg` w.r.t. the raw gate, `dq`/`dk` reduced to the q/k heads,
and states in the contract's layouts, so nothing is converted on the way out.

Hazard (GDR_MATH.md): on Hopper with Triton in [3.4.0, 3.7.1) fla's Triton
`chunk_bwd_dqkwg` is wrong (fla issue 640); fla-core 0.6 then routes that stage to its
TileLang kernel when tilelang and a usable nvcc are there and FLA_TILELANG is not 0, and
raises otherwise. Its TileLang kernel also requires `h` in q's dtype, so `h` is passed to
that stage in q's dtype (the dtype fla's own forward stores it in).
"""

from __future__ import annotations

import importlib.util
import os
import re

from typing import NamedTuple, Optional

import torch

from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, Problem, register

from .kernels.chunk_grid import varlen_chunk_indices
from .kernels.corrected_values import corrected_values
from .kernels.gate_wy_inverse import gate_wy_inverse

MIN_FLA = (0, 6, 0)
#: Triton versions that miscompile fla's gated chunk_bwd_dqkwg on Hopper (fla issue 640)
DQKWG_BAD_TRITON = ((3, 4, 0), (3, 7, 1))


def _version_tuple(v: str) -> tuple[int, ...]:
    """'3.7.1rc1+git12' -> (3, 7, 1): the leading digits of the first three fields."""
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        m = re.match(r"\d+", part)
        out.append(int(m.group()) if m else 0)
    return tuple(out + [0] * (3 - len(out)))


def _fla_tilelang_dqkwg_usable() -> tuple[bool, str]:
    """Whether fla-core will route chunk_bwd_dqkwg to its TileLang kernel (its own checks)."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False, "FLA_DISABLE_BACKEND_DISPATCH=1 turns off fla's TileLang dispatch"
    if importlib.util.find_spec("tilelang") is None:
        return False, "tilelang is not installed (pip install tilelang)"
    from fla.ops.common.backends.tilelang import CommonTileLangBackend

    if not CommonTileLangBackend.is_available():
        return False, "tilelang is installed but fla finds no usable nvcc for its JIT (install a CUDA toolkit)"
    if not CommonTileLangBackend().is_enabled():
        setting = os.environ.get("FLA_TILELANG")
        return False, (f"fla's TileLang kernels are off (FLA_TILELANG={setting})" if setting is not None else
                       "fla's TileLang kernels are off (FLA_TILELANG unset, and fla turns them on by default only "
                       "when it sees a Hopper GPU as device 0 with Triton >= 3.4; set FLA_TILELANG=1)")
    return True, ""


class FlaBackend(Backend):
    name = "fla"

    def not_supported_reasons(self, p: Problem) -> list[str]:
        return self.chain_reasons(p) + self.dqkwg_reasons(p)

    def chain_reasons(self, p: Problem) -> list[str]:
        """The limits of fla's chain as a whole; stages 1-4 of the Triton backends obey them too."""
        reasons = []
        if p.device.type != "cuda":
            reasons.append(f"needs a CUDA device (fla-core's kernels are GPU kernels); the tensors are on {p.device.type}")
        fla_version = p.version("fla")
        if fla_version is None:
            reasons.append("fla-core is not installed (pip install 'fla-core>=0.6')")
        elif _version_tuple(fla_version) < MIN_FLA:
            reasons.append(f"needs fla-core >= 0.6.0 (its GVA-aware chain), found {fla_version}")
        if p.dtype not in ("bfloat16", "float16"):
            reasons.append(f"q/k/v/do must be bfloat16 or float16 (fla's training dtypes, the ones tested here), got {p.dtype}")
        if p.chunk_size != 64:
            reasons.append(f"chunk_size must be 64 (the one size tested here against the oracle), got {p.chunk_size}")
        if p.K > 256:
            reasons.append(f"K must be <= 256 (fla's state kernels assert it), got K={p.K}")
        if min(p.K, p.V) < 16:
            reasons.append(f"K and V must be >= 16 (Triton dot tiles), got K={p.K}, V={p.V}")
        return reasons

    def dqkwg_reasons(self, p: Problem) -> list[str]:
        """The Hopper hazard of stage 5 (`chunk_bwd_dqkwg`), which only this backend runs."""
        reasons = []
        if p.device.type == "cuda" and p.version("fla") is not None and p.version("triton") is not None:
            cap = p.device.capability or (0, 0)
            tv = _version_tuple(p.version("triton"))
            hopper = cap[0] == 9 or p.device.name.startswith("NVIDIA H")
            if hopper and DQKWG_BAD_TRITON[0] <= tv < DQKWG_BAD_TRITON[1]:
                ok, why = _fla_tilelang_dqkwg_usable()
                if not ok:
                    reasons.append(
                        f"on Hopper, Triton {p.version('triton')} miscompiles fla's Triton chunk_bwd_dqkwg "
                        f"(fla issue 640, fixed in 3.7.1) and fla's TileLang replacement cannot run: {why}"
                    )
        return reasons

    def run(self, call: GDRCall) -> GDRGrads:
        st = fla_state_stages(call)
        dq, dk, dv, db, dg = fla_stages_5_6(st, call.scale)
        return GDRGrads(dq, dk, dv, dg, db, st.dh0)


class FlaStages(NamedTuple):
    """What stages 1-4 of fla's chain leave for stages 5 + 6 (fla's conventions)."""

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


def _fla_stage_1(call: GDRCall) -> _Stage1:
    """The contract's conventions -> fla's, then stage 1 (`w`, `u`)."""
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    k, v, beta = call.k.contiguous(), call.v.contiguous(), call.b.contiguous()
    cu = call.cu_seqlens
    ci = None if cu is None else varlen_chunk_indices(call.seq_lens, call.chunk_size, k.device, cu.dtype)
    h0 = None if call.initial_state is None else call.initial_state.float().contiguous()
    common = dict(cu_seqlens=cu, chunk_indices=ci)
    A, g2 = gate_wy_inverse(call.a, call.g, cu, ci, out_dtype=k.dtype, with_log2_gate=True)
    w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g2, **common)
    return _Stage1(k, v, beta, A, g2, w, u, h0, common)


def fla_recompute_states(call: GDRCall) -> torch.Tensor:
    """Stages 1-2 only: the chunk-start states `h` (k's dtype) from `initial_state`."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    s1 = _fla_stage_1(call)
    h, _, _ = chunk_gated_delta_rule_fwd_h(k=s1.k, w=s1.w, u=s1.u, g=s1.g2, initial_state=s1.h0,
                                           output_final_state=False, save_new_value=False, **s1.common,
                                           state_v_first=call.state_v_first, chunk_size=call.chunk_size)
    return h


def fla_state_stages(call: GDRCall) -> FlaStages:
    """Stages 1-4 (GDR_MATH.md) with the conversions; shared by the `fla` and Triton backends."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    BT = call.chunk_size
    s1 = _fla_stage_1(call)
    k, common = s1.k, s1.common
    q, do = call.q.contiguous(), call.do.contiguous()
    dht = None if call.dht is None else call.dht.float().contiguous()
    state = dict(state_v_first=call.state_v_first, chunk_size=BT)

    if call.h is None:
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=s1.w, u=s1.u, g=s1.g2, initial_state=s1.h0,
                                                   output_final_state=False, **common, **state)
    else:
        v_new = corrected_values(s1.u, s1.w, call.h, BT, common["cu_seqlens"], common["chunk_indices"],
                                 call.state_v_first)
        h = call.h.contiguous()
    dv = chunk_bwd_dv_local(q=q, k=k, g=s1.g2, do=do, scale=call.scale, **common, chunk_size=BT)
    dh, dh0, du = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=s1.w, g=s1.g2, h0=s1.h0, dht=dht, do=do, dv=dv,
                                                 scale=call.scale, **common, **state)
    return FlaStages(q, k, s1.v, do, s1.beta, s1.A, s1.g2, s1.w, h, v_new, dh,
                     dh0 if call.initial_state is not None else None, du, common, state)


def fla_stages_5_6(st: "FlaStages", scale: float):
    """fla's stages 5 + 6 and the reverse cumsum -> `(dq, dk, dv, db, dg)` (what `triton_wide` replaces)."""
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
    from fla.ops.utils import chunk_local_cumsum

    h = st.h.to(st.q.dtype)  # fla's TileLang chunk_bwd_dqkwg takes h in q's dtype only
    dq, dk, dw, dg = chunk_bwd_dqkwg(q=st.q, k=st.k, v=st.v_new, w=st.w, g=st.g2, h=h, dv=st.du, do=st.do,
                                     dh=st.dh, scale=scale, **st.common, **st.state)
    dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=st.k, v=st.v, beta=st.beta, g=st.g2, A=st.A, dw=dw, du=st.du,
                                           **st.common)
    dk.add_(dk2)
    dg.add_(dg2)
    dg = chunk_local_cumsum(dg, chunk_size=st.state["chunk_size"], reverse=True, **st.common)
    return dq, dk, dv, db, dg


register(FlaBackend())
