"""`gdr-dispatch` (also `python -m gdr_dispatch`): `tune` sweeps shapes into a tuning table,
`explain` shows for one shape what each backend says and which one a call would get."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch

from . import env, tuning_table
from .autotune import autotune, compile_jobs_of, measure_ms, one_warm_run_per_key, warm_backend, warm_key
from .autotune import precompile as run_precompile
from .contract import validate
from .dispatch import NO_TENSORS, STATIC, TABLE, autotune_block_reason, select_backend, wrapped_candidates
from .problem import Problem, device_info
from .registry import NoBackendError, registered_backends
from .shapes import PRESETS, ShapeSpec, call_kwargs, load_grid, make_inputs


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def summarize(results: list[tuple[ShapeSpec, dict, str]], names: list[str]) -> str:
    """The tune table: each backend's ms or why not, the winner, and its speedup over the
    backend the static order would run (what an untuned call gets)."""
    notes: dict[str, int] = {}

    def note(text: str) -> str:
        notes.setdefault(text, len(notes) + 1)
        return f"[{notes[text]}]"

    rows = []
    for spec, entry, static in results:
        cands = entry.get("candidates", {})
        cells = [spec.label()]
        for n in names:
            c = cands.get(n, {})
            if "failed" in c:
                cells.append("failed " + note(f"{n}: failed: {c['failed']}"))
            elif "unsupported" in c:
                cells.append(f"unsupported {note(f'{n}: ' + c['unsupported'])}")
            elif "ms" in c:
                cells.append(f"{c['ms']:.3f}")
            else:
                cells.append("-")
        winner = entry.get("winner") or "none"
        cells.append(winner)
        static_ms = cands.get(static, {}).get("ms") if "failed" not in cands.get(static, {}) else None
        win_ms = cands.get(winner, {}).get("ms")
        cells.append(f"{static_ms / win_ms:.2f}x ({static})" if static_ms and win_ms else "-")
        rows.append(cells)
    out = format_table(["shape", *[f"{n} ms" for n in names], "winner", "vs static order"], rows)
    if notes:
        out += "\n" + "\n".join(f"[{i}] {text}" for text, i in notes.items())
    return out


def precompile(variants, device, only, workers: int, splits: bool = True, done: set | None = None,
               prune: bool = False, forward: bool = False) -> None:
    """Compile every kernel the sweep's backends would build on first use, in parallel processes
    (autotune.precompile), and say how long each took: a user's first-call cost. With `splits`,
    the split candidates' builds too (their segments are a varlen call with both states). `done`:
    the builds an earlier group of the sweep ran, skipped here (and this group's added to it).
    With `prune`, not the builds of the families `_losing` leaves out. With `forward` (a sweep
    that measures the op's forward), its candidates' builds at the starved shapes too."""
    done = set() if done is None else done
    jobs: dict[tuple, list[str]] = {}
    print(f"collecting the kernel builds of {len(variants)} shapes", file=sys.stderr, flush=True)
    for i, spec in enumerate(variants, 1):
        inputs = make_inputs(spec, device, seed=i)
        call = validate(**call_kwargs(inputs))
        problem = Problem.from_call(call)
        chosen = {name: backend for name, backend in registered_backends().items()
                  if (only is None or name in only) and backend.supported(problem)[0]}
        if splits:
            chosen.update(wrapped_candidates(problem, chosen, thorough=True))
        if prune:
            chosen = _losing(problem, chosen)[0]
        for job, names in compile_jobs_of(call, chosen).items():
            jobs.setdefault(job, []).extend(names)
        if forward and device.type == "cuda":  # where the sweep measures the op's forward (_tune_forward)
            key, forward_jobs = _forward_jobs(inputs)
            if ("forward", key) not in done:  # one build per forward key, as _tune_forward measures one
                done.add(("forward", key))
                for job, name in forward_jobs.items():
                    jobs.setdefault(job, []).append(f"the op's forward {name}")
        del inputs, call
    def build(job):  # what a job builds: a warm run's key (one_warm_run_per_key's), else the job
        return warm_key(job) if job[1] == warm_backend.__name__ else job

    fresh = {job: names for job, names in one_warm_run_per_key(jobs).items() if build(job) not in done}
    done.update(map(build, fresh))
    if fresh:
        run_precompile(fresh, workers, lambda line: print(line, file=sys.stderr, flush=True))


def _forward_jobs(inputs: dict) -> tuple:
    """`(forward table key, {job: candidate})`: the builds of the op's forward candidates
    `_tune_forward` measures at a starved shape (none at a full grid), so they compile in the
    sweep's parallel processes instead of one kernel after another in its own (jobs of the kind the
    training op's first forward starts: autotune.forward_job). A provider's splits share one
    build. A build is an optimisation: a failure to make its jobs is said and makes none."""
    from .contract import sequence_lengths
    from .training import forward_candidate_jobs, forward_candidates, forward_problem

    q, v, g, beta = inputs["q"], inputs["v"], inputs["g_raw"], inputs["b"]
    h0, cu, v_first = inputs["initial_state"], inputs["cu_seqlens"], inputs["state_v_first"]
    try:
        problem = forward_problem(q, v, beta, h0, cu, v_first)
        try:
            offers, candidates, _ = forward_candidates(problem)
        except RuntimeError:  # no forward provider here: _tune_forward says so
            return problem.table_key(), {}
        if all(n in offers for n in candidates):
            return problem.table_key(), {}
        lens = sequence_lengths(cu, q.shape[0], q.shape[1])
        jobs = {}  # as _tune_forward runs it: the final state, no chunk states
        for name, job in forward_candidate_jobs(candidates, q, v, g, beta, h0, cu, lens, q.shape[-1] ** -0.5,
                                                v_first, True, False).items():
            jobs.setdefault(job, name)
        return problem.table_key(), jobs
    except Exception as e:  # noqa: BLE001 - the measurement builds them itself
        print(f"    the op's forward: no parallel builds ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return None, {}


def _losing(problem: Problem, candidates: dict) -> tuple[dict, dict]:
    """`(kept, left_out)` for `tune --prune`: the candidates of every backend family this device's
    tables show never winning in the problem's regime (`autotune.losing_families`: full or
    starved grids) are left out, with why. Kept whatever its family: the most trusted reference
    (`Backend.reference_rank`: the cross-check reads it). All are kept where that would leave no
    candidate that is neither a reference nor in need of an optional peer (the table's entry for
    users without the peer needs one)."""
    from .autotune import family_of, losing_families

    losing = losing_families(problem)
    ranked = sorted((b.reference_rank, n) for n, b in candidates.items() if b.reference_rank is not None)
    trusted = ranked[0][1] if ranked else None
    left_out = {n: losing[family_of(n)] for n in candidates if family_of(n) in losing and n != trusted}
    kept = {n: b for n, b in candidates.items() if n not in left_out}
    if not any(not getattr(b, "reference", False) and not getattr(getattr(b, "inner", b), "optional_lib", None)
               for b in kept.values()):  # (a split's peer is its inner backend's)
        return dict(candidates), {}
    return kept, left_out


def cmd_tune(args) -> int:
    if env.forced_backend_name():
        print(f"note: {env.BACKEND}={env.forced_backend_name()} is ignored while tuning", file=sys.stderr)
    device = _device_or_error(args)
    if args.grid:
        shapes = load_grid(args.grid)
        source = args.grid
    else:
        preset = args.preset or ("h200-train" if device.type == "cuda" else "cpu")
        shapes = PRESETS[preset]
        source = f"preset {preset}"
    variants = [v for s in shapes for v in s.variants()]
    if args.match:
        try:
            pattern = re.compile(args.match)
        except re.error as e:
            print(f"error: --match: {e}", file=sys.stderr)
            return 2
        variants = [v for v in variants if pattern.search(v.label())]
        if not variants:
            print(f"error: --match {args.match!r}: no shape of {source} matches", file=sys.stderr)
            return 2
        source += f", the shapes matching {args.match!r}"
    dev = device_info(device)
    out_dir = Path(args.out) if args.out else tuning_table.user_table_dir()
    if args.missing:  # a sweep that resumes: what the table already holds for this device and versions stays
        path = tuning_table.table_path(out_dir, dev.slug)
        held = tuning_table.load_entries(path) if path.exists() else {}
        before = len(variants)
        variants = [v for v in variants if v.problem(device).table_key() not in held]
        print(f"--missing: {before - len(variants)} of {before} shapes already in {path}, {len(variants)} to tune",
              file=sys.stderr)
        if not variants:
            return 0
        source += ", those the table lacks"
    if device.type != "cuda":
        print("note: no CUDA device, so nothing the dispatcher autotunes can be measured here: this sweep times "
              "the backends that run on the CPU (the torch backend) and writes a cpu table, which checks the "
              "sweep itself; run it on the GPU you train on for a table that matters", file=sys.stderr)
    only = set(args.backends.split(",")) if args.backends else None
    if only:
        unknown = only - set(registered_backends())
        if unknown:
            print(f"error: --backends: unknown {sorted(unknown)}; known: {', '.join(registered_backends())}", file=sys.stderr)
            return 2
    measure = functools.partial(measure_ms, warmup=args.warmup, reps=args.reps)
    print(f"tuning {len(variants)} shapes ({source}) on {dev.name}; table: "
          f"{tuning_table.table_path(out_dir, dev.slug)}", file=sys.stderr)
    # shapes grouped by head counts and dtype (the kernels' compile keys), each group compiled then
    # measured before the next: a sweep stopped part way keeps the groups it finished
    groups: dict[tuple, list] = {}
    grid_order = {id(spec): i for i, spec in enumerate(variants)}  # the summary keeps the grid's order
    for spec in variants:
        groups.setdefault((spec.H, spec.Hg, spec.dtype), []).append(spec)
    variants = [spec for group in groups.values() for spec in group]
    starts = {id(group[0]): group for group in groups.values()}
    compiled: set = set()  # the builds run so far (a build several groups share runs once)

    results = []
    written = written_forward = 0
    forwards_done = set()  # the op forward's table keys already measured (h and dht do not change them)
    needs = {}  # optional library -> the backends that need it (a table entry is also written without them)
    for n, b in registered_backends().items():
        if b.optional_lib:
            needs.setdefault(b.optional_lib, set()).add(n)
    for i, spec in enumerate(variants, 1):
        if args.compile_jobs and id(spec) in starts:
            precompile(starts[id(spec)], device, only, args.compile_jobs, splits=not args.no_splits, done=compiled,
                       prune=args.prune, forward=not args.no_splits)
        t0 = time.perf_counter()
        print(f"[{i}/{len(variants)}] {spec.label()} ...", file=sys.stderr, flush=True)
        inputs = make_inputs(spec, device, seed=i)
        call = validate(**call_kwargs(inputs))
        problem = Problem.from_call(call)
        verdicts = {n: b.supported(problem) for n, b in registered_backends().items()}
        static = next((n for n, (ok, _) in verdicts.items() if ok), "")
        candidates = {n: b for n, b in registered_backends().items() if verdicts[n][0] and (only is None or n in only)}
        if not args.no_splits:  # starved grids: each candidate cut into 2/4/8 segments too, as the dispatcher would
            candidates.update(wrapped_candidates(problem, candidates, thorough=True))
        left_out = {}
        if args.prune:
            candidates, left_out = _losing(problem, candidates)
        try:
            if not candidates:
                raise NoBackendError("no supported backend among those asked for")
            # a line per candidate as it is measured: at 32K tokens a shape took minutes without one
            # and starved grids have dozens of candidates
            entry, _ = autotune(call, problem, candidates, measure=measure, skipped=left_out or None,
                                progress=lambda line: print(f"    {line}", file=sys.stderr, flush=True))
        except NoBackendError as e:
            entry = {"problem": problem.describe(), "winner": None, "candidates": {}, "error": str(e)}
        for n, (ok, reason) in verdicts.items():
            if not ok:
                entry["candidates"][n] = {"unsupported": reason}
            elif n not in candidates and n not in left_out:
                entry["candidates"][n] = {"unsupported": "left out by --backends"}
        if entry["winner"]:
            tuning_table.record(dev.slug, dev.name, {problem.table_key(): entry,
                                **tuning_table.without_optional(problem.table_key(), entry, needs)}, out_dir)
            written += 1
        results.append((spec, entry, static))
        win = entry["winner"]
        won = f"{win} {entry['candidates'][win]['ms']:.3f} ms" if win else f"no winner ({entry.get('error')})"
        print(f"      -> {won}  [{time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
        if not args.no_splits and device.type == "cuda":
            written_forward += _tune_forward(spec, inputs, dev, out_dir, needs, measure, forwards_done)
        del inputs, call
        if device.type == "cuda":
            torch.cuda.empty_cache()

    results.sort(key=lambda r: grid_order[id(r[0])])
    known = list(registered_backends())
    splits = sorted({n for _, e, _ in results for n in e.get("candidates", {}) if n not in known})
    print(summarize(results, known + splits))
    path = tuning_table.table_path(out_dir, dev.slug)
    if written:
        print(f"\ntable written: {path} ({written} of {len(results)} shapes"
              + (f"; the op's forward at {written_forward} starved shapes" if written_forward else "") + ")")
    else:
        print(f"\nnothing written to {path}: no shape had a winner", file=sys.stderr)
    return 0 if written == len(results) else 1


def _tune_forward(spec: ShapeSpec, inputs: dict, dev, out_dir: Path, needs: dict, measure, done: set) -> int:
    """On a starved grid, the op's forward too: its providers and their splits measured on the
    shape's inputs (training.measure_forwards) and stored under the forward's key; 1 when written."""
    from .training import CHUNK, forward_candidates, forward_problem, measure_forwards

    q, k, v, g, beta = inputs["q"], inputs["k"], inputs["v"], inputs["g_raw"], inputs["b"]
    h0, cu, v_first = inputs["initial_state"], inputs["cu_seqlens"], inputs["state_v_first"]
    problem = forward_problem(q, v, beta, h0, cu, v_first)
    key = problem.table_key()
    if key in done:
        return 0
    done.add(key)
    try:
        offers, candidates, _ = forward_candidates(problem)
    except RuntimeError as e:
        print(f"    forward: {e}", file=sys.stderr)
        return 0
    if all(n in offers for n in candidates):  # a full grid: the ranks are the measured order
        return 0
    scale = q.shape[-1] ** -0.5

    def measure_on(backend):
        return backend.forward(q, k, v, g, beta, scale, h0, cu, v_first, True, CHUNK, need_states=False)[:2]

    try:
        entry = measure_forwards(problem, candidates, next(iter(offers)), measure_on, measure=measure,
                                 say=lambda line: print(f"    {line}", file=sys.stderr, flush=True))
    except RuntimeError as e:  # this shape's forward is not stored; the sweep goes on
        print(f"      -> the op's forward: not measured ({e})", file=sys.stderr, flush=True)
        return 0
    tuning_table.record(dev.slug, dev.name, {key: entry, **tuning_table.without_optional(key, entry, needs)}, out_dir)
    print(f"      -> the op's forward: {entry['winner']} {entry['candidates'][entry['winner']]['ms']:.3f} ms",
          file=sys.stderr, flush=True)
    return 1


def _spec_from_args(args) -> ShapeSpec:
    seqlens = args.seqlens
    return ShapeSpec(
        B=args.B, T=None if seqlens else args.T, seqlens=seqlens, H=args.H, Hg=args.Hg, K=args.K, V=args.V,
        dtype=args.dtype, h=args.h, initial_state=not args.no_initial_state, dht=not args.no_dht,
        state_v_first=args.state_v_first, chunk_size=args.chunk_size,
    )


def _device_or_error(args) -> torch.device:
    device = torch.device(args.device or _default_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    return device


def cmd_explain(args) -> int:
    device = _device_or_error(args)
    spec = _spec_from_args(args)
    problem = spec.problem(device)
    print(f"shape: {problem.describe()}  [chunks {problem.num_chunks}, CTAs: seq x head {problem.seq_head_ctas}, "
          f"chunk x head {problem.chunk_ctas}]")
    d = problem.device
    print(f"device: {d.name} (capability {d.capability}, {d.sm_count} SMs)" if d.type == "cuda"
          else f"device: {d.name} ({d.sm_count} cores)")
    print("versions: " + ", ".join(f"{k} {v or 'absent'}" for k, v in problem.versions))
    print(f"table key: {problem.table_key()}")
    rows = [[name, "yes" if ok else "no", reason or "-"] for name, (ok, reason) in
            ((n, b.supported(problem)) for n, b in registered_backends().items())]
    print(format_table(["backend", "supported", "reason"], rows))
    try:
        choice = select_backend(problem, call=None)
    except (NoBackendError, ValueError) as e:
        print(f"chosen: none -- {e}")
        return 1
    how = choice.how
    if choice.source == TABLE:
        hit = choice.table_hit
        how += f"; entry {hit.key!r}" + ("" if hit.exact else f" ({hit.versions_note})")
    elif choice.source == STATIC and choice.detail == NO_TENSORS:
        blocked = autotune_block_reason(problem, have_tensors=True)
        supported = [n for n, (ok, _) in choice.verdicts.items() if ok]
        how = (f"in no tuning table: the first call autotunes {', '.join(supported)}"
               if blocked is None and len(supported) > 1 else
               f"in no tuning table; static order ({blocked or 'the only supported backend'})")
    print(f"chosen: {choice.backend.name} ({how})")
    if getattr(choice.backend, "segments", 1) > 1:
        print(f"split={choice.backend.segments} (the table's choice): each sequence runs as runs of whole chunks "
              f"joined exactly, on {choice.backend.inner.name}")
    segments = env.cp_segments()
    if segments is not None and segments > 1:
        print(f"split={segments} (GDR_CP): each sequence runs as {segments} segments of whole chunks in one varlen "
              f"call, whose own shape then picks the backend")
    _explain_forward(problem)
    return 0


def _explain_forward(problem) -> None:
    """Which backend's forward the training op would run for this shape, and the providers
    ranked before it that refuse it."""
    from .training import forward_choice, forward_view

    try:
        chosen, how = forward_choice(forward_view(problem))
    except (ValueError, RuntimeError) as e:
        print(f"training op forward: none -- {e}")
        return
    print(f"training op forward: {chosen.name} ({how})")


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 1,63,64,65, got {text!r}") \
            from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected token counts >= 0, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    # -v is accepted before or after the subcommand (`gdr-dispatch -v explain`, `gdr-dispatch explain -v`)
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log the dispatcher's decisions")
    p = argparse.ArgumentParser(prog="gdr-dispatch", description=__doc__, parents=[verbose])
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tune", parents=[verbose],
                       help="measure every supported backend over a grid of shapes and write the table")
    src = t.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), help="default: h200-train on a GPU, cpu without one")
    src.add_argument("--grid", metavar="FILE.yaml", help="shapes to tune (see gdr_dispatch/shapes.py)")
    t.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    t.add_argument("--out", metavar="DIR", help="table directory (default: $GDR_TUNING_CACHE, else $XDG_CACHE_HOME/gdr_dispatch, "
                   "else ~/.cache/gdr_dispatch)")
    t.add_argument("--match", metavar="REGEX",
                   help="tune only the grid's shapes whose label matches (e.g. 'T8192 H16|varlen'); the table keeps the rest")
    t.add_argument("--missing", action="store_true",
                   help="tune only the shapes the table in --out does not hold yet for this device and these library "
                        "versions: a sweep stopped part way resumes where it stopped")
    t.add_argument("--backends", metavar="A,B", help="tune only these backends (and their split candidates)")
    t.add_argument("--prune", action="store_true",
                   help="leave out (and record as skipped) the backend families this device's tables show never "
                        "winning in the shape's regime, full or starved grids: a sweep then compiles and times "
                        "only what can win (GDR_AUTOTUNE_ALL's opposite, for tables)")
    t.add_argument("--no-splits", action="store_true",
                   help="leave out the context-parallel candidates <backend>@split<n> that grids with fewer sequence x "
                        "head programs than SMs get (GDR_CP set also leaves them out)")
    t.add_argument("--warmup", type=_count(0), default=2, help="untimed runs per backend after the first (default 2)")
    t.add_argument("--reps", type=_count(1), default=10, help="timed runs per backend, median reported (default 10)")
    t.add_argument("--compile-jobs", type=_count(0), default=max(1, (os.cpu_count() or 2) // 2),
                   help="processes that compile the sweep's kernels in parallel before timing them, one group "
                        "of head counts and dtype at a time (default: half the CPU cores; 0: each compiles on "
                        "first use)")
    t.set_defaults(func=cmd_tune)

    e = sub.add_parser("explain", parents=[verbose],
                       help="for one shape: each backend's verdict and what a call would get")
    e.add_argument("--B", type=int, default=1)
    e.add_argument("--T", type=int, default=4096)
    e.add_argument("--seqlens", metavar="L1,L2,..", type=_lengths, help="varlen batch (then B=1, T=sum)")
    e.add_argument("--H", type=int, default=32, help="value heads")
    e.add_argument("--Hg", type=int, default=None, help="q/k heads (default H)")
    e.add_argument("--K", type=int, default=128)
    e.add_argument("--V", type=int, default=128)
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--h", choices=["given", "none"], default="given", help="is h given to the call")
    e.add_argument("--no-initial-state", action="store_true")
    e.add_argument("--no-dht", action="store_true")
    e.add_argument("--state-v-first", action="store_true")
    e.add_argument("--chunk-size", type=int, default=64)
    e.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    e.set_defaults(func=cmd_explain)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
