"""GPU tests: every registered backend that supports a call, against the float64 oracle.

Marked `gpu`; skipped where torch sees no CUDA device. Tolerance: relative Frobenius error
of each gradient <= 1e-2 for 16-bit inputs (fla and FlashQLA land at 3-4e-3,
docs/kernels.md). Backends not yet verified on a GPU run here (GDR_ALLOW_UNVERIFIED):
these tests are what verifies them.
"""

import pytest
import torch

from conftest import WALKS, case, edge_gate_inputs, rel_errors, set_walks
from fixtures import fused_stage_case
from gdr_dispatch import Problem, fused_gdr_bwd, registered_backends
from gdr_dispatch import dispatch as dsp
from gdr_dispatch.autotune import relative_error
from gdr_dispatch.backends.split import SplitBackend
from gdr_dispatch.contract import validate
from gdr_dispatch.shapes import ShapeSpec

pytestmark = pytest.mark.gpu

# K = V = 128 (the training head size) and two head layouts throughout: fla's autotuner keys
# on H, HV, K, V, so fewer distinct layouts cost fewer minutes of first-call tuning.
# Varlen and state_v_first first: a run cut short by the device's time limit has then
# covered the cases most likely to break.
SHAPES = {
    "varlen_1_63_64_65_vfirst": ShapeSpec(seqlens=(1, 63, 64, 65), H=4, Hg=2, K=128, V=128, state_v_first=True),
    "varlen_1_63_64_65": ShapeSpec(seqlens=(1, 63, 64, 65), H=4, K=128, V=128, dht=False),
    "T100_grouped_all_optional": ShapeSpec(B=2, T=100, H=4, Hg=2, K=128, V=128),
    "T40_no_states": ShapeSpec(B=1, T=40, H=4, Hg=2, K=128, V=128, initial_state=False, dht=False),
    "T128_h0_only": ShapeSpec(B=2, T=128, H=4, K=128, V=128, dht=False),
    "T65_dht_only": ShapeSpec(B=1, T=65, H=4, K=128, V=128, initial_state=False),
    # g_raw around -5 per token: a chunk's cumulative decay near -320, exp(G) underflows in fp32
    # (FlashQLA once had a dg cancellation bug here)
    "T100_grouped_strong_decay": ShapeSpec(B=2, T=100, H=4, Hg=2, K=128, V=128, strong_decay=True),
}

TOL = {"bfloat16": 1e-2, "float16": 1e-2}

_ORACLE: dict = {}


def _case(spec: ShapeSpec):
    """`case(spec)`, with the oracle computed once per shape and dtype: the inputs do not
    depend on the h mode, and four backends x two h modes share one float64 autograd."""
    kwargs, _ = case(spec, device="cuda", with_oracle=False)
    key = (spec.label().rsplit(" h=", 1)[0], spec.state_v_first, spec.initial_state, spec.dht)
    if key not in _ORACLE:
        _ORACLE[key] = case(spec, device="cuda")[1]
    return kwargs, _ORACLE[key]


def _cases():
    # one xdist group per shape and dtype: its backends share the worker's oracle and
    # compiled kernels when the run is spread with `pytest -n N --dist loadgroup`
    for name in SHAPES:
        for dtype in ("bfloat16", "float16"):
            for h in ("given", "none"):
                yield pytest.param(name, dtype, h, marks=pytest.mark.xdist_group(f"{name}-{dtype}"))


@pytest.mark.parametrize("backend", list(registered_backends()))
@pytest.mark.parametrize("name,dtype,h_mode", list(_cases()))
def test_backend_matches_oracle_on_gpu(backend, name, dtype, h_mode, monkeypatch):
    _check_backend(backend, name, dtype, h_mode, monkeypatch)


def _check_backend(backend, name, dtype, h_mode, monkeypatch):
    # a backend waiting for exactly this test to pass on a GPU is let through here
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    spec = ShapeSpec(**{**SHAPES[name].__dict__, "dtype": dtype, "h": h_mode, "extra": {}})
    problem = spec.problem(torch.device("cuda"))
    ok, reason = registered_backends()[backend].supported(problem)
    if not ok:
        pytest.skip(f"{backend} does not take {spec.label()}: {reason}")
    kwargs, ref = _case(spec)
    monkeypatch.setenv("GDR_BACKEND", backend)
    grads = fused_gdr_bwd(**kwargs)
    errs = rel_errors(grads, ref)
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= TOL[dtype]}
    assert not bad, f"{backend} {spec.label()}: {bad} (all: { {n: f'{e:.1e}' for n, e in errs.items()} })"


@pytest.mark.parametrize("backend", list(registered_backends()))
def test_backend_matches_oracle_at_an_odd_scale_on_gpu(backend, monkeypatch):
    """A scale whose log2 and inverse are inexact in fp32 (kernels that fold the scale into a
    factor, e.g. tilelang_ws_bwd's "scale" word, undo it elsewhere), under strong decay."""
    from gdr_dispatch import oracle_grads
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    spec = ShapeSpec(**{**SHAPES["T100_grouped_strong_decay"].__dict__, "dtype": "bfloat16", "h": "given", "extra": {}})
    ok, reason = registered_backends()[backend].supported(spec.problem(torch.device("cuda")))
    if not ok:
        pytest.skip(f"{backend} does not take {spec.label()}: {reason}")
    x = make_inputs(spec, "cuda", seed=3)
    x["scale"] = 0.3
    ref = oracle_grads(x["q"], x["k"], x["v"], x["g_raw"], x["b"], x["do"], x["dht"], scale=0.3,
                       initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"], state_v_first=spec.state_v_first)
    monkeypatch.setenv("GDR_BACKEND", backend)
    errs = rel_errors(fused_gdr_bwd(**call_kwargs(x)), ref)
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= TOL["bfloat16"]}
    assert not bad, f"{backend} scale 0.3: {bad} (all: { {n: f'{e:.1e}' for n, e in errs.items()} })"


# -- strided inputs, as real models pass them ------------------------------------------------------
def _strided(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as `x` (`[B, T, H, D]` or `[B, T, H]`) in the memory a model hands over:
    `split` a slice of a wider fused projection, `transpose` a `[B, H, T, D]` buffer seen as
    `[B, T, H, D]`, `tfast` T the unit-stride axis (HF's Gated DeltaNet passes v so)."""
    if how == "split":
        wide = torch.cat([x, torch.zeros_like(x)], dim=-1)
        return wide[..., : x.shape[-1]]
    if how == "transpose":
        if x.dim() == 4:
            return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        return x.permute(0, 2, 1).contiguous().permute(0, 2, 1)
    if how == "tfast":  # T the unit-stride axis
        return x.movedim(1, -1).contiguous().movedim(-1, 1)
    raise ValueError(how)


@pytest.mark.parametrize("how", ["split", "transpose", "tfast"])
@pytest.mark.parametrize("backend", list(registered_backends()))
@pytest.mark.parametrize("h_mode", ["given", "none"])
def test_backends_take_strided_views_on_gpu(backend, how, h_mode, monkeypatch):
    """Every backend on q, k, v, do, a, g, b as strided views (not one contiguous): the oracle's
    answer, and the caller's tensors untouched."""
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    spec = ShapeSpec(**{**SHAPES["T100_grouped_all_optional"].__dict__, "dtype": "bfloat16", "h": h_mode, "extra": {}})
    ok, reason = registered_backends()[backend].supported(spec.problem(torch.device("cuda")))
    if not ok:
        pytest.skip(f"{backend} does not take {spec.label()}: {reason}")
    kwargs, ref = _case(spec)
    views = {n: (_strided(kwargs[n], how) if n in ("q", "k", "v", "do", "a", "g", "b") else kwargs[n]) for n in kwargs}
    assert not views["v"].is_contiguous()
    before = {n: views[n].clone() for n in ("q", "k", "v", "do", "a", "g", "b")}
    monkeypatch.setenv("GDR_BACKEND", backend)
    errs = rel_errors(fused_gdr_bwd(**views), ref)
    assert all(e <= TOL["bfloat16"] for e in errs.values()), (backend, how, errs)
    assert all(torch.equal(views[n], before[n]) for n in before)


@pytest.mark.parametrize("forward", ["fla", "flash_qla"])
@pytest.mark.parametrize("backend", ["fla", "tilelang_fused", "flash_qla"])
def test_the_op_takes_hf_style_views_on_gpu(forward, backend, monkeypatch):
    """The training op on q, k, v as HF's Gated DeltaNet makes them (a split of one fused
    projection, then a transpose: v with T as its fastest axis), each forward provider and a
    backward backend: the oracle's output and gradients."""
    from gdr_dispatch import chunk_gated_delta_rule, oracle_grads
    from gdr_dispatch.reference import recurrent_forward

    for name in (forward, backend):
        if name not in registered_backends():
            pytest.skip(f"{name} is not installed")
    monkeypatch.setenv("GDR_FORWARD", forward)
    monkeypatch.setenv("GDR_BACKEND", backend)
    B, T, H, K = 2, 200, 4, 128
    gen = torch.Generator().manual_seed(3)
    proj = torch.randn(B, T, 3 * H * K, generator=gen).cuda().to(torch.bfloat16)
    qf, kf, vf = proj.split(H * K, dim=-1)  # HF: one projection split, then heads, then a transpose
    q = torch.nn.functional.normalize(qf.float().view(B, T, H, K), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(kf.float().view(B, T, H, K), dim=-1).to(torch.bfloat16)
    v = vf.reshape(B, T, H, K).movedim(1, -1).contiguous().movedim(-1, 1)  # T the unit-stride axis, as HF's v
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen)).cuda()
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).cuda().to(torch.bfloat16)
    h0 = torch.randn(B, H, K, K, generator=gen).cuda()
    assert not v.is_contiguous() and v.stride(1) == 1
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    do = torch.randn(o.shape, generator=gen).cuda()
    dht = torch.randn(ht.shape, generator=gen).cuda()
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    o_ref, ht_ref = recurrent_forward(*(t.double() for t in (q, k, v, g, beta)), initial_state=h0.double())
    ref = oracle_grads(q, k, v, g, beta, do, dht, initial_state=h0)
    errs = {"o": relative_error(o, o_ref), "ht": relative_error(ht, ht_ref)}
    errs.update({f"d{n}": relative_error(t.grad, r) for n, t, r in zip(("q", "k", "v", "g", "beta", "h0"), leaves, ref)})
    assert all(e <= 1e-2 for e in errs.values()), errs


