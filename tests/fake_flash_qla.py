"""FlashQLA 0.1.3's entry points re-done with the torch backend's stage functions, for CPU tests.

FlashQLA cannot even be imported without a supported GPU (it picks its kernels at import), so
the `flash_qla` backend's plumbing is tested against these stand-ins, installed as a fake
`flash_qla` package. Each keeps the real function's signature, copied from the 0.1.3 source
(`SIGNATURES`; a GPU test checks them against the installed package), and its output
conventions: dq/dk per value head in v's dtype, dg w.r.t. the chunk-local cumsum (before the
reverse cumsum), states as `[K, V]` or `[V, K]` with `state_v_first`. It also keeps one quirk
of the sm120 kernel: without `dht` it leaves dh0 unwritten (NaN here), so a backend that relies
on dh0 then is caught.
"""

import inspect
import sys
import types

import torch

from fake_fla import F64, _heads, _layout, _states_in, _states_out, _vec_in
from gdr_dispatch import chunked_math as ex
from gdr_dispatch.contract import packed

VERSION = "0.1.3"

#: flash_qla 0.1.3: ops/gated_delta_rule/chunk/hopper/fused_bwd.py, .../prepare_h.py, ops/utils/cumsum.py
SIGNATURES = {
    "fused_gdr_bwd": "(q, k, v, a, g, b, do, dht, h, scale=None, cu_seqlens=None, chunk_size=64, state_v_first=False)",
    "fused_gdr_h": "(k, v, a, g, b, initial_state=None, output_final_state=True, output_h=True, cu_seqlens=None, "
                   "num_warmup_chunks=None, state_v_first=False)",
    "chunk_local_cumsum": "(g, chunk_size=64, cu_seqlens=None, reverse=False, zero_last_chunk=False)",
    "group_reduce_vector": "(buffer: torch.Tensor, Hg: int)",
    "chunk_gated_delta_rule_fwd": "(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, "
                                  "output_final_state=True, output_h=False, auto_cp=True, state_v_first=False, "
                                  "enable_fwd_cp_cache=False, cp_context=None, is_train=None)",
}


def _gathered(lay, k, v, a, g, b):
    H = v.shape[2]
    kk = _heads(lay, k, H)
    vv, A, bb = (lay.gather(x, F64) for x in (v, a, b))
    G = lay.gather_gate(g, F64)
    w, u = ex.recompute_w_u(kk, vv, bb, A, G)
    return kk, vv, A, bb, G, w, u


def fused_gdr_h(k, v, a, g, b, initial_state=None, output_final_state=True, output_h=True, cu_seqlens=None,
                num_warmup_chunks=None, state_v_first=False):
    lay = _layout(v, cu_seqlens, a.shape[-1])
    kk, vv, A, bb, G, w, u = _gathered(lay, k, v, a, g, b)
    h, _, ht = ex.chunk_states(kk, w, u, G, _vec_in(initial_state, state_v_first))
    h = _states_out(lay, h, state_v_first, cu_seqlens is not None, k.dtype) if output_h else None
    ht = (ht.transpose(-1, -2) if state_v_first else ht).float().contiguous() if output_final_state else None
    return h, ht, None


