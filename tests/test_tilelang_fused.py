"""The TileLang fused backend on a machine without a GPU: its reasons, and that its kernel
compiles for sm_90a within the H200's shared memory (needs nvcc; skipped without it)."""

import re
import shutil
from dataclasses import replace

import pytest
import torch

from gdr_dispatch import get_backend
from gdr_dispatch.backends import tilelang_fused
from gdr_dispatch.registry import DeviceInfo
from gdr_dispatch.shapes import ShapeSpec

H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), 132)
B200 = DeviceInfo("cuda", "NVIDIA B200", (10, 0), 148)


def reasons(device=H200, **spec):
    p = replace(ShapeSpec(**{"B": 2, "T": 4096, "H": 32, **spec}).problem(torch.device("cpu")), device=device)
    return get_backend("tilelang_fused").not_supported_reasons(p)


def test_takes_the_training_shapes_on_sm90(monkeypatch):
    monkeypatch.setattr(tilelang_fused, "nvcc_found", lambda: True)
    assert reasons() == []
    assert reasons(h="none", seqlens=(4096,) * 8, B=1, Hg=16) == []


def test_other_arches_and_shapes_say_why(monkeypatch):
    monkeypatch.setattr(tilelang_fused, "nvcc_found", lambda: True)
    text = " | ".join(reasons(device=B200, K=64, chunk_size=32, dtype="float32"))
    for words in ("built for sm_90a", "sm_100", "K and V must be 128", "chunk_size must be 64", "bfloat16 or float16"):
        assert words in text
    monkeypatch.setattr(tilelang_fused, "nvcc_found", lambda: False)
    assert any("no nvcc" in r for r in reasons())
    monkeypatch.setattr(tilelang_fused, "nvcc_found", lambda: True)
    assert any("32-bit integers" in r for r in reasons(B=64, T=32768))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile for sm_90a")
def test_kernel_compiles_for_sm90a_within_shared_memory():
    from gdr_dispatch.backends.kernels.tilelang_fused_bwd import build_fused_bwd

    kern = build_fused_bwd(4, 2, 128, 128, 64, 128 ** -0.5, "bfloat16", "bfloat16", "bfloat16")
    src = kern.get_kernel_source()
    offsets = [int(x) for x in re.findall(r"buf_dyn_shmem \+ (\d+)", src)]
    assert offsets and max(offsets) < 227 * 1024 - 8 * 1024, max(offsets)  # room for the last tiles


@pytest.mark.parametrize("spec", [ShapeSpec(B=2, T=100, H=4, Hg=2, K=16, V=32, h="given"),
                                  ShapeSpec(seqlens=(1, 63, 64, 65), H=2, K=16, V=16, h="given", state_v_first=True)],
                         ids=lambda s: s.label())
def test_h_recompute_for_h_none(spec, monkeypatch):
    """With h=None the backend recomputes h with fla's stages 1-2 (stood in on the CPU):
    same chunk-start states as prepare_residuals', in the layout of the contract's h."""
    import fake_fla

    from gdr_dispatch.backends.common.fla_pipeline import recompute_states
    from gdr_dispatch.contract import validate
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    fake_fla.install(monkeypatch)
    x = make_inputs(replace(spec, dtype="float16"), "cpu", seed=2)
    call = validate(**{**call_kwargs(x), "h": None})
    h = recompute_states(call)
    assert h.shape == x["h"].shape
    err = ((h.double() - x["h"].double()).norm() / x["h"].double().norm()).item()
    assert err < 5e-3, err


EMULATED = [
    ShapeSpec(B=2, T=100, H=4, Hg=2, K=16, V=16),
    ShapeSpec(B=1, T=40, H=2, K=16, V=16, initial_state=False, dht=False),
    ShapeSpec(seqlens=(1, 63, 64, 65), H=2, K=16, V=16, state_v_first=True),
]


@pytest.mark.parametrize("spec", EMULATED, ids=lambda s: s.label())
def test_kernel_algorithm_matches_the_oracle(spec):
    """The kernel's steps, transcribed into torch (fused_kernel_emulation.py): exact in fp64,
    and within the GPU tolerance when its 16-bit shared tiles round as on the GPU."""
    from conftest import case, rel_errors
    from fused_kernel_emulation import emulate_fused_bwd

    from gdr_dispatch import GDRGrads

    for dtype, round_to, tol in (("float64", None, 1e-10), ("bfloat16", torch.bfloat16, 1e-2)):
        kw, ref = case(replace(spec, dtype=dtype, h="given"))
        out = emulate_fused_bwd(kw["q"], kw["k"], kw["v"], kw["do"], kw["a"], kw["g"], kw["b"], kw["h"], kw["dht"],
                                kw["scale"], spec.seq_lens, round_to=round_to, state_v_first=spec.state_v_first)
        grads = GDRGrads(*out[:5], out[5] if spec.initial_state else None)
        errs = rel_errors(grads, ref)
        assert all(e < tol for e in errs.values()), (dtype, errs)