# -- the exact context-parallel split (backends/split/) forced on the GPU ---------------------------
SPLIT_CASES = ("T100_grouped_all_optional", "varlen_1_63_64_65_vfirst", "T40_no_states", "T100_grouped_strong_decay")


@pytest.mark.parametrize("segments", [2, 4])
@pytest.mark.parametrize("backend", ["fla", "triton_wide", "tilelang_fused", "flash_qla"])
@pytest.mark.parametrize("name", SPLIT_CASES)
@pytest.mark.parametrize("h_mode", ["given", "none"])
def test_split_matches_oracle_on_gpu(name, backend, segments, h_mode, monkeypatch):
    """GDR_CP forces the split around a backend: the segments run as one varlen call with
    exact start states and end gradients, so the oracle tolerance is the backend's own."""
    if backend not in registered_backends():
        pytest.skip(f"{backend} not registered here")
    monkeypatch.setenv("GDR_CP", str(segments))
    _check_backend(backend, name, "bfloat16", h_mode, monkeypatch)


@pytest.mark.parametrize("h_mode", ["given", "none"])
@pytest.mark.parametrize("name", ["varlen_1_63_64_65_vfirst", "T100_grouped_strong_decay"])
def test_split_with_fla_pass_1_on_gpu(name, h_mode, monkeypatch):
    """The split with pass 1 on fla's kernels (our Triton maps refused), so that path keeps its
    GPU check now that the maps take the calls above."""
    from gdr_dispatch.backends.split import passes as cp

    monkeypatch.setattr(cp, "_maps_kernels_refusal", lambda seg_call: "refused by the test")
    monkeypatch.setenv("GDR_CP", "4")
    _check_backend("fla", name, "bfloat16", h_mode, monkeypatch)


@pytest.mark.parametrize("walks", WALKS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["varlen_1_63_64_65_vfirst", "T100_grouped_strong_decay", "T128_h0_only"])
def test_split_pass_1_kernels_on_gpu(name, dtype, walks, monkeypatch):
    """Pass 1's Triton kernels (backends/kernels/segment_maps.py) at K = V = 128 against the batched
    products in float64 on the same segments (3 per sequence): M against the identity's size,
    R and D relative, within 16-bit rounding of the products' operands; the walks forming each
    chunk, reading `_factors`' chunks, or reading them with TMA."""
    from dataclasses import replace

    from gdr_dispatch.backends.split import passes as cp
    from gdr_dispatch.backends.kernels import segment_maps as sm
    from gdr_dispatch.backends.kernels.segment_maps import segment_maps

    set_walks(monkeypatch, walks)

    spec = replace(SHAPES[name], dtype=dtype, h="none")
    kwargs, _ = case(spec, device="cuda", with_oracle=False)
    call = validate(**kwargs)
    s, n_seg, seg_lens, pick = cp.segment_plan(call, 3)
    flat = {n: getattr(call, n).reshape(1, -1, *getattr(call, n).shape[2:]) for n in ("q", "k", "v", "a", "g", "b", "do")}
    offsets = torch.tensor([0] + seg_lens, device="cuda").cumsum(0).to(torch.int32)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=call.chunk_size)
    assert sm.use_tma_walks(seg_call) == (walks == "tma")
    got = segment_maps(seg_call)
    call64 = validate(**{n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in kwargs.items()})
    want = cp._torch_pass_1(call64, s, n_seg)
    for g, w, what in zip(got, want, "MRD"):
        w = torch.stack([w[n, j] for n, j in pick])
        size = torch.eye(call.K, dtype=w.dtype, device=w.device).expand_as(w).norm() if what == "M" else w.norm()
        err = ((g.double() - w).norm() / size).item()
        assert err < 1e-2, (what, err)


@pytest.mark.parametrize("segments", [2, 4])
@pytest.mark.parametrize("backend", ["tilelang_fused"])
@pytest.mark.parametrize("name", SPLIT_CASES)
def test_split_candidate_with_own_states_on_gpu(name, backend, segments, monkeypatch):
    """The tuner's `<backend>@split<n>` candidate (SplitBackend) with `h=None` around a backend
    that recomputes the segments' states in its own kernel (`own_state_recompute`: our TileLang
    state kernel from the segments' start states), against the oracle; the split's own Triton
    walk of the states must not run."""
    from gdr_dispatch.backends.kernels import segment_maps

    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    monkeypatch.setattr(segment_maps, "segment_states", lambda *a, **k: pytest.fail("the split walked the states"))
    spec = ShapeSpec(**{**SHAPES[name].__dict__, "dtype": "bfloat16", "h": "none", "extra": {}})
    inner = registered_backends()[backend]
    split = SplitBackend(inner, segments)
    ok, reason = split.supported(spec.problem(torch.device("cuda")))
    if not ok:
        pytest.skip(f"{split.name} does not take {spec.label()}: {reason}")
    assert inner.own_state_recompute()
    kwargs, ref = _case(spec)
    errs = rel_errors(split.run(validate(**kwargs)), ref)
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= TOL["bfloat16"]}
    assert not bad, f"{split.name} {spec.label()}: {bad}"


