"""The FlashQLA peer backend on a machine without a GPU: registration, its refusal reasons
(FlashQLA 0.1.3's real limits), its plumbing against the oracle with a fake `flash_qla`
(fake_flash_qla.py), and the table keys it changes. Its GPU oracle tests are in test_gpu.py."""

import importlib.util
from dataclasses import replace

import pytest
import torch

from gdr_dispatch import toolchain
from gdr_dispatch.backends import flash_qla
from gdr_dispatch.problem import DeviceInfo
from gdr_dispatch.registry import registered_backends
from gdr_dispatch.shapes import ShapeSpec

from conftest import PLUMBING, plumbing_errors

H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), 132)
B200 = DeviceInfo("cuda", "NVIDIA B200", (10, 0), 148)
RTX5090 = DeviceInfo("cuda", "NVIDIA GeForce RTX 5090", (12, 0), 170)
L40 = DeviceInfo("cuda", "NVIDIA L40S", (8, 9), 142)


def problem(device=H200, version="0.1.3", **spec):
    p = ShapeSpec(**{"B": 2, "T": 4096, "H": 32, **spec}).problem(torch.device("cpu"))
    versions = tuple((k, v) for k, v in p.versions if k != "flash_qla") + (("flash_qla", version),)
    return replace(p, device=device, versions=versions)


@pytest.fixture
def importable(monkeypatch):
    """FlashQLA's import succeeds and nvcc is there (what a GPU machine with the extra has)."""
    monkeypatch.setattr(flash_qla, "_import_error", lambda: "")
    monkeypatch.setattr(toolchain, "nvcc_found", lambda: True)


def reasons(p):
    return flash_qla.FlashQLABackend().not_supported_reasons(p)


@pytest.mark.skipif(importlib.util.find_spec("flash_qla") is not None, reason="flash_qla is installed here")
def test_not_registered_without_the_package():
    assert "flash_qla" not in registered_backends()


def test_takes_the_training_shapes_where_it_has_kernels(importable):
    assert reasons(problem()) == []
    assert reasons(problem(device=B200)) == []
    assert reasons(problem(device=RTX5090, chunk_size=32)) == []
    assert reasons(problem(B=1, seqlens=(1, 63, 64, 65), H=32, Hg=16, state_v_first=True, h="none")) == []


def test_lists_every_reason_it_refuses(importable):
    text = "; ".join(reasons(problem(device=L40, K=64, dtype="float32")))
    for words in ("sm_90, sm_100, sm_103, sm_120 or sm_121", "sm_89", "K and V must be 128", "bfloat16 or float16"):
        assert words in text, text
    assert any("chunk_size must be 32 on sm_120" in r for r in reasons(problem(device=RTX5090)))
    assert any("chunk_size must be 64 on sm_90" in r for r in reasons(problem(chunk_size=32)))
    assert any("needs a CUDA device" in r for r in reasons(problem(device=DeviceInfo("cpu", "cpu", None, 8))))
    assert any("untested here" in r for r in reasons(problem(version="0.2.0")))
    assert reasons(problem(version=None)) == ["flash_qla is not installed (pip install 'gdr_dispatch[flashqla]')"]


def test_a_failed_import_is_a_reason_not_a_silent_absence(monkeypatch):
    monkeypatch.setattr(toolchain, "nvcc_found", lambda: True)
    monkeypatch.setattr(flash_qla, "_import_error",
                        lambda: "ValueError: FlashQLA now support sm90, sm100, sm103, sm120 and sm121 only.")
    (why,) = reasons(problem())
    assert "does not import here" in why and "ValueError" in why


def test_verified_on_a_gpu(importable, monkeypatch):
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    assert flash_qla.FlashQLABackend().supported(problem()) == (True, "")


@pytest.mark.parametrize("spec", [ShapeSpec(B=2, T=100, H=4, Hg=2, K=128, V=128, dtype="float16", h="given"),
                                  ShapeSpec(seqlens=(1, 63, 64, 65), H=4, K=128, V=128, dtype="float16", dht=False,
                                            state_v_first=True, h="none"),
                                  ShapeSpec(B=1, T=70, H=2, K=128, V=128, dtype="float16", h="given", chunk_size=32)],
                         ids=lambda s: f"{s.label()} chunk{s.chunk_size}")
def test_compile_job_runs_its_kernels_with_the_calls_keys(spec, monkeypatch):
    """A sweep compiles FlashQLA's kernels beforehand by running them on one chunk with the
    call's compile-time keys (head counts, dtypes, scale, flags): the warm-up's call must carry
    the same keys as the real one, or the real call compiles again."""
    import fake_flash_qla
    from gdr_dispatch.contract import validate
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    seen = []
    real_run = flash_qla.FlashQLABackend.run
    monkeypatch.setattr(flash_qla.FlashQLABackend, "run", lambda self, c: seen.append(c) or real_run(self, c))
    fake_flash_qla.install(monkeypatch)
    call = validate(**call_kwargs(make_inputs(spec, "cpu")))
    ((module, function, keys),) = flash_qla.FlashQLABackend().compile_jobs(call)
    assert module == flash_qla.__name__
    getattr(flash_qla, function)(*keys, device="cpu")
    (warm,) = seen

    def key(c):
        return (c.H, c.Hg, c.scale, c.state_v_first, c.chunk_size, c.initial_state is not None, c.dht is not None,
                *(None if t is None else t.dtype for t in (c.q, c.k, c.v, c.do, c.a, c.g, c.b, c.h, c.cu_seqlens)))

    assert key(warm) == key(call)


