import contextlib
import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (fp16/fp32 only: bf16 dots come
# back wrong there). It is read when a kernel is decorated, so before gdr_dispatch loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from gdr_dispatch import oracle_grads  # noqa: E402
from gdr_dispatch.dispatch import clear_caches  # noqa: E402
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated_tables(tmp_path, monkeypatch):
    """Every test gets its own empty user table, no forced backend, and fresh caches."""
    monkeypatch.setenv("GDR_TUNING_CACHE", str(tmp_path / "user_tables"))
    monkeypatch.delenv("GDR_BACKEND", raising=False)
    monkeypatch.delenv("GDR_AUTOTUNE", raising=False)
    clear_caches()
    yield
    clear_caches()


def free_port() -> int:
    """A TCP port on localhost no one listens on now (for gloo process groups in the tests)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def with_backends():
    """`with_backends(b1, b2, hide=("flash_qla",))`: register backends (and hide others) until the
    test ends, through the registry's public scope."""
    from gdr_dispatch import registry

    stack = contextlib.ExitStack()

    def add(*backends, hide=()):
        stack.enter_context(registry.scoped(add=backends, hide=hide))
        return backends[0] if len(backends) == 1 else backends

    yield add
    stack.close()


def case(spec: ShapeSpec, device="cpu", seed=0, with_oracle=True):
    """(kwargs for fused_gdr_bwd, float64 oracle gradients or None) for one shape."""
    inputs = make_inputs(spec, device, seed=seed)
    if not with_oracle:
        return call_kwargs(inputs), None
    ref = oracle_grads(
        inputs["q"], inputs["k"], inputs["v"], inputs["g_raw"], inputs["b"], inputs["do"], inputs["dht"],
        scale=inputs["scale"], initial_state=inputs["initial_state"], cu_seqlens=inputs["cu_seqlens"],
        state_v_first=spec.state_v_first,
    )
    return call_kwargs(inputs), ref


def rel_errors(grads, ref) -> dict:
    out = {}
    for name in grads._fields:
        x, y = getattr(grads, name), getattr(ref, name)
        if x is None or y is None:
            assert x is None and y is None, f"{name}: one of backend/oracle is None"
            continue
        assert x.shape == y.shape, f"{name}: shape {tuple(x.shape)} vs oracle {tuple(y.shape)}"
        x, y = x.double(), y.double()
        out[name] = ((x - y).norm() / y.norm()).item()
    return out


# Shapes for the CPU plumbing tests of backends whose kernels need a GPU (their math swapped
# for exact torch stand-ins: tests/fake_fla.py, tests/fake_flash_qla.py).
PLUMBING = [
    ShapeSpec(B=2, T=100, H=4, Hg=2, K=32, V=16),
    ShapeSpec(B=1, T=40, H=2, K=16, V=16, initial_state=False, dht=False),
    # initial_state without dht (fake_flash_qla leaves dh0 unwritten then, as FlashQLA's sm120 kernel)
    ShapeSpec(seqlens=(1, 63, 64, 65), H=4, Hg=2, K=16, V=32, state_v_first=True, dht=False),
]


def plumbing_errors(backend: str, spec: ShapeSpec, h_mode: str, monkeypatch) -> dict:
    """`backend` forced through `fused_gdr_bwd` on fp16 inputs of `spec`: each gradient's
    relative error against the float64 oracle (fp16 rounding when the plumbing is right)."""
    from dataclasses import replace

    from gdr_dispatch import fused_gdr_bwd

    monkeypatch.setenv("GDR_BACKEND", backend)
    kwargs, ref = case(replace(spec, dtype="float16", h=h_mode))
    return rel_errors(fused_gdr_bwd(**kwargs), ref)


#: pass 1's walks (backends/kernels/segment_maps.py): forming each chunk, reading `_factors`' chunks,
#: or reading them with TMA (`use_tma_walks`; on a CPU under Triton's interpreter)
WALKS = ("form", "factors", "tma")


def edge_gate_inputs(spec: ShapeSpec, segment_tokens: int, seed: int = 4) -> dict:
    """`spec`'s backward call with a log decay that changes by segment (of `segment_tokens`
    tokens, counted in each sequence), residuals recomputed: weak everywhere (-0.002 a token) but
    for four tokens of -10 (summing to -40, below fp64's and fp32's rounding) at the end of an odd
    segment's first chunk and at the start of its last. An even segment's windows then reach one
    chunk into each neighbour, and every token of that chunk weighs fully in its warm-ups
    (segment_maps.CROSS); with windows kept inside their segments it is exact."""
    from gdr_dispatch.reference import prepare_residuals

    x = make_inputs(spec, "cpu", seed=seed)
    g = torch.full_like(x["g_raw"], -0.002)
    rows = g.view(-1, g.shape[-1]) if spec.seqlens is not None else None
    start = 0
    for n, length in enumerate(spec.seq_lens):
        seq = rows[start:start + length] if rows is not None else g[n]
        for s0 in range(segment_tokens, length, 2 * segment_tokens):  # the odd segments
            end = min(s0 + segment_tokens, length)
            last = s0 + (end - s0 - 1) // 64 * 64  # its last chunk's first token
            seq[s0 + 60:s0 + 64] = -10.0
            seq[last:last + 4] = -10.0
        start += length
    res = prepare_residuals(x["q"], x["k"], x["v"], g, x["b"], initial_state=x["initial_state"],
                            cu_seqlens=x["cu_seqlens"], chunk_size=spec.chunk_size, state_v_first=spec.state_v_first)
    out = {**call_kwargs(x), "a": res.a.to(x["a"].dtype), "g": res.g.to(x["g"].dtype)}
    out["h"] = None if x["h"] is None else res.h.to(x["h"].dtype)
    return out


def set_walks(monkeypatch, walks: str) -> None:
    from gdr_dispatch.backends.kernels import segment_maps as sm

    monkeypatch.setattr(sm, "FACTORS", walks != "form")
    monkeypatch.setattr(sm, "FACTORS_GPU_VERIFIED", True)
    monkeypatch.setattr(sm, "TMA_WALKS", walks == "tma")
    monkeypatch.setattr(sm, "TMA_WALKS_GPU_VERIFIED", True)
    if walks == "tma" and not torch.cuda.is_available():
        monkeypatch.setattr(sm, "tma_capable", lambda dev: True)


from gdr_dispatch import registry as _registry  # noqa: E402


class TorchAsPlain(_registry.Backend):
    """The torch backend's math under another name, allowed anywhere (a faked GPU too) and as a
    context-parallel split candidate: for dispatch and tune tests."""

    name = "fake_plain"

    def not_supported_reasons(self, problem):
        return []

    def run(self, call):
        return _registry.get_backend("torch").run(call)
