"""The full-K wide stage-5+6 kernel against the torch backend's stage functions (Triton's
interpreter on the CPU, fp32 and fp16), and the `triton_wide` backend's plumbing."""

from dataclasses import replace

import pytest
import torch

from gdr_dispatch import get_backend
from gdr_dispatch.backends import exact_torch as ex
from gdr_dispatch.backends import triton_wide
from gdr_dispatch.backends.kernels.chunk_grid import varlen_chunk_indices
from gdr_dispatch.backends.kernels.wy_dqkg_transposed import wy_dqkg_transposed
from gdr_dispatch.backends.kernels.wy_dqkg_wide import wy_dqkg_wide
from gdr_dispatch.chunk_layout import ChunkLayout
from gdr_dispatch.contract import chunk_counts
from gdr_dispatch.registry import DeviceInfo
from gdr_dispatch.shapes import ShapeSpec, make_inputs

F64 = torch.float64
SHAPES = [
    ShapeSpec(B=2, T=100, H=4, Hg=2, K=32, V=16),  # T % 64 != 0, grouped heads
    ShapeSpec(B=1, T=40, H=2, K=16, V=40, initial_state=False, dht=False),  # T < 64, V not a power of 2
    ShapeSpec(seqlens=(1, 63, 64, 65), H=2, K=16, V=48, state_v_first=True),
]


def stage_inputs_and_expected(spec, dtype):
    """Stages 1-4 by the torch backend; the kernel's inputs, and stages 5-7 as expected output."""
    x = make_inputs(replace(spec, dtype=dtype, h="none"), "cpu", seed=7)
    lay = ChunkLayout.build(spec.B, spec.T, spec.seq_lens, 64, "cpu")
    H, vf = spec.H, spec.state_v_first
    q, k = ex.expand_heads(lay.gather(x["q"], F64), H), ex.expand_heads(lay.gather(x["k"], F64), H)
    v, do, A, b = (lay.gather(x[n], F64) for n in ("v", "do", "a", "b"))
    G = lay.gather_gate(x["g"], F64)

    def state(s):
        return None if s is None else (s.transpose(-1, -2) if vf else s).to(F64)

    w, u = ex.recompute_w_u(k, v, b, A, G)
    h, v_new, _ = ex.chunk_states(k, w, u, G, state(x["initial_state"]))
    dvl = ex.dv_local(q, k, G, do, x["scale"])
    dh, _, du = ex.chunk_state_grads(q, k, w, G, state(x["dht"]), do, dvl, x["scale"])
    dq, dk, dw, dG = ex.dqkwg(q, k, v_new, w, G, h, du, do, dh, x["scale"], lay.chunk_len)
    dk2, dv, db, dG2 = ex.wy_bwd(k, v, b, A, G, dw, du)
    expected = {
        "dq": ex.reduce_heads(lay.scatter(dq, F64), spec.Hg), "dk": ex.reduce_heads(lay.scatter(dk + dk2, F64), spec.Hg),
        "dv": lay.scatter(dv, F64), "db": lay.scatter(db, F64), "dg": lay.scatter(ex.reverse_chunk_cumsum(dG + dG2), F64),
    }
    NT = sum(chunk_counts(spec.seq_lens, 64))
    lead = (1, NT) if spec.seqlens else (spec.B, NT // spec.B)

    def states_out(s, dt):
        out = lay.scatter_chunks(s, lead, dt)
        return out.transpose(-1, -2).contiguous() if vf else out

    dt = x["q"].dtype
    kernel_in = dict(q=x["q"], k=x["k"], v=x["v"], v_new=lay.scatter(v_new, dt), du=lay.scatter(du, dt), do=x["do"],
                     a=x["a"], g=x["g"], b=x["b"], h=states_out(h, dt), dh=states_out(dh, dt))
    return x, kernel_in, expected


KERNELS = {"wide": wy_dqkg_wide, "transposed": lambda **kw: wy_dqkg_transposed(**kw, KS=16)}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 2e-3)])
@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: s.label())
def test_kernel_matches_stage_functions(spec, dtype, tol, kernel):
    """The wide kernel and the transposed main + side pair: same contract, same expectations."""
    x, kin, expected = stage_inputs_and_expected(spec, dtype)
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

    fake_fla.install(monkeypatch)
    monkeypatch.setattr(type(get_backend(backend)), "not_supported_reasons", lambda self, p: [])
    monkeypatch.setenv("GDR_BACKEND", backend)
    kwargs, ref = case(replace(spec, dtype="float16", h=h_mode))
    errs = rel_errors(fused_gdr_bwd(**kwargs), ref)
    assert not {n: e for n, e in errs.items() if not e < 5e-3}, errs


def test_refused_until_verified_on_a_gpu(monkeypatch):
    p = replace(ShapeSpec(B=2, T=4096, H=32).problem(torch.device("cpu")),
                device=DeviceInfo("cuda", "NVIDIA H200", (9, 0), 132))
    monkeypatch.setattr(triton_wide, "GPU_VERIFIED", False)
    assert any("not verified on a GPU" in r for r in get_backend("triton_wide").not_supported_reasons(p))
    monkeypatch.setattr(triton_wide, "GPU_VERIFIED", True)
    reasons = get_backend("triton_wide").not_supported_reasons(p)
    assert not any("not verified" in r for r in reasons)
    assert not any("chunk_bwd_dqkwg" in r for r in reasons)  # fla's stage-5 hazard is not ours
    p256 = replace(p, K=256)
    assert any("K must be one of" in r for r in get_backend("triton_wide").not_supported_reasons(p256))


def test_transposed_refused_on_sm90_where_it_measured_slower_and_else_takes_what_wide_takes(monkeypatch):
    from gdr_dispatch.backends import triton_transposed

    h200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), 132)
    p = replace(ShapeSpec(B=2, T=4096, H=32).problem(torch.device("cpu")), device=h200)
    reasons = get_backend("triton_transposed").not_supported_reasons(p)
    assert any("slower than triton_wide" in r and "triton_wide runs the same math" in r for r in reasons), reasons
    monkeypatch.setattr(triton_transposed, "GPU_VERIFIED", False)
    assert any("not verified on a GPU" in r for r in get_backend("triton_transposed").not_supported_reasons(p))

    # where nothing was measured (another capability) it takes exactly what triton_wide takes
    monkeypatch.setattr(triton_transposed, "GPU_VERIFIED", True)
    monkeypatch.setattr(triton_wide, "GPU_VERIFIED", False)  # wide's own gate is not inherited
    other = replace(p, device=DeviceInfo("cuda", "NVIDIA B200", (10, 0), 148))
    wide = get_backend("triton_wide").not_supported_reasons
    transposed = get_backend("triton_transposed").not_supported_reasons
    for q in (other, replace(other, K=64), replace(other, dtype="float32")):
        assert transposed(q) == [r for r in wide(q) if "GPU_VERIFIED" not in r]


@pytest.mark.parametrize("bad", [dict(side_KS=32), dict(side_KS=64), dict(side_warps=4)])
def test_transposed_launcher_refuses_side_settings_measured_wrong_on_the_h200(bad):
    # the guard runs before any launch, so dummy tensors suffice
    q = torch.zeros(1, 64, 1, 128)
    v = torch.zeros(1, 64, 1, 128)
    with pytest.raises(ValueError, match="side_KS=.*side_warps=.*float64"):
        wy_dqkg_transposed(q, q, v, v, v, v, None, None, None, None, None, 1.0, **bad)
