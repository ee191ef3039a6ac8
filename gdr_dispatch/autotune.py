"""Measuring backends on a call's own tensors: timing, the cross-check between candidates, the
output check, and compiling the candidates' kernels in parallel processes first.

A table miss (dispatch.py) and `gdr-dispatch tune` (cli.py) both call `autotune`; the first
prunes the candidates to those that can win (`prune`, docs/design.md "Autotuning"), the second
measures everything it is asked to.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import statistics
import sys
import time
from typing import Callable, Collection, Optional

import torch

from . import caches
from .contract import GDRCall, GDRGrads
from .problem import Problem
from .registry import Backend, NoBackendError

log = logging.getLogger("gdr_dispatch")

#: Autotuning runs each candidate once untimed (first-call compiles and fla's own autotuner
#: happen there; the cross-check reads that run's output), then `AUTOTUNE_WARMUP` more
#: untimed runs and the median of `AUTOTUNE_REPS` timed ones.
AUTOTUNE_WARMUP = 2
AUTOTUNE_REPS = 10

#: Largest relative Frobenius difference allowed between two candidates' gradients, per
#: input dtype. bf16: fla and FlashQLA each land at 3-4e-3 from the fp64 oracle on the H200
#: (docs/kernels.md, "Accuracy"), so two correct backends can differ by ~8e-3; a broken kernel
#: is off by O(1).
AGREEMENT_TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4, "float64": 1e-8}

#: While a first call measures, a line at WARNING at most this often (seconds): Python's logging
#: shows WARNING without any set-up, so the user waiting sees that it goes on.
HEARTBEAT_S = 30.0


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


def autotune(call: GDRCall, problem: Problem, candidates: dict[str, Backend],
             measure: Optional[Callable[..., float]] = None,
             progress: Optional[Callable[[str], None]] = None, skipped: Optional[dict] = None,
             untimed: Collection[str] = ()) -> tuple[dict, GDRGrads]:
    """Time and cross-check `candidates` on the call's tensors; return (table entry, winner's grads).

    `measure(fn, device_type) -> ms` defaults to `measure_ms`; `progress(line)` receives a line
    per candidate as it is measured, with the time spent and an estimate of what is left (default:
    the INFO log); `skipped` (name -> why) is recorded in the entry beside the measured ones;
    `untimed` candidates run once, as the cross-check's reference only (never the winner).
    """
    from .graph_safe import copied_graph_inputs

    measure = measure or measure_ms
    say = progress or (lambda line: log.info("gdr_dispatch: %s", line))
    say(f"autotuning {len(candidates)} candidates for {problem.describe()}"
        + (f" ({len(skipped)} skipped: {', '.join(skipped)})" if skipped else ""))
    results: dict[str, dict] = {}
    outputs: dict[str, GDRGrads] = {}
    t_start = time.perf_counter()
    for i, (name, backend) in enumerate(candidates.items(), 1):
        t0 = time.perf_counter()
        first = None
        try:
            outputs[name] = backend.run(call)
            if call.q.is_cuda:
                torch.cuda.synchronize(call.q.device)
            first = time.perf_counter() - t0
            check_outputs(call, outputs[name], name)
            if name in untimed:
                results[name] = {"untimed": "the cross-check's reference"}
            else:
                with copied_graph_inputs():  # as a model whose layers share the shape calls it
                    results[name] = {"ms": round(measure(lambda: backend.run(call), problem.device.type), 4)}
        except Exception as e:  # a candidate that breaks is recorded, never chosen
            outputs.pop(name, None)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()  # e.g. the torch backend at a training shape: the others still run
            results[name] = {"failed": f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        spent = time.perf_counter() - t_start
        left = spent / i * (len(candidates) - i)
        say(f"autotune [{i}/{len(candidates)}] {name}: "
            + (f"{results[name]['ms']} ms" if "ms" in results[name] else
               results[name].get("failed") or results[name].get("untimed", ""))
            + (f"  [first call {first:.1f} s, " if first is not None else "  [")
            + f"{time.perf_counter() - t0:.1f} s in all; {spent:.0f} s spent, ~{left:.0f} s left]")

    # the cross-check reference: the most trusted candidate that ran (backends declare
    # `reference_rank`); without one, the candidate most others agree with (never simply the first:
    # one broken kernel would then fail every correct one), and none when no two agree
    trusted = sorted((b.reference_rank, n) for n, b in candidates.items()
                     if b.reference_rank is not None and n in outputs)
    tol = AGREEMENT_TOL[problem.dtype]
    how = "reference"
    if trusted:
        ref_name = trusted[0][1]
    else:
        ref_name, how = _majority(outputs, tol), "agreed with most candidates (no reference ran)"
        if ref_name is None and len(outputs) > 1:
            detail = "; ".join(f"{n}: {r.get('failed', 'ran')}" for n, r in results.items())
            raise NoBackendError(f"autotuning {problem.describe()}: no reference ran and no two candidates agree "
                                 f"within {tol:g}; nothing is stored ({detail})")
        ref_name = ref_name or next(iter(outputs), None)
    if ref_name is not None:
        for name in outputs:
            if name == ref_name:
                continue
            why = grads_disagreement(outputs[name], outputs[ref_name], tol)
            if why is not None:
                results[name] = {"failed": f"disagrees with {ref_name}: {why}", "ms": results[name].get("ms")}
    for name, why in (skipped or {}).items():
        results[name] = {"skipped": why}
    timed = {n: r["ms"] for n, r in results.items() if "ms" in r and "failed" not in r and "skipped" not in r}
    if not timed:
        detail = "; ".join(f"{n}: {r.get('failed') or r.get('skipped')}" for n, r in results.items())
        raise NoBackendError(f"every candidate failed while autotuning {problem.describe()}: {detail}")
    winner = min(timed, key=timed.get)
    from .tuning_table import now_iso

    entry = {
        "problem": problem.describe(),
        "winner": winner,
        "candidates": results,
        "cross_check": {"reference": ref_name, "tol": tol, "how": how},
        "measured_at": now_iso(),
    }
    return entry, outputs[winner]


# ---------------------------------------------------------------------------------------
# compiling first, in parallel
# ---------------------------------------------------------------------------------------
def _majority(outputs: dict, tol: float) -> Optional[str]:
    """The candidate whose gradients agree with the most others (ties: the first), None when no
    two agree."""
    names = list(outputs)
    votes = {n: sum(grads_disagreement(outputs[n], outputs[m], tol) is None for m in names if m != n) for n in names}
    best = max(names, key=lambda n: votes[n], default=None)
    return best if best is not None and votes[best] > 0 else None


def run_compile_job(job: tuple[str, str, tuple], device: str = "") -> float:
    """Run one `Backend.compile_jobs` entry (in a worker process) and mark it built for `device`
    (the GPU's name, `built_marker`); returns its wall time in seconds."""
    module, function, args = job
    t0 = time.perf_counter()
    getattr(importlib.import_module(module), function)(*args)
    took = time.perf_counter() - t0
    try:
        marker = built_marker(job, device)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(repr(job)[:2000] + "\n")
    except OSError:  # a marker only spares a later process a background build
        pass
    return took


def built_marker(job: tuple[str, str, tuple], device: str = ""):
    """The file saying `job` was built with these library versions, this gdr_dispatch and on a GPU
    named `device` (in the user cache directory, beside the tables): a table hit starts a
    background build only for jobs without one, so a tuned model's later launches start no
    processes (docs/design.md, "The first step")."""
    import hashlib

    from . import __version__, env
    from .problem import library_versions

    versions = ",".join(f"{k}={v}" for k, v in sorted(library_versions().items()))
    fn = getattr(importlib.import_module(job[0]), job[1], None) if job[0] in sys.modules else None
    what = warm_key(job) if getattr(fn, "length_free", False) else job  # a warm run: not its lengths
    digest = hashlib.sha1(f"{what!r}|{versions}|gdr_dispatch={__version__}|{device}".encode()).hexdigest()[:20]
    return env.user_table_dir() / "built" / digest


def precompile(jobs: dict[tuple, list[str]], workers: int, say: Callable[[str], None], device=None) -> None:
    """Run the compile jobs (each with the candidate names that need it) in up to `workers`
    processes at once, saying how long each took: a TileLang build is 20-100 s on one core, and
    TileLang's and Triton's disk caches are shared and process-safe, so the timing after finds
    them built. Each job is a fresh interpreter (`python -m gdr_dispatch.autotune JOB`), never a
    fork or a spawn of the caller's process, whose main script would run again in a spawned child.
    `device`: the GPU they build on (default: this process's current one)."""
    if not jobs:
        return
    workers = max(1, min(workers, len(jobs)))
    say(f"compiling {len(jobs)} kernels in {workers} processes first")
    t0 = time.perf_counter()
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    with ThreadPoolExecutor(workers) as pool:
        # a job the op's first forward started (`start_compiles`) is waited for, not run again
        futures = {pool.submit(_wait_early, job) if job in _early else pool.submit(_compile_in_subprocess, job, device): job
                   for job in jobs}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=HEARTBEAT_S, return_when=FIRST_COMPLETED)
            if not done:  # a build takes a minute: say that it goes on
                say(f"  still compiling: {len(jobs) - len(pending)} of {len(jobs)} done, "
                    f"{time.perf_counter() - t0:.0f} s spent")
            for fut in done:
                module, function, cfg = futures[fut]
                what = f"{'/'.join(sorted(set(jobs[futures[fut]])))}: {function}{cfg}"
                try:
                    say(f"  compiled {what} in {fut.result():.1f} s")
                except Exception as e:  # noqa: BLE001 - the timing compiles it again and records the failure
                    say(f"  failed to compile {what}: {type(e).__name__}: {str(e)[-300:]}")
    say(f"  all {len(jobs)} in {time.perf_counter() - t0:.1f} s")


