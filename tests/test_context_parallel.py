"""The exact intra-GPU split (backends/split/), on the CPU in float64:
the affine chunk maps, the segment plan, and split == unsplit through `fused_gdr_bwd` (GDR_CP)."""

import itertools
import logging
from dataclasses import replace

import pytest
import torch

from gdr_dispatch import chunked_math as cm
from gdr_dispatch import clear_caches, fused_gdr_bwd
from gdr_dispatch.backends.split.passes import chunk_maps, segment_length
from gdr_dispatch.contract import validate
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs


def test_segments_are_runs_of_whole_chunks():
    assert segment_length([300], 64, 2) == 3  # 5 chunks: runs of 3 and 2
    assert segment_length([300, 64, 0], 64, 3) == 2
    assert segment_length([130], 64, 100) == 1  # never less than one chunk
    with pytest.raises(ValueError, match="segments"):
        segment_length([10], 64, 0)


def test_chunk_maps_are_the_state_recurrences():
    """S_{c+1} = M_c S_c + R_c reproduces the forward recurrence; dS_c = M_c^T dS_{c+1} + D_c the
    backward one (chunked_math's stages 2 and 4)."""
    x = make_inputs(ShapeSpec(B=2, T=200, H=4, Hg=2, K=16, V=8, dtype="float64", h="given"), "cpu", seed=2)
    call = validate(**call_kwargs(x))
    lay, M, R, D = chunk_maps(call)
    q = cm.expand_heads(lay.gather(call.q, torch.float64), call.H)
    k = cm.expand_heads(lay.gather(call.k, torch.float64), call.H)
    G = lay.gather_gate(call.g, torch.float64)
    w, u = cm.recompute_w_u(k, lay.gather(call.v, torch.float64), lay.gather(call.b, torch.float64),
                            lay.gather(call.a, torch.float64), G)
    h, _, ht = cm.chunk_states(k, w, u, G, call.initial_state)
    S = call.initial_state
    for c in range(M.shape[1]):
        assert torch.allclose(S, h[:, c], atol=1e-12)
        S = M[:, c] @ S + R[:, c]
    assert torch.allclose(S, ht, atol=1e-12)
    do = lay.gather(call.do, torch.float64)
    dvl = cm.dv_local(q, k, G, do, call.scale)
    dh, dh0, _ = cm.chunk_state_grads(q, k, w, G, call.dht, do, dvl, call.scale)
    dS = call.dht
    for c in range(M.shape[1] - 1, -1, -1):
        assert torch.allclose(dS, dh[:, c], atol=1e-12)
        dS = M[:, c].transpose(-1, -2) @ dS + D[:, c]
    assert torch.allclose(dS, dh0, atol=1e-12)


SPLIT_SHAPES = [
    ShapeSpec(B=2, T=300, H=4, Hg=2, K=16, V=8),  # grouped heads, 300 = 4 chunks + 44 tokens
    ShapeSpec(seqlens=(1, 63, 64, 65, 300), H=2, K=16, V=8, state_v_first=True),
    ShapeSpec(B=1, T=200, H=2, K=8, V=16, initial_state=False, dht=False),
    ShapeSpec(B=1, T=256, H=2, K=8, V=8, initial_state=False),
    ShapeSpec(seqlens=(130, 0, 70), H=2, K=8, V=8, dht=False),  # a sequence of no tokens
]


def assert_split_equals_whole(kwargs: dict, segments: int, tol: float, monkeypatch) -> None:
    """Every gradient of the call split by GDR_CP=`segments` within `tol` (relative Frobenius) of
    the unsplit call's, the same shapes and dtypes, None where it is None."""
    whole = fused_gdr_bwd(**kwargs)
    monkeypatch.setenv("GDR_CP", str(segments))
    split = fused_gdr_bwd(**kwargs)
    monkeypatch.delenv("GDR_CP")
    for name in whole._fields:
        a, b = getattr(split, name), getattr(whole, name)
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert ((a - b).norm() / b.norm()).item() < tol, name


@pytest.mark.parametrize("segments", [2, 3, 100])
@pytest.mark.parametrize("h_mode", ["given", "none"])
@pytest.mark.parametrize("spec", SPLIT_SHAPES, ids=lambda s: s.label())
def test_split_equals_unsplit_in_float64(spec, h_mode, segments, monkeypatch):
    assert_split_equals_whole(call_kwargs(make_inputs(replace(spec, dtype="float64", h=h_mode), "cpu", seed=3)),
                              segments, 1e-10, monkeypatch)


@pytest.mark.parametrize("value", ["0", "1", ""])
def test_gdr_cp_off_runs_the_call_whole(value, monkeypatch):
    import gdr_dispatch.backends.split.passes as cp_mod

    monkeypatch.setenv("GDR_CP", value)
    monkeypatch.setattr(cp_mod, "split_backward", lambda *a, **k: pytest.fail("split although GDR_CP is off"))
    fused_gdr_bwd(**call_kwargs(make_inputs(ShapeSpec(B=1, T=70, H=2, K=8, V=8, dtype="float32", h="given"), "cpu")))


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_a_bad_gdr_cp_is_an_error_naming_it(value, monkeypatch):
    monkeypatch.setenv("GDR_CP", value)
    with pytest.raises(ValueError, match="GDR_CP"):
        fused_gdr_bwd(**call_kwargs(make_inputs(ShapeSpec(B=1, T=70, H=2, K=8, V=8, dtype="float32", h="given"),
                                                "cpu")))


def test_the_log_says_split(monkeypatch, caplog):
    monkeypatch.setenv("GDR_CP", "2")
    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        fused_gdr_bwd(**call_kwargs(make_inputs(ShapeSpec(B=1, T=200, H=2, K=8, V=8, dtype="float32", h="none"),
                                                "cpu")))
    assert any("split=2" in r.message for r in caplog.records)


def test_explain_shows_the_split(monkeypatch, capsys):
    from gdr_dispatch import cli

    monkeypatch.setenv("GDR_CP", "4")
    assert cli.main(["explain", "--device", "cpu", "--K", "16", "--V", "16"]) == 0
    assert "split=4" in capsys.readouterr().out


# -- the autotuner's (backend, segments) candidates --------------------------------------------
from gdr_dispatch import Problem, registry, tuning_table  # noqa: E402
from gdr_dispatch import autotune as at  # noqa: E402
from gdr_dispatch import dispatch as dsp  # noqa: E402
from gdr_dispatch.backends.split import SplitBackend, segment_counts  # noqa: E402
from gdr_dispatch.problem import DeviceInfo  # noqa: E402

STARVED = ShapeSpec(B=1, T=600, H=2, K=8, V=8, dtype="float64", h="none")  # 2 programs, 10 chunks


from conftest import TorchAsPlain as Plain, WALKS, edge_gate_inputs, set_walks  # noqa: E402


@pytest.fixture
def gpu_like(monkeypatch):
    """A Problem on a fake 132-SM GPU that may autotune every candidate (GDR_AUTOTUNE_ALL: no
    pruning, every split count), with measured times set per candidate."""
    plain = Plain()
    monkeypatch.setattr(dsp, "autotune_block_reason", lambda p, have_tensors: None)
    monkeypatch.setenv("GDR_AUTOTUNE_ALL", "1")
    real = Problem.from_call

    def on_gpu(call):
        return replace(real(call), device=DeviceInfo("cuda", "Fake GPU", (9, 0), 132))

    monkeypatch.setattr(dsp.Problem, "from_call", staticmethod(on_gpu))
    with registry.scoped(add=[plain]):
        yield plain


def _times(monkeypatch, ms):
    def measure(fn, device_type):
        fn()
        return measure.ms.pop(0)
    order = []

    def autotune(call, problem, candidates, measure=None, progress=None, skipped=None, untimed=()):
        order.extend(candidates)
        fake.ms = [ms(name) for name in candidates if name not in untimed]
        return real_autotune(call, problem, candidates, measure=fake, progress=progress, skipped=skipped,
                             untimed=untimed)

    def fake(fn, device_type):
        fn()
        return fake.ms.pop(0)
    real_autotune = at.autotune
    monkeypatch.setattr(at, "autotune", autotune)
    return order


def test_starved_grids_get_split_candidates_and_a_split_winner_is_stored_and_reused(gpu_like, monkeypatch):
    order = _times(monkeypatch, lambda name: 1.0 if name == "fake_plain@split4" else 5.0)
    kwargs = call_kwargs(make_inputs(STARVED, "cpu", seed=6))
    whole = registry.get_backend("torch").run(validate(**kwargs))
    grads = fused_gdr_bwd(**kwargs)
    assert {"fake_plain@split2", "fake_plain@split4", "fake_plain@split8"} <= set(order)
    assert not any(n.startswith("torch@") for n in order)  # the reference is never split
    problem = dsp.Problem.from_call(validate(**kwargs))
    hit = next(tuning_table.lookup(problem.device.slug, problem.problem_key(), problem.versions_key()))
    assert hit.entry["winner"] == "fake_plain@split4"
    for name in grads._fields:
        a, b = getattr(grads, name), getattr(whole, name)
        assert b is None or ((a - b).norm() / b.norm()).item() < 1e-10, name
    dsp.clear_caches()
    choice = dsp.select_backend(problem, validate(**kwargs))
    assert choice.source == dsp.TABLE and isinstance(choice.backend, SplitBackend) and choice.backend.segments == 4


def test_gdr_cp_0_turns_a_stored_split_off(gpu_like, monkeypatch):
    kwargs = call_kwargs(make_inputs(STARVED, "cpu", seed=6))
    problem = dsp.Problem.from_call(validate(**kwargs))
    tuning_table.record(problem.device.slug, "Fake GPU", {problem.table_key(): {
        "winner": "fake_plain@split2",
        "candidates": {"fake_plain@split2": {"ms": 1.0}, "fake_plain": {"ms": 3.0}, "torch": {"ms": 9.0}}}})
    monkeypatch.setenv("GDR_CP", "0")
    choice = dsp.select_backend(problem, validate(**kwargs))
    assert choice.backend.name == "fake_plain" and choice.source == dsp.TABLE


def test_full_grids_and_gdr_cp_get_no_split_candidates(gpu_like, monkeypatch):
    kwargs = call_kwargs(make_inputs(STARVED, "cpu", seed=6))
    problem = dsp.Problem.from_call(validate(**kwargs))
    options = {"fake_plain": gpu_like}
    assert dsp.wrapped_candidates(problem, options)
    full = replace(problem, device=DeviceInfo("cuda", "Fake GPU", (9, 0), 2))  # 2 programs on 2 SMs
    assert dsp.wrapped_candidates(full, options) == {}
    monkeypatch.setenv("GDR_CP", "4")
    assert dsp.wrapped_candidates(problem, options) == {}


@pytest.mark.parametrize("spec, sms, counts", [
    (ShapeSpec(B=1, T=32768, H=4), 132, (2, 4, 8, 16, 32, 64)),  # 4 programs: 64 x 4 is the first to fill
    (ShapeSpec(B=2, T=16384, H=8), 132, (2, 4, 8, 16)),
    (ShapeSpec(B=1, T=8192, H=16), 132, (2, 4, 8, 16)),
    (ShapeSpec(B=1, T=300, H=2), 132, (2, 4)),  # 5 chunks: no segment count above them
    (ShapeSpec(seqlens=(4096, 64), H=4), 132, (2, 4, 8, 16, 32)),  # the longest sequence's 64 chunks
])
def test_split_counts_run_up_to_the_first_that_fills_the_sms(spec, sms, counts):
    problem = replace(spec.problem(torch.device("cpu")), device=DeviceInfo("cuda", "Fake GPU", (9, 0), sms))
    assert segment_counts(problem) == counts


@pytest.mark.parametrize("spec, counts", [
    (ShapeSpec(B=1, T=32768, H=4), (32, 64)),  # 128 and 256 programs on 132 SMs
    (ShapeSpec(B=2, T=16384, H=8), (8, 16)),
    (ShapeSpec(B=1, T=8192, H=16), (8, 16)),
    (ShapeSpec(B=2, T=4096, H=16, Hg=8), (4, 8)),
    (ShapeSpec(B=1, T=300, H=2), (4,)),  # no count reaches half the SMs: the largest the sequence allows
])
def test_a_first_call_times_only_the_counts_near_a_full_grid(spec, counts):
    problem = replace(spec.problem(torch.device("cpu")), device=DeviceInfo("cuda", "Fake GPU", (9, 0), 132))
    assert segment_counts(problem, thorough=False) == counts


def test_split_names_parse():
    assert registry.parse_wrapped("fla@split4")[:2] == ("fla", 4)
    assert registry.parse_wrapped("fla") == ("fla", 1, None)
    assert registry.parse_wrapped("odd@splitx") == ("odd@splitx", 1, None)
    assert registry.get_backend("fla@split4").name == "fla@split4"
    with pytest.raises(ValueError, match="unknown backend 'banana@split4'"):
        registry.get_backend("banana@split4")


# -- pass 1 on fla's state kernels (stand-ins on the CPU) ----------------------------------------
FLA_PASS_SHAPES = [
    ShapeSpec(B=2, T=300, H=4, Hg=2, K=16, V=32),  # grouped heads, a partial last chunk
    ShapeSpec(B=2, T=100, H=4, Hg=2, K=16, V=16, strong_decay=True),
    ShapeSpec(seqlens=(1, 63, 64, 65, 300), H=2, K=16, V=16, state_v_first=True),
    ShapeSpec(B=1, T=200, H=2, K=16, V=16, initial_state=False, dht=False),
]


def _segments_call(spec, segments: int):
    """An fp16 call of `spec` cut into `segments`: `(call, s, n_seg, pick, seg_call)`, the last
    the segments as one varlen call without states (pass 1's input)."""
    from gdr_dispatch.backends.split import passes as cp

    call = validate(**call_kwargs(make_inputs(replace(spec, dtype="float16", h="none"), "cpu", seed=4)))
    s, n_seg, seg_lens, pick = cp.segment_plan(call, segments)
    flat = {n: getattr(call, n).reshape(1, -1, *getattr(call, n).shape[2:]) for n in ("q", "k", "v", "a", "g", "b", "do")}
    offsets = torch.tensor([0] + seg_lens).cumsum(0).to(torch.int32)
    return call, s, n_seg, pick, validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=call.chunk_size)


