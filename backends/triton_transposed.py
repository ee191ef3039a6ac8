"""Backend `triton_transposed`: `triton_wide`'s chain with stages 5 + 6 as a main + side pair.

Stages 1-4 are fla's and the chain is `triton_wide.run_chain` (shared, not copied); only the
fused stage differs: `kernels/wy_dqkg_transposed.py`, seed 004's transposed main kernel
(accumulators M = K, parked in global memory, epilogue in K-strips) and a v-side kernel that
finishes dk, db and dg in place. On Blackwell that layout took the stage off the register
wall; on the H200 a wgmma accumulator stays in registers, so whether it beats `triton_wide`
anywhere is for the H200 to say.

State: matches the torch stage functions in Triton's interpreter (fp32 to 1e-5, fp16 to
2e-3; against `triton_wide` at K = V = 128 there: dq and dv bit-identical, dk/db/dg within
6e-7). Not yet run on a GPU, so `supported` refuses every call until tests/test_gpu.py has
passed for it (`GPU_VERIFIED`), and it takes only what `triton_wide` takes.
"""

from __future__ import annotations

from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, Problem, register, unverified_reason

from .kernels.wy_dqkg_transposed import wy_dqkg_transposed
from .triton_wide import TritonWideBackend, run_chain

#: Set once tests/test_gpu.py has passed for this backend on a GPU (it has not: the session
#: that wrote it had no device time left).
GPU_VERIFIED = False


class TritonTransposedBackend(Backend):
    name = "triton_transposed"

    def not_supported_reasons(self, p: Problem) -> list[str]:
        unverified = [] if GPU_VERIFIED else [
            unverified_reason("only Triton's interpreter has run it; triton_wide runs the same math meanwhile")]
        # the same chain and shapes as triton_wide (its own GPU verification is not ours)
        return unverified + TritonWideBackend().chain_reasons(p)

    def run(self, call: GDRCall) -> GDRGrads:
        return run_chain(call, wy_dqkg_transposed)


register(TritonTransposedBackend())
