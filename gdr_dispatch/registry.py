"""The backend registry: `Backend` (what a backend declares), registration, and the names a
table or `GDR_BACKEND` may use.

A backend says whether it can take a call from the `Problem` alone (problem.py), listing every
reason it says no. Most reasons follow from limits every backend has (devices, compute
capabilities, dtypes, head dims, chunk sizes, libraries, a compiler): a backend declares those
as data in `limits` and the base class words the reasons (`Limits.reasons`); its own
`extra_reasons` adds only what is its own. `supported` answers "can it run this correctly
here"; which supported backend is fastest is for the tables and the static order.

Backends built on others (the exact split, `backends/split/`) register a `Wrapper`: the
dispatcher reaches `<backend>@split<n>` candidates through it without naming it.
Tests register or hide backends for a block with `registry.scoped(...)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator, Optional

from . import env, toolchain
from .contract import GDRCall, GDRGrads
from .problem import Problem


class NoBackendError(RuntimeError):
    """No registered backend can take the call (the message lists each one's reasons)."""


# ---------------------------------------------------------------------------------------
# the unverified gate
# ---------------------------------------------------------------------------------------
_allow_unverified: contextvars.ContextVar[bool] = contextvars.ContextVar("gdr_allow_unverified", default=False)


def unverified_allowed() -> bool:
    """True inside `allow_unverified()` or with GDR_ALLOW_UNVERIFIED=1 (read per call)."""
    return _allow_unverified.get() or env.unverified_allowed()


@contextlib.contextmanager
def allow_unverified() -> Iterator[None]:
    """Let kernels whose GPU tests have not passed yet take calls (for those tests and bench)."""
    token = _allow_unverified.set(True)
    try:
        yield
    finally:
        _allow_unverified.reset(token)


def unverified_reason(what: str) -> str:
    """The refusal of a kernel not verified on a GPU yet (`what` names it)."""
    return f"{what} is not verified on a GPU yet: refused until tests/test_gpu.py passes for it " \
           f"(set {env.ALLOW_UNVERIFIED}=1 to run it anyway)"


# ---------------------------------------------------------------------------------------
# limits as data
# ---------------------------------------------------------------------------------------
#: How to install each library a backend may need (the reason says it).
INSTALL = {
    "fla": "pip install 'fla-core>=0.6'",
    "tilelang": "pip install tilelang",
    "triton": "pip install triton",
    "flash_qla": "pip install 'gdr_dispatch[flashqla]'",
}
_LIB_NAMES = {"fla": "fla-core", "flash_qla": "flash_qla", "tilelang": "tilelang", "triton": "triton"}


def _words(values) -> str:
    names = [str(v) for v in values]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


_DEVICE_NAMES = {"cuda": "CUDA", "cpu": "CPU"}


def _cap(c) -> str:
    return f"sm_{c[0]}{c[1]}"


@dataclass(frozen=True)
class Limits:
    """What a backend's kernels take, as data; `None` is no limit. `why` adds a backend's
    explanation to a field's reason (keys: the field names)."""

    devices: Optional[tuple[str, ...]] = ("cuda",)
    capabilities: Optional[tuple[tuple[int, int], ...]] = None
    dtypes: Optional[tuple[str, ...]] = None  # of q/k/v/do
    K: Optional[Collection[int]] = None  # a tuple of values or a range
    V: Optional[Collection[int]] = None
    chunk_sizes: Optional[tuple[int, ...]] = None
    libraries: tuple[str, ...] = ()  # keys of `Problem.versions`
    nvcc: bool = False  # a CUDA compiler for a JIT (TileLang's)
    max_elements: Optional[int] = None  # the largest tensor's element count (32-bit indexing)
    why: dict = field(default_factory=dict, hash=False, compare=False)

    def reasons(self, p: Problem) -> list[str]:
        """Every limit `p` breaks, worded for `explain` and the errors."""
        out = []

        def note(name):
            return f" ({self.why[name]})" if name in self.why else ""

        on_device = self.devices is None or p.device.type in self.devices
        if not on_device:
            out.append(f"needs a {_words([_DEVICE_NAMES.get(d, d) for d in self.devices])} device"
                       f"{note('devices')}; the tensors are on {p.device.type}")
        elif self.capabilities is not None and p.device.type == "cuda" and p.device.capability not in self.capabilities:
            out.append(f"has kernels for {_words([_cap(c) for c in self.capabilities])}{note('capabilities')}; "
                       f"this device is {_cap(p.device.capability)}")
        if self.dtypes is not None and p.dtype not in self.dtypes:
            out.append(f"q/k/v/do must be {_words(self.dtypes)}{note('dtypes')}, got {p.dtype}")
        out += self._dims(p, note)
        if self.chunk_sizes is not None and p.chunk_size not in self.chunk_sizes:
            out.append(f"chunk_size must be {_words(self.chunk_sizes)}{note('chunk_sizes')}, got {p.chunk_size}")
        for lib in self.libraries:
            if p.version(lib) is None:
                out.append(f"{_LIB_NAMES.get(lib, lib)} is not installed{note('libraries')} ({INSTALL.get(lib, 'pip install ' + lib)})")
        if self.nvcc and p.device.type == "cuda" and not _nvcc_found():
            out.append("no nvcc found for TileLang's JIT (set CUDA_HOME or put nvcc on PATH)")
        if self.max_elements is not None:
            elements = max(p.B * p.T * p.H * max(p.K, p.V, p.chunk_size), p.num_chunks * p.H * p.K * p.V)
            if elements > self.max_elements:
                out.append(f"its kernels index with 32-bit integers; this call's largest tensor has {elements} "
                           f"elements (>= 2^31): split the batch")
        return out

    def _dims(self, p: Problem, note) -> list[str]:
        def fits(allowed, x):
            return allowed is None or x in allowed

        def says(allowed):
            if isinstance(allowed, range):
                return f"in {allowed.start}..{allowed.stop - 1}"
            return _words(sorted(allowed))

        if fits(self.K, p.K) and fits(self.V, p.V):
            return []
        if self.K is not None and self.V is not None and _same_values(self.K, self.V):
            return [f"K and V must be {says(self.K)}{note('K')}, got K={p.K}, V={p.V}"]
        out = []
        if not fits(self.K, p.K):
            out.append(f"K must be {says(self.K)}{note('K')}, got K={p.K}")
        if not fits(self.V, p.V):
            out.append(f"V must be {says(self.V)}{note('V')}, got V={p.V}")
        return out

    @property
    def env_vars(self) -> tuple[str, ...]:
        """The environment variables these limits' reasons read (the hot path keys on them)."""
        return toolchain.NVCC_ENV if self.nvcc else ()


def _same_values(a: Collection[int], b: Collection[int]) -> bool:
    """`a` and `b` hold the same values; a range is never expanded (the fla chain's V limit holds
    65520 values: a tuple of it costs over a millisecond per `supported` call)."""
    if isinstance(a, range) and isinstance(b, range):
        return a == b
    return len(a) == len(b) and tuple(a) == tuple(b)


def _nvcc_found() -> bool:
    return toolchain.nvcc_found()


# ---------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------
class Backend:
    """One way to compute the contract.

    Subclasses set `name`, `static_rank` (their place in the static order, lowest first: what
    runs when nothing was measured), `limits`, and implement `run` (and `extra_reasons` for
    what is their own). `reference_rank` marks a backend the autotuner may cross-check the
    others against (lowest first); `split_candidate = False` keeps it out of the split's
    candidates; `reference = True` (the exact torch math) keeps it out of a table miss's
    measurement on a GPU. A GPU kernel backend sets `gpu_verified = False` until its oracle
    tests (tests/test_gpu.py) pass on a GPU; it is refused until then, unless
    `allow_unverified()`.
    """

    name: str = ""
    static_rank: int = 1000
    reference_rank: Optional[int] = None
    reference: bool = False  # a reference or fallback: never worth measuring on a GPU's table miss
    gpu_verified: bool = True
    split_candidate: bool = True
    optional_lib: Optional[str] = None  # the optional library (problem.OPTIONAL_LIBS) it needs, if any
    limits: Limits = Limits(devices=None)
    #: Backends that share their kernels' design win and lose together (`triton_wide` and
    #: `triton_transposed`: "triton"): a first call on a full grid skips a family the device's
    #: tables show never winning there (autotune.losing_families). None: the backend's own name.
    family_name: Optional[str] = None
    #: Environment variables other than gdr_dispatch's own that `extra_reasons` reads: a call's
    #: plan (plans.py) is keyed on their values, so a change between calls is seen.
    extra_env: tuple[str, ...] = ()

    @property
    def family(self) -> str:
        return self.family_name or self.name

    @property
    def env_vars(self) -> tuple[str, ...]:
        """Every environment variable this backend's verdict reads besides gdr_dispatch's own."""
        return self.limits.env_vars + self.extra_env

    def extra_reasons(self, problem: Problem) -> list[str]:
        """What only this backend refuses (the declared `limits` are the base class's)."""
        return []

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        """Every reason this backend cannot take the problem correctly here; empty when it can."""
        return self.limits.reasons(problem) + self.extra_reasons(problem)

    def supported(self, problem: Problem) -> tuple[bool, str]:
        reasons = self.not_supported_reasons(problem)
        if not self.gpu_verified and not unverified_allowed():
            reasons.insert(0, unverified_reason(f"backend {self.name!r}"))
        return (not reasons, "; ".join(reasons))

    def run(self, call: GDRCall) -> GDRGrads:
        """Compute the gradients into fresh tensors; never write the call's tensors."""
        raise NotImplementedError

    def plan_run(self, call: GDRCall) -> Callable[[GDRCall], GDRGrads]:
        """What the dispatcher's plan runs for later calls like `call` (same shapes, dtypes,
        devices, flags, environment and registry state: plans.py): `run`, or a function with what
        `run` decides per call decided once (docs/design.md, "The hot path")."""
        return self.run

    #: The training op's forward (`gdr_dispatch.training`): backends that offer one set a rank
    #: (lowest first) and implement `forward`; `forward_verified = False` until the op's GPU
    #: tests pass with it (refused until then, unless `allow_unverified()`).
    forward_rank: Optional[int] = None
    forward_verified: bool = True

    def forward_not_supported_reasons(self, problem: Problem) -> list[str]:
        """Every reason this backend's forward cannot take the problem (`h_given` False, no dht)."""
        return [] if self.forward_rank is not None else [f"{self.name} offers no forward"]

    def forward_supported(self, problem: Problem) -> tuple[bool, str]:
        reasons = self.forward_not_supported_reasons(problem)
        if self.forward_rank is not None and not self.forward_verified and not unverified_allowed():
            reasons.insert(0, unverified_reason(f"the forward of {self.name!r}"))
        return (not reasons, "; ".join(reasons))

    def forward(self, q, k, v, g, beta, scale: float, initial_state, cu_seqlens, state_v_first: bool,
                need_final: bool, chunk_size: int, need_states: bool = True):
        """The training forward: `(o, final_state or None, G, a, h)` in the contract's forms (G the
        natural-log chunk cumsum in fp32, `a` the ungated inverse, `h` the chunk-start states; a
        backend may return `h=None` when `need_states` is False). Inputs may be any strided views."""
        raise NotImplementedError

    #: Whether the forward comes in two halves, `forward_residuals` (`G`, `a`) and
    #: `forward_from_residuals` (the rest): the split forward then computes the residuals once, on
    #: this backend's kernels (backends/split/forward.py). `residual_forward_verified = False` until
    #: the split forward's GPU test passes with them (its whole `forward` runs until then, unless
    #: `allow_unverified()`).
    residual_forward: bool = False
    residual_forward_verified: bool = True

    def forward_residuals(self, q, k, v, g, beta, cu_seqlens, chunk_size: int):
        """`(G, a)` of a forward call: the natural-log chunk cumsum (fp32) and the ungated inverse."""
        raise NotImplementedError

    def forward_from_residuals(self, q, k, v, G, a, beta, scale: float, initial_state, cu_seqlens,
                               state_v_first: bool, need_final: bool, chunk_size: int, need_states: bool = True):
        """`(o, final_state or None, h or None)` from `forward_residuals`' `(G, a)`."""
        raise NotImplementedError

    def forward_compile_jobs(self, spec: tuple, device: str) -> list[tuple[str, str, tuple]]:
        """The builds of this provider's forward kernels for a forward like `spec`
        (autotune.forward_spec), as jobs that run in parallel processes (`compile_jobs`' form): the
        op's first forward at a shape whose provider is known without measuring starts them and
        waits for them, instead of building them one after another in the caller's process.
        Empty: it builds on its first run here."""
        return []

    def split_passes(self, problem: Problem):
        """Pass 1 of the exact split on this backend's kernels, if it has them for `problem` (the
        segments' varlen call): a function `(call, need_r=True)` returning every segment's
        composed maps `(M, R, D)`; None otherwise (backends/split/passes.py)."""
        return None

    def own_state_recompute(self) -> bool:
        """Whether this backend's `h=None` path recomputes the chunk states in one kernel of its
        own: the split then leaves its pass 3 `h=None` (docs/design.md, "The split")."""
        return False

    def compile_jobs(self, call: GDRCall) -> list[tuple[str, str, tuple]]:
        """The kernel builds a first `run(call)` would compile, as picklable `(module, function,
        args)`: a sweep runs them in parallel processes beforehand (autotune.precompile).
        Empty: nothing to compile."""
        return []


class Wrapper:
    """A family of backends built on registered ones (`<backend><mark><n>`): the split."""

    mark: str = ""

    def candidates(self, problem: Problem, supported: dict[str, Backend], thorough: bool = False) -> dict[str, Backend]:
        """The wrapped candidates worth measuring for `problem`: every one a sweep may time with
        `thorough`, else the few a table miss times."""
        return {}

    def forward_candidates(self, problem: Problem, offers: dict[str, Backend]) -> dict[str, Backend]:
        """The wrapped forwards worth measuring for the training op's forward `problem`, built on
        `offers` (the forward providers that take it)."""
        return {}

    def wrap(self, inner: Backend, n: int) -> Backend:
        raise NotImplementedError

    def forced(self, call: GDRCall, n: int, run: Callable[[GDRCall], GDRGrads], inner: Optional[Backend]) -> GDRGrads:
        """`GDR_CP=<n>`: the call cut `n` ways, each piece run by `run` (the dispatcher's)."""
        raise NotImplementedError


_REGISTRY: dict[str, Backend] = {}
_WRAPPERS: dict[str, Wrapper] = {}
_CONTEXT_PARALLEL: list = []
_KERNELS: dict[str, Callable] = {}  # name -> a kernel registered by backends/ (register_kernel)
_hidden: contextvars.ContextVar[frozenset] = contextvars.ContextVar("gdr_hidden_backends", default=frozenset())
#: Bumped by every change to the registry: plans made before a change are not reused after it.
_generation = [0]


def _changed() -> None:
    _generation[0] += 1


def register(backend: Backend) -> Backend:
    if not backend.name:
        raise ValueError("a backend needs a name")
    if any(w.mark in backend.name for w in _WRAPPERS.values()):
        raise ValueError(f"backend name {backend.name!r}: contains a wrapper's mark")
    _REGISTRY[backend.name] = backend
    _changed()
    return backend


def register_wrapper(wrapper: Wrapper) -> Wrapper:
    _WRAPPERS[wrapper.mark] = wrapper
    _changed()
    return wrapper


def state() -> tuple:
    """What a verdict reads from the registry besides the environment: its generation, the
    backends `scoped` hides here and the unverified gate of this context (plans.py keys on it)."""
    return _generation[0], _hidden.get(), _allow_unverified.get()


def decision_env() -> tuple[str, ...]:
    """Every environment variable a call's choice of backend reads: gdr_dispatch's own
    (`env.DECIDING`) and each registered backend's (`Backend.env_vars`), once per generation."""
    return _env_names(env.DECIDING, _generation[0])


def forward_env() -> tuple[str, ...]:
    """The environment variables the training op's choice of forward reads (`env.FORWARD_DECIDING`
    and each registered backend's), once per generation."""
    return _env_names(env.FORWARD_DECIDING, _generation[0])


@functools.lru_cache(maxsize=16)
def _env_names(own: tuple[str, ...], generation: int) -> tuple[str, ...]:
    _load_builtin_backends()
    names = set(own)
    for b in _REGISTRY.values():
        names.update(b.env_vars)
    return tuple(sorted(names))


def register_context_parallel(provider) -> None:
    """The provider of context parallelism across ranks (`backward(...)` and `op(...)` with a
    process group: backends/split/ranks.py), which `cp_group=` reaches without naming it."""
    _CONTEXT_PARALLEL[:] = [provider]


def register_kernel(name: str, fn: Callable) -> None:
    """A kernel the core calls without importing backends/ (which register with it): `"l2norm"`,
    the HF hook's q/k normalisation (backends/kernels/l2norm.py)."""
    _KERNELS[name] = fn


def kernel(name: str) -> Optional[Callable]:
    """The kernel registered as `name`, or None where none is."""
    _load_builtin_backends()
    return _KERNELS.get(name)


def context_parallel():
    _load_builtin_backends()
    if not _CONTEXT_PARALLEL:
        raise RuntimeError("cp_group: no context-parallel provider is registered")
    return _CONTEXT_PARALLEL[0]


def wrappers() -> list[Wrapper]:
    _load_builtin_backends()
    return list(_WRAPPERS.values())


def parse_wrapped(name: str) -> tuple[str, int, Optional[Wrapper]]:
    """`fla@split4` -> ("fla", 4, the split wrapper); a plain name -> (name, 1, None)."""
    for w in wrappers():
        base, mark, n = name.partition(w.mark)
        if mark and n.isdigit() and int(n) > 1:
            return base, int(n), w
    return name, 1, None


def base_name(name: str) -> str:
    """The registered backend under a (possibly wrapped) name."""
    return parse_wrapped(name)[0]


def registered_backends() -> dict[str, Backend]:
    """Registered backends in static order (`static_rank`, then registration order), less any
    hidden by `scoped`."""
    _load_builtin_backends()
    hidden = _hidden.get()
    order = sorted((n for n in _REGISTRY if n not in hidden), key=lambda n: _REGISTRY[n].static_rank)
    return {n: _REGISTRY[n] for n in order}


def get_backend(name: str, what: str = "backend") -> Backend:
    """The backend called `name`, or `<backend>@split<n>` built on it; `what` names where the
    name came from in the error (e.g. `GDR_BACKEND`)."""
    known = registered_backends()
    if name in known:
        return known[name]
    base, n, wrapper = parse_wrapped(name)
    if wrapper is not None and base in known:
        return wrapper.wrap(known[base], n)
    hint = ""
    lower = {k.lower(): k for k in known}
    if name.lower() in lower:
        hint = f" (names are case-sensitive: did you mean {lower[name.lower()]!r}?)"
    marks = ", ".join(f"<backend>{w.mark}<n>" for w in wrappers())
    raise ValueError(f"{what}: unknown backend {name!r}{hint}; known backends: {', '.join(known)}"
                     + (f" (or {marks})" if marks else ""))


@contextlib.contextmanager
def scoped(add: Collection[Backend] = (), hide: Collection[str] = ()) -> Iterator[None]:
    """Register `add` and hide the backends named in `hide` for the block (tests, tools); the
    registry is as it was afterwards and the dispatcher's memos are forgotten both ways."""
    from . import caches

    saved = {b.name: _REGISTRY.get(b.name) for b in add}
    for b in add:
        register(b)
    token = _hidden.set(_hidden.get() | frozenset(hide))
    caches.clear()
    try:
        yield
    finally:
        _hidden.reset(token)
        for name, old in saved.items():
            if old is None:
                _REGISTRY.pop(name, None)
            else:
                _REGISTRY[name] = old
        _changed()
        caches.clear()


@functools.lru_cache(maxsize=None)
def _load_builtin_backends() -> None:
    # importing the subpackage registers each backend module
    importlib.import_module("gdr_dispatch.backends")