def _assert_same_maps(got, want, K: int, pick):
    """A pass 1's `(M, R, D)` of the non-empty segments against the batched products' grid, to
    fp16 rounding (an exchanged or transposed map is off by O(1)). M is measured against the
    identity's size: composed over chunks it decays towards zero, and what the scan needs is
    M S for states of order one."""
    for g, w, what in zip(got, want, "MRD"):
        w = torch.stack([w[n, j] for n, j in pick]).float()
        assert g.shape == w.shape, what
        size = torch.eye(K).expand_as(w).norm() if what == "M" else w.norm()
        assert ((g - w).norm() / size).item() < 5e-3, what


@pytest.fixture
def fla_pass_1(monkeypatch):
    """The fla backend offers pass 1 on a CPU (its kernels are fake_fla's exact stand-ins; its
    own gate needs CUDA), and the calls to its state kernels are counted."""
    import fake_fla

    from gdr_dispatch.backends import fla_chain
    from gdr_dispatch.backends.common import fla_pipeline

    calls = fake_fla.install(monkeypatch)
    monkeypatch.setattr(fla_chain.FlaBackend, "split_passes", lambda self, p: fla_pipeline.segment_maps)
    return calls


@pytest.mark.parametrize("spec", FLA_PASS_SHAPES, ids=lambda s: s.label())
def test_fla_pass_1_composes_the_same_maps_as_the_torch_products(spec, fla_pass_1):
    """[M | R] from one state pass over [0 | u] started at [I | 0], D from the dh pass started at
    zero: the same maps as the batched products (`_assert_same_maps`)."""
    from gdr_dispatch.backends.split import passes as cp

    call, s, n_seg, pick, seg_call = _segments_call(spec, 3)
    name, maps = cp.pass_1_provider(seg_call)
    assert name == "fla"
    _assert_same_maps(maps(seg_call), cp._torch_pass_1(call, s, n_seg), call.K, pick)
    assert fla_pass_1.count("chunk_gated_delta_rule_fwd_h") == 1 and fla_pass_1.count("chunk_gated_delta_rule_bwd_dhu") == 1


def test_fla_pass_1_without_r_runs_k_columns_and_keeps_m_and_d(fla_pass_1, monkeypatch):
    """With `h` given the split needs no R: the state pass then runs over K value columns, not
    K + V, and M and D are the same maps."""
    from fla.ops.common import chunk_delta_h  # fake_fla's stand-in (the fixture installs it)

    from gdr_dispatch.backends.common import fla_pipeline

    spec = replace(FLA_PASS_SHAPES[0], dtype="float16", h="none")
    call = validate(**call_kwargs(make_inputs(spec, "cpu", seed=4)))
    widths = []
    inner = chunk_delta_h.chunk_gated_delta_rule_fwd_h
    monkeypatch.setattr(chunk_delta_h, "chunk_gated_delta_rule_fwd_h",
                        lambda **kw: widths.append(kw["u"].shape[-1]) or inner(**kw))
    m1, r1, d1 = fla_pipeline.segment_maps(call)
    m2, r2, d2 = fla_pipeline.segment_maps(call, need_r=False)
    assert widths == [call.K + call.V, call.K] and r1 is not None and r2 is None
    assert torch.equal(m1, m2) and torch.equal(d1, d2)


def test_fla_state_kernels_get_chunk_offsets_that_outlive_fla_cache(fla_pass_1, monkeypatch):
    """fla's state kernels get their varlen chunk offsets from us, as a device constant of the
    lengths (the same object call after call), never from fla's 4-entry tensor cache: a CUDA graph
    captured on a cached tensor reads freed memory once that cache moves on."""
    from fla.ops.common import chunk_delta_h  # fake_fla's stand-ins (the fixture installs them)

    from gdr_dispatch.backends.common import fla_pipeline

    spec = replace(FLA_PASS_SHAPES[2], dtype="float16", h="none")  # varlen 1/63/64/65/300
    call = validate(**call_kwargs(make_inputs(spec, "cpu", seed=4)))
    seen = []
    for name in ("chunk_gated_delta_rule_fwd_h", "chunk_gated_delta_rule_bwd_dhu"):
        inner = getattr(chunk_delta_h, name)
        monkeypatch.setattr(chunk_delta_h, name, lambda inner=inner, **kw: seen.append(kw.get("chunk_offsets"))
                            or inner(**kw))
    fla_pipeline.segment_maps(call)
    fla_pipeline.state_stages(call)
    fla_pipeline.segment_maps(call)
    want = [0, 1, 2, 3, 5, 10]  # chunks of 64 before each sequence of 1, 63, 64, 65, 300 tokens
    assert len(seen) == 6 and all(o is seen[0] for o in seen)
    assert seen[0].dtype == torch.int64 and seen[0].tolist() == want


@pytest.mark.parametrize("provider", ["fla", "gdr_dispatch"])
@pytest.mark.parametrize("h_mode", ["given", "none"])
@pytest.mark.parametrize("spec", FLA_PASS_SHAPES, ids=lambda s: s.label())
def test_split_with_each_pass_1_matches_the_oracle(spec, h_mode, provider, request, monkeypatch, caplog):
    """The whole split with pass 1 on fla's kernels (fake_fla's stand-ins) or on ours (forced:
    on a CPU they refuse), segments run by the torch backend: every gradient within fp16
    rounding of the float64 oracle, and the log names the provider."""
    from conftest import case, rel_errors

    from gdr_dispatch.backends.split import passes as cp

    if provider == "fla":
        calls = request.getfixturevalue("fla_pass_1")
    else:
        monkeypatch.setattr(cp, "_maps_kernels_refusal", lambda seg_call: "")
    clear_caches()
    monkeypatch.setenv("GDR_CP", "3")
    monkeypatch.setenv("GDR_BACKEND", "torch")
    kwargs, ref = case(replace(spec, dtype="float16", h=h_mode))
    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        errs = rel_errors(fused_gdr_bwd(**kwargs), ref)
    assert not {n: e for n, e in errs.items() if not e < 5e-3}, errs
    if provider == "fla":
        assert "chunk_gated_delta_rule_fwd_h" in calls
    said = "our decay-aware Triton kernels" if provider == "gdr_dispatch" else f"{provider}'s kernels, every segment exact"
    assert any("split pass 1" in r.getMessage() and said in r.getMessage() for r in caplog.records)
    # with h=None and our maps, pass 3's h comes from our state walk too (its backend takes h given)
    states = any("pass 3's chunk states" in r.getMessage() for r in caplog.records)
    assert states == (provider == "gdr_dispatch" and h_mode == "none")


def test_without_a_provider_pass_1_is_the_torch_products(caplog):
    from gdr_dispatch.backends.split import passes as cp

    call = validate(**call_kwargs(make_inputs(ShapeSpec(B=1, T=200, H=2, K=8, V=8, dtype="float64", h="none"), "cpu")))
    assert cp.pass_1_provider(call) == ("torch products", None)  # fla's own gate needs CUDA


# -- pass 2 as Triton kernels (backends/kernels/segment_scan.py; Triton's interpreter on the CPU) ------
def _reference_chain(lens_per_seq, plan, M, starts, ends, S0, G_end):
    """The chains step by step in float64 (segment_scan's module docstring)."""
    starts = None if starts is None else starts.clone()
    ends = None if ends is None else ends.clone()
    first = 0
    for n, count in enumerate(lens_per_seq):
        if count:
            if starts is not None:
                starts[first] = 0 if S0 is None else S0[n]
                for j in range(first, first + count - 1):
                    for h in range(M.shape[1]):
                        if plan[j, h, 0] == 0:
                            starts[j + 1, h] = M[j, h] @ starts[j, h] + starts[j + 1, h]
            if ends is None:
                first += count
                continue
            ends[first + count - 1] = 0 if G_end is None else G_end[n]
            for j in range(first + count - 1, first, -1):
                for h in range(M.shape[1]):
                    if plan[j, h, 0] == 0:
                        ends[j - 1, h] = M[j, h].T @ ends[j, h] + ends[j - 1, h]
        first += count
    return starts, ends


@pytest.mark.parametrize("K, V, counts", [(16, 16, (1,)), (16, 32, (3, 0, 2)), (32, 64, (5, 4)), (16, 16, (9, 2, 0)),
                                          (32, 48, (4, 3))])
@pytest.mark.parametrize("given", [True, False], ids=["states", "no_states"])
@pytest.mark.parametrize("starts_wanted, ends_wanted", [(True, True), (False, True), (True, False)],
                         ids=["h_none", "h_given", "forward"])
