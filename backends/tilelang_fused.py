"""Backend `tilelang_fused`: the whole backward given `h` in one TileLang kernel (sm90).

`kernels/tilelang_fused_bwd.py` does stages 3-7 in one CTA per (sequence, value head),
walking the chunks backwards with `dh` in registers: seed 000's design without its warp
specialisation yet, so it is correct but ~4x slower than FlashQLA's kernel
(docs/measurements.md). With `h=None` the states are recomputed first
(`common/tilelang_sm90.recompute_states`).
"""

from __future__ import annotations

from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, Problem, register

from .common.tilelang_sm90 import fused_sm90_limits, own_state_recompute, run_given_h, states_compile_jobs


class TileLangFusedBackend(Backend):
    name = "tilelang_fused"
    static_rank = 40  # ties fla with h given on full grids, 1.7-4.5x slower on starved ones (docs/measurements.md)

    def not_supported_reasons(self, p: Problem) -> list[str]:
        return fused_sm90_limits(p, "~219 KiB")

    def run(self, call: GDRCall) -> GDRGrads:
        from .kernels.tilelang_fused_bwd import fused_bwd_given_h

        return run_given_h(call, fused_bwd_given_h)

    def own_state_recompute(self) -> bool:
        return own_state_recompute()

    def compile_jobs(self, call: GDRCall) -> list[tuple[str, str, tuple]]:
        from .kernels import tilelang_fused_bwd as m

        h_dtype = call.h.dtype if call.h is not None else call.k.dtype  # the recompute gives k's dtype
        return states_compile_jobs(call) + [(m.__name__, m.build_fused_bwd.__name__,
                                             m.fused_config(call.q, call.v, call.b, h_dtype, call.scale,
                                                            call.chunk_size))]


register(TileLangFusedBackend())
