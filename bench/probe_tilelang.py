"""Where the TileLang fused kernel's time goes: the same kernel with blocks dropped or doubled.

    python bench/probe_tilelang.py                      # B8 T4096 H32 and B1 T8192 H16, h given

Times `fused_bwd_given_h` (the kernel and its launcher, no dispatch) for each build in
`tilelang_fused_bwd.PROBES`: the full kernel, without stage 5, without stage 6, without
both (loads, forward recompute, dU and the dh recurrence only), and with every chunk's
loads issued twice. The difference to the full kernel is what a block costs inside the
chunk loop; per chunk step it is that difference over the sequential steps per CTA slot.
Probe outputs are wrong by design and only timed. Compile them first in parallel:
bench/precompile_tilelang.py --config 32,32,bfloat16,no_stage5 ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gdr_dispatch.backends.kernels.tilelang_fused_bwd import PROBES, fused_bwd_given_h  # noqa: E402
from gdr_dispatch.contract import validate  # noqa: E402
from gdr_dispatch.dispatch import measure_ms  # noqa: E402
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for spec in (ShapeSpec(B=8, T=4096, H=32, h="given"), ShapeSpec(B=1, T=8192, H=16, h="given")):
        call = validate(**call_kwargs(make_inputs(spec, "cuda", seed=1)))
        ctas = len(call.seq_lens) * call.H
        steps = -(-ctas // sms) * max(call.seq_lens) // call.chunk_size  # sequential chunk steps per SM slot
        base = None
        for probe in PROBES:
            def run(probe=probe):
                return fused_bwd_given_h(call.q, call.k, call.v, call.do, call.a, call.g, call.b, call.h, call.dht,
                                         call.scale, call.seq_lens, call.chunk_size, call.cu_seqlens,
                                         has_h0=call.initial_state is not None, probe=probe)
            ms = measure_ms(run, "cuda", warmup=3, reps=args.reps)
            base = ms if probe == "" else base
            row = {"shape": spec.label(), "probe": probe or "full", "ms": round(ms, 4),
                   "us_per_step": round(ms * 1e3 / steps, 2), "delta_ms_vs_full": round(ms - base, 4)}
            rows.append(row)
            print(row, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tilelang_probes.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n| shape | build | ms | us per chunk step | vs full |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['probe']} | {r['ms']:.3f} | {r['us_per_step']:.1f} | {r['delta_ms_vs_full']:+.3f} |")


if __name__ == "__main__":
    main()
