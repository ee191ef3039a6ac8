"""Backend `tilelang_fused`: the whole backward given `h` in one TileLang kernel (sm90).

With `h` given, `kernels/tilelang_fused_bwd.py` does stages 3-7 in one CTA per (sequence,
value head). With `h=None` the chunk-start states are first recomputed by fla's stages 1-2
(`fla_chain.fla_recompute_states`); a TileLang recompute kernel has not been tried.

This is the plain version of seed 000's design (no warp specialisation, no TMA pipeline).
On the H200 (2026-11-29, TileLang 0.1.15, nvcc 13): it passed every case of
tests/test_gpu.py (24: varlen 1/63/64/65 with and without state_v_first, T 40/65/100/128,
grouped heads, each optional input absent and present, bf16 and fp16, h given and None;
errors <= 3.7e-3 at the h200-train shapes). Its speed is not there yet: 6.59 ms at B8 T4096
H32 with h given against FlashQLA's 1.54 ms, i.e. ~51 us per chunk step per CTA against
FlashQLA's ~12 us, because every load, wgmma and reduction of a chunk runs one after another
behind block-wide barriers with nothing overlapped (~219 KiB of shared memory leaves no
room to prefetch the next chunk). First-call compile: 54-74 s per configuration on the
H200 machine when 7 compile at once (bench/precompile_tilelang.py), 37-41 s alone here.
TileLang's compiler warns of a "hoisted sync" race in the row-vector updates; the threads
it names each touch their own rows only, and the oracle tests pass.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import Backend, Problem, register, unverified_reason

#: tests/test_gpu.py passed for this backend on an H200 (2026-11-29): all 24 cases.
GPU_VERIFIED = True


def _nvcc_found() -> bool:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return True
    return shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


class TileLangFusedBackend(Backend):
    name = "tilelang_fused"

    def not_supported_reasons(self, p: Problem) -> list[str]:
        reasons = [] if GPU_VERIFIED else [unverified_reason()]
        if p.device.type != "cuda":
            reasons.append(f"needs a CUDA device; the tensors are on {p.device.type}")
        elif p.device.capability != (9, 0):
            reasons.append(f"built for sm_90a (Hopper: wgmma, 227 KiB shared memory per block, of which it uses "
                           f"~219 KiB); this device is sm_{p.device.capability[0]}{p.device.capability[1]}")
        if p.version("tilelang") is None or importlib.util.find_spec("tilelang") is None:
            reasons.append("tilelang is not installed (pip install tilelang)")
        elif p.device.type == "cuda" and not _nvcc_found():
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

        h = call.h
        if h is None:
            from .fla_chain import fla_recompute_states

            h = fla_recompute_states(call)
        dq, dk, dv, dg, db, dh0 = fused_bwd_given_h(
            call.q, call.k, call.v, call.do, call.a, call.g, call.b, h, call.dht, call.scale, call.seq_lens,
            call.chunk_size, call.cu_seqlens, has_h0=call.initial_state is not None,
            state_v_first=call.state_v_first,
        )
        return GDRGrads(dq, dk, dv, dg, db, dh0)


register(TileLangFusedBackend())
