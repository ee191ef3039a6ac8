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
