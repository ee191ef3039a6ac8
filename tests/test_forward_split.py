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
    monkeypatch.setattr(autotune, "start_compiles", lambda jobs, **kw: started.extend(jobs) or len(jobs))
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


# -- the backward on the split forward's carried plan, maps and start states (backends/split/carry.py)
class _FakeSplit(Backend):
    """The torch reference as a provider and backend the split may wrap both ways."""

    name = "fake_split"
    forward_rank = 1
    split_candidate = True

    def not_supported_reasons(self, problem):
        return []

    def forward(self, *args, **kwargs):
        return registry.get_backend("torch").forward(*args, **kwargs)

    def run(self, call):
        return registry.get_backend("torch").run(call)


def _op_grads(x, monkeypatch, forward, backward, allow):
    """Gradients of the op (eager) with `GDR_FORWARD=forward`, `GDR_BACKEND=backward`, carrying
    allowed or not; and the `carried` each split backward got."""
    from gdr_dispatch.backends.split import passes as cp

    from gdr_dispatch.backends.split import carry

    monkeypatch.setenv("GDR_FORWARD", forward)
    monkeypatch.setenv("GDR_BACKEND", backward)
    monkeypatch.setattr(carry, "GPU_VERIFIED", allow)  # the carry's gate
    if allow:
        monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    else:
        monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    clear_caches()
    seen = []
    real = cp.split_backward

    def spy(call, segments, run, states_by_run=False, carried=()):
        seen.append(carried)
        return real(call, segments, run, states_by_run=states_by_run, carried=carried)

    monkeypatch.setattr(cp, "split_backward", spy)
    leaves = {n: (t.clone().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
              for n, t in x.items()}
    o, ht = chunk_gated_delta_rule(**leaves, output_final_state=True)
    ((o * o.detach().sin()).sum() + (ht * ht.detach().cos()).sum()).backward()
    return [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state") if leaves[n] is not None], seen


@pytest.mark.parametrize("gate", ["logsigmoid", "mixed"])
@pytest.mark.parametrize("spec", SHAPES[:3], ids=lambda s: s.label())
def test_the_split_backward_takes_the_split_forwards_starts_and_matches(spec, gate, monkeypatch, with_backends):
    """With the forward and the backward split alike (`@split3` both), the backward takes the
    forward's completed start states (its own pass 1 then walks only backwards) and its gradients
    are the ones it computes on its own; with its gate closed (`carry.GPU_VERIFIED`, no
    GDR_ALLOW_UNVERIFIED) nothing is carried."""
    with_backends(_FakeSplit())
    x = _op_inputs(replace(spec, gate=gate))
    own, seen_own = _op_grads(x, monkeypatch, "fake_split@split3", "fake_split@split3", allow=False)
    assert seen_own == [()]
    from gdr_dispatch.backends.split import passes as cp

    firsts, real_pass_1 = [], cp.pass_1  # what each pass 1 was asked: its own starts, and the carry's size
    monkeypatch.setattr(cp, "pass_1", lambda call, segs, seg_call, need_starts, need_ends=True, carried=():
                        firsts.append((need_starts, len(carried)))
                        or real_pass_1(call, segs, seg_call, need_starts, need_ends, carried))
    carried, seen = _op_grads(x, monkeypatch, "fake_split@split3", "fake_split@split3", allow=True)
    assert len(seen) == 1 and len(seen[0]) == 3
    assert (False, 3) in firsts, firsts  # the backward's pass 1 took the carry and formed no starts
    plan, M, starts = seen[0]
    assert plan.dtype == torch.int32 and starts.dtype == torch.float64 and M.shape[-1] == spec.K
    for a, b in zip(carried, own):
        assert _rel(a, b) < 1e-12


def test_a_backward_split_otherwise_or_unsplit_takes_nothing(monkeypatch, with_backends):
    """Other segments (split4 after the forward's split3), or an unsplit forward: nothing is
    taken, and the gradients are still the whole ones."""
    with_backends(_FakeSplit())
    x = _op_inputs(replace(SHAPES[2], gate="mixed"))
    whole, _ = _op_grads(x, monkeypatch, "fake_split", "fake_split", allow=True)
    for forward, backward in (("fake_split@split3", "fake_split@split4"), ("fake_split", "fake_split@split3")):
        grads, seen = _op_grads(x, monkeypatch, forward, backward, allow=True)
        assert seen == [()], (forward, backward)
        for a, b in zip(grads, whole):
            assert _rel(a, b) < 1e-10


def test_the_ops_context_drops_the_carry_once_its_backward_used_it(monkeypatch, with_backends):
    """What a forward kept for its backward (a split forward's carry: its graph's own, lent
    buffers) is dropped from the op's context by the backward that used it: a training loop that
    keeps its loss into the next step must not hold it, or the next forward finds them held."""
    import gc
    import weakref

    from gdr_dispatch import carry as channel

    class Kept:
        pass

    kept, seen = [], []

    class Keeping(_FakeForward):
        def forward(self, *args, **kwargs):
            kept.append(Kept())
            channel.keep(kept[-1])
            return super().forward(*args, **kwargs)

    with_backends(Keeping())
    monkeypatch.setenv("GDR_FORWARD", "fake_forward")
    real = training._backward_impl
    monkeypatch.setattr(training, "_backward_impl", lambda *a: (seen.append(channel.offered() is not None), real(*a))[1])
    x = make_inputs(ShapeSpec(B=1, T=70, H=2, K=8, V=8, dtype="float32", h="none"), "cpu")
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g_raw", "b")}
    o, _ = chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g_raw"], leaves["b"])
    loss = o.sum()
    alive = weakref.ref(kept.pop())
    loss.backward()
    gc.collect()
    assert seen == [True] and alive() is None  # offered to the backward, then dropped
    assert loss.grad_fn is not None  # (the graph's nodes still there)


def test_the_carry_is_this_calls_only(monkeypatch):
    """`take` refuses a carry offered for another call: another G, other keys, other segments."""
    from gdr_dispatch import carry as channel
    from gdr_dispatch.backends.split import carry

    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    G, k, b, a = torch.zeros(1, 128, 2), torch.zeros(1, 128, 1, 8), torch.zeros(1, 128, 2), torch.zeros(1, 128, 2, 64)
    v = torch.zeros(1, 128, 2, 8)
    offsets = (0, 64, 128)
    with channel.keeping() as held:
        assert carry.wanted()
        carry.keep(G, k, v, b, a, None, offsets, torch.zeros(2, 2, 2), torch.zeros(1), torch.zeros(1))
    assert len(held) == 1 and not carry.wanted()
    with channel.offering(held[0]):
        assert carry.take(G, k, v, b, a, None, offsets) is held[0]
        assert carry.take(G.clone(), k, v, b, a, None, offsets) is None
        assert carry.take(G, k.clone(), v, b, a, None, offsets) is None
        assert carry.take(G, k, v.clone(), b, a, None, offsets) is None
        assert carry.take(G, k, v, b, a, torch.zeros(1, 2, 8, 8), offsets) is None
        assert carry.take(G, k, v, b, a, None, (0, 128)) is None
        assert carry.take(G[:, :64], k, v, b, a, None, offsets) is None
        monkeypatch.delenv("GDR_ALLOW_UNVERIFIED")
        monkeypatch.setattr(carry, "GPU_VERIFIED", False)
        assert carry.take(G, k, v, b, a, None, offsets) is None  # not with its gate closed
        monkeypatch.setattr(carry, "GPU_VERIFIED", True)
    assert carry.take(G, k, v, b, a, None, offsets) is None  # nothing offered
    with channel.keeping() as held:  # a measured candidate's carry is dropped before the pick runs
        monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
        carry.keep(G, k, v, b, a, None, offsets, torch.zeros(2, 2, 2), torch.zeros(1), torch.zeros(1))
        channel.discard()
    assert held == []


@pytest.mark.parametrize("gate", ["logsigmoid", "logsigmoid16"])
def test_the_carried_backward_on_our_kernels_walks_only_backwards_and_matches(gate, monkeypatch):
    """Pass 1 on our decay-aware kernels (Triton's interpreter, fp16): the split forward's plan,
    exact maps and completed starts carried into the split backward give its own result, the
    backward running no plan and no forward walk."""
    from gdr_dispatch.backends.kernels import segment_maps
    from gdr_dispatch.backends.split import forward as fw
    from gdr_dispatch.backends.split import passes as cp
    from gdr_dispatch.contract import validate

    monkeypatch.setattr(cp, "_maps_kernels_refusal", lambda seg_call: "")
    monkeypatch.setattr(cp, "_pieces_kernels_refusal", lambda seg_call: "")
    monkeypatch.setattr(cp, "_states_kernel", lambda call, seg_call, provider: None)
    torch_backend = registry.get_backend("torch")
    x = make_inputs(ShapeSpec(B=1, T=900, H=2, K=16, V=16, dtype="float16", h="none", gate=gate), "cpu", seed=5)
    scale = 16 ** -0.5
    o, ht, G, a, h, plan, M, starts = fw.split_forward(
        torch_backend, 3, x["q"], x["k"], x["v"], x["g_raw"], x["b"], scale, x["initial_state"], None, False, True,
        64, need_states=False, carry=True)
    # warm windows at the strong gate (the carried plan's), exact segments at the weak one (its maps;
    # windows reaching into the neighbouring segments warm some of them)
    assert bool((plan[..., 0] > 0).any()) if gate == "logsigmoid" else bool((plan[1:, :, 0] == 0).any()), plan
    assert bool((plan[1:, :, 0] == 0).any()) == (gate == "logsigmoid16"), plan
    call = validate(x["q"], x["k"], x["v"], a, G, x["b"], x["do"], x["dht"], None, scale=scale,
                    initial_state=x["initial_state"], chunk_size=64)
    calls = []
    real_plan = segment_maps.decay_plan
    monkeypatch.setattr(segment_maps, "decay_plan", lambda *a, **k: calls.append("decay_plan") or real_plan(*a, **k))
    monkeypatch.setattr(segment_maps, "_forward_maps", _Recorded(segment_maps._forward_maps, "_forward_maps", calls))
    monkeypatch.setattr(segment_maps, "_backward_maps", _Recorded(segment_maps._backward_maps, "_backward_maps", calls))
    own = cp.split_backward(call, 3, run=torch_backend.run)
    assert calls == ["decay_plan", "_forward_maps", "_backward_maps"], calls
    calls.clear()
    got = cp.split_backward(call, 3, run=torch_backend.run, carried=(plan, M, starts))
    assert calls == ["_backward_maps"], calls
    for n in ("dq", "dk", "dv", "dg", "db", "dh0"):
        assert _rel(getattr(got, n).double(), getattr(own, n).double()) < 1e-6, n


class _Recorded:
    """A Triton kernel's launches recorded (`kernel[grid](...)`), then run."""

    def __init__(self, kernel, name, calls):
        self.kernel, self.name, self.calls = kernel, name, calls

    def __getitem__(self, grid):
        self.calls.append(self.name)
        return self.kernel[grid]


class _StandInGraph:
    """A CUDA graph's stand-in on the CPU: its replay recomputes `fn` on the static inputs into the
    static outputs (what a real replay does with the captured kernels)."""

    def __init__(self, fn, static, out):
        self.fn, self.static, self.out = fn, static, out

    def replay(self):
        for o, new in zip(self.out, self.fn(self.static)):
            if o is not None:
                o.copy_(new)


@pytest.mark.parametrize("in_place", [False, True], ids=["copies", "in_place_allowed"])
def test_a_replayed_carried_backward_reads_each_calls_plan(in_place, monkeypatch):
    """The split backward on a carry, replayed from its graph with copies in (layers of one shape
    at other addresses): each call's carried plan (an integer input) is copied in with its maps and
    starts, so gates that change the plan between calls still give the backward's own result (a
    graph that kept the captured call's plan was 4e-2 off, silently)."""
    from gdr_dispatch import carry as channel
    from gdr_dispatch.backends.split import SplitBackend, graphs
    from gdr_dispatch.backends.split import passes as cp
    from gdr_dispatch.contract import validate

    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1" if in_place else "")
    monkeypatch.setattr("gdr_dispatch.backends.split.carry.allowed", lambda: True)
    monkeypatch.setattr(cp, "_maps_kernels_refusal", lambda seg_call: "")
    monkeypatch.setattr(cp, "_pieces_kernels_refusal", lambda seg_call: "")
    monkeypatch.setattr(cp, "_states_kernel", lambda call, seg_call, provider: None)
    monkeypatch.setattr(graphs, "wanted", lambda q: True)

    def capture(name, key, tensors, fn, seq_lens, in_place=False, pool=None, into=None):
        static = tensors if in_place else tuple(
            None if x is None else x.clone(memory_format=torch.contiguous_format) for x in tensors)
        out = fn(static)
        return _StandInGraph(fn, static, out), None if in_place else static, out, (
            graphs.addresses(tensors) if in_place else None)

    monkeypatch.setattr(graphs, "_capture", capture)
    clear_caches()
    torch_backend = registry.get_backend("torch")
    split = SplitBackend(torch_backend, 3)
    windows = []
    for step, gate in enumerate(["logsigmoid16", "logsigmoid16", "logsigmoid", "logsigmoid16", "logsigmoid"]):
        x = make_inputs(ShapeSpec(B=1, T=900, H=2, K=16, V=16, dtype="float16", h="none", gate=gate), "cpu",
                        seed=5 + step)
        with channel.keeping() as held:
            _, _, G, a, _ = split.forward(x["q"], x["k"], x["v"], x["g_raw"], x["b"], 0.25, x["initial_state"], None,
                                          False, True, 64, need_states=False)
        assert len(held) == 1
        windows.append(int((held[0].plan[..., 0] > 0).sum()))
        call = validate(x["q"], x["k"], x["v"], a, G, x["b"], x["do"], x["dht"], None, scale=0.25,
                        initial_state=x["initial_state"], chunk_size=64)
        own = cp.split_backward(call, 3, run=torch_backend.run)
        with channel.offering(held[0]):
            got = split.run(call)
        for n in ("dq", "dk", "dv", "dg", "db", "dh0"):
            assert _rel(getattr(got, n).double(), getattr(own, n).double()) < 1e-6, (step, gate, n)
    assert len(set(windows)) > 1, windows  # the plan changed between calls
    assert graphs.replays["copied"] + graphs.replays["in place"] >= 2


def test_a_forward_it_does_not_measure_builds_its_providers_kernels_early_and_waits(monkeypatch, with_backends):
    """Where the first forward at a shape measures nothing (here GDR_FORWARD), its provider's own
    kernel builds (`forward_compile_jobs`, with the call's forward spec) start in background
    processes before the backward's, and the forward runs only after waiting for each; a second
    call starts nothing."""
    from gdr_dispatch import autotune

    class Building(_FakeForward):
        def forward_compile_jobs(self, spec, device):
            return [("m", "half", (half, spec, device)) for half in ("residuals", "kernel")]

    with_backends(Building())
    monkeypatch.setenv("GDR_FORWARD", "fake_forward")
    events, specs = [], []
    monkeypatch.setattr(autotune, "start_compiles",
                        lambda jobs, **kw: specs.append([j[2][1] for j in jobs if j[0] == "m"])
                        or events.append(("start", [j[2][0] for j in jobs])) or len(jobs))
    monkeypatch.setattr(autotune, "wait_early", lambda job: events.append(("wait", job[2][0])))
    real = Building.forward
    monkeypatch.setattr(Building, "forward", lambda self, *a, **k: events.append(("forward",)) or real(self, *a, **k))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the trigger's own check
    x = _op_inputs(ShapeSpec(B=2, T=100, H=2, K=16, V=16))
    clear_caches()
    q = x["q"].clone().requires_grad_(True)
    chunk_gated_delta_rule(q, x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                           output_final_state=True)
    starts = [e for e in events if e[0] == "start" and e[1]]
    assert starts and starts[0] == ("start", ["residuals", "kernel"])  # before the backward's
    forward_at = events.index(("forward",))
    assert events.index(("wait", "residuals")) < forward_at and events.index(("wait", "kernel")) < forward_at
    spec = autotune.forward_spec(q, x["v"], x["g"], x["beta"], x["initial_state"], None, (100, 100),
                                 16 ** -0.5, False, True, False)
    assert dict(spec)["B"] == 2 and dict(spec)["T"] == 100 and dict(spec)["need_final"] is True
    assert next(sp for sp in specs if sp) == [spec, spec]  # the first builds were told this very call
    events.clear()
    chunk_gated_delta_rule(q, x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                           output_final_state=True)
    assert [e for e in events if e[0] != "forward" and e[1]] == []
