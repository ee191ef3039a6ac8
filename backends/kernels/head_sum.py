"""The sum over grouped value heads of per-head dq/dk, in one pass (Triton, any CUDA GPU).

Fused kernels write dq/dk per value head and leave the grouped-value-attention sum to their
launcher (the contract's rule: `gdr_dispatch.contract.reduce_value_heads`). Done in torch on
16-bit tensors with an fp32 accumulator, that sum is a reduction into an fp32 tensor and then
a cast: it moves ~2.3x the bytes of one pass that reads 16-bit, accumulates in fp32 registers
and writes 16-bit (about 1.9 against 0.8 GB for dq and dk at varlen 8x4096 H32 Hg16). FlashQLA's
caller does the one-pass form. On a CPU the torch form runs (the same arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdr_dispatch.contract import as_dtype, reduce_value_heads

ROWS = 16  # output rows (token, q/k head) per program


@triton.jit
def _head_sum(x, y, n_rows, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    # x: [n_rows * G, D] (row r * G + j is value head j of output row r), y: [n_rows, D]
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(G):
        acc += tl.load(x + (rows64[:, None] * G + j) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y + rows64[:, None] * D + cols[None, :], acc.to(y.dtype.element_ty), mask=mask)


def head_sum_triton(x: torch.Tensor, Hg: int, dtype: torch.dtype) -> torch.Tensor:
    """`[B, T, H, D]` -> `[B, T, Hg, D]` in `dtype`, summed in fp32 (the Triton kernel itself;
    runs on CPU tensors only under TRITON_INTERPRET=1, which is how the tests check it)."""
    B, T, H, D = x.shape
    if H % Hg:
        raise ValueError(f"head_sum: H={H} is not a multiple of Hg={Hg}")
    x = x.contiguous()
    y = torch.empty(B, T, Hg, D, dtype=dtype, device=x.device)
    n_rows = B * T * Hg
    if n_rows:
        _head_sum[(triton.cdiv(n_rows, ROWS),)](x, y, n_rows, G=H // Hg, D=D, BLOCK_D=triton.next_power_of_2(D),
                                                 ROWS=ROWS)
    return y


def sum_value_heads(x: torch.Tensor, Hg: int, dtype: torch.dtype) -> torch.Tensor:
    """The launchers' GVA sum of per-head dq/dk: one Triton pass on CUDA, torch elsewhere;
    both accumulate in fp32 and return `dtype`."""
    if x.shape[2] == Hg:  # ungrouped heads: x itself, cast if asked (the hot path: no further calls)
        return as_dtype(x, dtype)
    if x.device.type == "cuda":
        return head_sum_triton(x, Hg, dtype)
    return reduce_value_heads(x, Hg, dtype, accum=torch.float32)
