"""Backend `torch`: the exact chunked backward in PyTorch (`gdr_dispatch.chunked_math`).

Runs on any device and dtype; slow. It is the backend of last resort and the autotuner's
first cross-check reference (exact math, fp32 accumulation, fp64 for fp64 inputs). On a GPU's
table miss it runs once as that reference and is never timed (`reference`).
"""

from __future__ import annotations

from gdr_dispatch.chunked_math import chunked_backward
from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, Limits, register


class TorchBackend(Backend):
    name = "torch"
    static_rank = 100  # last: every other backend is faster wherever it runs
    reference_rank = 0  # exact: the first choice to cross-check the others against
    reference = True
    split_candidate = False  # splitting the reference buys nothing but tuning time
    forward_rank = 100  # the training op's forward where no kernel forward takes the call (the CPU)
    limits = Limits(devices=("cpu", "cuda"))  # every valid call on these devices (no meta tensors)

    def run(self, call: GDRCall) -> GDRGrads:
        return chunked_backward(call)

    def forward_not_supported_reasons(self, problem) -> list[str]:
        return self.limits.reasons(problem)

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, need_final, chunk_size,
                need_states=True):
        from gdr_dispatch.reference import prepare_residuals

        res = prepare_residuals(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                chunk_size=chunk_size, state_v_first=state_v_first, scale=scale)
        return res.o, res.ht, res.g, res.a, res.h


register(TorchBackend())
