"""A training step of the gated delta rule (forward + backward), our op against the peers' ops.

    python bench/bench_training_op.py --preset h200-train     # or --grid FILE.yaml, --match REGEX

For each shape, one process, the same inputs (bf16 q/k/v/beta, fp32 log decay g and initial
state; loss = <o, do> + <final_state, dht>):
  * `ours`: `gdr_dispatch.chunk_gated_delta_rule` (fla-core's forward with the contract's
    residuals, then `fused_gdr_bwd` on whatever backend the dispatcher picks: the JSON's
    `backend` says which);
  * `ours@<backend>` for each of `--backends`: the same op with GDR_BACKEND forcing that backend
    through the forward and the backward; `ours/fwd=<backend>` for each of `--forwards`: the op
    with GDR_FORWARD forcing its forward provider;
  * `fla-op`: fla-core's `chunk_gated_delta_rule` on its own Triton kernels. fla-core 0.6
    dispatches that op to FlashQLA whenever `flash_qla` imports (its backend registry,
    `FLA_FLASH_QLA` read per call), so this runner sets `FLA_FLASH_QLA=0` around its step: with
    FlashQLA installed, the op a user calls *is* flashqla-op (measured on the H200: within 2-8 %
    of it);
  * `flashqla-op`: FlashQLA's `chunk_gated_delta_rule` as a user calls it (its intra-card split
    `auto_cp` on), when importable.
Our op first runs steps until a few in a row capture no split graph (`settle`: each capture costs about
two eager steps, once per model; the JSON's `settle_steps`).
Times are medians of CUDA-event timings of the whole step after warm-up, with the host's enqueue
of one step beside them (near the step's time it is host-bound); ratios are fla-op's
time over each runner's (> 1 is faster than fla's op). The error column is each runner's
largest relative Frobenius error, over o, the final state and every gradient, against
fla-op's. Writes bench/results/<device>-training.json and .md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch

from gdr_dispatch import clear_caches
from gdr_dispatch.problem import device_info, library_versions
from gdr_dispatch.shapes import PRESETS, ShapeSpec, load_grid, log_decay
from timing import back_to_back_ms, host_enqueue_ms, kernel_ms, measure_ms, relative_error

RESULTS = Path(__file__).resolve().parent / "results"
LEAVES = ("q", "k", "v", "g", "beta", "initial_state")


def step_inputs(spec: ShapeSpec, device, seed: int = 0) -> dict:
    """Forward inputs of one training step and the gradients flowing into its outputs."""
    gen = torch.Generator().manual_seed(seed)
    B, T = (1, spec.T) if spec.seqlens else (spec.B, spec.T)
    N = len(spec.seq_lens)
    dt = getattr(torch, spec.dtype)
    acc = torch.float64 if dt == torch.float64 else torch.float32  # g and the states

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    x = dict(q=rnd(B, T, spec.Hg, spec.K).to(dt),
             k=torch.nn.functional.normalize(rnd(B, T, spec.Hg, spec.K), dim=-1).to(dt),
             v=rnd(B, T, spec.H, spec.V).to(dt),
             g=log_decay(spec, gen).to(acc),
             beta=torch.sigmoid(rnd(B, T, spec.H)).to(dt),
             initial_state=rnd(N, spec.H, spec.K, spec.V).to(acc),
             do=rnd(B, T, spec.H, spec.V).to(dt), dht=rnd(N, spec.H, spec.K, spec.V).to(acc))
    x = {n: t.to(device) for n, t in x.items()}
    x["cu_seqlens"] = None if not spec.seqlens else torch.tensor(
        [0, *torch.tensor(spec.seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return x


class Forced:
    """An op with environment variables set for the whole step (the backward runs after the
    forward returns): GDR_BACKEND for `ours@<backend>`, FLA_FLASH_QLA=0 for fla's own kernels."""

    def __init__(self, op, backend: str | None = None, env: dict | None = None, graph_flags: dict | None = None):
        self.op = op
        self.env = {**(env or {}), **({"GDR_BACKEND": backend} if backend else {})}
        self.graph_flags = graph_flags or {}  # backends/split/graphs.py constants set for the step


