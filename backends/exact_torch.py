"""Backend `torch`: the exact chunked backward in PyTorch (`gdr_dispatch.chunked_math`).

Runs on any device and dtype; slow. It is the backend of last resort and the autotuner's
first cross-check reference (exact math, fp32 accumulation, fp64 for fp64 inputs).
"""

from __future__ import annotations

from gdr_dispatch.chunked_math import chunked_backward
from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, Problem, register


class TorchBackend(Backend):
    name = "torch"
    static_rank = 100  # last: every other backend is faster wherever it runs
    reference_rank = 0  # exact: the first choice to cross-check the others against
    split_candidate = False  # splitting the reference buys nothing but tuning time

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        return []  # every valid call; speed is the autotuner's business

    def run(self, call: GDRCall) -> GDRGrads:
        return chunked_backward(call)


register(TorchBackend())
