"""The fla backend's CPU-checkable parts: its `supported` reasons and its two Triton kernels
(run in Triton's interpreter without a GPU). The backend itself runs in test_gpu.py."""

import math
from dataclasses import replace

import pytest
import torch

from gdr_dispatch import chunked_math as ex
from gdr_dispatch import get_backend
from gdr_dispatch.backends import fla_chain
from gdr_dispatch.toolchain import version_tuple
from gdr_dispatch.backends.kernels.chunk_grid import varlen_chunk_indices
from gdr_dispatch.backends.kernels.corrected_values import corrected_values
from gdr_dispatch.backends.kernels.gate_wy_inverse import gate_wy_inverse
from gdr_dispatch.chunk_layout import ChunkLayout
from gdr_dispatch.problem import DeviceInfo
from gdr_dispatch.shapes import ShapeSpec, make_inputs

from conftest import PLUMBING, plumbing_errors

H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), 132)
A100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 108)


def problem(device=H200, triton="3.6.0", fla="0.6.0", **spec):
    p = ShapeSpec(**{"B": 2, "T": 4096, "H": 32, **spec}).problem(torch.device("cpu"))
    versions = tuple((k, {"triton": triton, "fla": fla}.get(k, v)) for k, v in p.versions)
    return replace(p, device=device, versions=versions)


def reasons(p):
    return get_backend("fla").not_supported_reasons(p)


def test_refuses_cpu_with_a_reason():
    p = problem(device=DeviceInfo("cpu", "cpu", None, 2))
    assert any("needs a CUDA device" in r and "cpu" in r for r in reasons(p))


def test_takes_the_training_shapes_on_a_hopper_with_fla_tilelang(monkeypatch):
    monkeypatch.setattr(fla_chain, "_fla_tilelang_dqkwg_usable", lambda: (True, ""))
    assert reasons(problem()) == []
    assert reasons(problem(seqlens=(4096,) * 8, H=32, Hg=16, B=1, state_v_first=True)) == []


def test_lists_every_reason_at_once(monkeypatch):
    monkeypatch.setattr(fla_chain, "_fla_tilelang_dqkwg_usable", lambda: (True, ""))
    rs = reasons(problem(dtype="float32", K=512, chunk_size=32, fla="0.5.1"))
    text = " | ".join(rs)
    assert len(rs) == 4, rs
    for words in ("fla-core >= 0.6.0", "found 0.5.1", "bfloat16 or float16", "got float32",
                  "chunk_size must be 64", "K must be in 16..256"):
        assert words in text


def test_missing_fla_is_named():
    assert any("fla-core is not installed" in r for r in reasons(problem(fla=None)))


@pytest.mark.parametrize("triton,hit", [("3.3.1", False), ("3.4.0", True), ("3.6.0", True), ("3.7.1", False)])
def test_hopper_triton_hazard_needs_fla_tilelang(monkeypatch, triton, hit):
    monkeypatch.setattr(fla_chain, "_fla_tilelang_dqkwg_usable", lambda: (False, "FLA_TILELANG=0 turns it off"))
    rs = reasons(problem(triton=triton))
    assert any("fla issue 640" in r and "FLA_TILELANG=0" in r for r in rs) == hit
    assert reasons(problem(device=A100, triton=triton)) == []  # not Hopper: fla's Triton path is right


def test_version_parse():
    assert version_tuple("3.6.0+git1234") == (3, 6, 0)
    assert version_tuple("0.6") == (0, 6, 0)
    assert version_tuple("3.7.1rc1") == (3, 7, 1)


# -- the two kernels, against the torch backend's stage math (interpreter on the CPU) ------
KERNEL_SHAPES = [
    ShapeSpec(B=2, T=100, H=4, Hg=2, K=32, V=16, h="given"),
    ShapeSpec(seqlens=(1, 63, 64, 65), H=2, K=16, V=32, h="given", state_v_first=True),
]


def _chunked(spec, dtype):
    x = make_inputs(replace(spec, dtype=dtype), "cpu", seed=5)
    cu = x["cu_seqlens"]
    ci = None if cu is None else varlen_chunk_indices(spec.seq_lens, 64, "cpu")
    lay = ChunkLayout.build(spec.B, spec.T, spec.seq_lens, 64, "cpu")
    return x, cu, ci, lay


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("spec", KERNEL_SHAPES, ids=lambda s: s.label())
def test_gate_wy_inverse_kernel(spec, dtype):
    x, cu, ci, lay = _chunked(spec, dtype)
    out, g_log2 = gate_wy_inverse(x["a"], x["g"], cu, ci, with_log2_gate=True)
    assert torch.allclose(g_log2, x["g"].float() / math.log(2), rtol=1e-6, atol=1e-7)
    assert torch.equal(gate_wy_inverse(x["a"], x["g"], cu, ci), out)
    G = lay.gather_gate(x["g"], torch.float64)
    ref = lay.scatter(ex.gate_decay_matrix(G) * lay.gather(x["a"], torch.float64), torch.float64)
    assert out.dtype == x["a"].dtype
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-6 if dtype == "float32" else 1e-3), err
    assert ref.abs().sum() > 0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("spec", KERNEL_SHAPES, ids=lambda s: s.label())
def test_corrected_values_kernel(spec, dtype):
    x, cu, ci, lay = _chunked(spec, dtype)
    f64 = torch.float64
    k = ex.expand_heads(lay.gather(x["k"], f64), spec.H)
    A = lay.gather(x["a"], f64)
    w, u = ex.recompute_w_u(k, lay.gather(x["v"], f64), lay.gather(x["b"], f64), A, lay.gather_gate(x["g"], f64))
    h = x["h"].transpose(-1, -2) if spec.state_v_first else x["h"]
    ref = lay.scatter(ex.v_new_from_states(w, u, lay.gather_chunks(h, f64)), f64)
    dt = x["q"].dtype
    out = corrected_values(lay.scatter(u, dt), lay.scatter(w, dt), x["h"], 64, cu, ci, spec.state_v_first)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == "float32" else 2e-3), err


def test_varlen_chunk_indices():
    ci = varlen_chunk_indices([1, 0, 64, 65], 64, "cpu")
    assert ci.tolist() == [[0, 0], [2, 0], [3, 0], [3, 1]]


# -- the whole backend on the CPU, fla's stages replaced by exact stand-ins (fake_fla.py) ---
@pytest.mark.parametrize("h_mode", ["given", "none"])
@pytest.mark.parametrize("spec", PLUMBING, ids=lambda s: s.label())
def test_fla_backend_plumbing_against_the_oracle(spec, h_mode, monkeypatch):
    """Conversions, layouts and wiring of the fla backend, with fla's math swapped for exact
    torch (its kernels need a GPU): fp16 inputs, so the result is within fp16 rounding of the
    oracle; a wrong conversion (log2 gate, gating, states, heads) is off by O(1)."""
    import fake_fla

    calls = fake_fla.install(monkeypatch)
    monkeypatch.setattr(fla_chain.FlaBackend, "not_supported_reasons", lambda self, p: [])
    errs = plumbing_errors("fla", spec, h_mode, monkeypatch)
    assert not {n: e for n, e in errs.items() if not e < 5e-3}, errs
    assert ("chunk_gated_delta_rule_fwd_h" in calls) == (h_mode == "none"), "h given must not be recomputed"
