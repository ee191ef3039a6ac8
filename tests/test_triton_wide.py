"""The full-K wide stage-5+6 kernel against the torch backend's stage functions (Triton's
interpreter on the CPU, fp32 and fp16), and the `triton_wide` backend's plumbing."""

from dataclasses import replace

import pytest
import torch

from gdr_dispatch import get_backend
from gdr_dispatch.backends.kernels.chunk_grid import varlen_chunk_indices
from gdr_dispatch.backends.kernels.wy_dqkg_transposed import wy_dqkg_transposed
from gdr_dispatch.backends.kernels.wy_dqkg_wide import wy_dqkg_wide
from fixtures import fused_stage_case
from gdr_dispatch.problem import DeviceInfo
from gdr_dispatch.shapes import ShapeSpec

SHAPES = [
    ShapeSpec(B=2, T=100, H=4, Hg=2, K=32, V=16),  # T % 64 != 0, grouped heads
    ShapeSpec(B=1, T=40, H=2, K=16, V=40, initial_state=False, dht=False),  # T < 64, V not a power of 2
    ShapeSpec(seqlens=(1, 63, 64, 65), H=2, K=16, V=48, state_v_first=True),
]


KERNELS = {"wide": wy_dqkg_wide, "transposed": lambda **kw: wy_dqkg_transposed(**kw, KS=16)}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 2e-3)])
@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: s.label())
def test_kernel_matches_stage_functions(spec, dtype, tol, kernel):
    """The wide kernel and the transposed main + side pair: same contract, same expectations."""
    x, kin, expected = fused_stage_case(spec, dtype)
    cu = x["cu_seqlens"]
    ci = None if cu is None else varlen_chunk_indices(spec.seq_lens, 64, "cpu")
    out = KERNELS[kernel](**kin, scale=x["scale"], cu_seqlens=cu, chunk_indices=ci,
                          state_v_first=spec.state_v_first, BV=16)
    for name, got in zip(("dq", "dk", "dv", "db", "dg"), out):
        want = expected[name]
        assert got.shape == want.shape, name
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < tol, f"{name}: rel err {err:.2e}"
    assert out[0].dtype == out[1].dtype == x["q"].dtype and out[4].dtype == torch.float32


def test_wide_kernel_rejects_k_it_cannot_hold():
    z = torch.zeros(1, 8, 1, 24)
    with pytest.raises(ValueError, match="K must be a power of two"):
        wy_dqkg_wide(z, z, z, z, z, z, torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 1), torch.zeros(1, 8, 1),
                     torch.zeros(1, 1, 1, 24, 24), torch.zeros(1, 1, 1, 24, 24), 1.0)


@pytest.mark.parametrize("backend", ["triton_wide", "triton_transposed"])
@pytest.mark.parametrize("h_mode", ["given", "none"])
@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: s.label())
def test_triton_backend_plumbing(spec, h_mode, backend, monkeypatch):
    """The whole backend, fla's stages 1-4 replaced by exact stand-ins, fp16 inputs."""
    import fake_fla
    from conftest import case, rel_errors

    from gdr_dispatch import fused_gdr_bwd

    calls = fake_fla.install(monkeypatch)
    monkeypatch.setattr(type(get_backend(backend)), "not_supported_reasons", lambda self, p: [])
    monkeypatch.setenv("GDR_BACKEND", backend)
    kwargs, ref = case(replace(spec, dtype="float16", h=h_mode))
    errs = rel_errors(fused_gdr_bwd(**kwargs), ref)
    assert not {n: e for n, e in errs.items() if not e < 5e-3}, errs
    assert ("chunk_gated_delta_rule_fwd_h" in calls) == (h_mode == "none"), "h given must not be recomputed"


H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), 132)


def test_limits_are_fla_stages_plus_k_and_not_fla_stage_5():
    p = replace(ShapeSpec(B=2, T=4096, H=32).problem(torch.device("cpu")), device=H200)
    for name in ("triton_wide", "triton_transposed"):
        reasons = get_backend(name).not_supported_reasons(p)
        assert not any("chunk_bwd_dqkwg" in r for r in reasons), (name, reasons)  # fla's stage-5 hazard is not ours
        assert any("K must be 128 (the only K run on a GPU" in r for r in get_backend(name).not_supported_reasons(replace(p, K=256)))
        text = " | ".join(get_backend(name).not_supported_reasons(replace(p, dtype="float32", chunk_size=32)))
        assert "bfloat16 or float16" in text and "chunk_size must be 64" in text


def test_supported_is_about_correctness_not_speed():
    """triton_transposed is slower than triton_wide on the H200, and still supported there:
    speed is the tables' and the static order's business."""
    p = replace(ShapeSpec(B=2, T=4096, H=32).problem(torch.device("cpu")), device=H200)
    wide, transposed = get_backend("triton_wide"), get_backend("triton_transposed")
    assert transposed.not_supported_reasons(p) == wide.not_supported_reasons(p) == []
    assert transposed.static_rank > wide.static_rank


@pytest.mark.parametrize("bad", [dict(side_KS=32), dict(side_KS=64), dict(side_warps=4)])
def test_transposed_launcher_refuses_side_settings_measured_wrong_on_the_h200(bad):
    # the guard runs before any launch, so dummy tensors suffice
    q = torch.zeros(1, 64, 1, 128)
    v = torch.zeros(1, 64, 1, 128)
    with pytest.raises(ValueError, match="side_KS=.*side_warps=.*float64"):
        wy_dqkg_transposed(q, q, v, v, v, v, None, None, None, None, None, 1.0, **bad)
