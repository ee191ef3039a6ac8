"""What gdr_dispatch adds on the host to a backend's own call (docs/design.md, "The hot path").

    python bench/bench_hot_path.py                    # B4 T4096 H16 and B8 T4096 H32, bf16, K = V = 128, h given and None
    python bench/bench_hot_path.py --profile          # also where the host time goes (torch.profiler, cProfile)

Per shape and h mode, each runner:
  * `dispatched`: `fused_gdr_bwd` as a user calls it (its plan made by the warm-up: a table hit
    or the memoised decision);
  * `via <backend>`: `fused_gdr_bwd` with GDR_BACKEND naming the backend (set around the timing,
    not per call), for the pick and `--backends`;
  * `run <backend>`: the backend's `run` on a call validated outside the timing (no dispatch);
  * `own flash_qla`: FlashQLA's own calls as its own backward makes them (`fused_gdr_h` with
    h=None, `fused_gdr_bwd`, then its `group_reduce_vector` of dq/dk for grouped heads and its
    reverse `chunk_local_cumsum` of dg: the same gradients the contract returns), their inputs
    in its forms made outside the timing;
  * `own tilelang_fused`: our launcher called directly (`ws_bwd_given_h`, after `chunk_states`
    with h=None);
  * `via canned` / `run canned`: a backend that hands back outputs made once, through
    `fused_gdr_bwd` and alone: their difference is `fused_gdr_bwd`'s own Python per call on this
    host, with no launch beside it (registered for the shape's runs: a new registry generation,
    so every runner's first calls make new plans).
Three readings each: `latency_ms` (a sync before and after every call: what a step that waits on
it sees; median), `b2b_ms` (20 calls enqueued, then one sync: mean per call; median of the
rounds), `host_us` (one call's enqueue after a sync, to its return; median of 4 x `--reps` calls
with the runners taking turns call by call, in a shuffled order each round, so the host's drift
and what the runner before left in the CPU's caches fall on all alike;
`host_us_min` their lowest, `host_cpu_us` the median of the calling thread's CPU time over the
same calls (`time.thread_time`: what the host spends, without the time the thread was switched
out), `host_us_alone` the median timed one runner after another). The
Markdown adds, per row, `dispatched` against the pick's own call: the host time it adds (median,
lowest and thread CPU readings), `fused_gdr_bwd` alone (`via canned` against `run canned`, thread
CPU medians) and the latency and back-to-back ratios. The latency and back-to-back readings run
one runner after another (the pick's `dispatched` first); only the host readings take turns.

`--profile`: for each shape, a torch.profiler trace (Chrome JSON) and its `key_averages` table of
20 dispatched calls, 20 of the pick's `run` and 20 of its own call, and a cProfile summary of 200
dispatched calls' host side (`--profile-stack`: Python frames in the trace too).
Writes bench/results/<device>-hot-path.json and .md (`--out` elsewhere). `--device cpu` runs the
plumbing on a CPU (tests/test_bench_scripts.py, with FlashQLA faked).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import random
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch

from gdr_dispatch import Backend, Problem, fused_gdr_bwd, get_backend, registry
from gdr_dispatch import env as gdr_env
from gdr_dispatch.contract import GDRGrads, packed, validate
from gdr_dispatch.dispatch import select_backend
from gdr_dispatch.problem import device_info, library_versions
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs
from timing import back_to_back_ms, host_enqueue_ms, latency_ms

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [ShapeSpec(B=4, T=4096, H=16), ShapeSpec(B=8, T=4096, H=32)]
#: The backends timed beside the pick (through fused_gdr_bwd, their `run`, their own call).
BACKENDS = ("flash_qla", "tilelang_fused")
BACK_TO_BACK = 20


# -- timers ---------------------------------------------------------------------------------------
def syncer(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


# -- runners --------------------------------------------------------------------------------------
@contextlib.contextmanager
def environment(**values):
    """`values` set (None: unset) for the block, as they were afterwards."""
    saved = {n: os.environ.get(n) for n in values}
    for n, v in values.items():
        os.environ.pop(n, None) if v is None else os.environ.__setitem__(n, v)
    try:
        yield
    finally:
        for n, v in saved.items():
            os.environ.pop(n, None) if v is None else os.environ.__setitem__(n, v)


def own_flash_qla(call):
    """FlashQLA's own calls on this call's inputs, converted to its forms here (a and h in q's
    dtype, packed); a reason instead when it does not import."""
    try:
        from flash_qla.ops import utils
        from flash_qla.ops.gated_delta_rule import chunk
    except Exception as e:  # noqa: BLE001 - any import failure: the peer is absent here
        return f"flash_qla does not import: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    dt = call.q.dtype
    q, k, v, g, b, do = (packed(x) for x in (call.q, call.k, call.v, call.g, call.b, call.do))
    a, h = packed(call.a.to(dt)), None if call.h is None else packed(call.h.to(dt))
    h0 = None if call.initial_state is None else packed(call.initial_state.float())
    dht = call.dht
    if dht is None and call.initial_state is not None:
        dht = torch.zeros(call.initial_state.shape, dtype=torch.float32, device=call.q.device)
    dht = packed(dht)

    def run():
        states = h if h is not None else chunk.fused_gdr_h(
            k=k, v=v, a=a, g=g, b=b, initial_state=h0, output_final_state=False, output_h=True,
            cu_seqlens=call.cu_seqlens, state_v_first=call.state_v_first)[0]
        dq, dk, dv, dg, db, dh0 = chunk.fused_gdr_bwd(q=q, k=k, v=v, a=a, g=g, b=b, do=do, dht=dht, h=states,
                                                      scale=call.scale, cu_seqlens=call.cu_seqlens,
                                                      chunk_size=call.chunk_size, state_v_first=call.state_v_first)
        if call.Hg < call.H:  # as its own backward (chunk_gated_delta_rule_bwd) finishes
            dq, dk = utils.group_reduce_vector(dq, call.Hg), utils.group_reduce_vector(dk, call.Hg)
        dg = utils.chunk_local_cumsum(dg, chunk_size=call.chunk_size, reverse=True, cu_seqlens=call.cu_seqlens,
                                      zero_last_chunk=True)
        return dq, dk, dv, dg, db, dh0

    return run


def own_tilelang_fused(call):
    """Our fused kernel's launcher called directly (our state kernel first with h=None)."""
    if call.q.device.type != "cuda":
        return "needs a CUDA device (TileLang kernels)"
    from gdr_dispatch.backends.kernels.tilelang_states import call_states
    from gdr_dispatch.backends.kernels.tilelang_ws_bwd import ws_bwd_given_h

    def run():
        h = call.h if call.h is not None else call_states(call)[0]
        return ws_bwd_given_h(call.q, call.k, call.v, call.do, call.a, call.g, call.b, h, call.dht, call.scale,
                              call.seq_lens, call.chunk_size, call.cu_seqlens,
                              has_h0=call.initial_state is not None, state_v_first=call.state_v_first)

    return run


