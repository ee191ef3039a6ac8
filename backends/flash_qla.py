"""Backend `flash_qla`: FlashQLA's fused backward (a peer's TileLang kernels), when installed.

FlashQLA (`pip install 'gdr_dispatch[flashqla]'`) keeps this project's conventions (natural-log
chunk cumsum `g`, ungated inverse `a`, chunk-start `h`) and has kernels for sm90, sm100/103 and
sm120/121. Its `fused_gdr_bwd` leaves two things to its caller, done here: dq/dk come per value
head (summed over the heads that share a q/k head), and its dg is the gradient w.r.t. the
chunk-local cumsum (its own reverse chunk cumsum turns it into the raw gate's). With `h=None`
its `fused_gdr_h` recomputes the states first. Its intra-card split (`auto_cp`) is not used:
the dispatcher's exact split wraps this backend like any other.

Registered when the package is installed (never a hard dependency); it is imported on first
use, because FlashQLA picks its kernels for the current GPU at import and raises elsewhere: a
failed import is a refusal reason, not a silent absence. Limits read from flash_qla 0.1.3's
source (its README is not the reference); the hazards are in docs/contract.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import operator

import torch

from gdr_dispatch import caches, graph_safe
from gdr_dispatch.contract import GDRCall, GDRGrads, as_dtype, packed, packing_test
from gdr_dispatch.problem import Problem
from gdr_dispatch.registry import Backend, Limits, register

from .kernels.head_sum import sum_value_heads

#: Chunk size of FlashQLA's kernels per compute capability (flash_qla/ops/gated_delta_rule/
#: chunk/__init__.py: hopper and blackwell 64, blackwell_sm120 32; other GPUs fail its import).
ARCH_CHUNK = {(9, 0): 64, (10, 0): 64, (10, 3): 64, (12, 0): 32, (12, 1): 32}
#: The release line whose source these limits were checked against.
CHECKED_MINOR = "0.1."


@functools.lru_cache(maxsize=None)
def _ops():
    """FlashQLA's `chunk` and `utils` modules (imported on first use and kept until
    `dispatch.clear_caches()`: `run` is on the hot path)."""
    return (importlib.import_module("flash_qla.ops.gated_delta_rule.chunk"),
            importlib.import_module("flash_qla.ops.utils"))


caches.on_clear(_ops.cache_clear)


@functools.lru_cache(maxsize=None)
def _import_error() -> str:
    """Why FlashQLA's ops cannot be imported here ("" when they can); imported once."""
    try:
        importlib.import_module("flash_qla.ops.gated_delta_rule.chunk")
        importlib.import_module("flash_qla.ops.utils")
    except Exception as e:  # noqa: BLE001 - any failure is the reason the backend refuses
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return ""