@pytest.mark.parametrize("backend", ["tilelang_fused", "fla"])
@pytest.mark.parametrize("name", ["T100_grouped_all_optional", "varlen_1_63_64_65_vfirst"])
def test_split_captures_in_a_cuda_graph_on_gpu(name, backend, monkeypatch):
    """The split (GDR_CP=4 around `backend`, `h=None`) replays from a CUDA graph after an eager
    warm-up, with the eager call's gradients: eager it is bound by its host's enqueue at the
    starved shapes (docs/kernels.md, "The split"), captured it is not."""
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    monkeypatch.setenv("GDR_BACKEND", backend)
    monkeypatch.setenv("GDR_CP", "4")
    spec = ShapeSpec(**{**SHAPES[name].__dict__, "dtype": "bfloat16", "h": "none", "extra": {}})
    kwargs, _ = _case(spec)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up: compiles, and caches the segments' index tensors
            eager = fused_gdr_bwd(**kwargs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_gdr_bwd(**kwargs)
    graph.replay()
    torch.cuda.synchronize()
    for n in eager._fields:
        if getattr(eager, n) is not None:
            assert relative_error(getattr(captured, n), getattr(eager, n)) < 1e-3, n


def test_a_split_graph_called_from_two_streams_keeps_each_calls_result_on_gpu():
    """One key's graph replayed on two streams one after the other: the second waits for the
    first's copies out before it writes the graph's buffers (without that wait the first call's
    result is the second's: its copy out runs after its slow replay)."""
    from gdr_dispatch import clear_caches
    from gdr_dispatch.backends.split import graphs

    def slow_double(t):
        y = t[0] * 2
        torch.cuda._sleep(50_000_000)  # ~25 ms on the H200: the first call is still running
        return (y,)

    a = torch.full((256,), 1.0, device="cuda")
    b = torch.full((256,), 5.0, device="cuda")
    clear_caches()
    key = ("two streams",)
    for x in (a, b):  # eager, then the capture with copies (other addresses)
        graphs.run_tensors("test", key, (x,), slow_double, (1,))
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        ra = graphs.run_tensors("test", key, (a,), slow_double, (1,))[0]
    with torch.cuda.stream(s2):
        rb = graphs.run_tensors("test", key, (b,), slow_double, (1,))[0]
    torch.cuda.synchronize()
    assert graphs.held_graphs() > 0
    assert torch.equal(ra, a * 2) and torch.equal(rb, b * 2)


@pytest.mark.parametrize("backend", ["tilelang_fused", "fla", "flash_qla"])
@pytest.mark.parametrize("name", ["T100_grouped_all_optional", "varlen_1_63_64_65_vfirst"])
def test_split_candidates_replay_their_own_graphs_on_gpu(name, backend, monkeypatch):
    """`<backend>@split<n>` from its second call on replays a graph it captured itself
    (backends/split/graphs.py): the same gradients as eager; the same tensors again, read in
    place (new values written into them are what it reads; none written by it), other tensors of
    the same shapes copied in (not the captured call's values replayed); fresh outputs each call."""
    from gdr_dispatch.backends.split import graphs

    if backend not in registered_backends():
        pytest.skip(f"{backend} not registered here")
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    # one address set per key, the semantics asserted below (several: the layers' test further down)
    monkeypatch.setattr(graphs, "ADDRESS_SETS", 1)
    spec = ShapeSpec(**{**SHAPES[name].__dict__, "dtype": "bfloat16", "h": "none", "extra": {}})
    split = SplitBackend(registered_backends()[backend], 4)
    if not split.supported(spec.problem(torch.device("cuda")))[0]:
        pytest.skip(f"{split.name} does not take {spec.label()}")
    kwargs, ref = _case(spec)
    call = validate(**kwargs)
    before = {n: getattr(call, n).clone() for n in graphs.TENSORS if getattr(call, n) is not None}
    first, second, third = (split.run(call) for _ in range(3))
    for n, x in before.items():  # a graph reading the caller's tensors in place never writes them
        assert torch.equal(getattr(call, n), x), n
    if graphs.held_graphs() == 0:
        pytest.skip(f"{split.name}: its capture was refused (logged); it runs eagerly")
    for n in first._fields:
        if getattr(first, n) is not None:
            assert relative_error(getattr(third, n), getattr(first, n)) < 1e-3, n
    assert third.dq.data_ptr() != second.dq.data_ptr()
    hit = graphs._graphs.get(graphs.key_of(split.name, call))
    assert hit is not None and hit[1] is None and hit[3] == graphs.addresses(
        graphs._lengths_constant(getattr(call, n)) for n in graphs.TENSORS)
    # new values in the same tensors, read in place: with do and dht negated every gradient flips sign
    for t in (call.do, call.dht):
        if t is not None:
            t.neg_()
    in_place = split.run(call)
    assert relative_error(in_place.dq, -first.dq) < 1e-3 and relative_error(in_place.dv, -first.dv) < 1e-3
    for t in (call.do, call.dht):
        if t is not None:
            t.neg_()
    # other tensors of the same shapes, copied in
    other = {**kwargs, "do": -kwargs["do"], "dht": None if kwargs["dht"] is None else -kwargs["dht"]}
    flipped = split.run(validate(**other))
    assert relative_error(flipped.dq, -first.dq) < 1e-3 and relative_error(flipped.dv, -first.dv) < 1e-3
    assert graphs._graphs.get(graphs.key_of(split.name, call))[3] is None  # copies from now on
    # a graph read in place keeps the addresses, not the caller's tensors
    import dataclasses
    import gc
    import weakref

    from gdr_dispatch import clear_caches

    clear_caches()
    q2 = call.q.clone()
    c2 = dataclasses.replace(call, q=q2)
    for _ in range(2):
        split.run(c2)
    assert graphs._graphs.get(graphs.key_of(split.name, c2))[3] is not None
    alive = weakref.ref(q2)
    del q2, c2
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["varlen_1_63_64_65_vfirst", "T100_grouped_strong_decay"])
def test_split_states_kernel_on_gpu(name, dtype):
    """Pass 3's chunk states on our kernel (gdr_dispatch/segment_maps.segment_states; with
    `h=None` the split's backend takes them as `h`) against make_inputs' `h` (float64 walk),
    in the call's state layout."""
    from dataclasses import replace

    from gdr_dispatch import chunked_math as cm
    from gdr_dispatch.backends.kernels.segment_maps import segment_states

    spec = replace(SHAPES[name], dtype=dtype, h="given")
    kwargs, _ = case(spec, device="cuda", with_oracle=False)
    call = validate(**{**kwargs, "h": None})
    init = cm.states_in(call.initial_state, call.state_v_first).float()
    h = segment_states(call, init, call.state_v_first)
    want = kwargs["h"].double()
    assert h.shape == want.shape
    assert ((h.double() - want).norm() / want.norm()).item() < 1e-2


# the state kernel loads a chunk's g and b by TMA only where its sequence starts 16-byte aligned
# (an unaligned box start is an illegal instruction); sequences 2 and 3 here do not
STATE_SHAPES = {**SHAPES, "varlen_3_130_200_vfirst": ShapeSpec(seqlens=(3, 130, 200), H=4, Hg=2, K=128, V=128,
                                                               state_v_first=True)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["varlen_1_63_64_65_vfirst", "varlen_1_63_64_65", "T100_grouped_strong_decay",
                                  "T128_h0_only", "varlen_3_130_200_vfirst"])
def test_tilelang_states_kernel_on_gpu(name, dtype):
    """The TileLang state kernel (backends/kernels/tilelang_states.py): its `h` against
    make_inputs' (a float64 walk), its final state against the token-by-token forward in
    float64, in the call's state layout."""
    from dataclasses import replace

    from gdr_dispatch.backends.kernels.tilelang_states import call_states
    from gdr_dispatch.reference import recurrent_forward
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    spec = replace(STATE_SHAPES[name], dtype=dtype, h="given")
    inputs = make_inputs(spec, "cuda")
    call = validate(**{**call_kwargs(inputs), "h": None})
    h, ht = call_states(call)
    want = inputs["h"].double()
    assert h.shape == want.shape and h.dtype == call.k.dtype
    assert ((h.double() - want).norm() / want.norm()).item() < 1e-2
    h0 = None if call.initial_state is None else call.initial_state.double()
    _, ht_want = recurrent_forward(call.q.double(), call.k.double(), call.v.double(), inputs["g_raw"].double(),
                                   call.b.double(), initial_state=h0, cu_seqlens=call.cu_seqlens,
                                   state_v_first=call.state_v_first)
    assert ht.shape == ht_want.shape
    assert ((ht.double() - ht_want).norm() / ht_want.norm()).item() < 1e-2


