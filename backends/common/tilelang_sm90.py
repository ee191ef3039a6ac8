"""What the sm90 TileLang fused backends share: what their kernels take (their shared-memory
plans are for K = V = 128) and how a call reaches a kernel given `h`."""

from __future__ import annotations

import importlib.util
import logging

from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.registry import ALLOW_UNVERIFIED_ENV, Problem, first_time, unverified_allowed

from . import fla_pipeline
from .toolchain import nvcc_found


def fused_sm90_limits(p: Problem, smem_note: str) -> list[str]:
    """Every reason an sm90 fused TileLang kernel (`smem_note`: its shared-memory use) cannot take `p`."""
    reasons = []
    if p.device.type != "cuda":
        reasons.append(f"needs a CUDA device; the tensors are on {p.device.type}")
    elif p.device.capability != (9, 0):
        reasons.append(f"built for sm_90a (Hopper: wgmma, 227 KiB shared memory per block, of which it uses "
                       f"{smem_note}); this device is sm_{p.device.capability[0]}{p.device.capability[1]}")
    if p.version("tilelang") is None or importlib.util.find_spec("tilelang") is None:
        reasons.append("tilelang is not installed (pip install tilelang)")
    elif p.device.type == "cuda" and not nvcc_found():
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
        why = states_kernel_refusal()
        if why:
            reasons.append(f"with h=None the states are recomputed by fla-core's stages 1-2 (our state kernel: "
                           f"{why}), and fla-core is not installed")
    return reasons


log = logging.getLogger("gdr_dispatch")


def states_kernel_refusal() -> str:
    """Why `h=None` does not recompute the states on our TileLang kernel
    (kernels/tilelang_states.py), "" when it does; the backends' other limits are its own (sm90,
    K = V = 128, chunk 64, bf16/fp16). Gated like a backend until its GPU tests pass."""
    if importlib.util.find_spec("tilelang") is None:
        return "tilelang is not installed"
    from ..kernels import tilelang_states

    if not tilelang_states.GPU_VERIFIED and not unverified_allowed():
        return f"not verified on a GPU yet; {ALLOW_UNVERIFIED_ENV}=1 runs it"
    return ""


def own_state_recompute() -> bool:
    """`Backend.own_state_recompute` of the sm90 TileLang backends: `h=None` runs our state kernel."""
    return not states_kernel_refusal()


def recompute_states(call: GDRCall):
    """The chunk-start states of an `h=None` call: our state kernel where `states_kernel_refusal`
    allows it, else fla's stages 1-2. Says once per problem which ran."""
    why = states_kernel_refusal()
    problem = Problem.from_call(call)
    if first_time(("h=None states", problem, why)):
        log.info("gdr_dispatch: h=None: the chunk states on %s for %s",
                 "our TileLang state kernel" if not why else f"fla's stages 1-2 (our state kernel: {why})",
                 problem.describe())
    if why:
        return fla_pipeline.recompute_states(call)
    from ..kernels.tilelang_states import call_states

    return call_states(call)[0]


def states_compile_jobs(call: GDRCall) -> list:
    """`compile_jobs`' entry for the state kernel an `h=None` call runs first (none when `h` is given
    or fla's stages 1-2 recompute it): the very build `chunk_states` asks for."""
    if call.h is not None or states_kernel_refusal():
        return []
    from ..kernels import tilelang_states as m

    return [(m.__name__, m.build_states.__name__, m.states_config(call.k, call.v, call.state_v_first))]


def run_given_h(call: GDRCall, launcher) -> GDRGrads:
    """`launcher` (a kernel's `*_given_h`) on the call; with `h=None` the chunk-start states are
    recomputed first (`recompute_states`)."""
    h = call.h if call.h is not None else recompute_states(call)
    dq, dk, dv, dg, db, dh0 = launcher(
        call.q, call.k, call.v, call.do, call.a, call.g, call.b, h, call.dht, call.scale, call.seq_lens,
        call.chunk_size, call.cu_seqlens, has_h0=call.initial_state is not None, state_v_first=call.state_v_first,
    )
    return GDRGrads(dq, dk, dv, dg, db, dh0)
