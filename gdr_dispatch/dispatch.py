"""`fused_gdr_bwd` and the choice of backend.

Selection, in order (environment read on every call):
  1. `GDR_BACKEND=<name>` forces that backend; an error if it cannot take the call.
  2. A tuning-table entry whose winner can take the call: the exact key (user table, then
     shipped), else the same problem measured under other library versions (logged).
  3. A miss while autotuning is allowed: every supported backend runs on the call's own
     inputs (on grids with fewer sequence x head programs than SMs also as `<backend>@split<n>`,
     context_parallel.py), their gradients are cross-checked, the fastest that agrees wins and
     is stored.
  4. Otherwise (GDR_AUTOTUNE=0, CPU tensors, CUDA graph capture in progress, or a single
     supported backend) the first supported backend in the static order (each backend's
     `static_rank`).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import tuning_table
from .contract import GDRCall, GDRGrads, validate
from .registry import Backend, Problem, env_flag, first_time, forget_said, get_backend, registered_backends

log = logging.getLogger("gdr_dispatch")

#: Autotuning runs each candidate once untimed (first-call compiles and fla's own autotuner
#: happen there; the cross-check reads that run's output), then `AUTOTUNE_WARMUP` more
#: untimed runs and the median of `AUTOTUNE_REPS` timed ones.
AUTOTUNE_WARMUP = 2
AUTOTUNE_REPS = 10

#: Largest relative Frobenius difference allowed between two candidates' gradients, per
#: input dtype. bf16: fla and FlashQLA each land at 3-4e-3 from the fp64 oracle
#: (docs/measurements.md), so two correct backends can differ by ~8e-3; a broken kernel is
#: off by O(1).
AGREEMENT_TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4, "float64": 1e-8}

#: Segments per sequence the autotuner may try on grids with fewer sequence x head programs than
#: SMs (each with every supported backend that allows it), unless GDR_CP decides: powers of two
#: up to the first that fills the SMs (`split_segment_counts`). Up to 8 only, B1 T32768 H4 (4
#: programs) could use 32 of the H200's 132 SMs.
SPLIT_SEGMENTS = (2, 4, 8, 16, 32, 64)

#: How a backend was chosen (`Choice.source`).
FORCED, TABLE, AUTOTUNED, STATIC = "GDR_BACKEND", "table", "autotuned", "static order"

#: Why a call is not autotuned when `select_backend` has no tensors to measure on.
NO_TENSORS = "no tensors to measure on"


class NoBackendError(RuntimeError):
    """No registered backend can take the call (the message lists each one's reasons)."""


@dataclass
class Choice:
    backend: Backend
    source: str  # FORCED, TABLE, AUTOTUNED or STATIC
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
            return f"{self.source} {self.detail}, {self.table_hit.versions_note}; run `gdr-dispatch tune` to refresh"
        return f"{self.source} ({self.detail})" if self.detail else self.source


_decided: dict = {}  # table key (or (key, why not autotuned)) -> Choice, this process
_outputs_checked: set = set()  # (backend, Problem) pairs whose output shapes and dtypes were checked


def clear_caches() -> None:
    """Forget this process's decisions and cached tables (after editing a table by hand, in tests)."""
    _decided.clear()
    forget_said()
    _outputs_checked.clear()
    tuning_table.forget()


def autotune_block_reason(problem: Problem, have_tensors: bool) -> Optional[str]:
    """Why this call may not be autotuned, or None when it may."""
    if not env_flag("GDR_AUTOTUNE", True):
        return "GDR_AUTOTUNE=0"
    if problem.device.type != "cuda":
        return f"{problem.device.type} tensors are never autotuned"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "CUDA graph capture in progress (nothing may compile or benchmark)"
    if not have_tensors:
        return NO_TENSORS
    return None


def forced_backend() -> Optional[Backend]:
    """The backend `GDR_BACKEND` names (read per call), None when unset; an unknown name raises,
    listing the known ones."""
    forced = os.environ.get("GDR_BACKEND", "").strip()
    return get_backend(forced) if forced else None


def select_backend(problem: Problem, call: Optional[GDRCall] = None) -> Choice:
    """Pick the backend for `problem`; with `call`, a table miss may autotune on its tensors."""
    known = registered_backends()
    backend = forced_backend()
    if backend is not None:
        ok, reason = backend.supported(problem)
        if not ok:
            raise NoBackendError(f"GDR_BACKEND={backend.name}, but backend {backend.name!r} cannot take this call "
                                 f"({problem.describe()}): {reason}")
        return Choice(backend, FORCED)

    # a decision already made for this key: re-check only that its backend still takes the
    # call (its verdict can depend on the environment), not every backend
    key = problem.table_key()
    blocked = autotune_block_reason(problem, call is not None)
    memo = _decided.get(key) or _decided.get((key, blocked))
    if memo is not None and memo.backend.supported(problem)[0]:
        return memo

    verdicts = {name: b.supported(problem) for name, b in known.items()}
    supported = [n for n, (ok, _) in verdicts.items() if ok]
    if not supported:
        lines = "\n".join(f"  {n}: {r}" for n, (_, r) in verdicts.items())
        raise NoBackendError(f"no gdr_dispatch backend can take this call ({problem.describe()}):\n{lines}")
    options = {n: known[n] for n in supported}
    options.update(split_candidates(problem, options))

    for hit in tuning_table.lookup(problem.device.slug, problem.problem_key(), problem.versions_key()):
        winner = _table_winner(hit.entry, options)
        if winner is not None:
            _decided[key] = Choice(options[winner], TABLE, str(hit.path), verdicts, hit.entry, hit)
            return _decided[key]
        if hit.exact:
            name = hit.entry["winner"]
            log.warning("gdr_dispatch: table %s names %r for %s, which cannot take it now (%s); ignoring the entry",
                        hit.path, name, problem.describe(),
                        verdicts.get(name, (False, "not registered, or a split that GDR_CP=0 turns off"))[1])

    if blocked is None and len(options) > 1:
        entry, grads = autotune(call, problem, options)
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
    _decided[(key, blocked)] = Choice(known[supported[0]], STATIC, why, verdicts)
    return _decided[(key, blocked)]


def split_candidates(problem: Problem, supported: dict) -> dict:
    """`(backend, segments)` candidates for a starved grid (fewer sequence x head programs than
    SMs): nothing when GDR_CP decides, on a CPU, or when the grid is full."""
    from .context_parallel import SplitBackend

    if context_parallel_segments() is not None or problem.device.type != "cuda":
        return {}
    if problem.seq_head_ctas >= problem.device.sm_count:
        return {}
    out = {}
    for segments in split_segment_counts(problem):
        for backend in supported.values():
            if backend.split_candidate:
                split = SplitBackend(backend, segments)
                if split.supported(problem)[0]:
                    out[split.name] = split
    return out


def split_segment_counts(problem: Problem) -> tuple[int, ...]:
    """The `SPLIT_SEGMENTS` worth timing for a starved grid: each no more than the longest
    sequence's chunks, up to the first count whose segments fill every SM (more only add
    pass-1 work and segments of fewer chunks)."""
    longest = problem.max_seqlen if problem.max_seqlen is not None else problem.B * problem.T
    chunks = -(-longest // problem.chunk_size)
    out = []
    for segments in SPLIT_SEGMENTS:
        if segments > chunks:
            break
        out.append(segments)
        if problem.seq_head_ctas * segments >= problem.device.sm_count:
            break
    return tuple(out)


def _table_winner(entry: dict, options: dict) -> Optional[str]:
    """The entry's winner when it can run now; with GDR_CP=0 and a split winner, the fastest
    measured unsplit candidate of the same entry."""
    from .context_parallel import parse_split

    winner = entry["winner"]
    if winner in options:
        return winner
    if parse_split(winner)[1] > 1 and context_parallel_segments() == 0:
        measured = {n: c["ms"] for n, c in entry.get("candidates", {}).items()
                    if n in options and isinstance(c.get("ms"), (int, float)) and "failed" not in c}
        if measured:
            return min(measured, key=measured.get)
    return None


def _log_choice(problem: Problem, choice: Choice) -> None:
    if choice.logged:
        return
    choice.logged = True
    name = choice.backend.name
    # the Problem itself is the key (hashing it is ~4x cheaper than building table_key(),
    # and a forced backend makes a new Choice on every call)
    if not first_time(("backend", problem, name, choice.source)):
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
        elif "ms" in c:
            others.append(f"{other}: slower ({c['ms']:.3f} ms vs {cands.get(name, {}).get('ms', float('nan')):.3f} ms)")
        elif choice.source == TABLE:
            others.append(f"{other}: not measured in the table entry")
        else:
            others.append(f"{other}: lower in the static order")
    log.info("gdr_dispatch: backend %r for %s (%s)%s", name, problem.describe(), choice.how,
             "; not chosen: " + "; ".join(others) if others else "")


# ---------------------------------------------------------------------------------------
# autotuning
# ---------------------------------------------------------------------------------------
def measure_ms(fn: Callable[[], object], device_type: str, warmup: int = AUTOTUNE_WARMUP,
               reps: int = AUTOTUNE_REPS) -> float:
    """Median wall time of `fn` in ms: CUDA events on the GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device_type == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_enqueue_ms(fn: Callable[[], object], reps: int = 5) -> float:
    """Median host time of one call's enqueue in ms, the GPU drained before each (no sync
    inside). Near `measure_ms`'s reading the call is host-bound: the split's eager time at B1
    T32768 H4 was its host's 0.6-1.2 ms, varying between machines, over 0.64 ms of kernels
    (docs/measurements.md, "Session 13")."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def more_rounds(runners: dict, runs: dict, rounds: int, measure: Callable) -> None:
    """Time each runner that has a first reading (`runs[name]["ms"]`) `rounds - 1` more times,
    in alternating order (reversed first), and keep the least median; `ms_rounds` keeps all.
    Why: a runner's place in the sequence moved its time by up to 0.6 ms on the H200 (session 4's
    bench: flash_qla, first in every row, read above FlashQLA called directly; README, Results).
    Used by bench/bench_gdr_bwd.py and tools/ws_probe.py."""
    timed = [n for n in runners if "ms" in runs.get(n, {})]
    for r in range(1, rounds):
        for name in (timed[::-1] if r % 2 else timed):
            run = runs[name]
            run.setdefault("ms_rounds", [run["ms"]]).append(round(measure(runners[name]), 4))
            run["ms"] = min(run["ms_rounds"])


def relative_error(x: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> float:
    """||x - ref||_F / ||ref||_F in fp64 (inf for a missing or non-finite x, 0 for two Nones)."""
    if x is None or ref is None:
        return 0.0 if x is None and ref is None else float("inf")
    x, ref = x.detach().double(), ref.detach().double()
    if x.shape != ref.shape or not torch.isfinite(x).all():
        return float("inf")
    denom = ref.norm().item()
    diff = (x - ref).norm().item()
    return diff / denom if denom > 0 else diff


def grads_disagreement(grads: GDRGrads, ref: GDRGrads, tol: float) -> Optional[str]:
    """None when every gradient is within `tol` of `ref`, else the numbers that are not."""
    bad = []
    for name in GDRGrads._fields:
        err = relative_error(getattr(grads, name), getattr(ref, name))
        if not err <= tol:
            bad.append(f"{name} rel err {err:.2e}")
    return f"{', '.join(bad)} > {tol:g}" if bad else None


def autotune(call: GDRCall, problem: Problem, candidates: dict[str, Backend],
             measure: Optional[Callable[..., float]] = None,
             progress: Optional[Callable[[str], None]] = None) -> tuple[dict, GDRGrads]:
    """Time and cross-check `candidates` on the call's tensors; return (table entry, winner's grads).

    `measure(fn, device_type) -> ms` defaults to `measure_ms`; `progress(line)` receives a line
    per candidate as it is measured (default: the INFO log).
    """
    measure = measure or measure_ms
    log.info("gdr_dispatch: autotuning %d backends for %s", len(candidates), problem.describe())
    results: dict[str, dict] = {}
    outputs: dict[str, GDRGrads] = {}
    for i, (name, backend) in enumerate(candidates.items(), 1):
        t0 = time.perf_counter()
        first = None
        try:
            outputs[name] = backend.run(call)
            if call.q.is_cuda:
                torch.cuda.synchronize(call.q.device)
            first = time.perf_counter() - t0
            check_outputs(call, outputs[name], name)
            results[name] = {"ms": round(measure(lambda: backend.run(call), problem.device.type), 4)}
        except Exception as e:  # a candidate that breaks is recorded, never chosen
            outputs.pop(name, None)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()  # e.g. the torch backend at a training shape: the others still run
            results[name] = {"failed": f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        # progress: a starved grid has dozens of candidates (every split count), minutes in all
        # with the wall time of the first call (compiles, a peer's own autotuning) and of the whole
        # measurement: session 7's starved sweep spent ~30 s per candidate and could not say where
        line = (f"autotune [{i}/{len(candidates)}] {name}: "
                + (f"{results[name]['ms']} ms" if "ms" in results[name] else results[name]["failed"])
                + (f"  [first call {first:.1f} s, " if first is not None else "  [")
                + f"{time.perf_counter() - t0:.1f} s in all]")
        if progress is None:
            log.info("gdr_dispatch: %s", line)
        else:
            progress(line)

    # the cross-check reference: the most trusted candidate that ran (backends declare
    # `reference_rank`), else the first that ran
    trusted = sorted((b.reference_rank, n) for n, b in candidates.items()
                     if b.reference_rank is not None and n in outputs)
    ref_name = trusted[0][1] if trusted else next(iter(outputs), None)
    tol = AGREEMENT_TOL[problem.dtype]
    if ref_name is not None:
        for name in outputs:
            if name == ref_name:
                continue
            why = grads_disagreement(outputs[name], outputs[ref_name], tol)
            if why is not None:
                results[name] = {"failed": f"disagrees with {ref_name}: {why}", "ms": results[name].get("ms")}
    timed = {n: r["ms"] for n, r in results.items() if "failed" not in r}
    if not timed:
        detail = "; ".join(f"{n}: {r.get('failed')}" for n, r in results.items())
        raise NoBackendError(f"every candidate failed while autotuning {problem.describe()}: {detail}")
    winner = min(timed, key=timed.get)
    entry = {
        "problem": problem.describe(),
        "winner": winner,
        "candidates": results,
        "cross_check": {"reference": ref_name, "tol": tol},
        "measured_at": tuning_table.now_iso(),
    }
    return entry, outputs[winner]


# ---------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------
def check_outputs(call: GDRCall, grads: GDRGrads, backend: str) -> None:
    """Shapes and dtypes of a backend's gradients against the contract (a backend bug otherwise)."""
    acc = call.acc_dtype
    want = {
        "dq": (tuple(call.q.shape), call.q.dtype),
        "dk": (tuple(call.k.shape), call.k.dtype),
        "dv": (tuple(call.v.shape), call.v.dtype),
        "dg": (tuple(call.g.shape), acc),
        "db": (tuple(call.b.shape), call.b.dtype),
        "dh0": (call.state_shape(), acc) if call.initial_state is not None else None,
    }
    for name, spec in want.items():
        got = getattr(grads, name)
        if spec is None:
            if got is not None:
                raise RuntimeError(f"backend {backend!r} returned {name} although initial_state is None")
            continue
        if got is None or tuple(got.shape) != spec[0] or got.dtype != spec[1]:
            shape = None if got is None else (tuple(got.shape), got.dtype)
            raise RuntimeError(f"backend {backend!r} returned {name} as {shape}, the contract says {spec}")


def fused_gdr_bwd(q, k, v, a, g, b, do, dht=None, h=None, *, scale=None, initial_state=None,
                  cu_seqlens=None, chunk_size=64, state_v_first=False, max_seqlen=None) -> GDRGrads:
    """Backward of the chunked gated delta rule: `(dq, dk, dv, dg, db, dh0)`.

    Inputs and outputs are exactly those of docs/contract.md: `a` the ungated WY inverse
    `[B, T, H, BT]`, `g` the natural-log chunk-local cumsum of the gate, `h` the chunk-start
    states or None (then recomputed from `initial_state`); `dg` is w.r.t. the raw gate and
    `dq`/`dk` are at the q/k head count. `max_seqlen` (varlen: the longest sequence, as in
    flash-attn) only sharpens the tuning-table key. No input is written. Raises
    TypeError/ValueError naming the argument for a bad call, and NoBackendError when no
    backend can take it.
    """
    call = validate(q, k, v, a, g, b, do, dht, h, scale=scale, initial_state=initial_state,
                    cu_seqlens=cu_seqlens, chunk_size=chunk_size, state_v_first=state_v_first,
                    max_seqlen=max_seqlen)
    segments = context_parallel_segments()
    if segments is not None and segments > 1:
        from .context_parallel import split_backward

        problem = Problem.from_call(call)
        if first_time(("split", problem, segments)):
            log.info("gdr_dispatch: split=%d (GDR_CP) for %s: each sequence in %d segments of whole chunks, "
                     "run as one varlen call", segments, problem.describe(), segments)
        # a forced backend that recomputes the states in its own kernel does so for pass 3 too,
        # as its `<backend>@split<n>` candidate does (SplitBackend)
        forced = forced_backend()
        return split_backward(call, segments, run=_run,
                              states_by_run=forced is not None and forced.own_state_recompute())
    return _run(call)


def context_parallel_segments() -> Optional[int]:
    """`GDR_CP`: None when unset, 0 (off) or the number of segments per sequence."""
    raw = os.environ.get("GDR_CP")
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"GDR_CP: expected a number of segments per sequence (0 turns the split off), "
                         f"got {raw!r}") from None
    if value < 0:
        raise ValueError(f"GDR_CP: expected 0 or more segments per sequence, got {value}")
    return value


def _run(call: GDRCall) -> GDRGrads:
    """One validated call on the backend the dispatcher picks for it."""
    problem = Problem.from_call(call)
    choice = select_backend(problem, call)
    _log_choice(problem, choice)
    if choice.grads is not None:
        return choice.grads
    grads = choice.backend.run(call)
    # a backend's output shapes and dtypes follow from the Problem: checked on its first call
    # for each Problem (~10 us of host time per call otherwise, at shapes that are launch-bound)
    checked = (choice.backend.name, problem)
    if checked not in _outputs_checked:
        check_outputs(call, grads, choice.backend.name)
        _outputs_checked.add(checked)
    return grads
