"""What a CUDA-graph-captured step needs on the host side: the lengths of a `cu_seqlens` tensor,
and the small index tensors built from them, made once.

Capture forbids reading device values on the host (a synchronisation) and copying pageable host
memory to the device, and a captured step replays with the lengths it was captured with. So:

* Eager calls read `cu_seqlens` on every call (one device-to-host copy, as fla's varlen path
  makes): a buffer refilled in place by any means (numpy, `.data`, DLPack, a kernel) is read as
  it is now. Each read is also remembered for that tensor object. A copy only gdr_dispatch holds
  (the op's private copy for its backward, `remember_private`) is never read: its values are known.
* Under capture the lengths come from that memory only: the last eager read of the very same
  tensor. A tensor never read eagerly is an error that says what to run first (an eager step with
  the same tensors), never a silent read. The graph then replays with those lengths, whatever the
  buffer holds later: that is what capturing a varlen step means.

Index tensors are built once per content and kept (bounded; one that a capture of the caller's
used is never evicted, since that graph reads it at every replay; one the split's own graphs read
is kept while one of them holds it: `graph_owned_pins`).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections import OrderedDict
from typing import Optional

import torch

from . import caches

#: id(cu_seqlens) -> (weak reference to it, its offsets at the last eager read)
_offsets: dict[int, tuple] = {}
#: ids of the 1-D index tensors `device_constant` built: their `_offsets` entry is their content
_immutable: set = set()
_constants: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
#: keys a capture of the caller's used (a graph whose lifetime we cannot see: kept for good)
_pinned: set = set()
#: key -> how many of the split's own graphs read it (`graph_owned_pins`; released with them)
_owned: dict = {}
_owning: list = []  # the key sets of the captures of our own under way
#: Index tensors kept (least recently used go first, never one a graph reads: `_pinned`, `_owned`).
MAX_CONSTANTS = 1024


@caches.on_clear
def _forget() -> None:
    _offsets.clear()
    _immutable.clear()
    _owned.clear()  # (the split's graphs go with the same clear)
    for key in [k for k in _constants if k not in _pinned]:
        del _constants[key]


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def offsets_of(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """`cu_seqlens`' values on the host: read on every eager call, from the last eager read of
    the same tensor under graph capture; never read for an index tensor `device_constant` built
    (its values are known and nobody writes it)."""
    if id(cu_seqlens) in _immutable:
        offsets = remembered(cu_seqlens)
        if offsets is not None:
            return offsets
    if capturing(cu_seqlens.device):
        offsets = remembered(cu_seqlens)
        if offsets is None:
            raise RuntimeError(
                "cu_seqlens: its values are needed on the host, which a CUDA graph capture cannot read; run one "
                "eager step with this very cu_seqlens tensor before capturing (the graph then replays with its "
                "lengths)")
        return offsets
    offsets = tuple(int(x) for x in cu_seqlens.tolist())
    remember(cu_seqlens, offsets)  # for a capture that may follow
    return offsets


def remembered(cu_seqlens: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The values last read (or recorded) for this very tensor, None if none were; reads nothing."""
    hit = _offsets.get(id(cu_seqlens))
    return hit[1] if hit is not None and hit[0]() is cu_seqlens else None


def remember(cu_seqlens: torch.Tensor, offsets: tuple[int, ...]) -> None:
    """Record `offsets` as `cu_seqlens`' values (a weak reference: the entry dies with the tensor):
    what `offsets_of` does after each eager read, and what a caller does for a private copy it made
    of a tensor whose values it read (the op's backward runs on the forward's lengths so)."""
    key = id(cu_seqlens)
    hit = _offsets.get(key)
    if hit is None or hit[0]() is not cu_seqlens:
        def gone(_ref, key=key):
            _offsets.pop(key, None)
            _immutable.discard(key)

        hit = (weakref.ref(cu_seqlens, gone),)
    _offsets[key] = (hit[0], tuple(offsets))


