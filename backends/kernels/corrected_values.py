"""Corrected values for a given `h`: `v_new = u - w @ h[chunk]`, chunk-parallel.

fla's chain gets `v_new` from its forward state recurrence (`chunk_gated_delta_rule_fwd_h`).
When the caller hands us `h`, recomputing the recurrence only to get `v_new` would waste the
work the caller saved; `v_new` is one `[BT, K] @ [K, V]` product per chunk and head,
independent across chunks. One program per (chunk, batch x value head, V block).

`h` is read in its own dtype and cast to `w`'s for the tensor-core dot (fla's state kernel
does the same with its own h); the subtraction is in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .chunk_grid import chunk_bounds, state_strides


@triton.jit(do_not_specialize=["T"])
def corrected_values_kernel(
    u, w, h, out, cu_seqlens, chunk_indices, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, STATE_V_FIRST: tl.constexpr,
):
    i_t, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_chunk = (i_b * NT + i_t).to(tl.int64)  # row of h (varlen: B == 1, rows in chunk order)
    i_t, bos, T = chunk_bounds(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    h_base = h + (i_chunk * H + i_h) * K * V
    s_k, s_v = state_strides(K, V, STATE_V_FIRST)
    # plain pointers and masks (block pointers are gone from Triton 3.9, used on the CPU here)
    rows = i_t * BT + tl.arange(0, BT)
    cols_v = i_v * BV + tl.arange(0, BV)
    m_t = rows < T
    m_v = cols_v < V
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        cols_k = i_k * BK + tl.arange(0, BK)
        m_k = cols_k < K
        b_w = tl.load(w + ((bos + rows[:, None]) * H + i_h) * K + cols_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_h = tl.load(h_base + cols_k[:, None] * s_k + cols_v[None, :] * s_v,
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc += tl.dot(b_w, b_h.to(b_w.dtype))
    offs = ((bos + rows[:, None]) * H + i_h) * V + cols_v[None, :]
    mask = m_t[:, None] & m_v[None, :]
    b_u = tl.load(u + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offs, (b_u - acc).to(out.dtype.element_ty), mask=mask)


def corrected_values(u: torch.Tensor, w: torch.Tensor, h: torch.Tensor, chunk_size: int,
                     cu_seqlens: Optional[torch.Tensor] = None, chunk_indices: Optional[torch.Tensor] = None,
                     state_v_first: bool = False, BK: int = 64, BV: int = 64) -> torch.Tensor:
    """u: `[B, T, H, V]`, w: `[B, T, H, K]`, h: `[B, NT, H, K, V]` (or V, K) -> fresh `v_new`.

    BK = BV = 64: one [64, 64] fp32 accumulator per program, the tile fla's state kernels
    use on Hopper; this kernel is a small share of the backward (not tuned further).
    """
    B, T, H, V = u.shape
    K = w.shape[-1]
    u, w, h = u.contiguous(), w.contiguous(), h.contiguous()
    out = torch.empty_like(u)
    NT = h.shape[1]
    grid_t = NT if cu_seqlens is None else chunk_indices.shape[0]
    # tl.dot needs tiles of at least 16; boundary checks zero-fill past K and V
    BK, BV = max(16, min(BK, triton.next_power_of_2(K))), max(16, min(BV, triton.next_power_of_2(V)))
    corrected_values_kernel[(grid_t, B * H, triton.cdiv(V, BV))](
        u, w, h, out, cu_seqlens, chunk_indices, T, NT,
        H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV,
        IS_VARLEN=cu_seqlens is not None, STATE_V_FIRST=state_v_first,
    )
    return out