OWN = {"flash_qla": own_flash_qla, "tilelang_fused": own_tilelang_fused}


class Canned(Backend):
    """Hands back outputs made once: `via canned` against `run canned` is the Python that
    `fused_gdr_bwd` itself spends per call on this host (neither launches anything)."""

    name = "hot_path_canned"
    static_rank = 10 ** 6  # a backstop: it refuses every call GDR_BACKEND does not name it for

    def __init__(self, call):
        self.out = GDRGrads(*(None if x is None else torch.empty_like(x)
                              for x in (call.q, call.k, call.v, call.g, call.b, call.initial_state)))

    def not_supported_reasons(self, problem):
        # a stand-in, never a candidate: a table miss while it is registered must not time it
        return [] if gdr_env.forced_backend_name() == self.name else [f"{self.name}: only where GDR_BACKEND names it"]

    def run(self, call):
        return self.out


def runners(kwargs: dict, pick: str, backends, canned: Canned) -> dict:
    """name -> (a function of no arguments, the environment it runs in) or a reason it does not run;
    `canned` (registered by the caller): its `via` and `run` too."""
    call = validate(**kwargs)
    problem = Problem.from_call(call)
    out = {"dispatched": (lambda: fused_gdr_bwd(**kwargs), {"GDR_BACKEND": None, "GDR_CP": None})}
    for name in dict.fromkeys([pick, *backends]):
        try:
            backend = get_backend(name)
        except ValueError as e:
            out[f"via {name}"] = str(e)
            continue
        ok, why = backend.supported(problem)
        if not ok:
            out[f"via {name}"] = out[f"run {name}"] = f"unsupported: {why}"
        else:
            out[f"via {name}"] = (lambda: fused_gdr_bwd(**kwargs), {"GDR_BACKEND": name, "GDR_CP": None})
            out[f"run {name}"] = (lambda b=backend: b.run(call), {})
        base = name.split("@")[0]
        if base in OWN and not isinstance(out[f"run {name}"], str):
            own = OWN[base](call)
            out[f"own {base}"] = own if isinstance(own, str) else (own, {})
    # last: the GPU idles through its readings, which would raise the next runner's latency
    out["via canned"] = (lambda: fused_gdr_bwd(**kwargs), {"GDR_BACKEND": canned.name, "GDR_CP": None})
    out["run canned"] = (lambda: canned.run(call), {})
    return out


