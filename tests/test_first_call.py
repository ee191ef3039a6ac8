"""A first call's levers that need no GPU: the families the device's tables show never winning at
full grids (or at starved ones, for a starved call) are not measured, and the user waiting is told what happens (docs/design.md,
"Autotuning"). Tables are written here for a faked GPU."""

import logging
import time
import types
from dataclasses import replace

import pytest
import torch

from gdr_dispatch import Backend, registry, tuning_table
from gdr_dispatch import autotune as at
from gdr_dispatch.problem import DeviceInfo
from gdr_dispatch.shapes import ShapeSpec

GPU = DeviceInfo("cuda", "Fake GPU", (9, 0), 16)


class Member(Backend):
    def __init__(self, name, family=None):
        self.name, self.family_name = name, family

    def not_supported_reasons(self, problem):
        return []


def problem(B=4, H=8, T=1024, h="given"):
    """4 x 8 = 32 programs on 16 SMs: a full grid; B=1, H=8 is a starved one."""
    return replace(ShapeSpec(B=B, T=T, H=H, K=64, V=64, dtype="bfloat16", h=h).problem(torch.device("cpu")), device=GPU)


def record(p, winner, ms: dict):
    tuning_table.record(GPU.slug, GPU.name, {p.table_key(): {
        "problem": p.describe(), "winner": winner,
        "candidates": {n: ({"ms": v} if isinstance(v, (int, float)) else v) for n, v in ms.items()}}})


@pytest.fixture
def fakes(with_backends):
    with_backends(Member("fast_a"), Member("slow_x", "slow"), Member("slow_y", "slow"), Member("other"))


def full_grid_history(times=3, slow=1.5, T0=2048):
    for i in range(times):
        record(problem(T=T0 * 2 ** i), "fast_a", {"fast_a": 1.0, "slow_x": slow, "slow_y": slow + 0.2, "other": 1.05})


def test_a_family_that_never_won_at_full_grids_is_not_measured(fakes, caplog):
    full_grid_history()
    cands = {n: registry.get_backend(n) for n in ("fast_a", "slow_x", "slow_y", "other")}
    kept, skipped = at.prune(problem(), cands)
    assert set(kept) == {"fast_a", "other"}
    assert set(skipped) == {"slow_x", "slow_y"}
    assert "the slow family never won at the 3 full-grid entries" in skipped["slow_x"]
    assert "at best 1.50x the winner" in skipped["slow_x"]


@pytest.mark.parametrize("case", ["starved", "two entries", "won once", "close once", "other h mode", "all"])
def test_the_family_rule_is_conservative(fakes, monkeypatch, case):
    cands = {n: registry.get_backend(n) for n in ("fast_a", "slow_x", "slow_y")}
    target = problem()
    if case == "starved":  # 1 x 8 programs on 16 SMs: the tables' full grids say nothing of it
        full_grid_history()
        target = problem(B=1)
    elif case == "two entries":
        full_grid_history(times=2)
    elif case == "won once":
        full_grid_history()
        record(problem(T=64), "slow_y", {"fast_a": 1.0, "slow_y": 0.9})
    elif case == "close once":
        full_grid_history()
        record(problem(T=64), "fast_a", {"fast_a": 1.0, "slow_x": 1.05})
    elif case == "other h mode":
        full_grid_history()
        target = problem(h="none")
    else:
        full_grid_history()
        monkeypatch.setenv("GDR_AUTOTUNE_ALL", "1")
        kept, skipped = at.prune(target, cands)
        assert set(kept) == set(cands) and skipped == {}
    assert case == "all" or at.losing_families(target) == {}, case


def test_a_problem_counts_once_whatever_copies_of_its_entry_the_tables_hold(fakes):
    """An entry and its copy for users without an optional peer (the same problem, other library
    versions in the key) are one measurement: two problems so recorded twice are still too few."""
    for T in (2048, 4096):
        p = problem(T=T)
        entry = {"problem": p.describe(), "winner": "fast_a",
                 "candidates": {"fast_a": {"ms": 1.0}, "slow_x": {"ms": 1.5}, "slow_y": {"ms": 1.7}}}
        copy = {**entry, "candidates": {"fast_a": {"ms": 1.0}, "slow_x": {"ms": 1.5}}}
        tuning_table.record(GPU.slug, GPU.name, {p.table_key(): entry, p.table_key() + ",peer=0.1": copy})
    assert at.losing_families(problem()) == {}
    full_grid_history(times=1, T0=8192)  # a third problem
    assert "slow" in at.losing_families(problem())


