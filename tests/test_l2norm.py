"""The HF hook's one-pass q/k l2norm kernels (backends/kernels/l2norm.py) against the float64 torch
form and its autograd gradient, through Triton's interpreter on the CPU (fp16/fp32: the
interpreter's bf16 is not trusted), on strided views as HF passes q and k."""

import pytest
import torch

from gdr_dispatch.backends.kernels.l2norm import l2norm, l2norm_bwd, l2norm_fwd

EPS = 1e-6


def reference(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + EPS)


def views(B, T, H, D, dtype, gen, layout="projection"):
    """q as a strided view, and its base: of a fused projection `[B, T, 3 H D]`, or (`conv`) of a
    convolution's output `[B, 3 H D, T]` transposed to `[B, T, 3 H D]` (HF Qwen3-Next's layout:
    consecutive tokens adjacent, a head's features T apart), or (`features`) of a `[B, D, T, H]`
    tensor permuted (no axis with the unit stride but the heads'), or (`expanded`) one token's
    `[B, 1, H, D]` expanded over T (a zero token stride)."""
    if layout == "expanded":
        base = (torch.randn(B, 1, H, D, generator=gen) * 3).to(dtype)
        return base, base.expand(B, T, H, D)
    if layout == "features":
        base = (torch.randn(B, D, T, H, generator=gen) * 3).to(dtype)
        q = base.permute(0, 2, 3, 1)
        assert q.stride(3) == T * H and q.stride(2) == 1
        return base, q
    if layout == "conv":
        base = (torch.randn(B, 3 * H * D, T, generator=gen) * 3).to(dtype)
        q = base.transpose(1, 2)[..., H * D:2 * H * D].unflatten(-1, (H, D))
        assert T == 1 or (q.stride(1) == 1 and q.stride(3) == T)
        return base, q
    base = (torch.randn(B, T, 3 * H * D, generator=gen) * 3).to(dtype)
    return base, base[..., H * D:2 * H * D].view(B, T, H, D)


@pytest.mark.parametrize("layout", ["projection", "conv", "features", "expanded"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("B,T,H,D", [(1, 5, 2, 16), (2, 37, 3, 128), (1, 3, 4, 48), (2, 1, 1, 128), (1, 130, 2, 32),
                                     (1, 70, 2, 3)])
def test_l2norm_kernels_match_the_float64_form_and_its_gradient_on_a_strided_view(B, T, H, D, dtype, layout):
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + D)
    base, q = views(B, T, H, D, dtype, gen, layout)
    assert not q.is_contiguous() or T == 1  # (features or expanded: a [B, 1, H, D] view may be packed)
    dy = torch.randn(B, T, H, D, generator=gen).to(dtype)
    x64 = q.double().requires_grad_(True)
    want = reference(x64)
    want.backward(dy.double())
    y = l2norm_fwd(q, EPS)
    dx = l2norm_bwd(q, dy, EPS)
    assert y.dtype == dx.dtype == dtype and y.shape == dx.shape == q.shape and y.is_contiguous()
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.double(), want.detach(), **tol)
    torch.testing.assert_close(dx.double(), x64.grad, **tol)


@pytest.mark.parametrize("layout", ["projection", "conv"])
def test_rows_in_64_bits_give_the_32_bit_rows_values(layout, monkeypatch):
    """The kernels' int64 rows (`wide`: what B T H past 2^31 takes) decode each row as the int32
    form does: the same values, bit for bit, on both row orders and a T not a multiple of a tile."""
    from gdr_dispatch.backends.kernels import l2norm as kernels

    class Seen:  # the WIDE each launch of a kernel was given
        def __init__(self, kernel):
            self.kernel, self.wide = kernel, []

        def __getitem__(self, grid):
            return lambda *a, **kw: self.wide.append(kw["WIDE"]) or self.kernel[grid](*a, **kw)

    fwd, bwd = Seen(kernels._l2norm_fwd), Seen(kernels._l2norm_bwd)
    monkeypatch.setattr(kernels, "_l2norm_fwd", fwd)
    monkeypatch.setattr(kernels, "_l2norm_bwd", bwd)
    gen = torch.Generator().manual_seed(5)
    _, q = views(2, 70, 3, 32, torch.float32, gen, layout)
    dy = torch.randn(2, 70, 3, 32, generator=gen)
    assert torch.equal(l2norm_fwd(q, EPS, wide=True), l2norm_fwd(q, EPS, wide=False))
    assert torch.equal(l2norm_bwd(q, dy, EPS, wide=True), l2norm_bwd(q, dy, EPS, wide=False))
    assert fwd.wide == [True, False] and bwd.wide == [True, False]  # both forms ran


def test_l2norm_autograd_function_sums_into_the_projection_and_writes_no_input():
    gen = torch.Generator().manual_seed(3)
    base, _ = views(2, 9, 2, 32, torch.float32, gen)
    base.requires_grad_(True)
    before = base.detach().clone()
    q = base[..., 64:128].view(2, 9, 2, 32)
    dy = torch.randn(2, 9, 2, 32, generator=gen)
    l2norm(q, EPS).backward(dy)
    ref = base.detach().double().requires_grad_(True)
    reference(ref[..., 64:128].view(2, 9, 2, 32)).backward(dy.double())
    torch.testing.assert_close(base.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(base.detach(), before)
    assert base.grad[..., :64].eq(0).all() and base.grad[..., 128:].eq(0).all()


def test_l2norm_of_a_zero_row_is_zero_and_other_shapes_are_refused():
    x = torch.zeros(1, 2, 1, 16)
    x[0, 1, 0, 3] = 2.0
    y = l2norm_fwd(x, EPS)
    assert y[0, 0].eq(0).all() and torch.isfinite(y).all()
    torch.testing.assert_close(y[0, 1, 0, 3], torch.tensor(2.0 / (4.0 + EPS) ** 0.5))
    with pytest.raises(ValueError, match=r"\[B, T, H, D\]"):
        l2norm_fwd(torch.zeros(3, 16), EPS)


def test_l2norm_refuses_a_second_derivative_and_takes_an_empty_feature_axis():
    x = torch.randn(1, 3, 2, 16, requires_grad=True)
    (gx,) = torch.autograd.grad(l2norm(x, EPS).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()  # an error, not a silently dropped second-order term
    assert l2norm_fwd(torch.zeros(1, 2, 3, 0), EPS).shape == (1, 2, 3, 0)
    assert l2norm_bwd(torch.zeros(1, 2, 3, 0), torch.zeros(1, 2, 3, 0), EPS).shape == (1, 2, 3, 0)


def test_l2norm_tiles_run_along_the_tokens_of_a_transposed_view_and_shrink_with_the_features():
    """HF's transposed q/k (token stride 1) take 64 rows along the tokens (the measured form: its
    loads are runs across tokens); a projection view 16 feature rows; wider features fewer rows
    (the tile's elements stay bounded)."""
    from gdr_dispatch.backends.kernels.l2norm import tile

    gen = torch.Generator().manual_seed(0)
    assert tile(views(1, 256, 2, 128, torch.float16, gen, "conv")[1]) == (64, True)
    assert tile(views(1, 256, 2, 128, torch.float16, gen)[1]) == (16, False)
    assert tile(views(1, 256, 2, 512, torch.float16, gen, "conv")[1]) == (16, True)
    assert tile(views(1, 256, 2, 4096, torch.float16, gen)[1]) == (1, False)
    assert tile(torch.zeros(1, 1, 4, 128).transpose(1, 2)) == (16, False)  # T = 1: no token run
