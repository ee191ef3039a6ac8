"""What a hostile user found (the op in real models, a-i): each case fails before its fix.

a. a cu_seqlens buffer refilled behind autograd's back (numpy, .data) is read as it is now;
b. the op's forward runs the backward's value checks; the reference functions validate;
c. compiled, shape errors still name the argument;
d. host memory stays bounded over thousands of packings;
e. bad environment values and arguments name themselves;
f. bad grid files and CLI arguments are errors, not tracebacks;
g. a table rewrite killed midway leaves no temporary file behind; big tables load fast;
h. meta tensors get a clear refusal;
i. what fla's op takes (16-bit g and initial_state) the op takes.
"""

import logging
import random

import numpy as np
import pytest
import torch

from gdr_dispatch import (NoBackendError, caches, chunk_gated_delta_rule, fused_gdr_bwd, oracle_grads,
                          prepare_residuals)
from fixtures import host_growth, int_reads
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs


def op_inputs(seqlens=(5, 70), H=2, K=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(seqlens)
    q = torch.randn(1, T, H, K, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(1, T, H, K, generator=gen, dtype=dtype)
    g = -0.5 * torch.rand(1, T, H, generator=gen, dtype=dtype)
    beta = torch.rand(1, T, H, generator=gen, dtype=dtype)
    cu = torch.tensor([0, *np.cumsum(seqlens)], dtype=torch.int32)
    return q, k, v, g, beta, cu


def op_grads(q, k, v, g, beta, cu):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=cu)
    o.square().sum().backward()
    return o.detach(), [x.grad for x in leaves]


# -- a. no stale lengths -------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["numpy", "data"])
def test_a_refilled_cu_seqlens_gives_the_refilled_lengths_in_the_op_and_the_backward(how):
    q, k, v, g, beta, cu = op_inputs()
    buf = np.array([0, 5, 75], dtype=np.int32)
    mine = torch.from_numpy(buf)
    op_grads(q, k, v, g, beta, mine)  # lengths 5, 70 (remembered, were there a memory)
    if how == "numpy":
        buf[1] = 40
    else:
        mine.data[1] = 40
    got_o, got = op_grads(q, k, v, g, beta, mine)
    want_o, want = op_grads(q, k, v, g, beta, torch.tensor([0, 40, 75], dtype=torch.int32))
    assert torch.allclose(got_o, want_o)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)
    x = make_inputs(ShapeSpec(seqlens=(40, 35), H=2, K=8, V=8, dtype="float64", h="none"), "cpu")
    kw = {**call_kwargs(x), "max_seqlen": None}
    buf2 = np.array([0, 5, 75], dtype=np.int32)
    cu2 = torch.from_numpy(buf2)
    fused_gdr_bwd(**{**kw, "cu_seqlens": cu2, "initial_state": None, "dht": None})
    buf2[1] = 40
    a = fused_gdr_bwd(**{**kw, "cu_seqlens": cu2, "initial_state": None, "dht": None})
    b = fused_gdr_bwd(**{**kw, "initial_state": None, "dht": None})
    assert torch.allclose(a.dq, b.dq)


# -- b. the forward's value checks, and the reference functions' ----------------------------------
@pytest.mark.parametrize("cu, words", [([1, 5, 75], "start at 0"), ([0, 50, 40, 75], "non-decreasing"),
                                       ([0, 5, 60], "end at T=75"), ([0, 5, 80], "end at T=75")])
def test_the_op_checks_cu_seqlens_values_as_the_backward_does(cu, words):
    q, k, v, g, beta, _ = op_inputs()
    with pytest.raises(ValueError, match=f"cu_seqlens: .*{words}"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor(cu, dtype=torch.int32))


@pytest.mark.parametrize("scale, exc, words", [(float("nan"), ValueError, "finite"), (float("inf"), ValueError, "finite"),
                                               ("abc", TypeError, "scale: expected a float")])
