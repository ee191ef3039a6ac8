"""A floor for the backward, for the bench's tables: bytes every backend must move and the
matmul FLOPs of the chain (bench only: nothing in the library reads it)."""

from __future__ import annotations

import torch

from gdr_dispatch.contract import chunk_counts
from gdr_dispatch.shapes import DTYPES, ShapeSpec


def bytes_and_flops(spec: ShapeSpec) -> tuple[float, float]:
    """A floor for the backward: bytes every backend must move and the matmul FLOPs of the chain.

    Bytes: read q, k, v, do, a, g, b (+ h when given) once and write dq, dk, dv, dg, db
    once. FLOPs: per chunk and value head, the ~14 BTxBTxD / BTxDxD matmuls of the
    fused backward (docs/contract.md, chunk form), counted as 2 FLOPs per multiply-add; with
    `h=None` the state recompute adds ~4 more. An estimate for the roofline, not a count of
    what any one kernel executes.
    """
    e = torch.empty((), dtype=DTYPES[spec.dtype]).element_size()
    T, H, Hg, K, V, BT = spec.B * spec.T, spec.H, spec.Hg, spec.K, spec.V, spec.chunk_size
    n_chunks = sum(chunk_counts(spec.seq_lens, BT))
    reads = T * (2 * Hg * K + 2 * H * V + H * BT) * e + T * H * (4 + e)
    writes = T * (2 * Hg * K + H * V) * e + T * H * (4 + e)
    if spec.h == "given":
        reads += n_chunks * H * K * V * e
    per_chunk = 2 * (7 * BT * BT * max(K, V) + 7 * BT * K * V)
    if spec.h == "none":
        per_chunk += 2 * 4 * BT * K * V
    return float(reads + writes), float(per_chunk * n_chunks * H)


def floor_ms(spec: ShapeSpec, hbm_gbs: float, tflops: float) -> float:
    """max(bytes / bandwidth, flops / peak) in ms."""
    nbytes, flops = bytes_and_flops(spec)
    return max(nbytes / (hbm_gbs * 1e9), flops / (tflops * 1e12)) * 1e3

