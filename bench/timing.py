"""Timing helpers of the bench scripts (and tools/profile_split.py): what users feel beside what
the GPU does. The library's own timer is gdr_dispatch.autotune.measure_ms."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Callable

import torch

from gdr_dispatch import autotune
from gdr_dispatch.autotune import relative_error  # noqa: F401  (re-exported for the scripts)


@contextlib.contextmanager
def collector_off():
    """Python's cyclic collector paused inside a timed window, as `timeit` does: a full collection
    with torch, Triton, TileLang and fla loaded takes ~0.5 s, and one that fell due inside 20
    back-to-back calls once read as 16.8 ms per call for a 0.35 ms call. It runs again after the
    window (no collection forced here: that would cost the same 0.5 s per window)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def measure_ms(fn: Callable[[], object], device_type: str, warmup: int = autotune.AUTOTUNE_WARMUP,
               reps: int = autotune.AUTOTUNE_REPS) -> float:
    """The library's timer (`autotune.measure_ms`: median of `reps` calls, a sync after each) with
    the collector paused."""
    with collector_off():
        return autotune.measure_ms(fn, device_type, warmup=warmup, reps=reps)


def host_enqueue_ms(fn: Callable[[], object], reps: int = 5, sync: Callable[[], None] = torch.cuda.synchronize) -> float:
    """Median host time of one call's enqueue in ms, the device drained (`sync`) before each (no
    sync inside). Near `measure_ms`'s reading the call is host-bound: eager, the split's time at
    B1 T32768 H4 is its host's (docs/kernels.md, "The split")."""
    out = []
    with collector_off():
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        sync()
    return statistics.median(out)


def latency_ms(fn: Callable[[], object], reps: int, sync: Callable[[], None] = torch.cuda.synchronize) -> float:
    """Median wall time of one call between two syncs (what a step that waits on each call sees)."""
    out = []
    with collector_off():
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def back_to_back_ms(fn: Callable[[], object], n: int = 20, warmup: int = 2,
                    sync: Callable[[], None] = torch.cuda.synchronize, rounds: int = 3) -> float:
    """Mean ms per call of `n` calls enqueued back to back with one sync after them (GPU time, the
    host's enqueue hidden behind the queue), the median of `rounds` such windows (one stall of the
    host inside a window moves its mean by stall / n, the median not), beside `measure_ms`'s
    per-call median (a sync after each: what a latency-bound step sees)."""
    for _ in range(warmup):
        fn()
    out = []
    with collector_off():
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            out.append((time.perf_counter() - t0) * 1e3 / n)
    return statistics.median(out)


def kernel_ms(fn: Callable[[], object], n: int = 10, sync: Callable[[], None] = torch.cuda.synchronize) -> float:
    """The GPU's busy time per call in ms: the device time of every kernel and copy `n` calls
    launch (torch.profiler), summed, over `n`. Where a call is host-bound, its per-call and
    back-to-back times read the host's pace; this reads what the kernels cost (one stream, so
    nothing overlaps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with collector_off(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        sync()
    # kernels and copies only: an op's own row repeats its kernels' time
    total_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type != torch.autograd.DeviceType.CPU)
    return total_us / 1e3 / n


def more_rounds(runners: dict, runs: dict, rounds: int, measure: Callable) -> None:
    """Time each runner that has a first reading (`runs[name]["ms"]`) `rounds - 1` more times,
    in alternating order (reversed first), and keep the least median; `ms_rounds` keeps all.
    Why: a runner's place in the sequence moves its time by up to 0.6 ms on the H200 (the first
    runner of a row reads slower than the same kernel called later)."""
    timed = [n for n in runners if "ms" in runs.get(n, {})]
    for r in range(1, rounds):
        for name in (timed[::-1] if r % 2 else timed):
            run = runs[name]
            run.setdefault("ms_rounds", [run["ms"]]).append(round(measure(runners[name]), 4))
            run["ms"] = min(run["ms_rounds"])
