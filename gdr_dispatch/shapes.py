"""Shapes to tune and benchmark: presets, YAML grids, and random inputs for one shape.

A grid file is a YAML list (or a mapping with a `shapes:` list) of entries such as

    - {B: 8, T: 4096, H: 32, Hg: 32, K: 128, V: 128, dtype: bfloat16}
    - {seqlens: [4096, 4096, 4096, 4096], H: 32, Hg: 16, K: 128, V: 128, h: none}

Keys: B, T (or seqlens for a varlen batch: then B=1, T=sum), H, Hg (default H), K, V
(default 128), dtype (bfloat16, float16, float32, float64), h (given | none | both, default both),
initial_state and dht (default true), state_v_first (default false), chunk_size (64),
strong_decay (default false: g_raw in [-0.5, 0]; true: in [-5.5, -4.5], near fp32 underflow), gate
(`uniform`, the default: as strong_decay says; `logsigmoid`: logsigmoid(randn), most heads of a trained
model; `logsigmoid16`: that over 16, weak decay, FlashQLA's benchmark gate; `mixed`: Qwen3-Next's
form `-A softplus(x + dt_bias)` with per-head `A ~ U(1, 16)`, `dt ~ logU(1e-3, 1e-1)`, `dt_bias`
its softplus inverse and `x ~ N(0, 1)` per token, strongly and weakly decaying heads side by side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Optional

import torch
import yaml

from .contract import check_sizes, chunk_counts
from .problem import Problem, device_info, library_versions

GATES = ("uniform", "logsigmoid", "logsigmoid16", "mixed")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64}


@dataclass(frozen=True)
class ShapeSpec:
    H: int
    K: int = 128
    V: int = 128
    Hg: Optional[int] = None
    B: int = 1
    T: Optional[int] = None
    seqlens: Optional[tuple[int, ...]] = None
    dtype: str = "bfloat16"
    h: str = "both"  # given | none | both
    initial_state: bool = True
    dht: bool = True
    state_v_first: bool = False
    chunk_size: int = 64
    strong_decay: bool = False  # g_raw around -5 per token (decay near fp32 underflow within a chunk)
    gate: str = "uniform"  # uniform (strong_decay's ranges) | logsigmoid | logsigmoid16 | mixed
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name in ("H", "K", "V", "Hg", "B", "T", "chunk_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name}: expected an integer, got {value!r}")
        for name in ("initial_state", "dht", "state_v_first", "strong_decay"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if not isinstance(self.dtype, str) or not isinstance(self.h, str):
            raise ValueError(f"dtype and h: expected names, got {self.dtype!r} and {self.h!r}")
        if self.seqlens is not None:
            if isinstance(self.seqlens, (str, bytes)) or not hasattr(self.seqlens, "__iter__") or any(
                    isinstance(x, bool) or not isinstance(x, int) for x in self.seqlens):
                raise ValueError(f"seqlens: expected a list of integers, got {self.seqlens!r}")
            object.__setattr__(self, "seqlens", tuple(int(s) for s in self.seqlens))
            if self.B != 1:
                raise ValueError(f"seqlens: a varlen batch packs its sequences along T and needs B == 1, got B={self.B}")
            if not self.seqlens or min(self.seqlens) < 0:
                raise ValueError(f"seqlens: expected one or more lengths >= 0, got {list(self.seqlens)}")
            object.__setattr__(self, "T", sum(self.seqlens))
        if self.T is None:
            raise ValueError("a shape needs T, or seqlens for a varlen batch")
        if self.Hg is None:
            object.__setattr__(self, "Hg", self.H)
        # the rules a call of this shape would be held to, so that `explain` refuses what
        # `fused_gdr_bwd` refuses
        check_sizes(self.B, self.T, self.H, self.Hg, self.K, self.V, self.chunk_size)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", str(DTYPES[self.dtype]).replace("torch.", ""))
        if self.h not in ("given", "none", "both"):
            raise ValueError(f"h: expected given, none or both, got {self.h!r}")
        if self.gate not in GATES:
            raise ValueError(f"gate: expected one of {', '.join(GATES)}, got {self.gate!r}")

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self.seqlens if self.seqlens is not None else (self.T,) * self.B

    def variants(self) -> list["ShapeSpec"]:
        """One spec per `h` mode (`both` expands to `given` and `none`)."""
        return [replace(self, h="given"), replace(self, h="none")] if self.h == "both" else [self]

    def label(self) -> str:
        if self.seqlens is None:
            seqs = f"B{self.B} T{self.T}"
        elif len(set(self.seqlens)) == 1:
            seqs = f"varlen {len(self.seqlens)}x{self.seqlens[0]}"
        else:
            seqs = "varlen " + ",".join(map(str, self.seqlens[:6])) + (",.." if len(self.seqlens) > 6 else "")
        grp = f" Hg{self.Hg}" if self.Hg != self.H else ""
        decay = (" strong-decay" if self.strong_decay else "") + ("" if self.gate == "uniform" else f" gate={self.gate}")
        return f"{seqs} H{self.H}{grp} K{self.K} V{self.V} {self.dtype}{decay} h={self.h}"

    def problem(self, device: torch.device) -> Problem:
        """The dispatcher's view of this shape, without allocating it."""
        n_chunks = sum(chunk_counts(self.seq_lens, self.chunk_size))
        sdt = "float32" if (self.initial_state or self.dht) else None
        return Problem(
            B=self.B, T=self.T, H=self.H, Hg=self.Hg, K=self.K, V=self.V, N=len(self.seq_lens),
            chunk_size=self.chunk_size, num_chunks=n_chunks, max_seqlen=max(self.seq_lens),
            dtype=self.dtype, a_dtype=self.dtype, b_dtype=self.dtype,
            h_dtype=self.dtype if self.h == "given" else None, state_dtype=sdt,
            varlen=self.seqlens is not None, h_given=self.h == "given", has_dht=self.dht,
            has_initial_state=self.initial_state, state_v_first=self.state_v_first,
            device=device_info(device), versions=tuple(library_versions().items()),
        )

    @staticmethod
    def from_dict(d: dict) -> "ShapeSpec":
        if not isinstance(d, dict):
            raise ValueError(f"a shape is a mapping such as {{B: 8, T: 4096, H: 32}}, got {d!r}")
        known = {f.name for f in fields(ShapeSpec)} - {"extra"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"shape {d}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return ShapeSpec(**d)


PRESETS: dict[str, list[ShapeSpec]] = {
    # what `tune` runs on a machine without a GPU: seconds with the torch backend
    "cpu": [
        ShapeSpec(B=1, T=128, H=2, K=32, V=32),
        ShapeSpec(seqlens=(1, 63, 64, 65), H=4, Hg=2, K=32, V=32),
    ],
    # small shapes that touch every feature; a few seconds per backend on a CPU
    "smoke": [
        ShapeSpec(B=2, T=200, H=4, K=64, V=64),
        ShapeSpec(seqlens=(1, 63, 64, 65), H=4, Hg=2, K=64, V=64, state_v_first=True),
    ],
    # the training shapes the shipped H200 table is made for (K = V = 128, bf16)
    "h200-train": [
        ShapeSpec(B=1, T=8192, H=16),
        ShapeSpec(B=4, T=4096, H=16),
        ShapeSpec(B=8, T=4096, H=32),
        ShapeSpec(B=16, T=2048, H=32),
        ShapeSpec(seqlens=(4096,) * 8, H=32, Hg=16),
        # starved grids (fewer sequence x head programs than SMs): the context-parallel split
        ShapeSpec(B=1, T=32768, H=4),
        ShapeSpec(B=2, T=16384, H=8),
    ],
    # starved grids (fewer sequence x head programs than SMs), where the exact split runs
    "h200-starved": [
        ShapeSpec(B=1, T=8192, H=16),
        ShapeSpec(B=1, T=32768, H=4),
        ShapeSpec(B=1, T=65536, H=4),
        ShapeSpec(seqlens=(4096,) * 8, H=4),
        ShapeSpec(seqlens=(16384,) * 4, H=8),
        ShapeSpec(B=2, T=16384, H=8),
    ],
}


def load_grid(path: str | Path) -> list[ShapeSpec]:
    """The shapes of a grid file; a file that cannot be read or used is a ValueError naming it
    (and the entry at fault)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if isinstance(doc, dict):
        doc = doc.get("shapes")
    if not isinstance(doc, list) or not doc:
        raise ValueError(f"{path}: expected a YAML list of shapes (or a mapping with a 'shapes' list)")
    out = []
    for i, d in enumerate(doc, 1):
        try:
            out.append(ShapeSpec.from_dict(d))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: shape {i}: {e}") from None
    return out


def log_decay(spec: ShapeSpec, gen: torch.Generator) -> torch.Tensor:
    """The per-token log decay `g_raw` `[B, T, H]` (float64, CPU) of `spec`'s gate (module docstring)."""
    B, T, H = spec.B, spec.T, spec.H
    u = torch.rand(B, T, H, generator=gen)
    if spec.gate == "uniform":
        return (u.double() - 5.5) if spec.strong_decay else -0.5 * u.double()
    if spec.gate == "mixed":
        A = 1 + 15 * torch.rand(H, generator=gen, dtype=torch.float64)
        step = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(H, generator=gen,
                                                                                          dtype=torch.float64))
        dt_bias = step + torch.log(-torch.expm1(-step))  # softplus(dt_bias) = step
        x = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
        return -A * torch.nn.functional.softplus(x + dt_bias)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen)).double()
    return g / 16 if spec.gate == "logsigmoid16" else g


