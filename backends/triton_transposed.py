"""Backend `triton_transposed`: `triton_wide`'s chain with stages 5 + 6 as a main + side pair.

Stages 1-4 are fla's and the chain is `triton_wide.run_chain` (shared, not copied); only the
fused stage differs: `kernels/wy_dqkg_transposed.py`, seed 004's transposed main kernel
(accumulators M = K, parked in global memory, epilogue in K-strips) and a v-side kernel that
finishes dk, db and dg in place. On Blackwell that layout took the stage off the register
wall. On the H200 a wgmma accumulator stays in registers either way, and it loses.

Measured on the H200 (2026-11-29, Triton 3.6.0; bench/results/nvidia-h200-sm90-stage56.*):
  * correct: all 24 cases of tests/test_gpu.py pass, and the pair gives the wide kernel's
    dq and dv bit for bit (db within 9e-9, dk 1.2e-5, dg 5e-7 relative) at B8 T4096 H32. Its
    side kernel is not correct with strips of 32 or 64 (the launcher refuses them).
  * slower than `triton_wide` everywhere it ran: over the whole backward 1.12-1.24x at the
    ten h200-train shapes (bench/results/nvidia-h200-sm90.md); the fused stage alone 1.38x
    at B8 T4096 H32 (6.21 against 4.49 ms), and with side strips of 16 1.46-1.71x at all
    seven grid sizes from 128 to 16384 programs. The main kernel alone (3.2-3.6 ms) beats the wide
    kernel (4.1 ms), but it still holds 255 registers (one 8-warp CTA per SM, as the wide
    kernel does), and parking the fp32 accumulators, the side kernel (1.4-1.8 ms) and the
    fp32 -> bf16 cast (0.37 ms) cost more than that gain.
So on sm90 `supported` refuses it with those numbers (`SLOWER_THAN_WIDE`), and the autotuner
never measures it there; tests/test_gpu.py lifts the gate to keep checking its numerics.
"""

from __future__ import annotations

from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, Problem, register, unverified_reason

from .kernels.wy_dqkg_transposed import wy_dqkg_transposed
from .triton_wide import TritonWideBackend, run_chain

#: tests/test_gpu.py passed for this backend on an H200 (2026-11-29): all 24 cases, and the
#: pair against float64 next to the wide kernel.
GPU_VERIFIED = True

#: Device capabilities where the pair was measured slower than `triton_wide` at every shape
#: tried, with the measurement. It is refused there; `triton_wide` runs the same math.
SLOWER_THAN_WIDE = {
    (9, 0): "on sm90 (H200, Triton 3.6, 2026-11-29) its fused stage measured slower than triton_wide's at every "
            "grid size tried: 1.38x at B8 T4096 H32 in this configuration, 1.46-1.71x from 128 to 16384 programs "
            "with side strips of 16; triton_wide runs the same math (bench/results/nvidia-h200-sm90-stage56.md)",
}


class TritonTransposedBackend(Backend):
    name = "triton_transposed"

    def not_supported_reasons(self, p: Problem) -> list[str]:
        reasons = [] if GPU_VERIFIED else [
            unverified_reason("only Triton's interpreter has run it; triton_wide runs the same math meanwhile")]
        if p.device.capability in SLOWER_THAN_WIDE:
            reasons.append(SLOWER_THAN_WIDE[p.device.capability])
        # the same chain and shapes as triton_wide (its own GPU verification is not ours)
        return reasons + TritonWideBackend().chain_reasons(p)

    def run(self, call: GDRCall) -> GDRGrads:
        return run_chain(call, wy_dqkg_transposed)


register(TritonTransposedBackend())
