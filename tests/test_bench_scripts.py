"""The GPU-only scripts (bench/ and tools/), checked where a CPU can check them: a typo there
costs device time."""

import contextlib
import importlib.util
import inspect
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TOOLS = ROOT / "tools"
sys.path.insert(0, str(BENCH))  # the scripts themselves (never the package: that is the installed one)


def test_every_stage56_config_binds_to_its_launcher():
    import bench_stage56 as s56

    for cfg in s56.CONFIGS:
        cfg = dict(cfg)
        launcher = s56.KERNELS[cfg.pop("kernel")][0]
        inspect.signature(launcher).bind_partial(**cfg)  # raises TypeError on an unknown knob


def test_bench_rounds_alternate_the_order_and_keep_the_least_median():
    from timing import more_rounds

    order, readings = [], iter([2.0, 1.5, 1.2, 3.0])
    runners = {"a": "fa", "b": "fb", "skipped": "reason"}
    runs = {"a": {"ms": 1.0}, "b": {"ms": 2.5}, "skipped": {"skipped": "reason"}}
    more_rounds(runners, runs, 3, lambda fn: order.append(fn) or next(readings))
    assert order == ["fb", "fa", "fa", "fb"]  # round 2 reversed, round 3 as given
    assert runs["a"] == {"ms": 1.0, "ms_rounds": [1.0, 1.5, 1.2]}
    assert runs["b"] == {"ms": 2.0, "ms_rounds": [2.5, 2.0, 3.0]}
    assert runs["skipped"] == {"skipped": "reason"}


def test_back_to_back_reading_outlasts_one_stall_of_the_host():
    """One host stall inside 20 back-to-back calls (a collection of Python's cycles, ~0.5 s with the
    GPU stacks loaded) once read as 16.8 ms per call for a 0.35 ms call: the reading is the median
    of several windows."""
    import time

    from timing import back_to_back_ms

    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.3 if len(calls) == 10 else 0.001)  # the 8th call of the first window stalls

    ms = back_to_back_ms(fn, n=20, warmup=2, sync=lambda: None)
    assert len(calls) == 2 + 3 * 20
    assert ms < 5.0, ms  # one window's mean holds the stall (~16 ms); the median does not


def test_bench_timers_pause_the_collector_inside_their_window_and_only_there():
    import gc

    from timing import back_to_back_ms, host_enqueue_ms, latency_ms, measure_ms

    seen = []

    def fn():
        seen.append(gc.isenabled())

    assert gc.isenabled()
    for timer in (lambda: measure_ms(fn, "cpu", warmup=0, reps=3), lambda: latency_ms(fn, 3, sync=lambda: None),
                  lambda: host_enqueue_ms(fn, 3, sync=lambda: None),
                  lambda: back_to_back_ms(fn, n=3, warmup=0, sync=lambda: None)):
        seen.clear()
        timer()
        assert seen and not any(seen)
        assert gc.isenabled()
    gc.disable()
    try:  # a caller that paused it itself keeps it paused
        latency_ms(fn, 1, sync=lambda: None)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_bench_merge_replaces_remeasured_runs_and_keeps_the_rest():
    from bench_gdr_bwd import merge_rows

    earlier = [{"shape": "a", "measured_at": "t1", "runs": {"x": {"ms": 1}}},
               {"shape": "b", "measured_at": "t1", "runs": {"x": {"ms": 1}, "y": {"ms": 1}}}]
    fresh = [{"shape": "c", "measured_at": "t2", "runs": {"x": {"ms": 3}}},
             {"shape": "b", "measured_at": "t2", "runs": {"x": {"ms": 2}}}]  # y skipped this time
    merged = merge_rows(earlier, fresh)
    assert [r["shape"] for r in merged] == ["a", "b", "c"]
    assert merged[0] == earlier[0]
    assert merged[1]["runs"] == {"x": {"ms": 2}, "y": {"ms": 1, "measured_at": "t1"}}
    assert merged[1]["measured_at"] == "t2"
    assert merge_rows([], fresh) == fresh


def test_bench_dispatched_runner_forces_nothing_and_names_the_pick(monkeypatch):
    """`dispatched` is the user's call: GDR_BACKEND and GDR_CP (which the forced runners set
    around their own calls) are out of the environment during it and restored after; the
    markdown names the tables' pick per row."""
    import bench_gdr_bwd as bench

    seen = []
    monkeypatch.setattr(bench, "fused_gdr_bwd", lambda **kw: seen.append(
        (kw, {n: bench.os.environ.get(n) for n in ("GDR_BACKEND", "GDR_CP")})) or "grads")
    monkeypatch.setenv("GDR_BACKEND", "torch")
    monkeypatch.setenv("GDR_CP", "4")
    assert bench.dispatched({"q": 1})() == "grads"
    assert seen == [({"q": 1}, {"GDR_BACKEND": None, "GDR_CP": None})]
    assert bench.os.environ["GDR_BACKEND"] == "torch" and bench.os.environ["GDR_CP"] == "4"
    row = {"shape": "B1 T64 h=none", "h": "none", "floor_ms": 0.1, "dispatched_pick": "fla@split4",
           "runs": {"dispatched": {"ms": 1.0, "max_rel_err": 1e-3}}}
    md = bench.to_markdown([row], ["dispatched"], "dev")
    assert "the backend the tables picked, B1 T64 h=none: fla@split4" in md
    assert "Host-bound" not in md
    row["runs"]["dispatched"]["host_ms"] = 0.9  # the enqueue alone: 90 % of the time
    assert "Host-bound (the enqueue alone took >= 80% of the time" in bench.to_markdown([row], ["dispatched"], "dev")


