"""Every bad call raises before any work, naming the argument, what was expected and what came."""

import pytest
import torch

from gdr_dispatch import fused_gdr_bwd
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs


@pytest.fixture
def good():
    return call_kwargs(make_inputs(ShapeSpec(B=2, T=70, H=4, Hg=2, K=8, V=8, dtype="float32", h="given"), "cpu"))


@pytest.fixture
def good_varlen():
    return call_kwargs(make_inputs(ShapeSpec(seqlens=(5, 70), H=2, K=8, V=8, dtype="float32", h="given"), "cpu"))


def expect(exc, kwargs, *words):
    with pytest.raises(exc) as info:
        fused_gdr_bwd(**kwargs)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_good_calls_pass(good, good_varlen):
    fused_gdr_bwd(**good)
    fused_gdr_bwd(**good_varlen)


def test_not_a_tensor(good):
    expect(TypeError, {**good, "v": [1, 2]}, "v:", "torch.Tensor", "list")


@pytest.mark.parametrize("name,shape,words", [
    ("q", (2, 70, 2), ["q:", "4 dims", "[2, 70, 2]"]),
    ("k", (2, 70, 2, 4), ["k:", "[2, 70, 2, 8]", "got [2, 70, 2, 4]"]),
    ("v", (2, 71, 4, 8), ["v:", "[2, 70, 4, 8]", "got [2, 71, 4, 8]"]),
    ("do", (2, 70, 4, 4), ["do:", "[2, 70, 4, 8]"]),
    ("a", (2, 70, 4, 32), ["a:", "[2, 70, 4, 64]", "chunk_size"]),
    ("g", (2, 70, 2), ["g:", "[2, 70, 4]"]),
    ("b", (2, 70, 4, 1), ["b:", "[2, 70, 4]"]),
    ("h", (2, 1, 4, 8, 8), ["h:", "[2, 2, 4, 8, 8]", "2 chunks"]),
    ("initial_state", (2, 4, 8, 4), ["initial_state:", "[2, 4, 8, 8]", "state_v_first=False"]),
    ("dht", (1, 4, 8, 8), ["dht:", "[2, 4, 8, 8]"]),
])
def test_wrong_shapes(good, name, shape, words):
    bad = torch.zeros(shape, dtype=good[name].dtype)
    expect(ValueError, {**good, name: bad}, *words)


def test_heads_must_group(good):
    v = torch.zeros(2, 70, 3, 8)
    expect(ValueError, {**good, "v": v, "do": v, "a": torch.zeros(2, 70, 3, 64),
                        "g": torch.zeros(2, 70, 3), "b": torch.zeros(2, 70, 3), "h": None,
                        "initial_state": None, "dht": None}, "H=3", "Hg=2", "multiple")


@pytest.mark.parametrize("name,dtype,words", [
    ("q", torch.int32, ["q:", "dtype", "int32"]),
    ("k", torch.float64, ["k:", "dtype of q", "float64"]),
    ("do", torch.float16, ["do:", "dtype of q"]),
    ("g", torch.bfloat16, ["g:", "float32", "bfloat16"]),
    ("b", torch.int64, ["b:", "int64"]),
])
def test_wrong_dtypes(good, name, dtype, words):
    expect(TypeError, {**good, name: good[name].to(dtype)}, *words)


def test_state_v_first_layout(good):
    # states are [N, H, K, V]; with state_v_first they must be [N, H, V, K]: K=V here, so use K != V
    kw = call_kwargs(make_inputs(ShapeSpec(B=1, T=10, H=2, K=8, V=4, dtype="float32", h="given"), "cpu"))
    expect(ValueError, {**kw, "state_v_first": True}, "state_v_first=True", "[N, H, V, K]")


@pytest.mark.parametrize("cu,words", [
    ([0, 5], ["cu_seqlens:", "end at T=75", "got 5"]),
    ([1, 75], ["cu_seqlens:", "start at 0", "got 1"]),
    ([0, 40, 30, 75], ["cu_seqlens:", "non-decreasing", "40 then 30"]),
    ([75], ["cu_seqlens:", "[N + 1]"]),
])
def test_bad_cu_seqlens_values(good_varlen, cu, words):
    expect(ValueError, {**good_varlen, "cu_seqlens": torch.tensor(cu, dtype=torch.int32), "h": None,
                        "initial_state": None, "dht": None}, *words)


