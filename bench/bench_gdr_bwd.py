"""Side-by-side timing of the GDR backward: our backends and the peers, in one process.

    python bench/bench_gdr_bwd.py --preset h200-train      # or --grid FILE.yaml

For each shape, with `h` given and with `h=None`:
  * every registered backend that supports the call, through `fused_gdr_bwd` with
    GDR_BACKEND forcing it (so validation and dispatch are inside the time), except `torch`,
    which runs once as the exact reference for the error column;
  * `dispatched`: `fused_gdr_bwd` with nothing forced (the tables' pick, named in the JSON
    row's `dispatched_pick` and the markdown's notes); at varlen rows also
    `dispatched-cpu-offsets`, the same call with `cu_seqlens` on the CPU (no host wait per call
    after the first: its device copy is kept);
  * `fla-op`: fla-core's own `chunk_gated_delta_rule_bwd`, fed fla's conventions prepared
    outside the timing (as its forward would have saved them); it always recomputes `h`. Its
    Triton chain: fla-core's public op runs FlashQLA's op (`auto_cp`) instead where FlashQLA is
    installed, the `flashqla-auto_cp` runner;
  * `flashqla`: FlashQLA, when importable. With `h` given: its fused kernel plus the
    grouped-head reduction and reverse cumsum it leaves to its caller; with `h=None`: its
    `chunk_gated_delta_rule_bwd(auto_cp=False)`.
  * `--first-call`: what a user's first call at a shape no table holds costs (the dispatcher's
    pruned autotune, its kernels compiled first in parallel), its pick, and with
    `--first-call-full` the full sweep of every candidate (GDR_AUTOTUNE_ALL=1) at the same shape
    for comparison: the pick's time in the full sweep over the full sweep's winner;
  * with `--splits 2,4,8`: the context-parallel split forced (GDR_CP) around the
    `--split-backends`, as `<backend>@split<n>`, and FlashQLA's own `auto_cp=True` split
    (`flashqla-auto_cp`, h=None rows); `--splits auto`: on starved grids only (fewer sequence x
    head programs than SMs), the segment counts the autotuner would try there.
Times are medians of CUDA-event timings after warm-up (gdr_dispatch.autotune.measure_ms), each
with the host's enqueue time beside it (`host_ms`; near `ms` the call is host-bound); with
`--rounds N` (default 2) each runner is timed N times in alternating order and the least median
kept (the JSON's `ms_rounds` has all).
The floor is max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s), the copy bandwidth and bf16
matmul rate measured on an H200, for the estimate in `bench/roofline.py`.
Writes bench/results/<device>.json and .md. Runs against the installed gdr_dispatch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

from gdr_dispatch import GDRGrads, Problem, fused_gdr_bwd, registered_backends
from gdr_dispatch.backends.split import graphs
from gdr_dispatch.contract import validate
from gdr_dispatch.env import ALLOW_UNVERIFIED as ALLOW_UNVERIFIED_ENV
from gdr_dispatch.problem import device_info, library_versions
from gdr_dispatch.shapes import PRESETS, ShapeSpec, call_kwargs, load_grid, make_inputs
from roofline import bytes_and_flops, floor_ms
from timing import back_to_back_ms, host_enqueue_ms, measure_ms, more_rounds, relative_error

RESULTS = Path(__file__).resolve().parent / "results"

#: a runner whose enqueue alone takes this share of its time is marked host-bound in the markdown
HOST_BOUND = 0.8
HBM_GBS = 4300.0  # device-to-device copy on the H200 here (KINDS.md)
BF16_TFLOPS = 790.0  # 8192^3 bf16 matmul on the H200 here (KINDS.md)


def fla_op_runner(x):
    """fla-core's own backward, with its conventions made once outside the timing."""
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd
    from fla.ops.utils.index import prepare_chunk_indices

    from gdr_dispatch.backends.kernels.gate_wy_inverse import gate_wy_inverse

    cu = x["cu_seqlens"]
    ci = None if cu is None else prepare_chunk_indices(cu, x["chunk_size"])
    A, g2 = gate_wy_inverse(x["a"], x["g"], cu, ci, out_dtype=x["k"].dtype, with_log2_gate=True)
    h0 = x["initial_state"]

    def run():
        dq, dk, dv, db, dg, dh0, _, _ = chunk_gated_delta_rule_bwd(
            q=x["q"], k=x["k"], v=x["v"], g=g2, beta=x["b"], A=A, scale=x["scale"], initial_state=h0,
            do=x["do"], dht=x["dht"], state_v_first=x["state_v_first"], cu_seqlens=cu, chunk_indices=ci,
            chunk_size=x["chunk_size"])
        return GDRGrads(dq, dk, dv, dg, db, dh0 if h0 is not None else None)

    return run


