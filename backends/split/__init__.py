"""The exact intra-GPU split as a wrapper backend: `<backend>@split<n>` runs any registered
backend on each sequence cut into `n` segments of whole chunks, joined exactly (passes.py;
docs/design.md, "The split"). Registered with the registry as a `Wrapper`: the dispatcher asks
it for candidates on grids with fewer sequence x head programs than SMs, and `GDR_CP=<n>` runs
every call through it. The same maps join a sequence's pieces across the ranks of a process
group (ranks.py: `cp_group=`), registered as the context-parallel provider.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Optional

import torch

from gdr_dispatch import env
from gdr_dispatch.caches import first_time
from gdr_dispatch.contract import GDRCall, GDRGrads, chunk_counts, validate
from gdr_dispatch.problem import Problem
from gdr_dispatch.registry import Backend, Wrapper, register_context_parallel, register_wrapper

from . import carry, graphs, passes, ranks
from .forward import lengths, split_forward

log = logging.getLogger("gdr_dispatch")

#: How a split candidate is written in a table: `<backend>@split<segments>`.
SPLIT_MARK = "@split"

#: Segments per sequence a sweep may time on starved grids (each with every supported backend
#: that allows it): powers of two up to the first that fills the SMs (`segment_counts`).
SPLIT_SEGMENTS = (2, 4, 8, 16, 32, 64)


def segment_counts(problem: Problem, thorough: bool = True) -> tuple[int, ...]:
    """The `SPLIT_SEGMENTS` worth timing for a starved grid: each no more than the longest
    sequence's chunks, up to the first count whose segments fill every SM (more only add pass-1
    work and segments of fewer chunks). Not `thorough` (a table miss): only the counts whose
    programs lie between half the SMs and twice them, where every starved shape measured on the
    H200 found its best (docs/kernels.md, "The split")."""
    longest = problem.max_seqlen if problem.max_seqlen is not None else problem.B * problem.T
    chunks = -(-longest // problem.chunk_size)
    sms = problem.device.sm_count
    out = []
    for segments in SPLIT_SEGMENTS:
        if segments > chunks:
            break
        programs = problem.seq_head_ctas * segments
        if thorough or sms <= 2 * programs < 4 * sms:
            out.append(segments)
        if not thorough and programs >= 2 * sms:
            break
        if thorough and programs >= sms:
            break
    if not out and not thorough:
        return segment_counts(problem, thorough=True)[-1:]
    return tuple(out)


class SplitBackend(Backend):
    """A registered backend run on the segments of `passes.split_backward`."""

    reference_rank = None

    def __init__(self, inner: Backend, segments: int):
        self.inner, self.segments = inner, segments
        self.name = f"{inner.name}{SPLIT_MARK}{segments}"
        self.static_rank = inner.static_rank
        self.gpu_verified = True  # the inner backend's own gate applies through its `supported`

    def not_supported_reasons(self, p: Problem) -> list[str]:
        if not self.inner.split_candidate:
            return [f"{self.inner.name} is not split (it declares split_candidate = False)"]
        # the segments are one varlen call with both states given, in the accumulation dtype
        inner = replace(p, B=1, T=p.B * p.T, varlen=True, has_dht=True, has_initial_state=True,
                        state_dtype="float64" if p.dtype == "float64" else "float32",
                        max_seqlen=None, N=p.N * self.segments)
        ok, why = self.inner.supported(inner)
        return [] if ok else [f"{self.inner.name} on the segments: {why}"]

    def forward_not_supported_reasons(self, p: Problem) -> list[str]:
        if self.inner.forward_rank is None:
            return [f"{self.inner.name} offers no forward"]
        # the segments are one varlen call from their start states, in the accumulation dtype
        inner = replace(p, B=1, T=p.B * p.T, varlen=True, has_initial_state=True,
                        state_dtype="float64" if p.dtype == "float64" else "float32", max_seqlen=None,
                        N=p.N * self.segments)
        ok, why = self.inner.forward_supported(inner)
        return [] if ok else [f"{self.inner.name}'s forward on the segments: {why}"]

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, need_final, chunk_size,
                need_states=True):
        keep = carry.wanted()  # the op's backward will reuse the plan, maps and starts (carry.py)

        def fn(x):
            return split_forward(self.inner, self.segments, *x[:5], scale, x[5], x[6], state_v_first,
                                 need_final, chunk_size, need_states=need_states, carry=keep)

        tensors = (q, k, v, g, beta, initial_state, cu_seqlens)
        lens = lengths(cu_seqlens, q.shape[0], q.shape[1])
        if not graphs.wanted(q):
            out = fn(tensors)
        else:  # eager it is host-bound at the starved shapes, as the backward: from the second call, a graph
            key = (f"{self.name} forward", graphs.signature(tensors), lens, scale, state_v_first, need_final,
                   need_states, chunk_size, str(q.device), keep)
            # autograd keeps the outputs until the layer's backward: each layer's graph lends its own (`own`)
            out = graphs.run_tensors(f"{self.name} (the op's forward)", key, tensors, fn, lens, own=True)
        if keep:
            o, final, G, a, h, plan, M, starts = out
            segs = passes.segments_of(lens, chunk_size, self.segments)
            carry.keep(G, k, v, beta, a, initial_state, segs.token_offsets, plan, M, starts)
            return o, final, G, a, h
        return out

    def run(self, call: GDRCall) -> GDRGrads:
        carried = None
        if carry.allowed():
            segs = passes.segments_of(tuple(call.seq_lens), call.chunk_size, self.segments)
            carried = carry.take(call.g, call.k, call.v, call.b, call.a, call.initial_state, segs.token_offsets)
        # eager it is host-bound at the starved shapes: from the second call on, a graph (graphs.py);
        # where the op's forward split the same way, its plan, maps and starts are the graph's inputs too
        extra = () if carried is None else (carried.plan, carried.M, carried.starts)
        return graphs.run(self.name, call, self._run, extra)

    def _run(self, call: GDRCall, *carried) -> GDRGrads:
        return passes.split_backward(call, self.segments, run=self.inner.run,
                                     states_by_run=self.inner.own_state_recompute(), carried=carried)

    def compile_jobs(self, call: GDRCall) -> list[tuple[str, str, tuple]]:
        """The inner backend's builds for pass 3's call (the segments as one varlen call with both
        states in fp32): FlashQLA's kernels key on those flags, so precompiling only the unsplit
        call leaves about a minute of compiling to the first use; and the split's own passes
        (`warm_passes`), whose Triton kernels would otherwise compile in the caller's process
        when first used."""
        from gdr_dispatch.autotune import call_spec

        passes_of = (self.segments, self.inner.own_state_recompute())
        return self._inner_jobs(call) + [(__name__, warm_passes.__name__, (passes_of, call_spec(call),
                                                                           str(call.q.device)))]

    def _inner_jobs(self, call: GDRCall) -> list[tuple[str, str, tuple]]:
        segs = passes.segments_of(tuple(call.seq_lens), call.chunk_size, self.segments)
        seg_lens = segs.lens
        flat, offsets = passes._segments_inputs(call, segs.token_offsets)
        shape = (len(seg_lens), call.H, call.V, call.K) if call.state_v_first else (len(seg_lens), call.H, call.K, call.V)
        states = torch.zeros(shape, dtype=passes._state_dtype(call), device=call.q.device)
        h = None if call.h is None else call.h.reshape(1, -1, *call.h.shape[2:])
        # pass 3 takes h given where our maps run pass 1 unless the backend recomputes them itself;
        # what the maps check (K, V, dtype, chunk size, device) is the same for the unsplit call
        if h is None and not self.inner.own_state_recompute() and not passes._maps_kernels_refusal(call):
            nt = sum(chunk_counts(seg_lens, call.chunk_size))
            h = torch.zeros(1, nt, call.H, *shape[2:], dtype=call.q.dtype, device=call.q.device)
        seg = validate(**flat, h=h, dht=states, initial_state=states, scale=call.scale, chunk_size=call.chunk_size,
                       cu_seqlens=offsets, state_v_first=call.state_v_first)
        return self.inner.compile_jobs(seg)


def warm_passes(passes_of: tuple, spec: tuple, device: str = "cuda") -> None:
    """A compile job (`SplitBackend.compile_jobs`, in its own process): the split's passes once on
    random inputs like the call `spec` describes (autotune.call_spec), `passes_of` the segment
    count and whether the inner backend recomputes the states itself, the segments' backward a
    stand-in of zeros, so only the split's own kernels compile here (the inner backend's builds
    are jobs of their own, run beside it)."""
    from gdr_dispatch.autotune import spec_call

    segments, states_by_run = passes_of
    passes.split_backward(spec_call(spec, device), segments, run=_zero_grads, states_by_run=states_by_run)
    if device.startswith("cuda"):
        torch.cuda.synchronize()


#: Its marker keys on what it compiles, not the lengths (autotune.built_marker).
warm_passes.length_free = True


def _zero_grads(call: GDRCall) -> GDRGrads:
    """A stand-in backward: zeros of the gradients' shapes and dtypes."""
    acc = call.acc_dtype
    return GDRGrads(torch.zeros_like(call.q), torch.zeros_like(call.k), torch.zeros_like(call.v),
                    torch.zeros(call.g.shape, dtype=acc, device=call.g.device), torch.zeros_like(call.b),
                    None if call.initial_state is None else torch.zeros(call.initial_state.shape, dtype=acc,
                                                                        device=call.q.device))