@pytest.mark.parametrize("counts", [(1,), (7, 0, 3), (64, 64), (17, 33, 2)])
@pytest.mark.parametrize("starts_wanted", [True, False], ids=["h_none", "h_given"])
@pytest.mark.parametrize("how", ["serial", "prefetch", "prefix", "blocked", "tma"])
def test_split_chain_kernel_on_gpu(counts, starts_wanted, how, monkeypatch):
    """Pass 2's Triton chain (3xTF32 products, backends/kernels/segment_scan.py; serial, with each
    link's map loaded a step ahead, as the parallel prefix and blocked) at K = V = 128 against the chains
    step by step in float64, exact and warm links mixed and one head exact throughout, on
    contracting maps like the split's; on TMA over the exact links (a 16-bit call's, TF32 products)
    within 16-bit rounding."""
    import itertools

    from gdr_dispatch.backends.kernels import segment_scan
    from test_context_parallel import _reference_chain

    monkeypatch.setattr(segment_scan, "PREFETCH", how == "prefetch")
    monkeypatch.setattr(segment_scan, "PREFIX", how == "prefix")
    monkeypatch.setattr(segment_scan, "PREFIX_MIN_SEGMENTS", 1)
    monkeypatch.setattr(segment_scan, "PREFIX_GPU_VERIFIED", True)
    monkeypatch.setattr(segment_scan, "BLOCKED", how == "blocked")
    monkeypatch.setattr(segment_scan, "BLOCKED_MIN_SEGMENTS", 1)
    monkeypatch.setattr(segment_scan, "BLOCKED_GPU_VERIFIED", True)
    assert segment_scan.use_prefix(max(counts), "cuda") == (how == "prefix")
    assert segment_scan.use_blocked(max(counts), "cuda") == (how == "blocked")
    monkeypatch.setattr(segment_scan, "TMA_CHAIN", True)
    monkeypatch.setattr(segment_scan, "TMA_CHAIN_GPU_VERIFIED", True)
    assert segment_scan.use_tma_chain("cuda")

    gen = torch.Generator().manual_seed(sum(counts))
    S, H, K, V, N = sum(counts), 3, 128, 128, len(counts)
    M = torch.randn(S, H, K, K, generator=gen, dtype=torch.float64) / K ** 0.5 * 0.9
    starts = torch.randn(S, H, K, V, generator=gen, dtype=torch.float64) if starts_wanted else None
    ends = torch.randn(S, H, K, V, generator=gen, dtype=torch.float64)
    plan = torch.randint(0, 2, (S, H, 1), generator=gen).repeat(1, 1, 2).int() * 2
    plan[:, 0] = 0  # one head exact throughout: every prefix level counts
    M[:, 0] *= 0.5  # its maps contracting (spectral norm ~0.9, as the split's are at most 1)
    S0, G_end = (torch.randn(N, H, K, V, generator=gen, dtype=torch.float64) for _ in range(2))
    want_s, want_e = _reference_chain(counts, plan, M, starts, ends, S0, G_end)
    cuda = (lambda x: None if x is None else x.float().cuda())
    got_s, got_e = cuda(starts), cuda(ends)
    offsets = torch.tensor(tuple(itertools.accumulate((0,) + counts)), dtype=torch.int32, device="cuda")
    segment_scan.chain(cuda(M), got_s, got_e, plan.cuda(), offsets, max(counts), cuda(S0), cuda(G_end),
                       tf32=how == "tma")
    for got, want in ((got_s, want_s), (got_e, want_e)):
        if want is not None:
            assert ((got.double().cpu() - want).norm() / want.norm()).item() < (2e-3 if how == "tma" else 1e-5)


DECAY_GATES = ("logsigmoid", "logsigmoid16", "mixed")


