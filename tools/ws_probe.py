"""The warp-specialised TileLang kernel against the plain one, kernel launchers only (h given).

    python tools/ws_probe.py                      # times both at the bench shapes, prints a table
    python tools/ws_probe.py --only B4T4096H16 --once   # one launch of the ws kernel (for ncu)
    python tools/ws_probe.py --only B8T4096H32 --check --repeat 20   # the race hunt of docs/tilelang_ws.md
    compute-sanitizer --tool racecheck python3 tools/ws_probe.py --only tiny --once --kernel plain
    python tools/ws_probe.py --only B4T4096H16 --timing     # cycles per chunk, per group and phase
    python tools/ws_probe.py --build nofst --check ...       # the same for another build (v9 without frag_stores)
    python tools/ws_probe.py --builds default,nofst          # builds side by side (switches: build_flags)
    python tools/ws_probe.py --builds default --peer         # and FlashQLA in the same rounds
    python tools/ws_probe.py --warm-peer 8 --shapes B4T4096H16,B8T4096H32   # compile for --peer first

Prints median ms (CUDA events, gdr_dispatch.dispatch.measure_ms), us per chunk step (a CTA
walks its sequence's chunks one after another) and the largest relative difference between
the two kernels' outputs; at grouped-head shapes also the launcher's head sum alone (one of
dq/dk), one-pass Triton against torch. docs/tilelang_ws.md keeps the results.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from gdr_dispatch.backends.kernels.tilelang_fused_bwd import fused_bwd_given_h
from gdr_dispatch.backends.kernels.tilelang_ws_bwd import build_flags, ws_bwd_given_h
from gdr_dispatch.dispatch import measure_ms, more_rounds, relative_error
from gdr_dispatch.shapes import ShapeSpec, make_inputs

SHAPES = {
    "tiny": ShapeSpec(B=1, T=200, H=2, h="given"),  # for compute-sanitizer (slow)
    "B1T8192H16": ShapeSpec(B=1, T=8192, H=16, h="given"),
    "B4T4096H16": ShapeSpec(B=4, T=4096, H=16, h="given"),
    "B8T4096H32": ShapeSpec(B=8, T=4096, H=32, h="given"),
    "B16T2048H32": ShapeSpec(B=16, T=2048, H=32, h="given"),
    "varlen8x4096H32Hg16": ShapeSpec(seqlens=(4096,) * 8, H=32, Hg=16, h="given"),
}


def runner(launch, x):
    args = (x["q"], x["k"], x["v"], x["do"], x["a"], x["g"], x["b"], x["h"], x["dht"], x["scale"],
            (x["cu_seqlens"].diff().tolist() if x["cu_seqlens"] is not None else (x["q"].shape[1],) * x["q"].shape[0]),
            64, x["cu_seqlens"])
    return lambda: launch(*args, has_h0=True)


def head_sum_row(name, x) -> dict:
    """The launcher's grouped-head sum alone, for one of dq/dk (it runs twice per call): the
    one-pass Triton kernel against the torch sum into fp32 and cast it replaced (docs/tilelang_ws.md,
    "Next" 3)."""
    from gdr_dispatch.backends.kernels.head_sum import head_sum_triton
    from gdr_dispatch.contract import reduce_value_heads

    B, T, Hg, K = x["q"].shape
    H = x["v"].shape[2]
    per_head = torch.randn(B, T, H, K, device="cuda").to(x["q"].dtype)
    fused = head_sum_triton(per_head, Hg, per_head.dtype)
    ref = reduce_value_heads(per_head, Hg, per_head.dtype, accum=torch.float32)
    return {"shape": name, "head_sum_triton_ms": round(measure_ms(lambda: head_sum_triton(per_head, Hg, per_head.dtype),
                                                                  "cuda", warmup=3, reps=20), 4),
            "head_sum_torch_ms": round(measure_ms(lambda: reduce_value_heads(per_head, Hg, per_head.dtype,
                                                                             accum=torch.float32),
                                                  "cuda", warmup=3, reps=20), 4),
            "max_abs_diff": float((fused.float() - ref.float()).abs().max())}


def peer_runners(x) -> dict:
    """With `--peer`: FlashQLA's `fused_gdr_bwd` alone (issue 12's "FlashQLA fused kernel": its
    per-head dq/dk, dg before its reverse cumsum), and the whole contract call through each
    backend (`@flash_qla`: plus its cumsum and head sums; `@tilelang_ws`: plus validation and
    h's cast), so kernel and backend gaps are both read in one process."""
    import importlib

    from gdr_dispatch.contract import validate
    from gdr_dispatch.registry import get_backend
    from gdr_dispatch.shapes import call_kwargs

    call = validate(**call_kwargs(x))
    chunk = importlib.import_module("flash_qla.ops.gated_delta_rule.chunk")
    dt = x["q"].dtype
    a, h = x["a"].to(dt), x["h"].to(dt)

    def kernel():
        return chunk.fused_gdr_bwd(q=x["q"], k=x["k"], v=x["v"], a=a, g=x["g"], b=x["b"], do=x["do"], dht=x["dht"],
                                   h=h, scale=x["scale"], cu_seqlens=call.cu_seqlens, chunk_size=64,
                                   state_v_first=False)
    return {"flashqla_kernel": kernel,
            "@flash_qla": lambda: get_backend("flash_qla").run(call),
            "@tilelang_ws": lambda: get_backend("tilelang_ws").run(call)}


def phase_table(name, x, spec, launch) -> dict:
    """Run the timing build once (after a warm-up) and print the mean cycles per chunk step that
    each consumer group spends working before, and waiting at, each sync point."""
    from gdr_dispatch.backends.kernels.tilelang_ws_bwd import PHASES, TIMING_SLOTS

    n_seq = len(spec.seq_lens)
    clk = torch.zeros(n_seq * spec.H * 3 * TIMING_SLOTS, dtype=torch.int32, device="cuda")
    fn = runner(lambda *a, **kw: launch(*a, **kw, clk=clk), x)
    fn()
    clk.zero_()
    fn()
    torch.cuda.synchronize()
    c = clk.view(-1, 3, TIMING_SLOTS).double()
    steps = c[:, :, TIMING_SLOTS - 1].clamp(min=1)
    per = (c / steps.unsqueeze(-1)).mean(0)  # [group, slot], cycles per chunk step, mean over CTAs
    groups = ("S", "KV", "A")
    print(f"{name}: cycles per chunk step (mean over {c.shape[0]} CTAs), work | wait before each sync point")
    print("sync point " + "".join(f"{g:>16}" for g in groups))
    table = {}
    for slot in range(PHASES + 1):
        label = "full" if slot == 0 else f"phase {slot}"
        cells = [(per[g, 2 * slot].item(), per[g, 2 * slot + 1].item()) for g in range(3)]
        table[label] = {g: {"work": round(w), "wait": round(t)} for g, (w, t) in zip(groups, cells)}
        print(f"{label:<11}" + "".join(f"{w:>8.0f} |{t:>6.0f}" for w, t in cells))
    loop = [per[g, TIMING_SLOTS - 2].item() for g in range(3)]
    print(f"{'loop':<11}" + "".join(f"{v:>16.0f}" for v in loop))
    return {"shape": name, "cycles_per_step": table, "loop_cycles_per_step": [round(v) for v in loop]}


def summary_table(rows) -> str:
    """Builds (rows) by shapes (columns) in ms with the change against each shape's first build,
    then the peers with our first build's time over theirs: the table docs/tilelang_ws.md keeps
    per session, so it is not copied out of the rows by hand."""
    rows = [r for r in rows if "build" in r or "peer" in r]  # (not the head-sum rows)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    cell = {(r["shape"], r.get("build") or r["peer"]): r for r in rows}
    names = list(dict.fromkeys(r.get("build") or r["peer"] for r in rows))
    first = {}  # each shape's first build, the reference of its column
    for r in rows:
        if "build" in r:
            first.setdefault(r["shape"], r["ws_ms"])
    out = ["| build | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
    for name in names:
        cells = []
        for s in shapes:
            r = cell.get((s, name))
            if r is None:
                cells.append("-")
            elif "build" in r:
                change = 100 * (r["ws_ms"] / first[s] - 1)
                cells.append(f"{r['ws_ms']:.4f}" + ("" if r["ws_ms"] == first[s] else f" ({change:+.1f} %)"))
            else:
                cells.append(f"{r['ms']:.4f} (first build {r['ratio_to_first_build']:.2f}x)")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="one shape name")
    p.add_argument("--once", action="store_true", help="one launch after one warm-up (for ncu, compute-sanitizer)")
    p.add_argument("--kernel", choices=["ws", "plain", "flashqla"], default="ws",
                   help="the kernel --once launches (flashqla: FlashQLA's fused_gdr_bwd, for ncu beside ours)")
    p.add_argument("--repeat", type=int, default=1, help="--check: runs of each kernel (a race moves the error)")
    p.add_argument("--plain", action="store_true", help="also time the plain kernel")
    p.add_argument("--check", action="store_true",
                   help="per-output errors of both kernels against the torch backend, the ws kernel run twice "
                        "(a race moves its error between runs)")
    p.add_argument("--check-kernels", default="ws,plain", help="--check: the kernels checked (ws, plain)")
    p.add_argument("--timing", action="store_true",
                   help="run the timing build: cycles per chunk each consumer group works / waits per phase")
    p.add_argument("--build", default="default",
                   help="the ws build of --once, --check and --timing: 'default' or switches joined by '+' (e.g. "
                        "nofst-nogz; tilelang_ws_bwd.build_flags)")
    p.add_argument("--builds", default=None,
                   help="comma-separated ws builds to time (and --timing) side by side in this process, e.g. "
                        "default,nokfree (default: --build)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the builds this many times, order reversed each round; keep each build's least median")
    p.add_argument("--reps", type=int, default=20, help="timed launches per median")
    p.add_argument("--peer", action="store_true",
                   help="also time FlashQLA's fused kernel and both backends' whole calls in the same rounds "
                        "(needs flash-qla)")
    p.add_argument("--warm-peer", type=int, default=0, metavar="N",
                   help="only compile what --peer runs (FlashQLA's kernels, our backends' builds) for the shapes "
                        "of --only/--shapes, in N processes, and exit: one process per shape otherwise compiles "
                        "FlashQLA's kernels in turn, ~50-80 s each (session 7 lost a shape to it)")
    p.add_argument("--shapes", default=None, help="--warm-peer: shape names, comma- or space-separated")
    p.add_argument("--out", default=None)
    p.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                   help="only print the markdown table of these --out files (one per shape) and exit")
    args = p.parse_args(argv)
    if args.summarize:
        print(summary_table([row for f in args.summarize for row in json.load(open(f))]))
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if args.warm_peer:
        from gdr_dispatch.cli import precompile

        names = (args.shapes or args.only or " ".join(SHAPES)).replace(",", " ").split()
        unknown = [n for n in names if n not in SHAPES]
        if unknown:
            p.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
        precompile([SHAPES[n] for n in names], torch.device("cuda"), {"flash_qla", "tilelang_ws"}, args.warm_peer,
                   splits=False)
        return 0
    rows = []
    launch = functools.partial(ws_bwd_given_h, **build_flags(args.build))
    builds = args.builds.split(",") if args.builds else [args.build]
    for build in builds:
        build_flags(build)  # an unknown switch fails before any kernel runs
    for name, spec in SHAPES.items():
        if args.only and name != args.only:
            continue
        x = make_inputs(spec, "cuda", seed=1)
        ws = runner(launch, x)
        if args.once:
            one = {"ws": lambda: ws, "plain": lambda: runner(fused_bwd_given_h, x),
                   "flashqla": lambda: peer_runners(x)["flashqla_kernel"]}[args.kernel]()
            one()
            torch.cuda.synchronize()
            one()
            torch.cuda.synchronize()
            return 0
        if args.timing:
            for build in builds:
                print(f"build {build}: {build_flags(build)}")
                rows.append({**phase_table(name, x, spec, functools.partial(ws_bwd_given_h, **build_flags(build))),
                             "build": build})
            continue
        if args.check:
            from gdr_dispatch.chunked_math import chunked_backward
            from gdr_dispatch.contract import validate
            from gdr_dispatch.shapes import call_kwargs

            ref = chunked_backward(validate(**call_kwargs(x)))
            names = ("dq", "dk", "dv", "dg", "db", "dh0")
            kernels = {"ws": lambda: ws, "plain": lambda: runner(fused_bwd_given_h, x)}
            for label in args.check_kernels.split(","):
                fn = kernels[label]()
                worst, first = {}, None
                for rep in range(max(2, args.repeat)):
                    out = fn()
                    errs = {n: relative_error(o, r) for n, o, r in zip(names, out, ref) if r is not None}
                    worst = {n: max(worst.get(n, 0.0), e) for n, e in errs.items()}
                    if first is None:
                        first = [o.clone() for o in out if o is not None]
                    else:  # bit-identical reruns expected: the kernels are deterministic
                        moved = max((o - f).abs().max().item() for o, f in zip((o for o in out if o is not None), first))
                        if moved > 0:
                            print(name, label, f"run {rep + 1} differs from run 1 by up to {moved:.3e}", flush=True)
                print(name, label, f"{max(2, args.repeat)} runs, worst error against the torch backend:",
                      {n: f"{e:.2e}" for n, e in worst.items()}, flush=True)
        steps = max(spec.seq_lens) // 64
        fns = {b: runner(functools.partial(ws_bwd_given_h, **build_flags(b)), x) for b in builds}
        peers = peer_runners(x) if args.peer else {}
        fns.update(peers)
        def measure(fn):
            return measure_ms(fn, "cuda", warmup=3, reps=args.reps)

        timed = {b: {"ms": round(measure(fn), 4)} for b, fn in fns.items()}
        more_rounds(fns, timed, args.rounds, measure)  # alternating order, the least median kept
        ref_out = None
        for build in builds:
            fn = fns[build]
            row = {"shape": name, "build": build, **build_flags(build), "ws_ms": timed[build]["ms"]}
            row["ws_us_per_step"] = round(row["ws_ms"] * 1e3 / steps, 2)
            out = fn()
            if ref_out is None:  # the first build's outputs: the others must agree to rounding
                ref_out = out
            else:
                row["max_rel_diff_vs_first"] = float(
                    f"{max(relative_error(u, w) for u, w in zip(out, ref_out) if w is not None):.2e}")
            if args.plain and build == builds[0]:
                plain = runner(fused_bwd_given_h, x)
                row["plain_ms"] = round(measure_ms(plain, "cuda", warmup=3, reps=args.reps), 4)
                b = plain()
                row["max_rel_diff"] = float(f"{max(relative_error(u, w) for u, w in zip(out, b) if w is not None):.2e}")
            rows.append(row)
            print(row, flush=True)
        for label in peers:
            rows.append({"shape": name, "peer": label, "ms": timed[label]["ms"],
                         "ratio_to_first_build": round(timed[builds[0]]["ms"] / timed[label]["ms"], 3)})
            print(rows[-1], flush=True)
        if spec.Hg is not None and spec.Hg < spec.H and not (args.timing or args.check):
            rows.append(head_sum_row(name, x))
            print(rows[-1], flush=True)
        del x
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
