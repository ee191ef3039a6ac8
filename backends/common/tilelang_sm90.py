"""What the sm90 TileLang backend shares with its kernels: the limits its kernels declare
(their shared-memory plans are for K = V = 128), the `h=None` state recompute, and how a call
reaches a kernel given `h`."""

from __future__ import annotations

import functools
import importlib
import logging

from gdr_dispatch.caches import first_time, memo
from gdr_dispatch.contract import GDRCall, GDRGrads
from gdr_dispatch.problem import Problem
from gdr_dispatch.registry import Limits, unverified_allowed, unverified_reason
from gdr_dispatch.toolchain import module_found

from . import fla_pipeline


def sm90_limits(smem_note: str) -> Limits:
    """The limits of an sm90 TileLang kernel (`smem_note`: its shared-memory use)."""
    return Limits(devices=("cuda",), capabilities=((9, 0),), dtypes=("bfloat16", "float16"), K=(128,), V=(128,),
                  chunk_sizes=(64,), libraries=("tilelang",), nvcc=True, max_elements=2 ** 31 - 1,
                  why={"capabilities": f"built for sm_90a: wgmma, 227 KiB shared memory per block, of which it "
                                       f"uses {smem_note}",
                       "K": "the shared-memory plan is for 128 x 128 states"})


def h_none_reasons(p: Problem) -> list[str]:
    """With h=None and our state kernel refused, fla-core's stages 1-2 must be there instead."""
    if not p.h_given and p.version("fla") is None:
        why = states_kernel_refusal()
        if why:
            return [f"with h=None the states are recomputed by fla-core's stages 1-2 (our state kernel: {why}), "
                    f"and fla-core is not installed"]
    return []


log = logging.getLogger("gdr_dispatch")
_said = memo("h=None states logged", limit=1024)  # the shapes whose log line was considered


def states_kernel_refusal() -> str:
    """Why `h=None` does not recompute the states on our TileLang kernel
    (kernels/tilelang_states.py), "" when it does; the backends' other limits are its own (sm90,
    K = V = 128, chunk 64, bf16/fp16). Gated like a backend until its GPU tests pass."""
    if not module_found("tilelang"):
        return "tilelang is not installed"
    if not _states_kernel().GPU_VERIFIED and not unverified_allowed():
        return unverified_reason("the state kernel")
    return ""


def own_state_recompute() -> bool:
    """`Backend.own_state_recompute` of the sm90 TileLang backend: `h=None` runs our state kernel."""
    return not states_kernel_refusal()


def recompute_states(call: GDRCall):
    """The chunk-start states of an `h=None` call: our state kernel where `states_kernel_refusal`
    allows it, else fla's stages 1-2. Says once per problem which ran."""
    why = states_kernel_refusal()
    _say_states(call, why)
    return _states(call, why)


def _states(call: GDRCall, why: str):
    if why:
        return fla_pipeline.recompute_states(call)
    return _states_kernel().call_states(call)[0]


def _say_states(call: GDRCall, why: str) -> None:
    """The log line of `recompute_states`, once per problem."""
    # the log line's problem is built once per shape and dtype, not per call (it is on the hot path)
    seen = (call.q.shape, call.v.shape, call.q.dtype, call.q.device, call.N, call.max_seqlen,
            call.cu_seqlens is None, call.initial_state is None, call.dht is None, why)
    if seen not in _said:
        _said[seen] = True
        problem = Problem.from_call(call)
        if first_time(("h=None states", problem.table_key(), why)):
            log.info("gdr_dispatch: h=None: the chunk states on %s for %s",
                     "our TileLang state kernel" if not why else f"fla's stages 1-2 (our state kernel: {why})",
                     problem.describe())


@functools.lru_cache(maxsize=None)
def _states_kernel():
    """kernels/tilelang_states.py, imported on first use (it imports tilelang), then kept."""
    return importlib.import_module(f"{__package__.rpartition('.')[0]}.kernels.tilelang_states")


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
    return _given_h(call, launcher, None if call.h is not None else recompute_states)


def plan_given_h(call: GDRCall, launcher):
    """`run_given_h` for the later calls of `call`'s plan (`Backend.plan_run`): which kernel
    recomputes the states with `h=None` decided and said once, here (the plan's key holds what
    `states_kernel_refusal` reads: the registry's unverified gate and GDR_ALLOW_UNVERIFIED)."""
    if call.h is not None:
        return functools.partial(_given_h, launcher=launcher, states=None)
    why = states_kernel_refusal()
    _say_states(call, why)
    return functools.partial(_given_h, launcher=launcher, states=functools.partial(_states, why=why))


def _given_h(call: GDRCall, launcher, states) -> GDRGrads:
    h = call.h if states is None else states(call)
    dq, dk, dv, dg, db, dh0 = launcher(
        call.q, call.k, call.v, call.do, call.a, call.g, call.b, h, call.dht, call.scale, call.seq_lens,
        call.chunk_size, call.cu_seqlens, has_h0=call.initial_state is not None, state_v_first=call.state_v_first,
    )
    return GDRGrads(dq, dk, dv, dg, db, dh0)
