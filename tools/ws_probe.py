"""The warp-specialised TileLang backward's launcher alone (h given), beside FlashQLA's fused kernel.

    python tools/ws_probe.py --peer --rounds 3               # both kernels at the bench shapes, in turn
    python tools/ws_probe.py --only B4T4096H16 --once        # one launch of ours (for ncu; --kernel flashqla)
    python tools/ws_probe.py --only B8T4096H32 --check --repeat 20   # errors against torch, reruns bit for bit
    compute-sanitizer --tool racecheck python3 tools/ws_probe.py --only tiny --once
    python tools/ws_probe.py --only B4T4096H16 --timing      # cycles per chunk step, per group and phase
    python tools/ws_probe.py --only B1T8192H16 --timing --mode reconly   # a prototype build's cycles (wrong results)
    python tools/ws_probe.py --only B1T8192H16 --mode reconly            # its wall time (plain build)
    python tools/ws_probe.py --warm-peer 8 --shapes B4T4096H16,B8T4096H32   # compile for --peer first
    python tools/ws_probe.py --only B4T4096H16 --colsums warp,transpose [--timing] [--check]  # two forms, one process
    python tools/ws_probe.py --only B8T4096H32 --colsums warp,warp+gam+row --rounds 3   # tilelang_ws_bwd.HOIST's words off / on
    python tools/ws_probe.py --only B4T4096H16 --colsums warp,warp+row --rounds 6 --b2b  # the same, GPU time

Prints median ms (CUDA events, gdr_dispatch.autotune.measure_ms; with --b2b back to back), us per
chunk step (a CTA walks its sequence's chunks one after another); at grouped-head shapes also the
launcher's head sum alone. docs/kernels.md keeps the results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from gdr_dispatch.backends.kernels.tilelang_ws_bwd import (COLSUMS_FORMS, FORM, HOIST_WORDS, MODES,  # noqa: E402
                                                           form_keywords, ws_bwd_given_h)
from gdr_dispatch.shapes import ShapeSpec, make_inputs  # noqa: E402
from timing import back_to_back_ms, measure_ms, more_rounds, relative_error  # noqa: E402

SHAPES = {
    "tiny": ShapeSpec(B=1, T=200, H=2, h="given"),  # for compute-sanitizer (slow)
    "B1T8192H16": ShapeSpec(B=1, T=8192, H=16, h="given"),
    "B4T4096H16": ShapeSpec(B=4, T=4096, H=16, h="given"),
    "B8T4096H32": ShapeSpec(B=8, T=4096, H=32, h="given"),
    "B16T2048H32": ShapeSpec(B=16, T=2048, H=32, h="given"),
    "varlen8x4096H32Hg16": ShapeSpec(seqlens=(4096,) * 8, H=32, Hg=16, h="given"),
}


def runner(x, **kw):
    args = (x["q"], x["k"], x["v"], x["do"], x["a"], x["g"], x["b"], x["h"], x["dht"], x["scale"],
            (x["cu_seqlens"].diff().tolist() if x["cu_seqlens"] is not None else (x["q"].shape[1],) * x["q"].shape[0]),
            64, x["cu_seqlens"])
    return lambda: ws_bwd_given_h(*args, has_h0=True, **kw)


def head_sum_row(name, x) -> dict:
    """The launcher's grouped-head sum alone, for one of dq/dk (it runs twice per call): the
    one-pass Triton kernel against the torch sum into fp32 and a cast."""
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
    """FlashQLA's `fused_gdr_bwd` alone (per-head dq/dk, dg before its reverse cumsum), and the
    whole contract call through each backend (`@flash_qla`: plus its cumsum and head sums;
    `@tilelang_fused`: plus validation and h's cast): kernel and backend gaps in one process."""
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
            "@tilelang_fused": lambda: get_backend("tilelang_fused").run(call)}


def valid_form(form: str) -> bool:
    try:
        form_keywords(form)
    except ValueError:
        return False
    return True


def variant(form: str) -> str:
    return "" if form_keywords(form) == form_keywords(FORM) else f" {form}"