def make_inputs(spec: ShapeSpec, device, seed: int = 0) -> dict:
    """Random forward inputs for `spec` and the backward call's arguments built from them.

    Returns a dict with the keyword arguments of `fused_gdr_bwd` plus the forward's raw
    inputs (`g_raw`, `beta`) for oracles and peers. Keys are L2-normalised and the log gate
    lies in [-0.5, 0] per token (decays seen in trained models), so values stay O(1).
    """
    from .reference import prepare_residuals

    if spec.h not in ("given", "none"):
        raise ValueError("make_inputs needs one h mode; expand 'both' with spec.variants()")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dt = DTYPES[spec.dtype]
    B, T, H, Hg, K, V = spec.B, spec.T, spec.H, spec.Hg, spec.K, spec.V
    N = len(spec.seq_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = rnd(B, T, Hg, K).to(dt)
    k = torch.nn.functional.normalize(rnd(B, T, Hg, K), dim=-1).to(dt)
    v = rnd(B, T, H, V).to(dt)
    do = rnd(B, T, H, V).to(dt)
    state_dt = torch.float64 if dt == torch.float64 else torch.float32  # g_raw and the states
    g_raw = log_decay(spec, gen).to(device, state_dt)
    beta = torch.sigmoid(rnd(B, T, H)).to(dt)
    state = (N, H, V, K) if spec.state_v_first else (N, H, K, V)
    h0 = rnd(*state).to(state_dt) if spec.initial_state else None
    dht = rnd(*state).to(state_dt) if spec.dht else None
    cu = None
    if spec.seqlens is not None:
        cu = torch.tensor([0, *torch.tensor(spec.seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    res = prepare_residuals(q, k, v, g_raw, beta, initial_state=h0, cu_seqlens=cu,
                            chunk_size=spec.chunk_size, state_v_first=spec.state_v_first)
    return dict(
        q=q, k=k, v=v, a=res.a, g=res.g, b=beta, do=do, dht=dht,
        h=res.h.to(dt) if spec.h == "given" else None,
        initial_state=h0, cu_seqlens=cu, chunk_size=spec.chunk_size, state_v_first=spec.state_v_first,
        max_seqlen=max(spec.seqlens) if spec.seqlens is not None else None, scale=K ** -0.5, g_raw=g_raw,
    )


def call_kwargs(inputs: dict) -> dict:
    """The subset of `make_inputs` that `fused_gdr_bwd` takes."""
    return {k: v for k, v in inputs.items() if k != "g_raw"}
