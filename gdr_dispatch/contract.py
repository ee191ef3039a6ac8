"""The `fused_gdr_bwd` contract: what a call carries, what it returns, and its validation.

The conventions are docs/contract.md's: ungated WY inverse `a`, natural-log chunk-local
cumsum `g`, chunk-start states `h` (or None), `dg` with respect to the raw per-token gate,
`dq`/`dk` at the q/k head count.

Validation runs before any work and reads only shapes, dtypes and devices, except for
`cu_seqlens`, whose values must be read (one device-to-host copy) to check them and to
count chunks; fla's own varlen path makes the same copy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from .graph_safe import device_constant, offsets_of

#: dtypes accepted for q/k/v/do. fp32 and fp64 exist for the torch backend and the oracle
#: tests; the GPU backends state in their `supported` reasons that they take bf16/fp16.
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
GATE_DTYPES = (torch.float32, torch.float64)


class GDRGrads(NamedTuple):
    """Gradients of `<o, do> + <ht, dht>` w.r.t. the forward's inputs (docs/contract.md)."""

    dq: torch.Tensor  # [B, T, Hg, K], dtype of q
    dk: torch.Tensor  # [B, T, Hg, K], dtype of k
    dv: torch.Tensor  # [B, T, H, V], dtype of v
    dg: torch.Tensor  # [B, T, H] fp32 (fp64 for fp64 inputs), w.r.t. the raw gate g_raw
    db: torch.Tensor  # [B, T, H], dtype of b
    dh0: Optional[torch.Tensor]  # [N, H, K, V] (or [N, H, V, K]) fp32; None without initial_state


@dataclass(frozen=True)
class GDRCall:
    """One validated call: the caller's tensors (never written) and what was derived from them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    g: torch.Tensor
    b: torch.Tensor
    do: torch.Tensor
    dht: Optional[torch.Tensor]
    h: Optional[torch.Tensor]
    scale: float
    initial_state: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    chunk_size: int
    state_v_first: bool
    # derived
    seq_lens: tuple[int, ...]  # token count of each of the N sequences
    num_chunks: int  # chunks over all sequences (the h tensor's chunk dimension)
    max_seqlen: Optional[int] = None  # the caller's bound on the longest sequence (varlen), if given

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def T(self) -> int:
        return self.q.shape[1]

    @property
    def Hg(self) -> int:
        return self.q.shape[2]

    @property
    def K(self) -> int:
        return self.q.shape[3]

    @property
    def H(self) -> int:
        return self.v.shape[2]

    @property
    def V(self) -> int:
        return self.v.shape[3]

    @property
    def N(self) -> int:
        return len(self.seq_lens)

    @property
    def acc_dtype(self) -> torch.dtype:
        """Accumulation dtype of exact backends: fp64 for fp64 inputs, else fp32."""
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32

    def state_shape(self) -> tuple[int, int, int, int]:
        return (self.N, self.H, self.V, self.K) if self.state_v_first else (self.N, self.H, self.K, self.V)


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without torch's argument parsing where it is a no-op (about 1.4 us of host
    per call: launchers make several per call, docs/design.md "The hot path")."""
    return x if x.dtype == dtype else x.to(dtype)


