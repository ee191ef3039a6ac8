"""The backends of gdr_dispatch; installed as `gdr_dispatch.backends` (see pyproject.toml).

Importing a backend module registers it. A backend whose libraries are missing still
registers: its `supported` predicate then says what is missing. The exception is an optional
peer (`flash_qla`), registered only when installed. `split` registers the exact split, the
wrapper that runs any of them on segments of a long sequence. `kernels.l2norm` registers the
HF hook's q/k normalisation (`registry.register_kernel`).
"""

from . import exact_torch  # noqa: F401
from . import fla_chain  # noqa: F401
from . import flash_qla  # noqa: F401
from . import tilelang_fused  # noqa: F401
from . import triton_wide  # noqa: F401
from . import triton_transposed  # noqa: F401
from . import split  # noqa: F401
from .kernels import l2norm  # noqa: F401