class Split(Wrapper):
    mark = SPLIT_MARK

    @staticmethod
    def _counts(problem: Problem, thorough: bool) -> tuple[int, ...]:
        """The segment counts worth timing on a starved GPU grid (fewer sequence x head programs
        than SMs); none on a CPU or a full grid."""
        if problem.device.type != "cuda" or problem.seq_head_ctas >= problem.device.sm_count:
            return ()
        return segment_counts(problem, thorough)

    def candidates(self, problem: Problem, supported: dict, thorough: bool = False) -> dict:
        """`<backend>@split<n>` for a starved grid (fewer sequence x head programs than SMs):
        nothing while `GDR_CP` decides, on a CPU, or when the grid is full."""
        if env.cp_segments() is not None:
            return {}
        out = {}
        for segments in self._counts(problem, thorough):
            for backend in supported.values():
                if backend.split_candidate:
                    split = SplitBackend(backend, segments)
                    if split.supported(problem)[0]:
                        out[split.name] = split
        return out

    def forward_candidates(self, problem: Problem, offers: dict) -> dict:
        """`<provider>@split<n>` for the op's forward on a starved grid, the counts a table miss
        of the backward times: nothing with `GDR_CP=0`, on a CPU, or when the grid is full."""
        if env.cp_segments() == 0:
            return {}
        out = {}
        for segments in self._counts(problem, thorough=False):
            for backend in offers.values():
                if backend.split_candidate and not backend.reference:
                    split = SplitBackend(backend, segments)
                    if split.forward_supported(problem)[0]:
                        out[split.name] = split
        return out

    def wrap(self, inner: Backend, n: int) -> Backend:
        return SplitBackend(inner, n)

    def forced(self, call: GDRCall, n: int, run: Callable[[GDRCall], GDRGrads],
               inner: Optional[Backend]) -> GDRGrads:
        problem = Problem.from_call(call)
        if first_time(("split", problem.table_key(), n)):
            log.info("gdr_dispatch: split=%d (%s) for %s: each sequence in %d segments of whole chunks, run as one "
                     "varlen call", n, env.CP, problem.describe(), n)
        # a forced backend that recomputes the states in its own kernel does so for pass 3 too,
        # as its `<backend>@split<n>` candidate does
        own = inner is not None and inner.own_state_recompute()
        name = f"{env.CP}={n}" + ("" if inner is None else f" on {inner.name}")
        return graphs.run(name, call, lambda c: passes.split_backward(c, n, run=run, states_by_run=own))


register_wrapper(Split())
register_context_parallel(ranks)