@pytest.mark.parametrize("h_mode", ["given", "none"])
@pytest.mark.parametrize("spec", PLUMBING, ids=lambda s: s.label())
def test_plumbing_against_the_oracle(spec, h_mode, monkeypatch, with_backends):
    """The conversions around FlashQLA's two calls (q-dtype a and h, the head reduction, the
    reverse chunk cumsum, dh0 and dht) with its kernels swapped for exact torch: fp16 inputs,
    so the result lands within fp16 rounding of the oracle; a missed step is off by O(1)."""
    import fake_flash_qla

    calls = fake_flash_qla.install(monkeypatch)
    with_backends(flash_qla.FlashQLABackend())
    monkeypatch.setattr(flash_qla.FlashQLABackend, "not_supported_reasons", lambda self, p: [])
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    errs = plumbing_errors("flash_qla", spec, h_mode, monkeypatch)
    assert not {n: e for n, e in errs.items() if not e < 5e-3}, errs
    assert ("fused_gdr_h" in calls) == (h_mode == "none"), "h given must not be recomputed"
    assert calls[-2:] == ["fused_gdr_bwd", "chunk_local_cumsum"]


@pytest.mark.parametrize("spec", PLUMBING + [ShapeSpec(B=1, T=100, H=4, Hg=2, K=32, V=16)], ids=lambda s: s.label())
@pytest.mark.parametrize("h_mode", ["given", "none"])
def test_a_plan_made_on_packed_tensors_packs_a_later_calls_views(spec, h_mode, monkeypatch):
    """The plan checks packing per call from its shapes (`packing_test`): a later call of the same
    shapes and dtypes with any one tensor as a strided view (a transpose, a split of a fused
    projection, a padded first dim: at B = 1 an odd stride of a size-1 dim, contiguous to torch),
    or all of them, reaches FlashQLA packed (the stand-in asserts it) and gives the packed call's
    gradients bit for bit; so do plans whose `a` and `h` are cast (fp32) and whose h0 is fp16."""
    import fake_flash_qla

    from gdr_dispatch.contract import validate
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    fake_flash_qla.install(monkeypatch)
    flash_qla._ops.cache_clear()
    kwargs = call_kwargs(make_inputs(replace(spec, dtype="float16", h=h_mode), "cpu", seed=3))

    def strided(name, x):
        if x.dim() == 1:  # cu_seqlens: every other element of a wider tensor
            return torch.stack([x, x], 1)[:, 0]
        if name in ("v", "b", "initial_state"):  # a padded first dim
            strides = (x.stride(0) + 8, *x.stride()[1:])
            return x.new_empty(x.shape[0] * strides[0]).as_strided(x.shape, strides).copy_(x)
        t = x.transpose(1, 2).contiguous().transpose(1, 2)
        if name in ("k", "g") or t.stride() == x.stride():  # a split of a fused projection
            return torch.cat([x, x], -1)[..., :x.shape[-1]]
        return t

    names = [n for n, x in kwargs.items() if isinstance(x, torch.Tensor)]
    assert {"q", "k", "v", "a", "g", "b", "do"} <= set(names)
    variants = [kwargs, {**kwargs, "a": kwargs["a"].float()}]
    if kwargs["h"] is not None:
        variants.append({**kwargs, "h": kwargs["h"].float()})
    if kwargs["initial_state"] is not None:
        variants.append({**kwargs, "initial_state": kwargs["initial_state"].half()})
    for plan_kwargs in variants:
        plan = flash_qla.FlashQLABackend().plan_run(validate(**plan_kwargs))
        want = plan(validate(**plan_kwargs))
        views = {n: strided(n, plan_kwargs[n]) for n in names}
        for n, x in views.items():
            assert torch.equal(x, plan_kwargs[n]) and x.stride() != plan_kwargs[n].stride(), n
        for changed in [{n: views[n]} for n in names] + [views]:
            got = plan(validate(**{**plan_kwargs, **changed}))
            for name, x, y in zip(want._fields, want, got):
                assert (x is None and y is None) or torch.equal(x, y), (sorted(changed), name)
        # other values through the same plan (a strided do, doubled): the call's own tensors are read
        other = {**plan_kwargs, "do": plan_kwargs["do"] * 2}
        got = plan(validate(**{**other, "do": strided("do", other["do"])}))
        fresh = flash_qla.FlashQLABackend().plan_run(validate(**other))(validate(**other))
        assert not torch.equal(got.dq, want.dq)
        for name, x, y in zip(fresh._fields, fresh, got):
            assert (x is None and y is None) or torch.equal(x, y), ("doubled do", name)
    flash_qla._ops.cache_clear()


