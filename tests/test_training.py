"""The training drop-in `chunk_gated_delta_rule`: forward, autograd through the dispatcher,
torch.compile. On the CPU in float64 against the token-by-token oracle; GPU cases in test_gpu.py."""

import pytest
import torch

from gdr_dispatch import Backend, chunk_gated_delta_rule, clear_caches, oracle_grads, registry
from gdr_dispatch.reference import recurrent_forward

F64 = torch.float64


def inputs(B=2, T=100, Hg=2, H=4, K=16, V=8, seqlens=None, h0=True, v_first=False, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if seqlens is not None:
        B, T = 1, sum(seqlens)
    N = B if seqlens is None else len(seqlens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    x = dict(
        q=rnd(B, T, Hg, K).to(dtype), k=torch.nn.functional.normalize(rnd(B, T, Hg, K), dim=-1).to(dtype),
        v=rnd(B, T, H, V).to(dtype), g=(-0.5 * torch.rand(B, T, H, generator=gen, dtype=F64)).to(
            F64 if dtype == F64 else torch.float32),
        beta=torch.rand(B, T, H, generator=gen, dtype=F64).to(dtype),
        initial_state=(rnd(N, H, V, K) if v_first else rnd(N, H, K, V)).to(
            F64 if dtype == F64 else torch.float32) if h0 else None,
        cu_seqlens=None if seqlens is None else torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()],
                                                             dtype=torch.int32),
        state_v_first=v_first,
    )
    return x


def leaves(x):
    return {n: (t.clone().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
            for n, t in x.items()}


CASES = [
    dict(),  # T % 64 != 0, grouped heads, both states
    dict(h0=False),
    dict(seqlens=(1, 63, 64, 65)),
    dict(seqlens=(1, 63, 64, 65), v_first=True, Hg=4),
    dict(T=40, Hg=4, h0=False),
]


@pytest.mark.parametrize("save_states", [False, True])
@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_matches_the_float64_oracle(case, final, save_states):
    x = leaves(inputs(**case))
    o, ht = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                   output_final_state=final, cu_seqlens=x["cu_seqlens"],
                                   state_v_first=x["state_v_first"], save_states=save_states)
    assert (ht is None) == (not final)
    o_ref, ht_ref = recurrent_forward(*(x[n].detach() for n in ("q", "k", "v", "g", "beta")),
                                      initial_state=None if x["initial_state"] is None else x["initial_state"].detach(),
                                      cu_seqlens=x["cu_seqlens"], state_v_first=x["state_v_first"])
    assert ((o - o_ref).norm() / o_ref.norm()).item() < 1e-10
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    loss = (o * do).sum()
    dht = None
    if final:
        assert ((ht - ht_ref).norm() / ht_ref.norm()).item() < 1e-10
        dht = torch.randn(ht.shape, generator=gen, dtype=F64)
        loss = loss + (ht * dht).sum()
    loss.backward()
    ref = oracle_grads(x["q"], x["k"], x["v"], x["g"], x["beta"], do, dht, initial_state=x["initial_state"],
                       cu_seqlens=x["cu_seqlens"], state_v_first=x["state_v_first"])
    got = dict(dq=x["q"].grad, dk=x["k"].grad, dv=x["v"].grad, dg=x["g"].grad, db=x["beta"].grad,
               dh0=None if x["initial_state"] is None else x["initial_state"].grad)
    for name in ref._fields:
        want = getattr(ref, name)
        if want is None:
            assert got[name] is None
            continue
        assert got[name] is not None and got[name].shape == want.shape, name
        assert ((got[name] - want).norm() / want.norm()).item() < 1e-10, name


class Recorder(Backend):
    """Runs the torch backend and remembers whether the call carried `h`."""

    name = "fake_recorder"

    def __init__(self):
        self.h_given = []

    def not_supported_reasons(self, problem):
        return []

    def run(self, call):
        self.h_given.append(call.h is not None)
        return registry.get_backend("torch").run(call)


@pytest.fixture
def recorder(monkeypatch, with_backends):
    rec = with_backends(Recorder())
    monkeypatch.setenv("GDR_BACKEND", rec.name)
    yield rec