def test_starved_entries_are_no_evidence_at_full_grids(fakes):
    """Entries at starved grids (fewer programs than SMs) neither count against a family nor for it
    at a full grid."""
    for T in (2048, 4096, 8192):
        record(problem(B=1, T=T), "fast_a", {"fast_a": 1.0, "slow_x": 3.0})
    assert at.losing_families(problem()) == {}


def test_a_family_that_never_won_at_starved_grids_is_not_measured_there(fakes):
    """The starved regime by its own entries: a family (its splits included) that never won at 3
    starved entries is skipped at a starved call, not at a full one; one win there keeps it."""
    for T in (2048, 4096, 8192):
        record(problem(B=1, T=T), "fast_a@split4", {"fast_a@split4": 1.0, "slow_x": 3.0, "slow_y@split4": 1.2})
    cands = {n: registry.get_backend(n) for n in ("fast_a", "slow_x", "slow_y", "other")}
    kept, skipped = at.prune(problem(B=1), cands)
    assert set(skipped) == {"slow_x", "slow_y"} and set(kept) == {"fast_a", "other"}
    assert "the slow family never won at the 3 starved-grid entries" in skipped["slow_x"]
    assert "at best 1.20x the winner" in skipped["slow_x"]
    assert at.losing_families(problem()) == {}
    record(problem(B=1, T=64), "slow_y@split2", {"fast_a": 1.1, "slow_y@split2": 1.0})
    assert at.losing_families(problem(B=1)) == {}


def test_a_first_call_says_what_it_waits_for_at_warning(fakes, monkeypatch, caplog):
    """Python's logging shows WARNING without any set-up: the start, a line at most every
    HEARTBEAT_S while it lasts, and the pick."""
    call = types.SimpleNamespace(q=torch.zeros(1))  # (what first_call reads of it here: its device)
    p = problem()
    monkeypatch.setattr(at, "compile_jobs_of", lambda call, kept: {("m", "f", (1,)): ["fast_a"],
                                                                  ("m", "g", (2,)): ["other"]})
    monkeypatch.setattr(at, "precompile", lambda jobs, workers, say, device=None: say("compiled everything"))
    monkeypatch.setattr(at, "autotune", lambda call, problem, cands, progress, skipped=None, untimed=(): (
        progress("autotune [1/2] fast_a: 1.0 ms") or ({"winner": "fast_a", "candidates": {}}, None)))
    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        entry, _ = at.first_call(call, p, {n: registry.get_backend(n) for n in ("fast_a", "other")})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "no tuning-table entry, so 2 of 2 candidates are measured on it, their 2 kernels compiled first" in warnings[0]
    assert "GDR_AUTOTUNE=0" in warnings[0] and "fast_a picked in" in warnings[-1]
    assert len(warnings) == 2  # everything between within HEARTBEAT_S: INFO
    caplog.clear()
    monkeypatch.setattr(at, "HEARTBEAT_S", 0.0)
    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        at.first_call(call, p, {n: registry.get_backend(n) for n in ("fast_a", "other")})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("compiled everything" in w for w in warnings) and any("autotune [1/2]" in w for w in warnings)


