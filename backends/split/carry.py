"""What the training op's split forward hands its split backward: the decay plan, the exact
segments' maps and every segment's completed start state, so that the backward runs none of
pass 1's plan, forward walk or forward chain again (docs/kernels.md, "The split"; FlashQLA's
`auto_cp` keeps the same on its autograd context).

They travel by the op's side channel (gdr_dispatch/carry.py: on the op's autograd context,
eager calls only; traced calls carry nothing). A split forward inside it returns the three
tensors beside its outputs and `keep`s them; a split backward `take`s them where they are this
call's: the residual `G` the forward returned (its storage, offset, shape and strides), the same
`k`, `beta`, `a` and `initial_state`, and the same segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gdr_dispatch import carry as channel
from gdr_dispatch.registry import unverified_allowed

#: Whether the GPU tests of the backward on the forward's carried plan, maps and starts
#: (tests/test_gpu.py) have passed; while False they are carried only with GDR_ALLOW_UNVERIFIED=1.
GPU_VERIFIED = True


@dataclass(frozen=True)
class Carried:
    token_offsets: tuple  # the segments' (passes.Segments.token_offsets)
    plan: torch.Tensor  # [S, H, 2] int32, passes.pass_1's
    M: torch.Tensor  # [S, H, K, K], the exact segments' maps
    starts: torch.Tensor  # [S, H, K, V] in the accumulation dtype, every segment's start state (pass 2's)
    where: tuple  # G's (storage pointer, storage offset, shape, strides)
    inputs: tuple  # the data pointers of k, v, beta, a and initial_state (0 for none)


def allowed() -> bool:
    return GPU_VERIFIED or unverified_allowed()


def wanted() -> bool:
    """Whether a split forward should return what its backward can reuse."""
    return channel.wanted() and allowed()


def _where(t: torch.Tensor) -> tuple:
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride())


def _inputs(k, v, beta, a, initial_state) -> tuple:
    return (k.data_ptr(), v.data_ptr(), beta.data_ptr(), a.data_ptr(),
            0 if initial_state is None else initial_state.data_ptr())


def keep(G: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, a: torch.Tensor, initial_state,
         token_offsets: tuple, plan: torch.Tensor, M: torch.Tensor, starts: torch.Tensor) -> None:
    channel.keep(Carried(tuple(token_offsets), plan, M, starts, _where(G), _inputs(k, v, beta, a, initial_state)))


def take(g: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, a: torch.Tensor, initial_state,
         token_offsets: tuple) -> Optional[Carried]:
    """The offered forward's carry when it is this backward's (its residual `g`, its `k`, `v`,
    `beta`, `a` and `initial_state`, its segments `token_offsets`), else None: the backward then
    runs all of pass 1."""
    entry = channel.offered()
    if (not isinstance(entry, Carried) or not allowed() or entry.where != _where(g)
            or entry.token_offsets != tuple(token_offsets) or entry.inputs != _inputs(k, v, beta, a, initial_state)):
        return None
    return entry
