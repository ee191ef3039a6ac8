"""The q/k normalisation of fla's and HF's Gated DeltaNet, `y = x * rsqrt(sum(x^2, -1) + eps)`,
in one Triton pass each way (fp32 inside, x's dtype out), for the transformers hook.

The torch form is ~8 launches forward and ~10 backward with fp32 intermediates of the tensor's
size: 2.0 ms more a training step of HF's Qwen3-Next (3 layers, B1 T8192 H16 Hg8) on the H200.
fla-core's fused kernels are one launch each way, but their autotuner times 25 configurations
each way at a new shape: that model's first step took 72 s with them, 44 s with these
(bench/results/nvidia-h200-sm90-hf-first-step.md). These have one block shape, so a first call
compiles each once. Rows are read at their strides where the feature axis has the unit one; HF's
q and k (views of a transposed convolution output, consecutive tokens adjacent) are copied packed
first, in the forward and again in the backward, which recomputes the norm from the saved input
(only `x` is kept).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from gdr_dispatch.registry import register_kernel

ELEMENTS = 2048  # a program's rows x padded row width: 16 rows of 128


@triton.jit
def _row_offsets(rows, n_rows, T, H, s_b, s_t, s_h, cols, D: tl.constexpr):
    # row r of the [B, T, H] rows is (r // (T H), (r // H) % T, r % H)
    rows64 = rows.to(tl.int64)
    b, t, h = rows64 // (T * H), (rows64 // H) % T, rows64 % H
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    return (b * s_b + t * s_t + h * s_h)[:, None] + cols[None, :], mask


@triton.jit
def _l2norm_fwd(x, y, n_rows, T, H, s_b, s_t, s_h, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    src, mask = _row_offsets(rows, n_rows, T, H, s_b, s_t, s_h, cols, D)
    xv = tl.load(x + src, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) + eps)
    dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(y + dst, (xv * r[:, None]).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _l2norm_bwd(x, dy, dx, n_rows, T, H, s_b, s_t, s_h, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                ROWS: tl.constexpr):
    # dx = r (dy - y (y . dy)), y = x r in fp32: the torch form's gradient through its fp32 steps
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    src, mask = _row_offsets(rows, n_rows, T, H, s_b, s_t, s_h, cols, D)
    xv = tl.load(x + src, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) + eps)
    yv = xv * r[:, None]
    dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
    g = tl.load(dy + dst, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(yv * g, axis=1)
    tl.store(dx + dst, ((g - yv * dot[:, None]) * r[:, None]).to(dx.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as `[B, T, H, D]` rows with a unit stride along D (a copy only where it has none)."""
    if x.dim() != 4:
        raise ValueError(f"l2norm: x must be [B, T, H, D], got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(kernel, x: torch.Tensor, *tensors: torch.Tensor, eps: float) -> None:
    """`kernel` over the rows of `x` (`_rows`'), read at its strides, with `tensors` packed
    `[B, T, H, D]`; on x's device (Triton launches on the current one, not the tensor's: a layer
    a `device_map` put on another GPU); nothing where there is no element."""
    B, T, H, D = x.shape
    n = B * T * H
    if not (n and D):
        return
    block_d = triton.next_power_of_2(D)
    rows = max(1, ELEMENTS // block_d)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[(triton.cdiv(n, rows),)](x, *tensors, n, T, H, x.stride(0), x.stride(1), x.stride(2), float(eps),
                                        D=D, BLOCK_D=block_d, ROWS=rows)


def l2norm_fwd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(sum(x^2, -1) + eps)` of a `[B, T, H, D]` tensor (any strides), fresh and
    packed, in x's dtype."""
    x = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_l2norm_fwd, x, y, eps=eps)
    return y


def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor, eps: float) -> torch.Tensor:
    """The gradient w.r.t. `x` of `l2norm_fwd(x, eps)` given `dy`, fresh and packed, in x's dtype."""
    x = _rows(x)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_l2norm_bwd, x, dy.contiguous(), dx, eps=eps)
    return dx


class L2Norm(torch.autograd.Function):
    """`l2norm_fwd` with its gradient; keeps only `x` for the backward."""

    @staticmethod
    def forward(ctx, x, eps):
        ctx.save_for_backward(x)
        ctx.eps = eps
        return l2norm_fwd(x, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: an error, not a dropped term
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return l2norm_bwd(x, dy, ctx.eps), None


def l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`L2Norm.apply(x, eps)`."""
    return L2Norm.apply(x, eps)


register_kernel("l2norm", l2norm)
