"""What a CUDA-graph-captured step needs on the host side: the lengths of a `cu_seqlens` tensor
read once, and the small index tensors built from them made once.

Capture forbids reading device values on the host (a synchronisation) and copying pageable
host memory to the device, and a captured step replays with the lengths it was captured with.
So the offsets of a `cu_seqlens` tensor are read on its first eager use and remembered for that
very tensor object (and its version counter: an in-place change reads them again), and index
tensors are built once per content and kept. Under capture, a tensor or content not seen
before is an error that says what to run first (an eager step with the same tensors), never a
silent read. Index tensors that a capture used are never evicted (a graph reads them at replay).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Optional

import torch

#: id(cu_seqlens) -> (weak reference to it, its version counter then, its offsets)
_offsets: dict[int, tuple] = {}
_constants: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_pinned: set = set()
#: Index tensors kept (least recently used go first, never one a capture used).
MAX_CONSTANTS = 1024


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def offsets_of(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """`cu_seqlens`' values on the host: read once per tensor (one device-to-host copy),
    from memory afterwards, and only from memory under graph capture."""
    key = id(cu_seqlens)
    if cu_seqlens.is_inference():  # no version counter to guard a memory with: read every time
        return tuple(int(x) for x in cu_seqlens.tolist())
    hit = _offsets.get(key)
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
        return hit[2]
    if capturing(cu_seqlens.device):
        raise RuntimeError(
            "cu_seqlens: its values are needed on the host, which a CUDA graph capture cannot read; run one "
            "eager step with this very cu_seqlens tensor before capturing (the graph then replays with its "
            "lengths)")
    offsets = tuple(int(x) for x in cu_seqlens.tolist())
    ref = weakref.ref(cu_seqlens, lambda _ref, key=key: _offsets.pop(key, None))
    _offsets[key] = (ref, cu_seqlens._version, offsets)
    return offsets


def device_constant(values: tuple, dtype: torch.dtype, device: torch.device,
                    shape: Optional[tuple] = None) -> torch.Tensor:
    """A read-only device tensor holding `values` (viewed as `shape`), built once per content."""
    device = torch.device(device)
    key = (values, dtype, str(device), shape)
    t = _constants.get(key)
    if t is None:
        if capturing(device):
            raise RuntimeError(
                "gdr_dispatch: an index tensor for these sequence lengths would be copied to the device during "
                "CUDA graph capture; run one eager step with the same lengths before capturing")
        t = torch.tensor(values, dtype=dtype)
        t = (t.view(shape) if shape is not None else t).to(device)
        _constants[key] = t
        for old in [k for k in _constants if k not in _pinned][:max(0, len(_constants) - MAX_CONSTANTS)]:
            del _constants[old]
    else:
        _constants.move_to_end(key)
    if capturing(device):
        _pinned.add(key)
    return t
