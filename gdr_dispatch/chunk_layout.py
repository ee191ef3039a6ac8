"""Padded chunk layout for the exact torch math: `[B, T, H, D]` <-> `[N, C, H, BT, D]`.

Sequences (the B rows, or the packed varlen sequences) are cut into chunks of BT tokens
that restart at every sequence start; the last chunk of a sequence may be short. The torch
backend works on a rectangular layout: N sequences x C = max chunks per sequence, each chunk
padded to BT rows with zeros. Zero rows of k/q/v/do/b make every padded contribution vanish,
so the chunk math needs no masks beyond the triangular ones; the gate cumsum is padded with
the chunk's last valid value instead (see `gather_gate`), which keeps every exponent finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class ChunkLayout:
    B: int
    T: int
    BT: int
    seq_lens: tuple[int, ...]
    token_index: torch.Tensor  # [N, C, BT] flat index into B*T, 0 where padded
    valid: torch.Tensor  # [N, C, BT] bool
    chunk_len: torch.Tensor  # [N, C] valid rows per chunk (0 for chunks past a sequence's end)
    chunk_index: torch.Tensor  # [N, C] index into the h tensor's chunk dim (flattened), -1 if none

    @property
    def N(self) -> int:
        return len(self.seq_lens)

    @property
    def C(self) -> int:
        return self.token_index.shape[1]

    @staticmethod
    def build(B: int, T: int, seq_lens: Sequence[int], BT: int, device) -> "ChunkLayout":
        seq_lens = tuple(int(n) for n in seq_lens)
        N = len(seq_lens)
        # Flat token offsets: row n of a fixed-length batch starts at n*T, which is also the
        # running sum of the lengths; packed varlen sequences start at the running sum too.
        starts, s = [], 0
        for n in seq_lens:
            starts.append(s)
            s += n
        counts = [-(-n // BT) for n in seq_lens]
        C = max(max(counts), 1)
        pos = torch.arange(C * BT).view(C, BT)
        idx = torch.empty(N, C, BT, dtype=torch.long)
        valid = torch.empty(N, C, BT, dtype=torch.bool)
        clen = torch.empty(N, C, dtype=torch.long)
        cidx = torch.full((N, C), -1, dtype=torch.long)
        first_chunk = 0
        for n, (start, length) in enumerate(zip(starts, seq_lens)):
            valid[n] = pos < length
            idx[n] = torch.where(valid[n], pos + start, torch.zeros_like(pos))
            clen[n] = (length - torch.arange(C) * BT).clamp(0, BT)
            cidx[n, : counts[n]] = torch.arange(first_chunk, first_chunk + counts[n])
            first_chunk += counts[n]
        return ChunkLayout(
            B=B, T=T, BT=BT, seq_lens=seq_lens,
            token_index=idx.to(device), valid=valid.to(device),
            chunk_len=clen.to(device), chunk_index=cidx.to(device),
        )

    # -- tokens ------------------------------------------------------------------------
    def gather(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[B, T, H, *D]` -> `[N, C, H, BT, *D]`, zero-padded, cast to `dtype`."""
        flat = x.reshape(self.B * self.T, *x.shape[2:]).to(dtype)
        out = flat[self.token_index]  # [N, C, BT, H, *D]
        mask = self.valid.view(*self.valid.shape, *([1] * (out.dim() - 3)))
        out = out * mask
        return out.transpose(2, 3)

    def gather_gate(self, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[B, T, H]` -> `[N, C, H, BT]`; padded rows repeat the chunk's last valid value.

        With the padding equal to the last valid G, `exp(G_i - G_j)` stays bounded wherever a
        valid token meets a padded one, and `G[..., -1]` is the chunk's true last G.
        """
        x = self.gather(g, dtype)  # zeros at padded rows
        last = (self.chunk_len - 1).clamp(min=0)  # [N, C]
        g_last = x.gather(3, last[:, :, None, None].expand(-1, -1, x.shape[2], 1))
        return torch.where(self.valid[:, :, None, :], x, g_last)

    def scatter(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[N, C, H, BT, *D]` -> fresh `[B, T, H, *D]` in `dtype` (padded rows dropped)."""
        x = x.transpose(2, 3)  # [N, C, BT, H, *D]
        out = torch.zeros(self.B * self.T, *x.shape[3:], dtype=dtype, device=x.device)
        out[self.token_index[self.valid]] = x[self.valid].to(dtype)
        return out.view(self.B, self.T, *x.shape[3:])

    # -- chunk states ------------------------------------------------------------------
    def gather_chunks(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """h `[B or 1, NT, H, K, V]` -> `[N, C, H, K, V]` (zeros for chunks past a sequence's end)."""
        flat = h.reshape(-1, *h.shape[2:]).to(dtype)
        ci = self.chunk_index
        out = flat[ci.clamp(min=0)]
        return out * (ci >= 0).view(*ci.shape, 1, 1, 1)

    def scatter_chunks(self, x: torch.Tensor, lead: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """`[N, C, H, K, V]` -> fresh `[lead0, lead1, H, K, V]` (the h tensor's layout)."""
        ci = self.chunk_index
        out = torch.zeros(lead[0] * lead[1], *x.shape[2:], dtype=dtype, device=x.device)
        out[ci[ci >= 0]] = x[ci >= 0].to(dtype)
        return out.view(*lead, *x.shape[2:])
