"""Backend `triton_wide`: fla's stages 1-4, then stages 5 + 6 fused at full K in our kernel.

The fused stage (`kernels/wy_dqkg_wide.py`) replaces fla's `chunk_bwd_dqkwg` and
`prepare_wy_repr_bwd`, does the reverse cumsum of dg in its epilogue, and never runs fla's
stage 5, so fla's Hopper hazard (fla issue 640) is not its limit. It wins on small grids
and loses on large ones (255 registers, spilling): docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import replace

from gdr_dispatch.autotune import warm_job
from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, register

from .common import fla_pipeline
from .kernels.wy_dqkg_wide import wy_dqkg_wide

#: K values let through: only K = 128 has run on a GPU (three [BT, K] fp32 accumulators,
#: already spilling on the H200); 256 cannot hold its accumulators at full K.
WIDE_K = (128,)
LIMIT_WHY = "the only K run on a GPU so far; smaller K passes in Triton's interpreter only, K = 256 cannot hold its full-K accumulators"


class TritonWideBackend(Backend):
    name = "triton_wide"
    static_rank = 20  # 1.1-1.4x slower than fla at every h200-train shape (docs/kernels.md)
    family_name = "triton"  # fla's stages 1-4 and our fused Triton stage, as triton_transposed

    limits = replace(fla_pipeline.CHAIN_LIMITS, K=WIDE_K, why={**fla_pipeline.CHAIN_LIMITS.why, "K": LIMIT_WHY})

    def extra_reasons(self, p) -> list[str]:
        return fla_pipeline.version_reasons(p)

    def compile_jobs(self, call: GDRCall) -> list[tuple[str, str, tuple]]:
        # Triton compiles and fla-core autotunes on a first run (about 80 s at a new shape on the
        # H200), both cached on disk: one run at this shape in another process does it beforehand
        return [warm_job(self.name, call)]

    def run(self, call: GDRCall) -> GDRGrads:
        return fla_pipeline.run_with_fused_stage(call, wy_dqkg_wide)


register(TritonWideBackend())