@pytest.mark.parametrize("env,arg,saved", [(None, None, False), ("1", None, True), ("0", True, True),
                                           ("yes", False, False)])
def test_the_backward_runs_through_the_dispatcher_with_or_without_states(recorder, monkeypatch, env, arg, saved):
    if env is not None:
        monkeypatch.setenv("GDR_SAVE_STATES", env)
    x = leaves(inputs())
    o, _ = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                  save_states=arg)
    o.sum().backward()
    assert recorder.h_given == [saved]


def test_a_bad_gdr_save_states_is_an_error(monkeypatch):
    monkeypatch.setenv("GDR_SAVE_STATES", "sometimes")
    x = inputs()
    with pytest.raises(ValueError, match="GDR_SAVE_STATES"):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])


@pytest.mark.parametrize("flag", ["output_final_state", "state_v_first", "save_states"])
@pytest.mark.parametrize("value", ["False", None, 1])
def test_a_flag_that_is_not_a_bool_is_an_error_naming_it(flag, value):
    """bool("False") is True: a flag is taken only as a bool, never coerced (save_states=None:
    GDR_SAVE_STATES decides)."""
    if flag == "save_states" and value is None:
        pytest.skip("None is save_states' default")
    x = inputs()
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **{flag: value})


def test_the_states_are_kept_only_for_a_backward_that_can_run(monkeypatch):
    """save_states keeps the chunk states for the backward: none under no_grad, none when no input
    requires grad, kept when one does."""
    from gdr_dispatch import training

    seen = []
    real = training._forward_impl
    monkeypatch.setattr(training, "_forward_impl", lambda *a: seen.append(a[-1]) or real(*a))
    x = inputs()
    with torch.no_grad():
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], save_states=True)
    chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], save_states=True)
    y = leaves(x)
    chunk_gated_delta_rule(y["q"], x["k"], x["v"], x["g"], x["beta"], save_states=True)
    assert seen == [False, False, True]


def test_under_autocast_the_op_and_the_backward_compute_as_without():
    """torch.autocast (HF Trainer's bf16) would run the math's torch products in 16 bits: the op
    and fused_gdr_bwd run with it off, so fp32 inputs give what they give without it."""
    from gdr_dispatch import fused_gdr_bwd
    from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs

    x = inputs(dtype=torch.float32)

    def step():
        y = leaves(x)
        o, ht = chunk_gated_delta_rule(y["q"], y["k"], y["v"], y["g"], y["beta"], initial_state=y["initial_state"],
                                       output_final_state=True)
        (o.sum() + ht.sum()).backward()
        return [o, ht] + [y[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")]

    plain = step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = step()
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(cast, plain))
    kw = call_kwargs(make_inputs(ShapeSpec(B=1, T=100, H=2, K=16, V=16, dtype="float32", h="none"), "cpu", seed=2))
    want = fused_gdr_bwd(**kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_gdr_bwd(**kw)
    assert all(a is None or torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))


def test_a_compiled_call_with_dynamic_shapes_names_sizes_as_numbers():
    """torch.compile(dynamic=True) traces symbolic sizes: the bad argument's message still reads
    `[2, 100, 3]`, not `[s85, s34, s58]`."""
    x = inputs()

    def f(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta)[0]

    with pytest.raises(Exception) as info:
        torch.compile(f, dynamic=True, backend="aot_eager")(x["q"], x["k"], x["v"], x["g"][..., :3], x["beta"])
    assert "g: expected shape [2, 100, 4]" in str(info.value) and "got [2, 100, 3]" in str(info.value), str(info.value)


def test_a_parameter_takes_the_eager_path():
    """A learnt initial state (an nn.Parameter) is a plain tensor to the op's eager path."""
    from gdr_dispatch import training

    x = inputs()
    h0 = torch.nn.Parameter(x["initial_state"])
    assert training._eager_call(x["q"], x["k"], x["v"], x["g"], x["beta"], h0, None)


@pytest.mark.parametrize("change,exc,words", [
    (dict(g=torch.zeros(2, 100, 3)), ValueError, ["g:", "[2, 100, 4]"]),
    (dict(beta=torch.zeros(2, 100, 4, 1)), ValueError, ["beta:", "[2, 100, 4]"]),
    (dict(v=torch.zeros(2, 100, 3, 8, dtype=F64)), ValueError, ["H=3", "Hg=2"]),
    (dict(k=torch.zeros(2, 100, 2, 16, dtype=torch.float32)), TypeError, ["k:", "dtype of q"]),
    (dict(initial_state=torch.zeros(3, 4, 16, 8)), ValueError, ["initial_state:", "N=2"]),
    (dict(cu_seqlens=torch.tensor([0, 100], dtype=torch.int32)), ValueError, ["cu_seqlens:", "B == 1"]),
])
def test_bad_calls_name_the_argument(change, exc, words):
    x = {**inputs(), **change}
    with pytest.raises(exc) as info:
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               cu_seqlens=x.get("cu_seqlens"))
    assert all(w in str(info.value) for w in words), str(info.value)


