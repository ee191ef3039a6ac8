"""Gate the WY inverse: `A_gated[t, j] = a[t, j] * exp(G_t - G_j)` for j <= t in the chunk.

The same pass also writes `G / ln 2` when asked (fla's log2 gate), which saves the fla
backend one more launch: at B1 T8192 H16 its backward is launch-bound on the H200.

fla's `recompute_w_u_fwd` and `prepare_wy_repr_bwd` take the gated inverse, the contract
carries the ungated one (gating is exact, un-gating divides by an underflowing exp; see
docs/contract.md). One program per (chunk, batch x head) reads the chunk's [BT, BT] rows of `a`
and its BT gate values once. The exponent is masked before `exp`, so entries above the
diagonal (where G_t - G_j can be large and positive) never overflow.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .chunk_grid import chunk_bounds, masked_exp


@triton.jit(do_not_specialize=["T"])
def gate_wy_inverse_kernel(
    a, g, out, g_log2, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr, WRITE_LOG2: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = chunk_bounds(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    rows = i_t * BT + tl.arange(0, BT)  # token position within the sequence
    cols = tl.arange(0, BT)
    valid = rows < T
    G = tl.load(g + (bos + rows) * H + i_h, mask=valid, other=0.0).to(tl.float32)
    if WRITE_LOG2:
        tl.store(g_log2 + (bos + rows) * H + i_h, G * 1.4426950408889634, mask=valid)  # 1 / ln 2
    keep = (cols[None, :] <= cols[:, None]) & valid[:, None] & valid[None, :]
    gam = masked_exp(G[:, None] - G[None, :], keep)
    offs = ((bos + rows[:, None]) * H + i_h) * BT + cols[None, :]
    b_a = tl.load(a + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(out + offs, (b_a * gam).to(out.dtype.element_ty), mask=valid[:, None])


def gate_wy_inverse(a: torch.Tensor, g: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                    chunk_indices: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                    with_log2_gate: bool = False):
    """`Gam * a` in a fresh tensor (and `g / ln 2` in fp32 when `with_log2_gate`).

    a: `[B, T, H, BT]`, g: `[B, T, H]` natural-log chunk cumsum.
    """
    B, T, H, BT = a.shape
    a, g = a.contiguous(), g.contiguous()
    out = torch.empty(a.shape, dtype=out_dtype or a.dtype, device=a.device)
    g_log2 = torch.empty(g.shape, dtype=torch.float32, device=g.device) if with_log2_gate else None
    NT = triton.cdiv(T, BT) if cu_seqlens is None else chunk_indices.shape[0]
    gate_wy_inverse_kernel[(NT, B * H)](
        a, g, out, g_log2, cu_seqlens, chunk_indices, T, H=H, BT=BT, IS_VARLEN=cu_seqlens is not None,
        WRITE_LOG2=with_log2_gate,
    )
    return (out, g_log2) if with_log2_gate else out