def test_table_keys_name_it_only_when_installed():
    """Tables measured before the peer existed keep their exact keys on machines without it."""
    without = problem(version=None)
    assert "flash_qla" not in without.versions_key()
    assert without.versions_key() == ",".join(f"{k}={v or '-'}" for k, v in without.versions if k != "flash_qla")
    assert problem(version="0.1.3").versions_key().endswith(",flash_qla=0.1.3")


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("seqlens", [None, (1, 63, 64, 65)])
def test_the_op_forward_on_flash_qla_plumbing_against_the_oracle(seqlens, v_first, monkeypatch, with_backends):
    """The training op with GDR_FORWARD=flash_qla, FlashQLA's forward swapped for exact torch
    (fp32 inputs): o, the final state and every gradient within fp32 rounding of the float64
    oracle; its intra-card split must be off (the stand-in asserts it), and the states are
    asked for only when they are saved."""
    import fake_flash_qla
    from test_training import inputs, leaves

    from gdr_dispatch import chunk_gated_delta_rule, oracle_grads

    calls = fake_flash_qla.install(monkeypatch)
    with_backends(flash_qla.FlashQLABackend())
    monkeypatch.setattr(flash_qla.FlashQLABackend, "not_supported_reasons", lambda self, p: [])
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    monkeypatch.setenv("GDR_FORWARD", "flash_qla")
    monkeypatch.setenv("GDR_BACKEND", "torch")
    x = leaves(inputs(seqlens=seqlens, v_first=v_first, dtype=torch.float32))
    o, ht = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                   output_final_state=True, cu_seqlens=x["cu_seqlens"], state_v_first=v_first)
    assert calls == ["chunk_gated_delta_rule_fwd"]
    gen = torch.Generator().manual_seed(3)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    ((o * do).sum() + (ht * dht).sum()).backward()
    ref = oracle_grads(*(x[n].detach().double() for n in ("q", "k", "v", "g", "beta")), do.double(), dht.double(),
                       initial_state=x["initial_state"].detach().double(), cu_seqlens=x["cu_seqlens"],
                       state_v_first=v_first)
    for n, r in zip(("q", "k", "v", "g", "beta", "initial_state"), ref):
        err = (x[n].grad.double() - r).norm() / r.norm()
        assert err < 1e-4, (n, float(err))


def test_its_forward_builds_in_two_jobs_that_run_its_halves_like_the_call(monkeypatch):
    """`forward_compile_jobs`: the chunk cumsum with the KK^T solve, and the fused forward, each a
    job that runs that half once on random inputs of the call's shapes, dtypes and flags (what
    FlashQLA's JIT keys on: here the halves are recorded, not run)."""
    from gdr_dispatch import autotune

    seen = []
    monkeypatch.setattr(flash_qla.FlashQLABackend, "forward_residuals",
                        lambda self, *a: seen.append(("residuals", a[1].shape, a[3].dtype, a[5])))
    monkeypatch.setattr(flash_qla.FlashQLABackend, "forward_from_residuals",
                        lambda self, *a, need_states: seen.append(("kernel", a[3].dtype, a[4].shape, a[4].dtype,
                                                                   a[7] is not None, a[10], need_states)))
    q = torch.zeros(1, 130, 2, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, 130, 4, 128, dtype=torch.bfloat16)
    g, beta = torch.zeros(1, 130, 4), torch.zeros(1, 130, 4, dtype=torch.bfloat16)
    h0 = torch.zeros(2, 4, 128, 128)
    cu = torch.tensor([0, 30, 130], dtype=torch.int32)
    spec = autotune.forward_spec(q, v, g, beta, h0, cu, (30, 100), 0.1, False, True, False)
    jobs = flash_qla.FlashQLABackend().forward_compile_jobs(spec, "cpu")
    assert [j[2][0] for j in jobs] == ["residuals", "kernel"]
    # one chunk per sequence (its kernels take the lengths at run time): other lengths, the same jobs
    other = autotune.forward_spec(q, v, g, beta, h0, torch.tensor([0, 70, 130], dtype=torch.int32), (70, 60),
                                  0.1, False, True, False)
    assert flash_qla.FlashQLABackend().forward_compile_jobs(other, "cpu") == jobs
    for job in jobs:
        autotune.run_compile_job(job)
    assert seen[0][:3] == ("residuals", (1, 128, 2, 128), torch.float32) and seen[0][3].tolist() == [0, 64, 128]
    assert seen[1] == ("kernel", torch.float32, (1, 128, 4, 64), torch.bfloat16, True, True, False)
    dense = autotune.forward_spec(q.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), g.expand(3, -1, -1),
                                  beta.expand(3, -1, -1), None, None, (130,) * 3, 0.1, False, False, True)
    assert dict(flash_qla.FlashQLABackend().forward_compile_jobs(dense, "cpu")[0][2][1])["T"] == 64
