"""The training op's forward split as the backward is (backends/split/forward.py), on the CPU in
float64: `<provider>@split<n>` equals the provider whole (outputs, final states, residuals and the
gradients through it), at weak, strong and mixed gates; and how the op picks its forward on a
starved grid (a measurement, stored, then the table)."""

from dataclasses import replace

import pytest
import torch

from gdr_dispatch import Backend, chunk_gated_delta_rule, clear_caches, registry, training, tuning_table
from gdr_dispatch.problem import DeviceInfo
from gdr_dispatch.shapes import ShapeSpec, make_inputs

SHAPES = [
    ShapeSpec(B=2, T=300, H=4, Hg=2, K=16, V=8),  # grouped heads, 4 chunks + 44 tokens
    ShapeSpec(seqlens=(1, 63, 64, 65, 300), H=2, K=16, V=8, state_v_first=True),
    ShapeSpec(B=1, T=640, H=2, K=8, V=16, initial_state=False),
    ShapeSpec(seqlens=(130, 0, 200), H=2, K=8, V=8),  # a sequence of no tokens
]


def _op_inputs(spec, seed=3):
    x = make_inputs(replace(spec, dtype="float64", h="none"), "cpu", seed=seed)
    return dict(q=x["q"], k=x["k"], v=x["v"], g=x["g_raw"], beta=x["b"], initial_state=x["initial_state"],
                cu_seqlens=x["cu_seqlens"], state_v_first=spec.state_v_first)


def _forward(x, provider, monkeypatch):
    """The op's raw forward `(o, final_state, G, a, h)` with `GDR_FORWARD=provider`."""
    monkeypatch.setenv("GDR_FORWARD", provider)
    clear_caches()
    scale = x["q"].shape[-1] ** -0.5
    return torch.ops.gdr_dispatch.chunk_gdr_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"],
                                                x["cu_seqlens"], scale, True, x["state_v_first"], True)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("gate", ["uniform", "logsigmoid", "logsigmoid16", "mixed"])
@pytest.mark.parametrize("segments", [2, 3, 100])
@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: s.label())
def test_the_split_forward_equals_the_whole_in_float64(spec, segments, gate, monkeypatch):
    x = _op_inputs(replace(spec, gate=gate))
    whole = _forward(x, "torch", monkeypatch)
    split = _forward(x, f"torch@split{segments}", monkeypatch)
    for name, a, b in zip(("o", "final_state", "G", "a", "h"), split, whole):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) < 1e-10, name


def test_warm_windows_are_taken_and_a_loose_threshold_shows(monkeypatch):
    """The check above can fail: at a weak gate over 16 chunks in 4 segments, warm-ups cut at e^-3
    instead of below float64's rounding leave their dropped term in the output."""
    from gdr_dispatch.backends.split import passes as cp

    x = _op_inputs(ShapeSpec(B=1, T=1024, H=2, K=16, V=16, gate="logsigmoid16"))
    whole = _forward(x, "torch", monkeypatch)
    monkeypatch.setattr(cp, "threshold", lambda acc: -3.0)
    split = _forward(x, "torch@split4", monkeypatch)
    assert _rel(split[0], whole[0]) > 1e-6  # (the final state sees it decayed over a whole segment more)