#: `--graph-variants`: the split graphs' features each variant turns on or off (graphs.py's
#: PLACED_GPU_VERIFIED: several in-place graphs per key; LEND_GPU_VERIFIED: lent outputs;
#: OWN_POOLS_GPU_VERIFIED: the forward's graphs on pools of their own, lending all their outputs)
GRAPH_VARIANTS = {"one-set": {"PLACED_GPU_VERIFIED": False, "LEND_GPU_VERIFIED": False},
                  "placed": {"PLACED_GPU_VERIFIED": True, "LEND_GPU_VERIFIED": False},
                  "lend": {"PLACED_GPU_VERIFIED": False, "LEND_GPU_VERIFIED": True},
                  "placed+lend": {"PLACED_GPU_VERIFIED": True, "LEND_GPU_VERIFIED": True},
                  "fwd-copies": {"PLACED_GPU_VERIFIED": True, "LEND_GPU_VERIFIED": True,
                                 "OWN_POOLS_GPU_VERIFIED": False},
                  "fwd-lends": {"PLACED_GPU_VERIFIED": True, "LEND_GPU_VERIFIED": True,
                                "OWN_POOLS_GPU_VERIFIED": True}}


#: `--fresh-inputs`: every step clones its inputs first (every runner alike), as a model's layers
#: hand the op new activations each step, instead of the same tensors again
FRESH = False


def step(op, x: dict, **extra) -> dict:
    """One forward + backward of `op`; returns o, the final state and every gradient."""
    env = op.env if isinstance(op, Forced) else {}
    flags = op.graph_flags if isinstance(op, Forced) else {}
    op = op.op if isinstance(op, Forced) else op
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    graphs = None
    if flags:
        from gdr_dispatch.backends.split import graphs
        saved = {n: getattr(graphs, n) for n in flags}
        for n, v in flags.items():
            setattr(graphs, n, v)
    if FRESH:
        x = {n: t if t is None or not t.is_floating_point() else t.clone() for n, t in x.items()}
    try:
        leaves = {n: x[n].detach().requires_grad_(True) for n in LEAVES}
        o, ht = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                   initial_state=leaves["initial_state"], output_final_state=True, cu_seqlens=x["cu_seqlens"],
                   **extra)
        torch.autograd.backward((o, ht), (x["do"], x["dht"].to(ht.dtype)))
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
        if graphs is not None:
            for n, v in saved.items():
                setattr(graphs, n, v)
    return {"o": o.detach(), "ht": ht.detach(), **{"d" + n: t.grad for n, t in leaves.items()}}


class ChoiceLog(logging.Handler):
    """Remembers the backend of the dispatcher's latest 'backend <name> for ...' log line, and
    echoes the autotuner's progress lines (our op autotunes at a shape the table lacks)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.backend = self.forward = None

    def emit(self, record):
        if record.getMessage().startswith("gdr_dispatch: backend ") and record.args:
            self.backend = record.args[0]
        elif record.getMessage().startswith("gdr_dispatch: forward ") and record.args:
            self.forward = record.args[0]
        elif record.getMessage().startswith("gdr_dispatch: autotun"):  # a table miss: minutes, so say so
            print(f"      {record.getMessage()}", file=sys.stderr, flush=True)


def runners(forced=(), forwards=(), eager: bool = False, graph_variants=()) -> dict:
    """name -> op (or the reason it is absent)."""
    from gdr_dispatch import chunk_gated_delta_rule

    out = {"ours": chunk_gated_delta_rule}
    out.update({f"ours@{name}": Forced(chunk_gated_delta_rule, name) for name in forced})
    out.update({f"ours/graphs={name}": Forced(chunk_gated_delta_rule, graph_flags=GRAPH_VARIANTS[name])
                for name in graph_variants})
    if eager:  # the split eager (no graphs, no copies): GPU time against host time
        out["ours/eager"] = Forced(chunk_gated_delta_rule, env={"GDR_SPLIT_GRAPHS": "0"})
    # a forward provider forced (GDR_FORWARD), the backward dispatched as usual; unverified
    # forwards are what this measures before their GPU tests pass, hence GDR_ALLOW_UNVERIFIED
    out.update({f"ours/fwd={name}": Forced(chunk_gated_delta_rule, env={"GDR_FORWARD": name,
                                                                       "GDR_ALLOW_UNVERIFIED": "1"})
                for name in forwards})
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
        out["fla-op"] = Forced(fla_op, env={"FLA_FLASH_QLA": "0"})  # fla's own kernels (module docstring)
    except Exception as e:  # noqa: BLE001 - a peer that does not import is reported
        out["fla-op"] = f"not importable: {type(e).__name__}: {e}"
    try:
        from flash_qla import chunk_gated_delta_rule as fq_op
        out["flashqla-op"] = fq_op
    except Exception as e:  # noqa: BLE001
        out["flashqla-op"] = f"not importable: {type(e).__name__}: {e}"
    return out


def warm_flashqla(spec: ShapeSpec) -> float:
    """One FlashQLA training step at a bench shape (in a worker process). A small stand-in
    with the same head layout is not enough: on the H200 the timed step still compiled about
    three minutes of kernels at B1 T8192 H16 after such a warm-up (its intra-card split and
    kernels keyed on more than the layout)."""
    from flash_qla import chunk_gated_delta_rule as fq_op

    t0 = time.perf_counter()
    step(fq_op, step_inputs(spec, "cuda"))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def precompile_flashqla(shapes, workers: int) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    print(f"compiling FlashQLA's kernels for {len(shapes)} shapes first", file=sys.stderr, flush=True)
    with ProcessPoolExecutor(max(1, min(workers, len(shapes))), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(warm_flashqla, spec): spec.label() for spec in shapes}
        for fut in as_completed(futures):
            try:
                print(f"  {futures[fut]}: {fut.result():.1f} s", file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001 - the timed run reports it again
                print(f"  {futures[fut]}: failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)


def replays() -> dict:
    """The split graphs' replay counts so far (backends/split/graphs.py), {} where none ran."""
    try:
        from gdr_dispatch.backends.split import graphs
    except ImportError:
        return {}
    return dict(graphs.replays)


