"""The HF hook's q/k l2norm (backends/kernels/l2norm.py) on HF Qwen3-Next's q layout (a head slice
of a transposed convolution output, consecutive tokens adjacent): the shipped kernels reading the
view in place against the same kernels on the view copied packed first, forward and backward,
each checked against float64 and timed: 50 back-to-back calls (host launches included), and the
same 50 replayed from a CUDA graph (the kernels' GPU time alone); the shipped rows in 32 bits
beside rows forced to 64 bits (what a tensor of 2^31 rows takes). On a CPU, Triton's interpreter,
a small shape checked only.

    python tools/l2norm_probe.py --T 8192 --heads 8
"""

from __future__ import annotations

import argparse
import sys

import torch

from gdr_dispatch.backends.kernels.l2norm import l2norm_bwd, l2norm_fwd


def conv_view(B, T, H, D, dtype, device, gen):
    """q as HF Qwen3-Next makes it: a head slice of a `[B, 3 H D, T]` convolution output, transposed."""
    base = (torch.randn(B, 3 * H * D, T, generator=gen) * 3).to(dtype).to(device)
    return base.transpose(1, 2)[..., H * D:2 * H * D].unflatten(-1, (H, D))


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def timed(fn, reps: int) -> float:
    """Microseconds per call of `reps` calls of `fn` enqueued back to back (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    B, T, H, D = (a.B, a.T, a.heads, 128) if cuda else (1, 70, 2, 32)
    gen, eps = torch.Generator().manual_seed(0), 1e-6
    x = conv_view(B, T, H, D, dtype, dev, gen)
    dy = torch.randn(B, T, H, D, generator=gen).to(dtype).to(dev)
    x64 = x.double().requires_grad_(True)
    y64 = x64 * torch.rsqrt((x64 * x64).sum(-1, keepdim=True) + eps)
    y64.backward(dy.double())
    runners = {"in place (shipped)": (l2norm_fwd, l2norm_bwd),
               "in place, rows in int64": (lambda x, eps: l2norm_fwd(x, eps, wide=True),
                                           lambda x, dy, eps: l2norm_bwd(x, dy, eps, wide=True)),
               "copied packed first": (lambda x, eps: l2norm_fwd(x.contiguous(), eps),
                                       lambda x, dy, eps: l2norm_bwd(x.contiguous(), dy, eps))}
    for name, (fwd, bwd) in runners.items():
        line = f"{name}: error y {rel(fwd(x, eps), y64.detach()):.2e}, dx {rel(bwd(x, dy, eps), x64.grad):.2e}"
        if cuda:
            for what, fn in (("fwd", lambda: fwd(x, eps)), ("bwd", lambda: bwd(x, dy, eps))):
                line += f"; {what} {timed(fn, a.reps):.1f} us"
                graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.graph(graph, stream=side):
                    for _ in range(a.reps):
                        fn()
                line += f" (graph {timed(graph.replay, 1) / a.reps:.1f} us)"
        print(line, flush=True)
    print(f"(B{B} T{T} H{H} D{D} {str(dtype).removeprefix('torch.')}, q as a transposed convolution output's view)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