class FlashQLABackend(Backend):
    name = "flash_qla"
    optional_lib = "flash_qla"  # a tune with it installed also writes the table entries for users without it
    # FlashQLA's whole backward is 2.8-3.4x faster than fla's op at the saturated h200-train
    # shapes (bench/results/nvidia-h200-sm90.md); first in the static order once verified
    static_rank = 5
    gpu_verified = True  # tests/test_gpu.py on the H200 (flash_qla 0.1.3)
    limits = Limits(devices=("cuda",), capabilities=tuple(ARCH_CHUNK), dtypes=("bfloat16", "float16"), K=(128,),
                    V=(128,), libraries=("flash_qla", "tilelang"), nvcc=True,
                    why={"K": "FlashQLA asserts K == V == 128", "libraries": "FlashQLA's kernels are TileLang"})

    def not_supported_reasons(self, p: Problem) -> list[str]:
        version = p.version("flash_qla")
        if version is None:
            return ["flash_qla is not installed (pip install 'gdr_dispatch[flashqla]')"]
        return super().not_supported_reasons(p)

    def extra_reasons(self, p: Problem) -> list[str]:
        reasons = []
        version = p.version("flash_qla")
        if not version.startswith(CHECKED_MINOR):
            reasons.append(f"flash_qla {version} is untested here: its limits were read from {CHECKED_MINOR}x")
        cap = p.device.capability
        if p.device.type == "cuda" and cap in ARCH_CHUNK and p.chunk_size != ARCH_CHUNK[cap]:
            reasons.append(f"chunk_size must be {ARCH_CHUNK[cap]} on sm_{cap[0]}{cap[1]} (FlashQLA's kernels there), "
                           f"got {p.chunk_size}")
        if not reasons and p.device.type == "cuda" and not self.limits.reasons(p):
            why = _import_error()
            if why:
                reasons.append(f"flash_qla is installed but does not import here: {why}")
        return reasons

    def run(self, call: GDRCall) -> GDRGrads:
        return self._planned(call, reused=False)(call)

    def plan_run(self, call: GDRCall):
        """`run` for the calls of `call`'s plan: what its shapes, dtypes and absent inputs decide
        (casts, the zero dht, the grouped-head sums) decided once; only the packing (strides are
        not in a plan's key) is checked per call."""
        return self._planned(call, reused=True)

    def _planned(self, call: GDRCall, reused: bool):
        """The function `run` applies; with `reused`, one that checks its tensors' packing in one
        test decided from `call`'s shapes (`contract.packing_test`), else through `packed` each."""
        chunk, utils = _ops()
        fused_gdr_h, fused_gdr_bwd, cumsum = chunk.fused_gdr_h, chunk.fused_gdr_bwd, utils.chunk_local_cumsum
        dtype, k_dtype, b_dtype = call.q.dtype, call.k.dtype, call.b.dtype
        Hg, H = call.Hg, call.H
        # its kernels take packed tensors (TMA descriptors), and a and h in q's dtype (as its own
        # forward makes them); its sm120 kernel writes dh0 only when given a dht (a zero one, read only)
        zero_dht = call.dht is None and call.initial_state is not None
        has_h0 = call.initial_state is not None
        # the plan's shapes decide how its packing is checked (`packing_test`): the tensors FlashQLA
        # reads as they are, in one test a call; a and h are cast to q's dtype where they differ
        # (a fresh, packed tensor), h0 (read with h=None only) to fp32
        cast_a, cast_h = call.a.dtype != dtype, call.h is not None and call.h.dtype != dtype
        reads_h0 = has_h0 and call.h is None
        cast_h0 = reads_h0 and call.initial_state.dtype != torch.float32
        read = is_packed = None
        if reused:
            read = operator.attrgetter("q", "k", "v", "g", "b", "do", *(
                name for name, cast in (("a", cast_a), ("h", cast_h), ("dht", False), ("cu_seqlens", False))
                if getattr(call, name) is not None and not cast), *(("initial_state",) if reads_h0 and not cast_h0 else ()))
            is_packed = packing_test(*read(call))

        def planned(c: GDRCall) -> GDRGrads:
            q, k, v, g, b, do, a, h, dht, cu = c.q, c.k, c.v, c.g, c.b, c.do, c.a, c.h, c.dht, c.cu_seqlens
            h0 = c.initial_state if reads_h0 else None
            if is_packed is None or not is_packed(*read(c)):
                q, k, v, g, b, do, dht = packed(q), packed(k), packed(v), packed(g), packed(b), packed(do), packed(dht)
                cu, a, h, h0 = packed(cu), a if cast_a else packed(a), h if cast_h else packed(h), h0 if cast_h0 else packed(h0)
            if cast_a:
                a = packed(a.to(dtype))
            if cast_h:
                h = packed(h.to(dtype))
            if cast_h0:
                h0 = packed(h0.float())
            if zero_dht:
                dht = graph_safe.zeros(tuple(c.initial_state.shape), torch.float32, c.q.device)
            if h is None:
                h, _, _ = fused_gdr_h(k=k, v=v, a=a, g=g, b=b, initial_state=h0, output_final_state=False,
                                      output_h=True, cu_seqlens=cu, state_v_first=c.state_v_first)
            dq, dk, dv, dg, db, dh0 = fused_gdr_bwd(q=q, k=k, v=v, a=a, g=g, b=b, do=do, dht=dht, h=h, scale=c.scale,
                                                    cu_seqlens=cu, chunk_size=c.chunk_size,
                                                    state_v_first=c.state_v_first)
            dg = cumsum(dg, chunk_size=c.chunk_size, cu_seqlens=cu, reverse=True, zero_last_chunk=True)
            # its per-head dq/dk come in v's dtype: summed in fp32 where heads are grouped
            if Hg != H:
                dq, dk = sum_value_heads(dq, Hg, dtype), sum_value_heads(dk, Hg, k_dtype)
            else:
                dq, dk = as_dtype(dq, dtype), as_dtype(dk, k_dtype)
            return GDRGrads(dq, dk, dv, dg, as_dtype(db, b_dtype), dh0 if has_h0 else None)

        return planned

    forward_rank = 10  # FlashQLA's fused forward: ~0.7 ms against ~2.5 for fla's kernels at B8 T4096 H32
    # verified: tests/test_gpu.py's op tests with GDR_FORWARD=flash_qla on the H200 (0.1.3)
    forward_verified = True

    def forward_not_supported_reasons(self, p: Problem) -> list[str]:
        return self.not_supported_reasons(p)  # the same kernels' limits (no h, no dht here)

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, need_final, chunk_size,
                need_states=True):
        """FlashQLA's `chunk_gated_delta_rule_fwd`: its outputs are the contract's residuals (the
        natural-log chunk cumsum, the ungated inverse built by its own KK^T solve, chunk-start
        states). `auto_cp=False`: its intra-card split warms a segment's start state up from
        an earlier point instead of computing it, so it is not exact."""
        chunk = _ops()[0]
        h0 = None if initial_state is None else packed(initial_state.float())
        q, k, v, beta = (packed(x) for x in (q, k, v, beta))  # its kernels take packed tensors only
        G, a, o, h, ht, _ = chunk.chunk_gated_delta_rule_fwd(
            q=q, k=k, v=v, g=packed(g.float()), beta=beta, scale=scale, initial_state=h0, cu_seqlens=cu_seqlens,
            output_final_state=need_final, output_h=need_states, auto_cp=False, state_v_first=state_v_first)
        return o, ht, G, a, h

    residual_forward = True

    def forward_residuals(self, q, k, v, g, beta, cu_seqlens, chunk_size):
        """Its own forward's first kernels: the chunk cumsum and the fused KK^T solve."""
        chunk, utils = _ops()
        G = utils.chunk_local_cumsum(g=packed(g.float()), chunk_size=chunk_size, cu_seqlens=cu_seqlens)
        a = chunk.kkt_solve(k=packed(k), b=packed(beta), chunk_size=chunk_size, cu_seqlens=cu_seqlens)
        return G, a

    def forward_from_residuals(self, q, k, v, G, a, beta, scale, initial_state, cu_seqlens, state_v_first,
                               need_final, chunk_size, need_states=True):
        """Its fused forward kernel (`fused_gdr_fwd`) on given residuals, no split of its own."""
        chunk = _ops()[0]
        h0 = None if initial_state is None else packed(initial_state.float())
        o, h, ht = chunk.fused_gdr_fwd(q=packed(q), k=packed(k), v=packed(v), a=packed(a.to(q.dtype)),
                                       g=packed(G.float()), b=packed(beta), scale=scale, initial_state=h0,
                                       output_final_state=need_final, output_h=need_states, output_o=True,
                                       cu_seqlens=cu_seqlens, state_v_first=state_v_first)
        return o, (ht if need_final else None), (h if need_states else None)

    def forward_compile_jobs(self, spec: tuple, device: str) -> list[tuple[str, str, tuple]]:
        # its forward's kernels in two processes: the chunk cumsum with the KK^T solve, and the
        # fused forward (the two halves `forward_residuals` and `forward_from_residuals` call with
        # the whole forward's arguments, so its first run finds them in TileLang's disk cache). On
        # one chunk per sequence: its kernels take the lengths at run time and key on the rest,
        # the fused forward's tile width on the sequence count times H; so a new length (every
        # prompt at inference) is the same job, built once (its marker)
        f = dict(spec)
        n = len(f["seqlens"]) if f["seqlens"] is not None else f["B"]
        varlen = f["seqlens"] is not None
        f.update(B=1 if varlen else n, T=64 * n if varlen else 64, seqlens=(64,) * n if varlen else None)
        small = tuple(sorted(f.items()))
        return [(__name__, warm_forward_half.__name__, (half, small, device)) for half in ("residuals", "kernel")]

    def compile_jobs(self, call: GDRCall) -> list[tuple[str, str, tuple]]:
        # FlashQLA's kernels take their lengths at run time and key their JIT on the head counts,
        # dtypes, scale and flags: one run on a one-chunk input with the same keys compiles them
        # (about a minute each on the H200's machine, tests/test_gpu.py durations)
        def name(t):
            return None if t is None else str(t.dtype).removeprefix("torch.")

        keys = (call.H, call.Hg, name(call.q), name(call.a), name(call.g), name(call.b), name(call.h),
                name(call.cu_seqlens), call.initial_state is not None, call.dht is not None, call.scale,
                call.state_v_first, call.chunk_size)
        return [(__name__, warm_up.__name__, keys)]


