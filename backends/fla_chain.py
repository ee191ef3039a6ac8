"""Backend `fla`: fla-core's gated-delta-rule backward chain behind the contract.

The fallback that takes every GPU call the fast backends refuse, so it has to be right
everywhere: varlen, grouped heads, `state_v_first`, every optional input. The conversions
to fla's conventions live in `common/fla_pipeline.py`; fla's chain already returns `dg`
w.r.t. the raw gate, `dq`/`dk` reduced to the q/k heads and states in the contract's
layouts, so nothing is converted on the way out.

Hazard (docs/contract.md, "Known hazards"): on Hopper with Triton in [3.4.0, 3.7.1) fla's
Triton `chunk_bwd_dqkwg` (stage 5) is wrong (fla issue 640); fla-core 0.6 then routes that
stage to its TileLang kernel when it can, and raises otherwise. Only this backend runs
fla's stage 5, so only it carries that limit.
"""

from __future__ import annotations

import os

from gdr_dispatch.autotune import warm_job
from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.problem import Problem
from gdr_dispatch.registry import Backend, register
from gdr_dispatch.toolchain import NVCC_ENV, module_found, version_tuple

from .common import fla_pipeline

#: Triton versions that miscompile fla's gated chunk_bwd_dqkwg on Hopper (fla issue 640)
DQKWG_BAD_TRITON = ((3, 4, 0), (3, 7, 1))


def _fla_tilelang_dqkwg_usable() -> tuple[bool, str]:
    """Whether fla-core will route chunk_bwd_dqkwg to its TileLang kernel (its own checks)."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False, "FLA_DISABLE_BACKEND_DISPATCH=1 turns off fla's TileLang dispatch"
    if not module_found("tilelang"):
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


def dqkwg_hazard_reasons(p: Problem) -> list[str]:
    """The Hopper hazard of fla's stage 5 (`chunk_bwd_dqkwg`)."""
    if p.device.type != "cuda" or p.version("fla") is None or p.version("triton") is None:
        return []
    cap = p.device.capability or (0, 0)
    hopper = cap[0] == 9 or p.device.name.startswith("NVIDIA H")
    if not (hopper and DQKWG_BAD_TRITON[0] <= version_tuple(p.version("triton")) < DQKWG_BAD_TRITON[1]):
        return []
    ok, why = _fla_tilelang_dqkwg_usable()
    return [] if ok else [
        f"on Hopper, Triton {p.version('triton')} miscompiles fla's Triton chunk_bwd_dqkwg "
        f"(fla issue 640, fixed in 3.7.1) and fla's TileLang replacement cannot run: {why}"
    ]


class FlaBackend(Backend):
    name = "fla"
    static_rank = 10  # the fallback on a GPU: takes every call the fast backends refuse
    reference_rank = 1  # fla-core's own chain: the cross-check reference when torch cannot run
    limits = fla_pipeline.CHAIN_LIMITS
    # what its Hopper hazard's check reads (fla's own switches and its nvcc lookup)
    extra_env = ("FLA_DISABLE_BACKEND_DISPATCH", "FLA_TILELANG") + NVCC_ENV

    forward_rank = 20  # the training op's forward on a GPU (tests/test_gpu.py's op tests, H200)

    def extra_reasons(self, p: Problem) -> list[str]:
        return fla_pipeline.version_reasons(p) + dqkwg_hazard_reasons(p)

    def forward_not_supported_reasons(self, p: Problem) -> list[str]:
        # no stage 5 in the forward, so not its hazard
        return self.limits.reasons(p) + fla_pipeline.version_reasons(p)

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, need_final, chunk_size,
                need_states=True):
        return fla_pipeline.forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, need_final,
                                    chunk_size)

    def compile_jobs(self, call: GDRCall) -> list[tuple[str, str, tuple]]:
        # Triton compiles and fla-core autotunes on a first run (about 80 s at a new shape on the
        # H200), both cached on disk: one run at this shape in another process does it beforehand
        return [warm_job(self.name, call)]

    def run(self, call: GDRCall) -> GDRGrads:
        st = fla_pipeline.state_stages(call)
        dq, dk, dv, db, dg = fla_pipeline.stages_5_6(st, call.scale)
        return GDRGrads(dq, dk, dv, dg, db, st.dh0)

    def split_passes(self, p: Problem):
        # fla's state kernels compose the segments' maps (stages 1, 2 and 4 only: its stage-5
        # hazard does not apply)
        return None if self.forward_not_supported_reasons(p) else fla_pipeline.segment_maps


register(FlaBackend())