def phase_table(name, x, spec, mode: str = "full", colsums: str = FORM) -> dict:
    """Run the timing build once (after a warm-up) and print the mean cycles per chunk step that
    each consumer group spends working before, and waiting at, each sync point."""
    from gdr_dispatch.backends.kernels.tilelang_ws_bwd import PHASES, TIMING_SLOTS

    n_seq = len(spec.seq_lens)
    clk = torch.zeros(n_seq * spec.H * 3 * TIMING_SLOTS, dtype=torch.int32, device="cuda")
    fn = runner(x, clk=clk, mode=mode, **form_keywords(colsums))
    fn()
    clk.zero_()
    fn()
    torch.cuda.synchronize()
    c = clk.view(-1, 3, TIMING_SLOTS).double()
    steps = c[:, :, TIMING_SLOTS - 1].clamp(min=1)
    per = (c / steps.unsqueeze(-1)).mean(0)  # [group, slot], cycles per chunk step, mean over CTAs
    groups = ("S", "KV", "A")
    print(f"{name}{'' if mode == 'full' else f' ({mode} build)'}{variant(colsums)}: cycles per chunk step (mean over {c.shape[0]} "
          f"CTAs), work | wait before each sync point")
    print("sync point " + "".join(f"{g:>16}" for g in groups))
    table = {}
    for slot in range(PHASES + 1):
        label = "full" if slot == 0 else f"phase {slot}"
        cells = [(per[g, 2 * slot].item(), per[g, 2 * slot + 1].item()) for g in range(3)]
        table[label] = {g: {"work": round(w), "wait": round(t)} for g, (w, t) in zip(groups, cells)}
        print(f"{label:<11}" + "".join(f"{w:>8.0f} |{t:>6.0f}" for w, t in cells))
    loop = [per[g, TIMING_SLOTS - 2].item() for g in range(3)]
    print(f"{'loop':<11}" + "".join(f"{v:>16.0f}" for v in loop))
    return {"shape": name, "mode": mode, "colsums": colsums, "cycles_per_step": table,
            "loop_cycles_per_step": [round(v) for v in loop]}