@pytest.mark.parametrize("how", ["serial", "prefetch", "prefix", "blocked", "blocked_by_3", "tma"])
def test_chain_kernel_equals_the_step_by_step_chain(K, V, counts, given, starts_wanted, ends_wanted, how,
                                                    monkeypatch):
    """The Triton chain (interpreted; serial, with each link's map loaded a step ahead, as the
    parallel prefix and blocked, and over the exact links only on TMA) and the torch chain against
    the chains step by step: exact links apply M, warm links keep pass 1's window, every sequence's
    first start and last end are its states; sequences of several, one and no segments."""
    from gdr_dispatch.backends.kernels import segment_scan
    from gdr_dispatch.backends.split import passes as cp

    monkeypatch.setattr(segment_scan, "PREFETCH", how == "prefetch")
    monkeypatch.setattr(segment_scan, "use_tma_chain", lambda device: how == "tma")
    if how == "prefix":  # whatever the device and the segment count
        monkeypatch.setattr(segment_scan, "use_prefix", lambda max_segments, device: True)
    if how.startswith("blocked"):  # groups as chosen, and of 3 (a group's inner positions filled in)
        monkeypatch.setattr(segment_scan, "use_prefix", lambda max_segments, device: False)
        monkeypatch.setattr(segment_scan, "use_blocked", lambda max_segments, device: True)
        if how == "blocked_by_3":
            monkeypatch.setattr(segment_scan, "group_size", lambda max_segments: 3)

    gen = torch.Generator().manual_seed(K + V + len(counts))
    S, H, N = sum(counts), 3, len(counts)
    M = torch.randn(S, H, K, K, generator=gen, dtype=torch.float64) / K ** 0.5
    starts = torch.randn(S, H, K, V, generator=gen, dtype=torch.float64) if starts_wanted else None
    ends = torch.randn(S, H, K, V, generator=gen, dtype=torch.float64) if ends_wanted else None
    plan = torch.randint(0, 2, (S, H, 1), generator=gen).repeat(1, 1, 2).int() * 3  # 0: exact, 3: warm
    plan[:, 0] = 0  # one head exact throughout: a chain as long as its sequence (every prefix level counts)
    S0 = torch.randn(N, H, K, V, generator=gen, dtype=torch.float64) if given else None
    G_end = torch.randn(N, H, K, V, generator=gen, dtype=torch.float64) if given else None
    want_s, want_e = _reference_chain(counts, plan, M, starts, ends, S0, G_end)
    offsets = tuple(itertools.accumulate((0,) + counts))
    f32 = (lambda x: None if x is None else x.float().clone())
    got_s, got_e = f32(starts), f32(ends)
    wide = torch.cat([f32(M), torch.zeros(S, H, K, V)], -1)  # M as a provider hands it over: a slice of [M | R]
    segment_scan.chain(wide[..., :K], got_s, got_e, plan, torch.tensor(offsets, dtype=torch.int32), max(counts),
                       f32(S0), f32(G_end), tf32=True)
    lens = tuple(64 * c for c in counts)  # segments of one chunk: the Segments of these counts
    segs = cp.segments_of(lens, 64, max(counts))
    assert segs.seg_offsets == offsets
    tor_s, tor_e = (None if starts is None else starts.clone()), (None if ends is None else ends.clone())
    cp._chain_torch(segs, plan, M, tor_s, tor_e, S0, G_end)
    for got, tor, want in ((got_s, tor_s, want_s), (got_e, tor_e, want_e)):
        if want is None:
            assert got is None and tor is None
            continue
        assert torch.allclose(tor, want, rtol=1e-12, atol=1e-12)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_chain_kernel_says_what_it_does_not_take():
    from gdr_dispatch.backends.kernels.segment_scan import not_supported_reason

    assert not_supported_reason(128, 128, torch.float32, torch.device("cuda")) == ""
    assert "CUDA" in not_supported_reason(128, 128, torch.float32, torch.device("cpu"))
    assert "float64" in not_supported_reason(128, 128, torch.float64, torch.device("cuda"))
    assert "K=8, V=16" in not_supported_reason(8, 16, torch.float32, torch.device("cuda"))
    assert "K=16, V=40" in not_supported_reason(16, 40, torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("spec", [ShapeSpec(B=1, T=1000, H=2, K=16, V=16, dtype="float32", h="none"),
                                  ShapeSpec(seqlens=(1, 63, 64, 65, 300), H=2, K=16, V=32, state_v_first=True,
                                            dtype="float32", h="none"),
                                  ShapeSpec(B=2, T=300, H=4, Hg=2, K=32, V=32, initial_state=False, dht=False,
                                            dtype="float32", h="none")],
                         ids=lambda s: s.label())
def test_split_on_the_chain_kernel_stays_within_rounding(spec, monkeypatch):
    """Pass 2 on the Triton chain (forced here; on a GPU it runs for fp32 maps) against the
    unsplit call, as `test_split_in_float32_stays_within_rounding` holds the torch scans."""
    import gdr_dispatch.backends.split.passes as cp
    from gdr_dispatch.backends.kernels import segment_scan

    used = []
    monkeypatch.setattr(cp, "_chain_kernels", lambda *a: used.append(a) or segment_scan)
    kwargs = call_kwargs(make_inputs(spec, "cpu", seed=5))
    whole = fused_gdr_bwd(**kwargs)
    monkeypatch.setenv("GDR_CP", "3")
    split = fused_gdr_bwd(**kwargs)
    assert used
    for name in whole._fields:
        a, b = getattr(split, name), getattr(whole, name)
        if b is None:
            assert a is None, name
            continue
        assert ((a - b).norm() / b.norm()).item() < 1e-5, name


def _compile_recorder(seen: list):
    """A backend that takes every call, runs none, and records the calls its `compile_jobs`
    gets (one job per call, naming its sequence count)."""
    from gdr_dispatch.registry import Backend

    class Recorder(Backend):
        name = "recorder"

        def not_supported_reasons(self, p):
            return []

        def run(self, call):
            raise AssertionError("not run")

        def compile_jobs(self, call):
            seen.append(call)
            return [("m", "f", (call.N,))]

    return Recorder()


def test_a_split_candidate_precompiles_the_inner_builds_of_its_segments_call():
    """A sweep precompiles `<backend>@split<n>` through the inner backend's `compile_jobs` on
    pass 3's call: the segments as one varlen call with both states (FlashQLA keys its kernels
    on those flags), not the unsplit call's."""
    seen = []
    spec = ShapeSpec(B=2, T=300, H=4, Hg=2, K=16, V=8, initial_state=False, dht=False, dtype="float32",
                     h="given", state_v_first=True)
    call = validate(**call_kwargs(make_inputs(spec, "cpu", seed=1)))
    jobs = SplitBackend(_compile_recorder(seen), 3).compile_jobs(call)
    assert jobs[0] == ("m", "f", (6,)) and [j[1] for j in jobs[1:]] == ["warm_passes"]  # and the split's own
    (seg,) = seen
    assert seg.B == 1 and seg.seq_lens == (128, 128, 44) * 2  # 5 chunks in runs of 2, 2, 1
    assert seg.initial_state.dtype == seg.dht.dtype == torch.float32 and seg.initial_state.shape == (6, 4, 8, 16)
    assert seg.h is not None and seg.state_v_first


def test_a_split_candidate_on_our_maps_precompiles_pass_3_with_h_given(monkeypatch):
    """With `h=None` and pass 1 on our kernels, pass 3 runs with `h` from our state walk: its
    precompile call carries an `h` of the segments' chunks (both state layouts), not None."""
    import gdr_dispatch.backends.split.passes as cp

    seen = []
    monkeypatch.setattr(cp, "_maps_kernels_refusal", lambda seg_call: "")
    for v_first in (False, True):
        spec = ShapeSpec(B=2, T=300, H=4, Hg=2, K=16, V=8, dtype="float16", h="none", state_v_first=v_first)
        SplitBackend(_compile_recorder(seen), 3).compile_jobs(validate(**call_kwargs(make_inputs(spec, "cpu", seed=1))))
        seg = seen[-1]
        assert seg.h is not None and seg.h.shape == ((1, 10, 4, 8, 16) if v_first else (1, 10, 4, 16, 8))
        assert seg.h.dtype == torch.float16 and seg.state_v_first == v_first
    monkeypatch.undo()
    SplitBackend(_compile_recorder(seen), 3).compile_jobs(validate(**call_kwargs(make_inputs(spec, "cpu", seed=1))))
    assert seen[-1].h is None  # on a CPU our maps refuse: the backend recomputes the states itself


@pytest.mark.parametrize("own", [False, True], ids=["split_writes_h", "backend_recomputes"])
def test_pass_3_leaves_h_none_to_a_backend_with_its_own_state_kernel(own, monkeypatch):
    """With `h=None` the split writes pass 3's `h` from the segments' start states (where its
    Triton maps ran pass 1), unless the backend recomputes the states in one kernel of its own
    (`Backend.own_state_recompute`: then it gets `h=None` and the start states as
    `initial_state`). The gradients are the unsplit call's either way."""
    import gdr_dispatch.backends.split.passes as cp
    from gdr_dispatch.registry import get_backend

    torch_backend = get_backend("torch")
    walked = []

    def walk(call, seg_call, provider):  # the Triton walk's stand-in: records, leaves h=None
        return lambda init: walked.append(init)

    monkeypatch.setattr(cp, "_states_kernel", walk)
    spec = ShapeSpec(B=2, T=300, H=4, Hg=2, K=16, V=8, dtype="float64", h="none")
    call = validate(**call_kwargs(make_inputs(spec, "cpu", seed=3)))
    seen = []

    class Inner(type(torch_backend)):
        name = "inner"

        def own_state_recompute(self):
            return own

        def run(self, c):
            seen.append(c.h)
            return super().run(c)

    got = SplitBackend(Inner(), 3).run(call)  # (the torch backend recomputes h either way)
    want = torch_backend.run(call)
    assert seen == [None] and len(walked) == (0 if own else 1)
    for name in want._fields:
        if getattr(want, name) is not None:
            assert torch.allclose(getattr(got, name), getattr(want, name), rtol=1e-9, atol=1e-10), name


def test_the_chain_kernel_waits_for_its_gpu_tests(monkeypatch):
    """Until its GPU tests pass (segment_scan.GPU_VERIFIED) the split keeps the torch chain on
    CUDA unless GDR_ALLOW_UNVERIFIED is set (the GPU tests set it), and says why; once verified
    it runs on CUDA for fp32 maps without it."""
    import gdr_dispatch.backends.split.passes as cp
    from gdr_dispatch.backends.kernels import segment_scan

    cuda = torch.device("cuda")
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    monkeypatch.setattr(segment_scan, "GPU_VERIFIED", True)
    assert cp._chain_kernels_refusal(128, 128, torch.float32, cuda) == ""
    assert cp._chain_kernels(128, 128, torch.float32, cuda) is segment_scan
    monkeypatch.setattr(segment_scan, "GPU_VERIFIED", False)
    why = cp._chain_kernels_refusal(128, 128, torch.float32, cuda)
    assert "not verified on a GPU" in why and "GDR_ALLOW_UNVERIFIED=1" in why
    assert cp._chain_kernels(128, 128, torch.float32, cuda) is None
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert cp._chain_kernels_refusal(128, 128, torch.float32, cuda) == ""
    assert "float64" in cp._chain_kernels_refusal(128, 128, torch.float64, cuda)
    assert cp._chain_kernels_refusal(128, 128, torch.float32, torch.device("cpu")) == "not on CUDA"


@pytest.mark.parametrize("lens,segments", [((300, 300), 3), ((1, 63, 64, 65, 300, 0), 3)], ids=["full", "ragged"])
def test_segments_know_their_sequences_and_places(lens, segments):
    """The plan of segments: runs of whole chunks in order, each sequence's range of them (none for
    a sequence of no tokens), and the roles the chains read (first, last)."""
    from gdr_dispatch.backends.split import passes as cp

    segs = cp.segments_of(lens, 64, segments)
    assert sum(segs.lens) == sum(lens)
    for n, length in enumerate(lens):
        mine = range(segs.seg_offsets[n], segs.seg_offsets[n + 1])
        assert sum(segs.lens[j] for j in mine) == length
        assert [segs.place[j] for j in mine] == list(range(len(mine)))
        assert all(segs.seq[j] == n for j in mine)
        for j in mine:
            assert segs.roles[j] == (j == mine[0]) | ((j == mine[-1]) << 1)
            assert segs.lens[j] == min(segs.s * 64, length - segs.place[j] * segs.s * 64)
    assert segs.firsts == (tuple(segs.seg_offsets[n] for n in range(len(lens)) if lens[n]),
                           tuple(n for n in range(len(lens)) if lens[n]))


# -- pass 1 as Triton kernels (backends/kernels/segment_maps.py; Triton's interpreter on the CPU) -----
@pytest.mark.parametrize("walks", WALKS)
@pytest.mark.parametrize("spec", FLA_PASS_SHAPES, ids=lambda s: s.label())
def test_triton_pass_1_composes_the_same_maps_as_the_torch_products(spec, walks, monkeypatch):
    """Our kernels' [M | R] (the state walk from [I | 0]) and D (the dh walk from zero) against
    the batched products (`_assert_same_maps`), the walks forming each chunk, reading `_factors`'
    chunks, or reading them with TMA. Without `need_r` R is None and M, D are the same."""
    from gdr_dispatch.backends.split import passes as cp
    from gdr_dispatch.backends.kernels import segment_maps as sm
    from gdr_dispatch.backends.kernels.segment_maps import segment_maps

    set_walks(monkeypatch, walks)
    call, s, n_seg, pick, seg_call = _segments_call(spec, 3)
    assert sm.use_factors(seg_call, True, True) == (walks != "form")
    assert sm.use_tma_walks(seg_call) == (walks == "tma")
    got = segment_maps(seg_call)
    _assert_same_maps(got, cp._torch_pass_1(call, s, n_seg), call.K, pick)
    m, r, d = segment_maps(seg_call, need_r=False)
    assert r is None and torch.equal(m, got[0]) and torch.equal(d, got[2])


def test_the_walks_read_factors_only_once_verified_and_within_their_memory_bound(monkeypatch):
    """`segment_maps.use_factors`: not before the factors' GPU tests pass (unless
    GDR_ALLOW_UNVERIFIED=1), never with `FACTORS` off, nor where the buffers would pass
    `FACTOR_BYTES_MAX` (bf16 [NT, H, 64, 128] tiles: W, with R U0, with D X)."""
    from gdr_dispatch.backends.kernels import segment_maps as sm
    from gdr_dispatch.backends.split import passes as cp

    _, _, _, _, seg_call = _segments_call(FLA_PASS_SHAPES[1], 3)
    assert seg_call.K == seg_call.V
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    monkeypatch.setattr(sm, "FACTORS", True)
    monkeypatch.setattr(sm, "FACTORS_GPU_VERIFIED", True)
    assert sm.use_factors(seg_call, True, True)  # verified: on without the variable
    monkeypatch.setattr(sm, "FACTORS_GPU_VERIFIED", False)
    assert not sm.use_factors(seg_call, True, True)
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert sm.use_factors(seg_call, True, True)
    per_chunk = seg_call.H * 64 * seg_call.K * seg_call.k.element_size()  # one [64, K] tile per head
    chunks = sum(-(-n // 64) for n in seg_call.seq_lens)
    monkeypatch.setattr(sm, "FACTOR_BYTES_MAX", chunks * per_chunk * 3 - 1)  # K == V: three tiles with R and D
    assert not sm.use_factors(seg_call, True, True) and sm.use_factors(seg_call, False, True)
    monkeypatch.setattr(sm, "FACTOR_BYTES_MAX", chunks * per_chunk * 3)
    assert sm.use_factors(seg_call, True, True)
    monkeypatch.setattr(sm, "FACTORS", False)
    assert not sm.use_factors(seg_call, False, False)
    # U0's V columns are one tile: a V that is no power of two walks forming its chunks, as ever
    monkeypatch.setattr(sm, "FACTORS", True)
    call, s, n_seg, pick, odd = _segments_call(ShapeSpec(seqlens=(1, 63, 64, 65, 300), H=2, K=16, V=48), 3)
    assert not sm.use_factors(odd, True, True)
    _assert_same_maps(sm.segment_maps(odd), cp._torch_pass_1(call, s, n_seg), call.K, pick)


def test_triton_pass_1_waits_for_its_gpu_tests_and_says_what_it_does_not_take(monkeypatch):
    """Until their GPU tests pass (segment_maps.GPU_VERIFIED) the split keeps fla's kernels or the
    torch products unless GDR_ALLOW_UNVERIFIED is set, and every refusal says why."""
    from gdr_dispatch.backends.split import passes as cp
    from gdr_dispatch.backends.kernels import segment_maps

    _, _, _, _, seg_call = _segments_call(FLA_PASS_SHAPES[0], 3)
    cuda = replace(seg_call, q=torch.empty(seg_call.q.shape, dtype=torch.float16, device="meta"))
    monkeypatch.setattr(segment_maps, "not_supported_reason",
                        lambda K, V, dtype, bt, dev: segment_maps._call_reason(K, V, dtype, bt))  # as if on CUDA
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    monkeypatch.setattr(segment_maps, "GPU_VERIFIED", False)
    why = cp._maps_kernels_refusal(cuda)
    assert "not verified on a GPU" in why and "GDR_ALLOW_UNVERIFIED=1" in why
    assert cp.pass_1_provider(cuda)[0] != "gdr_dispatch"
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert cp._maps_kernels_refusal(cuda) == ""
    assert cp.pass_1_provider(cuda) == ("gdr_dispatch", segment_maps.segment_maps)
    monkeypatch.undo()
    reason = segment_maps.not_supported_reason
    assert reason(128, 128, torch.bfloat16, 64, torch.device("cuda")) == ""
    assert "CUDA" in reason(128, 128, torch.bfloat16, 64, torch.device("cpu"))
    assert "float32" in reason(128, 128, torch.float32, 64, torch.device("cuda"))
    assert "chunk_size=32" in reason(128, 128, torch.float16, 32, torch.device("cuda"))
    assert "K=128, V=256" in reason(128, 256, torch.float16, 64, torch.device("cuda"))
    assert reason(128, 256, torch.float32, 64, torch.device("cpu")).count(";") == 2  # all three reasons at once
    with pytest.raises(ValueError, match="float32"):
        segment_maps.segment_maps(replace(seg_call, q=seg_call.q.float()))


@pytest.mark.parametrize("spec", [ShapeSpec(seqlens=(1, 63, 64, 65, 200), H=4, Hg=2, K=16, V=32),
                                  ShapeSpec(seqlens=(130, 64), H=2, K=32, V=16, state_v_first=True),
                                  ShapeSpec(B=2, T=100, H=4, Hg=2, K=16, V=16, strong_decay=True)],
                         ids=lambda s: s.label())
def test_triton_states_are_the_chunk_start_states(spec):
    """`segment_states` walks each sequence of a call (varlen or not) from its start state and
    writes every chunk's start state in the contract's `h` layout (both state layouts): the `h`
    that make_inputs computes in float64, to fp16 rounding."""
    from gdr_dispatch.backends.kernels.segment_maps import segment_states

    x = make_inputs(replace(spec, dtype="float16", h="given"), "cpu", seed=6)
    call = validate(**{**call_kwargs(x), "h": None})
    init = cm.states_in(call.initial_state, call.state_v_first).float()
    h = segment_states(call, init, call.state_v_first)
    assert h.shape == x["h"].shape and h.dtype == torch.float16
    err = ((h.double() - x["h"].double()).norm() / x["h"].double().norm()).item()
    assert err < 5e-3, err


# -- the decay-aware split: warm-up windows where the decay underflows, exact maps elsewhere -------
DECAY_SHAPES = [
    ShapeSpec(B=1, T=640, H=4, Hg=2, K=16, V=16),  # 10 chunks, 2 segments of 5
    ShapeSpec(seqlens=(1, 63, 64, 65, 700), H=2, K=16, V=16, state_v_first=True),
    ShapeSpec(B=2, T=500, H=2, K=16, V=8, initial_state=False, dht=False),
]


def _plan_of(call, segments: int):
    from gdr_dispatch.backends.split import passes as cp

    segs = cp.segments_of(tuple(call.seq_lens), call.chunk_size, segments)
    plan, M, starts, ends = cp._torch_pieces(call, segs, need_starts=True)
    return segs, plan


@pytest.mark.parametrize("gate", ["uniform", "logsigmoid", "mixed"])
@pytest.mark.parametrize("h_mode", ["given", "none"])
@pytest.mark.parametrize("spec", DECAY_SHAPES, ids=lambda s: s.label())
def test_the_decay_aware_split_equals_unsplit_in_float64(spec, h_mode, gate, monkeypatch):
    """Segments whose decay underflows float64 (summed log decay below ln(2^-53)) start from a
    warm-up over their predecessor's last chunks, the others through the exact maps: the
    gradients are the unsplit call's to 1e-10, and partial windows are really taken."""
    kwargs = call_kwargs(make_inputs(replace(spec, dtype="float64", h=h_mode, gate=gate), "cpu", seed=8))
    call = validate(**kwargs)
    segs, plan = _plan_of(call, 2)
    nc = torch.tensor([-(-n // 64) for n in segs.lens])[:, None]
    partial = ((plan[..., 0] > 0) & (plan[..., 0] < nc)).any().item()
    if gate != "mixed" and spec.T >= 500:
        assert partial, plan[..., 0]
    assert_split_equals_whole(kwargs, 2, 1e-10, monkeypatch)


def test_a_loose_threshold_is_seen_in_the_gradients(monkeypatch):
    """The check above can fail: warm-ups cut at e^-3 instead of below float64's rounding leave
    their dropped term in the gradients."""
    from gdr_dispatch.backends.split import passes as cp

    spec = ShapeSpec(B=1, T=640, H=2, K=16, V=16, dtype="float64", h="none", gate="logsigmoid16")
    kwargs = call_kwargs(make_inputs(spec, "cpu", seed=8))
    whole = fused_gdr_bwd(**kwargs)
    monkeypatch.setenv("GDR_CP", "2")
    monkeypatch.setattr(cp, "threshold", lambda acc: -3.0)
    split = fused_gdr_bwd(**kwargs)
    worst = max(((getattr(split, n) - getattr(whole, n)).norm() / getattr(whole, n).norm()).item()
                for n in ("dq", "dk", "dv", "dg", "db"))
    assert worst > 1e-6, worst


@pytest.mark.parametrize("gate", ["uniform", "logsigmoid", "logsigmoid16", "mixed"])
def test_the_decay_aware_split_in_float32_stays_within_rounding(gate, monkeypatch):
    """Warm-ups drop terms below fp32's rounding and the exact maps only shrink (decay <= 1, the
    delta rule's projection), so fp32 holds."""
    spec = ShapeSpec(B=1, T=1000, H=4, K=16, V=16, dtype="float32", h="none", gate=gate)
    assert_split_equals_whole(call_kwargs(make_inputs(spec, "cpu", seed=5)), 4, 1e-5, monkeypatch)


def _hostile_keys(spec, tokens, factor: float, seed: int = 8):
    """`spec`'s inputs with the keys of `tokens` scaled by `factor` (b |k|^2 far above 2: those
    transitions grow the state), residuals recomputed."""
    from gdr_dispatch.reference import prepare_residuals

    x = make_inputs(spec, "cpu", seed=seed)
    k = x["k"].clone()
    k[:, list(tokens)] *= factor
    beta = x["b"].clone()
    beta[:, list(tokens)] = 1.0
    res = prepare_residuals(x["q"], k, x["v"], x["g_raw"], beta, initial_state=x["initial_state"],
                            cu_seqlens=x["cu_seqlens"], chunk_size=spec.chunk_size, state_v_first=spec.state_v_first)
    out = {**call_kwargs(x), "k": k, "b": beta, "a": res.a, "g": res.g}
    out["h"] = None if x["h"] is None else res.h.to(x["h"].dtype)
    return out


def test_keys_that_break_the_contraction_are_joined_exactly(monkeypatch):
    """A window holding a token with b |k|^2 > 2 (its transition grows the state, so the decay
    alone no longer bounds the dropped term) is not trusted: the plan joins that segment exactly
    where the decay alone would have warmed it up, and the split equals the unsplit call."""
    from gdr_dispatch.backends.split import passes as cp

    spec = ShapeSpec(B=1, T=640, H=2, K=16, V=16, dtype="float64", h="none")
    kwargs = _hostile_keys(spec, (258, 270, 281, 300, 310, 318), 40.0)
    call = validate(**kwargs)
    segs, plan = _plan_of(call, 2)
    assert (plan[0, :, 0] == 0).all() and (plan[1, :, 0] > 0).all(), plan  # segment 0's window holds them
    real = cp._windows
    monkeypatch.setattr(cp, "_windows", lambda gend, r, bad, *rest: real(gend, r, torch.zeros_like(bad), *rest))
    assert (_plan_of(call, 2)[1][0, :, 0] > 0).all()  # the decay alone would warm segment 0 up
    monkeypatch.undo()
    assert_split_equals_whole(kwargs, 2, 1e-10, monkeypatch)


def _rising_gate(spec, seed: int = 3):
    """`spec`'s inputs with one chunk of positive log decays (g = +0.5 a token: the state grows by
    e^32) between decaying ones, residuals recomputed: chunk 2 alone sums to -19, below fp32's
    rounding, though the state it starts from is e^32 larger than usual."""
    from gdr_dispatch.reference import prepare_residuals

    x = make_inputs(spec, "cpu", seed=seed)
    g = torch.full_like(x["g_raw"], -0.1)
    g[:, 0:64], g[:, 64:128], g[:, 128:192] = -0.5, 0.5, -0.3
    res = prepare_residuals(x["q"], x["k"], x["v"], g, x["b"], initial_state=x["initial_state"],
                            cu_seqlens=x["cu_seqlens"], chunk_size=spec.chunk_size, state_v_first=spec.state_v_first)
    return {**call_kwargs(x), "a": res.a.to(x["a"].dtype), "g": res.g.to(x["g"].dtype)}


def test_a_rising_log_decay_joins_its_head_exactly(monkeypatch):
    """A positive log decay (g > 0, which the contract's math allows) grows the state, so a window's
    summed decay no longer bounds the dropped term: every segment of that (sequence, head) is joined
    exactly, and the split equals the unsplit call chunk by chunk (a warm-up there was 100 % off in
    the chunk after the window)."""
    spec = ShapeSpec(B=1, T=384, H=2, K=16, V=16, dtype="float32", h="none")
    kwargs = _rising_gate(spec)
    segs, plan = _plan_of(validate(**kwargs), 2)
    assert (plan == 0).all(), plan
    whole = fused_gdr_bwd(**kwargs)
    monkeypatch.setenv("GDR_CP", "2")
    split = fused_gdr_bwd(**kwargs)
    for name in ("dq", "dk", "dv", "dg", "db"):
        a, b = getattr(split, name), getattr(whole, name)
        for t0 in range(0, 384, 64):
            part = (slice(None), slice(t0, t0 + 64))
            assert ((a[part] - b[part]).norm() / b[part].norm()).item() < 1e-4, (name, t0)


# -- the decay-aware pass 1 as Triton kernels (Triton's interpreter on the CPU) ------------------
PIECES_SHAPES = [
    ShapeSpec(B=1, T=640, H=4, Hg=2, K=16, V=32, gate="logsigmoid"),
    ShapeSpec(seqlens=(1, 63, 64, 65, 700), H=2, K=16, V=16, gate="mixed"),
    ShapeSpec(B=2, T=500, H=2, K=32, V=16, strong_decay=True),
]


#: the plan kernel's forms: one program per (segment, head); spread over programs of PLAN_CHUNKS
#: chunks (2: a chunk's program sees a window's other chunk elsewhere; 1: as many programs as
#: chunks); each finished by `_plan_combine`
PLAN_FORMS = {"one_program": (False, 2), "spread_2_chunks": (True, 2), "spread_1_chunk": (True, 1)}


def set_plan_form(monkeypatch, form: str) -> None:
    from gdr_dispatch.backends.kernels import segment_maps

    spread, chunks = PLAN_FORMS[form]
    monkeypatch.setattr(segment_maps, "PLAN_SPREAD", spread)
    monkeypatch.setattr(segment_maps, "PLAN_CHUNKS", chunks)


def _pieces_call(spec, segments: int, **kw):
    from gdr_dispatch.backends.split import passes as cp

    x = _hostile_keys(replace(spec, dtype="float16", h="none"), **kw) if kw else \
        call_kwargs(make_inputs(replace(spec, dtype="float16", h="none"), "cpu", seed=4))
    call = validate(**x)
    segs = cp.segments_of(tuple(call.seq_lens), 64, segments)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    return call, segs, validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)


@pytest.mark.parametrize("form", list(PLAN_FORMS))
def test_a_nan_key_in_a_window_joins_its_segment_exactly(form, monkeypatch):
    """A NaN key (or beta) inside a warm-up window is no contraction either: that segment is joined
    exactly, so the NaN reaches what follows as in the unsplit call, in the kernel plan (each
    form) and the tensor rule alike."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    set_plan_form(monkeypatch, form)
    spec = ShapeSpec(B=1, T=640, H=2, K=16, V=16, dtype="float16", h="none")
    x = call_kwargs(make_inputs(spec, "cpu", seed=8))
    x["k"] = x["k"].clone()
    x["k"][:, 300] = float("nan")  # in segment 0's last chunk: inside any forward window it has
    call = validate(**x)
    segs, plan = _plan_of(call, 2)
    assert (plan[0, :, 0] == 0).all() and (plan[1, :, 0] > 0).all(), plan
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
    assert torch.equal(segment_maps.decay_plan(seg_call, cp.threshold(torch.float32), segs), plan)


@pytest.mark.parametrize("form", list(PLAN_FORMS))
def test_decay_plan_kernel_joins_a_rising_head_exactly(form, monkeypatch):
    """The plan kernel, as the tensor rule: a (sequence, head) whose log decay rises anywhere has
    every segment exact, the other sequence's heads keep their windows (in each form: the rise
    lies in one program's chunks, the sequence's other segments are zeroed by the combine)."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    set_plan_form(monkeypatch, form)
    spec = ShapeSpec(seqlens=(384, 640), H=2, K=16, V=16, dtype="float16", h="none")
    kwargs = _rising_gate(spec)  # tokens 64-127: inside the first sequence only
    call = validate(**kwargs)
    segs = cp.segments_of(tuple(call.seq_lens), 64, 4)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
    got = segment_maps.decay_plan(seg_call, cp.threshold(torch.float32), segs)
    want = cp._torch_pieces(call, segs, need_starts=True)[0]
    assert torch.equal(got, want), (got[..., 0], want[..., 0])
    first = torch.tensor([n == 0 for n in segs.seq])
    assert (got[first] == 0).all() and (got[~first][..., 0] > 0).any(), got


@pytest.mark.parametrize("form", list(PLAN_FORMS))
@pytest.mark.parametrize("hostile", [False, True], ids=["normalised_keys", "growing_keys"])
@pytest.mark.parametrize("spec", PIECES_SHAPES, ids=lambda s: s.label())
def test_decay_plan_kernel_follows_the_tensor_rule(spec, hostile, form, monkeypatch):
    """`segment_maps.decay_plan` (the warm-up windows per segment and head, 0 where exact) is
    `passes._windows`' rule: the same plan, and windows that are really partial somewhere; in
    each of the kernel's forms (`PLAN_FORMS`)."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    set_plan_form(monkeypatch, form)
    kw = dict(tokens=(250, 251, 252, 253), factor=8.0) if hostile else {}
    call, segs, seg_call = _pieces_call(spec, 3, **kw)
    assert segment_maps.plan_spread(seg_call.q.device) == PLAN_FORMS[form][0]
    want = cp._torch_pieces(call, segs, need_starts=True)[0]
    got = segment_maps.decay_plan(seg_call, cp.threshold(torch.float32), segs)
    assert torch.equal(got, want), (got[..., 0], want[..., 0])
    if spec.gate != "mixed":
        assert (want[..., 0] > 0).any() and (want[..., 0] == 0).any() if hostile else (want[..., 0] > 0).any()


@pytest.mark.parametrize("form", list(PLAN_FORMS))
def test_decay_plan_kernel_checks_every_chunk_of_a_long_first_window(form, monkeypatch):
    """Keys that break the contraction inside a segment's first (backward) window, four chunks in
    and outside its last window, make that segment exact in the tensor rule and in each kernel
    form: the spread forms check that chunk in a program other than the window's first."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    set_plan_form(monkeypatch, form)
    spec = ShapeSpec(B=1, T=2560, H=2, K=16, V=16, dtype="float16", h="none", gate="logsigmoid16")
    plain = validate(**call_kwargs(make_inputs(spec, "cpu", seed=8)))
    segs, before = _plan_of(plain, 3)  # 14-chunk segments, windows of ~6 chunks
    first = segs.s * 64  # segment 1's first token
    assert (before[1, :, 1] >= 5).all() and (before[1, :, 0] <= segs.s - 5).all(), before
    call = validate(**_hostile_keys(spec, tokens=tuple(range(first + 3 * 64 + 10, first + 3 * 64 + 14)), factor=8.0))
    segs, want = _plan_of(call, 3)
    assert (want[1] == 0).all() and torch.equal(want[[0, 2]], before[[0, 2]]), (before, want)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
    got = segment_maps.decay_plan(seg_call, cp.threshold(torch.float32), segs)
    assert torch.equal(got, want), (got, want)


#: segments of 3 chunks (192 tokens), their gate changing by segment (`edge_gate_inputs`): a
#: sequence of 6 segments (its last partial) and a pack with a 2-segment sequence, a 1-token one
#: and a 5-segment one
EDGE_SHAPES = [
    ShapeSpec(B=1, T=1100, H=2, K=16, V=16),
    ShapeSpec(seqlens=(384, 1, 900), H=4, Hg=2, K=16, V=16, state_v_first=True),
]


def _edge_plan_checks(call, segs, plan) -> None:
    """Where `edge_gate_inputs`' windows must lie: an even segment (weak) reaches one chunk past
    each of its ends where its sequence goes on both ways, an odd one (strong) keeps one chunk."""
    nc = [-(-n // 64) for n in segs.lens]
    crossed = 0
    for j, (role, place) in enumerate(zip(segs.roles, segs.place)):
        if role:  # a sequence's first or last: no neighbour on one side, exact where even
            continue
        want = (nc[j] + 1, nc[j] + 1) if place % 2 == 0 else (1, 1)
        assert tuple(plan[j, 0].tolist()) == want, (j, plan[j])
        crossed += place % 2 == 0
    assert crossed, plan


@pytest.mark.parametrize("h_mode", ["given", "none"])
@pytest.mark.parametrize("spec", EDGE_SHAPES, ids=lambda s: s.label())
def test_windows_reach_into_neighbouring_segments_in_float64(spec, h_mode, monkeypatch):
    """A weakly decaying segment between strongly decaying ones warms up over a chunk of each
    neighbour (its own chunks alone do not pass the threshold): the plan says so, the split equals
    the unsplit call to 1e-10, and with windows kept inside their segments those segments are
    exact instead."""
    from gdr_dispatch.backends.kernels import segment_maps

    kwargs = edge_gate_inputs(replace(spec, dtype="float64", h=h_mode), 192)
    call = validate(**kwargs)
    segs, plan = _plan_of(call, 6)
    assert segs.s == 3
    _edge_plan_checks(call, segs, plan)
    assert_split_equals_whole(kwargs, 6, 1e-10, monkeypatch)
    monkeypatch.setattr(segment_maps, "CROSS", 0)
    inner = _plan_of(call, 6)[1]
    even = torch.tensor([p % 2 == 0 and not r for p, r in zip(segs.place, segs.roles)])
    assert (inner[even] == 0).all() and torch.equal(inner[~even], plan[~even]), (inner, plan)


@pytest.mark.parametrize("walks", ["form", "factors", "tma"])
@pytest.mark.parametrize("need_starts, need_ends", [(True, True), (False, True), (True, False)],
                         ids=["h_none", "h_given", "forward"])
@pytest.mark.parametrize("spec", EDGE_SHAPES, ids=lambda s: s.label())
def test_windows_into_neighbouring_segments_on_the_kernels(spec, need_starts, need_ends, walks, monkeypatch):
    """The plan kernel forms the windows that reach past their segment (each form), and the walks
    run them over the neighbours' chunks (the factors formed for those chunks too, the backward
    walk's masks at the sequence's end, not the segment's) to fp16 rounding of the tensor
    products, where those chunks weigh fully."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    x = edge_gate_inputs(replace(spec, dtype="float16", h="none"), 192)
    call = validate(**x)
    segs = cp.segments_of(tuple(call.seq_lens), 64, 6)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
    plan, M, starts, ends = cp._torch_pieces(call, segs, need_starts=need_starts)
    _edge_plan_checks(call, segs, plan)
    for form in PLAN_FORMS:
        set_plan_form(monkeypatch, form)
        got = segment_maps.decay_plan(seg_call, cp.threshold(torch.float32), segs)
        assert torch.equal(got, plan), (form, got, plan)
    set_walks(monkeypatch, walks)
    roles = torch.tensor(segs.roles, dtype=torch.int32)
    got = segment_maps.segment_pieces(seg_call, plan, roles, need_starts, need_ends, segs.s)
    checked, _ = _compare_pieces(segs, call.H, plan, got, (M, starts, ends), need_starts, need_ends)
    assert checked


def test_windows_reach_past_their_segment_on_a_gpu_only_once_verified(monkeypatch):
    from gdr_dispatch.backends.kernels import segment_maps as sm

    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    monkeypatch.setattr(sm, "CROSS_GPU_VERIFIED", False)
    assert sm.CROSS >= 1
    assert sm.window_reach(torch.device("cuda")) == 0 and sm.window_reach(torch.device("cpu")) == sm.CROSS
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert sm.window_reach(torch.device("cuda")) == sm.CROSS
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED")
    monkeypatch.setattr(sm, "CROSS_GPU_VERIFIED", True)
    assert sm.window_reach(torch.device("cuda")) == sm.CROSS


def test_a_window_is_capped_where_the_exact_join_costs_less():
    """At most CROSS segments past its own, and no more chunks than its own segment's plus
    LINK_CHUNKS per link of the longest chain: a warm-up longer than that walks more steps than
    the exact join's walk and chain."""
    from gdr_dispatch.backends.kernels import segment_maps as sm

    from gdr_dispatch.backends.split import passes as cp

    assert sm.window_cap(16, 32, 2) == 48  # 32 segments of 16 chunks: 31 links
    assert sm.window_cap(16, 8, 2) == 16 + int(sm.LINK_CHUNKS * 7)  # 8 segments: 7 links
    assert sm.window_cap(32, 32, 2) == 32 + int(sm.LINK_CHUNKS * 31)
    assert cp.segments_of((256, 512), 64, 2).max_per_sequence == 2  # a pack: its longest chain
    assert sm.window_cap(4, 2, 2) == 4 + int(sm.LINK_CHUNKS)
    assert sm.window_cap(16, 1, 2) == 16  # one segment: nothing to reach


def test_a_capped_window_leaves_its_segment_exact(monkeypatch):
    """The cap in the tensor rule and the plan kernel alike: the even segments' windows (one chunk
    past their own of 3 each way) are exact once the cap is below 4 chunks."""
    from gdr_dispatch.backends.kernels import segment_maps as sm
    from gdr_dispatch.backends.split import passes as cp

    x = edge_gate_inputs(ShapeSpec(B=1, T=1100, H=2, K=16, V=16, dtype="float16", h="none"), 192)
    call = validate(**x)
    segs = cp.segments_of((1100,), 64, 6)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
    wide = cp._torch_pieces(call, segs, need_starts=True)[0]
    monkeypatch.setattr(sm, "window_cap", lambda max_chunks, most_segments, cross: 3)
    want = cp._torch_pieces(call, segs, need_starts=True)[0]
    even = torch.tensor([p % 2 == 0 and not r for p, r in zip(segs.place, segs.roles)])
    assert (wide[even] == 4).all() and (want[even] == 0).all() and torch.equal(want[~even], wide[~even]), want
    got = sm.decay_plan(seg_call, cp.threshold(torch.float32), segs)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("form", list(PLAN_FORMS))
def test_a_broken_key_in_a_neighbours_chunk_makes_the_window_exact(form, monkeypatch):
    """Keys that break the contraction in the chunk an even segment's backward window borrows from
    the next segment make that segment exact (and the next one, whose own window holds them), in
    the tensor rule and in each kernel form."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    set_plan_form(monkeypatch, form)
    x = edge_gate_inputs(ShapeSpec(B=1, T=1100, H=2, K=16, V=16, dtype="float16", h="none"), 192)
    segs = cp.segments_of((1100,), 64, 6)
    clean = cp._torch_pieces(validate(**x), segs, need_starts=True)[0]
    tokens = list(range(3 * 192 + 10, 3 * 192 + 14))  # segment 3's first chunk
    x["k"], x["b"] = x["k"].clone(), x["b"].clone()
    x["k"][:, tokens] *= 8.0
    x["b"][:, tokens] = 1.0
    call = validate(**x)
    want = cp._torch_pieces(call, segs, need_starts=True)[0]
    assert clean[2, 0, 1] == 4 and (want[2:4] == 0).all(), want
    assert torch.equal(want[[0, 1, 4, 5]], clean[[0, 1, 4, 5]]), (clean, want)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
    got = segment_maps.decay_plan(seg_call, cp.threshold(torch.float32), segs)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("walks", ["factors", "tma"])
def test_the_factors_cover_every_chunk_a_window_reaches(walks, monkeypatch):
    """A window that reaches past its neighbour's own window (not a plan `decay_plan` forms where
    log decays never rise, but one the walks must take: `_visits` looks at the neighbours' windows
    too) reads factors formed for every chunk it walks: the factored walks equal the walks that
    form their chunks themselves."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    x = edge_gate_inputs(ShapeSpec(B=1, T=1100, H=2, K=16, V=16, dtype="float16", h="none"), 192)
    call = validate(**x)
    segs = cp.segments_of(tuple(call.seq_lens), 64, 6)
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
    plan = cp._torch_pieces(call, segs, need_starts=True)[0].clone()
    assert plan[1, 0, 0] == 1 and plan[3, 0, 1] == 1  # the neighbours' own windows: one chunk
    plan[2] = 5  # two chunks into each neighbour
    roles = torch.tensor(segs.roles, dtype=torch.int32)
    set_walks(monkeypatch, walks)
    _, starts, ends = segment_maps.segment_pieces(seg_call, plan, roles, True, True, segs.s)
    set_walks(monkeypatch, "form")
    _, want_starts, want_ends = segment_maps.segment_pieces(seg_call, plan, roles, True, True, segs.s)
    for got, want in ((starts[3], want_starts[3]), (ends[1], want_ends[1])):
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 5e-3


#: shapes whose 4-5 chunk segments are exact for some heads and warm for others
WEAK_PIECES_SHAPES = [
    ShapeSpec(seqlens=(1, 63, 64, 65, 700), H=4, Hg=2, K=16, V=32, gate="logsigmoid16"),
    ShapeSpec(B=2, T=900, H=2, K=16, V=16, gate="mixed"),
]


@pytest.mark.parametrize("walk_pieces, walks", [(1, "form"), (1, "factors"), (1, "tma"), (3, "form")],
                         ids=["walks_whole", "walks_whole_on_factors", "walks_whole_on_tma", "walks_in_3_pieces"])
@pytest.mark.parametrize("need_starts, need_ends", [(True, True), (False, True), (True, False)],
                         ids=["h_none", "h_given", "forward"])
@pytest.mark.parametrize("spec", PIECES_SHAPES + WEAK_PIECES_SHAPES, ids=lambda s: s.label())
def test_pieces_kernels_equal_the_tensor_products(spec, need_starts, need_ends, walk_pieces, walks, monkeypatch):
    """`segment_pieces` on a plan: every segment's warm-up window or exact map where the chains
    read them (starts[j] for j not first, ends[j] for j not last, M[j] where exact), to fp16
    rounding of the tensor products (the same windows: zero maps outside them); the exact
    segments' walks whole, or in 3 pieces composed after (segment_maps.walk_pieces; with 4-chunk
    segments the third piece is empty)."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    call, segs, seg_call = _pieces_call(spec, 3)
    plan, M, starts, ends = cp._torch_pieces(call, segs, need_starts=need_starts)
    roles = torch.tensor(segs.roles, dtype=torch.int32)
    monkeypatch.setattr(segment_maps, "walk_pieces", lambda max_chunks: walk_pieces)
    set_walks(monkeypatch, walks)
    got = segment_maps.segment_pieces(seg_call, plan, roles, need_starts, need_ends, segs.s)
    assert (got[1] is None) == (not need_starts) and (got[2] is None) == (not need_ends)
    checked, exact_checked = _compare_pieces(segs, call.H, plan, got, (M, starts, ends), need_starts, need_ends)
    assert checked and (exact_checked or spec not in WEAK_PIECES_SHAPES)


def _compare_pieces(segs, H: int, plan, got, want, need_starts: bool, need_ends: bool) -> tuple[int, int]:
    """`segment_pieces`' `(M, starts, ends)` against the tensor products' where the chains read
    them (starts[j] for j not first, ends[j] for j not last, M[j] where exact), to fp16 rounding:
    how many pieces were compared, and how many of them exact maps."""
    checked = exact_checked = 0
    for j, role in enumerate(segs.roles):
        for h in range(H):
            pairs = []
            if need_starts and not role & 1:
                pairs.append((got[1][j, h], want[1][j, h]))
            if need_ends and not role & 2:
                pairs.append((got[2][j, h], want[2][j, h]))
            if plan[j, h, 0] == 0 and role != 3:
                pairs.append((got[0][j, h], want[0][j, h]))
                exact_checked += 1
            for g, w in pairs:
                size = max(w.norm().item(), 1.0)
                assert ((g.double() - w.double()).norm() / size).item() < 5e-3, (j, h)
                checked += 1
    return checked, exact_checked


def test_tma_chain_runs_only_on_a_tma_gpu_for_16_bit_calls_and_once_verified(monkeypatch):
    """segment_scan.use_tma_chain: switched on, a GPU of compute capability 9 or more, and only once
    its GPU tests passed (or with GDR_ALLOW_UNVERIFIED=1); `chain` takes it for 16-bit calls only
    (`tf32`), fp32 maps of fp32 calls keep the 3xTF32 chain."""
    from types import SimpleNamespace

    from gdr_dispatch import problem
    from gdr_dispatch.backends.kernels import segment_scan as ss

    monkeypatch.setattr(problem, "device_info",
                        lambda dev: SimpleNamespace(capability=(9, 0) if dev.index == 0 else (8, 0)))
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    monkeypatch.setattr(ss, "TMA_CHAIN", True)
    monkeypatch.setattr(ss, "TMA_CHAIN_GPU_VERIFIED", True)
    assert ss.use_tma_chain("cuda:0") and not ss.use_tma_chain("cuda:1") and not ss.use_tma_chain("cpu")
    monkeypatch.setattr(ss, "TMA_CHAIN_GPU_VERIFIED", False)
    assert not ss.use_tma_chain("cuda:0")
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert ss.use_tma_chain("cuda:0")
    monkeypatch.setattr(ss, "TMA_CHAIN", False)
    assert not ss.use_tma_chain("cuda:0")
    # an fp32 call's chain (tf32 False) never asks: it launches the 3xTF32 chain
    launched = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(grid)

    monkeypatch.setattr(ss, "use_tma_chain", lambda device: pytest.fail("asked for an fp32 call"))
    monkeypatch.setattr(ss, "_chain", Launcher())
    ss.chain(torch.zeros(1, 1, 16, 16), torch.zeros(1, 1, 16, 16), None, torch.zeros(1, 1, 2, dtype=torch.int32),
             torch.tensor([0, 1], dtype=torch.int32), 1)
    assert launched == [(1, 1, 1)]


def test_tma_walks_run_only_on_a_tma_gpu_and_once_verified(monkeypatch):
    """segment_maps.use_tma_walks: switched on, a GPU of compute capability 9 or more (never the
    CPU), and only once their GPU tests passed (or with GDR_ALLOW_UNVERIFIED=1)."""
    from types import SimpleNamespace

    from gdr_dispatch import problem
    from gdr_dispatch.backends.kernels import segment_maps as sm

    def on(index=0):
        return sm.use_tma_walks(SimpleNamespace(q=SimpleNamespace(device=torch.device("cuda", index))))

    monkeypatch.setattr(problem, "device_info",
                        lambda dev: SimpleNamespace(capability=(9, 0) if dev.index == 0 else (8, 0)))
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    monkeypatch.setattr(sm, "TMA_WALKS", True)
    monkeypatch.setattr(sm, "TMA_WALKS_GPU_VERIFIED", True)
    assert on(0) and not on(1)
    assert not sm.use_tma_walks(SimpleNamespace(q=SimpleNamespace(device=torch.device("cpu"))))
    monkeypatch.setattr(sm, "TMA_WALKS_GPU_VERIFIED", False)
    assert not on(0)
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert on(0)
    monkeypatch.setattr(sm, "TMA_WALKS", False)
    assert not on(0)


@pytest.mark.parametrize("walks", WALKS)
def test_another_sequences_nan_stays_out_of_a_sequences_pass_1(walks, monkeypatch):
    """A pack whose second sequence is all NaN (q, k, v, dO, beta): the first sequence's windows and
    maps are the same bytes as with clean neighbours, whichever walks run. Its last chunk is partial,
    so every walk reads rows of the next sequence there and must mask them (the TMA walks' factors
    are zero past a segment's end, their dO load masked)."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    set_walks(monkeypatch, walks)
    spec = ShapeSpec(seqlens=(700, 300), H=2, K=16, V=16, gate="mixed")
    call, segs, seg_call = _pieces_call(spec, 4)
    plan, *_ = cp._torch_pieces(call, segs, need_starts=True)
    roles = torch.tensor(segs.roles, dtype=torch.int32)
    clean = segment_maps.segment_pieces(seg_call, plan, roles, True, True, segs.s)
    bad = {}
    for name in ("q", "k", "v", "do", "b"):
        x = getattr(seg_call, name).clone()
        x[:, 700:] = float("nan")
        bad[name] = x
    poisoned = segment_maps.segment_pieces(replace(seg_call, **bad), plan, roles, True, True, segs.s)
    mine = [j for j, n in enumerate(segs.seq) if n == 0]
    exact = plan[..., 0] == 0
    for j in mine:
        for h in range(call.H):
            pairs = [] if segs.roles[j] & 1 else [("start", 1)]
            pairs += [] if segs.roles[j] & 2 else [("end", 2)]
            pairs += [("map", 0)] if exact[j, h] and segs.roles[j] != 3 else []
            for what, out in pairs:
                assert torch.isfinite(poisoned[out][j, h]).all(), (what, j, h)
                assert torch.equal(poisoned[out][j, h], clean[out][j, h]), (what, j, h)


def test_pass_1_walks_fork_only_on_a_gpu_and_once_verified(monkeypatch):
    """The backward walk beside the forward one on a second stream (segment_maps.concurrent_walks):
    CUDA only, and only once its GPU test passed (or with GDR_ALLOW_UNVERIFIED=1)."""
    from gdr_dispatch.backends.kernels import segment_maps as sm

    gpu = torch.device("cuda", 0)
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    monkeypatch.setattr(sm, "CONCURRENT_WALKS", True)
    monkeypatch.setattr(sm, "CONCURRENT_WALKS_GPU_VERIFIED", True)
    assert sm.concurrent_walks(gpu)  # verified: on without the variable
    monkeypatch.setattr(sm, "CONCURRENT_WALKS_GPU_VERIFIED", False)
    assert not sm.concurrent_walks(gpu)
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert sm.concurrent_walks(gpu) and not sm.concurrent_walks(torch.device("cpu"))
    monkeypatch.setattr(sm, "CONCURRENT_WALKS", False)
    assert not sm.concurrent_walks(gpu)


@pytest.mark.parametrize("form", ["PREFIX", "BLOCKED"])
def test_pass_2_forms_run_only_on_a_gpu_at_many_segments_and_once_verified(form, monkeypatch):
    """segment_scan.use_prefix and use_blocked: switched on, CUDA, their MIN_SEGMENTS segments or
    more, and only once their GPU tests passed (or with GDR_ALLOW_UNVERIFIED=1)."""
    from gdr_dispatch.backends.kernels import segment_scan as ss

    use = ss.use_prefix if form == "PREFIX" else ss.use_blocked
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    monkeypatch.setattr(ss, form, True)
    monkeypatch.setattr(ss, f"{form}_GPU_VERIFIED", False)
    many = getattr(ss, f"{form}_MIN_SEGMENTS")
    monkeypatch.setattr(ss, f"{form}_GPU_VERIFIED", True)
    assert use(many, "cuda")  # verified: on without the variable
    monkeypatch.setattr(ss, f"{form}_GPU_VERIFIED", False)
    assert not use(many, "cuda")
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert use(many, "cuda") and not use(many - 1, "cuda") and not use(many, "cpu")
    monkeypatch.setattr(ss, form, False)
    assert not use(many, "cuda")


def test_blocked_groups_take_the_fewest_serial_steps():
    from gdr_dispatch.backends.kernels import segment_scan as ss

    assert [ss.group_size(c) for c in (1, 2, 3, 16, 32, 64)] == [1, 1, 1, 3, 4, 5]


def _reset_call(dtype: str, T: int = 4096, reset: int = 63):
    """One sequence of weak decay (-2 per chunk) with a reset token (log decay -1e9, a mask constant
    some models use) at the end of its first chunk: float32 sums of the segment's chunks round the
    reset's -1e9 by 64, so a window taken as `total - head` could come out chunks too short."""
    from gdr_dispatch.reference import prepare_residuals

    spec = ShapeSpec(B=1, T=T, H=2, K=16, V=16, dtype=dtype, h="none")
    x = make_inputs(spec, "cpu", seed=9)
    g_raw = torch.full_like(x["g_raw"], -2.0 / 64)
    g_raw[:, reset] = -1e9
    res = prepare_residuals(x["q"], x["k"], x["v"], g_raw, x["b"], initial_state=x["initial_state"], chunk_size=64)
    return validate(**{**call_kwargs(x), "a": res.a, "g": res.g})


def test_a_reset_token_does_not_shorten_the_windows():
    """The windows' sums run from each end of the segment: after a reset token the forward window
    still needs its 9 chunks of -2 (-18 < -16.6), in the tensor rule and in the kernel."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import passes as cp

    call = _reset_call("float16")
    segs = cp.segments_of(tuple(call.seq_lens), 64, 2)  # 2 segments of 32 chunks
    plan = cp._torch_pieces(call, segs, need_starts=True)[0]
    assert (plan[0, :, 0] == 9).all() and (plan[0, :, 1] == 1).all(), plan
    flat, offsets = cp._segments_inputs(call, segs.token_offsets)
    seg_call = validate(**flat, scale=call.scale, cu_seqlens=offsets, chunk_size=64)
    assert torch.equal(segment_maps.decay_plan(seg_call, cp.threshold(torch.float32), segs), plan)


def test_a_reset_token_splits_exactly_in_float32(monkeypatch):
    call = _reset_call("float32", T=2048)
    kwargs = {n: getattr(call, n) for n in ("q", "k", "v", "a", "g", "b", "do", "dht", "h", "initial_state", "scale")}
    assert_split_equals_whole(kwargs, 2, 1e-5, monkeypatch)


@pytest.fixture(autouse=True)
def _one_address_set(monkeypatch):
    """The graph tests here keep one in-place address set per key (whatever GDR_ALLOW_UNVERIFIED
    says), except those that ask for several (`_multi_setup`)."""
    from gdr_dispatch.backends.split import graphs

    monkeypatch.setattr(graphs, "ADDRESS_SETS", 1)


def test_a_graph_evicted_again_and_again_runs_eagerly(monkeypatch):
    """More split shapes in turn than graphs kept: each key is captured at most MAX_CAPTURES times,
    then runs eagerly (a capture per call costs more than the eager call)."""
    from gdr_dispatch import clear_caches
    from gdr_dispatch.backends.split import graphs

    class Graph:
        def replay(self):
            pass

    captures = []

    def capture(name, key, tensors, fn, seq_lens, in_place=False, pool=None, into=None, stream=None):
        captures.append(key)
        hit = (Graph(), None if in_place else tensors, fn(tensors), graphs.addresses(tensors) if in_place else None)
        (graphs._graphs if into is None else into)[key] = hit
        return hit

    monkeypatch.setattr(graphs, "_capture", capture)
    clear_caches()
    keys = [("k", i) for i in range(graphs.LIMIT + 1)]  # one more than kept: each evicts the next
    for _ in range(10):
        for key in keys:
            x = (torch.ones(2),)  # a new tensor each call: copies, no capture in place
            graphs.run_tensors("test", key, x, lambda t: (t[0] * 2,), (2,))
    assert all(captures.count(key) == graphs.MAX_CAPTURES for key in keys)


def test_a_capture_keeps_the_callers_cached_memory_and_always_ends(monkeypatch):
    """graphs.capturing begins the capture on the given pool in thread_local mode and ends it, also
    when the block raises; it never empties the allocator's cache or synchronizes the device (what
    torch.cuda.graph does first: mid-step, the model's next allocations then cudaMalloc afresh)."""
    from gdr_dispatch.backends.split import graphs

    def forbidden(*args, **kwargs):
        raise AssertionError("a capture emptied the cache or synchronized")

    monkeypatch.setattr(torch.cuda, "empty_cache", forbidden)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)

    class Graph:
        def __init__(self):
            self.calls = []

        def capture_begin(self, pool=None, capture_error_mode="global"):
            self.calls.append(("begin", pool, capture_error_mode))

        def capture_end(self):
            self.calls.append(("end",))

    graph = Graph()
    with graphs.capturing(graph, pool="P"):
        graph.calls.append(("work",))
    assert graph.calls == [("begin", "P", "thread_local"), ("work",), ("end",)]
    graph = Graph()
    with pytest.raises(ValueError, match="in the block"):
        with graphs.capturing(graph):
            raise ValueError("in the block")
    assert graph.calls == [("begin", None, "thread_local"), ("end",)]
    import inspect

    assert "torch.cuda.graph(" not in inspect.getsource(graphs)  # every capture goes through `capturing`


def test_a_key_out_of_captures_keeps_its_graph_with_copies(monkeypatch):
    """A key whose captures are spent (evicted and captured again MAX_CAPTURES times) and that holds
    a working graph with copies keeps replaying it when its calls start repeating addresses (no
    capture in place left), instead of dropping it and running eagerly."""
    from gdr_dispatch import clear_caches
    from gdr_dispatch.backends.split import graphs

    monkeypatch.setattr(graphs, "IN_PLACE_GPU_VERIFIED", True)
    monkeypatch.setattr(graphs, "_capture", _stand_in_capture(lambda t: (t[0] * 2,)))
    clear_caches()
    key = ("A",)
    graphs._seen[key] = (graphs.MAX_CAPTURES - 1, False)  # one capture left
    graphs.run_tensors("test", key, (torch.ones(3),), lambda t: (t[0] * 2,), (3,))  # the last: with copies
    assert graphs._graphs.get(key) is not None and graphs._graphs[key][3] is None
    x = torch.full((3,), 5.0)
    before = graphs.replays["copied"]
    outs = [graphs.run_tensors("test", key, (x,), lambda t: (t[0] * 2,), (3,))[0] for _ in range(3)]
    assert all(torch.equal(o, x * 2) for o in outs)
    assert graphs.replays["copied"] - before == 3 and graphs._graphs.get(key) is not None


def _stand_in_capture(fn):
    """A stand-in for graphs._capture on the CPU: a "graph" whose replay recomputes `fn` on what it
    was captured on (static copies, or with `in_place` the caller's tensors: what a CUDA graph
    reads at their addresses) into its static outputs."""
    from gdr_dispatch.backends.split import graphs

    class Graph:
        def __init__(self, reads, out):
            self.reads, self.out = reads, out

        def replay(self):
            for o, new in zip(self.out, fn(self.reads)):
                if o is not None:
                    o.copy_(new)

    def capture(name, key, tensors, fn_, seq_lens, in_place=False, pool=None, into=None, stream=None):
        static = tensors if in_place else tuple(
            None if x is None else x.clone(memory_format=torch.contiguous_format) for x in tensors)
        out = fn(static)
        hit = (Graph(static, out), None if in_place else static, out, graphs.addresses(tensors) if in_place else None)
        (graphs._graphs if into is None else into)[key] = hit
        return hit

    return capture


def test_a_graph_reads_inputs_in_place_while_their_addresses_repeat(monkeypatch):
    """The same tensors called again (new values written into them): the graph is captured on them
    in place and replays with no copy in, holding their addresses, never their static copies; the
    outputs follow the new values and stay fresh. Tensors at other addresses: back to the copies
    for good, with the right results (a replay at the old addresses would return stale ones)."""
    from gdr_dispatch import clear_caches
    from gdr_dispatch.backends.split import graphs

    def fn(t):
        x, y = t
        return (x * 2 + y.sum(), (x - 1).to(torch.float64))

    monkeypatch.setattr(graphs, "IN_PLACE_GPU_VERIFIED", True)
    copied = []
    real = graphs.copy_all
    monkeypatch.setattr(graphs, "copy_all", lambda pairs: (copied.append(len(pairs)), real(pairs))[1])
    monkeypatch.setattr(graphs, "_capture", _stand_in_capture(fn))
    clear_caches()
    x, y = torch.randn(3), torch.randn(2)
    outs = []
    for i in range(4):  # eager, captured in place (same addresses as the eager call), replays
        x.copy_(torch.randn(3))
        y.copy_(torch.randn(2))
        copied.clear()
        got = graphs.run_tensors("test", ("k",), (x, y), fn, (3,))
        want = fn((x, y))
        assert all(torch.allclose(a, b) for a, b in zip(got, want)), i
        if i >= 1:
            assert copied == [2], (i, copied)  # only the outputs' copy: nothing copied in
        outs.append(got)
    hit = graphs._graphs[("k",)]
    assert hit[1] is None and hit[3] == graphs.addresses((x, y))
    assert outs[2][0].data_ptr() != outs[3][0].data_ptr() != hit[2][0].data_ptr()
    for i in range(3):  # elsewhere: copies, and they stay copies even back at the first addresses
        x2, y2 = (torch.randn(3), torch.randn(2)) if i < 2 else (x, y)
        got = graphs.run_tensors("test", ("k",), (x2, y2), fn, (3,))
        assert all(torch.allclose(a, b) for a, b in zip(got, fn((x2, y2)))), i
        assert graphs._graphs[("k",)][3] is None
    assert graphs._seen[("k",)][1] is True  # copies for good


def _in_place_setup(monkeypatch, fn, fail_in_place=False):
    """The stand-in capture with in-place replays allowed; returns the list of captures made
    (True for in place, False for copies)."""
    from gdr_dispatch import clear_caches
    from gdr_dispatch.backends.split import graphs

    made = []
    stand_in = _stand_in_capture(fn)

    def capture(name, key, tensors, fn_, seq_lens, in_place=False, pool=None, into=None, stream=None):
        made.append(in_place)
        return None if in_place and fail_in_place else stand_in(name, key, tensors, fn_, seq_lens, in_place,
                                                                pool, into)

    monkeypatch.setattr(graphs, "IN_PLACE_GPU_VERIFIED", True)
    monkeypatch.setattr(graphs, "_capture", capture)
    clear_caches()
    return made


def _twice(t):
    return (t[0] * 2,)


def test_in_place_replays_tell_views_of_one_buffer_apart(monkeypatch):
    """Slices of one buffer (micro-batches cut from one tensor) sit in one storage at different
    offsets: a graph captured on the first slice must not replay on the second."""
    from gdr_dispatch.backends.split import graphs

    _in_place_setup(monkeypatch, _twice)
    buf = torch.randn(6)
    for i, x in enumerate((buf[0:3], buf[0:3], buf[0:3], buf[3:6], buf[0:3])):
        got = graphs.run_tensors("test", ("k",), (x,), _twice, (3,))
        assert torch.equal(got[0], x * 2), i


def test_in_place_needs_the_gate_and_never_recaptures_per_call_without_it(monkeypatch):
    """With in-place replays not verified (and no GDR_ALLOW_UNVERIFIED) the same tensors called
    again and again are captured once, with copies; with the gate opened later they go in place
    once; closed again, back to copies (never an in-place replay past the gate)."""
    from gdr_dispatch.backends.split import graphs

    made = _in_place_setup(monkeypatch, _twice)
    monkeypatch.setattr(graphs, "IN_PLACE_GPU_VERIFIED", False)
    monkeypatch.setattr(graphs, "ADDRESS_SETS", 1)  # one address set per key (the gate opens both)
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    x = torch.randn(3)
    for _ in range(10):
        assert torch.equal(graphs.run_tensors("test", ("k",), (x,), _twice, (3,))[0], x * 2)
    assert made == [False]
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    for _ in range(3):
        assert torch.equal(graphs.run_tensors("test", ("k",), (x,), _twice, (3,))[0], x * 2)
    assert made == [False, True]
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED")
    before = graphs.replays["in place"]
    for _ in range(3):
        assert torch.equal(graphs.run_tensors("test", ("k",), (x,), _twice, (3,))[0], x * 2)
    assert made == [False, True, False] and graphs.replays["in place"] == before


def test_the_autotuners_timing_copies_graph_inputs_in(monkeypatch):
    """Inside `graph_safe.copied_graph_inputs` (the autotuner's timing: the same tensors called again
    and again, where a model's layers would bring new addresses) the graphs copy their inputs in;
    after it, the same tensors go in place."""
    from gdr_dispatch.backends.split import graphs
    from gdr_dispatch.graph_safe import copied_graph_inputs

    made = _in_place_setup(monkeypatch, _twice)
    x = torch.randn(3)
    with copied_graph_inputs():
        for _ in range(5):
            assert torch.equal(graphs.run_tensors("test", ("k",), (x,), _twice, (3,))[0], x * 2)
    assert made == [False]
    for _ in range(2):
        assert torch.equal(graphs.run_tensors("test", ("k",), (x,), _twice, (3,))[0], x * 2)
    assert made == [False, True]


def test_copies_turn_in_place_once_the_addresses_repeat_and_captures_stay_bounded(monkeypatch):
    """Calls at new addresses, then the same ones twice in a row: copies first, then captured
    again in place (no copy in after); addresses that keep changing never capture per call."""
    from gdr_dispatch.backends.split import graphs

    made = _in_place_setup(monkeypatch, _twice)
    keep = [torch.randn(3) for _ in range(3)]  # alive: distinct addresses
    for i, x in enumerate((keep[0], keep[1], keep[1], keep[1])):
        assert torch.equal(graphs.run_tensors("test", ("k",), (x,), _twice, (3,))[0], x * 2), i
    assert made == [False, True] and graphs._graphs[("k",)][3] is not None
    for x in keep * 5:  # the addresses come and go: back to copies once, then no more captures
        assert torch.equal(graphs.run_tensors("test", ("k",), (x,), _twice, (3,))[0], x * 2)
    assert made == [False, True, False] and len(made) <= graphs.MAX_CAPTURES


def _layers(n: int, size: int = 3):
    """`n` layers' inputs at one shape: each its own tensors (its own addresses)."""
    return [(torch.randn(size), torch.randn(2)) for _ in range(n)]


def _affine(t):
    x, y = t
    return (x * 2 + y.sum(), (x - 1).to(torch.float64))


def _multi_setup(monkeypatch, fail_in_place=False):
    from gdr_dispatch.backends.split import graphs

    made = _in_place_setup(monkeypatch, _affine, fail_in_place)
    monkeypatch.setattr(graphs, "ADDRESS_SETS", 4)
    monkeypatch.setattr(graphs, "PLACED_GPU_VERIFIED", True)
    copied = []
    real = graphs.copy_all
    monkeypatch.setattr(graphs, "copy_all", lambda pairs: (copied.append(len(pairs)), real(pairs))[1])
    return made, copied


@pytest.mark.parametrize("layers", [2, 3, 4])
def test_layers_at_one_shape_each_replay_in_place_on_their_own_graph(layers, monkeypatch):
    """A model's layers at one shape call the split from their own addresses, in turn, step after
    step: from the second step on each layer replays its own in-place graph (nothing copied in, the
    outputs still fresh), with each call's new values; ADDRESS_SETS graphs at most per key."""
    from gdr_dispatch.backends.split import graphs

    made, copied = _multi_setup(monkeypatch)
    xs = _layers(layers)
    for step in range(4):
        for i, (x, y) in enumerate(xs):
            x.copy_(torch.randn_like(x))
            y.copy_(torch.randn_like(y))
            copied.clear()
            before = graphs.replays["in place"]
            got = graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
            assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y)))), (step, i)
            assert got[0].data_ptr() not in (x.data_ptr(), y.data_ptr())
            if step >= 1:
                assert graphs.replays["in place"] == before + 1 and copied == [2], (step, i, copied)
    assert made.count(True) == layers  # one in-place capture per layer, never again
    assert sum(k[0] == ("k",) for k in graphs._placed) == layers <= graphs.ADDRESS_SETS


def test_more_address_sets_than_kept_copy_and_stay_right(monkeypatch):
    """More layers at one shape, in turn, than ADDRESS_SETS: the first ADDRESS_SETS to come back
    get in-place graphs and keep them (a replacement would give each graph away before its layer
    came back: `_few_sets` refuses it), the rest copy in; every result right, the captures
    bounded however long it runs."""
    from gdr_dispatch.backends.split import graphs

    made, _ = _multi_setup(monkeypatch)
    xs = _layers(graphs.ADDRESS_SETS + 2)
    for step in range(6):
        for x, y in xs:
            x.copy_(torch.randn_like(x))
            got = graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
            assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y)))), step
    assert made.count(True) == graphs.ADDRESS_SETS and made.count(False) == 1
    kept = {k[1] for k in graphs._placed if k[0] == ("k",)}
    assert kept == {graphs.addresses(t) for t in xs[:graphs.ADDRESS_SETS]}
    assert graphs.replays["copied"] > 0 and graphs.replays["in place"] > 0