def test_bench_peer_summary_puts_both_timings_beside_flashqla():
    """Full-grid rows where FlashQLA ran whole get a per-call / back-to-back line with our times
    over FlashQLA's; rows with FlashQLA's own split (the starved summary's) and rows timed before
    back to back was (no `b2b_ms`) get none."""
    import bench_gdr_bwd as bench

    def run(ms, b2b=None):
        return {"ms": ms, "host_ms": 0.1, **({"b2b_ms": b2b} if b2b is not None else {})}

    full = {"shape": "B8 T4096 H32 h=given", "h": "given", "floor_ms": 0.6, "dispatched_pick": "tilelang_fused",
            "runs": {"tilelang_fused": run(1.5, 1.4), "dispatched": run(1.6, 1.4), "flashqla": run(2.0, 1.75)}}
    starved = {"shape": "B1 T8192 H16 h=none", "h": "none", "floor_ms": 0.1,
               "runs": {"dispatched": run(1.0, 0.9), "flashqla": run(1.2, 1.1), "flashqla-auto_cp": run(0.6, 0.5)}}
    old = {"shape": "B16 T2048 H32 h=given", "h": "given", "floor_ms": 0.6,
           "runs": {"tilelang_fused": run(1.5), "flashqla": run(1.5)}}
    lines = bench.peer_summary([full, starved, old])
    rows = [line for line in lines if line.startswith("| B")]
    assert len(rows) == 1 and rows[0].startswith("| B8 T4096 H32 | given | 1.500 / 1.400 (host 0.100) |")
    assert "[tilelang_fused]" in rows[0] and rows[0].endswith("| 0.75x / 0.80x | 0.80x / 0.80x |")
    assert bench.peer_summary([starved, old]) == []
    md = bench.to_markdown([full, starved], ["tilelang_fused", "dispatched"], "dev")
    assert "Beside FlashQLA, ms per call" in md and "Starved grids, ms per call" in md


#: modules the scripts import, not scripts themselves
HELPERS = {"bench/roofline.py", "bench/timing.py"}


@pytest.mark.parametrize("script", sorted(str(p.relative_to(ROOT)) for d in (BENCH, TOOLS) for p in d.glob("*.py")
                                          if str(p.relative_to(ROOT)) not in HELPERS))
def test_scripts_import(script):
    """Import errors and syntax errors surface here rather than on the GPU machine."""
    path = ROOT / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert hasattr(module, "main")


def test_l2norm_probe_checks_both_forms_against_float64_on_a_cpu(capsys):
    """tools/l2norm_probe.py on a CPU (Triton's interpreter, fp32): the in-place (32- and 64-bit rows) and copied forms'
    values and gradients on a transposed convolution view agree with float64."""
    import re

    path = TOOLS / "l2norm_probe.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    errors = re.findall(r"^(.+): error y ([0-9.e+-]+), dx ([0-9.e+-]+)", capsys.readouterr().out, re.M)
    assert len(errors) == 3, errors
    assert all(float(y) < 1e-6 and float(dx) < 1e-6 for _, y, dx in errors), errors


