"""Version strings and compiler and module lookups that several backends' `supported` predicates
read. The lookups touch the file system, so each answer is kept per input (the environment
values it reads) until `dispatch.clear_caches()`: a `supported` check on every call costs a
dictionary lookup, not a walk of PATH."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from . import caches

#: The environment variables `nvcc_found` reads: a verdict that uses it depends on them.
NVCC_ENV = ("CUDA_HOME", "CUDA_PATH", "PATH")


def version_tuple(v: str) -> tuple[int, ...]:
    """'3.7.1rc1+git12' -> (3, 7, 1): the leading digits of the first three fields."""
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        m = re.match(r"\d+", part)
        out.append(int(m.group()) if m else 0)
    return tuple(out + [0] * (3 - len(out)))


def nvcc_found() -> bool:
    """An nvcc for a JIT (TileLang's): $CUDA_HOME/$CUDA_PATH, PATH, or /usr/local/cuda."""
    return _nvcc_at(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"), os.environ.get("PATH"))


@functools.lru_cache(maxsize=64)
def _nvcc_at(cuda_home: Optional[str], path: Optional[str]) -> bool:
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return True
    return shutil.which("nvcc", path=path) is not None or Path("/usr/local/cuda/bin/nvcc").exists()


@functools.lru_cache(maxsize=64)
def module_found(name: str) -> bool:
    """Whether `import name` would find a module (`importlib.util.find_spec`), once per name."""
    return importlib.util.find_spec(name) is not None


caches.on_clear(_nvcc_at.cache_clear)
caches.on_clear(module_found.cache_clear)