def test_a_one_off_address_set_each_step_does_not_keep_the_others_from_their_graphs(monkeypatch):
    """Four layers at stable addresses and one call a step at fresh ones (a tensor the allocator
    places anew): the one-off sets do not count against ADDRESS_SETS, so the four get their
    in-place graphs."""
    from gdr_dispatch.backends.split import graphs

    made, _ = _multi_setup(monkeypatch)
    xs = _layers(graphs.ADDRESS_SETS)
    keep = []
    for _ in range(5):
        for x, y in xs:
            graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
        keep.append(_layers(1)[0])  # alive: its addresses never come back
        graphs.run_tensors("test", ("k",), keep[-1], _affine, (3,))
    assert made.count(True) == graphs.ADDRESS_SETS


def test_address_sets_that_settle_to_few_get_in_place_graphs(monkeypatch):
    """Calls first scattered over many address sets that never come back (warm-up, a burst of
    fresh tensors), then cycling through two: the two get in-place graphs, and replay with nothing
    copied in."""
    from gdr_dispatch.backends.split import graphs

    made, _ = _multi_setup(monkeypatch)
    scatter = _layers(graphs.ADDRESS_SETS + 3)  # kept alive: their addresses are not handed out again
    for x, y in scatter:
        graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
    assert True not in made
    two = _layers(2)
    for _ in range(graphs.ADDRESS_SETS + 2):
        for x, y in two:
            x.copy_(torch.randn_like(x))
            got = graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
            assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
    assert made.count(True) == 2
    before = graphs.replays["in place"]
    for x, y in two:
        graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
    assert graphs.replays["in place"] == before + 2


