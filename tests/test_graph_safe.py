"""Host-side bookkeeping that a CUDA graph capture of a varlen step needs (gdr_dispatch/graph_safe.py):
the lengths of a `cu_seqlens` tensor read on every eager call and from memory only under capture,
index tensors built once per content,
and a clear error, never a host read, when a capture meets something not seen eagerly. The
capture itself runs in test_gpu.py; here it is simulated."""

import numpy as np
import pytest
import torch

from fixtures import int_reads
from gdr_dispatch import fused_gdr_bwd, graph_safe
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs


@pytest.fixture
def capture(monkeypatch):
    """`on()` makes every device look as if its stream were being captured."""
    state = {"on": False}
    monkeypatch.setattr(graph_safe, "capturing", lambda device: state["on"])
    return state


def test_offsets_are_read_on_every_eager_call_and_from_memory_only_under_capture(capture):
    cu = torch.tensor([0, 5, 70], dtype=torch.int32)
    assert graph_safe.offsets_of(cu) == (0, 5, 70)
    capture["on"] = True
    cu[1] = 7  # a read under capture would see this; memory holds the eager read's values
    assert graph_safe.offsets_of(cu) == (0, 5, 70)  # from memory: no read under capture
    capture["on"] = False
    assert graph_safe.offsets_of(cu) == (0, 7, 70)
    cu[1] = 9
    assert graph_safe.offsets_of(cu) == (0, 9, 70)
    other = torch.tensor([0, 1, 70], dtype=torch.int32)  # another tensor is never confused with it
    assert graph_safe.offsets_of(other) == (0, 1, 70)


def test_a_buffer_refilled_behind_autograd_s_back_is_read_as_it_is_now():
    """numpy, `.data` and DLPack writes keep a tensor's version counter: a memory keyed on it
    would hand the backward the old lengths (every gradient wrong)."""
    buf = np.array([0, 5, 70], dtype=np.int32)
    cu = torch.from_numpy(buf)
    assert graph_safe.offsets_of(cu) == (0, 5, 70)
    version = cu._version
    buf[1] = 30  # through numpy
    assert cu._version == version and graph_safe.offsets_of(cu) == (0, 30, 70)
    cu.data[1] = 40  # through .data
    assert graph_safe.offsets_of(cu) == (0, 40, 70)
    np.from_dlpack(cu)[1] = 50  # through DLPack
    assert graph_safe.offsets_of(cu) == (0, 50, 70)


def test_an_unseen_cu_seqlens_under_capture_is_an_error_that_says_what_to_run(capture):
    capture["on"] = True
    with pytest.raises(RuntimeError, match="cu_seqlens: .*eager step"):
        graph_safe.offsets_of(torch.tensor([0, 64], dtype=torch.int32))


def test_index_tensors_are_built_once_and_those_a_capture_used_are_kept(capture, monkeypatch):
    monkeypatch.setattr(graph_safe, "MAX_CONSTANTS", 2)
    graph_safe._constants.clear()
    graph_safe._pinned.clear()
    a = graph_safe.device_constant((0, 1, 0, 2), torch.int32, "cpu", shape=(-1, 2))
    assert graph_safe.device_constant((0, 1, 0, 2), torch.int32, "cpu", shape=(-1, 2)) is a
    assert a.tolist() == [[0, 1], [0, 2]]
    capture["on"] = True
    graph_safe.device_constant((0, 1, 0, 2), torch.int32, "cpu", shape=(-1, 2))  # used by a capture: pinned
    with pytest.raises(RuntimeError, match="eager step"):
        graph_safe.device_constant((7,), torch.int32, "cpu")
    capture["on"] = False
    for n in range(5):  # evictions pass over the pinned one
        graph_safe.device_constant((n,), torch.int32, "cpu")
    assert graph_safe.device_constant((0, 1, 0, 2), torch.int32, "cpu", shape=(-1, 2)) is a
    assert len(graph_safe._constants) <= 3


