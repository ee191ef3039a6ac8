"""The TileLang fused backend (the warp-specialised kernel) on a machine without a GPU: its
reasons, and that its kernel compiles for sm_90a with its register split (needs nvcc)."""

import re
import shutil
from dataclasses import replace

import pytest
import torch

from gdr_dispatch import get_backend, toolchain
from gdr_dispatch.problem import DeviceInfo
from gdr_dispatch.shapes import ShapeSpec

H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), 132)
B200 = DeviceInfo("cuda", "NVIDIA B200", (10, 0), 148)


SM90_FUSED = ["tilelang_fused"]


def reasons(device=H200, backend="tilelang_fused", **spec):
    p = replace(ShapeSpec(**{"B": 2, "T": 4096, "H": 32, **spec}).problem(torch.device("cpu")), device=device)
    return get_backend(backend).not_supported_reasons(p)


@pytest.mark.parametrize("backend", SM90_FUSED)
def test_takes_the_training_shapes_on_sm90(monkeypatch, backend):
    monkeypatch.setattr(toolchain, "nvcc_found", lambda: True)
    assert reasons(backend=backend) == []
    assert reasons(backend=backend, h="none", seqlens=(4096,) * 8, B=1, Hg=16) == []


@pytest.mark.parametrize("backend", SM90_FUSED)
def test_other_arches_and_shapes_say_why(monkeypatch, backend):
    monkeypatch.setattr(toolchain, "nvcc_found", lambda: True)
    text = " | ".join(reasons(device=B200, backend=backend, K=64, chunk_size=32, dtype="float32"))
    for words in ("built for sm_90a", "sm_100", "K and V must be 128", "chunk_size must be 64", "bfloat16 or float16"):
        assert words in text
    monkeypatch.setattr(toolchain, "nvcc_found", lambda: False)
    assert any("no nvcc" in r for r in reasons(backend=backend))
    monkeypatch.setattr(toolchain, "nvcc_found", lambda: True)
    assert any("32-bit integers" in r for r in reasons(backend=backend, B=64, T=32768))


def test_the_warp_specialised_kernel_takes_h200_calls(monkeypatch):
    """Verified on the H200 (oracle tests, racecheck, synccheck): not behind GDR_ALLOW_UNVERIFIED."""
    monkeypatch.setattr(toolchain, "nvcc_found", lambda: True)
    monkeypatch.delenv("GDR_ALLOW_UNVERIFIED", raising=False)
    p = replace(ShapeSpec(B=2, T=4096, H=32).problem(torch.device("cpu")), device=H200)
    assert get_backend("tilelang_fused").supported(p) == (True, "")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile for sm_90a")
def test_ws_kernel_compiles_for_sm90a_with_its_register_split():
    from gdr_dispatch.backends.kernels.tilelang_ws_bwd import NREG, build_ws_bwd

    src = build_ws_bwd(4, 2, 128 ** -0.5, "bfloat16", "bfloat16").get_kernel_source()
    # no reduction across warps inside a role branch: TileLang's cross-warp all-reduce (the one
    # that takes a shared workspace) syncs on the same hardware barriers in every group, which
    # would complete each other's syncs (docs/kernels.md, "Fused backward")
    assert "workspace" not in src
    assert sum(NREG) * 128 <= 65536
    assert "__launch_bounds__(512, 1)" in src
    for n in NREG[:3]:
        assert f"warpgroup_reg_alloc<{n}>" in src
    assert f"warpgroup_reg_dealloc<{NREG[3]}>" in src
    assert "__syncthreads" not in src.split("warpgroup_reg")[1]  # no block-wide barrier once the roles split
    # each role group's code (S, KV, A, producer), from its register-cap instruction on
    groups = re.split(r"warpgroup_reg_(?:alloc|dealloc)<\d+>", src)[1:]
    # each group's 128-thread named barriers are its own: two groups on one id would complete
    # each other's syncs
    ids = [set(re.findall(r"__sync_thread_partial\((\d+), 128\)", part)) for part in groups]
    assert len(ids) == 4 and all(not (x & y) for i, x in enumerate(ids) for y in ids[i + 1:]), ids
    # db's column part: A's warps' partial sums (one shuffle reduce-scatter), added by S where it
    # writes db; the shuffles stay inside a warp, the sum over warps goes through shared memory
    assert [g.count("gdr_col_partials(") for g in groups] == [0, 0, 1, 0]
    assert "dbc_s" in groups[0] and "__shfl_xor_sync(0xffffffffu, send, d)" in src
    # a fence covers a fragment's registers per thread, never its logical size
    sizes = {int(n) for n in re.findall(r"warpgroup_fence_operand\(reinterpret_cast<float\*>\(\w+ \+ 0\), (\d+)\)", src)}
    assert sizes and max(sizes) <= 128, sizes
    assert src.count("tma_load(") >= 6
    # W, dP, dkk, dkk + dkk^T and Ag stored from registers by stmatrix, on top of ten fragment copies
    assert src.count("ptx_stmatrix") == 15, src.count("ptx_stmatrix")
    # S arrives at phase 4's barrier before it writes the scaled dO into dvp_s, and its own wgmma
    # reads dvp_s only after its 128-thread named barrier (the mbarrier no longer orders S's
    # threads' writes before that read)
    s_part = groups[0]
    arrive, wait = s_part.find("phase[3].arrive()"), s_part.find("phase[3].wait(")
    write = s_part.find("((bfloat16_t*)dvp_s) +")
    read = s_part.find("(&(((bfloat16_t*)dvp_s)[0]))")
    assert arrive < write < wait < read
    assert "__sync_thread_partial(3, 128)" in s_part[wait:read]