def test_compiling_says_that_it_goes_on(monkeypatch):
    import time

    monkeypatch.setattr(at, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(at, "_compile_in_subprocess", lambda job, device=None: time.sleep(0.3) or 0.3)
    lines = []
    at.precompile({("m", "f", (1,)): ["a"], ("m", "f", (2,)): ["b"]}, 1, lines.append)
    assert any(line.startswith("  still compiling: 0 of 2 done") for line in lines), lines
    assert lines[-1].startswith("  all 2 in")


def test_compiles_started_early_are_waited_for_not_run_again(tmp_path):
    """`start_compiles` runs jobs in background processes at once; `precompile` later waits for
    those (each built once) and says so as for its own."""
    marker = tmp_path / "runs"
    # a job is the module and function a worker process imports and calls: this one appends to a file
    job = ("builtins", "exec", (f"open({str(marker)!r}, 'a').write('x')",))
    assert at.start_compiles({job: ["a"]}) == 1
    assert at.start_compiles({job: ["a"]}) == 0  # already running (or done): not started twice
    lines = []
    at.precompile({job: ["a"], ("builtins", "exec", ("pass",)): ["b"]}, 2, lines.append)
    assert marker.read_text() == "x"
    assert any("compiled a: exec" in line for line in lines) and any("compiled b: exec" in line for line in lines)
    assert job not in at._early


def test_the_ops_first_training_forward_starts_its_backwards_builds(monkeypatch, with_backends, caplog):
    """A training forward (inputs that require grad) at a new shape starts the builds of the
    backward's candidates right away; an inference forward, or a second call, starts none."""
    from gdr_dispatch import chunk_gated_delta_rule, clear_caches, training
    from gdr_dispatch import dispatch as dsp

    started = []

    class Building(Member):
        def compile_jobs(self, call):
            return [("m", "build", (self.name, call.H, call.dht is not None, call.h is not None))]

    with_backends(Building("fast_a"), Building("other"))
    monkeypatch.setattr(at, "start_compiles", lambda jobs, **kw: started.extend(jobs) or len(jobs))
    monkeypatch.setattr(dsp, "autotune_block_reason", lambda p, have_tensors: None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the trigger's own check
    x = {n: torch.randn(1, 130, 2, 16, dtype=torch.float64) for n in ("q", "k", "v")}
    g = -torch.rand(1, 130, 2, dtype=torch.float64)
    beta = torch.rand(1, 130, 2, dtype=torch.float64)
    clear_caches()
    with torch.no_grad():
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, beta)
    assert started == []
    q = x["q"].clone().requires_grad_(True)
    clear_caches()
    ran = []
    provider = type(registry.get_backend("torch"))
    real = provider.forward
    monkeypatch.setattr(provider, "forward", lambda self, *a, **kw: ran.append(len(started)) or real(self, *a, **kw))
    with caplog.at_level(logging.INFO, logger="gdr_dispatch"):
        chunk_gated_delta_rule(q, x["k"], x["v"], g, beta, output_final_state=True)
    assert ran[:1] == [2]  # the builds started before the forward ran (chosen first: nothing to measure)
    assert sorted(started) == [("m", "build", ("fast_a", 2, True, False)), ("m", "build", ("other", 2, True, False))]
    assert any("kernel builds started in the background" in r.getMessage() for r in caplog.records)
    chunk_gated_delta_rule(q, x["k"], x["v"], g, beta, output_final_state=True)
    assert len(started) == 2  # the plan is made: nothing more


def test_an_early_job_stopped_at_exit_takes_its_compilers_with_it(tmp_path):
    """`_stop_early` stops a job's whole process group: a compiler it started leaves nothing behind."""
    marker = tmp_path / "orphan"
    code = (f"import subprocess, time; subprocess.Popen(['sh', '-c', 'sleep 2; touch {marker}']); time.sleep(30)")
    job = ("builtins", "exec", (code,))
    assert at.start_compiles({job: ["a"]}) == 1
    time.sleep(1.0)  # the job has started its child
    at._stop_early()
    time.sleep(2.5)
    assert not marker.exists() and at._early == {}


def test_a_table_hit_builds_its_winner_early_once_per_install(monkeypatch, with_backends, tmp_path):
    """A tuned shape's first training forward starts its backward winner's builds (not the
    others'), so they overlap the forward's own; a job a process before built (its marker, written
    by the job itself) is not started again: a tuned model's later launches start no processes.
    The backward's first call waits for exactly the builds its forward started."""
    from gdr_dispatch import dispatch as dsp
    from gdr_dispatch.contract import validate
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    started = []

    class Building(Member):
        def compile_jobs(self, call):
            return [("builtins", "len", (self.name,))]

    with_backends(Building("fast_a"), Building("other"))
    real_start = at.start_compiles
    monkeypatch.setattr(at, "start_compiles", lambda jobs, unbuilt_only=False, **kw: started.extend(jobs) or len(jobs))
    monkeypatch.setattr(dsp, "autotune_block_reason", lambda p, have_tensors: None)
    call = validate(**call_kwargs(make_inputs(ShapeSpec(B=1, T=100, H=2, K=16, V=16, dtype="float64", h="none"),
                                              "cpu")))
    assert dsp.start_backward_compiles(call) == 2  # a miss: every candidate's
    p = dsp.Problem.from_call(call)
    tuning_table.record(p.device.slug, p.device.name, {p.table_key(): {"winner": "fast_a",
                                                                        "candidates": {"fast_a": {"ms": 1.0}}}})
    started.clear()
    job = ("builtins", "len", ("fast_a",))
    assert dsp.start_backward_compiles(call) == 1 and started == [job]
    # once per table key and winner (a varlen run meets new lengths every step): not again
    assert dsp.start_backward_compiles(call) == 0 and started == [job]
    # the backward's first call waits for exactly those, once
    waited = []
    real_wait = at.wait_early
    monkeypatch.setattr(at, "wait_early", lambda j: waited.append(j))
    choice = dsp.select_backend(p, call)
    assert choice.source == dsp.TABLE and choice.backend.name == "fast_a" and waited == [job]
    # the job runs in its own process and marks itself built; the next process starts nothing
    monkeypatch.setattr(at, "wait_early", real_wait)
    monkeypatch.setattr(at, "start_compiles", real_start)
    assert at.start_compiles([job], unbuilt_only=True) == 1
    assert at.wait_early(job) is not None and at.built_marker(job).exists()
    assert at.start_compiles([job], unbuilt_only=True) == 0 and at.start_compiles([job]) == 1
    at.wait_early(job)
    dsp.clear_caches()  # a new process, as far as the dispatcher knows
    assert dsp.start_backward_compiles(call) == 0 and not at._early


def test_an_early_build_that_writes_odd_bytes_or_fails_never_fails_the_call(monkeypatch):
    """An early job's stderr is a compiler's (any bytes) and it may fail: waiting for it logs and
    returns, the call that needs it builds it itself."""
    odd = ("builtins", "exec", ("import sys; sys.stderr.buffer.write(bytes([255, 254, 10])); sys.stderr.flush()",))
    bad = ("builtins", "exec", ("import sys; sys.stderr.buffer.write(bytes([255, 10])); sys.exit(3)",))
    monkeypatch.setattr(at, "compile_workers", lambda: 8)  # (a 2-core machine runs one at a time)
    assert at.start_compiles([odd, bad]) == 2
    assert at.wait_early(odd) is not None
    assert at.wait_early(bad) is None and not at._early


def test_an_interrupted_wait_stops_its_early_build(monkeypatch):
    """Ctrl-C while the backward waits for an early build: the build stops with it (its own
    process group would not hear the terminal's signal), nothing is left for the exit."""
    job = ("builtins", "exec", ("import time; time.sleep(30)",))
    monkeypatch.setattr(at, "compile_workers", lambda: 8)
    assert at.start_compiles([job]) == 1
    proc = at._early[job][0]

    def interrupted(started, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(at, "_finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        at.wait_early(job)
    assert proc.poll() is not None and job not in at._early


def test_a_warm_runs_marker_keys_on_what_it_compiles_not_the_lengths():
    """A warm run (`warm_job`) builds what its backend compiles and autotunes on, whatever the
    lengths: one marker for a shape's packs, another for other heads."""
    def job(**spec):
        base = dict(B=1, T=100, H=2, Hg=2, K=16, V=16, dtype="bfloat16", h="none", initial_state=False, dht=False,
                    state_v_first=False, chunk_size=64, seqlens=None)
        return ("gdr_dispatch.autotune", "warm_backend", ("fla", tuple(sorted({**base, **spec}.items())), "cuda:0"))

    assert at.built_marker(job(T=300, seqlens=(100, 200))) == at.built_marker(job(T=500, seqlens=(250, 250)))
    assert at.built_marker(job(T=300, seqlens=(100, 200))) != at.built_marker(job(T=300))  # varlen or not
    assert at.built_marker(job()) != at.built_marker(job(H=4))
    assert at.built_marker(("m", "f", (1,))) != at.built_marker(("m", "f", (2,)))


def test_early_builds_can_be_turned_off(monkeypatch):
    """GDR_EARLY_BUILDS=0: no early build starts (the op's forward asks `start_compiles` for its
    backward's; a table-miss first call still compiles its own candidates, `precompile`)."""
    monkeypatch.setenv("GDR_EARLY_BUILDS", "0")
    job = ("builtins", "len", ("off",))
    assert at.start_compiles([job]) == 0 and job not in at._early
    monkeypatch.setenv("GDR_EARLY_BUILDS", "maybe")
    with pytest.raises(ValueError, match="GDR_EARLY_BUILDS"):
        at.start_compiles([job])


def test_an_early_build_past_its_time_is_stopped_and_said(monkeypatch, caplog):
    """A build that runs past EARLY_WAIT_S (hung): the wait stops it and says so at WARNING; the
    call builds the kernel itself."""
    job = ("builtins", "exec", ("import time; time.sleep(30)",))
    monkeypatch.setattr(at, "compile_workers", lambda: 8)
    monkeypatch.setattr(at, "EARLY_WAIT_S", 0.5)
    assert at.start_compiles([job]) == 1
    proc = at._early[job][0]
    with caplog.at_level(logging.INFO, logger="gdr_dispatch"):
        assert at.wait_early(job) is None
    assert proc.poll() is not None and job not in at._early
    assert any(r.levelno == logging.WARNING and "still building after" in r.getMessage() for r in caplog.records)


class _FakeProc:
    pid = -1

    def poll(self):
        return None

    def wait(self, timeout=None):
        return 0


def test_early_builds_run_on_the_calls_gpu_and_leave_it_memory(monkeypatch, caplog):
    """Each background build is told the call's GPU (index and name: under torchrun each rank's
    build runs on its own GPU, and its marker names the GPU it was built on); no more start than
    the GPU's free memory leaves room for (EARLY_BUILD_FREE each), the rest said once."""
    import subprocess

    argv = []
    monkeypatch.setattr(subprocess, "Popen", lambda args, **kw: argv.append(args) or _FakeProc())
    monkeypatch.setattr(at, "_build_device", lambda device=None: (3, "Fake GPU"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (2 * at.EARLY_BUILD_FREE + 1, 80 << 30))
    monkeypatch.setattr(at, "compile_workers", lambda: 8)
    monkeypatch.setattr(at, "_early", {})
    jobs = [("builtins", "len", (i,)) for i in range(4)]
    with caplog.at_level(logging.INFO, logger="gdr_dispatch"):
        assert at.start_compiles(jobs, device=torch.device("cuda", 3)) == 2
    assert [a[-2:] for a in argv] == [["3", "Fake GPU"]] * 2
    assert any("too little free memory" in r.getMessage() for r in caplog.records)
    assert at.built_marker(jobs[0], "Fake GPU") != at.built_marker(jobs[0], "Other GPU") != at.built_marker(jobs[0])
    at._early.clear()
    # builds that run the call at full size ask for room for it: a large call starts fewer
    big = torch.empty(at.EARLY_BUILD_FREE // at.WARM_RUN_FACTOR, dtype=torch.uint8, device="meta")
    assert at.build_bytes(big, None) == 2 * at.EARLY_BUILD_FREE
    assert at.start_compiles(jobs, device=torch.device("cuda", 3), per_job=at.build_bytes(big)) == 1
    at._early.clear()


def test_a_split_winner_builds_its_own_passes_early_too():
    """`<backend>@split<n>`'s compile jobs: its inner backend's builds and a run of its own passes
    (`warm_passes`: the segments' backward a stand-in of zeros), so the passes' Triton kernels
    compile beside the inner builds, not in the caller's process at the first backward; the
    passes job runs (here on a CPU) and its marker keys on what it compiles, not the lengths."""
    from gdr_dispatch import registered_backends
    from gdr_dispatch.backends.split import SplitBackend
    from gdr_dispatch.contract import validate
    from gdr_dispatch.shapes import call_kwargs, make_inputs

    def call_of(seqlens):
        spec = ShapeSpec(T=sum(seqlens), H=2, K=16, V=16, dtype="float64", h="none", seqlens=seqlens)
        return validate(**call_kwargs(make_inputs(spec, "cpu")))

    split = SplitBackend(registered_backends()["torch"], 2)
    jobs = split.compile_jobs(call_of((100, 200)))
    mine = [j for j in jobs if j[1] == "warm_passes"]
    assert len(mine) == 1 and mine[0][2][0] == (2, split.inner.own_state_recompute())
    assert at.run_compile_job(mine[0]) >= 0 and at.built_marker(mine[0]).exists()
    other = [j for j in split.compile_jobs(call_of((250, 50))) if j[1] == "warm_passes"][0]
    assert other != mine[0] and at.built_marker(other) == at.built_marker(mine[0])
