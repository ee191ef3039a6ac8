"""Make the Gated DeltaNet layers of Hugging Face Qwen3-Next / Qwen3.5 models use gdr_dispatch.

    from gdr_dispatch.integrations import transformers as gdr_hf
    gdr_hf.enable(model)      # or: with gdr_hf.use_gdr_dispatch(model): ... ; gdr_hf.disable() undoes it

Why: those layers call a module-level `torch_chunk_gated_delta_rule` of their modeling module
(transformers 5.x), decorated `use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule",
"fla")`: at import it binds fla-core's Triton op where fla imports (which fails on a CPU machine)
and the slow torch reference (the function the decorator wraps, its `__wrapped__`) elsewhere;
with `kernels` installed (transformers from 5.25 require it) the name holds a function-module, an
`nn.Module` instance that calls it. Either way the layer reads the name at call time, so the
hook rebinds that name to `hf_chunk_gated_delta_rule`, an adapter onto
`gdr_dispatch.chunk_gated_delta_rule`, so the backward goes through the dispatcher (README,
"Training: the drop-in op"; docs/contract.md). The rebinding is per modeling module, not per
model: every model of a patched class uses the op while it is enabled. (A layer that holds the
function as its own `chunk_gated_delta_rule` attribute, as transformers 4.x's did, is patched on
the instance instead.)

The adapter takes HF's call as it comes (q, k, v `[B, T, H, D]`, strided views of one fused
projection, passed on as they are), normalises q and k when `use_qk_l2norm_in_kernel` as fla and
HF do (`x * rsqrt(sum(x^2) + 1e-6)` in fp32, cast back; not `F.normalize`, whose
`x / max(|x|, eps)` differs), honours `cu_seqlens` (HF's `cu_seq_lens_q`, as fla does; HF's torch
reference drops it), drops HF's forward plumbing that rides along in the layer's `**kwargs`
(`use_cache`, `position_ids`, ...: HF's wrapper passes on only its kernel's parameters) and raises
TypeError naming any kernel keyword (fla's) it cannot honour. The decode step (one token with
a cache) keeps HF's `torch_recurrent_gated_delta_rule`.

Grouped heads: the op takes q and k at the key-head count (value head `i` reads key head
`i // (H // Hg)`), so a GVA-aware backend reads them once per group. transformers 5.x layers
hand the chunk function q and k at that count already (HF's reference repeats them inside
itself). Layers that repeat them before the call (`query.repeat_interleave(self.num_v_heads //
self.num_k_heads, dim=2)` in the layer's forward, as transformers 4.x's did) are found when
`enable(model)` reads the layer's forward; their adapter hands the op every r-th head of the
repeated q and k (`q[:, :, ::r]`, the originals) when the call's shapes say they are repeated.
The slice is differentiable: the op's dq/dk at the key heads (sums over each group) land on one
head of each group, and the repeat's backward sums the group, so the un-repeated q and k get
the very gradient they would without the slice. A layer whose whole forward a `kernels`
hub kernel replaced (`model.kernelize()`) does not call the name at all.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import sys
import textwrap
import threading
import types
import warnings
import weakref
from contextlib import contextmanager

import torch

import gdr_dispatch as _gdr
from gdr_dispatch import caches

# The modeling modules whose Gated DeltaNet layer calls `torch_chunk_gated_delta_rule` by its
# module-level name (transformers 5.x); `enable(model)` also finds any other module with that
# name whose `*GatedDeltaNet` layer the model holds.
MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)
FUNC_NAME = "torch_chunk_gated_delta_rule"
INSTANCE_ATTR = "chunk_gated_delta_rule"  # where a layer holds the function itself (transformers 4.x)
EPS = 1e-6  # fla's and HF's l2norm eps

_lock = threading.RLock()
_originals: dict[str, tuple] = {}  # key -> (module name or weakref to the layer, attribute, what it was)

# Keywords meant for the kernel. HF's decorated function passes on only the keywords that its
# implementation (fla's op, or the torch reference) names, so anything else reaching the layer's
# `**kwargs` (`use_cache`, `position_ids`, `output_attentions`, `max_length_q`, ...) is HF's forward
# plumbing, dropped here as there. A kernel keyword the op cannot honour is a TypeError.
_HONOURED = ("scale", "cu_seqlens", "state_v_first", "transpose_state_layout", "save_states",
             "use_beta_sigmoid_in_kernel", "allow_neg_eigval")
# fla's precomputed helpers for `cu_seqlens`: the op derives its own, so they are ignored
_HINTS = ("cu_seqlens_cpu", "chunk_indices")
# fla keywords honoured only at their default, None or False
_DEFAULT_ONLY = ("cp_context", "head_first", "use_gate_in_kernel", "A_log", "dt_bias", "gk", "gv")
_fla_keywords: frozenset = frozenset()  # fla's own op's keywords where fla is loaded: unknown ones raise


def _load_fla_keywords() -> frozenset:
    """The keywords of the installed fla's `chunk_gated_delta_rule` (only where HF's modeling
    module already imported fla: this does not import it), so a keyword a newer fla added is a
    TypeError rather than silently dropped."""
    global _fla_keywords
    mod = sys.modules.get("fla.ops.gated_delta_rule")
    fn = getattr(mod, "chunk_gated_delta_rule", None)
    if fn is not None:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            params = ()
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        _fla_keywords = frozenset(names - {"q", "k", "v", "g", "beta"})
    return _fla_keywords


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's and HF's q/k normalisation, `x * rsqrt(sum(x^2, -1) + 1e-6)`, in fp32 (fp64 stays
    fp64), returned in x's dtype. Eager 16-bit `[B, T, H, D]` CUDA tensors (plain ones, outside a
    dispatch mode) take one Triton pass each way (backends/kernels/l2norm.py: no autotune, so a
    model's first step compiles it once per layout; views are read in place, HF Qwen3-Next's
    transposed q and k along their tokens); the torch form below costs ~8 launches
    forward and ~10 backward with fp32 intermediates of the tensor's size. Traced calls keep the
    torch form (inductor fuses it), and so do calls inside a CUDA graph capture (a first call's
    compile does not belong in one)."""
    if (type(x) is torch.Tensor and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 4
            and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()
            and not torch.cuda.is_current_stream_capturing()):
        fused = _fused_l2norm()
        if fused is not None:
            return fused(x, EPS)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + EPS)).to(x.dtype)


