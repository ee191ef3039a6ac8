"""Version strings and compiler lookups that several backends' `supported` predicates read."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path


def version_tuple(v: str) -> tuple[int, ...]:
    """'3.7.1rc1+git12' -> (3, 7, 1): the leading digits of the first three fields."""
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        m = re.match(r"\d+", part)
        out.append(int(m.group()) if m else 0)
    return tuple(out + [0] * (3 - len(out)))


def nvcc_found() -> bool:
    """An nvcc for a JIT (TileLang's): $CUDA_HOME/$CUDA_PATH, PATH, or /usr/local/cuda."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return True
    return shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