def warm_up(H, Hg, dtype, a_dtype, g_dtype, b_dtype, h_dtype, cu_dtype, has_h0, has_dht, scale, state_v_first,
            chunk_size, device="cuda"):
    """Run the backend once on one chunk with a call's compile-time keys (a compile job)."""
    from gdr_dispatch.contract import validate

    dev, K, T = torch.device(device), 128, chunk_size

    def rnd(*shape, dt):
        return (0.1 * torch.randn(*shape, device=dev)).to(getattr(torch, dt))

    state = (1, H, K, K)
    call = validate(rnd(1, T, Hg, K, dt=dtype), rnd(1, T, Hg, K, dt=dtype), rnd(1, T, H, K, dt=dtype),
                    rnd(1, T, H, T, dt=a_dtype), -torch.rand(1, T, H, device=dev).cumsum(1).to(getattr(torch, g_dtype)),
                    torch.rand(1, T, H, device=dev).to(getattr(torch, b_dtype)), rnd(1, T, H, K, dt=dtype),
                    rnd(*state, dt="float32") if has_dht else None,
                    None if h_dtype is None else rnd(1, 1, H, K, K, dt=h_dtype), scale=scale,
                    initial_state=rnd(*state, dt="float32") if has_h0 else None,
                    cu_seqlens=None if cu_dtype is None else torch.tensor([0, T], dtype=getattr(torch, cu_dtype), device=dev),
                    chunk_size=chunk_size, state_v_first=state_v_first)
    FlashQLABackend().run(call)
    if dev.type == "cuda":
        torch.cuda.synchronize()


def warm_forward_half(half: str, spec: tuple, device: str = "cuda") -> None:
    """Run one half of the forward once on random inputs like `spec` (a forward compile job)."""
    from gdr_dispatch.autotune import forward_inputs

    q, k, v, g, beta, h0, cu, f = forward_inputs(spec, device)
    backend = FlashQLABackend()
    if half == "residuals":
        backend.forward_residuals(q, k, v, g, beta, cu, 64)
    else:
        B, T, H = v.shape[:3]
        a = torch.zeros(B, T, H, 64, dtype=q.dtype, device=q.device)
        backend.forward_from_residuals(q, k, v, g.float().cumsum(1), a, beta, f["scale"], h0, cu, f["state_v_first"],
                                       f["need_final"], 64, need_states=f["need_states"])
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


if importlib.util.find_spec("flash_qla") is not None:
    register(FlashQLABackend())