def _fused_l2norm():
    """The one-pass kernels' autograd function, as backends/ registered it (None where not)."""
    from gdr_dispatch.registry import kernel

    return kernel("l2norm")


def hf_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                              output_final_state=False, use_qk_l2norm_in_kernel=False, *, _repeats=1, **kwargs):
    """HF's `torch_chunk_gated_delta_rule` call, run by `gdr_dispatch.chunk_gated_delta_rule`.

    Returns `(o [B, T, H, V] in query's dtype, final_state [B, H, K, V] fp32 or None)`, as HF's
    reference does. `chunk_size` is accepted and ignored (the op's chunk is fixed; the result
    does not depend on it beyond rounding). Besides HF's keywords it takes fla's `scale`,
    `cu_seqlens`, `state_v_first` (or the old `transpose_state_layout`),
    `use_beta_sigmoid_in_kernel`, `allow_neg_eigval` and our `save_states`. `_repeats` (set by
    `enable` for layers that repeat q and k before the call): the repeat factor r, undone by
    taking every r-th head when q and k come with the value heads' count.
    """
    if (_repeats > 1 and query.shape[2] == value.shape[2] == key.shape[2] and query.shape[2] % _repeats == 0
            and _interleaved(query, key, _repeats)):
        query, key = query[:, :, ::_repeats], key[:, :, ::_repeats]
    scale = kwargs.pop("scale", None)
    cu_seqlens = kwargs.pop("cu_seqlens", None)
    state_v_first = bool(kwargs.pop("state_v_first", False))
    if "transpose_state_layout" in kwargs:
        state_v_first = state_v_first or bool(kwargs.pop("transpose_state_layout"))
    save_states = kwargs.pop("save_states", None)
    beta_sigmoid = bool(kwargs.pop("use_beta_sigmoid_in_kernel", False))
    neg_eigval = bool(kwargs.pop("allow_neg_eigval", False))
    for name in _HINTS:
        kwargs.pop(name, None)
    for name, value_ in kwargs.items():
        if name in _DEFAULT_ONLY:
            if value_ is None or value_ is False:
                continue
        elif name not in _fla_keywords:
            continue  # HF's forward plumbing (see _HONOURED)
        raise TypeError(f"gdr_dispatch.integrations.transformers: chunk_gated_delta_rule cannot honour the "
                        f"keyword {name}={_brief(value_)} (gdr_dispatch.chunk_gated_delta_rule has no such "
                        f"option); call disable() to run HF's function for this model")

    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    if beta_sigmoid:  # fla: sigmoid(beta), times 2 with allow_neg_eigval
        beta = beta.sigmoid() * 2 if neg_eigval else beta.sigmoid()
    # the op keeps the log decay in fp32 (fp64 for fp64); HF builds g in fp32 from `a.float()`,
    # but a caller under autocast or another model may hand it in bf16/fp16
    if g.dtype not in (torch.float32, torch.float64):
        g = g.float()
    if initial_state is not None and initial_state.dtype not in (torch.float32, torch.float64):
        initial_state = initial_state.float()  # a cache kept in bf16; HF's reference upcasts it too
    return _gdr.chunk_gated_delta_rule(  # looked up per call (a test wraps it)
        query, key, value, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=bool(output_final_state), cu_seqlens=cu_seqlens, state_v_first=state_v_first,
        save_states=save_states)


