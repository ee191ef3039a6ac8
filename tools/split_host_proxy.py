"""The split's host work on a CPU, every kernel launch a no-op (eager, the split is bound by its
host's enqueue at the starved shapes: docs/kernels.md, "The split").

    python tools/split_host_proxy.py [--segments 32] [--reps 200] [--profile]

Runs `SplitBackend(tilelang_fused, n)` with `h=None` at B1 T32768 H4 on CPU tensors, with pass 1's
and the scans' Triton kernels, the state kernel and the backward kernel replaced by no-ops (and
the head-major copies by empty tensors: on a CPU they are real copies, on the GPU one launch
each). What it times is the Python and torch-dispatch share of the host's enqueue, not the
CUDA launches (about 20-50 us each on the H200's host, `tools/profile_split.py --pyprof`);
the least of three rounds, since this machine's timings spread by ~30 %.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--segments", type=int, default=32)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="also print a cProfile of the calls, by own time")
    a = p.parse_args()

    import gdr_dispatch.backends.kernels.tilelang_states as states
    import gdr_dispatch.backends.kernels.tilelang_ws_bwd as ws
    import gdr_dispatch.backends.split.passes as cp
    from gdr_dispatch.backends.kernels import segment_maps, segment_scan
    from gdr_dispatch.backends.split import SplitBackend
    from gdr_dispatch.contract import validate
    from gdr_dispatch.registry import get_backend
    from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for mod, names in ((segment_maps, ("_factors", "_forward_maps", "_backward_maps", "_forward_states", "_decay_plan",
                                      "_plan_combine")),
                       (segment_scan, ("_chain",))):
        for n in names:
            setattr(mod, n, NoLaunch())
    states.build_states = ws.build_ws_bwd = lambda *args, **kwargs: (lambda *a2, **k2: None)
    states._head_major = lambda x, width: torch.empty(x.shape[1], width, dtype=torch.float32)
    cp._maps_kernels_refusal = cp._pieces_kernels_refusal = lambda seg_call: ""  # as on the GPU: our kernels run
    cp._chain_kernels = lambda *args: segment_scan

    spec = ShapeSpec(B=1, T=32768, H=4, K=128, V=128, dtype="bfloat16", h="none")
    call = validate(**call_kwargs(make_inputs(spec, "cpu", seed=0)))
    split = SplitBackend(get_backend("tilelang_fused"), a.segments)
    for _ in range(5):
        split.run(call)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(a.reps):
            split.run(call)
        best = min(best, (time.perf_counter() - t0) / a.reps * 1e3)
    print(f"{split.name}, h=None, B1 T32768 H4: {best:.3f} ms of host work per call (launches no-ops)")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.reps):
            split.run(call)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