def remember_private(cu_seqlens: torch.Tensor, offsets: tuple[int, ...]) -> None:
    """`remember` for a copy only gdr_dispatch holds and nothing writes (the op's private copy of
    `cu_seqlens` for its backward): its values are never read from the device again, so the
    backward's checks wait on nothing."""
    remember(cu_seqlens, offsets)
    _immutable.add(id(cu_seqlens))


#: inside `copied_graph_inputs`, in this thread (or task) only: another thread's calls keep their
#: in-place replays while one autotunes
_measuring: contextvars.ContextVar = contextvars.ContextVar("gdr_dispatch_copied_graph_inputs", default=False)


@contextlib.contextmanager
def copied_graph_inputs():
    """Inside: the split's graphs copy their inputs in even where they could read them in place
    (backends/split/graphs.py). The autotuner times its candidates so: it calls each on the same
    tensors again and again, while a model whose layers share a shape hands them new addresses."""
    token = _measuring.set(True)
    try:
        yield
    finally:
        _measuring.reset(token)


def graph_inputs_copied() -> bool:
    return _measuring.get()


def device_constant(values: tuple, dtype: torch.dtype, device: torch.device,
                    shape: Optional[tuple] = None) -> torch.Tensor:
    """A read-only device tensor holding `values` (viewed as `shape`), built once per content."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    key = (values, dtype, device, shape)
    t = _kept(key, device)
    if t is not None:
        return t
    if capturing(device):
        raise RuntimeError(
            "gdr_dispatch: an index tensor for these sequence lengths would be copied to the device during "
            "CUDA graph capture; run one eager step with the same lengths before capturing")
    t = torch.tensor(values, dtype=dtype)
    t = (t.view(shape) if shape is not None else t).to(device)
    if shape is None and not dtype.is_floating_point:  # an offsets-like vector: its values, unread
        remember(t, values)
        _immutable.add(id(t))
    return _keep(key, t)


def zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A read-only tensor of zeros, built once per shape, dtype and device: an absent input that a
    kernel reads (a `dht` of none) without a fill launch per call. Nothing may write it. Built
    fresh, not kept, when first asked for during a CUDA graph capture."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    key = ("zeros", tuple(shape), dtype, device)
    t = _kept(key, device)
    if t is not None:
        return t
    t = torch.zeros(shape, dtype=dtype, device=device)
    if capturing(device):  # allocated in the graph's pool: that graph's own
        return t
    return _keep(key, t)


def _kept(key: tuple, device: torch.device) -> Optional[torch.Tensor]:
    """The kept tensor of `key`, most recently used now, or None; one a capture reads is pinned (a
    graph reads it at every replay): for good, or for the graph's life where the split captures its
    own (`graph_owned_pins`). The hot path: one capture check."""
    t = _constants.get(key)
    if t is not None:
        _constants.move_to_end(key)
        if key not in _pinned and capturing(device):
            if _owning:
                _owning[-1].add(key)
            else:
                _pinned.add(key)
    return t


def _keep(key: tuple, t: torch.Tensor) -> torch.Tensor:
    """Keep `t` under `key`, dropping the least recently used unpinned tensors past MAX_CONSTANTS."""
    _constants[key] = t
    spare = [k for k in _constants if k not in _pinned and k not in _owned]
    for old in spare[:max(0, len(_constants) - MAX_CONSTANTS)]:
        del _constants[old]
    return t


@contextlib.contextmanager
def graph_owned_pins():
    """Around a capture of the split's own graph (backends/split/graphs.py): the kept tensors it
    reads are pinned for that graph only, not for good; yields the set of their keys, which the
    graph hands back to `release_pins` when it is dropped."""
    keys: set = set()
    _owning.append(keys)
    try:
        yield keys
    finally:
        _owning.pop()
        for key in keys:
            _owned[key] = _owned.get(key, 0) + 1


def release_pins(keys) -> None:
    """A dropped graph's pins (`graph_owned_pins`): each key no graph reads any more may be evicted."""
    for key in keys or ():
        n = _owned.get(key, 0) - 1
        if n > 0:
            _owned[key] = n
        else:
            _owned.pop(key, None)
