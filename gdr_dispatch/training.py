"""`chunk_gated_delta_rule`: the training drop-in, differentiable, with the backward dispatched.

    o, final_state = gdr_dispatch.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                         output_final_state=True)

fla-core 0.6's semantics for the arguments it shares with fla's op (`g` the per-token natural-log
decay, not cumulated; `beta` already in (0, 1); varlen through `cu_seqlens` with `B == 1`).
The forward saves exactly the contract's residuals (docs/contract.md: the chunk cumsum `G`, the
ungated inverse `a`, and `h` or not) and the backward is `fused_gdr_bwd`, so the tuning tables and
`GDR_BACKEND` decide which backend runs it. The forward comes from a backend that offers one
(`Backend.forward`), or its split (`<provider>@split<n>`, backends/split/forward.py), chosen as
`forward_choice` says: `GDR_FORWARD`, a table entry, a measurement on a starved grid, else the
lowest `forward_rank` that takes the call (FlashQLA's fused forward where flash-qla is installed,
else fla-core's kernels on a GPU, the torch reference elsewhere); a log line names it.

Inputs are taken as callers pass them: strided views (HF's q, k, v are a split of one projection,
then a transpose), `g`, `beta` and `initial_state` in 16-bit dtypes as fla's op takes them
(computed in fp32 inside; each gradient comes back in its input's dtype). The arguments are
checked as `fused_gdr_bwd` checks its own (contract.validate_forward): shapes and dtypes also
while `torch.compile` traces (in the ops' fake implementations), values on every eager call.

Both halves are `torch.library` custom ops with fake implementations, so `torch.compile(...,
fullgraph=True)` traces a model that uses them without a graph break.

Memory, per layer call (bf16 inputs, K = V = 128, chunk 64): `G` is 4 bytes and `a` 128 bytes
per token and value head, always saved. `save_states=True` (or `GDR_SAVE_STATES=1`) also keeps
`h`: K x V x 2 bytes per chunk and value head, i.e. 512 bytes per token and head (4x what `a`
costs); the backward then skips the state recompute. The default recomputes it (on sm90 with the
TileLang backend our state kernel, ~0.36 ms at B8 T4096 H32; else fla's stages 1-2, about a fifth
of the backward's time at the h200-train shapes: docs/kernels.md).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Callable, Optional

import torch

from . import carry, env, plans, tuning_table
from .caches import Memo, first_time, memo
from .contract import AUTOCAST_DEVICES, check_forward_structure, check_scale, packed, sequence_lengths
from .dispatch import fused_gdr_bwd
from .graph_safe import offsets_of, remember_private, remembered
from .problem import Problem, device_info, library_versions
from .registry import forward_env, get_backend, parse_wrapped, registered_backends, wrappers

CHUNK = 64
log = logging.getLogger("gdr_dispatch")


def _empty(ref: torch.Tensor) -> torch.Tensor:
    return ref.new_empty(0)


def _dt(x) -> Optional[str]:
    return None if x is None else str(x.dtype).replace("torch.", "")


# ---------------------------------------------------------------------------------------
# forward: the residuals and o, from the backend that offers the forward for this call
# ---------------------------------------------------------------------------------------
def forward_problem(q, v, beta, initial_state, cu_seqlens, state_v_first, seq_lens=None) -> Problem:
    """What a forward provider's `forward_supported` reads (no `h`, no `dht`)."""
    B, T, Hg, K = q.shape
    H, V = v.shape[2], v.shape[3]
    lens = list(seq_lens if seq_lens is not None else sequence_lengths(cu_seqlens, B, T))
    return Problem(B=B, T=T, H=H, Hg=Hg, K=K, V=V, N=len(lens), chunk_size=CHUNK, forward=True,
                   num_chunks=sum(-(-n // CHUNK) for n in lens), max_seqlen=max(lens, default=0),
                   dtype=_dt(q), a_dtype=_dt(q), b_dtype=_dt(beta), h_dtype=None, state_dtype=_dt(initial_state),
                   varlen=cu_seqlens is not None, h_given=False, has_dht=False,
                   has_initial_state=initial_state is not None, state_v_first=state_v_first,
                   device=device_info(q.device), versions=tuple(library_versions().items()))


_forward_decided = memo("forward decisions")  # table key -> (backend, how), from a table or a measurement


def forward_to_measure(problem: Problem) -> dict:
    """The candidates `forward_choice` would measure at `problem` now ({} where it would not: a
    forced or decided forward, a table entry, a full grid, autotuning off)."""
    if env.forced_forward_name():
        return {}
    if _decided_forward(problem) is not None:
        return {}
    offers, candidates, _ = forward_candidates(problem)
    if all(n in offers for n in candidates) or _table_forward(problem, offers, warn=False) is not None:
        return {}
    from .dispatch import autotune_block_reason

    return candidates if autotune_block_reason(problem, True) is None else {}


def forward_choice(problem: Problem, measure_on: Optional[Callable] = None, jobs: Optional[dict] = None):
    """`(backend, how)`: the backend whose `forward` runs and how it was chosen.

    In order: the one `GDR_FORWARD` names (an error, with its reasons, if it cannot take the
    call; `<provider>@split<n>` too); a tuning-table entry for the forward (its key carries the
    `forward` flag); on a starved grid, where the split's forwards are candidates, a measurement
    of the first provider whole and split on the call's inputs (`forward_candidates`;
    `measure_on(backend)` runs one; autotuning allowed), stored in the user's table; else the lowest `forward_rank` that takes the call (on a full grid
    the ranks are the measured order: docs/design.md, "The training op"). `how` names the
    ones passed over and why. `jobs`: candidate -> its early build (`_start_forward_compiles`),
    waited for before it is timed."""
    forced = env.forced_forward_name()
    if forced:
        backend = get_backend(forced, what=f"{env.FORWARD}={forced}")
        ok, why = backend.forward_supported(problem)
        if not ok:
            raise ValueError(f"{env.FORWARD}={forced}: its forward cannot take {problem.describe()}: {why}")
        return backend, env.FORWARD
    decided = _decided_forward(problem)
    if decided is not None:
        return decided
    key = _forward_key(problem)
    offers, candidates, refusals = forward_candidates(problem)
    first = next(iter(offers.values()))
    from_table = _table_forward(problem, offers, warn=True)
    if from_table is not None:
        _forward_decided[key] = from_table
        return from_table
    if any(n not in offers for n in candidates) and measure_on is not None:
        from .dispatch import autotune_block_reason

        if autotune_block_reason(problem, True) is None:
            try:
                entry = measure_forwards(problem, candidates, first.name, measure_on, jobs=jobs)
            except RuntimeError as e:  # nothing agreed with the provider whole: it runs, as ranked
                log.warning("gdr_dispatch: the op's forward at %s was not measured (%s); %s runs", problem.describe(),
                            e, first.name)
                _forward_decided[key] = (first, f"lowest forward_rank (the measurement failed: {e})")
                return _forward_decided[key]
            try:
                where = tuning_table.record(problem.device.slug, problem.device.name, {problem.table_key(): entry})
                where = f"stored in {where}"
            except OSError as e:
                log.warning("gdr_dispatch: could not write the tuning table (%s); keeping the choice in memory", e)
                where = "not stored"
            log.warning("gdr_dispatch: the op's forward at %s: %s picked (%s ms); later calls take it from the "
                        "table", problem.describe(), entry["winner"], entry["candidates"][entry["winner"]]["ms"])
            _forward_decided[key] = (candidates[entry["winner"]], f"measured, {where}")
            return _forward_decided[key]
    return first, "lowest forward_rank that takes it" + (f"; passed over {'; '.join(refusals)}" if refusals else "")


def _forward_key(problem: Problem) -> tuple:
    """A forward decision stands per table key and the environment it read (GDR_CP, the table
    directory, ...)."""
    return problem.table_key(), env.snapshot(forward_env())


def _decided_forward(problem: Problem):
    """The `(backend, how)` decided earlier for `problem`, while its backend still takes it."""
    decided = _forward_decided.get(_forward_key(problem))
    return decided if decided is not None and decided[0].forward_supported(problem)[0] else None


def _table_forward(problem: Problem, offers: dict, warn: bool):
    """`(backend, how)` from the first table entry for `problem` whose winner can take it now,
    else None; `warn`: an exact entry that cannot is said."""
    for hit in tuning_table.lookup(problem.device.slug, problem.problem_key(), problem.versions_key()):
        winner = _forward_winner(hit.entry, problem, offers)
        if winner is not None:
            return winner, f"table {hit.path}" + ("" if hit.exact else f", {hit.versions_note}")
        if warn and hit.exact:
            log.warning("gdr_dispatch: table %s names %r for %s, which cannot take it now; ignoring the entry",
                        hit.path, hit.entry.get("winner"), problem.describe())
    return None


def _forward_winner(entry: dict, problem: Problem, offers: dict):
    """A table entry's forward winner when it can take `problem` now (a split count measured at
    another size of the same table key too), else None; with `GDR_CP=0` and a split winner, the
    fastest unsplit provider the entry measured."""
    name = entry.get("winner")
    if not isinstance(name, str):
        return None
    try:
        backend = get_backend(name)
    except ValueError:
        return None
    if parse_wrapped(name)[1] > 1 and env.cp_segments() == 0:
        fastest = tuning_table.fastest_measured(entry, offers)
        return None if fastest is None else offers[fastest]
    return backend if backend.forward_supported(problem)[0] else None


def forward_candidates(problem: Problem) -> tuple[dict, dict, list]:
    """`(offers, candidates, refusals)`: the providers whose forward takes `problem` (lowest
    `forward_rank` first), what a measurement times (the first of them whole and, on a starved
    grid, split), and why the others refuse."""
    refusals, offers = [], {}
    for backend in sorted((b for b in registered_backends().values() if b.forward_rank is not None),
                          key=lambda b: b.forward_rank):
        ok, why = backend.forward_supported(problem)
        if ok:
            offers[backend.name] = backend
        else:
            refusals.append(f"{backend.name}: {why}")
    if not offers:
        raise RuntimeError(f"no backend's forward takes {problem.describe()}: " + "; ".join(refusals))
    # one provider, the lowest-ranked, whole and split: the ranks are the measured order of the
    # providers, whole and split alike (FlashQLA's forward against fla's kernels at B1 T32768 H4:
    # 1.13 against 1.55 ms whole, 0.45 against 0.66 split in 8; H200, docs/kernels.md), so a
    # measurement decides whether and how far to split, and a first call compiles and autotunes
    # no other provider's kernels
    first = next(iter(offers.values()))
    candidates = {first.name: first}
    for w in wrappers():
        candidates.update(w.forward_candidates(problem, {first.name: first}))
    return offers, candidates, refusals


def measure_forwards(problem: Problem, candidates: dict, reference: str, measure_on: Callable,
                     measure: Optional[Callable] = None, say: Optional[Callable[[str], None]] = None,
                     jobs: Optional[dict] = None) -> dict:
    """Time every candidate forward on the call's inputs (`measure(fn, device_type) -> ms`,
    default `autotune.measure_ms`) and cross-check each output and final state against
    `reference`'s (the lowest-ranked provider, unsplit): the table entry. `say` gets a line per
    candidate (default: a first call's progress lines). `jobs`: candidate -> a build started early
    (autotune.forward_job), waited for before the candidate runs here."""
    from .autotune import AGREEMENT_TOL, measure_ms, relative_error, wait_early, waiting
    from .graph_safe import copied_graph_inputs
    from .tuning_table import now_iso

    measure = measure or measure_ms
    say = say or waiting(f"first call of the op's forward at {problem.describe()}: no tuning-table entry, so its "
                         f"{len(candidates)} candidates (providers and their splits) are measured on it")
    results, outputs = {}, {}
    # every early build done before anything is timed (a build runs its forward on this GPU)
    for job in dict.fromkeys((jobs or {}).values()):
        built = wait_early(job)
        if built is not None:
            say(f"forward: {job[2][0]} built in the background in {built:.1f} s")
    for i, (name, backend) in enumerate(candidates.items(), 1):
        try:
            outputs[name] = measure_on(backend)
            with copied_graph_inputs():  # as a model whose layers share the shape calls it
                results[name] = {"ms": round(measure(lambda: measure_on(backend), problem.device.type), 4)}
        except Exception as e:  # a candidate that breaks is recorded, never chosen
            outputs.pop(name, None)
            results[name] = {"failed": f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        say(f"forward [{i}/{len(candidates)}] {name}: " + (f"{results[name]['ms']} ms" if "ms" in results[name]
                                                            else results[name]["failed"]))
    tol = AGREEMENT_TOL[problem.dtype]
    ref = outputs.get(reference)
    if ref is None:  # nothing to cross-check a split against: no pick
        raise RuntimeError(f"the provider whole ({reference}) failed: {results[reference].get('failed')}")
    for name, out in outputs.items():
        if name == reference:
            continue
        for what, i in (("o", 0), ("final_state", 1)):
            err = relative_error(out[i], ref[i]) if out[i] is not None and ref[i] is not None else 0.0
            if not err <= tol:
                results[name] = {"failed": f"disagrees with {reference}: {what} relative error {err:.3g} > {tol:g}",
                                 "ms": results[name].get("ms")}
                break
    timed = {n: r["ms"] for n, r in results.items() if "ms" in r and "failed" not in r}
    if not timed:
        raise RuntimeError(f"every forward failed at {problem.describe()}: "
                           + "; ".join(f"{n}: {r.get('failed')}" for n, r in results.items()))
    winner = min(timed, key=timed.get)
    log.info("gdr_dispatch: the op's forward at %s: %s picked (%.3f ms)", problem.describe(), winner, timed[winner])
    return {"problem": problem.describe(), "winner": winner, "candidates": results,
            "cross_check": {"reference": reference, "tol": tol}, "measured_at": now_iso()}


def select_forward(problem: Problem):
    """The backend whose `forward` runs for `problem` (`forward_choice`)."""
    return forward_choice(problem)[0]


def forward_view(problem: Problem) -> Problem:
    """A backward call's problem as the training op's forward sees it: no `h`, no `dht`, `a`
    still to be made (in q's dtype)."""
    return replace(problem, h_given=False, h_dtype=None, has_dht=False, a_dtype=problem.dtype, forward=True)


@torch.library.custom_op("gdr_dispatch::chunk_gdr_fwd", mutates_args=())
def chunk_gdr_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                  output_final_state: bool, state_v_first: bool, save_states: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(o, final_state or [], G, a, h or [])`: the output and the backward's residuals."""
    return _forward_impl(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, state_v_first,
                         save_states)


def _forward_impl(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, state_v_first,
                  save_states):
    """The op's forward, behind the custom op (traced) and `_Eager` (eager) alike; under
    `torch.autocast` with autocast off (the math in the inputs' own dtypes, as fused_gdr_bwd)."""
    if q.device.type in AUTOCAST_DEVICES and torch.is_autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):
            return _forward_impl(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                                 state_v_first, save_states)
    key = plans.forward_key(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, state_v_first,
                            save_states)
    plan = plans.forward.get(key) if key is not None else None
    if plan is None:
        B, T, Hg, K, H, V = check_forward_structure(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, CHUNK)
        check_scale(scale, K)
        plan = _ForwardPlan(B, T, None if cu_seqlens is not None else sequence_lengths(None, B, T))
    seq_lens = plan.fixed or sequence_lengths(cu_seqlens, plan.B, plan.T)  # the values, on every eager call
    # what a provider's verdict reads from the values: the chunk count and the longest sequence
    variant = (sum(-(-n // CHUNK) for n in seq_lens), max(seq_lens)) if plan.fixed is None else None
    backend = plan.backends.get(variant)
    if backend is None:
        problem = forward_problem(q, v, beta, initial_state, cu_seqlens, state_v_first, seq_lens)
        jobs, own = {}, []

        def measure_on(b):
            return b.forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first, output_final_state,
                             CHUNK, need_states=save_states)[:2]

        if q.is_cuda and not len(plan.backends):
            # a new shape: the builds of the forwards it is about to measure start now, in parallel
            # processes, or, where it measures none, the chosen provider's own kernels; and
            # (training) the backward's beside them (docs/design.md, "The first step")
            jobs = _start_forward_compiles(problem, q, v, g, beta, initial_state, cu_seqlens, seq_lens, scale,
                                           output_final_state, state_v_first, save_states)
            if not jobs and not forward_to_measure(problem):
                backend, how = forward_choice(problem, measure_on=measure_on, jobs=jobs)
                own = _start_provider_builds(backend, q, v, g, beta, initial_state, cu_seqlens, seq_lens, scale,
                                             output_final_state, state_v_first, save_states)
            if any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)):
                _start_backward_compiles(q, k, v, beta, initial_state, cu_seqlens, seq_lens, scale,
                                         output_final_state, state_v_first, save_states)
        if backend is None:
            backend, how = forward_choice(problem, measure_on=measure_on, jobs=jobs)
        if own:
            from .autotune import wait_early

            for job in own:  # built in TileLang's (or Triton's) disk cache: the forward below loads them
                wait_early(job)
        if first_time(("forward", problem.table_key(), backend.name)):
            log.info("gdr_dispatch: forward %s for %s (%s)", backend.name, problem.describe(), how)
        if key is not None:
            plan.backends[variant] = backend
            plans.forward[key] = plan
        carry.discard()  # what the measured candidates kept: only the pick's goes to the backward
    o, ht, G, a, h = backend.forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first,
                                     output_final_state, CHUNK, need_states=save_states)
    if save_states:
        h = h.to(q.dtype) if h.dtype != q.dtype and q.dtype in (torch.bfloat16, torch.float16) else h
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (packed(o.to(q.dtype)), packed(ht.to(acc)) if output_final_state else _empty(q), packed(G.to(acc)),
            packed(a.to(q.dtype)), packed(h) if save_states else _empty(q))


def forward_candidate_jobs(candidates, q, v, g, beta, initial_state, cu_seqlens, lens, scale, state_v_first,
                           need_final, need_states) -> dict:
    """`{candidate: job}` (autotune.forward_job) for the op's forward candidates: a provider's
    splits build its same kernels at every count (the segments' varlen call; our small Triton
    passes differ by count and build at the measurement), so they share one job."""
    from .autotune import forward_job
    from .registry import base_name

    jobs, first_split = {}, {}
    for name in candidates:
        split = parse_wrapped(name)[1] > 1
        same = first_split.get(base_name(name)) if split else None
        jobs[name] = same or forward_job(name, q, v, g, beta, initial_state, cu_seqlens, lens, scale,
                                         state_v_first, need_final, need_states)
        if split:
            first_split.setdefault(base_name(name), jobs[name])
    return jobs


def _start_forward_compiles(problem, q, v, g, beta, initial_state, cu_seqlens, lens, scale, output_final_state,
                            state_v_first, save_states) -> dict:
    """The forwards a first call at `problem` will measure (`forward_to_measure`), each built in a
    background process now (autotune.forward_job): `{candidate: job}` for `measure_forwards` to
    wait on before timing it, so their compiles overlap each other's and the backward's instead
    of running one after another in this process."""
    from .autotune import build_bytes, start_compiles

    try:
        jobs = forward_candidate_jobs(forward_to_measure(problem), q, v, g, beta, initial_state, cu_seqlens, lens,
                                      scale, state_v_first, output_final_state, save_states)
        # each runs the forward at full size (q and k, v and o, beta, g): room for that beside the caller
        # (one too long for a command-line argument is not started, and its wait returns at once)
        started = start_compiles(list(dict.fromkeys(jobs.values())), device=q.device,
                                 per_job=build_bytes(q, q, v, v, beta, g))
    except Exception as e:  # noqa: BLE001 - an early start is an optimisation: the measurement builds them itself
        log.info("gdr_dispatch: could not start the forward's compiles early (%s: %s)", type(e).__name__, e)
        return {}
    if started:
        log.info("gdr_dispatch: the op's forward: %d candidates' builds started in the background", started)
    return jobs


def _start_provider_builds(backend, q, v, g, beta, initial_state, cu_seqlens, lens, scale, output_final_state,
                           state_v_first, save_states) -> list:
    """The chosen provider's forward kernels (`Backend.forward_compile_jobs`), each built in a
    background process now, unless a process before built them (autotune.built_marker): the jobs,
    for the forward to wait on (FlashQLA's forward builds its kernels one after another, ~30-50 s
    on the H200's machine: bench/results/nvidia-h200-sm90-hf-first-step.md)."""
    from .autotune import forward_spec, start_compiles

    try:
        spec = forward_spec(q, v, g, beta, initial_state, cu_seqlens, lens, scale, state_v_first, output_final_state,
                            save_states)
        jobs = backend.forward_compile_jobs(spec, str(q.device))
        started = start_compiles(jobs, unbuilt_only=True, device=q.device)
    except Exception as e:  # noqa: BLE001 - an early start is an optimisation: the forward builds them itself
        log.info("gdr_dispatch: could not start the forward's builds early (%s: %s)", type(e).__name__, e)
        return []
    if started:
        log.info("gdr_dispatch: the op's forward: %s's %d kernel builds started in the background", backend.name,
                 started)
    return jobs


def _start_backward_compiles(q, k, v, beta, initial_state, cu_seqlens, lens, scale, output_final_state,
                             state_v_first, save_states) -> None:
    """A training forward at a new shape: the builds its backward will need start now, in
    background processes (dispatch.start_backward_compiles), so they overlap the forward's own
    compiles and measurement. The backward's call is built with uninitialised residuals (compile
    jobs read shapes and flags only); `lens` the sequence lengths the forward read."""
    from .contract import validate
    from .dispatch import start_backward_compiles

    B, T, H = v.shape[0], v.shape[1], v.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    state = (H, v.shape[3], q.shape[3]) if state_v_first else (H, q.shape[3], v.shape[3])
    a = q.new_empty(B, T, H, CHUNK)
    G = q.new_empty(B, T, H, dtype=acc)
    dht = h = None
    if output_final_state:  # autograd hands the backward a gradient for every output it returns
        dht = q.new_empty((len(lens),) + state, dtype=acc)
    if save_states:
        nt = sum(-(-n // CHUNK) for n in lens)
        h = q.new_empty(((1, nt) if cu_seqlens is not None else (B, nt // B)) + state)
    try:
        n = start_backward_compiles(validate(q, k, v, a, G, beta, v, dht, h, scale=scale,
                                             initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=CHUNK,
                                             state_v_first=state_v_first))
    except Exception as e:  # noqa: BLE001 - an early start is an optimisation: the backward decides as ever
        log.info("gdr_dispatch: could not start the backward's compiles early (%s: %s)", type(e).__name__, e)
        return
    if n:
        log.info("gdr_dispatch: the backward's %d kernel builds started in the background", n)


class _ForwardPlan:
    """The op forward's plan (plans.py): its sizes, its sequence lengths when they read no values
    (no `cu_seqlens`), and its provider per (chunk count, longest sequence)."""

    __slots__ = ("B", "T", "fixed", "backends")

    def __init__(self, B: int, T: int, fixed: Optional[tuple]):
        self.B, self.T, self.fixed = B, T, fixed
        self.backends = Memo("forward variants", limit=256)


@chunk_gdr_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, state_v_first, save_states):
    # the structural checks on the traced (fake) tensors: under torch.compile a bad call fails here,
    # naming the argument, before any kernel is traced
    B, T, Hg, K, H, V = check_forward_structure(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, CHUNK)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = (N, H, V, K) if state_v_first else (N, H, K, V)
    o = v.new_empty(B, T, H, V, dtype=q.dtype)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    ht = q.new_empty(state, dtype=acc) if output_final_state else q.new_empty(0)
    G = q.new_empty(B, T, H, dtype=acc)
    a = q.new_empty(B, T, H, CHUNK)
    if save_states:
        nt = torch.library.get_ctx().new_dynamic_size() if cu_seqlens is not None else math.ceil(T / CHUNK)
        h = q.new_empty((B, nt, H) + state[2:], dtype=q.dtype if q.dtype in (torch.bfloat16, torch.float16)
                        else G.dtype)
    else:
        h = q.new_empty(0)
    return o, ht, G, a, h


# ---------------------------------------------------------------------------------------
# backward: fused_gdr_bwd, whichever backend the dispatcher picks
# ---------------------------------------------------------------------------------------
@torch.library.custom_op("gdr_dispatch::chunk_gdr_bwd", mutates_args=())
def chunk_gdr_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, G: torch.Tensor,
                  beta: torch.Tensor, do: torch.Tensor, dht: Optional[torch.Tensor], h: Optional[torch.Tensor],
                  initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                  state_v_first: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dq, dk, dv, dg, dbeta, dh0 or [])` through `fused_gdr_bwd`, packed as the fake says."""
    grads = _backward_impl(q, k, v, a, G, beta, do, dht, h, initial_state, cu_seqlens, scale, state_v_first)
    dh0 = grads.dh0 if grads.dh0 is not None else _empty(q)
    return tuple(packed(x) for x in (grads.dq, grads.dk, grads.dv, grads.dg, grads.db, dh0))


def _backward_impl(q, k, v, a, G, beta, do, dht, h, initial_state, cu_seqlens, scale, state_v_first):
    return fused_gdr_bwd(q, k, v, a, G, beta, do, dht, h, scale=scale, initial_state=initial_state,
                         cu_seqlens=cu_seqlens, chunk_size=CHUNK, state_v_first=state_v_first)


@chunk_gdr_bwd.register_fake
def _(q, k, v, a, G, beta, do, dht, h, initial_state, cu_seqlens, scale, state_v_first):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dh0 = initial_state.new_empty(initial_state.shape, dtype=acc) if initial_state is not None else q.new_empty(0)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), G.new_empty(G.shape, dtype=acc),
            beta.new_empty(beta.shape), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, state_v_first, save_states = inputs
    o, ht, G, a, h = output
    ctx.mark_non_differentiable(G, a, h)
    if cu_seqlens is not None:
        # the backward runs on the forward's lengths: a private copy, so that a buffer the caller
        # refills before the backward (through numpy or .data, which autograd cannot see) does not
        # change them; its values are known, so a CUDA graph capture reads nothing
        traced = torch.compiler.is_compiling() or isinstance(cu_seqlens, torch._subclasses.FakeTensor)
        # the forward's validation has just read them: no second read (a device sync per layer)
        offsets = None if traced else remembered(cu_seqlens) or offsets_of(cu_seqlens)
        cu_seqlens = cu_seqlens.clone()
        if offsets is not None:  # known and private: the backward's checks read nothing (no device wait)
            remember_private(cu_seqlens, offsets)
    ctx.save_for_backward(q, k, v, beta, G, a, h, initial_state, cu_seqlens)
    ctx.scale, ctx.state_v_first, ctx.save_states, ctx.g_dtype = scale, state_v_first, save_states, g.dtype


def _backward(ctx, do, dht, dG, da, dh):
    q, k, v, beta, G, a, h, initial_state, cu_seqlens = ctx.saved_tensors
    if do is None:
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    dht = dht if dht is not None and dht.numel() > 0 else None
    args = (q, k, v, a, G, beta, do.to(q.dtype), dht, h if ctx.save_states else None, initial_state, cu_seqlens,
            ctx.scale, ctx.state_v_first)
    if ctx.eager:
        # dropped once offered: the context outlives the backward while the caller keeps the loss
        # (a training loop's `loss` into the next step), and a split forward's carry is its graph's
        # own buffers, lent until nothing holds them (backends/split/graphs.py); a second backward
        # (retain_graph) runs all of the split's pass 1
        carried, ctx.carried = ctx.carried, None
        with carry.offering(carried):
            dq, dk, dv, dg, db, dh0 = _backward_impl(*args)
    else:  # traced: the backward's own custom op, so the compiled graph holds it
        dq, dk, dv, dg, db, dh0 = torch.ops.gdr_dispatch.chunk_gdr_bwd(*args)
    return (dq, dk, dv, dg.to(ctx.g_dtype), db, dh0.to(initial_state.dtype) if initial_state is not None else None,
            None, None, None, None, None)


def _traced_backward(ctx, *grads):
    ctx.eager = False
    return _backward(ctx, *grads)


torch.library.register_autograd("gdr_dispatch::chunk_gdr_fwd", _traced_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The op in eager mode: the custom op's forward, context and backward without torch.library's
    Python dispatch around each call (the same functions; about a third of the op's host time per
    training step on a CPU, docs/design.md "The hot path"). Traced calls, functorch transforms,
    dispatch modes, tensor subclasses and fake tensors keep the custom op."""

    @staticmethod
    def forward(ctx, *inputs):  # (ctx first, no setup_context: apply then binds no signature per call)
        if not any(ctx.needs_input_grad):  # no backward will run
            return _forward_impl(*inputs)
        q, k, v, g, beta = inputs[:5]
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and g.is_contiguous()
                and beta.is_contiguous()):
            # strided views (HF's v is a view of a transposed convolution output) packed once, here:
            # the forward reads these copies and the backward the same ones, saved (else the split's
            # kernels each pack their own: six strided copies a layer per step in HF's Qwen3-Next)
            inputs = (packed(q), packed(k), packed(v), packed(g), packed(beta), *inputs[5:])
        # what a split forward keeps for its backward rides on this context (carry.py)
        token, held = carry.open_keeping()
        try:
            output = _forward_impl(*inputs)
        finally:
            carry.close_keeping(token)
        _setup_context(ctx, inputs, output)
        ctx.eager, ctx.carried = True, held[0] if held else None
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # as the custom op: no double backward (an error, not a dropped term)
    def backward(ctx, *grads):
        return _backward(ctx, *grads)


def _eager_call(q, k, v, g, beta, initial_state, cu_seqlens) -> bool:
    """Plain tensors outside a trace, a functorch transform or a dispatch mode (make_fx, a flop
    counter, selective checkpointing: each must see the op as one node): the op may skip the
    custom op's dispatch (`_Eager`)."""
    T = (torch.Tensor, torch.nn.Parameter)  # a Parameter (a learnt initial state) dispatches as a tensor
    return (type(q) in T and type(k) in T and type(v) in T and type(g) in T and type(beta) in T
            and (initial_state is None or type(initial_state) in T) and (cu_seqlens is None or type(cu_seqlens) in T)
            and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()
            and not torch._C._len_torch_dispatch_stack())


def _plain(q, k, v, g, beta, initial_state, cu_seqlens) -> bool:
    """Tensors where the op's schema wants them, and a 4-D `q` (`check_scale` reads its last dim)."""
    T = torch.Tensor
    return (isinstance(q, T) and isinstance(k, T) and isinstance(v, T) and isinstance(g, T) and isinstance(beta, T)
            and (initial_state is None or isinstance(initial_state, T))
            and (cu_seqlens is None or isinstance(cu_seqlens, T)) and q.dim() == 4)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, state_v_first=False, save_states=None, cp_group=None):
    """The gated delta rule's chunked forward with a dispatched backward: `(o, final_state)`.

    q, k `[B, T, Hg, K]`; v `[B, T, H, V]` with `H % Hg == 0`; g `[B, T, H]` the per-token
    natural-log decay (not cumulated); beta `[B, T, H]` in (0, 1); initial_state `[N, H, K, V]`
    (`[N, H, V, K]` with `state_v_first`); cu_seqlens `[N + 1]` for varlen (`B == 1`). Any
    strided views; g, beta and initial_state in any float dtype (computed in fp32).
    `final_state` (fp32; fp64 for fp64 inputs) is None unless `output_final_state`. Differentiable in q, k, v, g, beta
    and initial_state, each gradient in its input's dtype. `save_states` (default:
    `GDR_SAVE_STATES`, else False) keeps the chunk states for the backward instead of
    recomputing them; the module docstring says what each costs. A bad argument raises
    TypeError or ValueError naming it (compiled: torch.compile's TorchRuntimeError around it).

    `cp_group` (a `torch.distributed` process group; eager): context parallelism across its ranks.
    Each rank's q/k/v/g/beta hold a contiguous slice of the packed tokens, in rank order (slices
    may differ in length); `cu_seqlens`, when given, is the global one, identical on every rank,
    and sequences may cross rank edges (without it, B = 1 and the slices form one sequence);
    `initial_state` is the global `[N, H, K, V]`, identical on every rank, and each rank's
    gradient for it is its share (their sum is the full gradient, as an all-reduce of a
    replicated input gives); with `output_final_state` every rank returns the same global final
    state, and the gradients flowing into it are summed over the ranks. One all-gather of the
    maps per direction, after one of the slices' lengths; exact (docs/design.md). Eager only: the
    collectives run in a torch.autograd.Function, which torch.compile does not trace.
    """
    if save_states is None:
        save_states = env.save_states()
    for name, flag in (("output_final_state", output_final_state), ("state_v_first", state_v_first),
                       ("save_states", save_states)):
        if not isinstance(flag, bool):  # (bool("False") is True: coercing would hide the mistake)
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    # the states are kept only for a backward that can run
    save_states = save_states and torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    if cp_group is not None:
        from .registry import context_parallel

        o, ht = context_parallel().op(q, k, v, g, beta, check_scale(scale, q.shape[-1]), initial_state,
                                      output_final_state, cu_seqlens, state_v_first, save_states, cp_group, CHUNK)
        return o, (ht if output_final_state else None)
    if not torch.compiler.is_compiling() and not _plain(q, k, v, g, beta, initial_state, cu_seqlens):
        # a call the op's schema would refuse fails here, naming the argument, before any work; the
        # forward checks the rest as this does (compiled: in the fake)
        check_forward_structure(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, CHUNK)
    scale = check_scale(scale, q.shape[-1])
    args = (q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, state_v_first, save_states)
    if _eager_call(q, k, v, g, beta, initial_state, cu_seqlens):
        # without grad mode no graph is recorded: the forward alone, nothing saved
        o, ht, _, _, _ = _Eager.apply(*args) if torch.is_grad_enabled() else _forward_impl(*args)
    else:
        o, ht, _, _, _ = torch.ops.gdr_dispatch.chunk_gdr_fwd(*args)
    return o, (ht if output_final_state else None)
