"""fla-core's backward stages re-done with the torch backend's stage functions, for CPU tests.

fla's own kernels do not run in Triton's interpreter (docs/contract.md, "Known hazards"), so on a machine without
a GPU the fla and Triton backends are run against these stand-ins: same signatures (each
call is bound to the real function's signature, so a wrong keyword fails), same
conventions (log2 gate, gated A, GVA heads), exact fp64 math. What they test is our
plumbing: conversions, which tensor goes where, layouts, head reduction.
"""

import inspect
import math

import torch

from gdr_dispatch import chunked_math as ex
from gdr_dispatch.chunk_layout import ChunkLayout
from gdr_dispatch.contract import reduce_value_heads

F64 = torch.float64
LN2 = math.log(2.0)


def _layout(x, cu_seqlens, BT):
    B, T = x.shape[:2]
    lens = [T] * B if cu_seqlens is None else [int(e - s) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    return ChunkLayout.build(B, T, lens, BT, x.device)


def _heads(lay, x, H):
    return ex.expand_heads(lay.gather(x, F64), H)


def _states_out(lay, s, v_first, varlen, dtype):
    NT = int((lay.chunk_index >= 0).sum())
    lead = (1, NT) if varlen else (lay.B, NT // lay.B)
    out = lay.scatter_chunks(s, lead, dtype)
    return out.transpose(-1, -2).contiguous() if v_first else out


def _states_in(lay, s, v_first):
    return lay.gather_chunks(s.transpose(-1, -2) if v_first else s, F64)


def _vec_in(s, v_first):
    return None if s is None else (s.transpose(-1, -2) if v_first else s).to(F64)


def recompute_w_u_fwd(k, v, beta, A, g, cu_seqlens=None, chunk_indices=None):
    lay = _layout(v, cu_seqlens, A.shape[-1])
    H = v.shape[2]
    kk, G = _heads(lay, k, H), lay.gather_gate(g, F64) * LN2
    Ag, b = lay.gather(A, F64), lay.gather(beta, F64)
    w = Ag @ (kk * (b * torch.exp(G))[..., None])
    u = Ag @ (lay.gather(v, F64) * b[..., None])
    return lay.scatter(w, k.dtype), lay.scatter(u, v.dtype)


def chunk_gated_delta_rule_fwd_h(k, w, u, g=None, gk=None, initial_state=None, output_final_state=False,
                                 chunk_size=64, save_new_value=True, state_v_first=False, cu_seqlens=None,
                                 cu_seqlens_cpu=None, chunk_indices=None, chunk_offsets=None):
    lay = _layout(u, cu_seqlens, chunk_size)
    H = u.shape[2]
    h, v_new, ht = ex.chunk_states(_heads(lay, k, H), lay.gather(w, F64), lay.gather(u, F64),
                                   lay.gather_gate(g, F64) * LN2, _vec_in(initial_state, state_v_first))
    if output_final_state:  # fp32, like fla's
        ht = (ht.transpose(-1, -2) if state_v_first else ht).float().contiguous()
    return (_states_out(lay, h, state_v_first, cu_seqlens is not None, k.dtype), lay.scatter(v_new, u.dtype),
            ht if output_final_state else None)


def chunk_bwd_dv_local(q, k, do, g=None, g_gamma=None, A=None, scale=None, cu_seqlens=None, chunk_size=64,
                       chunk_indices=None):
    lay = _layout(do, cu_seqlens, chunk_size)
    H = do.shape[2]
    dv = ex.dv_local(_heads(lay, q, H), _heads(lay, k, H), lay.gather_gate(g, F64) * LN2, lay.gather(do, F64), scale)
    return lay.scatter(dv, do.dtype)


def chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None,
                                   state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None,
                                   chunk_offsets=None, use_graph=False):
    lay = _layout(do, cu_seqlens, chunk_size)
    H = do.shape[2]
    dh, dh0, du = ex.chunk_state_grads(_heads(lay, q, H), _heads(lay, k, H), lay.gather(w, F64),
                                       lay.gather_gate(g, F64) * LN2, _vec_in(dht, state_v_first),
                                       lay.gather(do, F64), lay.gather(dv, F64), scale)
    if h0 is not None:
        dh0 = (dh0.transpose(-1, -2) if state_v_first else dh0).float().contiguous()
    else:
        dh0 = None
    return _states_out(lay, dh, state_v_first, cu_seqlens is not None, q.dtype), dh0, lay.scatter(du, do.dtype)


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None, state_v_first=False,
                    cu_seqlens=None, chunk_size=64, chunk_indices=None):
    assert h.dtype == q.dtype, "fla's TileLang chunk_bwd_dqkwg takes h in q's dtype"
    lay = _layout(do, cu_seqlens, chunk_size)
    H, Hg = do.shape[2], q.shape[2]
    dq, dk, dw, dG = ex.dqkwg(_heads(lay, q, H), _heads(lay, k, H), lay.gather(v, F64), lay.gather(w, F64),
                              lay.gather_gate(g, F64) * LN2, _states_in(lay, h, state_v_first), lay.gather(dv, F64),
                              lay.gather(do, F64), _states_in(lay, dh, state_v_first), scale, lay.chunk_len)
    return (reduce_value_heads(lay.scatter(dq, F64), Hg, q.dtype), reduce_value_heads(lay.scatter(dk, F64), Hg, k.dtype),
            lay.scatter(dw, w.dtype), lay.scatter(dG, torch.float32))


