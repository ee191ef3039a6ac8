"""The TileLang state kernel (backends/kernels/tilelang_states.py) on the CPU: its algebra in
float64 (the kernel's per-chunk steps emulated in torch against the contract's states), its
compiled structure for sm_90a (needs nvcc), and the gate that keeps it off until its GPU tests
pass. The kernel itself runs in tests/test_gpu.py."""

import logging
import re
import shutil
from dataclasses import replace

import pytest
import torch

from gdr_dispatch.contract import validate
from gdr_dispatch.dispatch import clear_caches
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs

CASES = {
    "varlen_1_63_64_65_vfirst": ShapeSpec(seqlens=(1, 63, 64, 65), H=2, Hg=1, K=16, V=8, state_v_first=True),
    "T100_strong_decay": ShapeSpec(B=2, T=100, H=2, K=16, V=8, strong_decay=True),
    "T130_no_states": ShapeSpec(B=1, T=130, H=2, K=16, V=8, initial_state=False, dht=False),
}


def kernel_steps(k, v, a, g, b, h0, seq_lens, cu, BT, v_first):
    """The kernel's walk in torch: per chunk the chunk-start state, `Y = e^{G_L} K S - diag(e^{G_L
    - G}) V` and `S <- e^{G_L} S + X^T Y` with `X = -diag(b) A^T K`, rows past a sequence's end
    zero and G padded with the last valid G, as the producer loads them."""
    B, T, Hg, K = k.shape
    H = v.shape[2]
    kk, vv, aa, gg, bb = (x.reshape(B * T, *x.shape[2:]) for x in (k, v, a, g, b))
    starts = cu.tolist() if cu is not None else [n * T for n in range(B + 1)]
    hs, hts = [], []
    for n in range(len(seq_lens)):
        bos, eos = starts[n], starts[n + 1]
        for hh in range(H):
            S = torch.zeros(K, v.shape[3], dtype=torch.float64) if h0 is None else (
                h0[n, hh].transpose(-1, -2) if v_first else h0[n, hh]).double()
            mine = []
            for t0 in range(bos, eos, BT):
                rows = torch.arange(t0, t0 + BT)
                ok = rows < eos
                r = rows.clamp(max=eos - 1)
                Kc = torch.where(ok[:, None], kk[r, hh // (H // Hg)].double(), 0.0)
                Vc = torch.where(ok[:, None], vv[r, hh].double(), 0.0)
                Ac = torch.where(ok[:, None], aa[r, hh].double(), 0.0)
                Gc = gg[r, hh].double()
                bc = torch.where(ok, bb[r, hh].double(), 0.0)
                gl = Gc[int(ok.sum()) - 1]
                mine.append(S.clone())
                X = -bc[:, None] * (Ac.T @ Kc)
                Y = torch.exp(gl) * (Kc @ S) - torch.exp(gl - Gc)[:, None] * Vc
                S = torch.exp(gl) * S + X.T @ Y
            hs.append(torch.stack(mine))
            hts.append(S)
    return hs, hts


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernels_algebra_gives_the_contracts_states(name):
    """`e^{G_L} S + X^T Y` (every exponent <= 0) is the contract's chunk update; checked against
    make_inputs' float64 `h` and the token-by-token final state. Dropping the decay of V's term
    or the padding of G fails it."""
    import math

    from gdr_dispatch.backends.kernels import tilelang_states as ts
    from gdr_dispatch.reference import recurrent_forward

    assert ts.LOG2E == 1 / math.log(2)  # the kernel's exp2 form of the emulation's exp
    spec = replace(CASES[name], dtype="float64", h="given")
    inputs = make_inputs(spec, "cpu")
    call = validate(**call_kwargs(inputs))
    hs, hts = kernel_steps(call.k, call.v, call.a, call.g, call.b, call.initial_state, call.seq_lens,
                           call.cu_seqlens, call.chunk_size, call.state_v_first)
    H = call.H
    want = inputs["h"].reshape(-1, H, *inputs["h"].shape[-2:])
    if call.state_v_first:
        want = want.transpose(-1, -2)
    got = torch.stack([torch.stack([hs[n * H + hh][c] for hh in range(H)]) for n in range(call.N)
                       for c in range(hs[n * H].shape[0])])
    assert ((got - want).norm() / want.norm()).item() < 1e-10
    _, ht = recurrent_forward(call.q, call.k, call.v, inputs["g_raw"], call.b, initial_state=call.initial_state,
                              cu_seqlens=call.cu_seqlens, state_v_first=call.state_v_first)
    ht = ht.transpose(-1, -2) if call.state_v_first else ht
    got_ht = torch.stack(hts).view(call.N, H, *ht.shape[-2:])
    assert ((got_ht - ht).norm() / ht.norm()).item() < 1e-10


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile for sm_90a")
@pytest.mark.parametrize("v_first", [False, True], ids=["k_first", "v_first"])
def test_state_kernel_compiles_for_sm90a_with_its_roles(v_first):
    from gdr_dispatch.backends.kernels.tilelang_states import NREG, STAGES, build_states

    src = build_states(4, 2, "bfloat16", v_first).get_kernel_source()
    assert sum(NREG) * 128 <= 65536
    assert "__launch_bounds__(512, 1)" in src
    for n in sorted(set(NREG[:3])):
        assert f"warpgroup_reg_alloc<{n}>" in src
    assert f"warpgroup_reg_dealloc<{NREG[3]}>" in src
    roles = re.split(r"warpgroup_reg_(?:alloc|dealloc)<\d+>", src)[1:]
    assert len(roles) == 4
    assert "__syncthreads" not in "".join(roles)  # no block-wide barrier once the roles split
    ids = [set(re.findall(r"__sync_thread_partial\((\d+), 128\)", part)) for part in roles]
    assert all(not (x & y) for i, x in enumerate(ids) for y in ids[i + 1:]), ids
    producer = roles[3]
    # k (in a loop of two 64-column boxes), v, a, and g and b (256 bytes each, only where the
    # sequence starts at a multiple of 4 tokens: a box starts 16-byte aligned): whole chunks by TMA
    assert producer.count("tma_load(") == 5 and producer.count("expect_transaction") == 5
    assert producer.count("expect_transaction(256)") == 2
    assert re.search(r"if \(\(bos % 4\) == 0\) \{\s*if \(tl::tl_shuffle_elect<128>\(\)\) \{\s*"
                     r"ready\[[^]]+\]\.expect_transaction\(256\)", producer)
    assert re.search(r"for \(int i_\d+ = 0; i_\d+ < 2; \+\+i_\d+\) \{\s*tl::tma_load\(k_desc", producer)
    # the producer refills a stage only after its last chunk's free barrier (parity of c/stages - 1)
    assert STAGES == 2
    assert re.search(r"free\[\(c_\d+ & 1\)\]\.wait\(\(\(\(c_\d+ >> 1\) \+ 1\) & 1\)\)", producer)
    # the state groups wait for the stage's loads, then for X, and free the stage after S += X^T Y
    for part in roles[:2]:
        order = [part.find("ready["), part.find("xready["), part.find("free[")]
        assert -1 not in order and order == sorted(order), order
        # one elected thread stores h by TMA; its read of s_s is waited for before the stage is
        # freed (s_s is rewritten next)
        assert "*(uint4*)(h + " not in part
        store = re.search(r"tl_shuffle_elect<128>\(\)\) \{\s*(#pragma unroll\s*for [^{]*\{\s*)?tl::tma_store\(h_desc",
                          part)
        assert store, "h is not stored by one elected thread's TMA"
        order = [store.start(), part.find("xready["), part.find("tma_store_wait<0, true>()"), part.find("free[")]
        assert -1 not in order and order == sorted(order), order


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile for sm_90a")
def test_state_kernel_timing_build_counts_per_group_and_leaves_the_plain_build_alone():
    from gdr_dispatch.backends.kernels.tilelang_states import build_states

    plain = build_states(4, 2, "bfloat16", False).get_kernel_source()
    timed = build_states(4, 2, "bfloat16", False, timing=True).get_kernel_source()
    assert "clock64" not in plain and "clock64" in timed
    roles = re.split(r"warpgroup_reg_(?:alloc|dealloc)<\d+>", timed)[1:]
    # each group's lane 0 writes its counters once, after its loop
    assert all(("% 128) == 0)" in part or "threadIdx.x) == 0)" in part) and "clk[" in part for part in roles)


def test_h_none_recompute_waits_for_the_state_kernels_gpu_tests(monkeypatch, caplog):
    """Until tests/test_gpu.py's state-kernel tests pass (tilelang_states.GPU_VERIFIED), `h=None`
    keeps fla's stages 1-2 and the log says why; GDR_ALLOW_UNVERIFIED=1 runs ours."""
    from gdr_dispatch.backends.common import fla_pipeline, tilelang_sm90
    from gdr_dispatch.backends.kernels import tilelang_states

    inputs = make_inputs(ShapeSpec(B=1, T=70, H=2, K=16, V=8, dtype="float32", h="none"), "cpu")
    call = validate(**call_kwargs(inputs))
    ran = []
    monkeypatch.setattr(fla_pipeline, "recompute_states", lambda c: ran.append("fla") or "h from fla")
    monkeypatch.setattr(tilelang_states, "chunk_states", lambda *a, **kw: ran.append("ours") or ("h from ours", None))
    monkeypatch.setattr(tilelang_states, "GPU_VERIFIED", False)
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    clear_caches()
    with caplog.at_level(logging.INFO, logger="gdr_dispatch"):
        assert tilelang_sm90.recompute_states(call) == "h from fla"
        monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
        assert tilelang_sm90.recompute_states(call) == "h from ours"
    assert ran == ["fla", "ours"]
    assert "fla's stages 1-2 (our state kernel: the state kernel is not verified on a GPU yet" in caplog.text
    assert "on our TileLang state kernel" in caplog.text


@pytest.mark.parametrize("verified", [False, True])
def test_a_plans_h_none_run_decides_the_state_kernel_once(verified, monkeypatch, caplog):
    """`plan_given_h` (tilelang_fused's `plan_run`): which kernel recomputes the states is decided
    and logged when the plan is made, as `recompute_states` decides it; the plan's calls then run
    that kernel without asking again. With `h` given no states are recomputed."""
    from gdr_dispatch.backends.common import fla_pipeline, tilelang_sm90
    from gdr_dispatch.backends.kernels import tilelang_states

    inputs = make_inputs(ShapeSpec(B=1, T=70, H=2, K=16, V=8, dtype="float32", h="none"), "cpu")
    call = validate(**call_kwargs(inputs))
    ran, asked = [], []
    monkeypatch.setattr(fla_pipeline, "recompute_states", lambda c: ran.append("fla") or "h from fla")
    monkeypatch.setattr(tilelang_states, "chunk_states", lambda *a, **kw: ran.append("ours") or ("h from ours", None))
    monkeypatch.setattr(tilelang_states, "GPU_VERIFIED", verified)
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    real = tilelang_sm90.states_kernel_refusal
    monkeypatch.setattr(tilelang_sm90, "states_kernel_refusal", lambda: asked.append(1) or real())
    launcher = lambda *a, **kw: ("launched", a[7], None, None, None, None)  # noqa: E731 - its h argument
    clear_caches()
    with caplog.at_level(logging.INFO, logger="gdr_dispatch"):
        planned = tilelang_sm90.plan_given_h(call, launcher)
    assert len(asked) == 1 and ("on our TileLang state kernel" in caplog.text) == verified
    want = "h from ours" if verified else "h from fla"
    for _ in range(3):
        assert tuple(planned(call))[:2] == ("launched", want)
    assert len(asked) == 1 and ran == ["ours" if verified else "fla"] * 3
    assert tuple(tilelang_sm90.run_given_h(call, launcher))[:2] == ("launched", want)  # `run` decides per call
    given = validate(**call_kwargs(make_inputs(ShapeSpec(B=1, T=70, H=2, K=16, V=8, dtype="float32", h="given"),
                                               "cpu")))
    assert tuple(tilelang_sm90.plan_given_h(given, launcher)(given))[1] is given.h and len(ran) == 4


def test_head_major_copies_are_fresh_transposes_with_padded_rows():
    """The launcher's g and b for the kernel's TMA loads: `[H, width]` fp32, token t of head h at
    [h, t], rows padded to `width` (the kernel's TMA boxes need 16-byte row strides)."""
    from gdr_dispatch.backends.kernels.tilelang_states import _head_major

    x = torch.randn(7, 3, dtype=torch.bfloat16)
    out = _head_major(x, 8)
    assert out.shape == (3, 8) and out.dtype == torch.float32 and out.stride() == (8, 1)
    assert torch.equal(out[:, :7], x.float().t())
    assert out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("v_first", [False, True])
def test_the_state_kernels_compile_job_is_the_build_chunk_states_asks_for(v_first, monkeypatch):
    """`tune` compiles an `h=None` call's state kernel in a worker first (the sm90 TileLang
    backends' `compile_jobs`): the job must be the very `build_states` call (lru_cache key) the
    launcher then makes, or the sweep compiles it twice."""
    from gdr_dispatch.backends.common import tilelang_sm90
    from gdr_dispatch.backends.kernels import tilelang_states
    from gdr_dispatch.contract import validate
    from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs

    spec = ShapeSpec(seqlens=(1, 63, 130), H=4, Hg=2, K=128, V=128, h="none", state_v_first=v_first)
    call = validate(**call_kwargs(make_inputs(spec, "cpu")))
    monkeypatch.setattr(tilelang_states, "GPU_VERIFIED", True)
    (job,) = tilelang_sm90.states_compile_jobs(call)
    asked = []

    def build(*args, **kwargs):
        asked.append((args, kwargs))
        raise RuntimeError("stop before launching")

    monkeypatch.setattr(tilelang_states, job[1], build)
    with pytest.raises(RuntimeError, match="stop before launching"):
        tilelang_states.call_states(call)
    assert asked == [(job[2], {})] and job[0] == tilelang_states.__name__

