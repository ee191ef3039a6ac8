"""The process's caches, in one place: every memo of what gdr_dispatch decided or found (plans,
decisions, verdicts, tables read) is made here, so that one call (`clear`, also
`dispatch.clear_caches`) forgets them all, and each is bounded. Pure functions of their
arguments (a packing test per shapes, segments and chunk offsets per lengths) keep a bounded
`functools.lru_cache` beside their code, and per-process facts (library versions, a device's
properties) an unbounded one: nothing there goes stale or grows with the calls.

Why bounded: a training run with varlen packing presents a new exact shape every step; a memo
keyed on it would grow by an entry per step. Memos here are keyed by bucketed table keys or
other short strings and evict their oldest entries past `limit`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Optional

_all: dict[str, "Memo"] = {}
_hooks: list[Callable[[], None]] = []


class Memo(OrderedDict):
    """A dict that keeps at most `limit` entries (least recently set go first); `on_evict(key,
    value)` hears of each entry the limit pushes out."""

    def __init__(self, name: str, limit: int, on_evict: Optional[Callable] = None):
        super().__init__()
        self.name, self.limit, self.on_evict = name, limit, on_evict

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            old = self.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(*old)


def memo(name: str, limit: int = 4096, on_evict: Optional[Callable] = None) -> Memo:
    """The process-wide memo called `name` (made on first use)."""
    if name not in _all:
        _all[name] = Memo(name, limit, on_evict)
    return _all[name]


def on_clear(hook: Callable[[], None]) -> Callable[[], None]:
    """Run `hook` on every `clear` (for caches kept elsewhere, e.g. `functools.lru_cache`)."""
    _hooks.append(hook)
    return hook


def clear() -> None:
    """Forget every memo and run every hook."""
    for m in _all.values():
        m.clear()
    for hook in _hooks:
        hook()


def sizes() -> dict[str, int]:
    """Entries per memo (tests bound them)."""
    return {name: len(m) for name, m in _all.items()}


_said = memo("log once", limit=1024)


def first_time(key: Hashable) -> bool:
    """True the first time this process sees `key` (recently), False after: the log lines that
    say once per problem what ran. Keys are short: a word naming the line and the problem's
    bucketed table key, so a varlen run adds none per step."""
    if key in _said:
        return False
    _said[key] = True
    return True