def captures() -> int:
    """The split graphs' captures so far (backends/split/graphs.py), 0 where none ran."""
    try:
        from gdr_dispatch.backends.split import graphs
    except ImportError:
        return 0
    return sum(graphs.captures.values())


#: Warm-up steps at most while the split graphs still capture (each capture costs about two eager
#: steps: timed, a burst of them reads as a slow step; a model pays them once), and the steps in a
#: row that must capture nothing (captures come in bursts as address sets come back).
SETTLE_STEPS = 40
SETTLED = 3


def settle(fn) -> int:
    """Steps of `fn` until SETTLED in a row capture no split graph (at most SETTLE_STEPS); how
    many ran."""
    quiet = 0
    for n in range(1, SETTLE_STEPS + 1):
        before = captures()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        quiet = quiet + 1 if captures() == before else 0
        if quiet == SETTLED:
            return n
    return SETTLE_STEPS


def copied_mib(fn) -> dict:
    """The MiB the split graphs copy in and out during one call of `fn` (graphs.copied_bytes)."""
    try:
        from gdr_dispatch.backends.split import graphs
    except ImportError:
        return {}
    before = dict(graphs.copied_bytes)
    fn()
    return {k: round((v - before.get(k, 0)) / 2 ** 20, 1) for k, v in graphs.copied_bytes.items()
            if v != before.get(k, 0)}


