"""The one-pass GVA sum of per-head dq/dk (backends/kernels/head_sum.py) against a float64 sum,
run through Triton's interpreter on the CPU (fp16/fp32: the interpreter's bf16 is not trusted)."""

import pytest
import torch

from gdr_dispatch.backends.kernels.head_sum import head_sum_triton, sum_value_heads
from gdr_dispatch.contract import reduce_value_heads


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("B,T,H,Hg,D", [(1, 5, 4, 2, 16), (2, 37, 8, 2, 128), (1, 3, 6, 2, 48), (1, 17, 4, 1, 32)])
def test_triton_head_sum_matches_a_float64_sum(B, T, H, Hg, D, dtype):
    x = (torch.randn(B, T, H, D, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    want = x.double().view(B, T, Hg, H // Hg, D).sum(3).to(dtype)
    got = head_sum_triton(x, Hg, dtype)
    assert got.shape == (B, T, Hg, D) and got.dtype == dtype
    if dtype == torch.float16:  # fp32 accumulation, one rounding to fp16: the float64 sum's cast
        assert (got != want).float().mean() < 1e-3  # but where fp32 sits on an fp16 rounding boundary
    torch.testing.assert_close(got, want, rtol=2e-3 if dtype == torch.float16 else 1e-6, atol=1e-6)


def test_head_sum_of_shared_heads_sums_the_right_heads():
    # value head h uses q/k head h // (H // Hg): heads 0,1 -> 0 and 2,3 -> 1
    x = torch.zeros(1, 1, 4, 16)
    x[0, 0, 1] = 1.0
    x[0, 0, 2] = 2.0
    got = head_sum_triton(x, 2, torch.float32)
    assert got[0, 0, 0].eq(1.0).all() and got[0, 0, 1].eq(2.0).all()


def test_sum_value_heads_on_cpu_is_the_contract_sum_and_passes_ungrouped_heads_through():
    x = torch.randn(2, 9, 4, 16).to(torch.float16)
    got = sum_value_heads(x, 2, torch.float16)
    assert torch.equal(got, reduce_value_heads(x, 2, torch.float16, accum=torch.float32))  # the CPU's route
    want = x.double().view(2, 9, 2, 2, 16).sum(3)  # and an independent sum: heads 0,1 -> 0 and 2,3 -> 1
    assert got.dtype == torch.float16 and torch.allclose(got.double(), want, rtol=1e-3, atol=1e-3)
    assert sum_value_heads(x, 4, torch.float16) is x
    assert sum_value_heads(x, 4, torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="multiple of Hg"):
        head_sum_triton(torch.zeros(1, 1, 6, 16), 4, torch.float32)