def _build_device(device=None) -> tuple[Optional[int], str]:
    """`(index, name)` of the GPU a build runs on: `device`'s (a CUDA device), else this process's
    current one where it has CUDA up; `(None, "")` without."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None, ""
        index = device.index if device.index is not None else torch.cuda.current_device()
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
    else:
        return None, ""
    return index, torch.cuda.get_device_name(index)


def _spawn(job: tuple[str, str, tuple], device=None):
    """`python -m gdr_dispatch.autotune JOB [INDEX NAME]` started on the GPU of `device`
    (`_build_device`: under torchrun each rank's builds on its own GPU, not the first), its stderr
    into a temporary file (a pipe nobody reads while it runs could fill and stall it):
    `(process, stderr file, start time)`."""
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    env = dict(os.environ)
    here = str(Path(__file__).resolve().parent.parent)  # where this gdr_dispatch imports from
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    err = tempfile.TemporaryFile(mode="w+", errors="replace")  # a compiler's bytes are no reason to fail
    # its own process group: stopping it at exit stops the compilers it started too; started in
    # `here`, so `-m` imports this gdr_dispatch, not one in the caller's working directory
    index, name = _build_device(device)
    where = [] if index is None else [str(index), name]
    proc = subprocess.Popen([sys.executable, "-m", "gdr_dispatch.autotune", repr(job), *where], env=env, cwd=here,
                            stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True)
    return proc, err, time.perf_counter()


def _finish(started, timeout: Optional[float] = None) -> float:
    """Wait for a `_spawn`ed job: its wall time in seconds, or RuntimeError with its last line
    (TimeoutError, the job stopped, when it runs past `timeout` seconds)."""
    import subprocess

    proc, err, t0 = started
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(started)
        raise TimeoutError(f"still building after {timeout:.0f} s; stopped") from None
    err.seek(0)
    lines = [line for line in err.read().strip().splitlines() if line.strip()]
    err.close()
    if code != 0:
        raise RuntimeError(lines[-1] if lines else f"exit status {code}")
    return time.perf_counter() - t0


def _compile_in_subprocess(job: tuple[str, str, tuple], device=None) -> float:
    return _finish(_spawn(job, device))


#: The longest compile job (its repr, one command-line argument) started in the background.
MAX_JOB_CHARS = 100_000
#: Compile jobs started ahead of the call that needs them (`start_compiles`): job -> `_spawn`'s.
_early: dict = {}
#: Free memory on the call's GPU per background build started (its CUDA context and one small
#: run, with room left for the caller): fewer start where there is less.
EARLY_BUILD_FREE = 2 << 30
#: A build that runs the call at its full size (a warm run) holds its inputs, outputs and
#: intermediates: this many times the call's tensors, on top of EARLY_BUILD_FREE (`build_bytes`).
WARM_RUN_FACTOR = 8
#: The longest a call waits for a background build before stopping it and building itself.
EARLY_WAIT_S = 1800.0


def build_bytes(*tensors) -> int:
    """The free memory one background build running a call of these tensors at full size asks
    for (EARLY_BUILD_FREE plus WARM_RUN_FACTOR times their bytes)."""
    return EARLY_BUILD_FREE + WARM_RUN_FACTOR * sum(x.nbytes for x in tensors if x is not None)


def start_compiles(jobs, unbuilt_only: bool = False, device=None, per_job: int = EARLY_BUILD_FREE) -> int:
    """Start compile jobs (`compile_jobs_of`' keys) in background processes now, on `device`'s GPU
    (the call's), at most `compile_workers()` running at once and one per `per_job` bytes of
    that GPU's free memory (`build_bytes` for builds that run the call at full size), without
    waiting: the op's first forward at a shape starts its
    backward's builds so they overlap its own (docs/design.md, "The first step"); `precompile`
    then waits for them instead of starting them again, and a table hit waits for its winner's.
    `unbuilt_only`: not the jobs a process before built (`built_marker`). None with
    GDR_EARLY_BUILDS=0. The number started."""
    from . import env

    if not env.early_builds():
        return 0
    for done in [j for j, p in _early.items() if p[0].poll() is not None]:  # finished, nobody waited: said here
        wait_early(done)
    running = sum(p[0].poll() is None for p in _early.values())
    index, name = _build_device(device)
    room = None if index is None else int(torch.cuda.mem_get_info(index)[0] // max(per_job, EARLY_BUILD_FREE))
    started = 0
    for job in jobs:
        if job in _early or (unbuilt_only and built_marker(job, name).exists()):
            continue
        if len(repr(job)) >= MAX_JOB_CHARS:  # one command-line argument: a huge pack builds in-process
            continue
        if running >= compile_workers():
            break
        if room is not None and running >= room:  # (builds just started have not taken theirs yet)
            if caches.first_time(("early builds", "memory", index)):
                log.info("gdr_dispatch: %s has too little free memory for more background builds "
                         "(%.1f GiB each): the rest build in this process when first used", name,
                         max(per_job, EARLY_BUILD_FREE) / 2 ** 30)
            break
        _early[job] = _spawn(job, None if index is None else torch.device("cuda", index))
        running += 1
        started += 1
    return started


def wait_early(job) -> Optional[float]:
    """Wait for `job` when `start_compiles` started it and nobody waited yet: its wall time (None
    when it was not started early). A failed build is logged; the caller builds it again."""
    if job not in _early:
        return None
    try:
        return _wait_early(job)
    except Exception as e:  # noqa: BLE001 - an early build is an optimisation: the call builds it itself
        (log.warning if isinstance(e, TimeoutError) else log.info)(
            "gdr_dispatch: an early build failed (the call that needs it builds it again): %s: %s: %s", job[1],
            type(e).__name__, e)
        return None


def _wait_early(job) -> float:
    started = _early[job]
    try:
        took = _finish(started, EARLY_WAIT_S)
    except BaseException as e:
        if not isinstance(e, RuntimeError):  # interrupted (Ctrl-C): the job stops with the wait
            _stop(started)
        _early.pop(job, None)
        raise
    _early.pop(job, None)
    return took


def _stop_early() -> None:
    """At exit: the early jobs nobody waited for are stopped, with the compilers they started
    (their process groups); their partial builds are not cached."""
    for started in list(_early.values()):
        _stop(started)
    _early.clear()


def _stop(started) -> None:
    """Stop a `_spawn`ed job still running, with its process group (the compilers it started)."""
    import os
    import signal

    proc, err, _ = started
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - gone already, or will not die: kill it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
    try:
        err.close()
    except Exception:  # noqa: BLE001 - closed by _finish already
        pass


atexit.register(_stop_early)


def compile_jobs_of(call: GDRCall, candidates: dict[str, Backend]) -> dict[tuple, list[str]]:
    """Every candidate's compile jobs for `call`, each with the (base) names that need it. Warm
    runs (`warm_job`) are kept once per what their compilers and autotuners key on (the backend,
    heads, head dims, dtype, flags, varlen or not), not per sequence lengths: the split's segment
    counts would otherwise warm one backend a dozen times over (76 jobs, 417 s, for the starved
    bench's eight shapes on the H200)."""
    from .registry import base_name

    jobs: dict[tuple, list[str]] = {}
    for name, backend in candidates.items():
        for job in backend.compile_jobs(call):
            jobs.setdefault(job, []).append(base_name(name))
    return one_warm_run_per_key(jobs)


def one_warm_run_per_key(jobs: dict[tuple, list[str]]) -> dict[tuple, list[str]]:
    """`jobs` with only the first warm run (`warm_job`) of each `warm_key`; other jobs as they are."""
    out, warmed = {}, set()
    for job, names in jobs.items():
        if job[1] == warm_backend.__name__:
            if warm_key(job) in warmed:
                continue
            warmed.add(warm_key(job))
        out[job] = names
    return out


def warm_key(job: tuple) -> tuple:
    """What a warm job's kernels compile and autotune on: its backend, device and spec less the
    sizes (B, T, the lengths), with whether it is varlen."""
    backend, spec, device = job[2]
    fields = dict(spec)
    varlen = fields.get("seqlens") is not None
    return (backend, device, varlen, tuple((k, v) for k, v in sorted(fields.items()) if k not in ("B", "T", "seqlens")))


# ---------------------------------------------------------------------------------------
# a table miss: only the candidates that can win, compiled first
# ---------------------------------------------------------------------------------------
#: A candidate measured this much slower than the winner at every neighbouring table entry is
#: not measured on a table miss (docs/design.md, "Autotuning").
PRUNE_MARGIN = 1.25
#: A backend family (`Backend.family`, its splits included) is not measured on a table miss when
#: the device's tables hold at least `NEVER_WINS_ENTRIES` entries of the call's regime (full
#: grids, or starved ones) with its dtype, K, V, chunk size and `h` mode where it ran, it won none
#: of them, and it was `NEVER_WINS_MARGIN` or more slower than the winner at every one.
NEVER_WINS_ENTRIES = 3
NEVER_WINS_MARGIN = 1.1


def family_of(name: str) -> str:
    """The family (`Backend.family`) of a candidate name, wrapped or not; the base name for a
    backend not registered here."""
    from .registry import base_name, registered_backends

    base = base_name(name)
    backend = registered_backends().get(base)
    return backend.family if backend is not None else base


def losing_families(problem: Problem) -> dict[str, str]:
    """family -> why it is not measured at `problem`: the families the device's tables show never
    winning in the problem's regime (`NEVER_WINS_ENTRIES`, `NEVER_WINS_MARGIN`): full grids (as
    many sequence x head programs as SMs or more) by the full-grid entries, starved grids (where
    the splits compete) by the starved ones."""
    from . import tuning_table

    sms = problem.device.sm_count
    starved = problem.seq_head_ctas < sms
    regime = "starved-grid" if starved else "full-grid"
    won, ratios = set(), {}
    # one entry per measured problem: a table also holds each entry's copy for users without an
    # optional peer, and a user table may repeat the shipped one's (the one timing the most wins)
    measured: dict[tuple, tuple] = {}
    for key, entry in tuning_table.device_entries(problem):
        which = tuple(key.split("|")[:12])
        known = measured.get(which)
        if known is None or len(entry.get("candidates") or {}) > len(known[1].get("candidates") or {}):
            measured[which] = (key, entry)
    for key, entry in measured.values():
        programs = tuning_table.entry_programs(key, entry)
        cands = entry.get("candidates", {})
        best = cands.get(entry.get("winner"), {}).get("ms") if isinstance(cands, dict) else None
        if programs is None or (programs < sms) != starved or not isinstance(best, (int, float)) or best <= 0:
            continue
        won.add(family_of(entry["winner"]))
        mine: dict[str, float] = {}
        for name, c in cands.items():
            if isinstance(c, dict) and isinstance(c.get("ms"), (int, float)) and not {"failed", "skipped",
                                                                                    "unsupported"} & set(c):
                f = family_of(name)
                mine[f] = min(mine.get(f, float("inf")), c["ms"] / best)
        for f, r in mine.items():
            ratios.setdefault(f, []).append(r)
    return {f: f"the {f} family never won at the {len(r)} {regime} entries of this device's tables where it ran "
               f"(at best {min(r):.2f}x the winner)"
            for f, r in ratios.items()
            if f not in won and len(r) >= NEVER_WINS_ENTRIES and min(r) >= NEVER_WINS_MARGIN}


#: A table miss on a full grid takes the winner its neighbouring entries agree on, unmeasured,
#: where at least PREDICT_ENTRIES of them (the same device, library versions, dtype, K, V, chunk
#: size, flags and wave bucket; other sizes) all name it, it beat every other candidate timed
#: there by PREDICT_MARGIN or more, and every candidate that could run now was considered there
#: by name (docs/design.md, "Autotuning").
PREDICT_ENTRIES, PREDICT_MARGIN = 2, 1.15


def predict(problem: Problem, candidates: dict[str, Backend]) -> Optional[tuple[str, str]]:
    """`(winner, why)` when the device's neighbouring table entries agree on a winner among
    `candidates` clearly enough to skip measuring (`PREDICT_ENTRIES`, `PREDICT_MARGIN`), else
    None. Never on a CPU, with `GDR_AUTOTUNE_ALL=1`, or on a starved grid (its split counts, and
    whether to split at all, move with the grid inside one wave bucket)."""
    from . import env, tuning_table

    if env.autotune_all() or problem.device.type != "cuda" or problem.seq_head_ctas < problem.device.sm_count:
        return None
    mine = problem.problem_key().split("|")
    near = {}  # one per problem (a key in the user's and the shipped table counts once)
    for key, entry in tuning_table.neighbours(problem):
        parts = key.split("|")
        # the same library versions and every flag (varlen, states, layout), not just the h mode
        if key.rsplit("|", 1)[-1] == problem.versions_key() and parts[8] == mine[8]:
            near.setdefault(tuple(parts[:12]), entry)
    entries = list(near.values())
    if len(entries) < PREDICT_ENTRIES or len({e["winner"] for e in entries}) != 1:
        return None
    name = entries[0]["winner"]
    if name not in candidates:
        return None
    # every candidate that could run now was there by name, timed or skipped as losing (not "not
    # installed", not absent)
    names = {n for n, b in candidates.items() if not getattr(b, "reference", False)}
    margins = []
    for entry in entries:
        cands = entry.get("candidates", {})
        seen = {n for n, c in cands.items()
                if isinstance(c, dict) and ("ms" in c or "skipped" in c) and "unsupported" not in c}
        best = cands.get(name, {}).get("ms")
        others = [c["ms"] for n, c in cands.items() if n != name and isinstance(c, dict)
                  and isinstance(c.get("ms"), (int, float)) and not {"failed", "skipped", "unsupported"} & set(c)]
        if not names <= seen or not isinstance(best, (int, float)) or best <= 0 or not others:
            return None
        margins.append(min(others) / best)
    if min(margins) < PREDICT_MARGIN:
        return None
    return name, (f"predicted, not measured: the winner at all {len(entries)} neighbouring table entries, "
                  f"{min(margins):.2f}x ahead or more (GDR_AUTOTUNE_ALL=1 measures)")


def prune(problem: Problem, candidates: dict[str, Backend]) -> tuple[dict[str, Backend], dict[str, str]]:
    """`(kept, skipped)`: on a GPU a reference backend (`Backend.reference`, the exact torch math)
    is skipped; so is every member of a family the device's tables show never winning in the
    call's regime, full or starved grids (`losing_families`); and so is a candidate that the device's tables
    show losing by more than `PRUNE_MARGIN` (or failing) at every neighbouring entry where it was
    measured (same device, dtype, K, V, chunk size, `h` given or not, wave bucket; any library
    versions). A candidate no neighbour measured is kept; everything is never skipped (the
    non-reference candidates then run). `GDR_AUTOTUNE_ALL=1` keeps everything."""
    from . import env, tuning_table

    if env.autotune_all() or problem.device.type != "cuda":
        return dict(candidates), {}
    kept, skipped = {}, {}
    neighbours = tuning_table.neighbours(problem)
    losing = losing_families(problem)
    for name, backend in candidates.items():
        if getattr(backend, "reference", False) and len(candidates) > 1:
            skipped[name] = "a reference backend: it runs once for the cross-check, untimed"
            continue
        if family_of(name) in losing:
            skipped[name] = losing[family_of(name)]
            continue
        ratios = []
        for key, entry in neighbours:
            cands = entry.get("candidates", {})
            best = cands.get(entry.get("winner"), {}).get("ms")
            mine = cands.get(name)
            if not isinstance(best, (int, float)) or not isinstance(mine, dict):
                continue
            if "failed" in mine:
                ratios.append(float("inf"))
            elif isinstance(mine.get("ms"), (int, float)) and "unsupported" not in mine and "skipped" not in mine:
                ratios.append(mine["ms"] / best)
        if ratios and min(ratios) > PRUNE_MARGIN:
            skipped[name] = (f"{min(ratios):.2f}x the winner or worse at {len(ratios)} neighbouring table "
                             f"entr{'y' if len(ratios) == 1 else 'ies'}")
            continue
        kept[name] = backend
    if not kept:  # never prune everything: the non-reference candidates then all run
        kept = {n: b for n, b in candidates.items() if not getattr(b, "reference", False)} or dict(candidates)
        skipped = {n: why for n, why in skipped.items() if n not in kept}
    return kept, skipped


def compile_workers() -> int:
    import os

    return max(1, (os.cpu_count() or 2) // 2)


def first_call(call: GDRCall, problem: Problem, options: dict[str, Backend]) -> tuple[dict, GDRGrads]:
    """A table miss: prune, compile the kept candidates' kernels in parallel processes, then time
    them; a pruned reference backend still runs once (untimed) as the cross-check's reference."""
    import time

    t0 = time.perf_counter()
    kept, skipped = prune(problem, options)
    jobs = compile_jobs_of(call, kept)
    say = waiting(f"first call at {problem.describe()}: no tuning-table entry, so {len(kept)} of {len(options)} "
                  f"candidates are measured on it" + (f", their {len(jobs)} kernels compiled first" if len(jobs) > 1
                                                       else "")
                  + f"; this call takes a while ({env_hint()})")
    if skipped:
        say(f"table miss for {problem.describe()}: measuring {len(kept)} of {len(options)} candidates; skipped: "
            + "; ".join(f"{n} ({why})" for n, why in skipped.items()))
    if len(jobs) > 1 or any(job in _early for job in jobs):  # (one started early is waited for here)
        precompile(jobs, compile_workers(), say, device=call.q.device)
    # the most trusted reference of all runs once, untimed, when pruning skipped it
    refs = {n: b for n, b in options.items() if n in skipped and b.reference_rank is not None}
    kept_best = min((b.reference_rank for b in kept.values() if b.reference_rank is not None), default=None)
    best = min(refs, key=lambda n: refs[n].reference_rank) if refs else None
    if best is not None and (kept_best is None or refs[best].reference_rank < kept_best):
        name = best
        entry, grads = autotune(call, problem, {name: refs[name], **kept}, progress=say, skipped=None,
                                untimed={name})
        if "untimed" in entry["candidates"].get(name, {}):  # it ran: say why it was not timed (a failure stays)
            entry["candidates"][name] = {"skipped": skipped[name]}
        for n, why in skipped.items():
            entry["candidates"].setdefault(n, {"skipped": why})
    else:
        entry, grads = autotune(call, problem, kept, progress=say, skipped=skipped)
    entry["first_call_s"] = round(time.perf_counter() - t0, 1)
    log.warning("gdr_dispatch: first call at %s: %s picked in %s s; later calls take it from the table",
                problem.describe(), entry["winner"], entry["first_call_s"])
    return entry, grads


def waiting(start: str) -> Callable[[str], None]:
    """A `say` for a first call: `start` at WARNING now; then every line at INFO, and the first
    line after each `HEARTBEAT_S` at WARNING too."""
    log.warning("gdr_dispatch: %s", start)
    last = [time.perf_counter()]

    def say(line: str) -> None:
        now = time.perf_counter()
        if now - last[0] >= HEARTBEAT_S:
            last[0] = now
            log.warning("gdr_dispatch: %s", line)
        else:
            log.info("gdr_dispatch: %s", line)

    return say


def env_hint() -> str:
    from .env import AUTOTUNE

    return f"{AUTOTUNE}=0 takes the static order instead; `gdr-dispatch tune` measures ahead of time"


def warm_job(backend: str, call: GDRCall) -> tuple[str, str, tuple]:
    """A compile job that runs `backend` once on random inputs of `call`'s shape: for backends
    whose kernels compile and autotune on their first run (Triton's JIT, fla-core's autotuner;
    both cache on disk, so the caller's first run finds them done)."""
    return (__name__, warm_backend.__name__, (backend, call_spec(call), str(call.q.device)))


def forward_job(backend: str, q, v, g, beta, initial_state, cu_seqlens, seq_lens, scale: float, state_v_first: bool,
                need_final: bool, need_states: bool) -> tuple[str, str, tuple]:
    """A compile job that runs `backend`'s forward once on random inputs with the call's shapes,
    dtypes, flags and scale (what its kernels compile on: FlashQLA's TileLang kernels key on the
    scale too): the op's first forward at a shape builds the candidates it is about to measure
    in parallel processes (training.start_forward_compiles)."""
    spec = forward_spec(q, v, g, beta, initial_state, cu_seqlens, seq_lens, scale, state_v_first, need_final,
                        need_states)
    return (__name__, warm_forward.__name__, (backend, spec, str(q.device)))


def forward_spec(q, v, g, beta, initial_state, cu_seqlens, seq_lens, scale: float, state_v_first: bool,
                 need_final: bool, need_states: bool) -> tuple:
    """What a forward's kernels compile on, and what `forward_inputs` needs to make inputs like
    the call's: shapes, dtypes, flags, the scale, the lengths where varlen."""
    dt = lambda x: None if x is None else str(x.dtype)[6:]  # noqa: E731
    spec = dict(B=q.shape[0], T=q.shape[1], Hg=q.shape[2], K=q.shape[3], H=v.shape[2], V=v.shape[3], dtype=dt(q),
                g_dtype=dt(g), beta_dtype=dt(beta), h0_dtype=dt(initial_state),
                seqlens=tuple(seq_lens) if cu_seqlens is not None else None, cu_dtype=dt(cu_seqlens),
                state_v_first=bool(state_v_first),
                need_final=bool(need_final), need_states=bool(need_states), scale=float(scale))
    return tuple(sorted(spec.items()))


def warm_forward(backend: str, spec: tuple, device: str = "cuda") -> None:
    """`forward_job`'s work, in its own process."""
    from .registry import get_backend

    q, k, v, g, beta, h0, cu, f = forward_inputs(spec, device)
    get_backend(backend).forward(q, k, v, g, beta, f["scale"], h0, cu, f["state_v_first"], f["need_final"], 64,
                                 need_states=f["need_states"])
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def forward_inputs(spec: tuple, device: str = "cuda") -> tuple:
    """Random `(q, k, v, g, beta, initial_state, cu_seqlens, fields)` like the call `forward_spec`
    described (`fields`: the spec as a dict)."""
    f = dict(spec)
    gen = torch.Generator().manual_seed(0)
    B, T, Hg, K, H, V = f["B"], f["T"], f["Hg"], f["K"], f["H"], f["V"]

    def rnd(*shape, dtype):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=getattr(torch, dtype))

    q = rnd(B, T, Hg, K, dtype=f["dtype"])
    k = torch.nn.functional.normalize(rnd(B, T, Hg, K, dtype="float32"), dim=-1).to(q.dtype)
    v = rnd(B, T, H, V, dtype=f["dtype"])
    g = torch.nn.functional.logsigmoid(rnd(B, T, H, dtype="float32")).to(getattr(torch, f["g_dtype"]))
    beta = torch.sigmoid(rnd(B, T, H, dtype="float32")).to(getattr(torch, f["beta_dtype"]))
    cu = None
    if f["seqlens"] is not None:
        cu = torch.tensor([0, *torch.tensor(f["seqlens"]).cumsum(0).tolist()], dtype=getattr(torch, f["cu_dtype"]),
                          device=device)
    N = len(f["seqlens"]) if f["seqlens"] is not None else B
    state = (N, H, V, K) if f["state_v_first"] else (N, H, K, V)
    h0 = None if f["h0_dtype"] is None else rnd(*state, dtype=f["h0_dtype"])
    return q, k, v, g, beta, h0, cu, f


def warm_backend(backend: str, spec: tuple, device: str = "cuda") -> None:
    """`warm_job`'s work, in its own process."""
    from .registry import get_backend

    get_backend(backend).run(spec_call(spec, device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()


#: Its marker keys on what it compiles, not the lengths (`built_marker`): a job function of
#: `(name, call_spec(call), device)` may say so too.
warm_backend.length_free = True


def call_spec(call: GDRCall) -> tuple:
    """What a warm run needs of `call` to make one like it (`spec_call`): shapes, dtype, flags,
    the lengths where varlen."""
    spec = dict(B=call.B, T=call.T, H=call.H, Hg=call.Hg, K=call.K, V=call.V, dtype=str(call.q.dtype)[6:],
                h="given" if call.h is not None else "none", initial_state=call.initial_state is not None,
                dht=call.dht is not None, state_v_first=call.state_v_first, chunk_size=call.chunk_size,
                seqlens=tuple(call.seq_lens) if call.cu_seqlens is not None else None)
    return tuple(sorted(spec.items()))


def spec_call(spec: tuple, device: str = "cuda") -> GDRCall:
    """A validated call on random inputs like the one `call_spec` described."""
    from .contract import validate
    from .shapes import ShapeSpec, call_kwargs, make_inputs

    fields = dict(spec)
    if fields.get("seqlens") is None:
        fields.pop("seqlens", None)
    else:
        fields.pop("T")
        fields.pop("B")
    return validate(**call_kwargs(make_inputs(ShapeSpec(**fields), device, seed=0)))


if __name__ == "__main__":  # one compile job, in its own process (precompile)
    import ast

    if len(sys.argv) > 3:  # the GPU its parent's call is on: index and name
        torch.cuda.set_device(int(sys.argv[2]))
    run_compile_job(ast.literal_eval(sys.argv[1]), sys.argv[3] if len(sys.argv) > 3 else "")
