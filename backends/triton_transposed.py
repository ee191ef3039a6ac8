"""Backend `triton_transposed`: fla's stages 1-4, then stages 5 + 6 as a main + side pair.

`kernels/wy_dqkg_transposed.py`: seed 004's transposed main kernel (accumulators M = K,
parked in global memory, epilogue in K-strips) and a v-side kernel that finishes dk, db and
dg. The layout took the stage off the register wall on Blackwell; on the H200 it is correct
but slower than `triton_wide` everywhere measured (docs/kernels.md), which the static
order and the tables record. Its side kernel is wrong with strips of 32 or 64 on Hopper;
the launcher refuses those settings.
"""

from __future__ import annotations

from dataclasses import replace

from gdr_dispatch.autotune import warm_job
from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, register

from .common import fla_pipeline
from .kernels.wy_dqkg_transposed import wy_dqkg_transposed

#: K values let through: K = 128 is the only K run on a GPU (as for triton_wide).
TRANSPOSED_K = (128,)
LIMIT_WHY = "the only K run on a GPU so far"


class TritonTransposedBackend(Backend):
    name = "triton_transposed"
    static_rank = 30  # below triton_wide: 1.1-1.4x slower than it on the H200 (docs/kernels.md)
    family_name = "triton"  # fla's stages 1-4 and our fused Triton stage, as triton_wide

    limits = replace(fla_pipeline.CHAIN_LIMITS, K=TRANSPOSED_K, why={**fla_pipeline.CHAIN_LIMITS.why, "K": LIMIT_WHY})

    def extra_reasons(self, p) -> list[str]:
        return fla_pipeline.version_reasons(p)

    def compile_jobs(self, call: GDRCall) -> list[tuple[str, str, tuple]]:
        # Triton compiles and fla-core autotunes on a first run (about 80 s at a new shape on the
        # H200), both cached on disk: one run at this shape in another process does it beforehand
        return [warm_job(self.name, call)]

    def run(self, call: GDRCall) -> GDRGrads:
        return fla_pipeline.run_with_fused_stage(call, wy_dqkg_transposed)


register(TritonTransposedBackend())
