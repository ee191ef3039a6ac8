"""The chunk-start states `h` (the `h=None` recompute) side by side, on a GPU: our TileLang
kernel (backends/kernels/tilelang_states.py), fla's stages 1-2 (what the fla-based backends
run), and FlashQLA's `fused_gdr_h` where flash-qla is installed, in one process. Each runner per
call (median of CUDA-event timings, each call synchronised: the launcher's host work inside) and
queued (calls back to back between two events: the GPU's time when the host runs ahead), in
`--rounds` rounds, the least kept; each runner's `h` against ours (relative Frobenius).

    python bench/bench_states.py                       # the saturated training shapes
    python bench/bench_states.py --match B8 --no-peer --out bench/results/states.json
    python bench/bench_states.py --match B8 --no-peer --timing   # where a chunk step's cycles go
    compute-sanitizer --tool racecheck python bench/bench_states.py --tiny

Writes JSON and a markdown table (`--out`, `.md` beside it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from gdr_dispatch.contract import validate
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs
from timing import back_to_back_ms, measure_ms

SHAPES = {
    "B8 T4096 H32": ShapeSpec(B=8, T=4096, H=32, K=128, V=128, h="none"),
    "B16 T2048 H32": ShapeSpec(B=16, T=2048, H=32, K=128, V=128, h="none"),
    "varlen 8x4096 H32 Hg16": ShapeSpec(seqlens=(4096,) * 8, H=32, Hg=16, K=128, V=128, h="none"),
    "B4 T4096 H16": ShapeSpec(B=4, T=4096, H=16, K=128, V=128, h="none"),
}


def runners(call, peer: bool) -> dict:
    from gdr_dispatch.backends.common import fla_pipeline
    from gdr_dispatch.backends.kernels.tilelang_states import call_states

    out = {"tilelang_states": lambda: call_states(call)[0]}  # the reference the others' h is compared with
    out["fla stages 1-2"] = lambda: fla_pipeline.recompute_states(call)
    if peer:
        try:
            from flash_qla.ops.gated_delta_rule import chunk as fq
        except ImportError as e:
            print(f"FlashQLA left out: {e}", flush=True)
        else:
            a = call.a.to(call.q.dtype)
            h0 = None if call.initial_state is None else call.initial_state.float()
            out["flashqla fused_gdr_h"] = lambda: fq.fused_gdr_h(
                k=call.k, v=call.v, a=a, g=call.g, b=call.b, initial_state=h0, output_final_state=False,
                output_h=True, cu_seqlens=call.cu_seqlens, state_v_first=call.state_v_first)[0]
    return out


def timing(call) -> str:
    """The timing build on `call`: per role group, the mean over CTAs of its cycles per chunk at
    each mark (`tilelang_states.TIMING_NAMES`: the work before and the wait at each barrier)."""
    from gdr_dispatch.backends.kernels import tilelang_states as ts

    NS, groups = ts.TIMING_SLOTS, list(ts.TIMING_NAMES)
    clk = torch.zeros(call.N * call.H * len(groups) * NS, dtype=torch.int32, device="cuda")
    for _ in range(2):  # the first call compiles; the second counts alone
        clk.zero_()
        ts.call_states(call, clk=clk)
    torch.cuda.synchronize()
    c = clk.view(-1, len(groups), NS).double()
    per_chunk = (c[..., :NS - 1] / c[..., NS - 1:].clamp(min=1)).mean(0)  # [groups, slots]
    lines = [f"cycles per chunk step (mean over {c.shape[0]} CTAs)"]
    for i, g in enumerate(groups):
        parts = "  ".join(f"{name} {per_chunk[i, j]:.0f}" for j, name in enumerate(ts.TIMING_NAMES[g]))
        lines.append(f"{g:9s} {parts}  | loop {per_chunk[i, NS - 2]:.0f}")
    return "\n".join(lines)


def tiny() -> int:
    """One small call (varlen 1/63/64/65/200, grouped heads, both state layouts) run once, its
    `h` against make_inputs' float64 walk: the run for compute-sanitizer (racecheck, synccheck).
    The last sequence starts at token 193, off the 16-byte grid: its g and b take the plain loads."""
    from dataclasses import replace

    from gdr_dispatch.backends.kernels.tilelang_states import call_states

    base = ShapeSpec(seqlens=(1, 63, 64, 65, 200), H=2, Hg=1, K=128, V=128, h="given")
    for spec in (base, replace(base, state_v_first=True)):
        inputs = make_inputs(spec, "cuda")
        call = validate(**{**call_kwargs(inputs), "h": None})
        h, _ = call_states(call)
        want = inputs["h"].double()
        print(f"tiny state_v_first={spec.state_v_first}: h from the float64 walk "
              f"{((h.double() - want).norm() / want.norm()).item():.1e}", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--match", default="", help="only the shapes whose name contains this")
    p.add_argument("--no-peer", action="store_true", help="leave FlashQLA out (its first call compiles ~1 min)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="rounds of all runners in turn; the least median is kept")
    p.add_argument("--out", default="", help="JSON path (a .md table is written beside it)")
    p.add_argument("--tiny", action="store_true",
                   help="run the kernel once on a small call and check it (for compute-sanitizer), nothing else")
    p.add_argument("--timing", action="store_true",
                   help="also run the timing build (cycle counters per role group and barrier)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_states: needs a CUDA device", file=sys.stderr)
        return 2
    if a.tiny:
        return tiny()
    rows = []
    for name, spec in SHAPES.items():
        if a.match not in name:
            continue
        inputs = make_inputs(spec, "cuda")
        call = validate(**call_kwargs(inputs))
        row = {"shape": name}
        ref = None
        live = {}
        for label, fn in runners(call, not a.no_peer).items():
            try:
                got = fn()
                if ref is None:
                    ref = got.double()
                else:
                    row[f"{label} vs ours"] = ((got.double() - ref).norm() / ref.norm()).item()
                live[label] = fn
            except Exception as e:  # noqa: BLE001 - one runner's failure is its row's answer
                row[label] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                print(name, label, row[label], flush=True)
        # rounds of every runner in turn, the least median kept: in turn, a drift of the machine
        # falls on all of them alike
        for _ in range(a.rounds):
            for label, fn in live.items():
                ms = measure_ms(fn, "cuda", warmup=3, reps=a.reps)
                row[label] = min(ms, row.get(label, ms))
                ms = back_to_back_ms(fn, a.reps)
                row[f"{label} queued"] = min(ms, row.get(f"{label} queued", ms))
        for label in live:
            print(name, label, row[label], "queued", row[f"{label} queued"], row.get(f"{label} vs ours", ""),
                  flush=True)
        rows.append(row)
        if a.out:  # after every shape: a step cut short by its time limit keeps what it measured
            write_results(Path(a.out), rows)
        if a.timing:
            print(timing(call), flush=True)
    return 0


def write_results(out: Path, rows: list) -> None:
    """The rows as JSON and, beside it, a markdown table (ms per runner)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    labels = [k for k in rows[0] if k != "shape" and not k.endswith(" vs ours")] if rows else []
    lines = ["| shape | " + " | ".join(f"{x} ms" for x in labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r['shape']} | " + " | ".join(
            f"{r[x]:.4f}" if isinstance(r.get(x), float) else str(r.get(x, "-")) for x in labels) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
