"""`fused_gdr_bwd` and the choice of backend (docs/design.md, "One call").

Selection, in order (environment read on every call, env.py):
  1. `GDR_BACKEND=<name>` (or `<name>@split<n>`) forces that backend; an error if it cannot
     take the call.
  2. A tuning-table entry whose winner can take the call: the exact key (user table, then
     shipped), else the same problem measured under other library versions, else the same
     shape measured with other optional inputs (initial_state, dht; both logged).
  3. A miss while autotuning is allowed: the candidates that can win (autotune.prune) run on the
     call's own inputs, their kernels compiled first in parallel; their gradients are
     cross-checked, the fastest that agrees wins and is stored.
  4. Otherwise (GDR_AUTOTUNE=0, CPU tensors, CUDA graph capture in progress, or a single
     supported backend) the first supported backend in the static order (`static_rank`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import caches, env, plans, tuning_table
from .autotune import check_outputs, first_call, predict
from .contract import (AUTOCAST_DEVICES, GDRCall, GDRGrads, check_backward_structure, check_backward_values,
                       check_scale, make_call, offsets_to_device)
from .problem import Problem
from .registry import Backend, NoBackendError, get_backend, parse_wrapped, registered_backends, wrappers

__all__ = ["fused_gdr_bwd", "select_backend", "Choice", "NoBackendError", "clear_caches"]

log = logging.getLogger("gdr_dispatch")

#: How a backend was chosen (`Choice.source`).
FORCED, TABLE, AUTOTUNED, PREDICTED, STATIC = "GDR_BACKEND", "table", "autotuned", "neighbours", "static order"

#: Why a call is not autotuned when `select_backend` has no tensors to measure on.
NO_TENSORS = "no tensors to measure on"
#: Why a call is not autotuned during a CUDA graph capture (its static choice holds for it only).
CAPTURING = "CUDA graph capture in progress (nothing may compile or benchmark)"


@dataclass
class Choice:
    backend: Backend
    source: str  # FORCED, TABLE, AUTOTUNED, PREDICTED or STATIC
    detail: str = ""  # the table's path, where the autotuned result went, or why the static order
    verdicts: dict[str, tuple[bool, str]] = field(default_factory=dict)
    entry: Optional[dict] = None  # the table entry behind the choice, when there is one
    table_hit: Optional[tuning_table.TableHit] = None
    grads: Optional[GDRGrads] = None  # the winner's output when autotuning already ran it
    logged: bool = False  # remembered choices are logged once, then cost nothing per call

    @property
    def how(self) -> str:
        """One line for logs and `explain`."""
        if self.source == TABLE and self.table_hit is not None and not self.table_hit.exact:
            refresh = "" if self.table_hit.optional_note else "; run `gdr-dispatch tune` to refresh"
            return f"{self.source} {self.detail}, {self.table_hit.versions_note}{refresh}"
        return f"{self.source} ({self.detail})" if self.detail else self.source


_decided = caches.memo("decisions")  # table key (or (key, why not autotuned)) -> Choice
# (table key, backend) -> the builds the op's first forward started for it, until its backward waits
_early_builds = caches.memo("early builds", limit=256)
_outputs_checked = caches.memo("outputs checked")  # (backend, table key) whose outputs were checked


def clear_caches() -> None:
    """Forget every memo of this process: decisions, cached tables, log-once lines (after
    editing a table by hand, in tests)."""
    caches.clear()


def autotune_block_reason(problem: Problem, have_tensors: bool) -> Optional[str]:
    """Why this call may not be autotuned, or None when it may."""
    if not env.autotune_on():
        return f"{env.AUTOTUNE}=0"
    if problem.device.type != "cuda":
        return f"{problem.device.type} tensors are never autotuned"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return CAPTURING
    if not have_tensors:
        return NO_TENSORS
    return None


def forced_backend() -> Optional[Backend]:
    """The backend `GDR_BACKEND` names (read per call), None when unset; an unknown name is an
    error naming the variable and listing the known ones."""
    name = env.forced_backend_name()
    return get_backend(name, what=f"{env.BACKEND}={name}") if name else None


def wrapped_candidates(problem: Problem, supported: dict, thorough: bool = False) -> dict:
    """The wrappers' candidates for `problem` (the split's `<backend>@split<n>` on starved
    grids; none while `GDR_CP` decides); `thorough`: every count a sweep may time, else the
    few a first call times."""
    out = {}
    for w in wrappers():
        out.update(w.candidates(problem, supported, thorough))
    return out


def select_backend(problem: Problem, call: Optional[GDRCall] = None) -> Choice:
    """Pick the backend for `problem`; with `call`, a table miss may autotune on its tensors."""
    backend = forced_backend()
    if backend is not None:
        ok, reason = backend.supported(problem)
        if not ok:
            raise NoBackendError(f"{env.BACKEND}={backend.name}, but backend {backend.name!r} cannot take this call "
                                 f"({problem.describe()}): {reason}")
        return Choice(backend, FORCED)

    # a decision already made for this key: re-check only that its backend still takes the
    # call (its verdict can depend on the environment), not every backend
    key = problem.table_key()
    blocked = autotune_block_reason(problem, call is not None)
    memo = _decided.get(key) or _decided.get((key, blocked))
    if memo is not None and memo.backend.supported(problem)[0]:
        return memo

    verdicts, options = _options(problem)
    supported = [n for n, (ok, _) in verdicts.items() if ok]
    if not supported:
        lines = "\n".join(f"  {n}: {r}" for n, (_, r) in verdicts.items())
        raise NoBackendError(f"no gdr_dispatch backend can take this call ({problem.describe()}):\n{lines}")

    for hit in tuning_table.lookup(problem.device.slug, problem.problem_key(), problem.versions_key()):
        winner = _table_winner(hit.entry, options)
        if winner is not None:
            _decided[key] = Choice(options[winner], TABLE, str(hit.path), verdicts, hit.entry, hit)
            _wait_early_builds(key, winner)
            return _decided[key]
        if hit.exact:
            name = hit.entry["winner"]
            log.warning("gdr_dispatch: table %s names %r for %s, which cannot take it now (%s); ignoring the entry",
                        hit.path, name, problem.describe(),
                        verdicts.get(name, (False, "not registered, or a split that GDR_CP=0 turns off"))[1])

    if blocked in (None, NO_TENSORS) and len(options) > 1:
        predicted = predict(problem, options)
        if predicted is not None:  # the neighbouring entries agree: nothing to measure (`explain` says so too)
            at = key if blocked is None else (key, blocked)
            _decided[at] = Choice(options[predicted[0]], PREDICTED, predicted[1], verdicts)
            _wait_early_builds(key, predicted[0])
            return _decided[at]
    if blocked is None and len(options) > 1:
        entry, grads = first_call(call, problem, options)
        for name, (ok, reason) in verdicts.items():
            if not ok:
                entry["candidates"][name] = {"unsupported": reason}
        try:
            path = tuning_table.record(problem.device.slug, problem.device.name, {key: entry})
            detail = f"stored in {path}"
        except OSError as e:
            log.warning("gdr_dispatch: could not write the tuning table (%s); keeping the choice in memory", e)
            detail = "not stored"
        _decided[key] = Choice(options[entry["winner"]], AUTOTUNED, detail, verdicts, entry)
        return Choice(options[entry["winner"]], AUTOTUNED, detail, verdicts, entry, grads=grads)

    # static choices are remembered per reason: a call outside graph capture, or with
    # GDR_AUTOTUNE changed, decides afresh
    why = blocked if blocked is not None else "the only supported backend"
    _decided[(key, blocked)] = Choice(options[supported[0]], STATIC, why, verdicts)
    return _decided[(key, blocked)]


def _wait_early_builds(key: str, name: str) -> None:
    """The builds of `name` the op's first forward started for this table key
    (`start_backward_compiles`): waited for here, not built a second time in this process."""
    started = _early_builds.get((key, name))
    if started:
        from .autotune import wait_early

        for job in started:
            wait_early(job)
        _early_builds[(key, name)] = ()


def start_backward_compiles(call: GDRCall) -> int:
    """Start, in background processes, the builds a backward call like `call` will need
    (autotune.start_compiles): at a table hit its winner's, unless a process before built them
    (`autotune.built_marker`: a tuned model's later launches start no processes); at a miss the
    candidates its first call would measure, pruned as it prunes them. What the op's first
    forward at a shape calls, so the backward's compiles overlap the forward's (docs/design.md,
    "The first step"); the backward's first call waits for them. Nothing when the choice is
    forced (`GDR_BACKEND`, `GDR_CP`) or already made, nor at a miss that may not be measured.
    The number of jobs started."""
    from .autotune import build_bytes, compile_jobs_of, prune, start_compiles

    problem = Problem.from_call(call)
    if env.forced_backend_name() or env.cp_segments() is not None:
        return 0
    key = problem.table_key()
    if _decided.get(key) is not None:
        return 0
    # some builds run the call at full size (warm runs, the split's passes): room for that
    per_job = build_bytes(call.q, call.k, call.v, call.do, call.a, call.h)
    _, options = _options(problem)
    for hit in tuning_table.lookup(problem.device.slug, problem.problem_key(), problem.versions_key()):
        winner = _table_winner(hit.entry, options)
        if winner is not None:
            # once per table key and winner (a varlen run meets new lengths every step, and the
            # winner's builds key on neither the lengths nor the token count); never inside a
            # capture; the backward waits for exactly these
            if (key, winner) in _early_builds or (torch.cuda.is_available() and
                                                  torch.cuda.is_current_stream_capturing()):
                return 0
            jobs = tuple(compile_jobs_of(call, {winner: options[winner]}))
            _early_builds[(key, winner)] = jobs
            return start_compiles(jobs, unbuilt_only=True, device=call.q.device, per_job=per_job)
    if autotune_block_reason(problem, True) or len(options) < 2:
        return 0
    predicted = predict(problem, options)
    if predicted is not None:  # one candidate: its backward waits for exactly these (`select_backend`)
        jobs = tuple(compile_jobs_of(call, {predicted[0]: options[predicted[0]]}))
        _early_builds[(key, predicted[0])] = jobs
        return start_compiles(jobs, device=call.q.device, per_job=per_job)
    return start_compiles(compile_jobs_of(call, prune(problem, options)[0]), device=call.q.device, per_job=per_job)


def _options(problem: Problem) -> tuple[dict, dict]:
    """`(verdicts, options)`: every registered backend's verdict on `problem`, and the candidates
    a decision weighs (the supported backends and, on a starved grid, their splits)."""
    known = registered_backends()
    verdicts = {name: b.supported(problem) for name, b in known.items()}
    options = {n: known[n] for n, (ok, _) in verdicts.items() if ok}
    options.update(wrapped_candidates(problem, options, thorough=env.autotune_all()))
    return verdicts, options


def _table_winner(entry: dict, options: dict) -> Optional[str]:
    """The entry's winner when it can run now; with GDR_CP=0 and a split winner, the fastest
    measured unwrapped candidate of the same entry."""
    winner = entry["winner"]
    if winner in options:
        return winner
    if parse_wrapped(winner)[1] > 1 and env.cp_segments() == 0:
        return tuning_table.fastest_measured(entry, options)
    return None


def _log_choice(problem: Problem, choice: Choice) -> None:
    if choice.logged:
        return
    choice.logged = True
    name = choice.backend.name
    if not caches.first_time(("backend", problem.table_key(), name, choice.source)):
        return
    others = []
    cands = (choice.entry or {}).get("candidates", {})
    for other, (ok, reason) in choice.verdicts.items():
        if other == name:
            continue
        c = cands.get(other, {})
        if not ok:
            others.append(f"{other}: unsupported ({reason})")
        elif "failed" in c:
            others.append(f"{other}: failed ({c['failed']})")
        elif "skipped" in c:
            others.append(f"{other}: not measured ({c['skipped']})")
        elif "ms" in c:
            others.append(f"{other}: slower ({c['ms']:.3f} ms vs {cands.get(name, {}).get('ms', float('nan')):.3f} ms)")
        elif choice.source == TABLE:
            others.append(f"{other}: not measured in the table entry")
        elif choice.source == PREDICTED:
            others.append(f"{other}: not measured (the neighbouring entries' winner was taken)")
        else:
            others.append(f"{other}: lower in the static order")
    log.info("gdr_dispatch: backend %r for %s (%s)%s", name, problem.describe(), choice.how,
             "; not chosen: " + "; ".join(others) if others else "")


def fused_gdr_bwd(q, k, v, a, g, b, do, dht=None, h=None, *, scale=None, initial_state=None,
                  cu_seqlens=None, chunk_size=64, state_v_first=False, max_seqlen=None, cp_group=None) -> GDRGrads:
    """Backward of the chunked gated delta rule: `(dq, dk, dv, dg, db, dh0)`.

    Inputs and outputs are exactly those of docs/contract.md: `a` the ungated WY inverse
    `[B, T, H, BT]`, `g` the natural-log chunk-local cumsum of the gate, `h` the chunk-start
    states or None (then recomputed from `initial_state`); `dg` is w.r.t. the raw gate and
    `dq`/`dk` are at the q/k head count. Any strided views are taken. `max_seqlen` (varlen: the
    longest sequence, as in flash-attn) only sharpens the tuning-table key. No input is written.
    Raises TypeError/ValueError naming the argument for a bad call, and NoBackendError when no
    backend can take it.

    `cp_group` (a `torch.distributed` process group): this rank holds a contiguous slice of the
    packed tokens, in rank order; `cu_seqlens` is then the global one (identical on every rank;
    without it the slices form one sequence), the rank edges inside a sequence fall on whole
    chunks, `initial_state` is the global one and `dht` this rank's share of its gradient (the
    ranks' shares sum to it); `h`, when given, this rank's chunks of it. The returned `dh0` is
    this rank's share (their sum is the full gradient). Exact: docs/design.md, "Context
    parallelism across ranks".

    `cu_seqlens` may be on the CPU: its device copy is built once per content and kept, its values
    never read back from the device, so only a content's first call waits (on q's device they are
    read on every eager call, which waits for the work queued before it).
    """
    if cu_seqlens is not None:
        cu_seqlens = offsets_to_device(cu_seqlens, q)
    if cp_group is not None:
        if isinstance(q, torch.Tensor) and _autocasting(q.device.type):
            with torch.autocast(q.device.type, enabled=False):
                return fused_gdr_bwd(q, k, v, a, g, b, do, dht, h, scale=scale, initial_state=initial_state,
                                     cu_seqlens=cu_seqlens, chunk_size=chunk_size, state_v_first=state_v_first,
                                     max_seqlen=max_seqlen, cp_group=cp_group)
        from .registry import context_parallel

        return context_parallel().backward(q, k, v, a, g, b, do, dht, h, scale=scale, initial_state=initial_state,
                                           cu_seqlens=cu_seqlens, chunk_size=chunk_size, state_v_first=state_v_first,
                                           group=cp_group, run=run_call)
    key = plans.backward_key(q, k, v, a, g, b, do, dht, h, initial_state, cu_seqlens, scale, chunk_size,
                             state_v_first, max_seqlen)
    plan = plans.backward.get(key) if key is not None else None
    if plan is None:
        dims = check_backward_structure(q, k, v, a, g, b, do, dht, h, initial_state=initial_state,
                                        cu_seqlens=cu_seqlens, chunk_size=chunk_size, state_v_first=state_v_first)
        fixed = None if cu_seqlens is not None else check_backward_values(
            dims[0], dims[1], dims[4], dims[3], dims[5], h, None, chunk_size, state_v_first, max_seqlen)
        plan = _Plan(dims, fixed, q.device.type if q.device.type in AUTOCAST_DEVICES else None)
    if plan.autocast is not None and torch.is_autocast_enabled(plan.autocast):  # the plan knows q's device type
        with torch.autocast(plan.autocast, enabled=False):
            return fused_gdr_bwd(q, k, v, a, g, b, do, dht, h, scale=scale, initial_state=initial_state,
                                 cu_seqlens=cu_seqlens, chunk_size=chunk_size, state_v_first=state_v_first,
                                 max_seqlen=max_seqlen)
    B, T, _, K, H, V = plan.dims
    seq_lens, num_chunks = plan.fixed or check_backward_values(B, T, H, K, V, h, cu_seqlens, chunk_size,
                                                               state_v_first, max_seqlen)
    if plan.scale is None:
        plan.scale = check_scale(scale, K)
    call = make_call(q, k, v, a, g, b, do, dht, h, plan.scale, initial_state, cu_seqlens, chunk_size, state_v_first,
                     seq_lens, num_chunks, max_seqlen)
    runner = plan.runners.get(num_chunks)
    if runner is not None:
        return runner(call)
    grads, runner = _decide_and_run(call)
    if runner is not None and key is not None:
        plan.runners[num_chunks] = runner
        plans.backward[key] = plan
    return grads


class _Plan:
    """A backward call's plan (plans.py): its checked sizes `(B, T, Hg, K, H, V)`, its values part
    when it reads no tensor values (no `cu_seqlens`), its scale, and the function that runs it per
    chunk count (the count is the one value of `cu_seqlens` a backend's verdict reads: its
    32-bit indexing limit)."""

    __slots__ = ("dims", "fixed", "scale", "runners", "autocast")

    def __init__(self, dims: tuple, fixed: Optional[tuple], autocast: Optional[str]):
        self.dims, self.fixed, self.scale, self.autocast = dims, fixed, None, autocast  # autocast: q's device type
        self.runners = caches.Memo("chunk counts", limit=256)


def _autocasting(device_type: str) -> bool:
    return device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)


def run_call(call: GDRCall) -> GDRGrads:
    """A validated call: through `GDR_CP`'s split when set, else on the dispatcher's pick."""
    return _decide_and_run(call, plan=False)[0]


def _decide_and_run(call: GDRCall, plan: bool = True) -> tuple[GDRGrads, Optional[Callable[[GDRCall], GDRGrads]]]:
    """`run_call`, and (with `plan`) the function a later call with the same plan key runs
    instead of deciding again: the chosen backend's `plan_run` (None when the choice holds for
    this call only: a static choice made during a CUDA graph capture)."""
    segments = env.cp_segments()
    if segments is not None and segments > 1:
        forced = forced_backend()
        for w in wrappers():
            runner = functools.partial(w.forced, n=segments, run=_run, inner=forced)
            return runner(call), runner
    grads, choice = _chosen(call)
    once = not plan or (choice.source == STATIC and choice.detail == CAPTURING)
    return grads, None if once else choice.backend.plan_run(call)


def _run(call: GDRCall) -> GDRGrads:
    """One validated call on the backend the dispatcher picks for it (the split's segments)."""
    return _chosen(call)[0]


def _chosen(call: GDRCall) -> tuple[GDRGrads, Choice]:
    """The dispatcher's pick for `call`, logged once, and its gradients (the autotuner's when
    choosing ran it)."""
    problem = Problem.from_call(call)
    choice = select_backend(problem, call)
    _log_choice(problem, choice)
    grads = choice.grads if choice.grads is not None else choice.backend.run(call)
    # a backend's output shapes and dtypes follow from the Problem: checked on its first call
    # for each key (~10 us of host time per call otherwise, at shapes that are launch-bound)
    checked = (choice.backend.name, problem.table_key())
    if checked not in _outputs_checked:
        check_outputs(call, grads, choice.backend.name)
        _outputs_checked[checked] = True
    return grads, choice