def prepare_wy_repr_bwd(k, v, beta, A, dw, du, g=None, cu_seqlens=None, chunk_indices=None):
    lay = _layout(v, cu_seqlens, A.shape[-1])
    H, Hg = v.shape[2], k.shape[2]
    dk2, dv, db, dG2 = ex.wy_bwd(_heads(lay, k, H), lay.gather(v, F64), lay.gather(beta, F64), lay.gather(A, F64),
                                 lay.gather_gate(g, F64) * LN2, lay.gather(dw, F64), lay.gather(du, F64),
                                 a_is_gated=True)
    return (reduce_value_heads(lay.scatter(dk2, F64), Hg, k.dtype), lay.scatter(dv, v.dtype),
            lay.scatter(db, beta.dtype), lay.scatter(dG2, torch.float32))


def chunk_local_cumsum(g, chunk_size, reverse=False, scale=None, cu_seqlens=None, output_dtype=torch.float,
                       chunk_indices=None, use_graph=False, **kwargs):
    assert reverse and scale is None
    lay = _layout(g, cu_seqlens, chunk_size)
    return lay.scatter(ex.reverse_chunk_cumsum(lay.gather(g, F64)), output_dtype)


FAKES = {
    "fla.ops.gated_delta_rule.wy_fast": ["recompute_w_u_fwd", "prepare_wy_repr_bwd"],
    "fla.ops.common.chunk_delta_h": ["chunk_gated_delta_rule_fwd_h", "chunk_gated_delta_rule_bwd_dhu"],
    "fla.ops.common.chunk_o": ["chunk_bwd_dv_local", "chunk_bwd_dqkwg"],
    "fla.ops.utils": ["chunk_local_cumsum"],
}


def install(monkeypatch):
    """Replace fla's stage functions with the stand-ins, each checked against the real signature."""
    import importlib

    calls = []
    for mod_name, names in FAKES.items():
        mod = importlib.import_module(mod_name)
        for name in names:
            real, fake = getattr(mod, name), globals()[name]

            def wrapped(*args, _real=real, _fake=fake, _name=name, **kwargs):
                inspect.signature(_real).bind(*args, **kwargs)  # a keyword fla does not take fails here
                calls.append(_name)
                return _fake(*args, **kwargs)

            monkeypatch.setattr(mod, name, wrapped)
    return calls