def test_the_op_checks_scale(scale, exc, words):
    q, k, v, g, beta, cu = op_inputs()
    with pytest.raises(exc, match=words):
        chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, cu_seqlens=cu)


def test_the_reference_functions_validate_their_arguments():
    q, k, v, g, beta, cu = op_inputs()
    with pytest.raises(ValueError, match="chunk_size: expected a positive int"):
        prepare_residuals(q, k, v, g, beta, cu_seqlens=cu, chunk_size=0)
    with pytest.raises(ValueError, match="v: its head count H=3 must be a multiple"):
        prepare_residuals(q, k, torch.zeros(1, 75, 3, 8, dtype=q.dtype), torch.zeros(1, 75, 3, dtype=q.dtype),
                          torch.zeros(1, 75, 3, dtype=q.dtype), cu_seqlens=cu)
    with pytest.raises(ValueError, match="do: expected shape"):
        oracle_grads(q, k, v, g, beta, v[:, :10], cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens: expected to end at T=75"):
        oracle_grads(q, k, v, g, beta, v, cu_seqlens=torch.tensor([0, 5, 70], dtype=torch.int32))


# -- c. compiled, errors still name the argument --------------------------------------------------
@pytest.mark.parametrize("change, words", [
    ("beta", "beta: expected shape"), ("heads", "must be a multiple"), ("state", "initial_state: expected shape"),
    ("v_T", "v: expected shape")])
def test_compiled_calls_name_the_bad_argument(change, words):
    torch._dynamo.reset()
    B, T, H, K = 2, 70, 2, 8
    q = torch.randn(B, T, H, K)
    k, v, g, beta = q.clone(), torch.randn(B, T, H, K), -torch.rand(B, T, H), torch.rand(B, T, H)
    h0 = torch.zeros(B, H, K, K)
    if change == "beta":
        beta = torch.rand(B, T, 2 * H)
    elif change == "heads":
        v, g, beta, h0 = torch.randn(B, T, 3, K), -torch.rand(B, T, 3), torch.rand(B, T, 3), torch.zeros(B, 3, K, K)
    elif change == "state":
        h0 = torch.zeros(B + 1, H, K, K)
    else:
        v = torch.randn(B, T + 1, H, K)

    def f(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)[0].sum()

    with pytest.raises(Exception, match=words):
        torch.compile(f, fullgraph=True, backend="eager")(q, k, v, g, beta, h0)


# -- d. bounded memory -----------------------------------------------------------------------------
@pytest.mark.slow
def test_ten_thousand_random_packings_keep_the_host_memory_bounded(caplog):
    """The log-once keys and every memo are bounded (caches.py): a varlen run that packs its
    sequences differently every step adds nothing per step once the buckets are seen."""
    rng = random.Random(0)
    x = make_inputs(ShapeSpec(seqlens=(64,), H=2, K=8, V=8, dtype="float32", h="none"), "cpu")
    from gdr_dispatch import dispatch
    from gdr_dispatch.contract import validate
    from gdr_dispatch.problem import Problem

    T = 512
    kw = {n: x[n] for n in ("scale",)}
    tensors = {n: torch.zeros(1, T, *x[n].shape[2:], dtype=x[n].dtype)
               for n in ("q", "k", "v", "a", "g", "b", "do")}

    def step():
        cuts = sorted(rng.sample(range(1, T), rng.randint(1, 20)))
        cu = torch.tensor([0, *cuts, T], dtype=torch.int32)
        call = validate(**tensors, cu_seqlens=cu, **kw)
        problem = Problem.from_call(call)
        choice = dispatch.select_backend(problem, call)
        dispatch._log_choice(problem, choice)
        caches.first_time(("forward", problem.table_key(), "torch"))

    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        grown, memos = host_growth(step)
    assert memos < 50, caches.sizes()
    assert grown < 512 * 1024, f"host memory grew by {grown} bytes over 10,000 packings"


# -- e. bad environment values and arguments name themselves ---------------------------------------
@pytest.mark.parametrize("var, value, words", [
    ("GDR_BACKEND", "banana", "GDR_BACKEND=banana: unknown backend 'banana'"),
    ("GDR_BACKEND", "TORCH", "case-sensitive: did you mean 'torch'"),
    ("GDR_BACKEND", "torch@split2", "torch is not split"),
    ("GDR_FORWARD", "banana", "GDR_FORWARD=banana: unknown backend 'banana'"),
])
def test_bad_environment_values_name_the_variable(monkeypatch, var, value, words):
    q, k, v, g, beta, cu = op_inputs()
    monkeypatch.setenv(var, value)
    with pytest.raises((ValueError, NoBackendError), match=words.replace("(", r"\(")):
        o, _ = chunk_gated_delta_rule(*(x.requires_grad_(True) for x in (q, k, v, g, beta)), cu_seqlens=cu)
        o.sum().backward()


def test_a_0_d_q_and_a_string_scale_name_themselves():
    q, k, v, g, beta, cu = op_inputs()
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        chunk_gated_delta_rule(torch.tensor(1.0), k, v, g, beta)
    with pytest.raises(TypeError, match="scale: expected a float or None, got str"):
        chunk_gated_delta_rule(q, k, v, g, beta, scale="abc", cu_seqlens=cu)
    x = call_kwargs(make_inputs(ShapeSpec(B=1, T=70, H=2, K=8, V=8, dtype="float32", h="none"), "cpu"))
    with pytest.raises(TypeError, match="scale: expected a float or None, got str"):
        fused_gdr_bwd(**{**x, "scale": "abc"})


# -- f. the CLI ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [("- {B: 2, T: [\n", "not valid YAML"), ("- {B: 1, T: 64, H: abc}\n", "H: expected an integer"),
                                         ("- 5\n", "shape 1: a shape is a mapping"), ("- {B: 2.5, T: 64, H: 2}\n", "B: expected an integer")])
