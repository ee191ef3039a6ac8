"""Where a split call's time goes: GPU time against host time, and the top ops.

    python tools/profile_split.py --B 1 --T 32768 --H 4 --segments 16 --backends tilelang_fused,fla

For each backend, unsplit and `<backend>@split<n>`: the median of CUDA-event timings
(gdr_dispatch.autotune.measure_ms), the host time to enqueue one call (no sync inside; when
it is close to the median the call is host-bound), then one torch.profiler pass with the
CUDA kernels' total time and the ops that take the most host and device time (eager, the split
is host-bound at the starved shapes: docs/kernels.md, "The split"). `--graph` also captures each call in a CUDA graph and times its replays
(the time in a training step captured whole, where no launch costs host time) and checks the
replay's gradients against the eager call's. `--parts` times each part of the split alone (replayed),
with the decay plan's share of warm segments (`--pieces 4`: pass 1 with the exact walks in
pieces against whole, per kernel; the levers, pass 1's walks on one stream or two and pass 2
serial, as a prefix or blocked, each the other way beside what runs by default; `--chain-prefetch`: pass 2 with each link's map loaded a step
ahead, beside the plain chain). `--pass1` times pass 1's exact maps alone, fla's kernels
against ours (backends/kernels/segment_maps.py); with GDR_ALLOW_UNVERIFIED=1 in the environment
the splits above run pass 1 on ours (until their GPU tests pass). `--pyprof N` adds a cProfile
of N enqueues of each split call (which Python spends the host time) and the host time of its
graph's `replay()` alone. `--set segment_maps.NUM_STAGES=2` (repeatable) runs with a kernel
module's constant replaced. `--forward 8,16` times the op's forward instead: each provider of
--backends whole and split, and the split forward's parts.
`--peer` times FlashQLA's own whole backward (`chunk_gated_delta_rule_bwd`, h=None) with
`auto_cp` on and off at the shape and gate instead: median, host enqueue and each kernel's time.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from gdr_dispatch.backends.split import SplitBackend  # noqa: E402
from gdr_dispatch.contract import validate  # noqa: E402
from gdr_dispatch.registry import get_backend  # noqa: E402
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs  # noqa: E402
from timing import host_enqueue_ms, measure_ms, relative_error  # noqa: E402


def graph_ms(fn, reps: int):
    """Median replay time of `fn` captured in a CUDA graph (warmed up on a side stream first, as
    torch's capture notes ask), and the largest relative difference of the replay's gradients
    from an eager call's."""
    eager = fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    diff = max((relative_error(o, e) for o, e in zip(out, eager) if e is not None and torch.is_tensor(e)),
               default=0.0) if isinstance(eager, tuple) else 0.0
    return measure_ms(graph.replay, "cuda", warmup=3, reps=reps), diff


def kernel_table(fn, reps: int) -> str:
    """Each CUDA kernel's mean time per call of `fn` over `reps` eager calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / reps, e.count / reps) for e in prof.key_averages()
            if e.device_time_total > 0]
    return "\n".join(f"    {t:8.1f}  x{n:.0f}  {key[:90]}" for key, t, n in sorted(rows, key=lambda r: -r[1]))


def parts(call, segments: int, backend: str, reps: int, skip: str = "") -> None:
    """Each part of `<backend>@split<segments>` alone, replayed from a CUDA graph: the decay plan,
    pass 1's windows and maps, the chains, pass 3's states (our Triton walk) and pass 3's
    backward (h given, and h=None on the backend's own states), and the whole split; with the
    plan's share of warm (segment, head) pairs and their mean window (docs/kernels.md, "The
    split"); then pass 1's kernels each. `skip`: a regular expression; the parts whose names match
    it are not timed."""
    from dataclasses import replace

    from gdr_dispatch import chunked_math as cm
    from gdr_dispatch.backends.kernels import segment_maps as sm
    from gdr_dispatch.backends.kernels import segment_scan as ss
    from gdr_dispatch.backends.split import passes as cp
    from gdr_dispatch.graph_safe import device_constant

    dev = call.q.device
    inner = get_backend(backend)
    segs = cp.segments_of(tuple(call.seq_lens), call.chunk_size, segments)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=call.chunk_size)
    thr = cp.threshold(torch.float32)
    roles = device_constant(segs.roles, torch.int32, dev)
    seg_off = device_constant(segs.seg_offsets, torch.int32, dev)
    need = call.h is None
    plan = sm.decay_plan(seg_call, thr, segs)
    warm = plan[..., 0] > 0
    print(f"{len(segs.lens)} segments of {segs.s} chunks x {call.H} heads: {warm.float().mean().item():.0%} warm, "
          f"mean window {plan[..., 0][warm].float().mean().item() if warm.any() else 0:.1f} chunks; warm per head "
          f"{[round(x, 2) for x in warm.float().mean(0).tolist()]}; exact segments walked in "
          f"{sm.walk_pieces(segs.s)} piece(s)", flush=True)
    M, starts, ends = sm.segment_pieces(seg_call, plan, roles, need, max_chunks=segs.s)
    S0 = None if call.initial_state is None else cm.states_in(call.initial_state, call.state_v_first).float()
    G_end = None if call.dht is None else cm.states_in(call.dht, call.state_v_first).float()
    tf32 = call.q.dtype in (torch.float16, torch.bfloat16)  # as the split's pass 2 takes it
    ss.chain(M, starts, ends, plan, seg_off, segs.max_per_sequence, S0, G_end, tf32=tf32)
    init = starts if need else torch.zeros_like(ends)
    h = sm.segment_states(seg_call, init)
    with_h = replace(seg_call, dht=ends, h=h, initial_state=init)
    no_h = replace(seg_call, dht=ends, h=None, initial_state=init)
    split = SplitBackend(inner, segments)
    steps = {
        "decay plan": lambda: sm.decay_plan(seg_call, thr, segs),
        "pass 1 (windows, exact maps)": lambda: sm.segment_pieces(seg_call, plan, roles, need, max_chunks=segs.s),
        "pass 2 (chains, in place)": lambda: ss.chain(M, starts, ends, plan, seg_off, segs.max_per_sequence, S0, G_end,
                                                      tf32=tf32),
        "pass 3 states (our Triton walk)": lambda: sm.segment_states(seg_call, init),
        f"pass 3 {backend}, h given": lambda: inner.run(with_h),
        f"pass 3 {backend}, h=None": lambda: inner.run(no_h),
        f"{split.name} whole": lambda: split._run(call),
    }

    def lever(fn, *settings):
        """`fn` with each `(module, name, value)` of `settings` set while it runs, in this process only."""
        def run():
            saved = [(mod, name, getattr(mod, name)) for mod, name, _ in settings]
            for mod, name, value in settings:
                setattr(mod, name, value)
            try:
                return fn()
            finally:
                for mod, name, value in saved:
                    setattr(mod, name, value)
        return run

    if ss.PREFETCH:  # the same pass 2 with each link's map loaded when it is used
        steps["pass 2, maps loaded in the step"] = lever(steps["pass 2 (chains, in place)"], (ss, "PREFETCH", False))
    # the levers beside what runs by default, each switched the other way: pass 1's exact walks on
    # one stream or two (segment_maps.CONCURRENT_WALKS), pass 2 as a parallel prefix or blocked
    # (segment_scan.PREFIX, BLOCKED; at their segment counts)
    whole = steps[f"{split.name} whole"]
    two = sm.concurrent_walks(dev)
    walks = ((sm, "CONCURRENT_WALKS", not two), (sm, "CONCURRENT_WALKS_GPU_VERIFIED", True))
    label = "pass 1, walks on one stream" if two else "pass 1, walks on two streams"
    steps[label] = lever(steps["pass 1 (windows, exact maps)"], *walks)
    steps[f"{split.name} whole, {label[8:]}"] = lever(whole, *walks)
    many = segs.max_per_sequence
    serial = ((ss, "PREFIX", False), (ss, "BLOCKED", False))
    for flag, verified, least, label in (("PREFIX", "PREFIX_GPU_VERIFIED", ss.PREFIX_MIN_SEGMENTS, "as a parallel prefix"),
                                         ("BLOCKED", "BLOCKED_GPU_VERIFIED", ss.BLOCKED_MIN_SEGMENTS, "blocked")):
        if many >= least:
            settings = (*serial, (ss, flag, True), (ss, verified, True))
            steps[f"pass 2 {label}"] = lever(steps["pass 2 (chains, in place)"], *settings)
            steps[f"{split.name} whole, pass 2 {label}"] = lever(whole, *settings)
    if ss.use_prefix(many, dev) or ss.use_blocked(many, dev):
        steps["pass 2 serial"] = lever(steps["pass 2 (chains, in place)"], *serial)
    # pass 2 on TMA over the exact links (segment_scan.TMA_CHAIN) switched the other way
    on_tma = tf32 and ss.use_tma_chain(dev)
    tma = ((ss, "TMA_CHAIN", not on_tma), (ss, "TMA_CHAIN_GPU_VERIFIED", True))
    label = "pass 2, 3xTF32 chain" if on_tma else "pass 2 on TMA"
    steps[label] = lever(steps["pass 2 (chains, in place)"], *tma)
    steps[f"{split.name} whole, {label.removeprefix('pass 2').lstrip(', ')}"] = lever(whole, *tma)
    # the decay plan spread over programs per segment (segment_maps.PLAN_SPREAD) switched the other way
    spread = sm.plan_spread(dev)
    settings = ((sm, "PLAN_SPREAD", not spread), (sm, "PLAN_SPREAD_GPU_VERIFIED", True))
    label = "decay plan, one program per segment" if spread else "decay plan spread"
    steps[label] = lever(steps["decay plan"], *settings)
    steps[f"{split.name} whole, {label.removeprefix('decay plan').lstrip(', ')}"] = lever(whole, *settings)
    if sm.walk_pieces(segs.s) > 1:  # the same pass 1 with the exact walks whole, and both per kernel
        steps["pass 1, exact walks whole"] = lever(steps["pass 1 (windows, exact maps)"],
                                                   (sm, "walk_pieces", lambda max_chunks: 1))
        for name in ("pass 1 (windows, exact maps)", "pass 1, exact walks whole"):
            print(f"  {name}, per kernel (us per call):\n" + kernel_table(steps[name], reps), flush=True)
    for name, fn in steps.items():
        if skip and re.search(skip, name):
            continue
        try:
            replay, _ = graph_ms(fn, reps)
            print(f"  {name}: {replay:.4f} ms replayed, {measure_ms(fn, 'cuda', warmup=3, reps=reps):.4f} ms eager",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - a part that cannot run here is the answer
            print(f"  {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    print(f"  the decay plan's kernels (eager, us per call; {'spread' if spread else 'one program per segment'}):",
          flush=True)
    print(kernel_table(steps["decay plan"], reps), flush=True)
    print("  pass 1's kernels (eager, us per call; the two walks overlap on two streams):", flush=True)
    print(kernel_table(steps["pass 1 (windows, exact maps)"], reps), flush=True)
    print("  pass 2's kernels (eager, us per call):", flush=True)
    print(kernel_table(steps["pass 2 (chains, in place)"], reps), flush=True)


def forward_parts(spec: ShapeSpec, segments: str, providers: str, reps: int) -> None:
    """The op's forward (`chunk_gdr_fwd`, no `h` kept, the final state out): each provider whole and
    `<provider>@split<n>` for each of `segments` (comma-separated), per call (a sync around it),
    eager and replayed from a CUDA graph, with its host enqueue; then the split forward's parts
    alone (replayed): the residuals, the plan, pass 1 forwards, the chain, the provider over the
    segments (backends/split/forward.py)."""
    import os

    from gdr_dispatch import clear_caches
    from gdr_dispatch.backends.kernels import segment_maps as sm
    from gdr_dispatch.backends.kernels import segment_scan as ss
    from gdr_dispatch.backends.split import forward as fw
    from gdr_dispatch.backends.split import passes as cp
    from gdr_dispatch.graph_safe import device_constant
    from gdr_dispatch.shapes import log_decay

    gen = torch.Generator().manual_seed(1)
    B, T, H, K = spec.B, spec.T, spec.H, spec.K
    q = torch.randn(B, T, H, K, generator=gen).cuda().bfloat16()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).cuda().bfloat16()
    v = torch.randn(B, T, H, K, generator=gen).cuda().bfloat16()
    g = log_decay(spec, gen).float().cuda()
    beta = torch.rand(B, T, H, generator=gen).cuda().bfloat16()
    h0 = torch.randn(B, H, K, K, generator=gen).cuda()

    def op():
        return torch.ops.gdr_dispatch.chunk_gdr_fwd(q, k, v, g, beta, h0, None, K ** -0.5, True, False, False)

    for provider in providers.split(","):
        for name in [provider] + [f"{provider}@split{n}" for n in segments.split(",")]:
            os.environ["GDR_FORWARD"] = name
            clear_caches()
            try:
                eager = measure_ms(op, "cuda", warmup=3, reps=reps)  # (a split replays its graph from call 2)
                os.environ["GDR_SPLIT_GRAPHS"] = "0"
                plain = measure_ms(op, "cuda", warmup=2, reps=reps)
                enqueue = host_enqueue_ms(op, reps)
                os.environ.pop("GDR_SPLIT_GRAPHS")
                replay, _ = graph_ms(op, reps)
                print(f"  forward {name}: {eager:.4f} ms as the op runs it, {plain:.4f} ms eager (host enqueue "
                      f"{enqueue:.4f}), {replay:.4f} ms replayed", flush=True)
            except Exception as e:  # noqa: BLE001 - a forward that cannot run here is the answer
                print(f"  forward {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            os.environ.pop("GDR_SPLIT_GRAPHS", None)
    os.environ.pop("GDR_FORWARD", None)
    provider = get_backend(providers.split(",")[0])
    n = int(segments.split(",")[0])
    segs = cp.segments_of((T,) * B, 64, n)
    offsets = device_constant(segs.token_offsets, torch.int32, q.device)
    fq, fk, fv, fg, fb = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    G, a = fw.residuals(fq, fk, fv, fg, fb, offsets, 64)
    a = a.to(q.dtype)
    seg_call = validate(fq, fk, fv, a, G, fb, fv, scale=K ** -0.5, cu_seqlens=offsets, chunk_size=64)
    roles = device_constant(segs.roles, torch.int32, q.device)
    seg_off = device_constant(segs.seg_offsets, torch.int32, q.device)
    thr = cp.threshold(torch.float32)
    plan = sm.decay_plan(seg_call, thr, segs)
    M, starts, _ = sm.segment_pieces(seg_call, plan, roles, True, False, segs.s)
    init = starts.clone()
    steps = {
        "residuals (fla: cumsum, KK^T, solve)": lambda: fw.residuals(fq, fk, fv, fg, fb, offsets, 64),
        "decay plan": lambda: sm.decay_plan(seg_call, thr, segs),
        "pass 1 forwards": lambda: sm.segment_pieces(seg_call, plan, roles, True, False, segs.s),
        "chain forwards": lambda: ss.chain(M, starts, None, plan, seg_off, segs.max_per_sequence, h0.float(), None),
        f"{provider.name} over the segments": lambda: provider.forward(fq, fk, fv, fg, fb, K ** -0.5, init, offsets,
                                                                       False, True, 64, need_states=False),
        f"{provider.name} whole": lambda: provider.forward(q, k, v, g, beta, K ** -0.5, h0, None, False, True, 64,
                                                          need_states=False),
    }
    print(f"  parts of {provider.name}@split{n} ({len(segs.lens)} segments):", flush=True)
    for name, fn in steps.items():
        try:
            replay, _ = graph_ms(fn, reps)
            print(f"    {name}: {replay:.4f} ms replayed, {measure_ms(fn, 'cuda', warmup=3, reps=reps):.4f} ms eager, "
                  f"host enqueue {host_enqueue_ms(fn, reps):.4f}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"    {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


def pass1_configs(call, segments: int, configs: str, reps: int) -> None:
    """Pass 1 alone on the segments of one split call: fla's kernels (stage 1, the state and dh
    passes) against ours (backends/kernels/segment_maps.py, under each `BC,WARPS,STAGES` of `configs`
    beside the shipped one): median ms, host enqueue ms, and how far our maps are from fla's (M
    against the identity's size, R and D relative; both round their products' operands to 16
    bits, so ~1e-3 apart is agreement and O(1) a bug)."""
    from gdr_dispatch.backends.split import passes as cp
    from gdr_dispatch.backends.kernels import segment_maps as sm
    from gdr_dispatch.backends.common import fla_pipeline

    segs = cp.segments_of(tuple(call.seq_lens), call.chunk_size, segments)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=call.chunk_size)
    need_r = call.h is None
    ref = fla_pipeline.segment_maps(seg_call, need_r=need_r)
    fla_ms = measure_ms(lambda: fla_pipeline.segment_maps(seg_call, need_r=need_r), "cuda", warmup=3, reps=reps)
    print(f"pass 1 on fla's kernels: {fla_ms:.4f} ms, host enqueue "
          f"{host_enqueue_ms(lambda: fla_pipeline.segment_maps(seg_call, need_r=need_r), reps):.3f} ms", flush=True)
    eye = torch.eye(call.K, device=ref[0].device).expand_as(ref[0])
    shipped = (sm.BC, sm.NUM_WARPS, sm.NUM_STAGES, sm.FACTOR_WARPS)
    factors = (sm.FACTORS, sm.FACTORS_GPU_VERIFIED)
    runs = [((*cfg, *shipped[len(cfg):]), f)
            for cfg in [shipped] + [tuple(int(x) for x in c.split(",")) for c in filter(None, configs.split("/"))]
            for f in (False, True)]
    for cfg, factored in runs:
        sm.BC, sm.NUM_WARPS, sm.NUM_STAGES, sm.FACTOR_WARPS = cfg
        sm.FACTORS, sm.FACTORS_GPU_VERIFIED = factored, True
        cfg = (*cfg[:3], f"walks read the factors ({cfg[3]} warps)" if factored else "walks form the chunks")
        try:
            got = sm.segment_maps(seg_call, need_r=need_r)
            far = {what: f"{((g - w).norm() / (eye.norm() if what == 'M' else w.norm())).item():.1e}"
                   for g, w, what in zip(got, ref, "MRD") if w is not None}
            ms = measure_ms(lambda: sm.segment_maps(seg_call, need_r=need_r), "cuda", warmup=3, reps=reps)
            enqueue = host_enqueue_ms(lambda: sm.segment_maps(seg_call, need_r=need_r), reps)
            print(f"pass 1 on our kernels BC={cfg[0]} warps={cfg[1]} stages={cfg[2]}, {cfg[3]}: {ms:.4f} ms, host enqueue "
                  f"{enqueue:.3f} ms, from fla's maps {far}", flush=True)
            print(kernel_table(lambda: sm.segment_maps(seg_call, need_r=need_r), reps), flush=True)
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile is the answer
            print(f"pass 1 on our kernels {cfg}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    sm.BC, sm.NUM_WARPS, sm.NUM_STAGES, sm.FACTOR_WARPS = shipped
    sm.FACTORS, sm.FACTORS_GPU_VERIFIED = factors


def peer_backward(spec: ShapeSpec, reps: int) -> None:
    """FlashQLA's whole backward on the shape's inputs (its chunk_gated_delta_rule_bwd, as the
    starved bench calls it), `auto_cp` on and off: where its time goes, kernel by kernel."""
    from bench_gdr_bwd import flashqla_runner

    x = make_inputs(spec, "cuda", seed=1)  # as bench_gdr_bwd hands its runners the inputs
    for auto_cp in (True, False):
        run = flashqla_runner(x, auto_cp=auto_cp)
        if run is None:
            return
        label = f"FlashQLA's backward, auto_cp={auto_cp}, {spec.label()}"
        print(f"{label}: median {measure_ms(run, 'cuda', warmup=3, reps=reps):.4f} ms, host enqueue "
              f"{host_enqueue_ms(run, reps):.4f} ms", flush=True)
        print(kernel_table(run, reps), flush=True)


def replay_report(reps: int) -> None:
    """The host time of each kept split graph's `replay()` alone (the GPU drained before each),
    against the whole call's host enqueue above."""
    import statistics
    import time

    from gdr_dispatch.backends.split import graphs

    kept = list(graphs._graphs.items()) + list(graphs._placed.items())
    for key, (graph, *_rest) in kept:
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            out.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        name = key[0][0] if isinstance(key[0], tuple) else key[0]
        print(f"graph {name}: replay() host {statistics.median(out):.3f} ms median, {min(out):.3f} lowest",
              flush=True)


