"""The backend registry and the `Problem` every backend's `supported` predicate reads.

A backend says whether it can take a call from the `Problem` alone (shapes, dtypes, flags,
device, library versions), never from tensor values, so the verdict can be cached and
printed by `gdr-dispatch explain` for shapes that were never allocated. It lists *every*
reason it says no, not only the first, so that a user learns at once all that stands in
the way.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

import torch

from .contract import GDRCall, GDRGrads

#: Preference when nothing was measured (GDR_AUTOTUNE=0, CPU tensors, CUDA graph capture):
#: the order of the measurements, not of the hopes. On the H200 (2026-11-29, bf16, K = V =
#: 128, the h200-train tune of 10 shapes) `fla` won 9; `triton_wide` was 1.10-1.31x slower
#: than fla at all 10; `tilelang_fused` (not yet warp-specialised) won varlen 8x4096 Hg16
#: with h given (5.62 against fla's 6.39 ms) and was 1.07-3.8x slower at the other nine;
#: `triton_transposed` is refused on sm90 (slower than triton_wide at every shape tried),
#: so it and `tilelang_fused` (sm90 only) never compete. Names not registered are skipped.
STATIC_PREFERENCE = ("fla", "triton_wide", "triton_transposed", "tilelang_fused", "torch")


def unverified_reason(note: str = "") -> str:
    """The reason a kernel backend whose module says `GPU_VERIFIED = False` gives."""
    return ("not verified on a GPU in this build (GPU_VERIFIED is False): refused until tests/test_gpu.py "
            "passes for it" + (f"; {note}" if note else ""))


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
    }


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


def tokens_bucket(tokens: float) -> int:
    """Round tokens-per-sequence up to a power of two, so varlen batches share table keys."""
    return 1 << max(0, math.ceil(math.log2(max(tokens, 1.0))))


@dataclass(frozen=True)
class Problem:
    """What the dispatcher knows about a call before running it."""

    B: int
    T: int
    H: int
    Hg: int
    K: int
    V: int
    N: int  # sequences
    chunk_size: int
    num_chunks: int  # over all sequences
    max_seq_len: int
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
    def tokens_per_seq_bucket(self) -> int:
        return tokens_bucket(self.B * self.T / self.N)

    @property
    def flags(self) -> tuple[str, ...]:
        names = ("varlen", "grouped", "h_given", "has_dht", "has_initial_state", "state_v_first")
        return tuple(n for n in names if getattr(self, n))

    def version(self, lib: str) -> Optional[str]:
        return dict(self.versions)[lib]

    def table_key(self) -> str:
        """The tuning-table key: what decides which backend is fastest, nothing more.

        Tokens per sequence are bucketed to powers of two so varlen training, whose
        sequence lengths change every step, reuses a handful of keys.
        """
        cap = "cpu" if self.device.capability is None else f"sm{self.device.capability[0]}{self.device.capability[1]}"
        vers = ",".join(f"{k}={v or '-'}" for k, v in self.versions)
        flags = "+".join(self.flags) or "none"
        return (
            f"{self.device.name}|{cap}|{vers}|{self.dtype}|K{self.K}|V{self.V}|H{self.H}|Hg{self.Hg}"
            f"|BT{self.chunk_size}|{flags}|NH{self.seq_head_ctas}|tps{self.tokens_per_seq_bucket}"
        )

    def describe(self) -> str:
        """Short human form for logs and tables."""
        seqs = f"N{self.N} (varlen, max {self.max_seq_len})" if self.varlen else f"B{self.B}"
        return (
            f"{seqs} T{self.T} H{self.H} Hg{self.Hg} K{self.K} V{self.V} {self.dtype}"
            f" h={'given' if self.h_given else 'None'}"
            + (" dht" if self.has_dht else "") + (" h0" if self.has_initial_state else "")
            + (" v_first" if self.state_v_first else "")
        )

    @staticmethod
    def from_call(call: GDRCall) -> "Problem":
        def dt(x):
            return None if x is None else str(x.dtype).replace("torch.", "")

        state = call.initial_state if call.initial_state is not None else call.dht
        return Problem(
            B=call.B, T=call.T, H=call.H, Hg=call.Hg, K=call.K, V=call.V, N=call.N,
            chunk_size=call.chunk_size, num_chunks=call.num_chunks, max_seq_len=max(call.seq_lens),
            dtype=dt(call.q), a_dtype=dt(call.a), b_dtype=dt(call.b), h_dtype=dt(call.h),
            state_dtype=dt(state), varlen=call.cu_seqlens is not None, h_given=call.h is not None,
            has_dht=call.dht is not None, has_initial_state=call.initial_state is not None,
            state_v_first=call.state_v_first, device=device_info(call.q.device),
            versions=tuple(library_versions().items()),
        )


class Backend:
    """One way to compute the contract. Subclasses set `name` and implement the two methods."""

    name: str = ""

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        """Every reason this backend cannot take the problem; empty when it can."""
        raise NotImplementedError

    def supported(self, problem: Problem) -> tuple[bool, str]:
        reasons = self.not_supported_reasons(problem)
        return (not reasons, "; ".join(reasons))

    def run(self, call: GDRCall) -> GDRGrads:
        """Compute the gradients into fresh tensors; never write the call's tensors."""
        raise NotImplementedError


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if not backend.name:
        raise ValueError("a backend needs a name")
    _REGISTRY[backend.name] = backend
    return backend


def registered_backends() -> dict[str, Backend]:
    """Registered backends in static preference order (then registration order)."""
    _load_builtin_backends()
    order = [n for n in STATIC_PREFERENCE if n in _REGISTRY] + [n for n in _REGISTRY if n not in STATIC_PREFERENCE]
    return {n: _REGISTRY[n] for n in order}


def get_backend(name: str) -> Backend:
    known = registered_backends()
    if name not in known:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(known)}")
    return known[name]


@functools.lru_cache(maxsize=None)
def _load_builtin_backends() -> None:
    # importing the subpackage registers each backend module
    importlib.import_module("gdr_dispatch.backends")