def test_fresh_tensors_every_call_never_capture_in_place(monkeypatch):
    """Inputs at new addresses every call (nothing comes back): replays with copies, no in-place
    capture, right results."""
    from gdr_dispatch.backends.split import graphs

    made, _ = _multi_setup(monkeypatch)
    keep = []  # alive, so no address comes back
    for _ in range(8):
        x, y = torch.randn(3), torch.randn(2)
        keep.append((x, y))
        got = graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
        assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
    assert True not in made and made.count(False) == 1


def test_an_address_set_whose_capture_fails_copies_and_is_retried_a_bounded_number_of_times(monkeypatch):
    from gdr_dispatch.backends.split import graphs

    made, _ = _multi_setup(monkeypatch, fail_in_place=True)
    x, y = torch.randn(3), torch.randn(2)
    start = graphs.replays["in place"]
    for _ in range(30):
        x.copy_(torch.randn(3))
        got = graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
        assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
    assert made.count(True) == 2 * graphs.ADDRESS_SETS and graphs.replays["in place"] == start


def test_several_address_sets_need_their_gate(monkeypatch):
    """Without PLACED_GPU_VERIFIED (and no GDR_ALLOW_UNVERIFIED) two layers in turn behave as one
    address set did: copies for good after the addresses change; opened, each goes in place;
    closed again, no in-place replay."""
    from gdr_dispatch.backends.split import graphs

    made, _ = _multi_setup(monkeypatch)
    monkeypatch.setattr(graphs, "PLACED_GPU_VERIFIED", False)
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    xs = _layers(2)
    start = graphs.replays["in place"]
    for _ in range(4):
        for x, y in xs:
            graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
    assert graphs.replays["in place"] == start and True not in made
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    for _ in range(3):
        for x, y in xs:
            graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
    assert made.count(True) == 2 and graphs.replays["in place"] >= start + 2
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED")
    before = graphs.replays["in place"]
    for _ in range(3):
        for x, y in xs:
            x.copy_(torch.randn(3))
            got = graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
            assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
    assert graphs.replays["in place"] == before