def flashqla_runner(x, auto_cp=False):
    """FlashQLA 0.1.3 (its sm90 kernels), or None when it cannot be imported."""
    try:
        from flash_qla.ops.gated_delta_rule import chunk as fq
        from flash_qla.ops.utils import chunk_local_cumsum, group_reduce_vector
    except Exception as e:  # noqa: BLE001 - any import failure means "peer absent"
        print(f"  flashqla not importable: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    Hg, H = x["k"].shape[2], x["v"].shape[2]
    h0 = x["initial_state"]

    if x["h"] is not None:
        def run():
            dq, dk, dv, dg, db, dh0 = fq.fused_gdr_bwd(
                q=x["q"], k=x["k"], v=x["v"], a=x["a"], g=x["g"], b=x["b"], do=x["do"], dht=x["dht"], h=x["h"],
                scale=x["scale"], cu_seqlens=x["cu_seqlens"], chunk_size=x["chunk_size"],
                state_v_first=x["state_v_first"])
            if Hg < H:
                dq, dk = group_reduce_vector(dq, Hg), group_reduce_vector(dk, Hg)
            dg = chunk_local_cumsum(dg, chunk_size=x["chunk_size"], reverse=True, cu_seqlens=x["cu_seqlens"],
                                    zero_last_chunk=True)
            return GDRGrads(dq, dk, dv, dg, db, dh0 if h0 is not None else None)
    else:
        def run():
            dq, dk, dv, db, dg, dh0 = fq.chunk_gated_delta_rule_bwd(
                q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["b"], A=x["a"], do=x["do"], dht=x["dht"],
                scale=x["scale"], initial_state=h0, cu_seqlens=x["cu_seqlens"],
                state_v_first=x["state_v_first"], auto_cp=auto_cp)
            return GDRGrads(dq, dk, dv, dg, db, dh0 if h0 is not None else None)
    return run


def forced(name, kwargs, segments=None):
    """`name` forced through GDR_BACKEND; `segments`: the context-parallel split forced (GDR_CP)."""
    env = {"GDR_BACKEND": name, **({"GDR_CP": str(segments)} if segments else {})}

    def run():
        os.environ.update(env)
        try:
            return fused_gdr_bwd(**kwargs)
        finally:
            for n in env:
                os.environ.pop(n, None)
    return run


def dispatched(kwargs):
    """`fused_gdr_bwd` as a user calls it: no GDR_BACKEND or GDR_CP, the tables decide."""
    def run():
        saved = {n: os.environ.pop(n) for n in ("GDR_BACKEND", "GDR_CP") if n in os.environ}
        try:
            return fused_gdr_bwd(**kwargs)
        finally:
            os.environ.update(saved)
    return run


#: The first-call bench's default shape: a model configuration no shipped table holds.
FIRST_CALL_SHAPES = [ShapeSpec(B=2, T=4096, H=16, Hg=8, h="none")]


def first_call(spec, full: bool) -> dict:
    """A first call at `spec` with an empty user table: its wall time (compiles, the pruned
    autotune and the call itself), the pick and what was skipped; `full`: the full sweep too."""
    import tempfile

    import yaml

    from gdr_dispatch import clear_caches

    x = make_inputs(spec, "cuda", seed=1)
    kwargs = call_kwargs(x)
    row = {"shape": spec.label(), "h": spec.h}

    def one(all_candidates: bool):
        with tempfile.TemporaryDirectory() as d:
            saved = {n: os.environ.get(n) for n in ("GDR_TUNING_CACHE", "GDR_AUTOTUNE_ALL")}
            os.environ["GDR_TUNING_CACHE"] = d
            os.environ["GDR_AUTOTUNE_ALL"] = "1" if all_candidates else "0"
            clear_caches()
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dispatched(kwargs)()
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                tables = list(Path(d).glob("*.yaml"))
                entry = next(iter(yaml.safe_load(tables[0].read_text())["entries"].values())) if tables else {}
                if not entry:  # nothing stored: a prediction from the neighbouring entries (or the static order)
                    from gdr_dispatch.dispatch import select_backend

                    choice = select_backend(Problem.from_call(validate(**kwargs)), None)
                    entry = {"winner": choice.backend.name, "how": choice.how, "candidates": {}}
            finally:
                for n, v in saved.items():
                    os.environ.pop(n, None) if v is None else os.environ.__setitem__(n, v)
                clear_caches()
        return seconds, entry

    seconds, entry = one(False)
    cands = entry.get("candidates", {})
    row.update(first_call_s=round(seconds, 1), pick=entry.get("winner"), **({"how": entry["how"]} if "how" in entry else {}),
               measured=sorted(n for n, c in cands.items() if "ms" in c and "failed" not in c),
               skipped={n: c["skipped"] for n, c in cands.items() if "skipped" in c},
               candidates={n: c.get("ms") for n, c in cands.items() if "ms" in c})
    print(f"first call {spec.label()}: {seconds:.1f} s, pick {row['pick']}, measured {len(row['measured'])}, "
          f"skipped {len(row['skipped'])}", file=sys.stderr, flush=True)
    if full:
        seconds, entry = one(True)
        cands = {n: c.get("ms") for n, c in entry.get("candidates", {}).items()
                 if isinstance(c.get("ms"), (int, float)) and "failed" not in c}
        best = entry.get("winner")
        row.update(full_sweep_s=round(seconds, 1), full_pick=best, full_candidates=cands)
        if row["pick"] in cands and best in cands:
            row["pick_over_full_winner"] = round(cands[row["pick"]] / cands[best], 3)
        print(f"full sweep {spec.label()}: {seconds:.1f} s, pick {best}; first call's pick at "
              f"{row.get('pick_over_full_winner')}x its time", file=sys.stderr, flush=True)
    return row


def max_error(grads, ref):
    return max(relative_error(getattr(grads, n), getattr(ref, n)) for n in GDRGrads._fields)


def bench_shape(spec, warmup, reps, skip, splits=(), split_backends=(), rounds=1, only_splits=False):
    x = make_inputs(spec, "cuda", seed=1)
    kwargs = call_kwargs(x)
    problem = None
    ref = forced("torch", kwargs)()
    runners = {}
    for name, backend in registered_backends().items():
        if name == "torch" or name in skip:
            continue
        problem = problem or Problem.from_call(validate(**kwargs))
        ok, reason = backend.supported(problem)
        runners[name] = forced(name, kwargs) if ok else reason
    if splits == "auto":  # the autotuner's own counts, on starved grids only
        from gdr_dispatch.backends.split import segment_counts as split_segment_counts

        problem = problem or Problem.from_call(validate(**kwargs))
        splits = split_segment_counts(problem) if problem.seq_head_ctas < problem.device.sm_count else ()
    for name in split_backends:  # the context-parallel split, forced (docs/kernels.md)
        if not isinstance(runners.get(name), str) and name in runners:
            for n in splits:
                runners[f"{name}@split{n}"] = forced(name, kwargs, segments=n)
    if only_splits:  # the starved bench: the splits, the pick and the peers, not every backend unsplit
        runners = {n: fn for n, fn in runners.items() if "@split" in n}
    if "dispatched" not in skip:  # what the tables pick (the row's `dispatched_pick`)
        runners["dispatched"] = dispatched(kwargs)
        if kwargs.get("cu_seqlens") is not None:  # the offsets on the CPU: after the first call, no host wait
            runners["dispatched-cpu-offsets"] = dispatched({**kwargs, "cu_seqlens": kwargs["cu_seqlens"].cpu()})
    if "fla-op" not in skip:
        runners["fla-op"] = fla_op_runner(x)
    if "flashqla" not in skip:
        runners["flashqla"] = flashqla_runner(x) or "not importable"
        if splits and x["h"] is None:  # its own (approximate) intra-card split
            runners["flashqla-auto_cp"] = flashqla_runner(x, auto_cp=True) or "not importable"
    row = {"shape": spec.label(), "h": spec.h, "runs": {}}
    nbytes, flops = bytes_and_flops(spec)
    row["floor_ms"] = round(floor_ms(spec, HBM_GBS, BF16_TFLOPS), 4)
    row["bytes"], row["flops"] = nbytes, flops
    for name, fn in runners.items():
        if isinstance(fn, str):
            row["runs"][name] = {"skipped": fn}
            continue
        t0 = time.perf_counter()
        try:
            err = max_error(fn(), ref)
            before = sum(graphs.captures.values())
            ms = measure_ms(fn, "cuda", warmup=warmup, reps=reps)
            row["runs"][name] = {"ms": round(ms, 4), "b2b_ms": round(back_to_back_ms(fn), 4),
                                 "max_rel_err": float(f"{err:.3e}"), "host_ms": round(host_enqueue_ms(fn), 4)}
            if sum(graphs.captures.values()) > before:  # a split graph captured inside the timing: its times hold it
                row["runs"][name]["graph_captures_timed"] = sum(graphs.captures.values()) - before
        except Exception as e:  # noqa: BLE001 - a failing runner is reported, the sweep goes on
            row["runs"][name] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        print(f"    {name}: {row['runs'][name]}  [{time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
    more_rounds(runners, row["runs"], rounds, lambda fn: measure_ms(fn, "cuda", warmup=warmup, reps=reps))
    if "ms" in row["runs"].get("dispatched", {}):  # after it ran: the decision it made (a table miss autotunes or predicts)
        from gdr_dispatch.dispatch import select_backend

        row["dispatched_pick"] = select_backend(Problem.from_call(validate(**kwargs))).backend.name
    del x, kwargs, ref
    torch.cuda.empty_cache()
    return row


def merge_rows(earlier, fresh):
    """`earlier` rows updated by `fresh`, in the earlier order, new shapes last. A shape measured
    again keeps the runners the fresh run left out (`--skip`), each stamped with the time of the
    run that measured it."""
    new = {r["shape"]: r for r in fresh}
    merged = []
    for prev in earlier:
        r = new.pop(prev["shape"], None)
        if r is None:
            merged.append(prev)
            continue
        stamp = prev.get("measured_at")
        kept = {n: ({**v, "measured_at": stamp} if stamp and "measured_at" not in v else v)
                for n, v in prev["runs"].items() if n not in r["runs"]}
        merged.append({**r, "runs": {**r["runs"], **kept}})
    return merged + list(new.values())


def _both(run) -> str:
    """A summary cell: per call / back to back (host enqueue), or "-" where either is missing."""
    return (f"{run['ms']:.3f} / {run['b2b_ms']:.3f} (host {run.get('host_ms', float('nan')):.3f})"
            if "ms" in run and "b2b_ms" in run else "-")


def _over(run, peer) -> str:
    """`run`'s times over `peer`'s, per call / back to back."""
    return (f"{run['ms'] / peer['ms']:.2f}x / {run['b2b_ms'] / peer['b2b_ms']:.2f}x"
            if "ms" in run and "b2b_ms" in run else "-")


def starved_summary(rows) -> list:
    """Where FlashQLA's own split ran (`flashqla-auto_cp`): our pick, our best split and the peers,
    each with its host enqueue time, and our times over FlashQLA's (rows timed before the bench
    timed back to back are left out)."""
    rows = [r for r in rows if "b2b_ms" in r["runs"].get("flashqla-auto_cp", {})]
    if not rows:
        return []
    out = ["", "Starved grids, ms per call (a sync after each) / back to back (20 enqueued, one sync), host enqueue:",
           "", "| shape | our pick | our best split | FlashQLA auto_cp | fla's op | pick / auto_cp | best split / auto_cp |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = r["runs"]
        splits = {n: v for n, v in runs.items() if "@split" in n and "ms" in v}
        best = min(splits, key=lambda n: splits[n]["ms"]) if splits else None
        pick, fq = runs.get("dispatched", {}), runs["flashqla-auto_cp"]
        out.append(f"| {r['shape'].rsplit(' h=', 1)[0]} | {_both(pick)} [{r.get('dispatched_pick', '-')}] | "
                   + (f"{_both(splits[best])} [{best}]" if best else "-")
                   + f" | {_both(fq)} | {_both(runs.get('fla-op', {}))} | {_over(pick, fq)} | "
                   + (_over(splits[best], fq) if best else "-") + " |")
    return out


def peer_summary(rows) -> list:
    """Where FlashQLA ran without its own split (full grids, or `h` given): our backend whole, the
    tables' pick and FlashQLA per call and back to back, with our times over FlashQLA's. Rows
    measured before the bench timed back to back are left out."""
    rows = [r for r in rows if "b2b_ms" in r["runs"].get("flashqla", {})
            and "ms" not in r["runs"].get("flashqla-auto_cp", {})]
    if not rows:
        return []
    out = ["", "Beside FlashQLA, ms per call (a sync after each) / back to back (20 enqueued, one sync), host enqueue "
           "(FlashQLA: with `h` given its fused kernel plus the head sum and reverse cumsum it leaves to its caller, "
           "with `h=None` its whole backward):", "",
           "| shape | h | tilelang_fused | our pick | FlashQLA | tilelang_fused / FlashQLA | pick / FlashQLA |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = r["runs"]
        ours, pick, fq = runs.get("tilelang_fused", {}), runs.get("dispatched", {}), runs["flashqla"]
        out.append(f"| {r['shape'].rsplit(' h=', 1)[0]} | {r['h']} | {_both(ours)} | {_both(pick)} "
                   f"[{r.get('dispatched_pick', '-')}] | {_both(fq)} | {_over(ours, fq)} | {_over(pick, fq)} |")
    return out


def to_markdown(rows, names, device, unverified=()):
    lines = [f"GDR backward on {device}, median ms, least of the rounds (ratio = fla-op ms / this ms; >1 is faster than fla's own op)", ""]
    head = ["shape", "h", "floor", *(n + ("*" if n in unverified else "") for n in names)]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        base = r["runs"].get("fla-op", {}).get("ms")
        cells = [r["shape"].rsplit(" h=", 1)[0], r["h"], f"{r['floor_ms']:.3f}"]
        for n in names:
            run = r["runs"].get(n, {})
            if "ms" in run:
                ratio = f" ({base / run['ms']:.2f}x)" if base else ""
                cells.append(f"{run['ms']:.3f}{ratio}" + ("†" if "measured_at" in run else ""))
            else:
                cells.append("failed" if "failed" in run else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += peer_summary(rows) + starved_summary(rows)
    notes = sorted({f"{n}: {v.get('skipped') or v.get('failed')}" for r in rows for n, v in r["runs"].items()
                    if "skipped" in v or "failed" in v})
    worst = {}
    for r in rows:
        for n in names:
            e = r["runs"].get(n, {}).get("max_rel_err")
            if e is not None:
                worst[n] = max(worst.get(n, 0.0), e)
    lines += ["", "Largest relative Frobenius error of any gradient against the torch backend (fp32), over these shapes: "
              + ", ".join(f"{n} {e:.1e}" for n, e in worst.items())]
    if any("measured_at" in v for r in rows for v in r["runs"].values()):
        lines += ["", "† kept from an earlier run than the rest of its row (left out of the later one; its time "
                  "stamp is in the JSON): compare across runs with care, launch-bound rows move by up to 30 %"]
    if unverified:
        lines += ["", "* refused by the dispatcher when this ran (not yet GPU-verified by tests/test_gpu.py), "
                  "run by --unverified"]
    bound = sorted({f"{r['shape'].rsplit(' h=', 1)[0]} h={r['h']} {n}" for r in rows for n, v in r["runs"].items()
                    if "host_ms" in v and "ms" in v and v["host_ms"] >= HOST_BOUND * v["ms"]})
    if bound:
        lines += ["", f"Host-bound (the enqueue alone took >= {HOST_BOUND:.0%} of the time; such cells move with the "
                  "machine's CPU): " + "; ".join(bound)]
    picks = [f"{r['shape']}: {r['dispatched_pick']}" for r in rows if r.get("dispatched_pick")]
    if picks:
        lines += ["", "dispatched: the backend the tables picked, " + "; ".join(picks)]
    if notes:
        lines += ["", "Not run:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default="h200-train")
    src.add_argument("--grid")
    p.add_argument("--h", choices=["given", "none", "both"], default=None, help="override each shape's h mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2,
                   help="time every runner this many times per shape, in alternating order; keep the least median")
    p.add_argument("--skip", default="", help="runners to leave out, comma-separated")
    p.add_argument("--match", default=None, help="only the shapes whose label matches this regular expression")
    p.add_argument("--merge", action="store_true",
                   help="add to the rows already in the output JSON (same label and h replaced) instead of starting anew")
    p.add_argument("--splits", default="", help="segment counts of the context-parallel split to time as "
                   "extra runners `<backend>@split<n>` (e.g. 2,4,8), with FlashQLA's auto_cp beside them; 'auto': "
                   "on starved grids only, the counts the autotuner tries there")
    p.add_argument("--split-backends", default="fla,tilelang_fused", help="the backends --splits wraps")
    p.add_argument("--only-splits", action="store_true",
                   help="of our backends only the split runners (with the pick and the peers): the starved bench")
    p.add_argument("--gates", default="",
                   help="run every shape once per gate (shapes.GATES: logsigmoid = a trained model's strong decay, "
                        "logsigmoid16 = FlashQLA's benchmark gate, weak decay, mixed = Qwen3-Next's per-head "
                        "A and dt), comma-separated")
    p.add_argument("--compile-jobs", type=int, default=8,
                   help="compile the backends' kernels for every shape first, in this many processes (0: each on "
                        "first use, one after another)")
    p.add_argument("--first-call", action="store_true",
                   help="only the first-call cost at shapes no table holds (default: B2 T4096 H16 Hg8 h=None; "
                        "--grid picks others): wall time, the pick, what was skipped")
    p.add_argument("--first-call-full", action="store_true", help="with --first-call: the full sweep beside it")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--unverified", action="store_true",
                   help="also run backends still refused until their GPU tests pass (their error column then "
                        "is their first large-shape check against the torch backend); marked * in the table")
    args = p.parse_args(argv)
    unverified = []
    if args.unverified:
        os.environ[ALLOW_UNVERIFIED_ENV] = "1"
        unverified = [n for n, b in registered_backends().items() if not b.gpu_verified]
    if not torch.cuda.is_available():
        print("bench needs a CUDA device", file=sys.stderr)
        return 2
    if args.first_call:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(message)s")  # the dispatcher's lines: where the time goes
        shapes = load_grid(args.grid) if args.grid else FIRST_CALL_SHAPES
        rows = [first_call(v, args.first_call_full) for s in shapes for v in s.variants()]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        dev = device_info(torch.device("cuda"))
        (out / f"{dev.slug}-first-call.json").write_text(json.dumps(
            {"device": dev.name, "versions": library_versions(), "rows": rows}, indent=1) + "\n")
        lines = ["| shape | first call s | pick | measured | skipped | full sweep s | full sweep's pick | "
                 "pick's time / full winner's |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['shape']} | {r['first_call_s']} | {r['pick']} | {len(r['measured'])} | "
                         f"{len(r['skipped'])} | {r.get('full_sweep_s', '-')} | {r.get('full_pick', '-')} | "
                         f"{r.get('pick_over_full_winner', '-')} |")
        (out / f"{dev.slug}-first-call.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    shapes = load_grid(args.grid) if args.grid else PRESETS[args.preset]
    if args.h:
        from dataclasses import replace
        shapes = [replace(s, h=args.h) for s in shapes]
    variants = [v for s in shapes for v in s.variants()]
    if args.gates:
        from dataclasses import replace as _replace
        variants = [_replace(v, gate=gate) for v in variants for gate in args.gates.split(",")]
    if args.match:
        variants = [v for v in variants if re.search(args.match, v.label())]
    skip = set(filter(None, args.skip.split(",")))
    splits = "auto" if args.splits == "auto" else [int(n) for n in filter(None, args.splits.split(","))]
    split_backends = [n for n in filter(None, args.split_backends.split(",")) if n not in skip]
    dev = device_info(torch.device("cuda"))
    if args.compile_jobs:
        from gdr_dispatch.cli import precompile

        precompile(variants, torch.device("cuda"), set(registered_backends()) - skip, args.compile_jobs,
                   splits=bool(splits))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": dev.name, "capability": list(dev.capability), "versions": library_versions(),
           "source": args.grid or f"preset {args.preset}", "warmup": args.warmup, "reps": args.reps,
           "floor": {"hbm_gbs": HBM_GBS, "bf16_tflops": BF16_TFLOPS}, "unverified": unverified, "rows": []}
    earlier = []
    if args.merge and (out / f"{dev.slug}.json").exists():
        earlier = json.loads((out / f"{dev.slug}.json").read_text())["rows"]
    fresh = []
    for i, spec in enumerate(variants, 1):
        print(f"[{i}/{len(variants)}] {spec.label()}", file=sys.stderr, flush=True)
        row = bench_shape(spec, args.warmup, args.reps, skip, splits, split_backends, args.rounds, args.only_splits)
        row["measured_at"] = doc["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        fresh.append(row)
        # written after every shape, so a run cut short keeps what it measured
        doc["rows"] = merge_rows(earlier, fresh)
        names = list(dict.fromkeys(n for r in doc["rows"] for n in r["runs"]))
        md = to_markdown(doc["rows"], names, dev.name, unverified)
        (out / f"{dev.slug}.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / f"{dev.slug}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