def bench_shape(spec: ShapeSpec, ops: dict, warmup: int, reps: int) -> dict:
    x = step_inputs(spec, "cuda", seed=1)
    row = {"shape": spec.label().rsplit(" h=", 1)[0], "runs": {}}
    ref = step(ops["fla-op"], x) if not isinstance(ops.get("fla-op", ""), str) else None
    choices = ChoiceLog()
    logging.getLogger("gdr_dispatch").addHandler(choices)
    logging.getLogger("gdr_dispatch").setLevel(logging.INFO)
    for name, op in ops.items():
        if isinstance(op, str):
            row["runs"][name] = {"skipped": op}
            continue
        t0 = time.perf_counter()
        try:
            choices.backend = choices.forward = None
            seen = dict(replays())
            if name.startswith("ours"):  # decided (and logged) afresh at each shape and gate: the memo keys
                clear_caches()           # on the shape alone, so a second gate would log nothing
            got = step(op, x)
            err = max(relative_error(got[n], ref[n]) for n in got) if ref is not None else None
            settled = settle(lambda: step(op, x)) if name.startswith("ours") else 0
            ms = measure_ms(lambda: step(op, x), "cuda", warmup=warmup, reps=reps)
            row["runs"][name] = {"ms": round(ms, 4), "b2b_ms": round(back_to_back_ms(lambda: step(op, x)), 4),
                                 "host_ms": round(host_enqueue_ms(lambda: step(op, x)), 4),
                                 "gpu_ms": round(kernel_ms(lambda: step(op, x)), 4),
                                 "syncs": synchronizing_calls(lambda: step(op, x)),
                                 **({"max_rel_err_vs_fla_op": float(f"{err:.3e}")} if ref else {})}
            if name.startswith("ours"):
                row["runs"][name].update(backend=choices.backend, forward=choices.forward)
                if replays():  # the split graphs' replays in this row: in place or with copies in
                    row["runs"][name]["graph_replays"] = {k: v - seen.get(k, 0) for k, v in replays().items()}
                    row["runs"][name]["settle_steps"] = settled
                    row["runs"][name]["graph_copies_mib_per_step"] = copied_mib(lambda: step(op, x))
        except Exception as e:  # noqa: BLE001 - a failing runner is reported, the sweep goes on
            row["runs"][name] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        print(f"    {name}: {row['runs'][name]}  [{time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
    logging.getLogger("gdr_dispatch").removeHandler(choices)
    del x
    torch.cuda.empty_cache()
    return row


def synchronizing_calls(fn) -> dict:
    """The calls in one warm step that wait on the GPU (torch's sync debug mode: a host read, a
    blocking copy): {"count": n, "first": its message, "where": the innermost Python frames of
    each}. A step with one is host-bound however few launches it makes, and cannot be captured
    whole."""
    import traceback
    import warnings

    seen = []

    def hook(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "synchroniz" in text and "prototype feature" not in text:  # torch's notice of the mode is none
            frames = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
            seen.append((text.splitlines()[0][:200],
                         " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {"count": len(seen), **({"first": seen[0][0], "where": [w for _, w in seen]} if seen else {})}


def profile_shape(spec: ShapeSpec, ops: dict, n: int) -> str:
    """Where a step's host time goes (the step is host-bound where its enqueue is near its time):
    per runner, torch.profiler's ops of `n` steps by their own host time, and a cProfile of `n`
    more by own and by cumulative time (the Python around the launches)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    x = step_inputs(spec, "cuda", seed=1)
    out = [f"== {spec.label()}"]
    for name, op in ops.items():
        for _ in range(3):
            step(op, x)  # warm: decided, graphs captured
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step(op, x)
            torch.cuda.synchronize()
        out += [f"-- {name}: torch.profiler, {n} steps", prof.key_averages().table(sort_by="self_cpu_time_total",
                                                                                   row_limit=25),
                f"-- {name}: the same steps by device time", prof.key_averages().table(
                    sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)]
        prof_py = cProfile.Profile()
        torch.cuda.synchronize()
        prof_py.enable()
        for _ in range(n):
            step(op, x)
        prof_py.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof_py, stream=buf).sort_stats("tottime").print_stats(30)
        out += [f"-- {name}: cProfile, {n} steps, by own time", buf.getvalue()]
        buf = io.StringIO()
        pstats.Stats(prof_py, stream=buf).sort_stats("cumulative").print_stats(45)
        out += [f"-- {name}: the same, by cumulative time (which calls hold the host time)", buf.getvalue()]
    del x
    return "\n".join(out) + "\n"


def to_markdown(rows, device) -> str:
    names = list(dict.fromkeys(n for r in rows for n in r["runs"]))
    lines = [f"Training step (forward + backward) on {device}, ms per step (a sync after each) / back to back (20 "
             "enqueued, one sync) (host: the step's enqueue alone; GPU: its kernels' summed device time); fla-op's per-step ms / this one's in brackets; ours: [the forward and backward "
             "backends the dispatcher ran]", "",
             "| shape | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        base = r["runs"].get("fla-op", {}).get("ms")
        cells = []
        for n in names:
            run = r["runs"].get(n, {})
            syncs = (run.get("syncs") or {}).get("count")
            cells.append(f"{run['ms']:.3f} / {run.get('b2b_ms', float('nan')):.3f} (host {run.get('host_ms', float('nan')):.3f}"
                         + (f", GPU {run['gpu_ms']:.3f}" if "gpu_ms" in run else "")
                         + (", graph copies " + "/".join(f"{k} {v:.0f}" for k, v in run["graph_copies_mib_per_step"].items())
                            + " MiB" if run.get("graph_copies_mib_per_step") else "")
                         + (f", {syncs} host waits" if syncs else "") + ")"
                         + (f" ({base / run['ms']:.2f}x)" if base else "")
                         + (f" [fwd {run.get('forward') or '?'}, bwd {run.get('backend') or '?'}]" if n == "ours" else "")
                         if "ms" in run
                         else ("failed" if "failed" in run else "-"))
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    errs = {n: max((r["runs"][n].get("max_rel_err_vs_fla_op", 0.0) for r in rows if n in r["runs"]), default=0.0)
            for n in names}
    lines += ["", "Largest relative error against fla-op over o, the final state and all gradients: "
              + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())]
    notes = sorted({f"{n}: {v.get('skipped') or v.get('failed')}" for r in rows for n, v in r["runs"].items()
                    if "skipped" in v or "failed" in v})
    if notes:
        lines += ["", "Not run:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default="h200-train")
    src.add_argument("--grid")
    p.add_argument("--match", default=None, help="only the shapes whose label matches this regular expression")
    p.add_argument("--backends", default="", help="also run our op with each of these backends forced (GDR_BACKEND), "
                   "as ours@<backend>, comma-separated")
    p.add_argument("--forwards", default="", help="also run our op with each of these forward providers forced "
                   "(GDR_FORWARD), as ours/fwd=<backend>, comma-separated")
    p.add_argument("--compile-jobs", type=int, default=8,
                   help="compile our backends' kernels and FlashQLA's op (one step at each shape) first, in this "
                        "many processes (0: not)")
    p.add_argument("--compile-backends", default="",
                   help="precompile only these of our backends, comma-separated (default: every supported one; "
                        "e.g. the table's winners, or the backend GDR_BACKEND forces)")
    p.add_argument("--gates", default="", help="run every shape once per gate (shapes.GATES), comma-separated")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--eager", action="store_true",
                   help="also run our op with the split's CUDA graphs off (GDR_SPLIT_GRAPHS=0), as ours/eager: "
                        "no copies in and out, every launch on the host")
    p.add_argument("--graph-variants", default="",
                   help="also run our op with the split graphs' unverified features on, comma-separated: "
                        f"{', '.join(GRAPH_VARIANTS)} (as ours/graphs=<variant>; no GDR_ALLOW_UNVERIFIED needed)")
    p.add_argument("--fresh-inputs", action="store_true",
                   help="every step clones its inputs first (every runner alike), as a model hands the op new "
                        "activations each step: the split graphs then read them in place only where the caching "
                        "allocator hands the same blocks back")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile N steps of each runner but fla's op per shape: torch.profiler's ops by their own "
                        "host time and by device time, and a cProfile of the Python, in <out>/<device>-training-profile.txt")
    args = p.parse_args(argv)
    global FRESH
    FRESH = args.fresh_inputs
    from gdr_dispatch.registry import registered_backends

    only = {n for n in args.compile_backends.split(",") if n} or None
    if only and only - set(registered_backends()):
        p.error(f"--compile-backends: unknown {sorted(only - set(registered_backends()))}; "
                f"known: {', '.join(registered_backends())}")
    if not torch.cuda.is_available():
        print("bench needs a CUDA device", file=sys.stderr)
        return 2
    shapes = load_grid(args.grid) if args.grid else PRESETS[args.preset]
    if args.gates:
        from dataclasses import replace as _replace
        shapes = [_replace(s, gate=gate) for s in shapes for gate in args.gates.split(",")]
    if args.match:
        shapes = [s for s in shapes if re.search(args.match, s.label())]
    ops = runners([n for n in args.backends.split(",") if n], [n for n in args.forwards.split(",") if n], args.eager,
                  [n for n in args.graph_variants.split(",") if n])
    # said before anything slow (a starved run can compile for minutes)
    print(f"{len(shapes)} shapes; runners: {', '.join(ops)}", file=sys.stderr, flush=True)
    if args.compile_jobs:
        # our op's backward (h=None by default): the backends' kernels for these shapes, in
        # parallel (on the H200 each forced TileLang backend compiled ~50 s inside its first row)
        from dataclasses import replace

        from gdr_dispatch.cli import precompile

        precompile([replace(s, h="none") for s in shapes], torch.device("cuda"), only, args.compile_jobs)
    if args.compile_jobs and callable(ops.get("flashqla-op")):
        precompile_flashqla(shapes, args.compile_jobs)
    dev = device_info(torch.device("cuda"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": dev.name, "versions": library_versions(), "warmup": args.warmup, "reps": args.reps, "rows": []}
    for i, spec in enumerate(shapes, 1):
        print(f"[{i}/{len(shapes)}] {spec.label()}", file=sys.stderr, flush=True)
        doc["rows"].append(bench_shape(spec, ops, args.warmup, args.reps))
        if args.profile:
            ours = {n: op for n, op in ops.items() if not isinstance(op, str) and n != "fla-op"}
            with open(out / f"{dev.slug}-training-profile.txt", "a") as f:
                f.write(profile_shape(spec, ours, args.profile))
        doc["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        # written after every shape, so a run cut short keeps what it measured
        (out / f"{dev.slug}-training.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / f"{dev.slug}-training.md").write_text(to_markdown(doc["rows"], dev.name))
    print(to_markdown(doc["rows"], dev.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
