"""The exact torch backend and the residuals against the float64 token-by-token oracle."""

import pytest
import torch

from conftest import case, rel_errors
from gdr_dispatch import fused_gdr_bwd, oracle_grads, prepare_residuals, recurrent_forward
from gdr_dispatch.shapes import ShapeSpec, make_inputs

# Shapes that bite: T not a multiple of 64, T < 64, varlen lengths 1/63/64/65 (and an empty
# sequence), grouped value heads, optional inputs absent and present, state_v_first.
SHAPES = {
    "T100_grouped_all_optional": ShapeSpec(B=2, T=100, H=4, Hg=2, K=16, V=8),
    "T40_no_states": ShapeSpec(B=1, T=40, H=2, K=16, V=16, initial_state=False, dht=False),
    "T128_h0_only": ShapeSpec(B=2, T=128, H=2, K=8, V=16, dht=False),
    "T65_dht_only": ShapeSpec(B=1, T=65, H=3, K=8, V=8, initial_state=False),
    "varlen_1_63_64_65_vfirst": ShapeSpec(seqlens=(1, 63, 64, 65), H=4, Hg=2, K=16, V=8, state_v_first=True),
    "varlen_empty_seq": ShapeSpec(seqlens=(65, 0, 1), H=2, Hg=1, K=8, V=8),
}

# fp64 inputs: the chunked math must equal the recurrence to rounding; fp32: to ~1e-5.
TOL = {"float64": 1e-10, "float32": 1e-5}


@pytest.mark.parametrize("h_mode", ["given", "none"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_torch_backend_matches_oracle(name, dtype, h_mode, monkeypatch):
    monkeypatch.setenv("GDR_BACKEND", "torch")
    spec = ShapeSpec(**{**SHAPES[name].__dict__, "dtype": dtype, "h": h_mode, "extra": {}})
    kwargs, ref = case(spec)
    grads = fused_gdr_bwd(**kwargs)
    errs = rel_errors(grads, ref)
    assert set(errs) == ({"dq", "dk", "dv", "dg", "db"} | ({"dh0"} if spec.initial_state else set()))
    bad = {n: e for n, e in errs.items() if not e <= TOL[dtype]}
    assert not bad, f"{name} {dtype} h={h_mode}: {bad}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["T100_grouped_all_optional", "varlen_1_63_64_65_vfirst"])
def test_torch_backend_half_inputs(name, dtype, monkeypatch):
    """16-bit inputs, h given narrowed to 16 bits as a forward stores it: errors at the
    16-bit rounding of h and of the outputs, far under the GPU tolerance of 1e-2."""
    monkeypatch.setenv("GDR_BACKEND", "torch")
    spec = ShapeSpec(**{**SHAPES[name].__dict__, "dtype": dtype, "h": "given", "extra": {}})
    kwargs, ref = case(spec)
    grads = fused_gdr_bwd(**kwargs)
    assert grads.dq.dtype == grads.dk.dtype == grads.dv.dtype == grads.db.dtype == getattr(torch, dtype)
    assert grads.dg.dtype == torch.float32 and grads.dh0.dtype == torch.float32
    errs = rel_errors(grads, ref)
    bad = {n: e for n, e in errs.items() if not e <= 1e-2}
    assert not bad, bad


def test_oracle_catches_a_wrong_gradient(monkeypatch):
    """The comparison can fail: a perturbed dk is seen."""
    monkeypatch.setenv("GDR_BACKEND", "torch")
    kwargs, ref = case(ShapeSpec(B=1, T=70, H=2, K=8, V=8, dtype="float64", h="none"))
    grads = fused_gdr_bwd(**kwargs)
    wrong = grads._replace(dk=grads.dk * (1 + 1e-6))
    assert rel_errors(wrong, ref)["dk"] > 1e-7


@pytest.mark.parametrize("name", list(SHAPES))
def test_prepare_residuals_matches_recurrence(name):
    spec = ShapeSpec(**{**SHAPES[name].__dict__, "dtype": "float64", "h": "given", "extra": {}})
    x = make_inputs(spec, "cpu", seed=3)
    res = prepare_residuals(x["q"], x["k"], x["v"], x["g_raw"], x["b"], initial_state=x["initial_state"],
                            cu_seqlens=x["cu_seqlens"], state_v_first=spec.state_v_first)
    o, ht = recurrent_forward(x["q"], x["k"], x["v"], x["g_raw"], x["b"], initial_state=x["initial_state"],
                              cu_seqlens=x["cu_seqlens"], state_v_first=spec.state_v_first)
    assert (res.o - o).abs().max() < 1e-10
    assert (res.ht - ht).abs().max() < 1e-10
    # g restarts at every chunk and sequence start
    starts = [0] if x["cu_seqlens"] is None else x["cu_seqlens"].tolist()[:-1]
    for s in starts:
        if s < spec.T:
            assert torch.allclose(res.g[0, s], x["g_raw"][0, s].double())
    # a is the ungated inverse: unit diagonal, nothing above it
    BT = spec.chunk_size
    first = res.a[0, :min(BT, spec.seq_lens[0])]
    n = first.shape[0]
    assert torch.allclose(first[torch.arange(n), :, torch.arange(n)], torch.ones(n, spec.H, dtype=torch.float64))
    assert torch.all(first[:, :, n:] == 0)
    above = torch.ones(n, n, dtype=torch.bool).triu(1)  # row i, column j > i, within the chunk
    assert torch.all(first[:, :, :n].permute(1, 0, 2)[:, above] == 0)
    if n > 1:  # (the inverse is not the identity)
        assert torch.any(first[:, :, :n].permute(1, 0, 2)[:, above.T] != 0)


def test_h_given_is_the_recomputed_state(monkeypatch):
    """The h from prepare_residuals and the torch backend's own recompute agree exactly."""
    monkeypatch.setenv("GDR_BACKEND", "torch")
    spec = ShapeSpec(seqlens=(63, 65), H=2, K=8, V=8, dtype="float64", h="given")
    kwargs, _ = case(spec)
    with_h = fused_gdr_bwd(**kwargs)
    without = fused_gdr_bwd(**{**kwargs, "h": None})
    for x, y in zip(with_h, without):
        assert torch.allclose(x, y, rtol=1e-12, atol=1e-12)


def test_strong_decay_matches_the_oracle():
    """g_raw around -5 per token: exp(G) underflows in fp32 inside a chunk; decays are only
    formed as differences, so the chunked math stays finite and matches float64."""
    from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs

    x = make_inputs(ShapeSpec(B=2, T=100, H=4, Hg=2, K=16, V=16, strong_decay=True, h="none", dtype="float32"),
                    "cpu", seed=3)
    assert -5.5 <= x["g_raw"].min() and x["g_raw"].max() <= -4.5
    assert x["g"].min() < -104  # below fp32's smallest subnormal exponent: exp(G) is 0 there
    grads = fused_gdr_bwd(**call_kwargs(x))
    ref = oracle_grads(x["q"], x["k"], x["v"], x["g_raw"], x["b"], x["do"], x["dht"], scale=x["scale"],
                       initial_state=x["initial_state"])
    for name in grads._fields:
        got, want = getattr(grads, name).double(), getattr(ref, name)
        assert torch.isfinite(got).all(), name
        assert ((got - want).norm() / want.norm()).item() < 1e-3, name