def test_in_place_graphs_give_way_to_the_autotuners_copies_and_go_with_their_key(monkeypatch):
    """Inside the autotuner's timing (`copied_graph_inputs`) a key with in-place graphs replays with
    copies; a key dropped (refused after too many captures) takes its in-place graphs and their
    pins with it; in-place graphs pushed out by other keys release their pins."""
    from gdr_dispatch.backends.split import graphs
    from gdr_dispatch.graph_safe import copied_graph_inputs

    _multi_setup(monkeypatch)
    released = []
    monkeypatch.setattr(graphs, "release_pins", lambda keys: released.append(keys))
    xs = _layers(2)
    for _ in range(3):
        for x, y in xs:
            graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
    mine = [k for k in graphs._placed if k[0] == ("k",)]
    assert len(mine) == 2
    before = dict(graphs.replays)
    with copied_graph_inputs():
        for x, y in xs:
            x.copy_(torch.randn(3))
            got = graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
            assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
    assert graphs.replays["in place"] == before.get("in place", 0)
    for k in mine:
        graphs._pins[k] = {("pin", k)}
    graphs._drop(("k",))
    assert not [k for k in graphs._placed if k[0] == ("k",)]
    assert all({("pin", k)} in released for k in mine)
    released.clear()
    for i in range(graphs.LIMIT * graphs.ADDRESS_SETS + 1):  # other keys push the first one out
        x, y = torch.randn(3), torch.randn(2)
        graphs._pins[(("other", i), graphs.addresses((x, y)))] = {("pin", i)}
        for _ in range(3):
            graphs.run_tensors("test", ("other", i), (x, y), _affine, (3,))
    assert {("pin", 0)} in released