@pytest.mark.parametrize("spec", SHAPES[:2], ids=lambda s: s.label())
def test_gradients_through_a_split_forward_are_the_whole_ones(spec, monkeypatch):
    x = _op_inputs(replace(spec, gate="mixed"))
    out = {}
    for provider in ("torch", "torch@split3"):
        monkeypatch.setenv("GDR_FORWARD", provider)
        clear_caches()
        leaves = {n: (t.clone().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                  for n, t in x.items()}
        o, ht = chunk_gated_delta_rule(**leaves, output_final_state=True)
        ((o * o.detach().sin()).sum() + (ht * ht.detach().cos()).sum()).backward()
        out[provider] = [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")]
    for a, b in zip(out["torch@split3"], out["torch"]):
        assert _rel(a, b) < 1e-10


class _FakeForward(Backend):
    """A forward provider on the torch reference that the split may wrap (the torch reference
    itself is never a candidate)."""

    name = "fake_forward"
    forward_rank = 1

    def not_supported_reasons(self, problem):
        return []

    def forward(self, *args, **kwargs):
        return registry.get_backend("torch").forward(*args, **kwargs)


def _starved_problem(x, sms=132):
    p = training.forward_problem(x["q"], x["v"], x["beta"], x["initial_state"], x["cu_seqlens"],
                                 x["state_v_first"])
    return replace(p, device=DeviceInfo("cuda", "Fake GPU", (9, 0), sms))


def test_a_starved_forward_is_measured_stored_and_then_read_from_the_table(monkeypatch, with_backends):
    from gdr_dispatch import autotune, dispatch

    with_backends(_FakeForward())
    monkeypatch.setattr(dispatch, "autotune_block_reason", lambda p, have_tensors: None)
    times = {}

    def fake_ms(fn, device_type):
        fn()
        return times.setdefault("n", iter([5.0, 9.0, 1.0, 3.0, 4.0, 6.0, 7.0, 8.0])).__next__()

    monkeypatch.setattr(autotune, "measure_ms", fake_ms)
    x = _op_inputs(ShapeSpec(B=1, T=1024, H=2, K=16, V=16, gate="mixed"))
    p = _starved_problem(x, sms=16)  # 2 programs: 4 and 8 segments are the counts a miss times
    scale = x["q"].shape[-1] ** -0.5
    ran = []

    def measure_on(backend):
        ran.append(backend.name)
        return backend.forward(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], None, False,
                               True, 64, need_states=False)[:2]

    backend, how = training.forward_choice(p, measure_on=measure_on)
    names = list(dict.fromkeys(ran))
    assert names == ["fake_forward", "fake_forward@split4", "fake_forward@split8"]
    assert "torch" not in names  # the reference is never measured
    assert backend.name == names[2] and how.startswith("measured, stored in")
    hit = next(tuning_table.lookup(p.device.slug, p.problem_key(), p.versions_key()))
    assert hit.entry["winner"] == names[2] and "forward" in p.problem_key()
    clear_caches()
    again, how = training.forward_choice(p, measure_on=lambda b: pytest.fail("measured again"))
    assert again.name == names[2] and how.startswith("table")


def test_a_full_grid_forward_is_the_lowest_rank_unmeasured(monkeypatch, with_backends):
    from gdr_dispatch import dispatch

    with_backends(_FakeForward())
    monkeypatch.setattr(dispatch, "autotune_block_reason", lambda p, have_tensors: None)
    x = _op_inputs(ShapeSpec(B=1, T=1024, H=2, K=16, V=16))
    p = _starved_problem(x, sms=2)  # 2 programs on 2 SMs
    backend, how = training.forward_choice(p, measure_on=lambda b: pytest.fail("measured a full grid"))
    assert backend.name == "fake_forward" and "lowest forward_rank" in how
    monkeypatch.setenv("GDR_CP", "0")  # no split candidates: nothing to measure either
    backend, _ = training.forward_choice(_starved_problem(x), measure_on=lambda b: pytest.fail("measured"))
    assert backend.name == "fake_forward"


def test_gdr_forward_names_a_split_and_says_why_it_cannot(monkeypatch):
    x = _op_inputs(ShapeSpec(B=1, T=200, H=2, K=8, V=8))
    monkeypatch.setenv("GDR_FORWARD", "triton_wide@split2")
    with pytest.raises(ValueError, match="GDR_FORWARD=triton_wide@split2: .*triton_wide offers no forward"):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])


def test_tune_measures_the_forward_at_a_starved_shape_once(monkeypatch, with_backends, tmp_path):
    """`gdr-dispatch tune` on a GPU also measures the op's forward where the split's forwards are
    candidates, once per forward key (the h and dht variants share it), into the table it writes."""
    from gdr_dispatch import autotune, cli

    with_backends(_FakeForward())
    monkeypatch.setattr(autotune, "measure_ms", lambda fn, device_type: fn() and 1.0)
    real = training.forward_problem
    monkeypatch.setattr(training, "forward_problem",
                        lambda *a, **kw: replace(real(*a, **kw), device=DeviceInfo("cuda", "Fake GPU", (9, 0), 16)))
    spec = ShapeSpec(B=1, T=1024, H=2, K=16, V=16, dtype="float64", h="none")
    x = make_inputs(spec, "cpu", seed=1)
    dev = DeviceInfo("cuda", "Fake GPU", (9, 0), 16)
    done = set()
    assert cli._tune_forward(spec, x, dev, tmp_path, {}, autotune.measure_ms, done) == 1
    assert cli._tune_forward(spec, x, dev, tmp_path, {}, autotune.measure_ms, done) == 0
    (key, entry), = tuning_table.load_entries(tuning_table.table_path(tmp_path, dev.slug)).items()
    assert "forward" in key and set(entry["candidates"]) == {"fake_forward", "fake_forward@split4",
                                                             "fake_forward@split8"}