hf_chunk_gated_delta_rule._gdr_dispatch_hook = True


#: repeat factor -> whether q and k came interleaved (head i of the key heads at i*r .. i*r + r - 1),
#: checked on the first eager call with that factor
_LAYOUT_CHECKED: dict = {}


@caches.on_clear
def _forget_layouts() -> None:
    _LAYOUT_CHECKED.clear()


def _interleaved(query, key, r: int) -> bool:
    """Whether q and k repeated `r` times along the heads are `repeat_interleave`'s layout (every
    r-th head an original, the slice's premise), checked on the values of the first eager call per
    `r` and remembered; a traced call trusts the layer's source (`layer_repeats`). A layer that
    tiles instead (`repeat`) is said once and runs unsliced: the op then takes all the heads."""
    ok = _LAYOUT_CHECKED.get(r)
    if ok is None:
        if torch.compiler.is_compiling():
            return True
        ok = all(torch.equal(x, x[:, :, ::r].repeat_interleave(r, dim=2)) for x in (query, key))
        _LAYOUT_CHECKED[r] = ok
        if not ok:
            warnings.warn(f"gdr_dispatch.integrations.transformers: this model's layers hand q and k repeated {r} "
                          f"times, but not as repeat_interleave lays them out: the op takes every head as given "
                          f"(no saving from reading q and k at the key heads)", stacklevel=3)
    return ok


def _adapter(repeats: int):
    """The adapter for layers that repeat q and k `repeats` times before the call (1: none)."""
    if repeats <= 1:
        return hf_chunk_gated_delta_rule
    fn = functools.partial(hf_chunk_gated_delta_rule, _repeats=repeats)
    fn._gdr_dispatch_hook = True
    return fn


#: HF's repeat of q and k to the value heads in a layer's forward (transformers 4.x)
_REPEAT = re.compile(r"(query|key)\s*=\s*\1\.repeat_interleave\(\s*self\.num_v_heads\s*//\s*"
                     r"self\.num_k_heads\s*,\s*dim\s*=\s*2\s*\)")


def layer_repeats(layer) -> int:
    """How many times `layer` repeats q and k along the heads before its chunk call: its
    `num_v_heads // num_k_heads` when its forward's code (not a comment or a string in it) holds
    HF's `repeat_interleave` of both, else 1. The first call checks the values too (`_interleaved`)."""
    r = getattr(layer, "num_v_heads", 0) // max(getattr(layer, "num_k_heads", 0) or 1, 1)
    if r <= 1:
        return 1
    try:
        src = textwrap.dedent(inspect.getsource(type(layer).forward))
        statements = [ast.unparse(node) for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Assign)]
    except (OSError, TypeError, SyntaxError):
        return 1
    return r if {m.group(1) for x in statements for m in _REPEAT.finditer(x)} == {"query", "key"} else 1


