"""Backend `tilelang_fused`: the whole backward given `h` in one TileLang kernel (sm90).

`kernels/tilelang_fused_bwd.py` does stages 3-7 in one CTA per (sequence, value head),
walking the chunks backwards with `dh` in registers: seed 000's design without its warp
specialisation yet, so it is correct but ~4x slower than FlashQLA's kernel
(docs/measurements.md). With `h=None` fla's stages 1-2 recompute `h` first.
"""

from __future__ import annotations

import importlib.util

from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, Problem, register

from .common import fla_pipeline
from .common.toolchain import nvcc_found


class TileLangFusedBackend(Backend):
    name = "tilelang_fused"
    static_rank = 40  # ties fla with h given on full grids, 1.7-4.5x slower on starved ones (docs/measurements.md)

    def not_supported_reasons(self, p: Problem) -> list[str]:
        reasons = []
        if p.device.type != "cuda":
            reasons.append(f"needs a CUDA device; the tensors are on {p.device.type}")
        elif p.device.capability != (9, 0):
            reasons.append(f"built for sm_90a (Hopper: wgmma, 227 KiB shared memory per block, of which it uses "
                           f"~219 KiB); this device is sm_{p.device.capability[0]}{p.device.capability[1]}")
        if p.version("tilelang") is None or importlib.util.find_spec("tilelang") is None:
            reasons.append("tilelang is not installed (pip install tilelang)")
        elif p.device.type == "cuda" and not nvcc_found():
            reasons.append("no nvcc found for TileLang's JIT (set CUDA_HOME or put nvcc on PATH)")
        if (p.K, p.V) != (128, 128):
            reasons.append(f"K and V must be 128 (the shared-memory plan is for 128 x 128 states), got K={p.K}, V={p.V}")
        if p.chunk_size != 64:
            reasons.append(f"chunk_size must be 64, got {p.chunk_size}")
        if p.dtype not in ("bfloat16", "float16"):
            reasons.append(f"q/k/v/do must be bfloat16 or float16, got {p.dtype}")
        elements = max(p.B * p.T * p.H * max(p.K, p.V, p.chunk_size), p.num_chunks * p.H * p.K * p.V)
        if elements >= 2 ** 31:
            reasons.append(f"the kernel indexes with 32-bit integers; this call's largest tensor has {elements} "
                           f"elements (>= 2^31): split the batch")
        if not p.h_given and p.version("fla") is None:
            reasons.append("with h=None the states are recomputed by fla-core's stages 1-2, and fla-core is not installed")
        return reasons

    def run(self, call: GDRCall) -> GDRGrads:
        from .kernels.tilelang_fused_bwd import fused_bwd_given_h

        h = call.h if call.h is not None else fla_pipeline.recompute_states(call)
        dq, dk, dv, dg, db, dh0 = fused_bwd_given_h(
            call.q, call.k, call.v, call.do, call.a, call.g, call.b, h, call.dht, call.scale, call.seq_lens,
            call.chunk_size, call.cu_seqlens, has_h0=call.initial_state is not None,
            state_v_first=call.state_v_first,
        )
        return GDRGrads(dq, dk, dv, dg, db, dh0)


register(TileLangFusedBackend())