@pytest.mark.parametrize("walk, walks", [(1, "form"), (1, "factors"), (1, "tma"), (4, "form")],
                         ids=["walks_whole", "walks_whole_on_factors", "walks_whole_on_tma", "walks_in_4_pieces"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("gate", DECAY_GATES)
def test_split_decay_plan_and_pieces_on_gpu(gate, dtype, walk, walks, monkeypatch):
    """The decay-aware pass 1 (backends/kernels/segment_maps.py: `decay_plan`, `segment_pieces`)
    at K = V = 128 against the tensor products in float64 on the same plan and segments: the
    kernel's plan is the tensor rule's, every window and exact map within 16-bit rounding; the
    exact segments' walks whole (forming each chunk or reading `_factors`' chunks) and in 4
    pieces composed after (`walk_pieces`)."""
    from dataclasses import replace

    from gdr_dispatch.backends.kernels import segment_maps

    spec = ShapeSpec(seqlens=(4096, 1000, 65), H=4, Hg=2, K=128, V=128, dtype=dtype, h="none", gate=gate)
    kwargs, _ = case(spec, device="cuda", with_oracle=False)
    segs, seg_call, plan, want_plan, want = _plan_and_products(kwargs, 8)
    assert (plan != want_plan).sum().item() <= 2, (plan[..., 0], want_plan[..., 0])  # a sum at the threshold may round
    monkeypatch.setattr(segment_maps, "walk_pieces", lambda max_chunks: walk)
    set_walks(monkeypatch, walks)
    assert segment_maps.use_tma_walks(seg_call) == (walks == "tma")
    got = segment_maps.segment_pieces(seg_call, want_plan.cuda(), torch.tensor(
        segs.roles, dtype=torch.int32, device="cuda"), max_chunks=segs.s)
    worst = _pieces_error(segs, want_plan, got, want)
    assert worst < 1e-2, worst


def _plan_and_products(kwargs: dict, segments: int):
    """`(segs, seg_call, plan, want_plan, (M, starts, ends))`: the call cut into `segments`, the
    plan kernel's plan, and the tensor rule's plan and pass 1 in float64 (on the kernels' fp32
    threshold)."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    call = validate(**kwargs)
    segs = cp.segments_of(tuple(call.seq_lens), 64, segments)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
    thr = cp.threshold(torch.float32)
    plan = segment_maps.decay_plan(seg_call, thr, segs)
    call64 = validate(**{n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x)
                         for n, x in kwargs.items()})
    real = cp.threshold
    cp.threshold = lambda acc: thr  # the kernels' fp32 rule on float64 products
    try:
        want_plan, M, starts, ends = cp._torch_pieces(call64, segs, need_starts=True)
    finally:
        cp.threshold = real
    return segs, seg_call, plan, want_plan, (M, starts, ends)


def _pieces_error(segs, plan, got, want) -> float:
    """The worst relative error (to a norm of at least 1) of `segment_pieces`' `(M, starts, ends)`
    against the tensor products' where the chains read them: starts but a sequence's first, ends
    but its last, M where `plan` says exact."""
    (gM, gstarts, gends), (M, starts, ends) = got, want
    exact = plan[..., 0] == 0
    worst = 0.0
    for j, role in enumerate(segs.roles):
        for h in range(plan.shape[1]):
            pairs = [] if role & 1 else [(gstarts[j, h], starts[j, h])]
            pairs += [] if role & 2 else [(gends[j, h], ends[j, h])]
            pairs += [(gM[j, h], M[j, h])] if exact[j, h] and role != 3 else []
            for g, w in pairs:
                worst = max(worst, ((g.double() - w).norm() / max(w.norm().item(), 1.0)).item())
    return worst


def _on_gpu(kwargs: dict) -> dict:
    return {n: x.cuda() if torch.is_tensor(x) else x for n, x in kwargs.items()}


@pytest.mark.parametrize("walks", ["factors", "tma"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_windows_into_neighbouring_segments_on_gpu(dtype, walks, monkeypatch):
    """Windows that reach a chunk into each neighbouring segment (`edge_gate_inputs`,
    segment_maps.CROSS) at K = V = 128: the kernel's plan is the tensor rule's, and the walks over
    the neighbours' chunks are within 16-bit rounding of the float64 tensor products."""
    from gdr_dispatch.backends.kernels import segment_maps

    monkeypatch.setattr(segment_maps, "CROSS_GPU_VERIFIED", True)
    spec = ShapeSpec(seqlens=(4096, 1000, 65), H=4, Hg=2, K=128, V=128, dtype=dtype, h="none")
    segs, seg_call, plan, want_plan, want = _plan_and_products(_on_gpu(edge_gate_inputs(spec, 512)), 8)
    assert segs.s == 8
    assert torch.equal(plan, want_plan), (plan[..., 0], want_plan[..., 0])
    nc = torch.tensor([-(-n // 64) for n in segs.lens], device="cuda")
    assert (plan[..., 0] > nc[:, None]).any() and (plan[..., 1] > nc[:, None]).any(), plan
    set_walks(monkeypatch, walks)
    got = segment_maps.segment_pieces(seg_call, plan, torch.tensor(
        segs.roles, dtype=torch.int32, device="cuda"), max_chunks=segs.s)
    worst = _pieces_error(segs, plan, got, want)
    assert worst < 1e-2, worst


@pytest.mark.parametrize("backend", ["tilelang_fused", "flash_qla"])
def test_split_with_windows_into_neighbouring_segments_equals_unsplit_on_gpu(backend, monkeypatch):
    """`<backend>@split8` where windows reach into the neighbouring segments against the same
    backend unsplit, to 16-bit rounding."""
    from gdr_dispatch.backends.kernels import segment_maps

    monkeypatch.setattr(segment_maps, "CROSS_GPU_VERIFIED", True)
    if backend not in registered_backends():
        pytest.skip(f"{backend} not registered here")
    inner = registered_backends()[backend]
    for h_mode in ("given", "none"):
        spec = ShapeSpec(seqlens=(4096, 1000, 65), H=4, Hg=2, K=128, V=128, dtype="bfloat16", h=h_mode)
        call = validate(**_on_gpu(edge_gate_inputs(spec, 512)))
        split = SplitBackend(inner, 8)
        if not split.supported(spec.problem(torch.device("cuda")))[0]:
            pytest.skip(f"{split.name} does not take {spec.label()}")
        whole, got = inner.run(call), split.run(call)
        errs = {n: relative_error(getattr(got, n), getattr(whole, n)) for n in whole._fields
                if getattr(whole, n) is not None}
        assert max(errs.values()) < 2e-2, (h_mode, errs)


def test_split_with_windows_into_neighbouring_segments_in_float32_on_gpu(monkeypatch):
    """The same in fp32 (the torch backend, its tensor products' windows, the Triton chain): the
    split equals the unsplit call to 1e-4."""
    from gdr_dispatch.backends.kernels import segment_maps

    monkeypatch.setattr(segment_maps, "CROSS_GPU_VERIFIED", True)
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    monkeypatch.setenv("GDR_BACKEND", "torch")
    spec = ShapeSpec(seqlens=(4096, 1000, 65), H=2, K=64, V=64, dtype="float32", h="none")
    kwargs = _on_gpu(edge_gate_inputs(spec, 512))
    whole = fused_gdr_bwd(**kwargs)
    monkeypatch.setenv("GDR_CP", "8")
    split = fused_gdr_bwd(**kwargs)
    for n in whole._fields:
        if getattr(whole, n) is not None:
            assert relative_error(getattr(split, n), getattr(whole, n)) < 1e-4, n


@pytest.mark.parametrize("hostile", ["plain", "keys", "rise"])
@pytest.mark.parametrize("segments", [2, 8, 32])
@pytest.mark.parametrize("gate", DECAY_GATES)
def test_spread_decay_plan_equals_one_program_on_gpu(gate, segments, hostile, monkeypatch):
    """The decay plan spread over programs (`segment_maps.plan_spread`: a segment's chunks over up
    to 16 programs, the exact segments zeroed by `_plan_combine`) is the one-program plan bit for
    bit at K = V = 128, from 1 to 16 programs per segment, with keys that break the contraction
    inside windows and a rising log decay in one sequence; and some windows are warm and some
    segments exact, so the comparison can tell them apart."""
    from gdr_dispatch.backends.kernels import segment_maps as sm
    from gdr_dispatch.backends.split import passes as cp

    spec = ShapeSpec(seqlens=(4096, 1000, 65), H=4, Hg=2, K=128, V=128, dtype="bfloat16", h="none", gate=gate)
    kwargs, _ = case(spec, device="cuda", with_oracle=False)
    thr = cp.threshold(torch.float32)
    segs = cp.segments_of(tuple(spec.seqlens), 64, segments)

    def plan_of(x, spread):
        call = validate(**x)
        flat, offsets = cp._segments_inputs(call, segs.token_offsets)
        seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
        monkeypatch.setattr(sm, "PLAN_SPREAD", spread)
        monkeypatch.setattr(sm, "PLAN_SPREAD_GPU_VERIFIED", True)
        assert sm.plan_spread(call.q.device) == spread
        return sm.decay_plan(seg_call, thr, segs)

    plain = plan_of(kwargs, False).cpu()
    x = dict(kwargs)
    if hostile == "keys":  # b |k|^2 far above 2 in every third chunk
        x["k"] = x["k"].clone()
        x["k"][:, 100::192] *= 8.0
    elif hostile == "rise":  # the first sequence's log decay rises at one token of head 1
        x["g"] = x["g"].clone()
        x["g"][0, 2050, 1] = x["g"][0, 2049, 1] + 0.5
    plans = {spread: plan_of(x, spread) for spread in (False, True)}
    assert torch.equal(plans[True], plans[False]), (plans[True][..., 0], plans[False][..., 0])
    one = plans[False].cpu()
    if gate != "logsigmoid16":  # (its windows outgrow the short segments)
        assert (plain[..., 0] > 0).any(), plain[..., 0]
    if hostile == "keys" and (plain[..., 0] > 0).any():
        assert not torch.equal(one, plain), one[..., 0]
    if hostile == "rise":
        assert (one[:segs.seg_offsets[1], 1] == 0).all(), one[..., 0]


@pytest.mark.parametrize("gate", ["logsigmoid", "mixed"])
def test_pass_1_walks_on_two_streams_equal_them_on_one_on_gpu(gate, monkeypatch):
    """Pass 1's backward walk on a second stream beside the forward walk
    (`segment_maps.concurrent_walks`): the same bytes as the two walks one after the other, eager,
    replayed from a CUDA graph (the fork and join captured), and called from a side stream, where
    the fork must wait for the caller's stream (its inputs written there just before)."""
    from gdr_dispatch.backends.kernels import segment_maps as sm
    from gdr_dispatch.backends.split import passes as cp

    spec = ShapeSpec(seqlens=(4096, 1000, 65), H=4, Hg=2, K=128, V=128, dtype="bfloat16", h="none", gate=gate)
    kwargs, _ = case(spec, device="cuda", with_oracle=False)
    call = validate(**kwargs)
    segs = cp.segments_of(tuple(call.seq_lens), 64, 8)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
    plan = sm.decay_plan(seg_call, cp.threshold(torch.float32), segs)
    roles = torch.tensor(segs.roles, dtype=torch.int32, device="cuda")
    exact = (plan[..., 0] == 0).cpu()

    def walks(p=plan):
        return sm.segment_pieces(seg_call, p, roles, max_chunks=segs.s)

    def same(got, want, how):
        # what pass 1 writes: no start for a sequence's first segment, no end for its last, maps where exact
        for j, role in enumerate(segs.roles):
            for h in range(call.H):
                pairs = [] if role & 1 else [("start", got[1][j, h], want[1][j, h])]
                pairs += [] if role & 2 else [("end", got[2][j, h], want[2][j, h])]
                pairs += [("map", got[0][j, h], want[0][j, h])] if exact[j, h] and role != 3 else []
                for what, g, w in pairs:
                    assert torch.equal(g, w), (how, what, j, h)

    monkeypatch.setattr(sm, "walk_pieces", lambda max_chunks: 1)  # the fork's path (pieces never fork)
    monkeypatch.setattr(sm, "CONCURRENT_WALKS_GPU_VERIFIED", True)
    monkeypatch.setattr(sm, "CONCURRENT_WALKS", False)
    assert not sm.concurrent_walks(call.q.device)
    want = [x.clone() for x in walks()]
    monkeypatch.setattr(sm, "CONCURRENT_WALKS", True)
    assert sm.concurrent_walks(call.q.device)
    forks = []
    real_stream = sm._walk_stream
    monkeypatch.setattr(sm, "_walk_stream", lambda dev: forks.append(dev) or real_stream(dev))
    if gate == "mixed":
        assert exact.any() and not exact.all(), "the mixed gate should leave some segments exact"
    # NaN in the blocks the outputs will take (the caching allocator hands freed blocks back):
    # a walk that never ran, or ran after the read, leaves NaN where the one-stream walks wrote
    poison = [torch.full_like(x, float("nan")) for x in want]
    del poison
    same(walks(), want, "eager")
    assert forks, "the backward walk did not fork"

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        walks()  # a warm-up on the capture's stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = walks()
    for x in out:
        x.fill_(float("nan"))
    graph.replay()
    same(out, want, "replayed")

    # the plan written on the caller's stream just before the call, behind a busy kernel: a fork that
    # did not wait for that stream would read the poisoned plan (every segment exact, no windows)
    late = torch.zeros_like(plan)
    torch.cuda.synchronize()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        torch.cuda._sleep(50_000_000)
        late.copy_(plan)
        got = walks(late)
    torch.cuda.current_stream().wait_stream(other)
    torch.cuda.synchronize()
    same(got, want, "from a side stream")


@pytest.mark.parametrize("walk", ["whole", "pieces"])
@pytest.mark.parametrize("backend", ["tilelang_fused", "flash_qla", "fla"])
@pytest.mark.parametrize("gate", DECAY_GATES)
@pytest.mark.parametrize("h_mode", ["given", "none"])
def test_decay_aware_split_equals_unsplit_on_gpu(backend, gate, h_mode, walk, monkeypatch):
    """`<backend>@split8` with the decay-aware pass 1 against the same backend unsplit, at strong,
    weak and mixed gates over 8192 tokens of one sequence and a pack: the same gradients to
    16-bit rounding (the split's states are fp32 walks with 16-bit operands, as the unsplit
    backends' own); the exact segments' walks whole and in pieces (segment_maps.walk_pieces)."""
    from gdr_dispatch.backends.kernels import segment_maps

    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    if walk == "whole":
        monkeypatch.setattr(segment_maps, "walk_pieces", lambda max_chunks: 1)
    else:  # in pieces whatever the default (segment_maps.PIECES)
        monkeypatch.setattr(segment_maps, "PIECES", 4)
    if backend not in registered_backends():
        pytest.skip(f"{backend} not registered here")
    inner = registered_backends()[backend]
    for spec in (ShapeSpec(B=1, T=8192, H=4, K=128, V=128, dtype="bfloat16", h=h_mode, gate=gate),
                 ShapeSpec(seqlens=(3000, 63, 5000, 129), H=4, Hg=2, K=128, V=128, dtype="bfloat16", h=h_mode,
                           gate=gate, state_v_first=True)):
        split = SplitBackend(inner, 8)
        if not split.supported(spec.problem(torch.device("cuda")))[0]:
            pytest.skip(f"{split.name} does not take {spec.label()}")
        kwargs, _ = case(spec, device="cuda", with_oracle=False)
        call = validate(**kwargs)
        whole = inner.run(call)
        got = split.run(call)
        errs = {n: relative_error(getattr(got, n), getattr(whole, n)) for n in whole._fields
                if getattr(whole, n) is not None}
        assert max(errs.values()) < 2e-2, (spec.label(), errs)


@pytest.mark.parametrize("gate", DECAY_GATES)
@pytest.mark.parametrize("segments", [8, 32])
def test_decay_aware_split_in_float32_on_gpu(gate, segments, monkeypatch):
    """In fp32 (the torch backend, its decay-aware tensor products, the Triton chain for the fp32
    maps) the split equals the unsplit call to fp32 rounding: what the warm-ups drop is below it.
    At 32 segments (16 and more per sequence) pass 2 runs blocked where segment_scan.BLOCKED is on."""
    from gdr_dispatch.backends.kernels import segment_scan

    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert segment_scan.use_blocked(segments, "cuda") == (segment_scan.BLOCKED
                                                          and segments >= segment_scan.BLOCKED_MIN_SEGMENTS)
    spec = ShapeSpec(seqlens=(4096, 200, 1000), H=2, K=64, V=64, dtype="float32", h="none", gate=gate)
    kwargs, _ = case(spec, device="cuda", with_oracle=False)
    monkeypatch.setenv("GDR_BACKEND", "torch")
    whole = fused_gdr_bwd(**kwargs)
    monkeypatch.setenv("GDR_CP", str(segments))
    split = fused_gdr_bwd(**kwargs)
    for n in whole._fields:
        if getattr(whole, n) is not None:
            assert relative_error(getattr(split, n), getattr(whole, n)) < 1e-4, n


@pytest.mark.parametrize("provider", ["flash_qla", "fla"])
@pytest.mark.parametrize("gate", DECAY_GATES)
def test_split_forward_equals_the_whole_on_gpu(provider, gate, monkeypatch):
    """The op's forward as `<provider>@split8` (backends/split/forward.py) against the provider
    whole, at strong, weak and mixed gates, one sequence (no initial state) and a GVA pack with
    `state_v_first` and h0: outputs, final states and residuals to 16-bit rounding, and the
    gradients through the op; replayed from its CUDA graph, the same outputs. FlashQLA's split
    forward runs in its two halves here (`residual_forward`)."""
    import torch.nn.functional as F

    from gdr_dispatch import chunk_gated_delta_rule, clear_caches
    from gdr_dispatch.shapes import log_decay

    if provider not in registered_backends():
        pytest.skip(f"{provider} not registered here")
    # FlashQLA's split forward runs in two halves (the residuals once: Backend.residual_forward);
    # the gate stays open here so a kernel marked unverified again is still what this checks
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    # the backward on the provider itself: the gradients then differ only by the forward's residuals,
    # and no autotune compiles every candidate at these two shapes (minutes on a fresh machine)
    monkeypatch.setenv("GDR_BACKEND", provider)
    for seqlens, Hg, v_first, h0 in (((8192,), 4, False, False), ((3000, 63, 5000, 129), 2, True, True)):
        gen = torch.Generator().manual_seed(11)
        T, H, K = sum(seqlens), 4, 128
        spec = ShapeSpec(seqlens=seqlens, H=H, Hg=Hg, K=K, V=K, gate=gate)
        q = torch.randn(1, T, Hg, K, generator=gen).cuda().bfloat16()
        k = F.normalize(torch.randn(1, T, Hg, K, generator=gen), dim=-1).cuda().bfloat16()
        v = torch.randn(1, T, H, K, generator=gen).cuda().bfloat16()
        g = log_decay(spec, gen).float().cuda()
        beta = torch.rand(1, T, H, generator=gen).cuda().bfloat16()
        init = torch.randn(len(seqlens), H, K, K, generator=gen).cuda() if h0 else None
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        outs = {}
        for name in (provider, f"{provider}@split8"):
            monkeypatch.setenv("GDR_FORWARD", name)
            clear_caches()
            raw = torch.ops.gdr_dispatch.chunk_gdr_fwd(q, k, v, g, beta, init, cu, K ** -0.5, True, v_first, True)
            if "@split" in name:  # the second call captures a graph with copies, the third on its inputs in
                from gdr_dispatch.backends.split import graphs  # place; then new values read in place

                def fwd(values):
                    return torch.ops.gdr_dispatch.chunk_gdr_fwd(q, k, values, g, beta, init, cu, K ** -0.5, True,
                                                                v_first, True)

                v2 = v * 0.5
                copied = tuple(x.clone() for x in fwd(v2))
                in_place = fwd(v2)
                assert graphs.held_graphs() >= 1, name
                assert all(relative_error(a, b) < 1e-6 for a, b in zip(in_place, copied)), name
                assert relative_error(copied[0], raw[0]) > 0.1, name  # (v2's output differs: the inputs were read)
                kept = [x.clone() for x in (q, k, g, beta, cu)]
                v2.mul_(2)  # v's values at v2's address: read in place
                assert all(relative_error(a, b) < 1e-6 for a, b in zip(fwd(v2), raw)), name
                assert all(torch.equal(x, y) for x, y in zip((q, k, g, beta, cu), kept)), name  # none written
                assert all(relative_error(a, b) < 1e-6 for a, b in zip(fwd(v), raw)), name  # another address: copied
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
            o, ht = chunk_gated_delta_rule(*leaves, initial_state=init, output_final_state=True, cu_seqlens=cu,
                                           state_v_first=v_first)
            ((o.float() * o.detach().float().sin()).sum() + (ht * ht.detach().cos()).sum()).backward()
            outs[name] = list(raw) + [x.grad for x in leaves]
        names = ("o", "final_state", "G", "a", "h", "dq", "dk", "dv", "dg", "dbeta")
        errs = {n: relative_error(a, b) for n, a, b in zip(names, outs[f"{provider}@split8"], outs[provider])}
        assert max(errs.values()) < 2e-2, (seqlens, errs)


@pytest.mark.parametrize("gate", DECAY_GATES)
def test_the_split_backward_on_the_split_forwards_carry_on_gpu(gate, monkeypatch):
    """The op with its forward and backward split alike (`fla@split8` forward, `tilelang_fused@split8`
    backward): the backward takes the forward's plan, exact maps and start states (backends/split/
    carry.py; its own pass 1 then walks only backwards) and its gradients are those it computes
    without them, step by step: eager, captured, then replayed with copies in, the gate alternating
    with a weak one so the plan changes between steps. One sequence, and a GVA pack with h0 and
    `state_v_first`."""
    import torch.nn.functional as F

    from gdr_dispatch import chunk_gated_delta_rule, clear_caches
    from gdr_dispatch.backends.split import carry
    from gdr_dispatch.backends.split import passes as cp
    from gdr_dispatch.shapes import log_decay

    if not {"fla", "tilelang_fused"} <= set(registered_backends()):
        pytest.skip("fla and tilelang_fused are not both registered here")
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")  # both runs alike: only the carry differs
    monkeypatch.setenv("GDR_FORWARD", "fla@split8")
    monkeypatch.setenv("GDR_BACKEND", "tilelang_fused@split8")
    seen = []
    real = cp.split_backward

    def spy(call, segments, run, states_by_run=False, carried=()):
        seen.append(len(carried))
        return real(call, segments, run, states_by_run=states_by_run, carried=carried)

    monkeypatch.setattr(cp, "split_backward", spy)
    for seqlens, Hg, v_first, h0 in (((8192,), 4, False, False), ((3000, 63, 5000, 129), 2, True, True)):
        gen = torch.Generator().manual_seed(13)
        T, H, K = sum(seqlens), 4, 128
        q = torch.randn(1, T, Hg, K, generator=gen).cuda().bfloat16()
        k = F.normalize(torch.randn(1, T, Hg, K, generator=gen), dim=-1).cuda().bfloat16()
        v = torch.randn(1, T, H, K, generator=gen).cuda().bfloat16()
        gates = [log_decay(ShapeSpec(seqlens=seqlens, H=H, Hg=Hg, K=K, V=K, gate=name), gen).float().cuda()
                 for name in (gate, "logsigmoid16")]
        beta = torch.rand(1, T, H, generator=gen).cuda().bfloat16()
        init = torch.randn(len(seqlens), H, K, K, generator=gen).cuda() if h0 else None
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        grads = {}
        for allow in (False, True):
            monkeypatch.setattr(carry, "allowed", lambda allow=allow: allow)
            clear_caches()
            seen.clear()
            grads[allow] = []
            for step in range(4):  # eager, the graphs captured, then replayed (copies in: fresh leaves)
                leaves = [x.clone().requires_grad_(True) for x in (q, k, v, gates[step % 2], beta)]
                o, ht = chunk_gated_delta_rule(*leaves, initial_state=init, output_final_state=True, cu_seqlens=cu,
                                               state_v_first=v_first)
                ((o.float() * o.detach().float().sin()).sum() + (ht * ht.detach().cos()).sum()).backward()
                grads[allow].append([x.grad for x in leaves])
            # (a replay runs no Python: the eager calls and the captures are what the spy sees)
            assert seen and set(seen) == {3 if allow else 0}, (allow, seen)
        for step in range(4):
            errs = {n: relative_error(a, b) for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads[True][step],
                                                               grads[False][step])}
            assert max(errs.values()) < 1e-3, (seqlens, step, errs)


def test_layers_at_one_shape_replay_their_own_in_place_graphs_on_gpu(monkeypatch):
    """Three layers at one shape, each with its own input tensors, new values written into them
    every step (a model whose caching allocator hands each layer its blocks again): from the second
    step the split forward replays one in-place graph per layer (graphs.ADDRESS_SETS, the key's
    graphs on one memory pool), the backward in place where its inputs repeat too, and every step's
    outputs and gradients are the eager op's (GDR_SPLIT_GRAPHS=0) on the same values; the inputs
    are never written."""
    import torch.nn.functional as F

    from gdr_dispatch import chunk_gated_delta_rule, clear_caches
    from gdr_dispatch.backends.split import graphs
    from gdr_dispatch.shapes import log_decay

    if not {"fla", "tilelang_fused"} <= set(registered_backends()):
        pytest.skip("fla and tilelang_fused are not both registered here")
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    monkeypatch.setenv("GDR_FORWARD", "fla@split8")
    monkeypatch.setenv("GDR_BACKEND", "tilelang_fused@split8")
    T, H, K, layers, steps = 8192, 4, 128, 3, 4
    gen = torch.Generator().manual_seed(21)

    def values(gate):
        return {"q": torch.randn(1, T, H, K, generator=gen).bfloat16(),
                "k": F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).bfloat16(),
                "v": torch.randn(1, T, H, K, generator=gen).bfloat16(),
                "g": log_decay(ShapeSpec(B=1, T=T, H=H, K=K, V=K, gate=gate), gen).float(),
                "beta": torch.rand(1, T, H, generator=gen).bfloat16()}

    feed = [[values(("mixed", "logsigmoid")[(s + i) % 2]) for i in range(layers)] for s in range(steps)]
    names = ("q", "k", "v", "g", "beta")

    held = []  # layer 0's forward outputs of step 1, the very tensors, kept past later steps

    def step(x, keep=False):
        leaves = [x[n].detach().requires_grad_(True) for n in names]  # the layer's own storage
        o, ht = chunk_gated_delta_rule(*leaves, output_final_state=True)
        ((o.float() * o.detach().float().sin()).sum() + (ht * ht.detach().cos()).sum()).backward()
        if keep:
            held.append((o.detach(), ht.detach(), o.detach().clone(), ht.detach().clone()))
        return [o.detach().clone(), ht.detach().clone()] + [t.grad.clone() for t in leaves]

    captured = []  # (step, the graph's name, in place)
    real_capture = graphs._capture

    def spy(name, key, tensors, fn, seq_lens, in_place=False, **kw):
        captured.append((len(order_seen), name, in_place))
        return real_capture(name, key, tensors, fn, seq_lens, in_place=in_place, **kw)

    monkeypatch.setattr(graphs, "_capture", spy)
    monkeypatch.setattr(graphs, "PLACED_GPU_VERIFIED", True)
    monkeypatch.setattr(graphs, "OWN_POOLS_GPU_VERIFIED", True)
    results, order_seen = {}, []
    for graphs_on in (False, True):
        monkeypatch.setenv("GDR_SPLIT_GRAPHS", "1" if graphs_on else "0")
        clear_caches()
        captured.clear()
        mine = [{n: t.cuda() for n, t in feed[0][i].items()} for i in range(layers)]
        results[graphs_on] = {}
        lent_before = graphs.replays["lent"]
        for s in range(steps):
            order_seen.append(s)
            forward_in_place, lent = graphs.replays["in place"], graphs.replays["lent"]
            for i in (range(layers) if s % 2 == 0 else reversed(range(layers))):  # the order moves too
                for n in names:
                    mine[i][n].copy_(feed[s][i][n])
                results[graphs_on][(s, i)] = step(mine[i], keep=graphs_on and s == 2 and i == 0)
                for n in names:
                    assert torch.equal(mine[i][n].cpu(), feed[s][i][n]), (s, i, n)
            if graphs_on and s == 2:
                # every layer's forward replays its own in-place graph, captured once, and lends
                # its outputs and the backward its gradients (their own memory pools: graphs.py)
                assert graphs.replays["in place"] - forward_in_place >= layers, (s, graphs.replays)
                assert graphs.replays["lent"] - lent >= layers, (s, graphs.replays)
            if graphs_on and s >= 2:
                assert not [c for c in captured if c[0] == len(order_seen) and "forward" in c[1]], captured
        order_seen.clear()
        if graphs_on:
            forward_placed = [c for c in captured if "forward" in c[1] and c[2]]
            assert len(forward_placed) == layers, captured
            assert graphs.replays["lent"] > lent_before
            for o, ht, o_then, ht_then in held:  # held past a later step: never overwritten
                assert torch.equal(o, o_then) and torch.equal(ht, ht_then)
    labels = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta")
    for at, got in results[True].items():
        errs = {n: relative_error(x, y) for n, x, y in zip(labels, got, results[False][at])}
        assert max(errs.values()) < 1e-3, (at, errs)


@pytest.mark.parametrize("layout", ["projection", "conv"])
def test_hf_hook_l2norm_fused_matches_the_torch_form_on_gpu(layout, monkeypatch):
    """The HF hook's q/k normalisation on CUDA bf16 runs the one-pass kernels
    (backends/kernels/l2norm.py) and gives the torch form's values and gradients (bf16 rounding
    apart), on a strided view as HF passes it (a fused projection's, or a transposed convolution
    output's: HF Qwen3-Next's); inside a capture the torch form runs."""
    from gdr_dispatch.integrations import transformers as gdr_hf

    fused = gdr_hf._fused_l2norm()
    calls = []
    monkeypatch.setattr(gdr_hf, "_fused_l2norm", lambda: (lambda x, eps: calls.append(eps) or fused(x, eps)))
    B, T, H, D = 2, 300, 4, 128
    if layout == "conv":
        base = torch.randn(B, 3 * H * D, T, device="cuda", dtype=torch.bfloat16) * 3

        def view(x):
            return x.transpose(1, 2)[..., :H * D].unflatten(-1, (H, D))
    else:
        base = torch.randn(B, T, 3 * H * D, device="cuda", dtype=torch.bfloat16) * 3

        def view(x):
            return x[..., :H * D].view(B, T, H, D)
    dy = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    outs = []
    for route in ("fused", "torch"):
        x = base.detach().clone().requires_grad_(True)
        q = view(x)
        assert not q.is_contiguous()
        if route == "fused":
            y = gdr_hf.l2norm(q)
        else:
            qf = q.float()
            y = (qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + gdr_hf.EPS)).bfloat16()
        (y.float() * dy.float()).sum().backward()
        outs.append((y.detach(), view(x.grad).detach()))
    assert calls == [gdr_hf.EPS]
    assert outs[0][0].dtype == torch.bfloat16
    assert relative_error(outs[0][0], outs[1][0]) < 1e-2 and relative_error(outs[0][1], outs[1][1]) < 2e-2
    # inside a CUDA graph capture the torch form runs (a first call's compile does not belong in one)
    q = view(base)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side):
        y = gdr_hf.l2norm(q)
    graph.replay()
    torch.cuda.synchronize()
    assert calls == [gdr_hf.EPS] and relative_error(y, outs[1][0]) < 1e-2


def test_split_graph_capture_keeps_the_allocators_cached_blocks_on_gpu(monkeypatch):
    """A split call captured into its graph (graphs.capturing) leaves the caching allocator's cached
    blocks with it: no cudaFree during the capture (torch.cuda.graph empties the cache first, and a
    model's next allocations then cudaMalloc afresh), and the capture's outputs match the eager call."""
    from gdr_dispatch import clear_caches
    from gdr_dispatch.backends.split import graphs
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    if "tilelang_fused" not in registered_backends():
        pytest.skip("tilelang_fused is not registered here")
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    monkeypatch.setenv("GDR_BACKEND", "tilelang_fused@split4")
    monkeypatch.setenv("GDR_SPLIT_GRAPHS", "1")
    spec = ShapeSpec(B=1, T=4096, H=4, K=128, V=128, dtype="bfloat16", h="none", gate="mixed")
    kwargs = call_kwargs(make_inputs(spec, torch.device("cuda")))
    clear_caches()
    eager = [x.clone() for x in fused_gdr_bwd(**kwargs) if x is not None]  # the key's first call: eager
    spare = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del spare  # a cached free block, as a training step leaves them
    torch.cuda.synchronize()
    frees, captured = torch.cuda.memory_stats().get("num_device_free", 0), sum(graphs.captures.values())
    replayed = [x.clone() for x in fused_gdr_bwd(**kwargs) if x is not None]  # captured, then replayed
    torch.cuda.synchronize()
    assert sum(graphs.captures.values()) == captured + 1, graphs.captures
    assert torch.cuda.memory_stats().get("num_device_free", 0) == frees
    assert max(relative_error(a, b) for a, b in zip(eager, replayed)) < 1e-5


def test_split_backward_lends_its_outputs_only_while_nothing_holds_them_on_gpu(monkeypatch):
    """The split backward replayed from its graph with its outputs lent (graphs.LEND_GPU_VERIFIED):
    steps whose gradients are dropped before the next step get the graph's own buffers, steps
    that keep them (a leaf's .grad, a list) make the next call run eagerly; every step's outputs
    and gradients equal the eager op's, and a kept gradient never changes after it was returned."""
    import torch.nn.functional as F

    from gdr_dispatch import chunk_gated_delta_rule, clear_caches
    from gdr_dispatch.backends.split import graphs
    from gdr_dispatch.shapes import log_decay

    if not {"fla", "tilelang_fused"} <= set(registered_backends()):
        pytest.skip("fla and tilelang_fused are not both registered here")
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    monkeypatch.setenv("GDR_FORWARD", "fla@split8")
    monkeypatch.setenv("GDR_BACKEND", "tilelang_fused@split8")
    T, H, K, steps = 8192, 4, 128, 6
    gen = torch.Generator().manual_seed(22)
    names = ("q", "k", "v", "g", "beta")

    def values(s):
        return {"q": torch.randn(1, T, H, K, generator=gen).bfloat16(),
                "k": F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).bfloat16(),
                "v": torch.randn(1, T, H, K, generator=gen).bfloat16(),
                "g": log_decay(ShapeSpec(B=1, T=T, H=H, K=K, V=K, gate=("mixed", "logsigmoid")[s % 2]), gen).float(),
                "beta": torch.rand(1, T, H, generator=gen).bfloat16()}

    feed = [values(s) for s in range(steps)]
    keep_at = {3, 4}  # these steps' gradients are kept past the next step

    def run_all():
        kept, out = [], {}
        for s in range(steps):
            leaves = [feed[s][n].cuda().requires_grad_(True) for n in names]
            o, ht = chunk_gated_delta_rule(*leaves, output_final_state=True)
            ((o.float() * o.detach().float().sin()).sum() + (ht * ht.detach().cos()).sum()).backward()
            grads = [t.grad for t in leaves]
            out[s] = [o.detach().clone(), ht.detach().clone()] + [x.clone() for x in grads]
            if s in keep_at:
                kept.append((s, grads))  # the very tensors returned, held
        for s, grads in kept:  # held gradients were never overwritten by a later replay
            assert all(torch.equal(x, y) for x, y in zip(grads, out[s][2:])), s
        return out

    monkeypatch.setenv("GDR_SPLIT_GRAPHS", "0")
    clear_caches()
    eager = run_all()
    monkeypatch.setenv("GDR_SPLIT_GRAPHS", "1")
    monkeypatch.setattr(graphs, "LEND_BLOCKS", 10)  # keep lending through the held steps
    clear_caches()
    before = dict(graphs.replays)
    lent = run_all()
    assert graphs.replays["lent"] > before.get("lent", 0), graphs.replays
    labels = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta")
    for s in range(steps):
        errs = {n: relative_error(x, y) for n, x, y in zip(labels, lent[s], eager[s])}
        assert max(errs.values()) < 1e-3, (s, errs)
    # through fused_gdr_bwd the returned gradients are held for certain (autograd may clone them):
    # the call after finds them held, runs eagerly, and leaves them as they were
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    spec = ShapeSpec(B=1, T=T, H=H, K=K, V=K, dtype="bfloat16", h="none", gate="mixed")
    kwargs = call_kwargs(make_inputs(spec, torch.device("cuda")))
    clear_caches()
    first = fused_gdr_bwd(**kwargs)  # eager
    second = fused_gdr_bwd(**kwargs)  # captured, lent
    held = [x for x in second if x is not None]
    kept = [x.clone() for x in held]
    blocked = graphs.replays["blocked"]
    third = fused_gdr_bwd(**kwargs)
    torch.cuda.synchronize()
    assert graphs.replays["blocked"] == blocked + 1, graphs.replays
    assert all(torch.equal(a, b) for a, b in zip(held, kept))
    for n in first._fields:
        if getattr(first, n) is not None:
            assert relative_error(getattr(third, n), getattr(first, n)) < 1e-3, n
            assert relative_error(getattr(second, n), getattr(first, n)) < 1e-3, n
    # on a side stream nothing is lent (another stream may still read what a call lent when the
    # key's next call runs there), and the results are the default stream's; dh0 is never lent
    clear_caches()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    lent = graphs.replays["lent"]
    with torch.cuda.stream(side):
        got = [fused_gdr_bwd(**kwargs) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert graphs.replays["lent"] == lent, graphs.replays
    for n in first._fields:
        if getattr(first, n) is not None:
            assert relative_error(getattr(got[-1], n), getattr(first, n)) < 1e-3, n
    if first.dh0 is not None:  # the second call replays: the per-token gradients lent, dh0 alone copied out
        clear_caches()
        fused_gdr_bwd(**kwargs)
        lent, copied = graphs.replays["lent"], graphs.copied_bytes["out"]
        second = fused_gdr_bwd(**kwargs)
        assert graphs.replays["lent"] == lent + 1, graphs.replays
        assert graphs.copied_bytes["out"] - copied == second.dh0.nbytes


def test_cu_seqlens_on_the_cpu_equals_it_on_the_device_and_waits_for_nothing_on_gpu(monkeypatch):
    """`fused_gdr_bwd` with `cu_seqlens` on the CPU (contract.offsets_to_device): the same gradients
    as with it on the GPU, and, from the second call at these lengths on, no host wait (torch's
    sync debug mode raises on one)."""
    monkeypatch.setenv("GDR_BACKEND", "tilelang_fused")
    spec = ShapeSpec(seqlens=(1, 63, 64, 65, 300), H=4, Hg=2, K=128, V=128, dtype="bfloat16", h="given")
    kwargs, _ = case(spec, device="cuda", with_oracle=False)
    on_gpu = fused_gdr_bwd(**kwargs)
    cpu_kwargs = {**kwargs, "cu_seqlens": kwargs["cu_seqlens"].cpu()}
    fused_gdr_bwd(**cpu_kwargs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_cpu = fused_gdr_bwd(**cpu_kwargs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for name in on_gpu._fields:
        if getattr(on_gpu, name) is not None:
            assert torch.equal(getattr(on_cpu, name), getattr(on_gpu, name)), name
