"""A candidate for the HF hook's q/k l2norm (backends/kernels/l2norm.py): rows read at their
strides in place, tokens along a program's rows where the token axis has the unit stride (HF
Qwen3-Next's q and k are views of a transposed convolution output), against the shipped kernels,
which copy such a view packed first, in the forward and again in the backward (four ~57 us copies
a layer per step at B1 T8192 Hg8: bench/results/nvidia-h200-sm90-hf-starved.md), and the same
forward keeping 1 / norm per row for a backward from the normalised y (fla's form: the op saves y
as its q or k anyway, so the backward reads no x). Checks each against float64 and times them; on
a CPU (TRITON_INTERPRET=1) it checks a small shape only.

    python tools/l2norm_probe.py --T 8192 --heads 8
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from gdr_dispatch.backends.kernels import l2norm as shipped

ROWS_PACKED, ROWS_TOKENS = 16, 64  # 256 B rows (bf16, D 128); 64 tokens: 128 B per column load


@triton.jit
def _offsets(rows, n_rows, T, H, s_b, s_t, s_h, s_d, cols, D: tl.constexpr):
    # row r of the [B, H, T] rows (tokens fastest); the source at its strides, the destination packed
    rows64 = rows.to(tl.int64)
    b, h, t = rows64 // (T * H), (rows64 // T) % H, rows64 % T
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    src = (b * s_b + t * s_t + h * s_h)[:, None] + cols.to(tl.int64)[None, :] * s_d
    dst = (((b * T + t) * H + h) * D)[:, None] + cols[None, :]
    return src, dst, mask


@triton.jit
def _fwd(x, y, rstd, n_rows, T, H, s_b, s_t, s_h, s_d, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
         ROWS: tl.constexpr, KEEP: tl.constexpr):
    # KEEP: also each row's 1 / norm, for a backward from y (the op saves y as its q or k)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    src, dst, mask = _offsets(rows, n_rows, T, H, s_b, s_t, s_h, s_d, cols, D)
    xv = tl.load(x + src, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) + eps)
    tl.store(y + dst, (xv * r[:, None]).to(y.dtype.element_ty), mask=mask)
    if KEEP:
        tl.store(rstd + rows, r, mask=rows < n_rows)


@triton.jit
def _bwd(x, dy, dx, n_rows, T, H, s_b, s_t, s_h, s_d, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
         ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    src, dst, mask = _offsets(rows, n_rows, T, H, s_b, s_t, s_h, s_d, cols, D)
    xv = tl.load(x + src, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) + eps)
    yv = xv * r[:, None]
    g = tl.load(dy + dst, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(yv * g, axis=1)
    tl.store(dx + dst, ((g - yv * dot[:, None]) * r[:, None]).to(dx.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_y(y, rstd, dy, dx, n_rows, T, H, s_b, s_t, s_h, s_d, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
           ROWS: tl.constexpr):
    # dx = r (dy - y (y . dy)) from the rounded y and the kept r: no read of x (fla's form)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    _, dst, mask = _offsets(rows, n_rows, T, H, s_b, s_t, s_h, s_d, cols, D)
    yv = tl.load(y + dst, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(rstd + rows, mask=rows < n_rows, other=0.0)
    g = tl.load(dy + dst, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(yv * g, axis=1)
    tl.store(dx + dst, ((g - yv * dot[:, None]) * r[:, None]).to(dx.dtype.element_ty), mask=mask)


def _launch(kernel, x, *tensors, eps, **constants):
    """`kernel(*tensors, ...)` over the rows of `x` at x's strides (x itself is read only where it
    is among `tensors`)."""
    B, T, H, D = x.shape
    n = B * T * H
    if n and D:
        rows = ROWS_TOKENS if x.stride(1) == 1 and T > 1 else ROWS_PACKED
        kernel[(triton.cdiv(n, rows),)](*tensors, n, T, H, *x.stride(), float(eps), D=D,
                                        BLOCK_D=triton.next_power_of_2(D), ROWS=rows, **constants)


def strided_fwd(x, eps, keep=False):
    """y, and with `keep` (y, 1 / norm per row) for `from_y_bwd`."""
    B, T, H, _ = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(B * T * H if keep else 0, dtype=torch.float32, device=x.device)
    _launch(_fwd, x, x, y, rstd, eps=eps, KEEP=keep)
    return (y, rstd) if keep else y


def strided_bwd(x, dy, eps):
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_bwd, x, x, dy.contiguous(), dx, eps=eps)
    return dx


def from_y_bwd(x, y, rstd, dy, eps):
    """The gradient from `strided_fwd(..., keep=True)`'s outputs; `x` only lends its shape and
    strides (the rows' order), it is not read."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_bwd_y, x, y, rstd, dy.contiguous(), dx, eps=eps)
    return dx


def conv_view(B, T, H, D, dtype, device, gen):
    """q as HF Qwen3-Next makes it: a head slice of a `[B, 3 H D, T]` convolution output, transposed."""
    base = (torch.randn(B, 3 * H * D, T, generator=gen) * 3).to(dtype).to(device)
    return base.transpose(1, 2)[..., H * D:2 * H * D].unflatten(-1, (H, D))


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


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
    y_kept, rstd_kept = strided_fwd(x, eps, keep=True)
    runners = {"shipped (copy, then the kernel)": (shipped.l2norm_fwd, shipped.l2norm_bwd),
               "strided read": (strided_fwd, strided_bwd),
               "strided read, backward from y": (lambda x, eps: strided_fwd(x, eps, keep=True)[0],
                                                 lambda x, dy, eps: from_y_bwd(x, y_kept, rstd_kept, dy, eps))}
    for name, (fwd, bwd) in runners.items():
        line = f"{name}: error y {rel(fwd(x, eps), y64.detach()):.2e}, dx {rel(bwd(x, dy, eps), x64.grad):.2e}"
        if cuda:
            for what, fn in (("fwd", lambda: fwd(x, eps)), ("bwd", lambda: bwd(x, dy, eps))):
                for _ in range(3):
                    fn()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(a.reps):
                    fn()
                end.record()
                torch.cuda.synchronize()
                line += f"; {what} {start.elapsed_time(end) * 1e3 / a.reps:.1f} us"
        print(line, flush=True)
    print(f"(B{B} T{T} H{H} D{D} {str(dtype).removeprefix('torch.')}, q as a transposed convolution output's view)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
