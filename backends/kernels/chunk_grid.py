"""What the chunk-parallel kernels share: which (sequence, chunk) a program owns, the state
layout, the per-token gate scalars of a chunk, and the intra-chunk decay matrix.

fla's convention, so its stages and ours can share one table: for varlen calls a
`[num_chunks, 2]` tensor of (sequence index, chunk index within the sequence), in order, so
that row i is also chunk i of the `h` tensor. Built on the host from the sequence lengths
the contract already validated, which costs no device synchronisation.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from gdr_dispatch.graph_safe import device_constant


def varlen_chunk_indices(seq_lens: Sequence[int], chunk_size: int, device, dtype=torch.int32) -> torch.Tensor:
    # built once per content and kept: a CUDA graph capture cannot copy it to the device
    rows = tuple(x for n, length in enumerate(seq_lens) for c in range(-(-length // chunk_size)) for x in (n, c))
    return device_constant(rows, dtype, device, shape=(-1, 2))


def varlen_chunk_offsets(seq_lens: Sequence[int], chunk_size: int, device) -> torch.Tensor:
    """Each sequence's first chunk as a row of `h` (`[N + 1]`, int64, fla's `chunk_offsets`), a
    device constant like the indices: fla's own (`prepare_chunk_offsets`) lives only in its
    4-entry tensor cache, so a CUDA graph captured on it reads freed memory once that cache
    moves on."""
    rows, total = [0], 0
    for length in seq_lens:
        total += -(-length // chunk_size)
        rows.append(total)
    return device_constant(tuple(rows), torch.int64, device)


@triton.jit
def chunk_bounds(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr):
    """For grid row `i_t` of batch row `i_b`: (chunk index within its sequence, the
    sequence's first token as a flat index into B*T, the sequence's length).

    Callers mark `T` do_not_specialize: a T of 1 would otherwise arrive as a constexpr, and
    each T % 16 class would compile anew (fla's kernels do the same)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        i_c = i_t
        bos = (i_b * T).to(tl.int64)
    return i_c, bos, T


@triton.jit
def state_strides(K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """Element strides (of the K axis, of the V axis) inside one chunk's `[K, V]` state, or
    `[V, K]` with `state_v_first`: one place for the layout rule every state-reading kernel
    applies. Compiles to the same PTX as the rule written inline (Triton 3.6, sm_90a)."""
    s_k = V
    s_v = 1
    if STATE_V_FIRST:
        s_k = 1
        s_v = K
    return s_k, s_v


@triton.jit
def masked_exp(x, keep):
    """`exp(x)` where `keep`, 0 elsewhere, with `x` masked *before* the exp: above the
    diagonal G_t - G_s can be large and positive, and exp would overflow to inf there (and
    inf * 0 is NaN). Every decay matrix Gam = exp(G_t - G_s), s <= t, is built with it."""
    return tl.where(keep, tl.exp(tl.where(keep, x, 0.0)), 0.0)


@triton.jit
def chunk_gate_scalars(g, b, bos, rows, m_t, i_h, H: tl.constexpr):
    """(G, beta, e^G) of one chunk's rows for value head `i_h`, in fp32, all 0 on rows past
    the sequence's end (so nothing a padded row feeds can carry a value)."""
    G = tl.load(g + (bos + rows) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    beta = tl.load(b + (bos + rows) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    eG = tl.where(m_t, tl.exp(G), 0.0)
    return G, beta, eG


@triton.jit
def decay_to_chunk_end(G, o_t, m_t, n_valid):
    """(G_L, exp(G_L - G_t)) with L the chunk's last valid row: the gate at the chunk's end
    and each row's decay to it (0 past the end)."""
    g_last = tl.sum(tl.where(o_t == n_valid - 1, G, 0.0), axis=0)
    return g_last, tl.where(m_t, tl.exp(g_last - G), 0.0)