def measure(fn, env: dict, sync, reps: int, rounds: int) -> dict:
    with environment(**env):
        for _ in range(3):  # warm: compiles, the plan, the allocator
            fn()
        sync()
        return {"latency_ms": round(latency_ms(fn, reps, sync), 4),
                "b2b_ms": round(back_to_back_ms(fn, BACK_TO_BACK, 0, sync, rounds), 4),
                "host_us": round(host_enqueue_ms(fn, reps, sync) * 1e3, 1)}


def interleaved_host_us(fns: dict, sync, reps: int) -> dict:
    """name -> (median, lowest, thread CPU median) host us of one call's enqueue, the runners taking
    turns call by call in a shuffled order each round: a host whose speed drifts (a shared machine,
    clock changes) then slows every runner alike, where timing one runner after another reads the
    drift as a difference between them; the lowest reading is the call's cost with the least
    interference."""
    seen = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    order, shuffle = list(fns), random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)  # no runner always follows the same one (whose code and data it would find cached)
        for name in order:
            fn, env = fns[name]
            with environment(**env):
                sync()
                c0, t0 = time.thread_time(), time.perf_counter()
                fn()
                t1, c1 = time.perf_counter(), time.thread_time()
                seen[name].append((t1 - t0) * 1e6)
                cpu[name].append((c1 - c0) * 1e6)
    sync()
    return {name: (round(statistics.median(v), 1), round(min(v), 1), round(statistics.median(cpu[name]), 1))
            for name, v in seen.items()}


def profile(fns: dict, sync, out: Path, stem: str, device: torch.device, with_stack: bool = False) -> list[str]:
    """A torch.profiler trace and table of 20 calls of each of `fns`, and cProfile's summary of 200
    calls of the first; returns the files written. `with_stack`: Python frames in the trace (torch
    2.13's CPU profiler then at times fails to decode an event's name: UnicodeDecodeError)."""
    from torch.profiler import ProfilerActivity, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities, with_stack=with_stack) as prof:
        for name, (fn, env) in fns.items():
            with environment(**env), record_function(name):
                for _ in range(BACK_TO_BACK):
                    fn()
                sync()
    files = [out / f"{stem}-trace.json", out / f"{stem}-profile.txt"]
    prof.export_chrome_trace(str(files[0]))
    text = [prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)]
    name, (fn, env) = next(iter(fns.items()))
    host = cProfile.Profile()
    with environment(**env):
        host.enable()
        for _ in range(200):
            fn()
        host.disable()
        sync()
    buf = io.StringIO()
    pstats.Stats(host, stream=buf).sort_stats("tottime").print_stats(25)
    text.append(f"cProfile, 200 calls of {name} (host side only):\n{buf.getvalue()}")
    files[1].write_text("\n\n".join(text))
    return [str(f) for f in files]