def test_cu_seqlens_dtype_and_batch(good_varlen, good):
    expect(TypeError, {**good_varlen, "cu_seqlens": good_varlen["cu_seqlens"].float()}, "cu_seqlens:", "int32")
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    expect(ValueError, {**good, "cu_seqlens": cu}, "cu_seqlens:", "B == 1", "B=2")


def test_devices_must_agree(good):
    expect(ValueError, {**good, "b": good["b"].to("meta")}, "b:", "device cpu", "meta")


@pytest.mark.parametrize("name,value,exc,words", [
    ("scale", "0.1", TypeError, ["scale:", "str"]),
    ("scale", float("nan"), ValueError, ["scale:", "finite"]),
    ("chunk_size", 64.0, TypeError, ["chunk_size:", "int"]),
    ("chunk_size", 0, ValueError, ["chunk_size:", "positive"]),
    ("state_v_first", 1, TypeError, ["state_v_first:", "bool"]),
])
def test_bad_options(good, name, value, exc, words):
    expect(exc, {**good, name: value}, *words)


def test_inputs_are_never_written(good_varlen):
    before = {k: v.clone() for k, v in good_varlen.items() if isinstance(v, torch.Tensor)}
    grads = fused_gdr_bwd(**good_varlen)
    for k, v in before.items():
        assert torch.equal(v, good_varlen[k]), f"{k} was written"
    outs = [g for g in grads if g is not None]
    for g in outs:
        for v in good_varlen.values():
            if isinstance(v, torch.Tensor):
                assert g.data_ptr() != v.data_ptr(), "an output aliases an input"


@pytest.mark.parametrize("h_given", [True, False])
def test_empty_batch_is_a_clear_error(good, h_given):
    """B = 0 raised ZeroDivisionError (h given) or `max() arg is an empty sequence` (h=None)."""
    empty = {k: (v[:0] if isinstance(v, torch.Tensor) and k not in ("initial_state", "dht") else v)
             for k, v in good.items()}
    empty.update(initial_state=None, dht=None, h=good["h"][:0] if h_given else None)
    expect(ValueError, empty, "q:", "B >= 1", "B=0")


def test_max_seqlen_must_bound_the_longest_sequence(good_varlen):
    fused_gdr_bwd(**{**good_varlen, "max_seqlen": 70})
    fused_gdr_bwd(**{**good_varlen, "max_seqlen": 75})  # a bound, as flash-attn callers pass it
    expect(ValueError, {**good_varlen, "max_seqlen": 64}, "max_seqlen:", "70 tokens", "got 64")
    expect(ValueError, {**good_varlen, "max_seqlen": 76}, "max_seqlen:", "T=75")
    expect(TypeError, {**good_varlen, "max_seqlen": 70.0}, "max_seqlen:", "int")


