"""Backend `triton_wide`: fla's stages 1-4, then stages 5 + 6 fused at full K in our kernel.

Stages 1-4 (state recompute unless `h` is given, local dv, the dh recurrence) are
`fla_chain.fla_state_stages`, shared with the `fla` backend. The fused stage
(`kernels/wy_dqkg_wide.py`) replaces fla's `chunk_bwd_dqkwg` + `prepare_wy_repr_bwd` and
also does the reverse cumsum of dg; the grouped-head reduction follows it.

Measured on the H200 (2026-11-29, Triton 3.6.0, bench/results/nvidia-h200-sm90-stage56.*):
  * correct: all 24 cases of tests/test_gpu.py pass, and at the h200-train shapes its
    gradients are within 3.7e-3 of the torch backend's. Triton 3.6 on Hopper is inside the
    range that miscompiles `dot(trans(acc))` (fla issue 640); this kernel has no such dot
    and is not hit, so no version gate.
  * the fused stage against fla's stages 5 + 6 on the same inputs: faster at 1024 programs
    (chunks x heads) and fewer (0.33 vs 0.69 ms at B1 T2048 H32, 0.14 vs 0.78 ms at B1 T256
    H32, where fla's five launches are host-bound), level at 2048 (0.72 vs 0.71 ms), slower
    above (4.48 vs 3.19 ms at B8 T4096 H32, 16384 programs). It is register-bound: 255 registers and 164-206
    spilled with 8 warps, 844-888 spilled with 4.
  * so there is no CTA floor to gate on: the autotuner chooses it where it wins. Over the
    whole backward it won B1 T8192 H16 with h given by 2 % in one tune sweep and lost it
    (1.57 vs 1.40 ms) in the next; the shipped table has fla there now.
"""

from __future__ import annotations

from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, Problem, register, unverified_reason

from .fla_chain import FlaBackend, fla_state_stages
from .kernels.wy_dqkg_wide import wy_dqkg_wide

#: tests/test_gpu.py passed for this backend on an H200 (2026-11-29): all 24 cases.
GPU_VERIFIED = True

#: K values let through: only K = 128 has run on a GPU (H200: its three [BT, K] fp32
#: accumulators, 96 KiB, already spill there). K = 16 and 32 pass in Triton's interpreter
#: and K = 64 is untried; 256 (192 KiB of accumulators) cannot be held at full K.
WIDE_K = (128,)


class TritonWideBackend(Backend):
    name = "triton_wide"

    def not_supported_reasons(self, p: Problem) -> list[str]:
        return ([] if GPU_VERIFIED else [unverified_reason()]) + self.chain_reasons(p)

    def chain_reasons(self, p: Problem) -> list[str]:
        """What `run_chain` with a full-K fused stage takes; `triton_transposed` shares it."""
        # stages 1-4 are fla's: its device, version, dtype and chunk limits apply. Its
        # Hopper hazard concerns chunk_bwd_dqkwg (stage 5), which this chain does not run.
        reasons = FlaBackend().chain_reasons(p)
        if p.K not in WIDE_K:
            reasons.append(f"K must be one of {WIDE_K}, got K={p.K}: the only K run on a GPU so far (smaller K "
                           f"passes in Triton's interpreter only; K = 256 cannot hold its full-K accumulators)")
        return reasons

    def run(self, call: GDRCall) -> GDRGrads:
        return run_chain(call, wy_dqkg_wide)


def fused_stage_args(call: GDRCall, st) -> tuple:
    """The positional arguments of a fused stage-5+6 launcher (`wy_dqkg_wide`'s signature)
    from the call and what fla's stages 1-4 left (`fla_chain.FlaStages`)."""
    return (st.q, st.k, st.v, st.v_new, st.du, st.do, call.a, call.g, st.beta, st.h, st.dh, call.scale,
            call.chunk_size, st.common["cu_seqlens"], st.common["chunk_indices"], call.state_v_first)


def run_chain(call: GDRCall, fused_stage_5_6) -> GDRGrads:
    """fla's stages 1-4, then `fused_stage_5_6` (wy_dqkg_wide's arguments and returns);
    the chain `triton_wide` and `triton_transposed` share."""
    st = fla_state_stages(call)
    dq, dk, dv, db, dg = fused_stage_5_6(*fused_stage_args(call, st))
    return GDRGrads(dq, dk, dv, dg, db, st.dh0)


register(TritonWideBackend())