def test_a_full_key_gives_its_oldest_in_place_graph_to_a_new_address_set(monkeypatch):
    """Address sets that stop coming (warm-up steps) do not hold a key's in-place slots for good:
    a set that comes back replaces the least recently replayed one, within the capture budget."""
    from gdr_dispatch.backends.split import graphs

    made, _ = _multi_setup(monkeypatch)
    old, new = _layers(graphs.ADDRESS_SETS), _layers(2)
    for _ in range(2):
        for x, y in old:
            graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
    for _ in range(3):
        for x, y in new:
            x.copy_(torch.randn(3))
            got = graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
            assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
    kept = {k[1] for k in graphs._placed if k[0] == ("k",)}
    assert all(graphs.addresses(t) in kept for t in new) and len(kept) == graphs.ADDRESS_SETS
    assert made.count(True) == graphs.ADDRESS_SETS + 2


def test_a_failed_in_place_capture_keeps_the_copies(monkeypatch):
    """A capture on the caller's tensors that fails leaves the key on its copies graph (not eager,
    not refused), and it is not tried again."""
    from gdr_dispatch.backends.split import graphs

    made = _in_place_setup(monkeypatch, _twice, fail_in_place=True)
    a, b = torch.randn(3), torch.randn(3)
    for i, x in enumerate((a, b, b, b, b)):
        assert torch.equal(graphs.run_tensors("test", ("k",), (x,), _twice, (3,))[0], x * 2), i
    assert made == [False, True] and graphs._seen[("k",)] != "refused"
    assert graphs._graphs[("k",)][3] is None and graphs.replays["copied"] >= 3


def test_known_lengths_read_from_one_constant_so_fresh_copies_keep_their_address(monkeypatch):
    """cu_seqlens whose values are known (the op's backward gets a fresh copy of them each step)
    is swapped for the device constant of those values: the same address each call, so the call
    still replays in place; the graph reads the right lengths."""
    from gdr_dispatch.backends.split import graphs
    from gdr_dispatch.graph_safe import remember

    def fn(t):
        x, cu = t
        return (x * cu[-1],)

    made = _in_place_setup(monkeypatch, fn)
    x = torch.randn(3)
    for i in range(4):
        cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        remember(cu, (0, 2, 5))
        got = graphs.run_tensors("test", ("k",), (x, cu), fn, (2, 3))
        assert torch.equal(got[0], x * 5), i
    assert made == [True]