def test_value_head_reduction_accumulates_16_bit_heads_in_fp32():
    """Kernels hand over 16-bit dq/dk per value head: the sum over each q/k head's value heads
    (head i belongs to q/k head i // (H // Hg)) is the fp32 sum, rounded once."""
    from gdr_dispatch.contract import reduce_value_heads

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 64, 8, 16, generator=gen) * torch.logspace(0, 3, 16)).to(torch.bfloat16)
    want = torch.stack([x[:, :, [i for i in range(8) if i // 4 == j]].float().sum(2) for j in range(2)], 2)
    got = reduce_value_heads(x, 2, torch.bfloat16, accum=torch.float32)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    assert reduce_value_heads(x, 8, torch.float32, accum=torch.float32).dtype == torch.float32  # nothing to sum


def test_packed_keeps_canonical_tensors_and_copies_every_other_layout():
    """`contract.packed`: row-major strides pass as they are (size-1 and empty dims included, whose
    strides torch's is_contiguous ignores and TMA descriptors do not); any other layout is copied,
    its values unchanged. The verdict for a size-1 dim is memoised per shape and strides."""
    from gdr_dispatch.contract import packed

    x = torch.randn(1, 6, 2, 4)
    assert packed(x) is x and packed(x) is x
    odd = torch.randn(6, 2, 4).as_strided((1, 6, 2, 4), (1, 8, 4, 1))  # contiguous to torch, not canonical
    assert odd.is_contiguous() and packed(odd) is not odd and torch.equal(packed(odd), odd)
    assert packed(odd).stride() == (48, 8, 4, 1)
    view = torch.randn(1, 6, 6, 4)[:, :, :2]  # a split of a fused projection
    assert packed(view) is not view and torch.equal(packed(view), view)
    t = torch.randn(4, 2, 6).transpose(0, 2)
    assert packed(t) is not t and torch.equal(packed(t), t)
    empty = torch.empty(0, 3)
    assert packed(empty).shape == (0, 3) and packed(None) is None


def test_packing_test_agrees_with_packed_on_every_layout_of_the_plans_shapes():
    """`contract.packing_test`, decided from one set of shapes, says True for later tensors of
    those shapes exactly when `packed` would hand each back as it is: with and without size-1 and
    empty dims, on transposes, splits, expands and odd strides of a size-1 dim."""
    from gdr_dispatch.contract import packed, packing_test

    def layouts(shape):
        n = 1
        for s in shape:
            n *= s
        yield torch.randn(shape)
        yield torch.randn(*shape[:-1], 2 * shape[-1])[..., :shape[-1]]  # a split of a fused projection
        yield torch.randn(tuple(reversed(shape))).permute(*reversed(range(len(shape))))  # a transpose
        yield torch.randn(shape[-1]).expand(shape)
        if 1 in shape:  # contiguous to torch, not canonical: the size-1 dim's stride is odd
            i = list(shape).index(1)
            yield torch.randn(shape).as_strided(shape, tuple(7 if d == i else st
                                                             for d, st in enumerate(torch.empty(shape).stride())))

    for shapes in ([(2, 6, 3, 4), (2, 6, 3)], [(1, 6, 3, 4), (1, 6, 3)], [(2, 6, 1, 4), (2, 6, 1)], [(0, 6, 3, 4), (0, 6, 3)]):
        test = packing_test(*(torch.empty(s) for s in shapes))
        for first in layouts(shapes[0]):
            for second in layouts(shapes[1]):
                want = packed(first) is first and packed(second) is second
                assert test(first, second) == want, (shapes, first.stride(), second.stride())
            assert test(first, torch.randn(shapes[1])) == (packed(first) is first)


def test_cu_seqlens_on_the_cpu_becomes_a_kept_copy_on_the_device_of_q():
    """contract.offsets_to_device: a CPU `cu_seqlens` for a call on another device (here `meta`, whose
    tensors hold no values) becomes one copy there per content, whose values are known and never
    read back; everything else comes back as it is, for the checks to name."""
    from gdr_dispatch.contract import offsets_to_device
    from gdr_dispatch.graph_safe import offsets_of

    q = torch.empty(1, 10, 2, 16, device="meta")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    on = offsets_to_device(cu, q)
    assert on.device.type == "meta" and on.dtype == torch.int32 and tuple(on.shape) == (3,)
    assert offsets_to_device(cu.clone(), q) is on  # once per content
    assert offsets_to_device(cu.long(), q) is not on  # and dtype
    assert offsets_of(on) == (0, 4, 10)  # known: a meta tensor could not be read
    assert offsets_to_device([0, 4, 10], q) == [0, 4, 10]  # not a tensor: the checks name it
    assert offsets_to_device(cu, torch.empty(1)) is cu  # a CPU call keeps its own
    with pytest.raises(TypeError, match="cu_seqlens:.*int32"):  # its own fault named, not the device
        offsets_to_device(cu.float(), q)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected a 1-D tensor"):
        offsets_to_device(cu.view(1, 3), q)
