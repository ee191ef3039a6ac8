"""The backend registry, and the `Problem` every backend's `supported` predicate reads.

A backend says whether it can take a call from the `Problem` alone (shapes, dtypes, flags,
device, library versions), never from tensor values, so the verdict can be cached and
printed by `gdr-dispatch explain` for shapes that were never allocated. It lists *every*
reason it says no, not only the first. `supported` answers "can it run this correctly
here"; which supported backend is fastest is for the tables and the static order.

The registry names no backend: each one declares its own place in the static order
(`static_rank`) and whether the autotuner may use it as the cross-check reference
(`reference_rank`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import math
import os
from dataclasses import dataclass
from importlib import metadata
from typing import Iterator, Optional

import torch

from .contract import GDRCall, GDRGrads

#: Environment switch that lets kernel backends not yet verified on a GPU run (tests, bench).
ALLOW_UNVERIFIED_ENV = "GDR_ALLOW_UNVERIFIED"
_allow_unverified: contextvars.ContextVar[bool] = contextvars.ContextVar("gdr_allow_unverified", default=False)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_flag(name: str, default: bool) -> bool:
    """A boolean environment variable, read now; anything unrecognised is an error naming it."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}: expected one of 1/0, true/false, yes/no, on/off, got {raw!r}")


_said: set = set()  # first_time's keys, this process


def first_time(key) -> bool:
    """True the first time this process sees `key`, False after: the log lines that say once per
    problem what ran (dispatch, the split, the forward, the h=None recompute). Keys start with a
    word naming their line, so two lines' keys never meet."""
    if key in _said:
        return False
    _said.add(key)
    return True


def forget_said() -> None:
    """Let every once-per-problem log line be said again (`dispatch.clear_caches`, tests)."""
    _said.clear()


def unverified_allowed() -> bool:
    """True inside `allow_unverified()` or with GDR_ALLOW_UNVERIFIED=1 (read per call)."""
    return _allow_unverified.get() or env_flag(ALLOW_UNVERIFIED_ENV, False)


@contextlib.contextmanager
def allow_unverified() -> Iterator[None]:
    """Let backends whose GPU tests have not passed yet take calls (for those tests and bench)."""
    token = _allow_unverified.set(True)
    try:
        yield
    finally:
        _allow_unverified.reset(token)


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
        names = ("varlen", "grouped", "h_given", "has_dht", "has_initial_state", "state_v_first")
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
            + (" v_first" if self.state_v_first else "")
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


class Backend:
    """One way to compute the contract.

    Subclasses set `name`, `static_rank` (their place in the static order, lowest first:
    what runs when nothing was measured) and implement `not_supported_reasons` and `run`.
    `reference_rank` marks a backend the autotuner may cross-check the others against
    (lowest first); `split_candidate = False` keeps it out of the autotuner's context-parallel
    candidates. A GPU kernel backend sets `gpu_verified = False` until its oracle tests
    (tests/test_gpu.py) pass on a GPU; it is refused until then, unless `allow_unverified()`.
    """

    name: str = ""
    static_rank: int = 1000
    reference_rank: Optional[int] = None
    gpu_verified: bool = True
    unverified_why: str = "refused until tests/test_gpu.py passes for it"  # said while gpu_verified is False
    split_candidate: bool = True  # the autotuner may try it on context-parallel segments (starved grids)
    optional_lib: Optional[str] = None  # the optional library (OPTIONAL_LIBS) it needs, if any

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        """Every reason this backend cannot take the problem correctly here; empty when it can."""
        raise NotImplementedError

    def supported(self, problem: Problem) -> tuple[bool, str]:
        return _verdict(self.not_supported_reasons(problem), self.gpu_verified,
                        f"not verified on a GPU yet: {self.unverified_why}")

    def run(self, call: GDRCall) -> GDRGrads:
        """Compute the gradients into fresh tensors; never write the call's tensors."""
        raise NotImplementedError

    #: The training op's forward (`gdr_dispatch.training`): backends that offer one set a rank
    #: (lowest first) and implement `forward`; `forward_verified = False` until the op's GPU
    #: tests pass with it (refused until then, unless `allow_unverified()`).
    forward_rank: Optional[int] = None
    forward_verified: bool = True

    def forward_not_supported_reasons(self, problem: Problem) -> list[str]:
        """Every reason this backend's forward cannot take the problem (`h_given` False, no dht)."""
        return [] if self.forward_rank is not None else [f"{self.name} offers no forward"]

    def forward_supported(self, problem: Problem) -> tuple[bool, str]:
        return _verdict(self.forward_not_supported_reasons(problem), self.forward_rank is None or self.forward_verified,
                        "its forward is not verified on a GPU yet: refused until tests/test_gpu.py's op tests pass "
                        "with it")

    def forward(self, q, k, v, g, beta, scale: float, initial_state, cu_seqlens, state_v_first: bool,
                need_final: bool, chunk_size: int, need_states: bool = True):
        """The training forward: `(o, final_state or None, G, a, h)` in the contract's forms (G the
        natural-log chunk cumsum in fp32, `a` the ungated inverse, `h` the chunk-start states; a
        backend may return `h=None` when `need_states` is False)."""
        raise NotImplementedError

    def split_passes(self, problem: Problem):
        """Pass 1 of the exact context-parallel split on this backend's kernels, if it has them
        for `problem` (the segments' varlen call): a function `(call, need_r=True)` returning
        every segment's composed maps `(M, R, D)` (`[segments, H, K, K | V | V]`, fp32, K x V
        state layout; R may be None when `need_r` is False: with `h` given the segments' start
        states come from `h`). None: gdr_dispatch/context_parallel.py's batched torch products
        run it."""
        return None

    def own_state_recompute(self) -> bool:
        """Whether this backend's `h=None` path recomputes the chunk states in one kernel of its
        own, from `initial_state`: the context-parallel split then leaves its pass 3 `h=None`
        instead of writing `h` with its Triton walk (segment_maps.segment_states; docs/
        measurements.md, "Session 13")."""
        return False

    def compile_jobs(self, call: GDRCall) -> list[tuple[str, str, tuple]]:
        """The kernel builds a first `run(call)` would compile, as picklable `(module, function,
        args)`: a sweep runs them in parallel processes beforehand (`run_compile_job`), since
        one TileLang build takes about a minute on one core. Empty: nothing to compile."""
        return []


def _verdict(reasons, verified: bool, unverified: str) -> tuple[bool, str]:
    """`(ok, reasons joined)`; a GPU path not verified yet is refused first, unless allowed."""
    reasons = list(reasons)
    if not verified and not unverified_allowed():
        reasons.insert(0, f"{unverified} (set {ALLOW_UNVERIFIED_ENV}=1 to run it anyway)")
    return (not reasons, "; ".join(reasons))


def run_compile_job(job: tuple[str, str, tuple]) -> float:
    """Run one `compile_jobs` entry (in a worker process); returns its wall time in seconds."""
    import time

    module, function, args = job
    t0 = time.perf_counter()
    getattr(importlib.import_module(module), function)(*args)
    return time.perf_counter() - t0


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if not backend.name:
        raise ValueError("a backend needs a name")
    _REGISTRY[backend.name] = backend
    return backend


def registered_backends() -> dict[str, Backend]:
    """Registered backends in static order (`static_rank`, then registration order)."""
    _load_builtin_backends()
    order = sorted(_REGISTRY, key=lambda n: _REGISTRY[n].static_rank)  # sorted() is stable
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