def _brief(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"<tensor {list(x.shape)} {str(x.dtype).replace('torch.', '')}>"
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_hook(fn) -> bool:
    return bool(getattr(fn, "_gdr_dispatch_hook", False))


def _repeats_of(fn) -> int:
    return getattr(fn, "keywords", {}).get("_repeats", 1) if isinstance(fn, functools.partial) else 1


def _sites_of(model) -> list[tuple[str, object, str, int]]:
    """`(key, owner, attribute, repeats)` for each place `model`'s Gated DeltaNet layers read their
    chunk function from: the layer itself where it holds it as an instance attribute
    (transformers 4.x bound `self.chunk_gated_delta_rule` in `__init__`), else its modeling
    module's `FUNC_NAME` (transformers 5.x, read at call time); `repeats`: `layer_repeats`, for a
    module the one its layers share (1 when they differ: the adapter then slices nothing)."""
    sites, modules = [], {}
    for layer in model.modules():
        cls = type(layer)
        if not cls.__name__.endswith("GatedDeltaNet"):
            continue
        if callable(layer.__dict__.get(INSTANCE_ATTR)):
            sites.append((f"{cls.__name__}@{id(layer):#x}", layer, INSTANCE_ATTR, layer_repeats(layer)))
            continue
        mod = sys.modules.get(cls.__module__)
        if mod is not None and hasattr(mod, FUNC_NAME):
            modules.setdefault(cls.__module__, (mod, set()))[1].add(layer_repeats(layer))
    for name, (mod, repeats) in modules.items():
        sites.append((name, mod, FUNC_NAME, repeats.pop() if len(repeats) == 1 else 1))
    if not sites:
        raise ValueError(f"{type(model).__name__} has no Gated DeltaNet layer that reads its chunk function "
                         f"from {INSTANCE_ATTR} or its module's {FUNC_NAME} (supported: transformers 5.x "
                         f"Qwen3-Next, Qwen3.5, Qwen3.5-MoE)")
    return sites


def enable(model=None) -> list[str]:
    """Route the chunked Gated DeltaNet call of HF's Qwen3-Next / Qwen3.5 layers through
    `gdr_dispatch.chunk_gated_delta_rule`. With `model`, where its `*GatedDeltaNet` layers read
    the function (ValueError if it has none); else every module of `MODULES` that this
    transformers has. Idempotent. Returns the keys it patched now (module names, or
    `Class@id` for a layer patched on the instance), for `disable`."""
    _load_fla_keywords()
    with _lock:
        if model is not None:
            sites = _sites_of(model)
        else:
            sites = []
            for name in MODULES:
                try:
                    sites.append((name, importlib.import_module(name), FUNC_NAME, 1))
                except ImportError:
                    continue
            if not sites:
                raise ImportError("gdr_dispatch.integrations.transformers: this transformers has none of "
                                  + ", ".join(MODULES))
        patched = []
        for key, owner, attr, repeats in sites:
            current = getattr(owner, attr, None)
            if current is None:
                raise AttributeError(f"{key} has no {attr} (transformers {_tf_version()}): "
                                     f"the hook knows transformers 5.x's layout")
            if _is_hook(current):
                if _repeats_of(current) != repeats and _repeats_of(current) > 1:
                    # another model's layers repeat otherwise: slicing for one would be wrong for
                    # the other, so this module's adapter slices nothing from now on
                    setattr(owner, attr, hf_chunk_gated_delta_rule)
                continue
            ref = key if isinstance(owner, types.ModuleType) else weakref.ref(owner)
            _originals[key] = (ref, attr, current)
            setattr(owner, attr, _adapter(repeats))
            patched.append(key)
        return patched


def disable(keys=None) -> list[str]:
    """Undo `enable`: rebind each patched name to exactly what it was (all of them, or the keys
    `enable` returned). A name someone rebound after us is left as it is (with a warning).
    Returns the keys restored."""
    with _lock:
        keys = list(_originals) if keys is None else [k for k in keys if k in _originals]
        restored = []
        for key in keys:
            ref, attr, original = _originals.pop(key)
            owner = sys.modules.get(ref) if isinstance(ref, str) else ref()
            if owner is None:
                continue  # module unloaded or layer collected
            if not _is_hook(getattr(owner, attr, None)):
                warnings.warn(f"gdr_dispatch: {key}.{attr} was rebound after enable(); left as it is")
                continue
            setattr(owner, attr, original)
            restored.append(key)
        return restored


def is_enabled(module: str = MODULES[0]) -> bool:
    """Whether `module`'s `FUNC_NAME` is currently the hook."""
    mod = sys.modules.get(module)
    return mod is not None and _is_hook(getattr(mod, FUNC_NAME, None))


@contextmanager
def use_gdr_dispatch(model=None):
    """`enable(model)` for the block; on exit undoes what this block enabled (nested blocks and an
    outer `enable` keep theirs)."""
    patched = enable(model)
    try:
        yield
    finally:
        disable(patched)


def _tf_version() -> str:
    try:
        import transformers
        return transformers.__version__
    except ImportError:
        return "not installed"
