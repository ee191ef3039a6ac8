"""Plans: what a repeated call reuses instead of checking and deciding again (docs/design.md,
"The hot path").

A training step calls the backward (and the op's forward) with the same shapes, dtypes and
devices layer after layer, step after step. The first call with a key is checked and decided in
full, and what it found (the structural checks passed, the backend chosen) is kept under the key;
a later call with the same key reads only what changes per call: `cu_seqlens`' values (on every
eager call, the contract) and what depends on them.

A key is everything those checks and that choice read, and nothing per call: the arguments'
`contract.signature` (each tensor's type, shape, dtype, device; the scalars with their types),
the raw values of the environment variables that decide (`registry.decision_env`: the `GDR_*`
ones and each backend's, e.g. PATH for nvcc), and the registry's state (its generation, the
backends hidden here, the unverified gate). A changed variable, backend or gate is a new key;
`dispatch.clear_caches()` forgets every plan (after a table was edited by hand).
"""

from __future__ import annotations

from typing import Optional

from . import caches, env, registry
from .contract import backward_signature, signature

#: key -> dispatch's plan of a backward call
backward = caches.memo("backward plans", limit=1024)
#: key -> training's plan of the op's forward
forward = caches.memo("forward plans", limit=1024)


def backward_key(*args) -> Optional[tuple]:
    """The key of a `fused_gdr_bwd` call (its arguments in `contract.backward_signature`'s order);
    None when an argument is of a kind only the checked path handles."""
    sig = backward_signature(*args)
    if sig is None:
        return None
    return sig, env.snapshot(registry.decision_env()), registry.state()


def forward_key(*args) -> Optional[tuple]:
    """The key of the op's forward (its arguments in order); None as for `backward_key`."""
    sig = signature(*args)
    if sig is None:
        return None
    return sig, env.snapshot(registry.forward_env()), registry.state()