def fused_gdr_bwd(q, k, v, a, g, b, do, dht, h, scale=None, cu_seqlens=None, chunk_size=64, state_v_first=False):
    assert a.dtype == q.dtype and h.dtype == q.dtype, "FlashQLA's kernels read a and h in q's dtype"
    scale = scale or q.shape[-1] ** -0.5
    lay = _layout(v, cu_seqlens, chunk_size)
    H = v.shape[2]
    kk, vv, A, bb, G, w, u = _gathered(lay, k, v, a, g, b)
    qq, dd = _heads(lay, q, H), lay.gather(do, F64)
    hh = _states_in(lay, h, state_v_first)
    v_new = ex.v_new_from_states(w, u, hh)
    dv_loc = ex.dv_local(qq, kk, G, dd, scale)
    dh, dh0, du = ex.chunk_state_grads(qq, kk, w, G, _vec_in(dht, state_v_first), dd, dv_loc, scale)
    dq, dk, dw, dG = ex.dqkwg(qq, kk, v_new, w, G, hh, du, dd, dh, scale, lay.chunk_len)
    dk2, dv, db, dG2 = ex.wy_bwd(kk, vv, bb, A, G, dw, du)
    dh0 = (dh0.transpose(-1, -2) if state_v_first else dh0).float().contiguous()
    if dht is None:
        dh0 = torch.full_like(dh0, float("nan"))  # the sm120 kernel's quirk (module docstring)
    return (lay.scatter(dq, v.dtype), lay.scatter(dk + dk2, v.dtype), lay.scatter(dv, v.dtype),
            lay.scatter(dG + dG2, torch.float32), lay.scatter(db, b.dtype), dh0)


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                               output_final_state=True, output_h=False, auto_cp=True, state_v_first=False,
                               enable_fwd_cp_cache=False, cp_context=None, is_train=None):
    """(g cumsum, A, o, h, final_state, cp_cache) in 0.1.3's conventions, from the torch reference."""
    from gdr_dispatch.reference import prepare_residuals

    assert not auto_cp, "auto_cp's intra-card split is approximate; the backend must turn it off"
    res = prepare_residuals(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                            state_v_first=state_v_first, scale=scale)
    h = res.h.to(k.dtype) if output_h else None
    ht = res.ht.float() if output_final_state else None
    return res.g.float(), res.a.to(k.dtype), res.o.to(q.dtype), h, ht, None


def chunk_local_cumsum(g, chunk_size=64, cu_seqlens=None, reverse=False, zero_last_chunk=False):
    assert reverse, "the backend only asks for the reverse cumsum"
    lay = _layout(g, cu_seqlens, chunk_size)
    return lay.scatter(ex.reverse_chunk_cumsum(lay.gather(g, F64)), g.dtype)


def group_reduce_vector(buffer: torch.Tensor, Hg: int):
    """Each group's consecutive H // Hg heads summed (in fp32), in the buffer's dtype."""
    B, T, H, K = buffer.shape
    return buffer.float().view(B, T, Hg, H // Hg, K).sum(3).to(buffer.dtype)


def install(monkeypatch):
    """Put a fake `flash_qla` package in sys.modules; returns the list of calls made into it."""
    calls = []

    def tracked(fn):
        sig = inspect.signature(fn)
        assert str(sig) == SIGNATURES[fn.__name__], f"{fn.__name__}: the stand-in drifted from 0.1.3's signature"

        def wrapped(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)  # a keyword FlashQLA does not take fails here
            for name, x in bound.arguments.items():  # its kernels take packed tensors (TMA descriptors)
                if isinstance(x, torch.Tensor):
                    assert packed(x) is x, f"{fn.__name__}: {name} is not packed"
            calls.append(fn.__name__)
            return fn(*args, **kwargs)

        return wrapped

    mods = {name: types.ModuleType(name) for name in
            ("flash_qla", "flash_qla.ops", "flash_qla.ops.gated_delta_rule", "flash_qla.ops.gated_delta_rule.chunk",
             "flash_qla.ops.utils")}
    mods["flash_qla"].__version__ = VERSION
    chunk = mods["flash_qla.ops.gated_delta_rule.chunk"]
    chunk.fused_gdr_bwd, chunk.fused_gdr_h = tracked(fused_gdr_bwd), tracked(fused_gdr_h)
    chunk.chunk_gated_delta_rule_fwd = tracked(chunk_gated_delta_rule_fwd)
    chunk.CHUNK_SIZE = 64
    mods["flash_qla.ops.utils"].chunk_local_cumsum = tracked(chunk_local_cumsum)
    mods["flash_qla.ops.utils"].group_reduce_vector = tracked(group_reduce_vector)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return calls
