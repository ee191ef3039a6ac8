"""The q/k normalisation of fla's and HF's Gated DeltaNet, `y = x * rsqrt(sum(x^2, -1) + eps)`,
in one Triton pass each way (fp32 inside, x's dtype out), for the transformers hook.

The torch form is ~8 launches forward and ~10 backward with fp32 intermediates of the tensor's
size: 2.0 ms more a training step of HF's Qwen3-Next (3 layers, B1 T8192 H16 Hg8) on the H200.
fla-core's fused kernels are one launch each way, but their autotuner times 25 configurations
each way at a new shape: that model's first step took 72 s with them, 44 s with these
(bench/results/nvidia-h200-sm90-hf-first-step.md). These have no autotune: a first call
compiles each kernel once per layout (two row orders). Both read x in place at its strides; on
HF's q and k (views of a transposed convolution output, consecutive tokens adjacent) a program
takes 64 consecutive rows of the [B, H, T] order, so every load is a run across tokens: 8.4 /
14.5 us of GPU time forward / backward at B1 T8192 H8 D128 bf16 on the H200, against 64.5 / 68.6
with the view copied packed first (tools/l2norm_probe.py). Rows are int32 (their decode divides in
32 bits; int64 only where B T H passes 2^31: 12.1 / 16.7 us). The backward recomputes the norm
from the saved input (only `x` is kept).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from gdr_dispatch.registry import register_kernel

#: elements of a program's tile (rows x padded feature width): 16 rows of 128 where features are
#: adjacent (16 x 256 B at bf16), 64 where tokens are (HF's transposed views: each feature column
#: a 128 B read across the tokens); fewer rows at wider features
ELEMENTS_PACKED, ELEMENTS_TOKENS = 2048, 8192


@triton.jit
def _rows(ROWS: tl.constexpr, WIDE: tl.constexpr):
    # a program's rows: int64 only where B T H (plus a tile) passes 2^31 (WIDE), int32 elsewhere,
    # whose decode divides in 32 bits
    first = tl.program_id(0)
    if WIDE:
        first = first.to(tl.int64)
    return first * ROWS + tl.arange(0, ROWS)


@triton.jit
def _offsets(rows, n_rows, T, H, s_b, s_t, s_h, s_d, cols, D: tl.constexpr, TOKENS: tl.constexpr):
    # row r: (b, t, h) of the [B, T, H] rows, or with TOKENS of the [B, H, T] rows (tokens
    # fastest, for a view whose token axis has the unit stride); the source at x's strides, the
    # destination (y, dy, dx) packed [B, T, H, D], both in int64 (a tensor may pass 2^31 elements)
    if TOKENS:  # (b by two divisions: T H itself may pass 2^31)
        b, h, t = rows // T // H, (rows // T) % H, rows % T
    else:
        b, t, h = rows // H // T, (rows // H) % T, rows % H
    b, t, h = b.to(tl.int64), t.to(tl.int64), h.to(tl.int64)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    src = (b * s_b + t * s_t + h * s_h)[:, None] + cols.to(tl.int64)[None, :] * s_d
    dst = (((b * T + t) * H + h) * D)[:, None] + cols[None, :]
    return src, dst, mask


@triton.jit
def _l2norm_fwd(x, y, n_rows, T, H, s_b, s_t, s_h, s_d, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                ROWS: tl.constexpr, TOKENS: tl.constexpr, WIDE: tl.constexpr):
    rows = _rows(ROWS, WIDE)
    cols = tl.arange(0, BLOCK_D)
    src, dst, mask = _offsets(rows, n_rows, T, H, s_b, s_t, s_h, s_d, cols, D, TOKENS)
    xv = tl.load(x + src, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) + eps)
    tl.store(y + dst, (xv * r[:, None]).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _l2norm_bwd(x, dy, dx, n_rows, T, H, s_b, s_t, s_h, s_d, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                ROWS: tl.constexpr, TOKENS: tl.constexpr, WIDE: tl.constexpr):
    # dx = r (dy - y (y . dy)), y = x r in fp32: the torch form's gradient through its fp32 steps
    rows = _rows(ROWS, WIDE)
    cols = tl.arange(0, BLOCK_D)
    src, dst, mask = _offsets(rows, n_rows, T, H, s_b, s_t, s_h, s_d, cols, D, TOKENS)
    xv = tl.load(x + src, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) + eps)
    yv = xv * r[:, None]
    g = tl.load(dy + dst, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(yv * g, axis=1)
    tl.store(dx + dst, ((g - yv * dot[:, None]) * r[:, None]).to(dx.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"l2norm: x must be [B, T, H, D], got shape {tuple(x.shape)}")


def _launch(kernel, x: torch.Tensor, *tensors: torch.Tensor, eps: float, wide: Optional[bool] = None) -> None:
    """`kernel` over the rows of `x`, read in place at its strides, with `tensors` packed
    `[B, T, H, D]`; on x's device (Triton launches on the current one, not the tensor's: a layer
    a `device_map` put on another GPU); nothing where there is no element. `wide`: rows in int64
    (None: where B T H plus a tile passes 2^31; tools/l2norm_probe.py times both)."""
    B, T, H, D = x.shape
    n = B * T * H
    if not (n and D):
        return
    rows, tokens = tile(x)
    wide = n + rows >= 2 ** 31 if wide is None else wide
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[(triton.cdiv(n, rows),)](x, *tensors, n, T, H, *x.stride(), float(eps), D=D,
                                        BLOCK_D=triton.next_power_of_2(D), ROWS=rows, TOKENS=tokens, WIDE=wide)


def tile(x: torch.Tensor) -> tuple[int, bool]:
    """A program's rows over `x` (`[B, T, H, D]`), and whether they run along the tokens (where
    the token axis has the unit stride)."""
    T, D = x.shape[1], x.shape[3]
    tokens = x.stride(1) == 1 and T > 1
    return max(1, (ELEMENTS_TOKENS if tokens else ELEMENTS_PACKED) // triton.next_power_of_2(max(D, 1))), tokens


def l2norm_fwd(x: torch.Tensor, eps: float, wide: Optional[bool] = None) -> torch.Tensor:
    """`x * rsqrt(sum(x^2, -1) + eps)` of a `[B, T, H, D]` tensor (any strides), fresh and
    packed, in x's dtype."""
    _check(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_l2norm_fwd, x, y, eps=eps, wide=wide)
    return y


def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor, eps: float, wide: Optional[bool] = None) -> torch.Tensor:
    """The gradient w.r.t. `x` of `l2norm_fwd(x, eps)` given `dy`, fresh and packed, in x's dtype."""
    _check(x)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_l2norm_bwd, x, dy.contiguous(), dx, eps=eps, wide=wide)
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