def test_an_index_tensor_our_graph_reads_is_kept_only_while_the_graph_is(capture, monkeypatch):
    """The split's own graphs pin the index tensors they read for their lifetime only: while a
    graph holds one it survives evictions; once the last graph reading it is dropped (evicted
    from the split's graphs) it may go like any other."""
    from gdr_dispatch import clear_caches
    from gdr_dispatch.backends.split import graphs

    clear_caches()
    monkeypatch.setattr(graph_safe, "MAX_CONSTANTS", 2)
    a = graph_safe.device_constant((3, 4), torch.int32, "cpu")
    capture["on"] = True
    with graph_safe.graph_owned_pins() as pins:  # a capture of ours reads it
        graph_safe.device_constant((3, 4), torch.int32, "cpu")
    capture["on"] = False
    assert len(pins) == 1 and not pins & graph_safe._pinned  # pinned for the graph, not for good
    key = ("pinning graph",)
    graphs._pins[key], graphs._graphs[key] = pins, ("graph", None, (), None)
    for n in range(5):  # evictions pass over it while the graph lives
        graph_safe.device_constant((n,), torch.int32, "cpu")
    assert graph_safe.device_constant((3, 4), torch.int32, "cpu") is a
    for n in range(graphs.LIMIT):  # more graphs than kept: ours is evicted, its pins released
        graphs._graphs[("other", n)] = ("graph", None, (), None)
    assert key not in graphs._graphs and not graph_safe._owned
    for n in range(5, 10):
        graph_safe.device_constant((n,), torch.int32, "cpu")
    assert graph_safe.device_constant((3, 4), torch.int32, "cpu") is not a  # evicted, built again


def test_a_varlen_call_repeats_under_capture_without_reading_the_device(capture):
    """The contract's validation takes the lengths from memory on the second call, and a fresh
    cu_seqlens under capture names itself."""
    x = make_inputs(ShapeSpec(seqlens=(1, 63, 64, 65), H=2, K=16, V=16, dtype="float64", h="given"), "cpu")
    kwargs = call_kwargs(x)
    eager = fused_gdr_bwd(**kwargs)
    capture["on"] = True
    again = fused_gdr_bwd(**kwargs)
    assert torch.equal(again.dq, eager.dq)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        fused_gdr_bwd(**{**kwargs, "cu_seqlens": kwargs["cu_seqlens"].clone()})


def test_inference_tensors_are_read_every_time():
    with torch.inference_mode():
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        assert graph_safe.offsets_of(cu) == (0, 3, 8)
        cu[1] = 4
        assert graph_safe.offsets_of(cu) == (0, 4, 8)


def test_the_index_tensors_it_builds_are_never_read_back(monkeypatch):
    """A 1-D index tensor of `device_constant` (the split's segments' cu_seqlens, say) has known
    values: `offsets_of` answers from them, eager or captured, without a device read."""
    cu = graph_safe.device_constant((0, 3, 9), torch.int32, "cpu")
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read a device constant back"))
    assert graph_safe.offsets_of(cu) == (0, 3, 9)


def test_the_op_s_backward_reads_no_lengths_from_the_device():
    """The op reads the caller's `cu_seqlens` in its forward; its backward runs on a private copy
    whose values it knows (`remember_private`), so its checks make no device read (on a GPU, a
    wait per layer): counted as the int tensors' `tolist` calls during the backward alone. A new
    copy each step: the previous step's is not confused with it."""
    from gdr_dispatch import chunk_gated_delta_rule

    cu = torch.tensor([0, 30, 64, 95], dtype=torch.int32)
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        q, k, v = (torch.randn(1, 95, 2, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
        g = (-torch.rand(1, 95, 2, generator=gen, dtype=torch.float64)).requires_grad_()
        beta = torch.rand(1, 95, 2, generator=gen, dtype=torch.float64).requires_grad_()
        o, _ = chunk_gated_delta_rule(q, torch.nn.functional.normalize(k, dim=-1), v, g, beta, cu_seqlens=cu)
        with int_reads() as reads:
            o.sum().backward()
        assert reads == [], reads
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v, g, beta))