def packed(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`x` itself when its memory is packed row-major (canonical strides, what TMA descriptors and
    flat pointer arithmetic assume), else a packed copy: callers pass strided views (a split of a
    fused projection, a transpose, an expand) and the contract takes any of them."""
    if x is None:
        return None
    shape = x.shape
    if 1 not in shape and 0 not in shape and x.is_contiguous():
        return x  # no size-1 or empty dim: contiguous strides are the canonical ones (one C call)
    if _canonical(shape, x.stride()):  # B = 1 and one-sequence calls: a size-1 dim, a memoised verdict
        return x
    return x.clone(memory_format=torch.contiguous_format)


def packing_test(*tensors: torch.Tensor):
    """`test(*xs)`, True only when `packed(x) is x` for each of `xs`, tensors of these tensors'
    shapes (a plan's later calls): decided once per set of shapes, it costs a plan one
    `is_contiguous` per tensor, or a strides compare where a dim is 1 (docs/design.md)."""
    return _packing_test(tuple(x.shape for x in tensors))


@functools.lru_cache(maxsize=256)
def _packing_test(shapes: tuple):
    if all(1 not in s and 0 not in s for s in shapes):
        return _all_contiguous
    expected = [_canonical_strides(s) for s in shapes]
    return lambda *xs: [x.stride() for x in xs] == expected


def _all_contiguous(*xs: torch.Tensor) -> bool:
    for x in xs:
        if not x.is_contiguous():
            return False
    return True


def _canonical_strides(shape) -> tuple:
    expected, step = [], 1
    for size in reversed(shape):
        expected.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(expected))


@functools.lru_cache(maxsize=256)
def _canonical(shape: torch.Size, strides: tuple) -> bool:
    """Whether `strides` are the row-major strides of `shape` (size-1 and empty dims included)."""
    return _canonical_strides(shape) == tuple(strides)


#: Where `torch.autocast` may be on (it knows no other device: meta has none). The op's forward and
#: `fused_gdr_bwd` turn it off there: the contract's math runs in the inputs' own dtypes with fp32
#: accumulation, and a torch product inside would otherwise drop to autocast's 16 bits, silently.
AUTOCAST_DEVICES = ("cuda", "cpu")


def _n(x):
    """A size as a number: a traced call's symbolic size (torch.compile with dynamic shapes) by the
    value it has in the call being traced, so an error reads `[2, 100, 3]`, not `[s85, s34, s58]`."""
    if isinstance(x, torch.SymInt):
        hint = getattr(x.node, "hint", None)  # (None without one: the symbol is then its name)
        return hint if isinstance(hint, int) else x
    return x


def _fmt_shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(_n(s)) for s in t.shape) + "]"


def _expect_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _expect_shape(name: str, x: torch.Tensor, expected: Sequence[int], meaning: str) -> None:
    if tuple(x.shape) != tuple(expected):
        want = "[" + ", ".join(str(_n(s)) for s in expected) + "]"
        raise ValueError(f"{name}: expected shape {want} ({meaning}), got {_fmt_shape(x)}")


def _expect_dtype(name: str, x: torch.Tensor, allowed: Sequence[torch.dtype], why: str = "") -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        extra = f" ({why})" if why else ""
        raise TypeError(f"{name}: expected dtype in {{{names}}}{extra}, got {str(x.dtype).replace('torch.', '')}")


def chunk_counts(seq_lens: Sequence[int], chunk_size: int) -> list[int]:
    return [math.ceil(n / chunk_size) for n in seq_lens]


def reduce_value_heads(x: torch.Tensor, Hg: int, dtype: Optional[torch.dtype] = None,
                       accum: Optional[torch.dtype] = None) -> torch.Tensor:
    """`[B, T, H, D]` -> `[B, T, Hg, D]`: the sum over the value heads that share a q/k head
    (head i uses q/k head i // (H // Hg)), accumulated in `accum` (default `x`'s dtype), then
    cast to `dtype` if given.

    The contract's GVA reduction. 16-bit per-head values summed with `accum=float32` skip the
    fp32 copy of `[B, T, H, D]` (about 1 ms at varlen 8x4096 H32 Hg16 on the H200); the fused
    launchers on CUDA use `backends/kernels/head_sum.py`, the same sum in one pass.
    """
    B, T, H, D = x.shape
    out = x if H == Hg else x.view(B, T, Hg, H // Hg, D).sum(3, dtype=accum)
    return out if dtype is None or out.dtype == dtype else out.to(dtype)


def check_cu_seqlens_form(cu_seqlens: torch.Tensor, B: int) -> None:
    """What `cu_seqlens` must be without reading its values: `[N + 1]` integers, with `B == 1`."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [N + 1] with N >= 1, got {_fmt_shape(cu_seqlens)}")
    _expect_dtype("cu_seqlens", cu_seqlens, (torch.int32, torch.int64))
    if B != 1:
        raise ValueError(f"cu_seqlens: varlen calls pack sequences along T and need B == 1, got B={_n(B)}")


def check_state(name: str, x: torch.Tensor, N: int, H: int, K: int, V: int, state_v_first: bool) -> None:
    """An `initial_state`/`dht`-like tensor: `[N, H, K, V]` (`[N, H, V, K]` with `state_v_first`), a float dtype."""
    state = (N, H, V, K) if state_v_first else (N, H, K, V)
    layout = "[N, H, V, K] (state_v_first=True)" if state_v_first else "[N, H, K, V] (state_v_first=False)"
    _expect_shape(name, x, state, f"{layout}, N={_n(N)} sequences")
    _expect_dtype(name, x, (torch.float32, torch.float64, torch.bfloat16, torch.float16))


def check_sizes(B: int, T: int, H: int, Hg: int, K: int, V: int, chunk_size: int) -> None:
    """The size rules of a call, without tensors: `validate` and `gdr-dispatch explain` share them.

    Raises ValueError naming the argument (`q` carries B, T, Hg, K; `v` carries H, V).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    if B < 1:
        raise ValueError(f"q: expected at least one sequence (B >= 1), got B={_n(B)}")
    if T < 1:
        raise ValueError(f"q: expected at least one token (T >= 1), got T={_n(T)}")
    if Hg < 1 or K < 1:
        raise ValueError(f"q: the q/k head count and head dim must be >= 1, got Hg={_n(Hg)}, K={_n(K)}")
    if H < 1 or V < 1:
        raise ValueError(f"v: the value head count and head dim must be >= 1, got H={_n(H)}, V={_n(V)}")
    if H % Hg != 0:
        raise ValueError(
            f"v: its head count H={_n(H)} must be a multiple of q/k's head count Hg={_n(Hg)} "
            f"(value head i uses q/k head i // (H // Hg))"
        )


def _check_common(q, k, v, gate, beta, names: dict, gate_dtypes, chunk_size, state_v_first,
                  initial_state, cu_seqlens) -> tuple[int, int, int, int, int, int]:
    """The structural checks the op's forward and the backward share (shapes, dtypes, devices;
    no tensor values, so they hold on fake tensors while `torch.compile` traces). `names` maps
    "gate" and "beta" to the caller's argument names. Returns `(B, T, Hg, K, H, V)`."""
    gname, bname = names["gate"], names["beta"]
    for name, x in (("q", q), ("k", k), ("v", v), (gname, gate), (bname, beta)):
        _expect_tensor(name, x)
    if not isinstance(state_v_first, bool):
        raise TypeError(f"state_v_first: expected a bool, got {type(state_v_first).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims [B, T, Hg, K], got {_fmt_shape(q)}")
    B, T, Hg, K = q.shape
    if v.dim() != 4:
        raise ValueError(f"v: expected 4 dims [B, T, H, V], got {_fmt_shape(v)}")
    H, V = v.shape[2], v.shape[3]
    _expect_shape("v", v, (B, T, H, V), "[B, T, H, V] with B, T of q")
    check_sizes(B, T, H, Hg, K, V, chunk_size)
    _expect_shape("k", k, (B, T, Hg, K), "same as q: [B, T, Hg, K]")
    _expect_shape(gname, gate, (B, T, H), names["gate_what"])
    _expect_shape(bname, beta, (B, T, H), f"[B, T, H], {names.get('beta_what', 'beta')}")
    _expect_dtype("q", q, ACTIVATION_DTYPES)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected the dtype of q ({q.dtype}), got {x.dtype}")
    _expect_dtype(gname, gate, gate_dtypes, names.get("gate_why", ""))
    _expect_dtype(bname, beta, ACTIVATION_DTYPES)
    for name, x in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens)):
        if x is not None:
            _expect_tensor(name, x)
    for name, x in (("k", k), ("v", v), (gname, gate), (bname, beta), ("initial_state", initial_state),
                    ("cu_seqlens", cu_seqlens)):
        if x is not None and x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (the device of q), got {x.device}")
    if cu_seqlens is not None:
        check_cu_seqlens_form(cu_seqlens, B)
    if initial_state is not None:
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        check_state("initial_state", initial_state, N, H, K, V, state_v_first)
    return B, T, Hg, K, H, V