@pytest.mark.parametrize("spec", [dict(B=2, T=70, H=4, Hg=2, K=16, V=16), dict(seqlens=(1, 63, 65), H=2, K=16, V=16)])
def test_training_bench_step_runs_our_op_and_agrees_with_the_oracle(spec):
    """The training bench's step on a CPU (float64 through the torch forward and backward):
    every output it times is there and matches the token-by-token recurrence."""
    import bench_training_op as bt

    from gdr_dispatch import chunk_gated_delta_rule, oracle_grads
    from gdr_dispatch.reference import recurrent_forward
    from gdr_dispatch.shapes import ShapeSpec

    x = bt.step_inputs(ShapeSpec(**spec, dtype="float64"), "cpu")
    got = bt.step(chunk_gated_delta_rule, x)
    o, ht = recurrent_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                              cu_seqlens=x["cu_seqlens"])
    ref = oracle_grads(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"], x["dht"],
                       initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    assert set(got) == {"o", "ht", *("d" + n for n in bt.LEAVES)}
    for name, want in zip(("o", "ht", *("d" + n for n in bt.LEAVES)), (o, ht, *ref)):
        assert torch.allclose(got[name], want, rtol=1e-8, atol=1e-9), name


def test_training_bench_forces_a_backend_through_the_whole_step_and_names_it(monkeypatch):
    """`ours@<backend>` keeps GDR_BACKEND set until the backward (which runs after the forward
    returns) and restores the caller's value; the row records the backend the log line named."""
    import logging

    import bench_training_op as bt

    from gdr_dispatch import chunk_gated_delta_rule
    from gdr_dispatch import dispatch as dsp
    from gdr_dispatch.shapes import ShapeSpec

    monkeypatch.setenv("GDR_BACKEND", "callers-own")
    seen = []
    real = dsp.select_backend
    monkeypatch.setattr(dsp, "select_backend", lambda *a, **k: seen.append(bt.os.environ["GDR_BACKEND"]) or real(*a, **k))
    dsp.clear_caches()
    handler = bt.ChoiceLog()
    logging.getLogger("gdr_dispatch").addHandler(handler)
    logging.getLogger("gdr_dispatch").setLevel(logging.INFO)
    try:
        x = bt.step_inputs(ShapeSpec(B=1, T=40, H=2, K=16, V=16, dtype="float64"), "cpu")
        bt.step(bt.Forced(chunk_gated_delta_rule, "torch"), x)
    finally:
        logging.getLogger("gdr_dispatch").removeHandler(handler)
    assert seen == ["torch"] and handler.backend == "torch" and handler.forward == "torch"
    assert bt.os.environ["GDR_BACKEND"] == "callers-own"


def test_training_bench_runs_fla_op_on_fla_own_kernels(monkeypatch):
    """fla-core 0.6 sends its op to FlashQLA whenever flash_qla imports; the fla-op runner turns
    that off (FLA_FLASH_QLA=0) for its step only, so the column is fla's own kernels."""
    import bench_training_op as bt

    from gdr_dispatch.shapes import ShapeSpec

    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    seen = []

    def fake_op(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None):
        seen.append(bt.os.environ.get("FLA_FLASH_QLA"))
        return (v * beta[..., None]).sum() * v, initial_state * 1.0

    runner = bt.Forced(fake_op, env={"FLA_FLASH_QLA": "0"})
    bt.step(runner, bt.step_inputs(ShapeSpec(B=1, T=40, H=2, K=16, V=16, dtype="float64"), "cpu"))
    assert seen == ["0"] and "FLA_FLASH_QLA" not in bt.os.environ
    if bt.runners().get("fla-op") is not None and not isinstance(bt.runners()["fla-op"], str):
        assert bt.runners()["fla-op"].env == {"FLA_FLASH_QLA": "0"}


def test_training_bench_forces_a_forward_provider_for_the_step(monkeypatch):
    import bench_training_op as bt

    from gdr_dispatch import training
    from gdr_dispatch.shapes import ShapeSpec

    monkeypatch.delenv("GDR_FORWARD", raising=False)
    seen = []
    real = training.forward_choice
    monkeypatch.setattr(training, "forward_choice",
                        lambda p, **kw: seen.append(bt.os.environ.get("GDR_FORWARD")) or real(p, **kw))
    runner = bt.runners(forwards=["torch"])["ours/fwd=torch"]
    bt.step(runner, bt.step_inputs(ShapeSpec(B=1, T=40, H=2, K=16, V=16, dtype="float64"), "cpu"))
    assert seen == ["torch"] and "GDR_FORWARD" not in bt.os.environ


def test_training_bench_fresh_inputs_hand_each_step_new_tensors_of_the_same_values(monkeypatch):
    """`--fresh-inputs`: every step's floating inputs are clones (new tensors, as a model's layers
    hand over new activations each step), the integer ones as they are; the results unchanged."""
    import bench_training_op as bt

    from gdr_dispatch import chunk_gated_delta_rule
    from gdr_dispatch.shapes import ShapeSpec

    x = bt.step_inputs(ShapeSpec(seqlens=(5, 40), H=2, K=16, V=16, dtype="float64"), "cpu")
    seen = []

    def op(q, k, v, g, beta, **kw):
        seen.append((q.data_ptr(), kw["cu_seqlens"].data_ptr()))
        return chunk_gated_delta_rule(q, k, v, g, beta, **kw)

    want = bt.step(op, x)
    monkeypatch.setattr(bt, "FRESH", True)
    got = bt.step(op, x)
    assert seen[0][0] == x["q"].data_ptr() and seen[1][0] != x["q"].data_ptr()
    assert seen[1][1] == x["cu_seqlens"].data_ptr()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_ncu_groups_sums_samples_per_role_group(tmp_path, capsys):
    """tools/ncu_groups.py on a made-up source page: rows split at the four USETMAXREG lines
    (nvcc's order: producer, A, KV, S; caps from tilelang_ws_bwd.NREG), samples summed per group."""
    sys.path.insert(0, str(TOOLS))
    import ncu_groups

    from gdr_dispatch.backends.kernels.tilelang_ws_bwd import NREG

    caps = dict(zip(("S", "KV", "A", "producer"), NREG))
    rows = [["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb"],
            ["0", "MOV R1, c[0x0][0x28]", "1", "0"]]
    for i, (g, samples) in enumerate((("producer", 2), ("A", 30), ("KV", 10), ("S", 5))):
        op = "USETMAXREG.DEALLOC" if g == "producer" else "USETMAXREG.TRY_ALLOC"
        rows.append([str(16 * (2 * i + 1)), f"{op} 0x{caps[g]:x}", "0", "0"])
        rows.append([str(16 * (2 * i + 2)), "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ", str(samples), str(samples // 2)])
    (tmp_path / "src.csv").write_text("\n".join(",".join(f'"{c}"' for c in r) for r in rows) + "\n")
    assert ncu_groups.main([str(tmp_path / "src.csv"), "--group", "A", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "prologue | 1 | 0" in out and "A | 30 | 15" in out and "KV | 10 | 5" in out and "S | 5 | 2" in out
    assert "producer | 2 | 1" in out and "HGMMA" in out.split("group A:")[1]


def test_training_bench_rejects_an_unknown_backend_to_precompile_by_name(capsys):
    """`--compile-backends` names our backends; a typo is an error that names the flag (before
    the bench needs a GPU), not a silent precompile of nothing."""
    import bench_training_op as bt

    with pytest.raises(SystemExit) as e:
        bt.main(["--compile-backends", "fla,no_such_backend"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--compile-backends" in err and "no_such_backend" in err


def test_sass_report_cuts_each_consumer_group_at_its_mbarrier_arrivals(monkeypatch):
    """tools/sass_report.py --phases on made-up SASS: the branches open at USETMAXREG (producer
    first, as nvcc lays them out), each consumer group is cut after every SYNCS.ARRIVE, and a
    segment counts its instructions, spill instructions and named barriers."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import sass_report

    body = {
        24: ["NOP"],
        168: ["FMUL", "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR5], RZ", "LDL R1", "BAR.SYNC.DEFER_BLOCKING 0x5, 0x80", "FADD"],
        160: ["STL R2", "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR8], RZ", "BAR.SYNC.DEFER_BLOCKING 0x4, 0x80"],
    }
    lines, addr = [], 0
    for cap, ops in ((24, body[24]), (168, body[168]), (160, body[160]), (160, body[160])):
        for op in [f"USETMAXREG.TRYALLOC.CCTL P0, 0x{cap:x}"] + ops:
            lines.append(f"        /*{addr:04x}*/                   {op} ;")
            addr += 16
    got = sass_report.per_phase("\n".join(lines))
    assert set(got) == {"S", "KV", "A"}
    assert got["A"] == [(2, 0, 0), (4, 1, 1)]  # USETMAXREG, FMUL | ARRIVE, LDL, BAR, FADD
    assert got["S"] == got["KV"] == [(2, 1, 0), (2, 0, 1)]


def test_sass_report_names_groups_by_position_against_the_builds_caps(monkeypatch):
    """The branches are named in nvcc's order (producer, A, KV, S) once their caps are the build's
    in that order: a "kvregs" build (KV 168, A 160: the default's four numbers, reordered) is
    named by its own caps, and read against the default's it is refused, not mislabelled."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import sass_report
    from gdr_dispatch.backends.kernels import tilelang_ws_bwd as ws

    assert sass_report.caps_of("warp+gam+scale+mma+ag+kvregs") == ws.NREG_KVREGS
    assert sass_report.caps_of("default") == ws.NREG == sass_report.caps_of("timing-warp+gam")
    assert sass_report.caps_of("default", kernel="states") is None
    assert sass_report.caps_of("warp+gam+scale+mma+ag+kvregs", dtype="float16") == ws.NREG
    kv = ws.NREG_KVREGS[::-1]
    assert sass_report.label_regions(list(kv), nreg=ws.NREG_KVREGS) == ["producer", "A", "KV", "S"]
    assert sass_report.label_regions(list(ws.NREG[::-1])) == ["producer", "A", "KV", "S"]
    with pytest.raises(SystemExit, match="caps"):
        sass_report.label_regions(list(kv))  # a kvregs build against the default's caps
    with pytest.raises(SystemExit, match="caps"):
        sass_report.label_regions([24, 160, 168, 168])


def test_sass_report_counts_opcodes_by_class_without_predicates_or_modifiers(monkeypatch):
    """tools/sass_report.py --opcodes: an instruction counts under its mnemonic's base (a guard
    predicate and the modifiers dropped), uniform-datapath forms under their base's class, the
    unknown under "other"."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import sass_report

    lines = [f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate([
        "FMUL R1, R2, R3", "@P0 FMUL R4, R5, R6", "@!PT FFMA R1, R2, R3, R4", "F2FP.BF16.F32.PACK_AB R1, R2, R3",
        "PRMT R1, R2, 0x7632, R3", "LDS.U16 R1, [R2]", "STSM.16.M88.4 [R1], R4", "UIADD3 UR4, UR5, 0x1, URZ",
        "MUFU.EX2 R1, R2", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", "LDL.64 R1, [R2]", "BOGUS R1"])]
    counts = sass_report.opcode_counts(lines)
    assert counts["FMUL"] == 2 and counts["FFMA"] == 1 and counts["F2FP"] == 1 and counts["UIADD3"] == 1
    classes = sass_report.classify(counts)
    assert classes["fp32"] == 3 and classes["conversion"] == 1 and classes["shared"] == 2 and classes["exp2"] == 1
    assert classes["integer/address"] == 2 and classes["gemm"] == 1 and classes["spill"] == 1 and classes["other"] == 1
    assert sum(classes.values()) == len(lines)


def test_sass_report_reads_ptxas_notes_from_the_compilers_log(monkeypatch):
    """`--ptxas`: the numbered notes come from the output TileLang logs for a verbose compile (with
    `-Xptxas -v` and the kernel's own flags), the serialization codes are named, and TileLang's
    logger is left as it was (its handlers never see the compiler's output)."""
    import logging

    monkeypatch.syspath_prepend(str(TOOLS))
    import sass_report
    from tilelang.contrib import nvcc as tl_nvcc

    seen = []

    def fake_compile(code, target_format="ptx", arch=None, options=None, path_target=None, verbose=False):
        seen.append((code, target_format, verbose, options))
        tl_nvcc.logger.info("PTXAS verbose output:\n%s", "ptxas info    : (C7517) warpgroup.wait is injected\n"
                            "ptxas info    : Used 128 registers\n"
                            "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions "
                            "are serialized due to insufficient register resources")
        return b""

    monkeypatch.setattr(tl_nvcc, "compile_cuda", fake_compile)
    monkeypatch.setattr(sass_report, "kernel_flags", lambda kern: ["--use_fast_math"])

    class Kern:
        target = contextlib.nullcontext()

        def get_kernel_source(self):
            return "src"

    heard = []

    class Own(logging.Handler):  # one of TileLang's own handlers: it must not hear the compiler
        def emit(self, record):
            heard.append(record.getMessage())

    own = Own()
    tl_nvcc.logger.addHandler(own)
    try:
        handlers, level, propagate = tl_nvcc.logger.handlers[:], tl_nvcc.logger.level, tl_nvcc.logger.propagate
        notes = sass_report.ptxas_notes(Kern())
        assert [c for c, _ in notes] == ["C7517", "C7512"] and "serialized" in notes[1][1]
        assert sass_report.serialized(notes) and not sass_report.serialized(notes[:1])
        (code, fmt, verbose, options), = seen
        assert (code, fmt, verbose) == ("src", "cubin", True)
        assert "--use_fast_math" in options and options[-2:] == ["-Xptxas", "-v"]
        assert (tl_nvcc.logger.handlers, tl_nvcc.logger.level, tl_nvcc.logger.propagate) == (handlers, level, propagate)
        assert heard == []

        def failing(*a, **k):
            raise RuntimeError("nvcc failed")

        monkeypatch.setattr(tl_nvcc, "compile_cuda", failing)  # the logger comes back as it was
        with pytest.raises(RuntimeError, match="nvcc failed"):
            sass_report.ptxas_notes(Kern())
        assert (tl_nvcc.logger.handlers, tl_nvcc.logger.level, tl_nvcc.logger.propagate) == (handlers, level, propagate)
        monkeypatch.setattr(tl_nvcc, "compile_cuda", lambda *a, **k: b"")  # nothing logged: refused, not "no notes"
        with pytest.raises(RuntimeError, match="no ptxas report"):
            sass_report.ptxas_notes(Kern())
    finally:
        tl_nvcc.logger.removeHandler(own)


def test_sass_report_builds_name_a_mode_and_the_timing_build(monkeypatch):
    """`--builds`: default, timing, a mode of the backward (`nowait`), a form as ws_probe spells it,
    or those joined by '-' reach `build_ws_bwd` as its keywords (the kernel's own form where none
    is named); the state kernel takes default and timing only, and unknown words are refused."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import sass_report
    from gdr_dispatch.backends.kernels import tilelang_ws_bwd

    seen = []

    def fake(H, Hg, scale, dtype, b_dtype, timing=False, mode="full", colsums=None, hoist=None):
        if mode not in tilelang_ws_bwd.MODES:
            raise ValueError(f"mode: {mode!r}")
        seen.append((timing, mode, colsums, hoist))
        return object()

    monkeypatch.setattr(sass_report, "kernel_sass", lambda kern: "")
    monkeypatch.setattr(tilelang_ws_bwd, "build_ws_bwd", fake)
    monkeypatch.setattr(tilelang_ws_bwd, "FORM", "warp+gam")
    for build in ("default", "timing", "nowait", "timing-nowait", "timing-reconly", "warp", "timing-transpose+row+gam"):
        sass_report.sass_of(build, 2, 2, "bfloat16")
    assert seen == [(False, "full", "warp", "gam"), (True, "full", "warp", "gam"), (False, "nowait", "warp", "gam"),
                    (True, "nowait", "warp", "gam"), (True, "reconly", "warp", "gam"), (False, "full", "warp", ""),
                    (True, "full", "transpose", "gam+row")]
    with pytest.raises(ValueError, match="states"):
        sass_report.sass_of("nowait", 2, 2, "bfloat16", kernel="states")
    for bogus in ("timing-bogus", "timingnowait", "warp+bogus", "gam"):
        with pytest.raises(ValueError, match="bogus|none of|hoist"):
            sass_report.sass_of(bogus, 2, 2, "bfloat16")


def test_sass_report_disassembles_the_kernel_as_its_pass_configs_build_it(monkeypatch):
    """The SASS comes from the kernel's source compiled with the flags its pass configs give:
    `--use_fast_math` where TileLang builds with it (exp2 is one MUFU.EX2 there, four
    instructions without), none where it does not."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import sass_report
    from tilelang.contrib import nvcc as tl_nvcc
    from tilelang.transform import PassConfigKey

    seen = []
    monkeypatch.setattr(sass_report, "_cuobjdump_on_path", lambda: None)
    monkeypatch.setattr(tl_nvcc, "get_sass_from_source", lambda code, compile_flags=None, verbose=False:
                        seen.append((code, compile_flags)) or "sass")

    class Kern:
        target = contextlib.nullcontext()

        def __init__(self, cfg):
            self.pass_configs = cfg

        def get_kernel_source(self):
            return "src"

    assert sass_report.kernel_sass(Kern({PassConfigKey.TL_ENABLE_FAST_MATH: True})) == "sass"
    sass_report.kernel_sass(Kern({}))
    sass_report.kernel_sass(Kern(None))
    assert seen == [("src", ["--use_fast_math"]), ("src", []), ("src", [])]


def test_precompile_names_the_backends_build_by_ws_alone(monkeypatch):
    """`ws` (with or without `-timing`/a mode) builds the kernel's own form, `ws` alone by the
    positional arguments the launcher's cache key uses; a form names its hoist words exactly."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import precompile_tilelang
    from gdr_dispatch.backends.kernels import tilelang_ws_bwd

    seen = []

    def fake(*args, **kw):
        seen.append((args[3:], kw))

    monkeypatch.setattr(tilelang_ws_bwd, "build_ws_bwd", fake)
    monkeypatch.setattr(precompile_tilelang, "_count_cubin_lookups", lambda: [])
    own = tilelang_ws_bwd.form_keywords(tilelang_ws_bwd.FORM)
    for schedule in ("ws", f"ws-{tilelang_ws_bwd.FORM}", "ws-timing", "ws-warp", "ws-timing-warp+scale+gam"):
        precompile_tilelang.compile_one(4, 2, "bfloat16", schedule)
    assert seen == [(("bfloat16", "bfloat16"), {}), (("bfloat16", "bfloat16"), {}),
                    (("bfloat16", "bfloat16"), {"timing": True, "mode": "full", **own}),
                    (("bfloat16", "bfloat16"), {"timing": False, "mode": "full", "colsums": "warp", "hoist": ""}),
                    (("bfloat16", "bfloat16"), {"timing": True, "mode": "full", "colsums": "warp",
                                                "hoist": "gam+scale"})]
    with pytest.raises(ValueError, match="none of"):
        precompile_tilelang.compile_one(4, 2, "bfloat16", "ws-gam")


def test_ws_probe_runs_a_prototype_mode_alone(capsys, monkeypatch):
    """A prototype build's results are wrong: `--check` or `--peer` with it is refused before any
    device is asked for; `--mode` takes the kernel's own modes only."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import ws_probe

    with pytest.raises(SystemExit) as e:
        ws_probe.main(["--mode", "bogus"])
    assert e.value.code == 2 and "nowait" in capsys.readouterr().err
    for extra in (["--check"], ["--peer"]):
        with pytest.raises(SystemExit) as e:
            ws_probe.main(["--mode", "nowait", *extra])
        assert e.value.code == 2
        assert "prototype" in capsys.readouterr().err


def test_ws_probe_names_builds_by_their_forms(capsys, monkeypatch):
    """`--colsums` takes a column-sum form with any of the kernel's hoist words (`HOIST_WORDS`),
    in any order, and refuses others before a device is asked for; the kernel refuses an unknown
    hoist word before it compiles anything."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import ws_probe

    from gdr_dispatch.backends.kernels import tilelang_ws_bwd

    assert ws_probe.form_keywords("warp+row+gam") == {"colsums": "warp", "hoist": "gam+row"}
    assert ws_probe.form_keywords("transpose") == {"colsums": "transpose", "hoist": ""}
    assert ws_probe.form_keywords(ws_probe.FORM) == {"colsums": tilelang_ws_bwd.COLSUMS,
                                                       "hoist": tilelang_ws_bwd.HOIST}
    assert ws_probe.variant(ws_probe.FORM) == "" and ws_probe.variant("warp+row") == " warp+row"
    for bogus in ("warp+bogus", "bogus", "warp+gam+hoist"):
        with pytest.raises(SystemExit) as e:
            ws_probe.main(["--colsums", bogus])
        assert e.value.code == 2 and "--colsums" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a misspelt shape would run nothing
        ws_probe.main(["--only", "B8T4096H23"])
    assert e.value.code == 2 and "--only" in capsys.readouterr().err
    with pytest.raises(ValueError, match="hoist"):
        tilelang_ws_bwd.build_ws_bwd.__wrapped__(2, 2, 0.1, "bfloat16", "bfloat16", hoist="gam+bogus")


def test_ws_probe_once_launches_the_first_forms_build(monkeypatch):
    """`--once` (what compute-sanitizer and ncu run) launches `--colsums`' first form, so a build
    is checked before it is the kernel's own."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import ws_probe

    from gdr_dispatch.shapes import ShapeSpec

    launched = []
    monkeypatch.setattr(ws_probe.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ws_probe.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(ws_probe, "SHAPES", {"tiny": ShapeSpec(B=1, T=128, H=2, K=16, V=16)})
    monkeypatch.setattr(ws_probe, "make_inputs", lambda spec, device, seed: {})
    monkeypatch.setattr(ws_probe, "runner", lambda x, **kw: lambda: launched.append(kw))
    assert ws_probe.main(["--only", "tiny", "--once", "--colsums", "warp+mma+gam,warp"]) == 0
    assert launched == [{"mode": "full", "colsums": "warp", "hoist": "gam+mma"}] * 2


def test_ws_probe_b2b_times_gpu_time_in_alternating_rounds(capsys, monkeypatch):
    """`--b2b` times each build back to back (`timing.back_to_back_ms`, never the per-call
    median), in `--rounds` alternating rounds, and prints every round's reading beside the least."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import ws_probe

    from gdr_dispatch.shapes import ShapeSpec

    readings, order = iter([1.0, 1.2, 0.9, 1.1, 1.3, 0.95]), []
    monkeypatch.setattr(ws_probe.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ws_probe, "FORM", "warp")  # the kernel's own form, whatever HOIST says
    monkeypatch.setattr(ws_probe, "SHAPES", {"tiny": ShapeSpec(B=1, T=128, H=2, K=16, V=16)})
    monkeypatch.setattr(ws_probe, "make_inputs", lambda spec, device, seed: {})
    monkeypatch.setattr(ws_probe, "runner", lambda x, **kw: kw.get("hoist", ""))
    monkeypatch.setattr(ws_probe, "measure_ms", lambda *a, **k: pytest.fail("a per-call median under --b2b"))
    monkeypatch.setattr(ws_probe, "back_to_back_ms", lambda fn, **k: order.append(fn) or next(readings))
    assert ws_probe.main(["--only", "tiny", "--colsums", "warp,warp+row", "--rounds", "3", "--b2b"]) in (0, None)
    assert order == ["", "row", "row", "", "", "row"]
    rows = [eval(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["runner"], r["ms"], r["ms_rounds"], r["timed"]) for r in rows] == [
        ("ws", 1.0, [1.0, 1.1, 1.3], "back to back"), ("ws warp+row", 0.9, [1.2, 0.9, 0.95], "back to back")]


def test_ncu_groups_compares_a_peer_group_by_group(tmp_path, capsys):
    """`--peer`: both pages split at their USETMAXREG lines in nvcc's order; instructions per
    warp and step, and samples on an mbarrier poll (a branch after a try-wait) kept apart from
    working samples, whose stall reasons are summed."""
    sys.path.insert(0, str(TOOLS))
    import ncu_groups

    from gdr_dispatch.backends.kernels.tilelang_ws_bwd import NREG

    caps = dict(zip(("S", "KV", "A", "producer"), NREG))
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_short_sb",
            "stall_long_sb", "stall_short_sb (Not Issued)"]

    def page(name, a_work, a_poll):
        rows = [head]
        for i, g in enumerate(("producer", "A", "KV", "S")):
            op = "USETMAXREG.DEALLOC" if g == "producer" else "USETMAXREG.TRY_ALLOC"
            rows.append([str(i), f"{op} 0x{caps[g]:x}", "0", "8", "0", "0", "0"])
            if g == "A":
                rows.append(["a", "FMUL.FTZ R1, R2, R3", str(a_work), "16", str(a_work), "0", "0"])
                rows.append(["b", "@!P0  BRA 0x10", str(a_poll), "8", "0", str(a_poll), "0"])
        path = tmp_path / name
        path.write_text("\n".join(",".join(f'"{c}"' for c in r) for r in rows) + "\n")
        return path

    ours, peer = page("ours.csv", 30, 5), page("peer.csv", 20, 9)
    assert ncu_groups.main([str(ours), "--top", "1", "--peer", str(peer), "--warps-steps", "8"]) == 0
    out = capsys.readouterr().out.split("ours / peer")[-1]  # the comparison, after the per-group sums
    line = next(l for l in out.splitlines() if l.startswith("A | "))
    # (8 + 16 + 8) / 8 instructions; 30 / 20 working, 5 / 9 polling; short_sb only from work
    assert line.startswith("A | 4 / 4 | 30 / 20 | 5 / 9 | short_sb 30 / 20")


def test_bench_states_timing_reads_each_groups_counters_per_chunk(monkeypatch):
    """bench_states.py --timing: the counters of every CTA and role group, divided by the CTA's
    chunks and averaged, under each group's own names (the kernel writes them; made up here)."""
    import bench_states

    from gdr_dispatch.backends.kernels import tilelang_states as ts
    from gdr_dispatch.contract import validate
    from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs

    call = validate(**call_kwargs(make_inputs(ShapeSpec(seqlens=(64, 192), H=1, K=16, V=8, h="none"), "cpu")))
    NS = ts.TIMING_SLOTS

    def fake(*args, clk=None):
        c = clk.view(call.N * call.H, 4, NS)
        for cta, chunks in enumerate((1, 3)):
            c[cta, :, :NS - 1] = torch.arange(NS - 1, dtype=torch.int32) * 10 * chunks * (cta + 1)
            c[cta, :, NS - 1] = chunks
        return None, None

    monkeypatch.setattr(ts, "chunk_states", fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench_states.torch, "zeros", lambda *a, **kw: torch.empty(*a, dtype=kw["dtype"]))
    out = bench_states.timing(call).splitlines()
    assert out[0] == "cycles per chunk step (mean over 2 CTAs)"
    # slot j per chunk: 10 j (first CTA) and 20 j (second): mean 15 j
    assert out[1].startswith("S0") and "work 0  ready wait 15  work 30  xready wait 45  work 60" in out[1]
    assert out[3].startswith("X") and "ready wait 0  work 15" in out[3] and out[3].endswith("| loop 90")


def test_hot_path_bench_times_every_runner_and_profiles_on_a_cpu(tmp_path, monkeypatch, with_backends):
    """bench_hot_path.py's plumbing on a CPU with FlashQLA faked (tests/fake_flash_qla.py): the
    dispatched call, the pick through GDR_BACKEND, its `run` and its own call each get their three
    readings, and the stand-in its thread CPU time; the row says what dispatched adds against the
    own call and what fused_gdr_bwd costs alone; the profile's files exist; GDR_BACKEND is restored
    after the runner that sets it; the stand-in takes only calls GDR_BACKEND names it for."""
    import bench_hot_path as bh
    import fake_flash_qla

    from gdr_dispatch.backends import flash_qla

    sys.path.insert(0, str(ROOT / "tests"))
    calls = fake_flash_qla.install(monkeypatch)
    with_backends(flash_qla.FlashQLABackend())
    monkeypatch.setattr(flash_qla.FlashQLABackend, "not_supported_reasons", lambda self, p: [])
    monkeypatch.delenv("GDR_BACKEND", raising=False)
    assert bh.main(["--device", "cpu", "--shapes", "1,64,2,1,16,16", "--dtype", "float16", "--reps", "2",
                    "--rounds", "1", "--profile", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "cpu-hot-path.json").read_text())
    assert [r["h"] for r in doc["rows"]] == ["given", "none"]
    for row in doc["rows"]:
        assert row["pick"] == "flash_qla"
        runs = row["runs"]
        for name in ("dispatched", "via flash_qla", "run flash_qla", "own flash_qla"):
            assert {"latency_ms", "b2b_ms", "host_us"} <= set(runs[name]), (name, runs[name])
        assert "unsupported" in runs["via tilelang_fused"]["skipped"]
        assert row["added"]["against"] == "own flash_qla" and row["added"]["latency_ratio"] > 0
        assert {"host_cpu_us"} <= set(runs["via canned"]) and {"host_cpu_us"} <= set(runs["run canned"])
        assert "dispatcher_cpu_us" in row["added"]
        assert all(Path(f).stat().st_size > 0 for f in row["profile"])
    assert "fused_gdr_h" in calls and "chunk_local_cumsum" in calls and "group_reduce_vector" in calls
    md = (tmp_path / "cpu-hot-path.md").read_text()
    assert "| B1 T64 H2 Hg1 K16 V16 float16 | given | flash_qla |" in md and "own flash_qla" in md
    assert "GDR_BACKEND" not in bh.os.environ
    assert "hot_path_canned" not in bh.registry.registered_backends()  # registered for the bench's runs only
    from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs

    call = bh.validate(**call_kwargs(make_inputs(ShapeSpec(B=1, T=64, H=2, K=16, V=16, dtype="float16",
                                                           h="given"), "cpu")))
    stand_in, problem = bh.Canned(call), bh.Problem.from_call(call)
    assert not stand_in.supported(problem)[0]  # never a candidate: only where GDR_BACKEND names it
    monkeypatch.setenv("GDR_BACKEND", stand_in.name)
    assert stand_in.supported(problem)[0]
    assert "cProfile, 200 calls of dispatched" in Path(doc["rows"][0]["profile"][1]).read_text()


def test_hf_first_step_runs_each_model_fresh_then_warm_on_its_own_caches(monkeypatch, tmp_path):
    """`bench_hf_qwen3_next.py --first-step`: per model a process on fresh cache directories
    (TileLang's, Triton's, our tables) and a second on the same ones; the models never share them."""
    import argparse
    import subprocess

    import bench_hf_qwen3_next as hf

    calls = []

    def fake_run(cmd, env, capture_output, text, timeout):
        calls.append((cmd[cmd.index("--only") + 1], {k: env[k] for k in ("TRITON_CACHE_DIR", "TILELANG_CACHE_DIR",
                                                                          "GDR_TUNING_CACHE")}))
        out = json.dumps({"which": calls[-1][0], "losses": [1.0], "first_step_s": 1.5 * len(calls), "step_ms": 9.0})
        if len(calls) == 2:  # a process that printed no JSON: its row says so, the others go on
            return subprocess.CompletedProcess(cmd, 0, stdout="noise\n", stderr="oops\n")
        return subprocess.CompletedProcess(cmd, 0, stdout="noise\n" + out + "\nafter\n", stderr=f"log {len(calls)}\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    a = argparse.Namespace(cache_root=str(tmp_path / "caches"), steps=2, B=1, T=128, heads=2, key_heads=1, layers=1,
                           child_timeout=10.0)
    doc = hf.first_steps(a)
    assert [c[0] for c in calls] == ["default", "default", "ours", "ours"]
    assert calls[0][1] == calls[1][1] and calls[2][1] == calls[3][1]
    assert not set(calls[0][1].values()) & set(calls[2][1].values())
    assert all(str(tmp_path) in d for _, dirs in calls for d in dirs.values())
    assert doc["runs"]["ours warm"]["first_step_s"] == 6.0 and doc["runs"]["default fresh"]["first_step_s"] == 1.5
    assert doc["runs"]["default warm"] == {"failed": "oops"}
    # each process's stderr kept beside --out (here without one: in the cache root)
    assert Path(doc["runs"]["ours warm"]["log"]).read_text() == "log 4\n"
    assert (tmp_path / "caches" / "default-warm.log").read_text() == "oops\n"
    a.out = str(tmp_path / "res" / "hf.json")
    shutil.rmtree(tmp_path / "caches")
    calls.clear()
    doc = hf.first_steps(a)
    assert (tmp_path / "res" / "hf-logs" / "ours-fresh.log").read_text() == "log 3\n"
    (tmp_path / "caches" / "x").mkdir(parents=True, exist_ok=True)  # not empty: its caches would read as fresh
    with pytest.raises(SystemExit, match="not empty"):
        hf.first_steps(a)


def test_training_bench_warms_up_until_the_split_graphs_stop_capturing(monkeypatch):
    """A burst of captures (each about two eager steps) is warm-up, never a timed step: `settle`
    runs steps until SETTLED in a row capture nothing, and stops at SETTLE_STEPS whatever
    happens."""
    import bench_training_op as bt

    from gdr_dispatch.backends.split import graphs

    monkeypatch.setattr(graphs, "captures", graphs.collections.Counter())
    calls = []

    def step(burst):
        calls.append(1)
        if len(calls) <= burst:
            graphs.captures["in place"] += 1

    assert bt.settle(lambda: step(3)) == 3 + bt.SETTLED and len(calls) == 3 + bt.SETTLED
    calls.clear()
    assert bt.settle(lambda: step(10 ** 6)) == bt.SETTLE_STEPS and len(calls) == bt.SETTLE_STEPS
    calls.clear()
    assert bt.settle(lambda: step(0)) == bt.SETTLED
    calls.clear()
    gaps = iter([1, 0, 1, 0, 0, 1, 0, 0, 0, 1])  # captures per step, in bursts with quiet steps between

    def bursty():
        calls.append(1)
        graphs.captures["in place"] += next(gaps)

    assert bt.settle(bursty) == 9


def test_training_bench_graph_variants_set_the_flags_for_the_step_only(monkeypatch):
    """`ours/graphs=<variant>` turns the split graphs' features on for its whole step (the backward
    runs after the forward returns) and leaves the module's constants as they were afterwards."""
    import bench_training_op as bt

    from gdr_dispatch.backends.split import graphs

    seen = []

    def op(q, k, v, g, beta, **kw):  # a stand-in op that reads the flags as the backward would
        seen.append((graphs.PLACED_GPU_VERIFIED, graphs.LEND_GPU_VERIFIED))
        q = q * 1
        return q.sum(-1, keepdim=True).expand_as(v) * 0 + v, kw["initial_state"] * 1

    monkeypatch.setattr(graphs, "PLACED_GPU_VERIFIED", False)
    monkeypatch.setattr(graphs, "LEND_GPU_VERIFIED", False)
    ops = bt.runners(graph_variants=["lend", "placed+lend"])
    from gdr_dispatch.shapes import ShapeSpec
    x = bt.step_inputs(ShapeSpec(B=1, T=8, H=2, K=4, V=4, dtype="float32"), "cpu")
    for name, flags in (("ours/graphs=lend", (False, True)), ("ours/graphs=placed+lend", (True, True))):
        bt.step(bt.Forced(op, graph_flags=ops[name].graph_flags), x)
        assert seen[-1] == flags
        assert (graphs.PLACED_GPU_VERIFIED, graphs.LEND_GPU_VERIFIED) == (False, False)


def test_training_bench_names_where_each_host_wait_happened(monkeypatch):
    """`synchronizing_calls` counts the step's sync warnings (torch's sync debug mode, stubbed here)
    and names the Python frames each came from; other warnings do not count."""
    import warnings

    import bench_training_op as bt

    monkeypatch.setattr(bt.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bt.torch.cuda, "set_sync_debug_mode", lambda mode: None)

    def reads_lengths():
        warnings.warn("called a synchronizing CUDA operation (stand-in)")

    def step():
        warnings.warn("something else")
        reads_lengths()
        reads_lengths()

    got = bt.synchronizing_calls(step)
    assert got["count"] == 2 and got["first"].startswith("called a synchronizing")
    assert all(w.startswith("test_bench_scripts.py:") and "reads_lengths" in w.split(" < ")[0] for w in got["where"])
    assert bt.synchronizing_calls(lambda: None) == {"count": 0}


def test_device_run_steps_and_variables_are_the_ones_tools_readme_lists():
    """Every step of tools/device_run.sh is a row of tools/README.md's step table and the other
    way round, and every variable the script reads (bar the machine's own) is named there."""
    import re

    script = (TOOLS / "device_run.sh").read_text()
    readme = (TOOLS / "README.md").read_text()
    steps = set(re.findall(r"^    ([a-z0-9]+)\)", script, re.M))
    rows = set(re.findall(r"^\| `([a-z0-9]+)` \|", readme.split("## Reading kernels")[0], re.M))
    assert steps and steps == rows, (steps - rows, rows - steps)
    variables = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", script)) - {"OUT", "PWD", "PIPESTATUS"}
    assert {"WS_HOIST", "PROBE_ARGS", "SANITIZE_FORMS"} <= variables
    assert not {v for v in variables if f"`{v}" not in readme}
