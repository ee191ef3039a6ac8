"""gdr_dispatch: the backward pass of the chunked gated delta rule, on the fastest correct backend.

    from gdr_dispatch import fused_gdr_bwd
    grads = fused_gdr_bwd(q, k, v, a, g, b, do, dht, h, scale=..., initial_state=h0)

The contract is docs/contract.md; `gdr-dispatch explain` shows which backend a shape gets.
"""

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path


def _map_source_subpackage(name: str) -> None:
    """Source checkouts: load `<repo>/<name>/` as `gdr_dispatch.<name>`.

    An install (wheel or editable) maps `backends/` and `tuning_cache/` into this package
    through pyproject.toml's package-dir; a bare checkout on PYTHONPATH (the GPU machine)
    has no such mapping, so it is made here. A checkout imported ahead of an editable install
    of another checkout (a second worktree run from its own directory) takes its own folders,
    not the ones the install maps.
    """
    full = f"{__name__}.{name}"
    if full in _sys.modules:
        return
    here = _Path(__file__).resolve().parent
    init = here.parent / name / "__init__.py"
    found = _ilu.find_spec(full)
    if found is not None and found.origin and here in _Path(found.origin).resolve().parents:
        return  # a wheel: the folder ships inside this package
    if not (init.is_file() and (here.parent / "pyproject.toml").is_file()):
        return  # not a checkout: the import fails or succeeds on its own
    if found is not None and found.origin and _Path(found.origin).resolve() == init:
        return  # an editable install of this very checkout
    spec = _ilu.spec_from_file_location(full, init, submodule_search_locations=[str(init.parent)])
    module = _ilu.module_from_spec(spec)
    _sys.modules[full] = module
    setattr(_sys.modules[__name__], name, module)
    spec.loader.exec_module(module)


# registry first: the backend modules import it while they load
from . import registry  # noqa: E402

_map_source_subpackage("tuning_cache")
_map_source_subpackage("backends")

from .contract import GDRCall, GDRGrads  # noqa: E402
from .dispatch import clear_caches, fused_gdr_bwd, select_backend  # noqa: E402
from .problem import Problem  # noqa: E402
from .reference import oracle_grads, prepare_residuals, recurrent_forward  # noqa: E402
from .registry import Backend, Limits, NoBackendError, get_backend, register, registered_backends  # noqa: E402
from .training import chunk_gated_delta_rule  # noqa: E402

__all__ = [
    "fused_gdr_bwd", "chunk_gated_delta_rule", "select_backend", "clear_caches", "GDRGrads", "GDRCall", "Problem",
    "Backend", "Limits", "NoBackendError", "registered_backends", "get_backend", "register", "oracle_grads",
    "prepare_residuals", "recurrent_forward",
]
__version__ = "0.2.0"

from . import backends  # noqa: E402,F401  (registers every backend)