def test_torch_compile_traces_it_in_one_graph():
    """fullgraph=True fails on any graph break; aot_eager traces forward and backward through the
    ops' fake implementations without generating code."""
    x = inputs(dtype=torch.float32, T=70)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8, dtype=torch.float32)

        def forward(self, q, k, v, g, beta, h0):
            o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
            return self.proj(o).sum() + ht.square().sum()

    torch.manual_seed(0)
    layer = Layer()
    args = [x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    eager = layer(*args)
    eager.backward()
    want = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got_loss = compiled(*args)
    got_loss.backward()
    assert torch.allclose(got_loss, eager, rtol=1e-5)
    for w, a in zip(want, args):
        assert torch.allclose(a.grad, w, rtol=1e-4, atol=1e-6)


def test_the_forward_comes_from_the_lowest_ranked_backend_that_takes_it_and_is_named(caplog):
    """On a CPU only the torch reference offers a forward (fla's and FlashQLA's need a GPU)."""
    import logging

    from gdr_dispatch import training

    x = inputs()
    p = training.forward_problem(x["q"], x["v"], x["beta"], x["initial_state"], None, False)
    assert training.select_forward(p).name == "torch"
    with caplog.at_level(logging.INFO, logger="gdr_dispatch"):
        clear_caches()
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert any(r.getMessage().startswith("gdr_dispatch: forward torch for") for r in caplog.records)


def test_gdr_forward_forces_one_and_says_why_it_cannot(monkeypatch):
    x = inputs()
    monkeypatch.setenv("GDR_FORWARD", "fla")
    with pytest.raises(ValueError, match="GDR_FORWARD=fla: its forward cannot take .*needs a CUDA device"):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
    monkeypatch.setenv("GDR_FORWARD", "no-such")
    with pytest.raises(ValueError, match="unknown backend 'no-such'"):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])


def test_an_unverified_forward_is_refused_with_its_reason(monkeypatch, with_backends):
    """A backend whose forward has not passed the GPU tests is skipped by the ranking and refused
    when forced, unless GDR_ALLOW_UNVERIFIED; one that offers no forward says so."""
    from gdr_dispatch import training

    class Fresh(Backend):
        name = "fresh-forward"
        forward_rank = 0
        forward_verified = False

        def not_supported_reasons(self, problem):
            return []

        def forward(self, *args, **kwargs):
            return registry.get_backend("torch").forward(*args, **kwargs)

    with_backends(Fresh())
    x = inputs()
    p = training.forward_problem(x["q"], x["v"], x["beta"], x["initial_state"], None, False)
    assert training.select_forward(p).name == "torch"
    monkeypatch.setenv("GDR_FORWARD", Fresh.name)
    with pytest.raises(ValueError, match="not verified on a GPU yet"):
        training.select_forward(p)
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert training.select_forward(p).name == Fresh.name
    monkeypatch.delenv("GDR_FORWARD")
    assert training.select_forward(p).name == Fresh.name  # rank 0, now allowed
    assert registry.get_backend("triton_wide").forward_supported(p) == (False, "triton_wide offers no forward")