def test_a_provider_in_two_halves_computes_the_residuals_once_when_verified(monkeypatch, with_backends):
    """A provider in two halves runs as such only once verified (or GDR_ALLOW_UNVERIFIED): its
    residuals are computed once, its second half takes them, and the result is the whole call's."""
    from gdr_dispatch.backends.split.forward import residuals

    torch_fwd = registry.get_backend("torch")

    class Halves(_FakeForward):
        name = "fake_halves"
        residual_forward = True
        residual_forward_verified = False
        handed = []

        def forward_residuals(self, q, k, v, g, beta, cu_seqlens, chunk_size):
            self.handed.append("residuals")
            return residuals(q, k, v, g, beta, cu_seqlens, chunk_size)

        def forward_from_residuals(self, q, k, v, G, a, beta, scale, initial_state, cu_seqlens, state_v_first,
                                   need_final, chunk_size, need_states=True):
            self.handed.append("rest")
            # the torch reference's forward needs g: recover it from the cumsum it was handed
            Gc = G.reshape(*G.shape[:-2], -1, chunk_size, G.shape[-1]) if G.shape[1] % chunk_size == 0 else None
            assert Gc is not None
            g = torch.cat([Gc[..., :1, :], Gc.diff(dim=-2)], dim=-2).reshape(G.shape)
            o, ht, G2, a2, h = torch_fwd.forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first,
                                                 need_final, chunk_size, need_states=need_states)
            assert _rel(G2, G) < 1e-12 and _rel(a2.double(), a.double()) < 1e-12
            return o, ht, h

    halves = Halves()
    with_backends(halves)
    x = _op_inputs(ShapeSpec(B=1, T=1024, H=2, K=16, V=16, gate="mixed"))  # whole chunks: g recoverable above
    whole = _forward(x, "torch", monkeypatch)
    split = _forward(x, "fake_halves@split4", monkeypatch)
    assert Halves.handed == []  # unverified: its whole forward ran
    for a, b in zip(split, whole):
        assert _rel(a, b) < 1e-10
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    split = _forward(x, "fake_halves@split4", monkeypatch)
    assert Halves.handed == ["residuals", "rest"]
    for name, a, b in zip(("o", "final_state", "G", "a", "h"), split, whole):
        assert _rel(a, b) < 1e-10, name


def test_forward_entries_are_never_a_backwards_neighbours(monkeypatch, with_backends):
    """A forward entry at the backward's very shape does not prune the backward's candidates."""
    x = _op_inputs(ShapeSpec(B=1, T=1024, H=2, K=16, V=16))
    p = _starved_problem(x)
    back = replace(p, forward=False, has_dht=True)
    tuning_table.record(p.device.slug, p.device.name, {p.table_key(): {
        "winner": "fake_forward@split8", "candidates": {"fake_forward": {"ms": 3.0}, "fake_forward@split8": {"ms": 1.0}}}})
    assert tuning_table.neighbours(back) == [] and tuning_table.device_entries(back) == []
    assert [k for k, _ in tuning_table.device_entries(p)] == [p.table_key()]


def test_a_stored_forward_split_holds_at_other_sizes_of_its_key_and_gdr_cp_0_turns_it_off(monkeypatch,
                                                                                         with_backends):
    """A table's split winner is taken wherever it can run (its count need not be one this size
    would measure); with GDR_CP=0 the entry's fastest unsplit provider runs instead."""
    with_backends(_FakeForward())
    x = _op_inputs(ShapeSpec(B=1, T=1024, H=2, K=16, V=16))
    p = _starved_problem(x)
    assert "fake_forward@split2" not in training.forward_candidates(p)[1]  # not a count it would measure
    tuning_table.record(p.device.slug, p.device.name, {p.table_key(): {
        "winner": "fake_forward@split2", "candidates": {"fake_forward": {"ms": 3.0}, "fake_forward@split2": {"ms": 1.0}}}})
    backend, how = training.forward_choice(p, measure_on=lambda b: pytest.fail("measured"))
    assert backend.name == "fake_forward@split2" and how.startswith("table")
    monkeypatch.setenv("GDR_CP", "0")
    backend, how = training.forward_choice(p, measure_on=lambda b: pytest.fail("measured"))
    assert backend.name == "fake_forward" and how.startswith("table")


def test_a_failed_whole_forward_stores_no_pick(monkeypatch, with_backends, caplog):
    """With nothing to cross-check a split against, nothing is stored and the provider runs whole."""
    from gdr_dispatch import autotune, dispatch

    class Broken(_FakeForward):
        def forward(self, *args, **kwargs):
            if args[7] is None:  # no cu_seqlens: the whole call (the split passes its segments')
                raise RuntimeError("broken whole")
            return super().forward(*args, **kwargs)

    with_backends(Broken())
    monkeypatch.setattr(dispatch, "autotune_block_reason", lambda p, have_tensors: None)
    monkeypatch.setattr(autotune, "measure_ms", lambda fn, device_type: fn() and 1.0)
    x = _op_inputs(ShapeSpec(B=1, T=1024, H=2, K=16, V=16, initial_state=False))
    p = _starved_problem(x, sms=16)
    scale = x["q"].shape[-1] ** -0.5

    def measure_on(backend):
        return backend.forward(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, None, None, False, True, 64,
                               need_states=False)[:2]

    backend, how = training.forward_choice(p, measure_on=measure_on)
    assert backend.name == "fake_forward" and "measurement failed" in how
    assert list(tuning_table.lookup(p.device.slug, p.problem_key(), p.versions_key())) == []