def test_mma_column_sums_tile_is_tilelangs_swizzle_and_sums_to_fp32():
    """"mma"'s helper (`COLSUM_TILE`) stores the row-pair sums' bf16 hi and lo where TileLang's
    128-byte swizzle of the 64 x 64 tile puts them (the tensor core reads the tile through that
    layout), and the tile's column sums are the fp32 column sums to ~2^-17. The fragment side
    (element `4 n + 2 r + c` of lane l, warp w: row `16 w + 8 r + l / 4`, column `8 n + 2 (l % 4)
    + c`) is `COL_PARTIALS`', which the GPU oracle tests cover."""
    from tilelang import layout as tl_layout  # puts TileLang's tvm on the path

    import tvm
    from tvm import tirx

    from gdr_dispatch.backends.kernels import tilelang_ws_bwd as ws

    # the helper's address, as its source spells it
    assert "const unsigned at = tile + (((n ^ (q & 7)) << 4) | ((lane & 3) << 2));" in ws.COLSUM_TILE
    assert "gdr_st_shared(at + q * 128, hi);" in ws.COLSUM_TILE and "gdr_st_shared(at + (32 + q) * 128," in ws.COLSUM_TILE
    # and its values, as the emulation below forms them: the fragment's row pairs (elements 4 n + c
    # and 4 n + 2 + c, rows l / 4 and 8 + l / 4), the bf16 hi, the lo as what hi leaves
    assert "const float y0 = x[4 * n] + x[4 * n + 2], y1 = x[4 * n + 1] + x[4 * n + 3];" in ws.COLSUM_TILE
    assert "const __nv_bfloat162 hi = __floats2bfloat162_rn(y0, y1);" in ws.COLSUM_TILE
    assert "__floats2bfloat162_rn(y0 - h.x, y1 - h.y)" in ws.COLSUM_TILE
    assert ws.ONES_N & (ws.ONES_N - 1) == 0  # 1 / ONES_N exact in bf16, so the gemm's sums are the sums
    lay = tl_layout.make_swizzled_layout(tirx.decl_buffer((64, 64), "bfloat16", name="t", scope="shared.dyn"))
    ana = tvm.arith.Analyzer()

    def element(row, col):  # TileLang's physical element index
        *_, tile, at = [int(ana.simplify(e)) for e in lay.map_forward_index([tirx.IntImm("int32", row),
                                                                            tirx.IntImm("int32", col)])]
        return tile * 512 + at

    X = torch.randn(64, 64, dtype=torch.float32, generator=torch.Generator().manual_seed(0)) * \
        torch.logspace(-3, 3, 64).unsqueeze(1)
    tile = torch.full((64, 64), float("nan"))  # by physical element
    for w in range(4):
        for lane in range(32):
            q = 8 * w + lane // 4
            for n in range(8):
                at = ((n ^ (q & 7)) << 4) | ((lane & 3) << 2)
                for c in range(2):
                    col = 8 * n + 2 * (lane % 4) + c
                    y = X[16 * w + lane // 4, col] + X[16 * w + 8 + lane // 4, col]
                    hi = y.to(torch.bfloat16).float()
                    lo = (y - hi).to(torch.bfloat16).float()
                    for row, v in ((q, hi), (32 + q, lo)):
                        byte = row * 128 + at + 2 * c
                        assert byte == 2 * element(row, col), (row, col)
                        tile.view(-1)[byte // 2] = v
    assert not tile.isnan().any()  # every element written once
    logical = torch.stack([torch.stack([tile.view(-1)[element(r, c)] for c in range(64)]) for r in range(64)])
    sums = (logical.double() * (1.0 / ws.ONES_N)).sum(0) * ws.ONES_N
    ref = X.double().sum(0)
    assert ((sums - ref).abs() / X.double().abs().sum(0)).max() < 2 ** -16


def test_ws_kernel_register_caps_fill_the_file_and_follow_the_words():
    """Both cap sets fill the 64K-register file in multiples of 8 (setmaxnreg's rule) within
    [24, 256]; "kvregs" picks `NREG_KVREGS` with "mma" in a bf16 build, in any word order, and
    nowhere else."""
    from gdr_dispatch.backends.kernels import tilelang_ws_bwd as ws

    for caps in (ws.NREG, ws.NREG_KVREGS):
        assert sum(caps) * 128 == 65536 and all(c % 8 == 0 and 24 <= c <= 256 for c in caps), caps
    assert ws.nreg_of(ws.HOIST) == ws.NREG and ws.nreg_of("") == ws.NREG
    assert ws.nreg_of(ws.hoist_form(["kvregs", "mma", "gam"])) == ws.NREG_KVREGS
    assert ws.nreg_of("gam+mma+kvregs", "float16") == ws.nreg_of("gam+kvregs") == ws.NREG
    assert ws.hoist_form(["kvregs", "mma", "gam"]) == "gam+mma+kvregs"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile for sm_90a")
def test_ws_kernel_keeps_its_wgmmas_pipelined(monkeypatch):
    """ptxas serializes every wgmma of the kernel (C7510-C7512) where a group's accumulators do not
    fit its registers: each gemm then waits for the one before, and no group's element-wise work
    overlaps its gemms. The backend's builds (bf16 and fp16, `HOIST`'s words) and the words apart
    must not; S capped at 128 registers (its dS alone takes 128) does (docs/kernels.md, "the next
    decomposition"). "ag" takes away the one wait ptxas injects (C7517)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    import sass_report

    from gdr_dispatch.backends.kernels import tilelang_ws_bwd as ws

    compiled = {}  # ptxas's notes per generated source: a build asked for twice compiles once

    def notes(*args, **kw):
        kern = ws.build_ws_bwd(*args, **kw)
        src = kern.get_kernel_source()
        if src not in compiled:
            compiled[src] = sass_report.ptxas_notes(kern)
        return compiled[src]

    def codes(*args, **kw):
        return {code for code, _ in notes(*args, **kw)}

    def serialized(*args, **kw):
        return sass_report.serialized(notes(*args, **kw))

    assert not serialized(4, 2, 128 ** -0.5, "bfloat16", "bfloat16")
    assert not serialized(2, 2, 128 ** -0.5, "float16", "float16")
    assert not serialized(4, 2, 128 ** -0.5, "bfloat16", "bfloat16", hoist="gam+scale+mma")
    # "ag": Ag's stmatrix in phase 1 no longer waits for the Q K^T gemm (ptxas's injected wait)
    for without in ("gam", "gam+scale+mma"):
        assert "C7517" in codes(4, 2, 128 ** -0.5, "bfloat16", "bfloat16", hoist=without)
    for with_ag in ("gam+ag", "gam+scale+mma+ag"):
        assert not codes(4, 2, 128 ** -0.5, "bfloat16", "bfloat16", hoist=with_ag)
    # "kvregs": KV's cap 168, A's 160, still pipelined
    kern = ws.build_ws_bwd(4, 2, 128 ** -0.5, "bfloat16", "bfloat16", hoist="gam+scale+mma+ag+kvregs")
    src = kern.get_kernel_source()
    assert [int(n) for n in re.findall(r"warpgroup_reg_(?:alloc|dealloc)<(\d+)>", src)] == list(ws.NREG_KVREGS)
    assert not serialized(4, 2, 128 ** -0.5, "bfloat16", "bfloat16", hoist="gam+scale+mma+ag+kvregs")
    monkeypatch.setattr(ws, "NREG", (128, 160, 200, 24))  # read when a build is made; a scale no other test builds
    try:
        assert serialized(2, 2, 0.125, "bfloat16", "bfloat16")  # the check can fail
    finally:
        ws.build_ws_bwd.cache_clear()  # that build must not outlive the patched caps


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile for sm_90a")
def test_ws_kernel_hoist_words_build_what_they_say():
    """"mma": A alone calls the column-sum helper, once, on a named barrier none of TileLang's own
    takes, and its bf16 ones tile is there; an fp16 build ("mma"; "scale" in the transpose form)
    and a `scale` outside `SCALE_FOLD_RANGE` build as without the word (the same source)."""
    from gdr_dispatch.backends.kernels.tilelang_ws_bwd import COLSUM_BARRIER, build_ws_bwd

    src = build_ws_bwd(4, 2, 128 ** -0.5, "bfloat16", "bfloat16", hoist="gam+scale+mma").get_kernel_source()
    groups = re.split(r"warpgroup_reg_(?:alloc|dealloc)<\d+>", src)[1:]
    assert [g.count("gdr_colsum_tile(") for g in groups] == [0, 0, 1, 0]
    taken = {int(i) for i in re.findall(r"__sync_thread_partial\((\d+), \d+\)|bar\.sync (\d+)", src) for i in i if i}
    assert taken and COLSUM_BARRIER not in taken, taken
    assert "ones_s" in src and "64, 8, 16" in src  # the m64n8k16 column-sum gemm
    # the helper writes pg_s in the 128-byte swizzle (type 1): every gemm must read it so (and h_s
    # keeps its own)
    for buf in ("pg_s", "h_s"):
        kinds = re.findall(r"initialize_wgmma_descriptor<(\d), [^>]*>\(\w+, \(&\(\(\(bfloat16_t\*\)" + buf + r"\)", src)
        assert kinds and set(kinds) == {"1"}, (buf, kinds)

    def source(dtype, scale, hoist):
        return build_ws_bwd(2, 2, scale, dtype, dtype, hoist=hoist).get_kernel_source()

    assert source("float16", 0.1, "gam+mma") == source("float16", 0.1, "gam")
    assert source("float16", 0.1, "gam+mma+kvregs") == source("float16", 0.1, "gam")  # A keeps its 168 there
    assert source("bfloat16", 0.0, "gam+scale") == source("bfloat16", 0.0, "gam")
    assert source("bfloat16", 0.1, "gam+scale") != source("bfloat16", 0.1, "gam")
    transpose = [build_ws_bwd(2, 2, 0.1, "float16", "float16", colsums="transpose", hoist=h).get_kernel_source()
                 for h in ("gam+scale", "gam")]
    assert transpose[0] == transpose[1]  # fp16's 16-bit copy of db's column terms holds no scaled values


@pytest.mark.parametrize("spec", [ShapeSpec(B=2, T=100, H=4, Hg=2, K=16, V=32, h="given"),
                                  ShapeSpec(seqlens=(1, 63, 64, 65), H=2, K=16, V=16, h="given", state_v_first=True)],
                         ids=lambda s: s.label())
def test_h_recompute_for_h_none(spec, monkeypatch):
    """With h=None the backend recomputes h with fla's stages 1-2 (stood in on the CPU):
    same chunk-start states as prepare_residuals', in the layout of the contract's h."""
    import fake_fla

    from gdr_dispatch.backends.common.fla_pipeline import recompute_states
    from gdr_dispatch.contract import validate
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    fake_fla.install(monkeypatch)
    x = make_inputs(replace(spec, dtype="float16"), "cpu", seed=2)
    call = validate(**{**call_kwargs(x), "h": None})
    h = recompute_states(call)
    assert h.shape == x["h"].shape
    err = ((h.double() - x["h"].double()).norm() / x["h"].double().norm()).item()
    assert err < 5e-3, err


@pytest.mark.parametrize("h_mode", ["given", "none"])
@pytest.mark.parametrize("spec", [dict(B=2, T=100, H=4, Hg=2), dict(seqlens=(1, 63, 64, 65), H=4, state_v_first=True)])
def test_compile_jobs_are_the_builds_the_launchers_make(spec, h_mode, monkeypatch):
    """A sweep or a table miss compiles a backend's `compile_jobs` in other processes first: each
    job must survive its trip there (`repr`, then `ast.literal_eval`) and name the very build
    (function and arguments) the launcher then asks for, or the kernel compiles twice."""
    import ast
    import importlib

    backend = "tilelang_fused"
    from gdr_dispatch.backends.common import tilelang_sm90
    from gdr_dispatch.contract import validate
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    call = validate(**call_kwargs(make_inputs(ShapeSpec(**spec, K=128, V=128, h=h_mode), "cpu")))
    *first, job = get_backend(backend).compile_jobs(call)
    assert ast.literal_eval(repr([*first, job])) == [*first, job]
    # with h=None the state kernel's build comes first (tests/test_tilelang_states.py checks that it
    # is the build chunk_states asks for)
    assert first == (tilelang_sm90.states_compile_jobs(call) if h_mode == "none" else [])
    assert (len(first) == 1) == (h_mode == "none")
    mod = importlib.import_module(job[0])
    built = []

    def build(*args, **kwargs):
        built.append(args)
        raise RuntimeError("stop before launching")

    monkeypatch.setattr(mod, job[1], build)
    # with h=None the launcher gets the recomputed states, in k's dtype
    monkeypatch.setattr(tilelang_sm90, "recompute_states",
                        lambda c: torch.zeros(c.B, c.num_chunks // c.B if c.cu_seqlens is None else c.num_chunks,
                                              c.H, c.K, c.V, dtype=c.k.dtype))
    with pytest.raises(RuntimeError, match="stop before launching"):
        get_backend(backend).run(call)
    assert built == [job[2]]


def test_packed_sequences_give_each_sequences_chunks_and_first_chunk_in_h():
    """The launchers' calling convention (tilelang_launch.packed_sequences): int32 `cu_seqlens`
    (made for a fixed-length batch), each sequence's chunk count and first chunk in `h`; the
    counts and offsets are built once per lengths, so a second call gets the same tensors."""
    from gdr_dispatch.backends.kernels.tilelang_launch import packed_sequences

    cu, offsets, counts = packed_sequences(1, 193, (1, 63, 64, 65, 0), 64, torch.tensor([0, 1, 64, 128, 193, 193]), "cpu")
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 1, 64, 128, 193, 193]
    assert counts == (1, 1, 1, 2, 0) and offsets.tolist() == [0, 1, 2, 3, 5, 5] and offsets.dtype == torch.int32
    again = packed_sequences(1, 193, [1, 63, 64, 65, 0], 64, torch.tensor([0, 1, 64, 128, 193, 193]), "cpu")
    assert again[1] is offsets and again[2] == counts
    cu, offsets, counts = packed_sequences(3, 100, (100,) * 3, 64, None, "cpu")
    assert cu.tolist() == [0, 100, 200, 300] and counts == (2, 2, 2) and offsets.tolist() == [0, 2, 4, 6]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile for sm_90a")
def test_the_prototype_builds_compile_and_keep_the_barrier_protocol():
    """`reconly` and `nowait` (docs/kernels.md, the prototype): they compile for sm_90a; `nowait`'s
    consumers never wait at a phase barrier (only the producer does, on phases 1, 5 and 6), while
    `reconly` keeps the kernel's waits and stores no gradient rows but dS's."""
    from gdr_dispatch.backends.kernels.tilelang_ws_bwd import build_ws_bwd

    full = build_ws_bwd(4, 2, 128 ** -0.5, "bfloat16", "bfloat16", timing=True).get_kernel_source()
    nowait = build_ws_bwd(4, 2, 128 ** -0.5, "bfloat16", "bfloat16", timing=True, mode="nowait").get_kernel_source()
    reconly = build_ws_bwd(4, 2, 128 ** -0.5, "bfloat16", "bfloat16", timing=True, mode="reconly").get_kernel_source()
    waits = {name: sorted(re.findall(r"phase\[(\d)\]\.wait", src)) for name, src in
             (("full", full), ("nowait", nowait), ("reconly", reconly))}
    assert waits["nowait"] == ["0", "4", "5"]
    assert set(waits["reconly"]) == set(waits["full"]) and len(waits["full"]) > 3
    assert len(reconly) < len(full) and len(nowait) <= len(full)
    with pytest.raises(ValueError, match="mode"):
        build_ws_bwd(4, 2, 128 ** -0.5, "bfloat16", "bfloat16", mode="bogus")
