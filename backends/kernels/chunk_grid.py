"""The chunk grid shared by chunk-parallel kernels: which (sequence, chunk) a program owns.

fla's convention, so its stages and ours can share one table: for varlen calls a
`[num_chunks, 2]` tensor of (sequence index, chunk index within the sequence), in order, so
that row i is also chunk i of the `h` tensor. Built on the host from the sequence lengths
the contract already validated, which costs no device synchronisation.
"""

from __future__ import annotations

from typing import Sequence

import torch


def varlen_chunk_indices(seq_lens: Sequence[int], chunk_size: int, device, dtype=torch.int32) -> torch.Tensor:
    rows = [(n, c) for n, length in enumerate(seq_lens) for c in range(-(-length // chunk_size))]
    return torch.tensor(rows, dtype=dtype).view(-1, 2).to(device)