def test_the_forwards_a_first_call_measures_are_built_early_and_waited_for(monkeypatch, with_backends):
    """A first forward at a starved shape starts its candidates' builds in background processes
    (one autotune.forward_job each, with the call's shapes, dtypes, flags and scale) and the
    measurement waits for each build before timing it; where nothing is measured (a table entry,
    GDR_FORWARD, a full grid) nothing is started."""
    from gdr_dispatch import autotune, dispatch

    with_backends(_FakeForward())
    monkeypatch.setattr(dispatch, "autotune_block_reason", lambda p, have_tensors: None)
    monkeypatch.setattr(autotune, "measure_ms", lambda fn, device_type: (fn(), 1.0)[1])
    x = _op_inputs(ShapeSpec(B=1, T=1024, H=2, K=16, V=16, gate="mixed"))
    p = _starved_problem(x, sms=16)
    scale = x["q"].shape[-1] ** -0.5
    started, events = [], []
    monkeypatch.setattr(autotune, "start_compiles", lambda jobs: started.extend(jobs) or len(jobs))
    monkeypatch.setattr(autotune, "wait_early", lambda job: events.append(("waited", job[2][0])) or 2.0)
    args = (x["q"], x["v"], x["g"], x["beta"], x["initial_state"], None, (1024,), scale, True, False, False)
    jobs = training._start_forward_compiles(p, *args)
    assert list(jobs) == ["fake_forward", "fake_forward@split4", "fake_forward@split8"]
    assert jobs["fake_forward@split8"] == jobs["fake_forward@split4"] != jobs["fake_forward"]  # one build per kind
    assert started == [jobs["fake_forward"], jobs["fake_forward@split4"]]
    spec = dict(jobs["fake_forward@split4"][2][1])
    assert jobs["fake_forward@split4"][:2] == ("gdr_dispatch.autotune", "warm_forward")
    assert spec["T"] == 1024 and spec["H"] == 2 and spec["scale"] == scale and spec["need_final"] is True
    assert spec["g_dtype"] == str(x["g"].dtype)[6:] and spec["h0_dtype"] == "float64" and spec["seqlens"] is None
    assert spec["cu_dtype"] is None

    def measure_on(backend):
        events.append(("ran", backend.name))
        return backend.forward(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], None, False,
                               True, 64, need_states=False)[:2]

    training.forward_choice(p, measure_on=measure_on, jobs=jobs)
    firsts = [e for i, e in enumerate(events) if e not in events[:i]]
    # every build waited for before anything is timed (a build runs its forward on the same GPU)
    assert firsts == [("waited", "fake_forward"), ("waited", "fake_forward@split4"), ("ran", "fake_forward"),
                      ("ran", "fake_forward@split4"), ("ran", "fake_forward@split8")]
    # now a table entry: nothing to measure, nothing started
    started.clear()
    clear_caches()
    assert training._start_forward_compiles(p, *args) == {} and started == []
    monkeypatch.setenv("GDR_FORWARD", "fake_forward")
    assert training.forward_to_measure(_starved_problem(x, sms=64)) == {}


def test_a_forward_build_job_runs_the_provider_on_inputs_like_the_call(monkeypatch):
    """What a background build runs (autotune.warm_forward, in its own process on the GPU): the
    provider's forward, here the torch reference split in two on a CPU, at the job's shapes."""
    from gdr_dispatch import autotune
    from gdr_dispatch.registry import get_backend

    x = _op_inputs(ShapeSpec(seqlens=(70, 1, 130), H=4, Hg=2, K=16, V=16))
    seen = []
    split = get_backend("torch@split2")
    real = type(split).forward
    monkeypatch.setattr(type(split), "forward", lambda self, *a, **k: seen.append((a[0].shape, a[6] is not None,
                                                                                    a[7].tolist())) or real(self, *a, **k))
    job = autotune.forward_job("torch@split2", x["q"], x["v"], x["g"], x["beta"], x["initial_state"], x["cu_seqlens"],
                               (70, 1, 130), 0.25, False, True, False)
    assert autotune.run_compile_job(job) >= 0
    assert seen == [((1, 201, 2, 16), True, [0, 70, 71, 201])]
