"""Where the fla backend's time goes next to fla's own op: interleaved timings and a kernel profile.

    python tools/profile_fla_adapter.py --B 1 --T 8192 --H 16

Runs `fla` (through fused_gdr_bwd, h given and h=None) and `fla-op` (fla's own backward)
round-robin, `--rounds` times `--reps` CUDA-event timings each, so clock drift hits all
three alike; then one torch.profiler pass per runner with the CUDA kernels' total times;
then the host time of our own layers per call (validation, the Problem, the choice, and a
whole `fused_gdr_bwd` through a backend that launches nothing), which is what separates
the two when the backward is launch-bound.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from bench_gdr_bwd import fla_op_runner, forced  # noqa: E402
from gdr_dispatch import GDRGrads, fused_gdr_bwd  # noqa: E402
from gdr_dispatch.contract import validate  # noqa: E402
from gdr_dispatch.dispatch import measure_ms, select_backend  # noqa: E402
from gdr_dispatch.registry import Backend, Problem, register  # noqa: E402
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()
    spec = ShapeSpec(B=a.B, T=a.T, H=a.H, h="given")
    x = make_inputs(spec, "cuda", seed=1)
    kw = call_kwargs(x)
    runners = {"fla h=given": forced("fla", kw), "fla h=None": forced("fla", {**kw, "h": None}),
               "fla-op": fla_op_runner(x)}
    times = {n: [] for n in runners}
    for _ in range(a.rounds):
        for n, fn in runners.items():
            times[n].append(measure_ms(fn, "cuda", warmup=2, reps=a.reps))
    print(f"{spec.label()}: median over {a.rounds} rounds of median-of-{a.reps} ms")
    base = statistics.median(times["fla-op"])
    for n, t in times.items():
        m = statistics.median(t)
        print(f"  {n:12s} {m:.4f} ms  ({m / base - 1:+.1%} vs fla-op)  rounds: {', '.join(f'{v:.3f}' for v in t)}")
    for n, fn in runners.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"\n== {n}: CUDA kernels over 5 calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    g = runners["fla h=given"]()
    host_overhead(kw, g)


class _NoLaunch(Backend):
    """Returns preallocated gradients: a `fused_gdr_bwd` through it costs only our host code."""

    name = "_no_launch"

    def __init__(self, grads):
        self.grads = grads

    def not_supported_reasons(self, problem):
        return []

    def run(self, call):
        return self.grads


def host_overhead(kw, grads, n=2000):
    register(_NoLaunch(GDRGrads(*grads)))
    call = validate(**kw)
    problem = Problem.from_call(call)
    steps = {
        "validate": lambda: validate(**kw),
        "Problem.from_call": lambda: Problem.from_call(call),
        "select_backend (GDR_BACKEND=fla)": lambda: select_backend(problem, call),
        "fused_gdr_bwd, no launches": lambda: fused_gdr_bwd(**kw),
    }
    print(f"\nhost time per call, median of 5 x {n} calls:")
    for label, fn in steps.items():
        os.environ["GDR_BACKEND"] = "_no_launch" if "no launches" in label else "fla"
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n * 1e6)
        print(f"  {label:36s} {statistics.median(runs):7.1f} us")
    os.environ.pop("GDR_BACKEND", None)


if __name__ == "__main__":
    main()