def set_constant(p: argparse.ArgumentParser, assignment: str) -> None:
    """`--set MODULE.NAME=VALUE`: an existing module constant replaced for this process (a lever's
    other setting timed without editing the module)."""
    import ast
    import importlib

    target, _, text = assignment.partition("=")
    module, _, name = target.rpartition(".")
    for package in ("gdr_dispatch.backends.kernels", "gdr_dispatch.backends.split"):
        try:
            mod = importlib.import_module(f"{package}.{module}")
            break
        except ImportError:
            continue
    else:
        p.error(f"--set {assignment}: no module {module!r} in backends/kernels or backends/split")
    if not name or not hasattr(mod, name):
        p.error(f"--set {assignment}: {mod.__name__} has no {name!r}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        p.error(f"--set {assignment}: {text!r} is not a Python literal")
    print(f"--set: {mod.__name__}.{name} = {value!r} (was {getattr(mod, name)!r})", flush=True)
    setattr(mod, name, value)


def python_profile(fn, n: int) -> None:
    """cProfile over `n` enqueues (the GPU drained before each, as `host_enqueue_ms`): the functions with
    the most own time and the most time inside them, per call."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(25)
        print(f"Python profile of {n} enqueues, by {key} (seconds are totals over the {n}):\n"
              + out.getvalue().split("\n\n", 1)[-1], flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--seqlens", default="", help="a varlen pack instead of --B/--T: the lengths, comma-separated")
    p.add_argument("--h", choices=["given", "none"], default="given")
    p.add_argument("--segments", type=int, default=16)
    p.add_argument("--backends", default="tilelang_fused,fla")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--graph", action="store_true", help="also time each call's CUDA-graph replay")
    p.add_argument("--gate", default="uniform", help="the shape's gate (shapes.GATES)")
    p.add_argument("--parts", action="store_true",
                   help="time each part of the split around the first of --backends (graph replays), then stop")
    p.add_argument("--skip", default="", metavar="REGEX",
                   help="--parts: leave out the parts whose names match REGEX (e.g. 'prefix|TMA')")
    p.add_argument("--pieces", type=int, default=0, metavar="N",
                   help="--parts: walk the exact segments in N pieces (segment_maps.PIECES), and time pass 1 "
                        "both ways, per kernel")
    p.add_argument("--compose-cb", type=int, default=0, metavar="N",
                   help="--parts --pieces: the compositions over N columns per work item (segment_maps.COMPOSE_CB)")
    p.add_argument("--chain-prefetch", action="store_true",
                   help="--parts: pass 2 with each exact link's map loaded a step ahead (segment_scan.PREFETCH), "
                        "timed beside the plain chain")
    p.add_argument("--pyprof", type=int, default=0, metavar="N",
                   help="also profile N enqueues of each split call in Python (cProfile: where its host time goes)")
    p.add_argument("--pass1", nargs="?", const="", default=None,
                   help="time pass 1 alone, fla's kernels against ours (backends/kernels/segment_maps.py) under the "
                        "shipped and these 'BC,WARPS,STAGES[,FACTOR_WARPS]' configurations ('/'-separated), each "
                        "with the walks forming their chunks and reading the factors, then stop")
    p.add_argument("--forward", default=None, metavar="COUNTS",
                   help="the op's forward instead: each of --backends (forward providers) whole and split in these "
                        "segment counts (comma-separated), then the split forward's parts; then stop")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a kernel module's constant for this run (a module of gdr_dispatch.backends.kernels or "
                        "gdr_dispatch.backends.split, e.g. segment_maps.NUM_STAGES=2; a Python literal), repeatable")
    p.add_argument("--peer", action="store_true",
                   help="FlashQLA's own whole backward (h=None) with auto_cp on and off at this shape and gate, "
                        "kernel by kernel; then stop")
    a = p.parse_args()
    for assignment in a.set:
        set_constant(p, assignment)

    def spec(h: str) -> ShapeSpec:
        if a.seqlens:
            return ShapeSpec(seqlens=tuple(int(n) for n in a.seqlens.split(",")), H=a.H, h=h, gate=a.gate)
        return ShapeSpec(B=a.B, T=a.T, H=a.H, h=h, gate=a.gate)

    if a.peer:
        peer_backward(spec("none"), a.reps)
        return 0
    if a.forward:
        if a.seqlens:
            p.error("--forward times one dense sequence (--B, --T); --seqlens is for the backward's parts and --peer")
        forward_parts(spec("given"), a.forward, a.backends, a.reps)
        return 0
    call = validate(**call_kwargs(make_inputs(spec(a.h), "cuda", seed=1)))
    if a.chain_prefetch:
        from gdr_dispatch.backends.kernels import segment_scan

        segment_scan.PREFETCH = True
    if a.pieces or a.compose_cb:
        from gdr_dispatch.backends.kernels import segment_maps

        segment_maps.PIECES = a.pieces or segment_maps.PIECES
        segment_maps.COMPOSE_CB = a.compose_cb or segment_maps.COMPOSE_CB
    if a.parts:
        parts(call, a.segments, a.backends.split(",")[0], a.reps, a.skip)
        return 0
    if a.pass1 is not None:
        pass1_configs(call, a.segments, a.pass1, a.reps)
        return 0
    for name in a.backends.split(","):
        inner = get_backend(name)
        for label, backend in ((name, inner), (f"{name}@split{a.segments}", SplitBackend(inner, a.segments))):
            def fn(backend=backend):
                return backend.run(call)
            ms = measure_ms(fn, "cuda", warmup=3, reps=a.reps)
            enqueue = host_enqueue_ms(fn, a.reps)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            events = prof.key_averages()
            # kernels and copies only (an op's own row repeats its kernels' time)
            gpu = sum(e.self_device_time_total for e in events if e.device_type != torch.autograd.DeviceType.CPU) / 1e3
            print(f"{label}: median {ms:.3f} ms, host enqueue {enqueue:.3f} ms, GPU kernels {gpu:.3f} ms", flush=True)
            if a.graph:
                try:
                    replay, diff = graph_ms(fn, a.reps)
                    print(f"{label}: CUDA-graph replay {replay:.3f} ms (gradients {diff:.1e} from eager)", flush=True)
                except Exception as e:  # noqa: BLE001 - a call that cannot be captured is the answer
                    print(f"{label}: CUDA-graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                          flush=True)
            if a.pyprof and backend is not inner:
                python_profile(fn, a.pyprof)
                replay_report(a.reps)
            print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60), flush=True)
            print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