def test_a_bad_grid_is_an_error_not_a_traceback(tmp_path, capsys, text, words):
    from gdr_dispatch import cli

    grid = tmp_path / "grid.yaml"
    grid.write_text(text)
    assert cli.main(["tune", "--grid", str(grid), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err


def test_explain_with_bad_seqlens_says_what_it_takes(capsys):
    from gdr_dispatch import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["explain", "--seqlens", "abc"])
    assert info.value.code == 2
    assert "comma-separated token counts" in capsys.readouterr().err


# -- g. tables -------------------------------------------------------------------------------------
def test_a_killed_rewrite_leaves_no_temporary_file(tmp_path):
    from gdr_dispatch import tuning_table

    path = tuning_table.record("dev", "dev", {"a|b": {"winner": "torch", "candidates": {"torch": {"ms": 1.0}}}}, tmp_path)
    stale = path.with_name(path.name + ".abc123.tmp")  # what a writer killed by SIGTERM leaves
    stale.write_text("half a table")
    tuning_table.record("dev", "dev", {"c|d": {"winner": "torch", "candidates": {"torch": {"ms": 1.0}}}}, tmp_path)
    assert not stale.exists() and not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_a_ten_thousand_entry_table_loads_and_records_in_seconds(tmp_path):
    import time

    import yaml

    from gdr_dispatch import tuning_table

    entries = {f"dev|cpu|float32|K{i}|V8|H2|Hg2|BT64|none|waves1|tokens64|max64|torch=2": {
        "winner": "torch", "candidates": {"torch": {"ms": 1.0}, "fla": {"unsupported": "needs a CUDA device"}}}
        for i in range(10_000)}
    path = tmp_path / "dev.yaml"
    path.write_text(yaml.safe_dump({"format": 3, "entries": entries}))
    t0 = time.perf_counter()
    assert len(tuning_table.load_entries(path)) == 10_000
    loaded = time.perf_counter() - t0
    t0 = time.perf_counter()
    tuning_table.record("dev", "dev", {"x|y": {"winner": "torch"}}, tmp_path)
    recorded = time.perf_counter() - t0
    if getattr(yaml, "CSafeLoader", None) is not None:  # libyaml: the C loader and dumper
        assert loaded < 5 and recorded < 10, (loaded, recorded)


# -- h. meta tensors ----------------------------------------------------------------------------
def test_meta_tensors_get_a_refusal_naming_the_device():
    x = call_kwargs(make_inputs(ShapeSpec(B=1, T=70, H=2, K=8, V=8, dtype="float32", h="given"), "cpu"))
    meta = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    with pytest.raises(NoBackendError, match="torch: needs a CPU or CUDA device; the tensors are on meta"):
        fused_gdr_bwd(**meta)


# -- i. a drop-in for fla's op ----------------------------------------------------------------------
def test_16_bit_gates_and_initial_states_are_taken_as_fla_s_op_takes_them():
    """fla's own varlen tests pass g and initial_state in fp16; each gradient comes back in its
    input's dtype, computed in fp32 inside."""
    q, k, v, g, beta, cu = op_inputs(dtype=torch.float32)
    h0 = torch.randn(2, 2, 8, 8)
    leaves = [x.clone().to(torch.float16).requires_grad_(True) for x in (g, h0)]
    o, ht = chunk_gated_delta_rule(q, k, v, leaves[0], beta, initial_state=leaves[1], output_final_state=True,
                                   cu_seqlens=cu)
    (o.square().sum() + ht.square().sum()).backward()
    assert leaves[0].grad.dtype == torch.float16 and leaves[1].grad.dtype == torch.float16
    assert ht.dtype == torch.float32
    ref = [x.detach().float().requires_grad_(True) for x in leaves]
    o2, ht2 = chunk_gated_delta_rule(q, k, v, ref[0], beta, initial_state=ref[1], output_final_state=True,
                                     cu_seqlens=cu)
    (o2.square().sum() + ht2.square().sum()).backward()
    assert torch.allclose(o, o2) and torch.allclose(leaves[0].grad.float(), ref[0].grad, rtol=1e-2, atol=1e-2)
    assert torch.allclose(leaves[1].grad.float(), ref[1].grad, rtol=1e-2, atol=1e-2)
    assert ref[1].grad.abs().max() > 0.1  # (a gradient that could be told from zeros)


@pytest.mark.parametrize("how", ["numpy", "data"])
def test_a_cu_seqlens_refilled_between_the_forward_and_the_backward_leaves_the_backward_on_the_forward_s_lengths(how):
    """The next batch written into the same buffer before this one's backward (numpy, .data:
    autograd's version check sees neither) must not change this step's gradients."""
    q, k, v, g, beta, _ = op_inputs()
    buf = np.array([0, 5, 75], dtype=np.int32)
    cu = torch.from_numpy(buf)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=cu)
    if how == "numpy":
        buf[1] = 40
    else:
        cu.data[1] = 40
    o.square().sum().backward()
    _, want = op_grads(q, k, v, g, beta, torch.tensor([0, 5, 75], dtype=torch.int32))
    for a, b in zip(leaves, want):
        assert torch.allclose(a.grad, b, atol=1e-12)


def test_the_op_s_backward_copy_of_cu_seqlens_costs_no_second_read(monkeypatch):
    """The backward's private copy of cu_seqlens takes the values the forward's validation read,
    not a read of its own (on a GPU each read synchronises the stream)."""
    from gdr_dispatch import training

    q, k, v, g, beta, cu = op_inputs()
    reads = []
    monkeypatch.setattr(training, "offsets_of", lambda t: reads.append(1) or tuple(t.tolist()))
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=cu)
    with int_reads() as device_reads:  # and no read by any other route (the backward's own checks) either
        o.sum().backward()
    assert reads == [] and device_reads == []
    assert all(x.grad is not None for x in leaves)
