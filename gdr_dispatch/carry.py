"""A side channel from the training op's eager forward to its backward: what a provider's
forward keeps for its own backward (the split's plan, maps and start states:
backends/split/carry.py), held on the op's autograd context, so it lives exactly as long as
the backward can run. The op opens `keeping` around its forward and `offering` around its
backward; what travels is the provider's own business."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

_keeping: contextvars.ContextVar = contextvars.ContextVar("gdr_dispatch keeping", default=None)
_offered: contextvars.ContextVar = contextvars.ContextVar("gdr_dispatch offered", default=None)


@contextlib.contextmanager
def keeping(on: bool = True) -> Iterator[list]:
    """Within (when `on`): a forward may `keep` one object for its backward, into the list yielded."""
    token, held = open_keeping() if on else (None, [])
    try:
        yield held
    finally:
        if token is not None:
            close_keeping(token)


def open_keeping() -> tuple:
    """`keeping` without a context manager (the op's hot path): `(token, held)`; then `close_keeping(token)`."""
    held: list = []
    return _keeping.set(held), held


def close_keeping(token) -> None:
    _keeping.reset(token)


def keep(item: Any) -> bool:
    """Hand `item` to the op's backward; False (nothing kept) outside `keeping`."""
    held = _keeping.get()
    if held is None:
        return False
    held[:] = [item]
    return True


def discard() -> None:
    """Drop what a forward kept so far (a measurement's candidates, before the pick runs)."""
    held = _keeping.get()
    if held is not None:
        held.clear()


def wanted() -> bool:
    return _keeping.get() is not None


@contextlib.contextmanager
def offering(item: Optional[Any]) -> Iterator[None]:
    """Within: the backward's providers may read `item` (`offered`)."""
    token = _offered.set(item)
    try:
        yield
    finally:
        _offered.reset(token)


def offered() -> Optional[Any]:
    return _offered.get()