def test_a_replayed_graph_reads_new_inputs_and_returns_fresh_outputs(monkeypatch):
    """The replay path (graphs.run_tensors) with a stand-in graph that recomputes into its static
    outputs: each call's floating inputs are copied in (strided views too; an integer input and
    None stay), the outputs equal fn on the new values, and they are fresh tensors, never the
    graph's own (a later replay must not change what an earlier call returned)."""
    from gdr_dispatch import clear_caches
    from gdr_dispatch.backends.split import graphs

    def fn(t):
        x, y, idx, _ = t
        return (x * 2 + y.sum(), None, (x[idx.long()] - 1).to(torch.float64))

    monkeypatch.setattr(graphs, "_capture", _stand_in_capture(fn))
    clear_caches()
    idx = torch.tensor([0, 2], dtype=torch.int32)
    results = []
    keep = []
    for i in range(4):  # eager, capture, then two replays
        base = torch.randn(3, 4, dtype=torch.float32)
        keep.append(base)  # (alive: no address comes back, so no capture in place)
        x, y = base.t()[:, :3], torch.randn(2, dtype=torch.float16)  # x a strided view
        got = graphs.run_tensors("test", ("k",), (x, y, idx, None), fn, (4,))
        want = fn((x, y, idx, None))
        assert got[1] is None
        for a, b in ((got[0], want[0]), (got[2], want[2])):
            assert a.dtype == b.dtype and torch.allclose(a, b), i
        results.append((got, [None if t is None else t.clone() for t in got]))
    _, static, out, reads = graphs._graphs[("k",)]
    assert reads is None
    for got, kept in results:
        assert all(a is None or (a.data_ptr() != o.data_ptr() and torch.equal(a, k))
                   for a, k, o in zip(got, kept, out) if o is not None)


def test_the_replay_copies_one_foreach_call_per_dtype_and_layout(monkeypatch):
    """graphs.copy_all: every pair copied (a strided source too), in one `_foreach_copy_` per
    (dtype, layout) group, each group of one dtype with matching strides where it can be (torch's
    multi-tensor copy takes only those; anything else is a copy per tensor)."""
    from gdr_dispatch.backends.split import graphs

    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (calls.append((d, s)), real(d, s))[1])
    base = torch.randn(6, 5)
    srcs = [torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(2, dtype=torch.float32),
            torch.randn(5, dtype=torch.bfloat16), base.t()[:, :3], torch.randn(4, dtype=torch.float32)]
    dsts = [torch.empty(x.shape, dtype=x.dtype) for x in srcs]
    graphs.copy_all(list(zip(dsts, srcs)))
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    assert len(calls) == 3  # bf16; fp32 with matching strides; the strided fp32 view
    for d, s in calls:
        assert len({x.dtype for x in d + s}) == 1
        assert len({a.stride() == b.stride() for a, b in zip(d, s)}) == 1
    assert sorted(len(d) for d, _ in calls) == [1, 2, 2]


def _lend_run(x, y, lend=2):
    from gdr_dispatch.backends.split import graphs

    return graphs.run_tensors("test", ("k",), (x, y), _affine, (3,), lend=lend)


def test_lent_outputs_are_the_graphs_own_buffers_and_never_overwritten_while_held(monkeypatch):
    """With lending on, a replay hands out the graph's own output buffers (no copy out) while the
    call before's are no longer held; a call that finds them held runs eagerly (right results, the
    held ones unchanged), and after LEND_BLOCKS such calls the key copies out for good."""
    from gdr_dispatch.backends.split import graphs

    _in_place_setup(monkeypatch, _affine)
    monkeypatch.setattr(graphs, "LEND_GPU_VERIFIED", True)
    x, y = torch.randn(3), torch.randn(2)
    _lend_run(x, y)  # eager
    got = _lend_run(x, y)  # captured in place (the same addresses twice), lent
    static = graphs._graphs[("k",)][2]
    assert got[0].data_ptr() == static[0].data_ptr() and got[1].data_ptr() == static[1].data_ptr()
    assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
    del got
    for _ in range(3):  # nothing held between calls: lent every time, new values each time
        x.copy_(torch.randn(3))
        got = _lend_run(x, y)
        assert got[0].data_ptr() == static[0].data_ptr()
        assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
        del got
    held = _lend_run(x, y)
    kept = [t.clone() for t in held]
    blocked, lent = graphs.replays["blocked"], graphs.replays["lent"]
    x.copy_(torch.randn(3))
    got = _lend_run(x, y)  # held: eager, never a replay over them
    assert graphs.replays["blocked"] == blocked + 1 and graphs.replays["lent"] == lent
    assert all(torch.equal(a, b) for a, b in zip(held, kept))
    assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
    assert got[0].data_ptr() != static[0].data_ptr()
    view = held[0][1:]  # a view holds the storage too
    del held, kept
    x.copy_(torch.randn(3))
    seen = view.clone()
    got = _lend_run(x, y)
    assert torch.equal(view, seen) and graphs.replays["blocked"] == blocked + 2  # LEND_BLOCKS reached
    # its graph goes (none may write the held buffers again), and what it lent is forgotten
    assert ("k",) not in graphs._graphs and ("k",) not in graphs._lent
    del view
    x.copy_(torch.randn(3))
    copied = graphs.copied_bytes["out"]
    got = _lend_run(x, y)  # nothing held now: a replay again, its outputs copied out for good
    assert got[0].data_ptr() != static[0].data_ptr() and graphs.copied_bytes["out"] > copied
    assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
    again = _lend_run(x, y)  # copies out: holding `got` blocks nothing
    assert graphs.replays["blocked"] == blocked + 2 and torch.equal(again[0], got[0])


#: the key of `_own_run`'s graphs: apart from those of the shared pool (graphs.run_tensors)
OWN_KEY = ("k", "own pools")


def _own_run(x, y):
    from gdr_dispatch.backends.split import graphs

    return graphs.run_tensors("test", ("k",), (x, y), _affine, (3,), own=True)


def test_the_forwards_layers_lend_all_their_outputs_each_held_on_its_own(monkeypatch):
    """`own` (the op's forward: autograd keeps its outputs until the layer's backward): each layer's
    in-place graph lends all its outputs (no copy out), and one layer's held outputs block only
    that layer's next call (eager, the held ones unchanged) while the other layers still replay
    and lend; after LEND_BLOCKS blocked calls that layer's graph goes and its next one copies out."""
    from gdr_dispatch.backends.split import graphs

    made, copied = _multi_setup(monkeypatch)
    monkeypatch.setattr(graphs, "LEND_GPU_VERIFIED", True)
    monkeypatch.setattr(graphs, "OWN_POOLS_GPU_VERIFIED", True)
    xs = _layers(3)
    for step in range(2):  # eager, then each layer captured in place
        for x, y in xs:
            _own_run(x, y)
    static = {i: graphs._placed[(OWN_KEY, graphs.addresses(xs[i]))][2] for i in range(3)}
    held = kept = None
    for step in range(4):
        for i, (x, y) in enumerate(xs):
            x.copy_(torch.randn(3))
            copied.clear()
            lent, blocked = graphs.replays["lent"], graphs.replays["blocked"]
            got = _own_run(x, y)
            assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y)))), (step, i)
            if i == 0 and step in (1, 2):  # layer 0 still holds its outputs from step 0: eager
                assert graphs.replays["blocked"] == blocked + 1 and graphs.replays["lent"] == lent
                assert all(torch.equal(a, b) for a, b in zip(held, kept)) and got[0].data_ptr() != static[0][0].data_ptr()
                continue
            if i == 0 and step == 3:  # LEND_BLOCKS reached at step 2: its graph went; a new one copies out
                assert graphs.replays["blocked"] == blocked and graphs.replays["lent"] == lent and copied
                assert all(torch.equal(a, b) for a, b in zip(held, kept)) and got[0].data_ptr() != static[0][0].data_ptr()
                assert (OWN_KEY, graphs.addresses(xs[0])) not in graphs._lent
                continue
            assert copied == [] and graphs.replays["lent"] == lent + 1, (step, i, copied)
            assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got, static[i])), (step, i)
            if i == 0:
                held, kept = got, [t.clone() for t in got]  # layer 0's outputs kept past the next step
            del got
    assert all(static[i][0].data_ptr() == graphs._placed[(OWN_KEY, graphs.addresses(xs[i]))][2][0].data_ptr()
               for i in (1, 2))  # the other layers kept their graphs
    keep = _own_run(*xs[0])
    copied.clear()
    again = _own_run(*xs[0])  # copies out: holding `keep` blocks nothing
    assert copied and torch.equal(again[0], keep[0])
    assert all(torch.equal(a, b) for a, b in zip(held, kept))


def test_a_replay_hashes_its_key_once_and_reads_no_environment(monkeypatch):
    """A call's key is looked up in a dozen memos: from the second call on it is hashed once per
    call (`graphs._interned`), the replays still right; with every gate verified no call reads the
    unverified gate (an environment read). A key element that counts its hashes tells."""
    from gdr_dispatch.backends.split import graphs

    class Counted:
        hashes = 0

        def __hash__(self):
            Counted.hashes += 1
            return 7

        def __eq__(self, other):
            return isinstance(other, Counted)

    _multi_setup(monkeypatch)
    monkeypatch.setattr(graphs, "LEND_GPU_VERIFIED", True)
    monkeypatch.setattr(graphs, "OWN_POOLS_GPU_VERIFIED", True)
    x, y = torch.randn(3), torch.randn(2)
    for _ in range(3):  # eager, captured, replayed
        del _
        graphs.run_tensors("test", ("k", Counted()), (x, y), _affine, (3,), own=True)
    monkeypatch.setattr(graphs, "unverified_allowed", lambda: pytest.fail("the unverified gate was read"))
    for _ in range(4):
        x.copy_(torch.randn(3))
        Counted.hashes = 0
        replayed = graphs.replays["in place"]
        got = graphs.run_tensors("test", ("k", Counted()), (x, y), _affine, (3,), own=True)
        assert graphs.replays["in place"] == replayed + 1
        assert Counted.hashes == 1
        assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
        del got
    monkeypatch.setattr(graphs, "IN_PLACE_GPU_VERIFIED", False)  # a gate not verified: the variable decides
    read = []
    monkeypatch.setattr(graphs, "unverified_allowed", lambda: read.append(1) or False)
    graphs.run_tensors("test", ("k", Counted()), (x, y), _affine, (3,), own=True)
    assert read


def test_blocked_calls_count_in_a_row(monkeypatch):
    """A layer whose outputs are held at one call, then released, lends again and its count starts
    over: two blocked calls far apart (two logging steps that keep an output) do not turn its
    graph to copies."""
    from gdr_dispatch.backends.split import graphs

    _multi_setup(monkeypatch)
    monkeypatch.setattr(graphs, "LEND_GPU_VERIFIED", True)
    monkeypatch.setattr(graphs, "OWN_POOLS_GPU_VERIFIED", True)
    x, y = torch.randn(3), torch.randn(2)
    _own_run(x, y)
    _own_run(x, y)  # captured in place, lent
    mine = (OWN_KEY, graphs.addresses((x, y)))
    for _ in range(3):
        held = _own_run(x, y)
        blocked = graphs.replays["blocked"]
        _own_run(x, y)  # held: eager
        assert graphs.replays["blocked"] == blocked + 1
        del held
        lent = graphs.replays["lent"]
        _own_run(x, y)  # released: lent again
        assert graphs.replays["lent"] == lent + 1 and mine in graphs._placed


def test_the_forwards_own_pools_need_their_gate(monkeypatch):
    """Without OWN_POOLS_GPU_VERIFIED (and no GDR_ALLOW_UNVERIFIED) `own` calls replay as any other:
    outputs copied out."""
    from gdr_dispatch.backends.split import graphs

    made, copied = _multi_setup(monkeypatch)
    monkeypatch.setattr(graphs, "LEND_GPU_VERIFIED", True)
    monkeypatch.setattr(graphs, "OWN_POOLS_GPU_VERIFIED", False)
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    x, y = torch.randn(3), torch.randn(2)
    for _ in range(4):
        copied.clear()
        got = _own_run(x, y)
    assert copied == [2] and got[0].data_ptr() != graphs._placed[(("k",), graphs.addresses((x, y)))][2][0].data_ptr()


def test_only_the_leading_outputs_are_lent_the_rest_copied_out(monkeypatch):
    """`lend=n` lends the first n outputs (the backward's per-token gradients) and copies the rest
    out (its dh0: a learnt initial state's .grad keeps it): holding a copied one blocks nothing."""
    from gdr_dispatch.backends.split import graphs
    from gdr_dispatch.contract import GDRGrads

    assert graphs.LENT_GRADS == 5 and GDRGrads._fields[graphs.LENT_GRADS] == "dh0"
    _in_place_setup(monkeypatch, _affine)
    monkeypatch.setattr(graphs, "LEND_GPU_VERIFIED", True)
    x, y = torch.randn(3), torch.randn(2)
    _lend_run(x, y, lend=1)
    kept, blocked = [], graphs.replays["blocked"]
    for _ in range(3):
        x.copy_(torch.randn(3))
        got = _lend_run(x, y, lend=1)
        static = graphs._graphs[("k",)][2]
        assert got[0].data_ptr() == static[0].data_ptr() and got[1].data_ptr() != static[1].data_ptr()
        assert all(torch.allclose(a, b) for a, b in zip(got, _affine((x, y))))
        kept.append(got[1])  # the copied one, held: the next call still lends
        del got
    assert graphs.replays["blocked"] == blocked and len({t.data_ptr() for t in kept}) == 3


def test_lending_needs_its_gate_and_stays_out_of_the_autotuners_timing(monkeypatch):
    """Not verified and no GDR_ALLOW_UNVERIFIED, or inside the autotuner's timing (it may keep a
    run's outputs to compare with the next's): outputs copied out, never the graph's own; the
    forward (no `lend`) always copies."""
    from gdr_dispatch.backends.split import graphs
    from gdr_dispatch.graph_safe import copied_graph_inputs

    _in_place_setup(monkeypatch, _affine)
    monkeypatch.setattr(graphs, "LEND_GPU_VERIFIED", False)
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    x, y = torch.randn(3), torch.randn(2)
    lent = graphs.replays["lent"]
    for _ in range(3):
        got = _lend_run(x, y)
        del got  # nothing held between calls: a lending replay would lend again, not be blocked
    got = _lend_run(x, y)
    static = graphs._graphs[("k",)][2]
    assert got[0].data_ptr() != static[0].data_ptr() and graphs.replays["lent"] == lent
    monkeypatch.setattr(graphs, "LEND_GPU_VERIFIED", True)
    with copied_graph_inputs():
        got = _lend_run(x, y)
    assert got[0].data_ptr() != graphs._graphs[("k",)][2][0].data_ptr()
    got = graphs.run_tensors("test", ("k",), (x, y), _affine, (3,))
    assert got[0].data_ptr() != graphs._graphs[("k",)][2][0].data_ptr()
    got = _lend_run(x, y)
    assert got[0].data_ptr() == graphs._graphs[("k",)][2][0].data_ptr()