def bench_shape(spec: ShapeSpec, device: torch.device, backends, reps: int, rounds: int,
                out: Optional[Path] = None, with_stack: bool = False) -> dict:
    sync = syncer(device)
    kwargs = call_kwargs(make_inputs(spec, device, seed=1))
    canned = Canned(validate(**kwargs))
    # registered for the whole shape (a new registry generation clears the decisions): the pick
    # is made inside, so the runners below time the backend it names
    with registry.scoped(add=(canned,)):
        with environment(GDR_BACKEND=None, GDR_CP=None):
            fused_gdr_bwd(**kwargs)  # decides (a table hit, else the first call) and makes the plan
            pick = select_backend(Problem.from_call(validate(**kwargs))).backend.name
        row = {"shape": spec.label(), "h": spec.h, "pick": pick, "runs": {}}
        return _bench_runners(row, kwargs, pick, backends, canned, sync, reps, rounds, device, out, with_stack)


def _bench_runners(row, kwargs, pick, backends, canned, sync, reps, rounds, device, out, with_stack) -> dict:
    spec_label = row["shape"]
    fns = runners(kwargs, pick, backends, canned)
    for name, fn in fns.items():
        if isinstance(fn, str):
            row["runs"][name] = {"skipped": fn}
            continue
        try:
            row["runs"][name] = measure(*fn, sync, reps, rounds)
        except Exception as e:  # noqa: BLE001 - a failing runner is reported, the bench goes on
            row["runs"][name] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        print(f"    {name}: {row['runs'][name]}", file=sys.stderr, flush=True)
    ran = {n: fns[n] for n, r in row["runs"].items() if "host_us" in r}
    for name, (us, low, cpu) in interleaved_host_us(ran, sync, 4 * reps).items():  # the runners taking turns
        row["runs"][name]["host_us_alone"] = row["runs"][name]["host_us"]
        row["runs"][name]["host_us"], row["runs"][name]["host_us_min"] = us, low
        row["runs"][name]["host_cpu_us"] = cpu
    print(f"    host us, interleaved (median, lowest, thread CPU median): "
          f"{({n: (row['runs'][n]['host_us'], row['runs'][n]['host_us_min'], row['runs'][n]['host_cpu_us']) for n in ran})}",
          file=sys.stderr, flush=True)
    row["added"] = added(row)
    if out is not None:
        own = f"own {pick.split('@')[0]}"
        chosen = {n: fns[n] for n in ("dispatched", f"run {pick}", own) if not isinstance(fns.get(n, ""), str)}
        stem = f"{device_info(device).slug}-hot-path-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", spec_label)
        try:
            row["profile"] = profile(chosen, sync, out, stem, device, with_stack)
        except Exception as e:  # noqa: BLE001 - the readings stand; the row says the profile failed
            row["profile_failed"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            print(f"    profile failed: {row['profile_failed']}", file=sys.stderr, flush=True)
    return row


def added(row: dict) -> dict:
    """`dispatched` against the pick's own call (else its `run`): host us added (median, lowest,
    thread CPU), `fused_gdr_bwd` alone on the stand-in, latency and back-to-back ratios."""
    runs, pick = row["runs"], row["pick"]
    base_name = next((n for n in (f"own {pick.split('@')[0]}", f"run {pick}") if "latency_ms" in runs.get(n, {})), None)
    mine = runs.get("dispatched", {})
    if base_name is None or "latency_ms" not in mine:
        return {}
    base = runs[base_name]
    more = {k: round(mine[k] - base[k], 1) for k in ("host_us_min", "host_cpu_us") if k in mine and k in base}
    ours = {}
    if "host_cpu_us" in runs.get("via canned", {}) and "host_cpu_us" in runs.get("run canned", {}):
        ours = {"dispatcher_cpu_us": round(runs["via canned"]["host_cpu_us"] - runs["run canned"]["host_cpu_us"], 1)}
    return {"against": base_name, "host_us": round(mine["host_us"] - base["host_us"], 1), **more, **ours,
            "latency_ratio": round(mine["latency_ms"] / base["latency_ms"], 3),
            "b2b_ratio": round(mine["b2b_ms"] / base["b2b_ms"], 3)}


def to_markdown(rows: list, device: str) -> str:
    names = list(dict.fromkeys(n for r in rows for n in r["runs"]))
    lines = [f"Host overhead of fused_gdr_bwd on {device}: latency ms (sync around each call) / back-to-back ms "
             f"(mean of {BACK_TO_BACK} enqueued) / host us (one call's enqueue)", ""]
    head = ["shape", "h", "pick", *names, "added host us", "latency ratio", "b2b ratio"]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [r["shape"].rsplit(" h=", 1)[0], r["h"], r["pick"]]
        for n in names:
            run = r["runs"].get(n, {})
            cells.append(f"{run['latency_ms']:.3f} / {run['b2b_ms']:.3f} / {run['host_us']:.0f}" if "latency_ms" in run
                         else ("failed" if "failed" in run else "-"))
        a = r.get("added", {})
        low = "".join(f", {label} {a[k]:.0f}" for k, label in (("host_us_min", "lowest"), ("host_cpu_us", "thread CPU"))
                      if k in a)
        alone = f"; fused_gdr_bwd alone {a['dispatcher_cpu_us']:.0f}" if "dispatcher_cpu_us" in a else ""
        cells += [f"{a['host_us']:.0f} against {a['against']}{low}{alone}", f"{a['latency_ratio']:.3f}", f"{a['b2b_ratio']:.3f}"] if a \
            else ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = sorted({f"{n}: {v.get('skipped') or v.get('failed')}" for r in rows for n, v in r["runs"].items()
                    if "skipped" in v or "failed" in v})
    if notes:
        lines += ["", "Not run:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help="shapes as B,T,H[,Hg[,K[,V]]] separated by ';' (default: 4,4096,16;8,4096,32)")
    p.add_argument("--h", choices=["given", "none", "both"], default="both")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-states", action="store_true", help="no initial_state and no dht (default: both given)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="timed beside the pick, comma-separated")
    p.add_argument("--reps", type=int, default=50, help="calls per latency and host reading")
    p.add_argument("--rounds", type=int, default=5, help="back-to-back rounds")
    p.add_argument("--profile", action="store_true", help="a torch.profiler trace and summaries per shape")
    p.add_argument("--profile-stack", action="store_true", help="with --profile: Python frames in the trace")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench needs a CUDA device (--device cpu runs its plumbing)", file=sys.stderr)
        return 2
    shapes = SHAPES
    if args.shapes:
        shapes = []
        for text in filter(None, args.shapes.split(";")):
            n = [int(x) for x in text.split(",")]
            shapes.append(ShapeSpec(B=n[0], T=n[1], H=n[2], **dict(zip(("Hg", "K", "V"), n[3:]))))
    shapes = [replace(s, h=args.h, dtype=args.dtype, initial_state=not args.no_states, dht=not args.no_states)
              for s in shapes]
    variants = [v for s in shapes for v in s.variants()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = device_info(device)
    doc = {"device": dev.name, "versions": library_versions(), "reps": args.reps, "rounds": args.rounds,
           "back_to_back": BACK_TO_BACK, "rows": []}
    backends = [n for n in args.backends.split(",") if n]
    for i, spec in enumerate(variants, 1):
        print(f"[{i}/{len(variants)}] {spec.label()}", file=sys.stderr, flush=True)
        row = bench_shape(spec, device, backends, args.reps, args.rounds, out if args.profile else None,
                          args.profile_stack)
        row["measured_at"] = doc["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        doc["rows"].append(row)
        md = to_markdown(doc["rows"], dev.name)  # written after every shape: a run cut short keeps what it has
        (out / f"{dev.slug}-hot-path.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / f"{dev.slug}-hot-path.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
