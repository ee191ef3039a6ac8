"""What the fused TileLang kernels' launchers share: the packed-sequence calling convention.

Both kernels take every call as packed sequences (`cu_seqlens`; a fixed-length batch is B
sequences of T tokens, so one compiled kernel serves both), per-sequence chunk offsets into
`h`, states as `[K, V]` (`state_v_first` is transposed here), a `dht` of zeros for none, and
write dq/dk per value head (reduced here over the heads that share a q/k head).
"""

from __future__ import annotations

import functools
import itertools

import torch

from gdr_dispatch.contract import as_dtype, packed
from gdr_dispatch import graph_safe
from gdr_dispatch.graph_safe import device_constant

from .head_sum import sum_value_heads


def tl_dtype(dt) -> str:
    """`torch.bfloat16` -> "bfloat16" (TileLang's dtype names)."""
    return str(dt).replace("torch.", "")


def packed_sequences(B: int, T_: int, seq_lens, chunk_size: int, cu_seqlens, dev) -> tuple:
    """The calling convention's sequence tensors: `(cu, offsets, counts)`, int32 `cu_seqlens`
    (B sequences of T tokens when None), each sequence's first chunk in `h` (both cached device
    constants: graph-capture safe once built) and its chunk count."""
    if cu_seqlens is None:  # a cached constant too: one launch less per call
        cu = device_constant(tuple(range(0, (B + 1) * T_, T_)), torch.int32, dev)
    else:
        cu = cu_seqlens.to(torch.int32)
    counts, firsts = _chunk_offsets(tuple(seq_lens), chunk_size)
    return cu, device_constant(firsts, torch.int32, dev), counts


@functools.lru_cache(maxsize=256)
def _chunk_offsets(seq_lens: tuple, chunk_size: int) -> tuple[tuple, tuple]:
    """Each sequence's chunk count and first chunk in `h`, once per lengths (the split's pass 3
    has 128 sequences at B1 T32768 H4; its host time per call is its eager time there)."""
    counts = tuple(-(-n // chunk_size) for n in seq_lens)
    return counts, (0, *itertools.accumulate(counts))


def launch_packed(kern, q, k, v, do, a, g, b, h, dht, seq_lens, chunk_size: int, cu_seqlens, has_h0: bool,
                  state_v_first: bool, dq_dtype: torch.dtype, db_dtype: torch.dtype, extra=()):
    """Pack the call, run `kern(q, k, v, do, a, g, b, h, dht, cu, offsets, dq, dk, dv, dg, db, dh0)`
    on fresh outputs and return `(dq, dk, dv, dg, db, dh0)` in the contract's form.

    `h` comes in the contract's layout (transposed here for `state_v_first`); `dq_dtype` and
    `db_dtype` are the kernel's output dtypes (db is cast to b's dtype on the way out); `extra`
    are arguments a kernel takes after dh0.
    """
    B, T_, Hg, K = q.shape
    H, V = v.shape[2], v.shape[3]
    N = len(seq_lens)
    dev = q.device
    cu, offsets, _ = packed_sequences(B, T_, seq_lens, chunk_size, cu_seqlens, dev)
    if dht is None:  # read only: one cached zeros tensor per shape, no fill launch per call
        dht_in = graph_safe.zeros((N, H, K, V), torch.float32, dev)
    else:
        dht_in = packed((dht.transpose(-1, -2) if state_v_first else dht).float())
    if state_v_first:  # the kernels read [K, V] states; a copy of h is the price of one variant
        h = h.transpose(-1, -2)
    TT = B * T_
    dq = torch.empty(TT, H, K, dtype=dq_dtype, device=dev)
    dk = torch.empty(TT, H, K, dtype=dq_dtype, device=dev)
    dv = torch.empty(TT, H, V, dtype=v.dtype, device=dev)
    dg = torch.empty(TT, H, dtype=torch.float32, device=dev)
    db = torch.empty(TT, H, dtype=db_dtype, device=dev)
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=dev)
    # packed memory for the TMA descriptors: a strided view is copied once, a packed one not at all
    kern(packed(q.reshape(TT, Hg, K)), packed(k.reshape(TT, Hg, K)), packed(v.reshape(TT, H, V)),
         packed(do.reshape(TT, H, V)), packed(as_dtype(a.reshape(TT, H, chunk_size), q.dtype)),
         packed(as_dtype(g.reshape(TT, H), torch.float32)), packed(b.reshape(TT, H)),
         packed(h.reshape(-1, *h.shape[2:])), dht_in, cu, offsets, dq, dk, dv, dg, db, dh0, *extra)
    dq = sum_value_heads(dq.view(B, T_, H, K), Hg, q.dtype)
    dk = sum_value_heads(dk.view(B, T_, H, K), Hg, k.dtype)
    if state_v_first:
        dh0 = dh0.transpose(-1, -2).contiguous()
    return (dq, dk, dv.view(B, T_, H, V), dg.view(B, T_, H), as_dtype(db.view(B, T_, H), b.dtype),
            dh0 if has_h0 else None)
