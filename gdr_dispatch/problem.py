"""What the dispatcher knows about a call before running it: `Problem` (shapes, dtypes, flags,
device, library versions; never tensor values), the device it runs on and its table key.

A backend decides from a `Problem` alone whether it can take a call, so its verdict can be
cached and printed by `gdr-dispatch explain` for shapes never allocated.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

import torch

from .contract import GDRCall


@functools.lru_cache(maxsize=None)
def library_versions() -> dict[str, Optional[str]]:
    """Installed versions of the libraries the backends compile with (None when absent)."""

    def dist(*names: str) -> Optional[str]:
        for n in names:
            try:
                return metadata.version(n)
            except metadata.PackageNotFoundError:
                continue
        return None

    return {
        "torch": torch.__version__.split("+")[0],
        "triton": dist("triton", "pytorch-triton"),
        "tilelang": dist("tilelang"),
        "fla": dist("fla-core", "flash-linear-attention"),
        "flash_qla": dist("flash-qla", "flash_qla"),
    }


#: Libraries a table key names only when installed (optional peers): without them every key
#: stays what it was, so tables measured before a peer existed keep their exact matches.
OPTIONAL_LIBS = ("flash_qla",)


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cuda" or "cpu"
    name: str
    capability: Optional[tuple[int, int]]
    sm_count: int  # CPU: logical cores

    @property
    def slug(self) -> str:
        """File-name form: `nvidia-h200-sm90`, `cpu`."""
        if self.type != "cuda":
            return "cpu"
        base = "".join(c if c.isalnum() else "-" for c in self.name.lower()).strip("-")
        while "--" in base:
            base = base.replace("--", "-")
        return f"{base}-sm{self.capability[0]}{self.capability[1]}"


@functools.lru_cache(maxsize=None)
def _cuda_device_info(index: int) -> DeviceInfo:
    p = torch.cuda.get_device_properties(index)
    return DeviceInfo("cuda", p.name, (p.major, p.minor), p.multi_processor_count)


@functools.lru_cache(maxsize=None)
def _host_device_info(device_type: str) -> DeviceInfo:
    return DeviceInfo(device_type, device_type, None, os.cpu_count() or 1)


def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        return _cuda_device_info(device.index if device.index is not None else torch.cuda.current_device())
    return _host_device_info(device.type)


def pow2_bucket(x: float) -> int:
    """Round up to a power of two (1 for anything <= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


@dataclass(frozen=True)
class Problem:
    """What the dispatcher knows about a call before running it (shapes, never tensor values)."""

    B: int
    T: int
    H: int
    Hg: int
    K: int
    V: int
    N: int  # sequences
    chunk_size: int
    num_chunks: int  # over all sequences
    max_seqlen: Optional[int]  # longest sequence: T for a fixed-length batch, the caller's max_seqlen for varlen
    dtype: str  # of q/k/v/do
    a_dtype: str
    b_dtype: str
    h_dtype: Optional[str]  # None when h is not given
    state_dtype: Optional[str]  # of initial_state/dht, None when neither is given
    varlen: bool
    h_given: bool
    has_dht: bool
    has_initial_state: bool
    state_v_first: bool
    device: DeviceInfo
    versions: tuple[tuple[str, Optional[str]], ...]
    forward: bool = False  # the training op's forward (its own table entries: gdr_dispatch/training.py)

    @property
    def grouped(self) -> bool:
        return self.H > self.Hg

    @property
    def seq_head_ctas(self) -> int:
        """CTAs of a kernel with one CTA per (sequence, value head): the fused backward."""
        return self.N * self.H

    @property
    def chunk_ctas(self) -> int:
        """CTAs of a chunk-parallel kernel (one per chunk x head): fla's stages 3, 5, 6."""
        return self.num_chunks * self.H

    @property
    def flags(self) -> tuple[str, ...]:
        names = ("varlen", "grouped", "h_given", "has_dht", "has_initial_state", "state_v_first", "forward")
        return tuple(n for n in names if getattr(self, n))

    def version(self, lib: str) -> Optional[str]:
        return dict(self.versions).get(lib)

    def problem_key(self) -> str:
        """What decides which backend is fastest, bucketed so that training runs reuse keys.

        Sequences x heads count in waves of the device's SMs (rounded up to a power of two),
        the total tokens and the longest sequence in powers of two: packed batches with a
        varying number of sequences share a handful of keys. The longest sequence sets a
        per-sequence kernel's time; for varlen calls it comes from the caller's `max_seqlen`
        (never from reading `cu_seqlens`), `-` when not given.
        """
        cap = "cpu" if self.device.capability is None else f"sm{self.device.capability[0]}{self.device.capability[1]}"
        flags = "+".join(self.flags) or "none"
        waves = pow2_bucket(self.seq_head_ctas / max(self.device.sm_count, 1))
        longest = "-" if self.max_seqlen is None else pow2_bucket(self.max_seqlen)
        return (
            f"{self.device.name}|{cap}|{self.dtype}|K{self.K}|V{self.V}|H{self.H}|Hg{self.Hg}"
            f"|BT{self.chunk_size}|{flags}|waves{waves}|tokens{pow2_bucket(self.B * self.T)}|max{longest}"
        )

    def versions_key(self) -> str:
        return ",".join(f"{k}={v or '-'}" for k, v in self.versions if v or k not in OPTIONAL_LIBS)

    def table_key(self) -> str:
        """The tuning-table key: the problem, then the library versions it was measured with."""
        return f"{self.problem_key()}|{self.versions_key()}"

    def describe(self) -> str:
        """Short human form for logs and tables."""
        if self.varlen:
            seqs = f"N{self.N} (varlen" + (f", max {self.max_seqlen})" if self.max_seqlen else ")")
        else:
            seqs = f"B{self.B}"
        return (
            f"{seqs} T{self.T} H{self.H} Hg{self.Hg} K{self.K} V{self.V} {self.dtype}"
            f" h={'given' if self.h_given else 'None'}"
            + (" dht" if self.has_dht else "") + (" h0" if self.has_initial_state else "")
            + (" v_first" if self.state_v_first else "") + (" (forward)" if self.forward else "")
        )

    @staticmethod
    def from_call(call: GDRCall) -> "Problem":
        def dt(x):
            return None if x is None else str(x.dtype).replace("torch.", "")

        state = call.initial_state if call.initial_state is not None else call.dht
        varlen = call.cu_seqlens is not None
        return Problem(
            B=call.B, T=call.T, H=call.H, Hg=call.Hg, K=call.K, V=call.V, N=call.N,
            chunk_size=call.chunk_size, num_chunks=call.num_chunks,
            max_seqlen=call.max_seqlen if varlen else call.T,
            dtype=dt(call.q), a_dtype=dt(call.a), b_dtype=dt(call.b), h_dtype=dt(call.h),
            state_dtype=dt(state), varlen=varlen, h_given=call.h is not None,
            has_dht=call.dht is not None, has_initial_state=call.initial_state is not None,
            state_v_first=call.state_v_first, device=device_info(call.q.device),
            versions=tuple(library_versions().items()),
        )