def offsets_to_device(cu_seqlens, q):
    """`cu_seqlens` given on the CPU for a call on another device: its copy there, built once per
    content and kept (graph_safe.device_constant), its values never read back: only a content's
    first call waits, for the copy. Anything else comes back as it is, for the checks to name."""
    if (isinstance(cu_seqlens, torch.Tensor) and isinstance(q, torch.Tensor) and cu_seqlens.device.type == "cpu"
            and q.device.type != "cpu"):
        check_cu_seqlens_form(cu_seqlens, 1)  # its form named first (B is checked on the copy)
        return device_constant(tuple(cu_seqlens.tolist()), cu_seqlens.dtype, q.device)
    return cu_seqlens


def sequence_lengths(cu_seqlens: Optional[torch.Tensor], B: int, T: int) -> tuple[int, ...]:
    """Each sequence's token count: `cu_seqlens`' values read (and checked) on every call, from
    memory only while a CUDA graph is being captured (graph_safe.offsets_of)."""
    if cu_seqlens is None:
        return (T,) * B
    if cu_seqlens.device.type == "meta":
        raise ValueError("cu_seqlens: its values are needed on the host, and a meta tensor has none")
    offsets = offsets_of(cu_seqlens)
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens: expected to start at 0, got {offsets[0]}")
    steps = [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
    if any(s < 0 for s in steps):
        i = next(i for i, s in enumerate(steps) if s < 0)
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {offsets[i]} then {offsets[i + 1]} at index {i}")
    if offsets[-1] != T:
        raise ValueError(f"cu_seqlens: expected to end at T={_n(T)} (the token count of q), got {offsets[-1]}")
    return tuple(steps)


def check_scale(scale, K: int) -> float:
    """`scale` as a float (`K ** -0.5` for None): a finite real number."""
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite number, got {value}")
    return value


#: The op's names for its per-token arguments (`g` is the raw log decay there, `beta` its name).
FORWARD_NAMES = {"gate": "g", "beta": "beta", "gate_what": "[B, T, H], the per-token log decay",
                 "beta_what": "beta", "gate_why": "the log decay; computed in fp32 inside"}
#: Its accepted dtypes for `g`: any float (fla's op takes 16-bit gates too); computed in fp32.
FORWARD_GATE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
BACKWARD_NAMES = {"gate": "g", "beta": "b", "gate_what": "[B, T, H], the chunk-local cumsum of the log gate",
                  "beta_what": "beta", "gate_why": "the log-gate cumsum is kept in fp32"}


def check_forward_structure(q, k, v, g, beta, initial_state=None, cu_seqlens=None, state_v_first=False,
                            chunk_size=64):
    """The op's forward arguments without their values (also on fake tensors): `(B, T, Hg, K, H, V)`."""
    return _check_common(q, k, v, g, beta, FORWARD_NAMES, FORWARD_GATE_DTYPES, chunk_size, state_v_first,
                         initial_state, cu_seqlens)


def validate_forward(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, state_v_first=False,
                     chunk_size=64) -> tuple[float, tuple[int, ...]]:
    """The op's forward arguments, values included (the backward's checks on the forward's own
    arguments): `(scale, seq_lens)`."""
    B, T, Hg, K, H, V = check_forward_structure(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first,
                                                chunk_size)
    scale = check_scale(scale, K)
    return scale, sequence_lengths(cu_seqlens, B, T)


def check_backward_structure(q, k, v, a, g, b, do, dht=None, h=None, *, initial_state=None, cu_seqlens=None,
                             chunk_size=64, state_v_first=False) -> tuple[int, int, int, int, int, int]:
    """`validate`'s checks that read no tensor values (shapes, dtypes, devices): what a call's
    signature decides, so a plan (plans.py) runs them once per signature. `(B, T, Hg, K, H, V)`."""
    B, T, Hg, K, H, V = _check_common(q, k, v, g, b, BACKWARD_NAMES, GATE_DTYPES, chunk_size, state_v_first,
                                      initial_state, cu_seqlens)
    a = _expect_tensor("a", a)
    do = _expect_tensor("do", do)
    _expect_shape("do", do, (B, T, H, V), "same as v: [B, T, H, V]")
    _expect_shape("a", a, (B, T, H, chunk_size), "[B, T, H, chunk_size], the ungated WY inverse per chunk row")
    if do.dtype != q.dtype:
        raise TypeError(f"do: expected the dtype of q ({q.dtype}), got {do.dtype}")
    _expect_dtype("a", a, ACTIVATION_DTYPES)
    for name, x in (("a", a), ("do", do), ("dht", dht), ("h", h)):
        if x is not None and _expect_tensor(name, x).device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (the device of q), got {x.device}")
    if dht is not None:
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        check_state("dht", dht, N, H, K, V, state_v_first)
    if h is not None:
        _expect_dtype("h", h, ACTIVATION_DTYPES)
    return B, T, Hg, K, H, V


def check_backward_values(B: int, T: int, H: int, K: int, V: int, h, cu_seqlens, chunk_size: int,
                          state_v_first: bool, max_seqlen) -> tuple[tuple[int, ...], int]:
    """`validate`'s checks that need `cu_seqlens`' values (read here, on every eager call) and
    what depends on them: `max_seqlen` against the longest sequence, `h`'s chunk count.
    `(seq_lens, num_chunks)`."""
    seq_lens = sequence_lengths(cu_seqlens, B, T)
    num_chunks = sum(-(-n // chunk_size) for n in seq_lens)
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"max_seqlen: expected an int or None, got {type(max_seqlen).__name__}")
        longest = max(seq_lens)
        if not longest <= max_seqlen <= T:
            raise ValueError(f"max_seqlen: expected the longest sequence's length ({longest} tokens here) or a bound "
                             f"on it no larger than T={_n(T)}, got {max_seqlen}")
    if h is not None:
        lead = (1, num_chunks) if cu_seqlens is not None else (B, num_chunks // B)
        hshape = lead + ((H, V, K) if state_v_first else (H, K, V))
        if tuple(h.shape) != hshape:
            hwhat = (
                f"[{lead[0]}, chunks, H, {'V, K' if state_v_first else 'K, V'}] with "
                f"{lead[1]} chunks of {chunk_size} tokens" + (" over all sequences" if cu_seqlens is not None else
                                                               " per sequence")
            )
            _expect_shape("h", h, hshape, hwhat)
    return seq_lens, num_chunks


def validate(
    q, k, v, a, g, b, do, dht=None, h=None, *,
    scale=None, initial_state=None, cu_seqlens=None, chunk_size=64, state_v_first=False, max_seqlen=None,
) -> GDRCall:
    """Check a `fused_gdr_bwd` call and return it as a `GDRCall`.

    Raises TypeError (wrong kind or dtype) or ValueError (wrong shape or value) whose
    message names the argument, what was expected and what came. `cu_seqlens` may be on the CPU
    (`offsets_to_device`).
    """
    cu_seqlens = offsets_to_device(cu_seqlens, q)
    B, T, Hg, K, H, V = check_backward_structure(q, k, v, a, g, b, do, dht, h, initial_state=initial_state,
                                                 cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                                 state_v_first=state_v_first)
    seq_lens, num_chunks = check_backward_values(B, T, H, K, V, h, cu_seqlens, chunk_size, state_v_first, max_seqlen)
    scale = check_scale(scale, K)
    return make_call(q, k, v, a, g, b, do, dht, h, scale, initial_state, cu_seqlens, chunk_size, state_v_first,
                     seq_lens, num_chunks, max_seqlen)


_CALL_FIELDS = ("q", "k", "v", "a", "g", "b", "do", "dht", "h", "scale", "initial_state", "cu_seqlens", "chunk_size",
                "state_v_first", "seq_lens", "num_chunks", "max_seqlen")


def make_call(*values) -> GDRCall:
    """A `GDRCall` of checked arguments, in `GDRCall`'s field order. Frozen like one built by its
    constructor; built without it (a frozen dataclass sets its 17 fields through
    `object.__setattr__`, ~4 us of every call's host time)."""
    call = object.__new__(GDRCall)
    call.__dict__.update(zip(_CALL_FIELDS, values))
    return call


def signature(*args) -> Optional[tuple]:
    """What `validate` and the choice of backend read from a call's arguments, as a hashable key:
    each tensor's type, shape, dtype and device, each other argument with its type (so that
    `True` and `1` differ). None when an argument is not a tensor, None or a plain scalar: such a
    call takes the checked path, which names it."""
    out = []
    extend = out.extend
    tensor = torch.Tensor
    for x in args:
        kind = type(x)
        if kind is tensor or (kind not in _SCALARS and isinstance(x, tensor)):  # plain tensors first: most are
            extend((kind, x.shape, x.dtype, x.device))
        elif kind in _SCALARS:
            extend((kind, x))
        else:
            return None
    return tuple(out)


_SCALARS = frozenset((bool, int, float, type(None)))


def backward_signature(q, k, v, a, g, b, do, dht, h, initial_state, cu_seqlens, scale, chunk_size, state_v_first,
                       max_seqlen) -> Optional[tuple]:
    """`signature` of a `fused_gdr_bwd` call's arguments in this order, unrolled where they are
    plain tensors (its seven required ones; a third less host time per call than the loop):
    the same information, another form; a tensor subclass among them takes `signature`'s."""
    t = torch.Tensor
    if not (type(q) is t and type(k) is t and type(v) is t and type(a) is t and type(g) is t and type(b) is t
            and type(do) is t):
        return signature(q, k, v, a, g, b, do, dht, h, initial_state, cu_seqlens, scale, chunk_size, state_v_first,
                         max_seqlen)
    out = [q.shape, q.dtype, q.device, k.shape, k.dtype, k.device, v.shape, v.dtype, v.device, a.shape, a.dtype,
           a.device, g.shape, g.dtype, g.device, b.shape, b.dtype, b.device, do.shape, do.dtype, do.device]
    for x in (dht, h, initial_state, cu_seqlens):
        if x is None:
            out.append(None)
        elif isinstance(x, t):
            out.append((type(x), x.shape, x.dtype, x.device))
        else:
            return None
    for x in (scale, chunk_size, state_v_first, max_seqlen):
        kind = type(x)
        if kind not in _SCALARS:
            return None
        out.append((kind, x))
    return tuple(out)