def check(name, x, repeat: int, colsums: str = FORM) -> None:
    """Per-output errors against the torch backend over `repeat` runs, and whether reruns are
    bit-identical (a race moves the result between runs)."""
    from gdr_dispatch.chunked_math import chunked_backward
    from gdr_dispatch.contract import validate
    from gdr_dispatch.shapes import call_kwargs

    ref = chunked_backward(validate(**call_kwargs(x)))
    names = ("dq", "dk", "dv", "dg", "db", "dh0")
    fn = runner(x, **form_keywords(colsums))
    worst, first = {}, None
    for rep in range(max(2, repeat)):
        out = fn()
        errs = {n: relative_error(o, r) for n, o, r in zip(names, out, ref) if r is not None}
        worst = {n: max(worst.get(n, 0.0), e) for n, e in errs.items()}
        if first is None:
            first = [o.clone() for o in out if o is not None]
        else:
            moved = max((o - f).abs().max().item() for o, f in zip((o for o in out if o is not None), first))
            if moved > 0:
                print(name, f"run {rep + 1} differs from run 1 by up to {moved:.3e}", flush=True)
    print(name + variant(colsums), f"{max(2, repeat)} runs, worst error against the torch backend:",
          {n: f"{e:.2e}" for n, e in worst.items()}, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="one shape name")
    p.add_argument("--once", action="store_true",
                   help="one launch after one warm-up (for ncu, compute-sanitizer), of --colsums' first form")
    p.add_argument("--kernel", choices=["ws", "flashqla"], default="ws",
                   help="the kernel --once launches (flashqla: FlashQLA's fused_gdr_bwd, for ncu beside ours)")
    p.add_argument("--check", action="store_true", help="errors against the torch backend, reruns compared")
    p.add_argument("--repeat", type=int, default=2, help="--check: runs (a race moves the error)")
    p.add_argument("--timing", action="store_true",
                   help="run the timing build: cycles per chunk each consumer group works / waits per phase")
    p.add_argument("--rounds", type=int, default=1, help="timing rounds, order reversed each round; least median kept")
    p.add_argument("--reps", type=int, default=20, help="timed launches per median")
    p.add_argument("--b2b", action="store_true",
                   help="time GPU time instead: --reps launches enqueued back to back, one sync (the median of "
                        "three such windows; the launches' host time hidden), each round's reading printed")
    p.add_argument("--peer", action="store_true",
                   help="also time FlashQLA's fused kernel and both backends' whole calls in the same rounds")
    p.add_argument("--warm-peer", type=int, default=0, metavar="N",
                   help="only compile what --peer runs (FlashQLA's kernels, ours) for the shapes of --only/--shapes, "
                        "in N processes, and exit")
    p.add_argument("--shapes", default=None, help="--warm-peer: shape names, comma- or space-separated")
    p.add_argument("--mode", default="full", choices=MODES,
                   help="a prototype build of ours (tilelang_ws_bwd.MODES; wrong results: --timing's cycles and "
                        "the wall time only, no --check, no --peer)")
    p.add_argument("--colsums", default=FORM,
                   help=f"comma-separated builds to run side by side: a form of A's column sums "
                        f"({', '.join(COLSUMS_FORMS)}), each optionally +{'/+'.join(HOIST_WORDS)} (tilelang_ws_bwd.HOIST); "
                        f"the kernel's is {FORM}")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.mode != "full" and (args.check or args.peer or args.kernel != "ws"):
        p.error("--mode: a prototype build's results are wrong; it runs alone (no --check, --peer, --kernel)")
    if args.only and args.only not in SHAPES:
        p.error(f"--only: unknown shape {args.only!r}; known: {', '.join(SHAPES)}")
    forms = args.colsums.replace(",", " ").split()
    if not forms or not all(map(valid_form, forms)):
        p.error(f"--colsums: expected forms of {COLSUMS_FORMS}, each optionally +{'/+'.join(HOIST_WORDS)}, "
                f"got {args.colsums!r}")
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if args.warm_peer:
        from gdr_dispatch.cli import precompile

        names = (args.shapes or args.only or " ".join(SHAPES)).replace(",", " ").split()
        unknown = [n for n in names if n not in SHAPES]
        if unknown:
            p.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
        precompile([SHAPES[n] for n in names], torch.device("cuda"), {"flash_qla", "tilelang_fused"}, args.warm_peer,
                   splits=False)
        return 0
    rows = []
    for name, spec in SHAPES.items():
        if args.only and name != args.only:
            continue
        x = make_inputs(spec, "cuda", seed=1)
        if args.once:
            one = runner(x, mode=args.mode, **form_keywords(forms[0])) if args.kernel == "ws" else peer_runners(x)["flashqla_kernel"]
            one()
            torch.cuda.synchronize()
            one()
            torch.cuda.synchronize()
            return 0
        if args.timing:
            rows.extend(phase_table(name, x, spec, args.mode, f) for f in forms)
            continue
        if args.check:
            for f in forms:
                check(name, x, args.repeat, f)
        steps = max(spec.seq_lens) // 64
        base = "ws" if args.mode == "full" else f"ws {args.mode}"
        fns = {**{base + variant(f): runner(x, mode=args.mode, **form_keywords(f)) for f in forms},
               **(peer_runners(x) if args.peer else {})}

        def measure(fn):
            if args.b2b:  # GPU time: what two builds of one kernel differ by, without the host's spread
                return back_to_back_ms(fn, n=args.reps, warmup=3)
            return measure_ms(fn, "cuda", warmup=3, reps=args.reps)

        timed = {b: {"ms": round(measure(fn), 4)} for b, fn in fns.items()}
        more_rounds(fns, timed, args.rounds, measure)  # alternating order, the least median kept
        for label in fns:
            row = {"shape": name, "runner": label, "ms": timed[label]["ms"],
                   "us_per_step": round(timed[label]["ms"] * 1e3 / steps, 2),
                   **({"timed": "back to back"} if args.b2b else {}),
                   **({"ms_rounds": timed[label]["ms_rounds"]} if "ms_rounds" in timed[label] else {})}
            if label != "ws" and "ws" in timed:
                row["ws_over_this"] = round(timed["ws"]["ms"] / timed[label]["ms"], 3)
            rows.append(row)
            print(row, flush=True)
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
