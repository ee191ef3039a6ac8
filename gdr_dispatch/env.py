"""Every `GDR_*` environment variable gdr_dispatch reads, read here and nowhere else.

Each is read when it matters (per call), so a test or a training script may change it between
calls; a value that cannot be used is an error naming the variable and what it takes.

| variable | meaning | default |
|---|---|---|
| `GDR_BACKEND` | force one backend, or `<backend>@split<n>`, for every backward call | unset: tables, autotune, static order |
| `GDR_FORWARD` | force the training op's forward provider (or `<provider>@split<n>`) | unset: a table entry, a measurement on a starved grid, else the lowest `forward_rank` that takes the call |
| `GDR_AUTOTUNE` | `0` turns autotuning on a table miss off (the static order runs) | on |
| `GDR_AUTOTUNE_ALL` | `1` makes a table miss measure every candidate (no pruning by the device's tables, no prediction from them) | off |
| `GDR_CP` | `<n>` cuts every sequence into at most n segments (the exact split); `0` turns the split off | unset: the tables and autotuner decide |
| `GDR_SPLIT_GRAPHS` | `0` runs the split eagerly on every call (no CUDA graphs of its own) | on |
| `GDR_EARLY_BUILDS` | `0`: the op's first forward at a new shape starts no early builds of its backward's kernels (a table-miss first call still compiles its candidates in parallel processes before timing them) | on |
| `GDR_SAVE_STATES` | the training op keeps the chunk states for its backward | off |
| `GDR_ALLOW_UNVERIFIED` | lets kernels whose GPU tests have not passed run | off |
| `GDR_TUNING_CACHE` | the user table directory | `$XDG_CACHE_HOME/gdr_dispatch` or `~/.cache/gdr_dispatch` |
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

BACKEND = "GDR_BACKEND"
FORWARD = "GDR_FORWARD"
AUTOTUNE = "GDR_AUTOTUNE"
AUTOTUNE_ALL = "GDR_AUTOTUNE_ALL"
CP = "GDR_CP"
SAVE_STATES = "GDR_SAVE_STATES"
SPLIT_GRAPHS = "GDR_SPLIT_GRAPHS"
EARLY_BUILDS = "GDR_EARLY_BUILDS"
ALLOW_UNVERIFIED = "GDR_ALLOW_UNVERIFIED"
TUNING_CACHE = "GDR_TUNING_CACHE"

#: What a backward call's choice of backend reads from the environment (with each backend's
#: `env_vars`, registry.decision_env): a call's plan is keyed on their values (plans.py).
#: XDG_CACHE_HOME and HOME locate the user table when GDR_TUNING_CACHE is unset.
DECIDING = (BACKEND, AUTOTUNE, AUTOTUNE_ALL, CP, ALLOW_UNVERIFIED, TUNING_CACHE, "XDG_CACHE_HOME", "HOME")
#: What the training op's choice of forward reads (with each backend's `env_vars`).
FORWARD_DECIDING = (FORWARD, AUTOTUNE, CP, ALLOW_UNVERIFIED, TUNING_CACHE, "XDG_CACHE_HOME", "HOME")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def flag(name: str, default: bool) -> bool:
    """A boolean variable; anything unrecognised is an error naming it."""
    raw = get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}: expected one of 1/0, true/false, yes/no, on/off, got {raw!r}")


def _name(var: str) -> Optional[str]:
    raw = (get(var) or "").strip()
    return raw or None


def forced_backend_name() -> Optional[str]:
    """`GDR_BACKEND`, stripped; None when unset or empty (the registry resolves and checks it)."""
    return _name(BACKEND)


def forced_forward_name() -> Optional[str]:
    """`GDR_FORWARD`, stripped; None when unset or empty."""
    return _name(FORWARD)


def autotune_on() -> bool:
    return flag(AUTOTUNE, True)


def autotune_all() -> bool:
    return flag(AUTOTUNE_ALL, False)


def split_graphs() -> bool:
    return flag(SPLIT_GRAPHS, True)


def early_builds() -> bool:
    return flag(EARLY_BUILDS, True)


def save_states() -> bool:
    return flag(SAVE_STATES, False)


def unverified_allowed() -> bool:
    return flag(ALLOW_UNVERIFIED, False)


def cp_segments() -> Optional[int]:
    """`GDR_CP`: None when unset, 0 (off) or the number of segments per sequence."""
    raw = get(CP)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{CP}: expected a number of segments per sequence (0 turns the split off), "
                         f"got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{CP}: expected 0 or more segments per sequence, got {value}")
    return value


def snapshot(names: tuple[str, ...]) -> tuple:
    """The raw values of `names` (None where unset), compared, never interpreted: a hot-path
    key. Read from `os.environ`'s own mapping (about 80 ns a variable; `os.environ.get` of an
    unset one raises and catches a KeyError inside, about 1.5 us)."""
    raw = getattr(os.environ, "_data", None)
    if raw is None:  # not CPython's os.environ: the public reads, same values
        return tuple(os.environ.get(n) for n in names)
    return tuple(map(raw.get, _encoded(names)))


def get(name: str) -> Optional[str]:
    """`os.environ.get(name)`, as cheap for an unset variable as for a set one (`snapshot`)."""
    raw = getattr(os.environ, "_data", None)
    if raw is None:
        return os.environ.get(name)
    value = raw.get(_encoded((name,))[0])
    return None if value is None else os.environ.decodevalue(value)


def _encoded(names: tuple[str, ...]) -> tuple:
    keys = _ENCODED.get(names)
    if keys is None:
        keys = _ENCODED[names] = tuple(os.environ.encodekey(n) for n in names)
    return keys


_ENCODED: dict = {}


def user_table_dir() -> Path:
    """`GDR_TUNING_CACHE`, else `$XDG_CACHE_HOME/gdr_dispatch`, else `~/.cache/gdr_dispatch`."""
    env = os.environ.get(TUNING_CACHE)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gdr_dispatch"
