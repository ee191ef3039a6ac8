"""Selection order, the GDR_BACKEND override, autotuning and its cross-check, the tables."""

import logging
import re
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
import yaml

from gdr_dispatch import Backend, Problem, fused_gdr_bwd, plans, registry, tuning_table
from gdr_dispatch import autotune as at
from gdr_dispatch import dispatch as dsp
from gdr_dispatch.contract import validate
from gdr_dispatch.problem import OPTIONAL_LIBS, DeviceInfo
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs

SPEC = ShapeSpec(B=1, T=70, H=2, K=8, V=8, dtype="float32", h="given")


@pytest.fixture
def kwargs():
    return call_kwargs(make_inputs(SPEC, "cpu"))


class Fake(Backend):
    """Delegates to the torch backend, optionally wrong, slow, broken or picky."""

    def __init__(self, name, scale=1.0, raises=False, refuse=None):
        self.name, self.scale, self.raises, self.refuse, self.calls = name, scale, raises, refuse, 0

    def not_supported_reasons(self, problem):
        return [self.refuse] if self.refuse else []

    def run(self, call):
        self.calls += 1
        if self.raises:
            raise RuntimeError("kernel exploded")
        g = registry.get_backend("torch").run(call)
        return g._replace(dq=g.dq * self.scale)


@pytest.fixture
def fakes(with_backends):
    def add(*args, **kw):
        return with_backends(Fake(*args, **kw))

    yield add


def fake_cuda(problem):
    return replace(problem, device=DeviceInfo("cuda", "Fake GPU", (9, 0), 132))


class WrongShape(Fake):
    def run(self, call):
        g = super().run(call)
        return g._replace(dq=g.dq[..., :-1])


def test_a_backend_returning_the_wrong_shape_is_caught(kwargs, monkeypatch, with_backends):
    with_backends(WrongShape("fake_wrong"))
    monkeypatch.setenv("GDR_BACKEND", "fake_wrong")
    with pytest.raises(RuntimeError, match="backend 'fake_wrong' returned dq as"):
        fused_gdr_bwd(**kwargs)


def test_outputs_are_checked_once_per_backend_and_problem(kwargs, fakes, monkeypatch):
    fakes("fake_a")
    monkeypatch.setenv("GDR_BACKEND", "fake_a")
    seen = []
    monkeypatch.setattr(dsp, "check_outputs", lambda call, grads, name: seen.append(name))
    for _ in range(3):
        plans.backward.clear()  # each call decides again (a kept plan's runner never reaches the check)
        fused_gdr_bwd(**kwargs)
    assert seen == ["fake_a"]
    fused_gdr_bwd(**{**kwargs, "h": None})  # another Problem: checked again
    assert seen == ["fake_a", "fake_a"]


# -- the override ---------------------------------------------------------------------
def test_forced_backend_runs(kwargs, fakes, monkeypatch):
    f = fakes("fake_a")
    monkeypatch.setenv("GDR_BACKEND", "fake_a")
    fused_gdr_bwd(**kwargs)
    assert f.calls == 1


def test_forced_unknown_lists_known(kwargs, monkeypatch):
    monkeypatch.setenv("GDR_BACKEND", "tilelang_fusd")
    with pytest.raises(ValueError, match="unknown backend 'tilelang_fusd'.*known backends: .*torch"):
        fused_gdr_bwd(**kwargs)


def test_forced_unsupported_says_why(kwargs, fakes, monkeypatch):
    fakes("fake_picky", refuse="needs capability 9.0, this device is cpu")
    monkeypatch.setenv("GDR_BACKEND", "fake_picky")
    with pytest.raises(dsp.NoBackendError, match="fake_picky.*needs capability 9.0, this device is cpu"):
        fused_gdr_bwd(**kwargs)


def test_env_is_read_per_call(kwargs, fakes, monkeypatch):
    f = fakes("fake_a")
    monkeypatch.setenv("GDR_BACKEND", "fake_a")
    fused_gdr_bwd(**kwargs)
    monkeypatch.setenv("GDR_BACKEND", "torch")
    fused_gdr_bwd(**kwargs)
    assert f.calls == 1


def test_nothing_supported_lists_every_reason(kwargs, fakes, monkeypatch):
    fakes("fake_picky", refuse="K must be 128; dtype must be bf16")
    monkeypatch.setattr(registry.get_backend("torch"), "not_supported_reasons", lambda p: ["switched off in this test"])
    with pytest.raises(dsp.NoBackendError) as info:
        fused_gdr_bwd(**kwargs)
    assert "fake_picky: K must be 128; dtype must be bf16" in str(info.value)
    assert "torch: switched off in this test" in str(info.value)


# -- selection order --------------------------------------------------------------------
def test_static_order_on_cpu_never_autotunes(kwargs, fakes, monkeypatch):
    fakes("fake_a")
    monkeypatch.setattr(dsp, "first_call", lambda *a, **k: pytest.fail("autotuned a CPU call"))
    problem = Problem.from_call(validate(**kwargs))
    choice = dsp.select_backend(problem, validate(**kwargs))
    assert choice.backend.name == "torch"  # torch (rank 100) is ahead of the fake (default rank 1000)
    assert choice.source == dsp.STATIC and "cpu tensors are never autotuned" in choice.detail


def test_graph_capture_never_autotunes(kwargs, fakes, monkeypatch):
    fakes("fake_a")
    monkeypatch.setattr(dsp, "first_call", lambda *a, **k: pytest.fail("autotuned during capture"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    call = validate(**kwargs)
    choice = dsp.select_backend(fake_cuda(Problem.from_call(call)), call)
    assert choice.source == dsp.STATIC and "CUDA graph capture" in choice.detail


def test_autotune_off_by_env(kwargs, fakes, monkeypatch):
    fakes("fake_a")
    monkeypatch.setenv("GDR_AUTOTUNE", "0")
    monkeypatch.setattr(dsp, "first_call", lambda *a, **k: pytest.fail("autotuned with GDR_AUTOTUNE=0"))
    call = validate(**kwargs)
    choice = dsp.select_backend(fake_cuda(Problem.from_call(call)), call)
    assert choice.source == dsp.STATIC and choice.detail == "GDR_AUTOTUNE=0"


def _fake_measure(times):
    def measure(fn, device_type):
        fn()
        return measure.next.pop(0)
    measure.next = list(times)
    return measure


def test_autotune_miss_picks_fastest_agreeing_and_stores(kwargs, fakes, monkeypatch, caplog):
    fakes("fake_fast_wrong", scale=1.5)  # fastest, but dq off by 50 %
    fakes("fake_broken", raises=True)
    fakes("fake_ok")
    order = list(registry.registered_backends())  # torch, then the fakes in registration order
    times = {"torch": 9.0, "fake_fast_wrong": 1.0, "fake_ok": 2.0}
    monkeypatch.setattr(dsp, "autotune_block_reason", lambda p, have_tensors: None)
    monkeypatch.setattr(at, "measure_ms", _fake_measure([times[n] for n in order if n in times]))
    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        grads = fused_gdr_bwd(**kwargs)
    # one progress line per candidate, numbered
    progress = [r.getMessage().split("  [")[0] for r in caplog.records
                if r.getMessage().startswith("gdr_dispatch: autotune [")]
    timed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gdr_dispatch: autotune [")]
    assert all(re.search(r"  \[(first call \d+\.\d s, )?\d+\.\d s in all; \d+ s spent, ~\d+ s left\]$", line)
               for line in timed), timed
    assert "first call" not in timed[2] and all("first call" in timed[j] for j in (0, 1, 3)), timed
    assert progress == ["gdr_dispatch: autotune [1/4] torch: 9.0 ms", "gdr_dispatch: autotune [2/4] fake_fast_wrong: 1.0 ms",
                        "gdr_dispatch: autotune [3/4] fake_broken: raised RuntimeError: kernel exploded",
                        "gdr_dispatch: autotune [4/4] fake_ok: 2.0 ms"]  # (the cross-check comes after)

    problem = Problem.from_call(validate(**kwargs))
    hit = next(tuning_table.lookup(problem.device.slug, problem.problem_key(), problem.versions_key()), None)
    assert hit is not None and hit.exact, "the autotuned choice was not stored"
    entry, path = hit.entry, hit.path
    assert entry["winner"] == "fake_ok"
    c = entry["candidates"]
    assert c["torch"]["ms"] == 9.0 and c["fake_ok"]["ms"] == 2.0
    assert "disagrees with torch" in c["fake_fast_wrong"]["failed"] and "dq rel err" in c["fake_fast_wrong"]["failed"]
    assert "kernel exploded" in c["fake_broken"]["failed"]
    assert entry["cross_check"]["reference"] == "torch"
    assert str(path).startswith(str(tuning_table.user_table_dir()))
    # the winner's gradients from the tuning run are returned
    ref = registry.get_backend("torch").run(validate(**kwargs))
    assert torch.allclose(grads.dq, ref.dq)


def test_table_hit_comes_before_autotune_and_static(kwargs, fakes, monkeypatch):
    f = fakes("fake_a")
    problem = Problem.from_call(validate(**kwargs))
    entry = {"winner": "fake_a", "candidates": {"fake_a": {"ms": 1.0}, "torch": {"ms": 2.0}}}
    tuning_table.record(problem.device.slug, problem.device.name, {problem.table_key(): entry})
    monkeypatch.setattr(dsp, "first_call", lambda *a, **k: pytest.fail("autotuned on a table hit"))
    fused_gdr_bwd(**kwargs)
    assert f.calls == 1


def test_an_entry_measured_with_other_optional_inputs_is_the_shapes_hit(kwargs, fakes, monkeypatch, caplog):
    """The model grids are tuned with initial_state and dht given; a training call passes neither:
    the same shape's entry is its hit (after an exact one), the log says how it differs, and an
    entry that differs in anything else (h given) is no hit."""
    fakes("fake_a")
    fakes("fake_b")
    problem = Problem.from_call(validate(**kwargs))
    assert problem.has_initial_state and problem.has_dht
    bare = replace(problem, has_initial_state=False, has_dht=False)
    monkeypatch.setattr(dsp, "first_call", lambda *a, **k: pytest.fail("autotuned on a table hit"))
    monkeypatch.setattr(dsp, "predict", lambda *a, **k: None)
    tuning_table.record(problem.device.slug, problem.device.name, {
        problem.table_key(): {"winner": "fake_b"},
        replace(problem, h_given=not problem.h_given).table_key(): {"winner": "fake_a"}})
    hits = list(tuning_table.lookup(bare.device.slug, bare.problem_key(), bare.versions_key()))
    assert [h.entry["winner"] for h in hits] == ["fake_b"] and not hits[0].exact
    assert hits[0].versions_note == "measured with dht and with initial_state (the same shape otherwise)"
    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        choice = dsp.select_backend(bare)
    assert choice.backend.name == "fake_b" and choice.source == dsp.TABLE
    assert "measured with dht and with initial_state" in choice.how
    # an exact entry comes first
    tuning_table.record(bare.device.slug, bare.device.name, {bare.table_key(): {"winner": "fake_a"}})
    first = next(tuning_table.lookup(bare.device.slug, bare.problem_key(), bare.versions_key()))
    assert first.exact and first.entry["winner"] == "fake_a"
    # the fewest flags apart first: for a call with neither, an entry with dht only (one apart,
    # older) before the one with both (two apart)
    one = replace(problem, has_initial_state=False)
    tuning_table.record(one.device.slug, one.device.name, {one.table_key(): {"winner": "fake_a",
                                                                           "measured_at": "2000-01-01"}})
    bare_hits = [h for h in tuning_table.lookup(bare.device.slug, bare.problem_key(), bare.versions_key())
                 if not h.exact]
    assert [h.key for h in bare_hits] == [one.table_key(), problem.table_key()]
    # and the other way round: a call with both, an entry with neither
    hits = list(tuning_table.lookup(problem.device.slug, problem.problem_key(), problem.versions_key()))
    assert [h.exact for h in hits] == [True, False, False] and hits[1].key == one.table_key()
    assert hits[1].versions_note == "measured without initial_state (the same shape otherwise)"
    assert hits[2].versions_note == "measured without dht and without initial_state (the same shape otherwise)"


def test_user_table_shadows_shipped_table(kwargs, fakes, monkeypatch, tmp_path):
    fakes("fake_a")
    fakes("fake_b")
    problem = Problem.from_call(validate(**kwargs))
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(tuning_table, "shipped_table_dir", lambda: shipped)
    key = problem.table_key()
    tuning_table.record(problem.device.slug, "cpu", {key: {"winner": "fake_b"}}, shipped)
    assert dsp.select_backend(problem).backend.name == "fake_b"
    dsp.clear_caches()
    tuning_table.record(problem.device.slug, "cpu", {key: {"winner": "fake_a"}})
    assert dsp.select_backend(problem).backend.name == "fake_a"


def test_table_winner_that_cannot_run_is_ignored(kwargs, fakes, caplog):
    fakes("fake_picky", refuse="not on this device")
    problem = Problem.from_call(validate(**kwargs))
    tuning_table.record(problem.device.slug, "cpu", {problem.table_key(): {"winner": "fake_picky"}})
    with caplog.at_level(logging.WARNING, "gdr_dispatch"):
        choice = dsp.select_backend(problem)
    assert choice.backend.name == "torch"
    assert "not on this device" in caplog.text


def test_logs_the_backend_once_per_key(kwargs, caplog):
    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        fused_gdr_bwd(**kwargs)
        plans.backward.clear()  # the second call decides again (a kept plan's runner logs nothing)
        fused_gdr_bwd(**kwargs)
    lines = [r.message for r in caplog.records if "backend 'torch'" in r.message]
    assert len(lines) == 1 and "static order" in lines[0]


# -- the tables -------------------------------------------------------------------------
def test_table_round_trip(tmp_path):
    entries = {"k1|x": {"winner": "torch", "candidates": {"torch": {"ms": 1.5}, "other": {"unsupported": "no CUDA"}}},
               "k2|y": {"winner": "other", "candidates": {"other": {"ms": 0.5}}}}
    path = tuning_table.record("nvidia-h200-sm90", "NVIDIA H200", entries, tmp_path)
    assert path == tmp_path / "nvidia-h200-sm90.yaml"
    doc = yaml.safe_load(path.read_text())
    assert doc["format"] == tuning_table.FORMAT_VERSION and doc["device"] == "NVIDIA H200"
    assert tuning_table.load_entries(path) == entries
    tuning_table.record("nvidia-h200-sm90", "NVIDIA H200", {"k3|z": {"winner": "torch"}}, tmp_path)
    assert set(tuning_table.load_entries(path)) == {"k1|x", "k2|y", "k3|z"}
    assert not list(tmp_path.glob("*.tmp")), "a temporary file was left behind"


def test_two_processes_write_one_table(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from gdr_dispatch import tuning_table  # the package under test, wherever it is installed
        from pathlib import Path
        tag = sys.argv[1]
        for i in range(40):
            tuning_table.record("dev", "Dev", {{f"{{tag}}|{{i}}": {{"winner": "torch"}}}}, Path({str(tmp_path)!r}))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, tag]) for tag in ("a", "b")]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    entries = tuning_table.load_entries(tmp_path / "dev.yaml")
    assert set(entries) == {f"{t}|{i}" for t in "ab" for i in range(40)}


def test_corrupt_table_warns_once_and_is_ignored(kwargs, caplog):
    problem = Problem.from_call(validate(**kwargs))
    path = tuning_table.table_path(tuning_table.user_table_dir(), problem.device.slug)
    path.parent.mkdir(parents=True)
    path.write_text("entries: [unclosed\n  : :")
    with caplog.at_level(logging.WARNING, "gdr_dispatch"):
        fused_gdr_bwd(**kwargs)
        fused_gdr_bwd(**kwargs)
    warnings = [r for r in caplog.records if "ignoring tuning table" in r.message]
    assert len(warnings) == 1 and str(path) in warnings[0].message
    # the next write sets the corrupt file aside and starts a fresh table
    with caplog.at_level(logging.WARNING, "gdr_dispatch"):
        tuning_table.record(problem.device.slug, "cpu", {"k|v": {"winner": "torch"}})
    assert len(list(path.parent.glob(path.name + ".corrupt*"))) == 1
    assert tuning_table.load_entries(path) == {"k|v": {"winner": "torch"}}


@pytest.mark.parametrize("text", ["- just\n- a list\n", "format: 99\nentries: {}\n", "entries: 3\n"])
def test_wrong_table_structure_is_ignored(text, tmp_path, caplog):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, "gdr_dispatch"):
        assert tuning_table.load_entries(path) == {}
    assert "ignoring tuning table" in caplog.text


def test_spec_problem_matches_call_problem():
    spec = ShapeSpec(seqlens=(1, 63, 64, 65), H=4, Hg=2, K=8, V=8, h="given", state_v_first=True)
    call = validate(**call_kwargs(make_inputs(spec, "cpu")))
    assert spec.problem(torch.device("cpu")) == Problem.from_call(call)


def test_shipped_tables_parse_and_name_registered_backends(caplog):
    from gdr_dispatch.registry import parse_wrapped as parse_split

    tables = sorted(tuning_table.shipped_table_dir().glob("*.yaml"))
    assert tables, "no shipped tuning table"
    known = set(registry.registered_backends())
    with caplog.at_level(logging.WARNING, "gdr_dispatch"):
        for path in tables:
            entries = tuning_table.load_entries(path)
            assert entries, f"{path} is empty or unreadable"
            for key, entry in entries.items():
                # a peer backend that is not installed here may win where the key says it was
                versions = dict(kv.split("=") for kv in key.rsplit("|", 1)[1].split(","))
                peers = {lib for lib in OPTIONAL_LIBS if lib in versions}
                # (a context-parallel winner, `<backend>@split<n>`, names its backend)
                assert parse_split(entry["winner"])[0] in known | peers, (path, key)
                won = entry["candidates"][entry["winner"]]
                assert "ms" in won and "failed" not in won, (path, key)
                # cross-checked against a declared reference: torch, or fla where a sweep left
                # torch out (25-90 ms a run at the 32K-token shapes), or, where a sweep ran no
                # reference, the majority of candidates from two independent implementations or more
                refs = {n for n, b in registry.registered_backends().items() if b.reference_rank is not None}
                check = entry["cross_check"]
                if entry["problem"].endswith("(forward)"):
                    # the op's forward (training.measure_forwards): a provider's splits against the
                    # provider whole, which was measured and is the reference
                    assert parse_split(entry["winner"])[0] == check["reference"], (path, key)
                    assert "ms" in entry["candidates"][check["reference"]], (path, key)
                    continue
                if check["reference"] not in refs:
                    assert check.get("how", "").startswith("agreed with most candidates"), (path, key)
                    source = entries.get(entry.get("derived_from"), entry)  # an entry without a peer: its source's
                    measured = {parse_split(n)[0] for n, c in source["candidates"].items() if "ms" in c and "failed" not in c}
                    assert len(measured) >= 2, (path, key, measured)
    assert "ignoring tuning table" not in caplog.text


# -- environment and policy -------------------------------------------------------------
@pytest.mark.parametrize("value", ["banana", "2", "of"])
def test_an_unrecognised_gdr_autotune_is_an_error_naming_it(kwargs, monkeypatch, value):
    monkeypatch.setenv("GDR_AUTOTUNE", value)  # was silently "on"
    with pytest.raises(ValueError, match=f"GDR_AUTOTUNE: expected one of .*got '{value}'"):
        fused_gdr_bwd(**kwargs)


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_gdr_autotune_off_spellings(kwargs, monkeypatch, value):
    monkeypatch.setenv("GDR_AUTOTUNE", value)
    call = validate(**kwargs)
    assert dsp.autotune_block_reason(fake_cuda(Problem.from_call(call)), True) == "GDR_AUTOTUNE=0"


class Unverified(Fake):
    gpu_verified = False


def test_an_unverified_backend_is_refused_until_switched_on(kwargs, monkeypatch, with_backends):
    with_backends(Unverified("fake_unverified"))
    problem = Problem.from_call(validate(**kwargs))
    backend = registry.get_backend("fake_unverified")
    ok, reason = backend.supported(problem)
    assert not ok and "not verified on a GPU" in reason and "GDR_ALLOW_UNVERIFIED=1" in reason
    with registry.allow_unverified():
        assert backend.supported(problem) == (True, "")
    assert not backend.supported(problem)[0]  # the context manager undoes itself
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "1")
    assert backend.supported(problem) == (True, "")
    monkeypatch.setenv("GDR_ALLOW_UNVERIFIED", "maybe")
    with pytest.raises(ValueError, match="GDR_ALLOW_UNVERIFIED"):
        backend.supported(problem)


def test_the_static_order_is_what_backends_declare(fakes):
    first = fakes("fake_first")
    first.static_rank = -1
    fakes("fake_last")  # the default rank: after every built-in backend
    names = list(registry.registered_backends())
    assert names[0] == "fake_first" and names[-1] == "fake_last"
    ranks = [b.static_rank for b in registry.registered_backends().values()]
    assert ranks == sorted(ranks)


def test_the_cross_check_reference_is_the_most_trusted_candidate_that_ran(kwargs, fakes):
    call = validate(**kwargs)
    problem = Problem.from_call(call)
    trusted = fakes("fake_trusted")
    trusted.reference_rank = -1
    fakes("fake_other")
    entry, _ = at.autotune(call, problem, {n: registry.get_backend(n) for n in ("fake_other", "fake_trusted", "torch")},
                            measure=lambda fn, dev: 1.0)
    assert entry["cross_check"]["reference"] == "fake_trusted"
    broken = fakes("fake_broken_ref", raises=True)
    broken.reference_rank = -2  # a reference that raised is skipped
    entry, _ = at.autotune(call, problem, {n: registry.get_backend(n) for n in ("fake_broken_ref", "torch")},
                            measure=lambda fn, dev: 1.0)
    assert entry["cross_check"]["reference"] == "torch"


def test_the_autotuner_times_with_graph_inputs_copied(kwargs, fakes):
    """Every timing runs inside `graph_safe.copied_graph_inputs` (the split's graphs then copy
    their inputs in, as a model whose layers share the shape meets them), and only the timing."""
    from gdr_dispatch import graph_safe

    call = validate(**kwargs)
    fakes("fake_other")
    seen = []
    at.autotune(call, Problem.from_call(call), {n: registry.get_backend(n) for n in ("fake_other", "torch")},
                measure=lambda fn, dev: seen.append(graph_safe.graph_inputs_copied()) or 1.0)
    assert seen == [True, True] and not graph_safe.graph_inputs_copied()
    from gdr_dispatch import training

    seen.clear()
    out = (torch.ones(2), torch.ones(2))
    training.measure_forwards(Problem.from_call(call), {"p": None, "p@split2": None}, "p", lambda b: out,
                              measure=lambda fn, dev: seen.append(graph_safe.graph_inputs_copied()) or 1.0,
                              say=lambda line: None)
    assert seen == [True, True] and not graph_safe.graph_inputs_copied()


# -- a table miss measures only what can win ---------------------------------------------------
def test_a_table_miss_skips_what_neighbouring_entries_show_losing(kwargs, fakes, monkeypatch, caplog):
    """On a (faked) GPU, a candidate that the device's tables show more than PRUNE_MARGIN slower
    than the winner at every neighbouring entry is not measured, nor is the torch reference
    timed (it runs once, as the cross-check's reference); one no neighbour measured is; every
    skip is logged and recorded with its reason. GDR_AUTOTUNE_ALL=1 measures everything."""
    fakes("fake_slow")
    fakes("fake_new")
    fakes("fake_good")
    call = validate(**kwargs)
    # a full grid (2 programs on 2 SMs): no split candidates
    problem = replace(Problem.from_call(call), device=DeviceInfo("cuda", "Fake GPU", (9, 0), 2))
    monkeypatch.setattr(dsp, "autotune_block_reason", lambda p, have_tensors: None)
    for T in (256, 1024):  # two neighbours: the same device, dtype, heads and h mode, other sizes
        other = replace(problem, T=T, max_seqlen=T)
        tuning_table.record(problem.device.slug, problem.device.name, {other.table_key(): {
            "winner": "fake_good", "candidates": {"fake_good": {"ms": 1.0}, "fake_slow": {"ms": 2.0}}}})
    ran = []
    monkeypatch.setattr(at, "measure_ms", lambda fn, device_type: ran.append(1) or 1.0)
    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        choice = dsp.select_backend(problem, call)
    cands = choice.entry["candidates"]
    assert "skipped" in cands["fake_slow"] and "2.00x the winner" in cands["fake_slow"]["skipped"]
    assert "skipped" in cands["torch"] and choice.entry["cross_check"]["reference"] == "torch"
    assert "ms" in cands["fake_new"] and "ms" in cands["fake_good"]
    assert len(ran) == 2  # fake_new and fake_good timed; torch ran once untimed, fake_slow not at all
    assert "skipped: fake_slow" in caplog.text or "fake_slow (2.00x" in caplog.text
    dsp.clear_caches()
    monkeypatch.setenv("GDR_AUTOTUNE_ALL", "1")
    tuning_table.forget()
    kept, skipped = at.prune(replace(problem, T=70), {n: registry.get_backend(n) for n in ("fake_slow", "torch")})
    assert set(kept) == {"fake_slow", "torch"} and skipped == {}


def _neighbours(problem, entries):
    """Record table entries for `problem` at other sizes (its neighbours): one per (T, entry)."""
    for T, entry in entries:
        other = replace(problem, T=T, max_seqlen=T)
        tuning_table.record(problem.device.slug, problem.device.name, {other.table_key(): entry})


@pytest.mark.parametrize("case", ["agree", "close", "disagree", "one_neighbour", "new_backend", "autotune_all",
                                  "same_key_twice", "other_flags", "starved"])
def test_a_table_miss_takes_the_winner_its_neighbours_agree_on_unmeasured(kwargs, fakes, monkeypatch, caplog, case):
    """Where at least PREDICT_ENTRIES neighbouring entries (same library versions) all name one
    winner, PREDICT_MARGIN or more ahead of every other candidate timed there, and every backend
    that could run now was considered there, a table miss takes it without measuring (said in
    the log); otherwise it measures as ever."""
    fakes("fake_slow")
    fakes("fake_good")
    if case == "new_backend":
        fakes("fake_new")  # could run now, never considered at the neighbours
    call = validate(**kwargs)
    sms = 132 if case == "starved" else 2  # a full grid but where starved: the split's counts move with the grid
    problem = replace(Problem.from_call(call), device=DeviceInfo("cuda", "Fake GPU", (9, 0), sms))
    monkeypatch.setattr(dsp, "autotune_block_reason", lambda p, have_tensors: None)
    slow = 1.1 if case == "close" else 2.0
    entries = [(256, {"winner": "fake_good", "candidates": {"fake_good": {"ms": 1.0}, "fake_slow": {"ms": slow}}}),
               (1024, {"winner": "fake_slow" if case == "disagree" else "fake_good",
                       "candidates": {"fake_good": {"ms": 1.0}, "fake_slow": {"ms": 2.0 if case != "disagree" else 0.5}}})]
    if case == "same_key_twice":  # one problem in the user's table and the shipped one counts once
        from gdr_dispatch import tuning_table as tt

        other = replace(problem, T=256, max_seqlen=256)
        monkeypatch.setattr(tt, "neighbours", lambda p: [(other.table_key(), entries[0][1])] * 2)
    elif case == "other_flags":  # entries without an initial state do not predict a call with one
        _neighbours(replace(problem, has_initial_state=False), entries)
    else:
        _neighbours(problem, entries[:1] if case == "one_neighbour" else entries)
    if case == "autotune_all":
        monkeypatch.setenv("GDR_AUTOTUNE_ALL", "1")
    ran = []
    monkeypatch.setattr(at, "measure_ms", lambda fn, device_type: ran.append(1) or 1.0)
    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        choice = dsp.select_backend(problem, call)
    if case == "agree":
        assert choice.source == dsp.PREDICTED and choice.backend.name == "fake_good" and ran == []
        assert "predicted, not measured" in caplog.text or "predicted, not measured" in choice.how
        assert "2.00x ahead" in choice.how
    else:
        assert choice.source == dsp.AUTOTUNED and ran, case


def test_the_early_builds_of_a_predicted_backward_build_the_prediction_only_and_are_waited_for(kwargs, fakes,
                                                                                              monkeypatch):
    fakes("fake_slow")
    fakes("fake_good")
    call = validate(**kwargs)
    problem = replace(Problem.from_call(call), device=DeviceInfo("cuda", "Fake GPU", (9, 0), 2))  # a full grid
    monkeypatch.setattr(dsp, "autotune_block_reason", lambda p, have_tensors: None)
    monkeypatch.setattr(dsp.Problem, "from_call", staticmethod(lambda c: problem))
    _neighbours(problem, [(T, {"winner": "fake_good", "candidates": {"fake_good": {"ms": 1.0}, "fake_slow": {"ms": 3.0}}})
                          for T in (256, 1024)])
    seen = []
    monkeypatch.setattr(at, "compile_jobs_of", lambda c, cands: seen.append(sorted(cands)) or {("m", "f", ()): ["x"]})
    monkeypatch.setattr(at, "start_compiles", lambda jobs, **kw: len(jobs))
    assert dsp.start_backward_compiles(call) == 1 and seen == [["fake_good"]]
    waited = []  # the backward's first call then waits for them instead of building them again
    monkeypatch.setattr(at, "wait_early", lambda job: waited.append(job))
    choice = dsp.select_backend(problem, call)
    assert choice.source == dsp.PREDICTED and waited == [("m", "f", ())]


def test_warm_runs_are_compiled_once_per_compile_key_not_per_length():
    """The split's candidates at several segment counts share one warm run per backend and mode."""
    from gdr_dispatch.backends.split import SplitBackend

    spec = ShapeSpec(B=1, T=300, H=2, K=16, V=16, dtype="float16", h="none")
    call = validate(**call_kwargs(make_inputs(spec, "cpu")))
    fla = registry.get_backend("fla")
    cands = {"fla": fla, **{f"fla@split{n}": SplitBackend(fla, n) for n in (2, 4)}}
    jobs = at.compile_jobs_of(call, cands)
    warm = [j for j in jobs if j[1] == "warm_backend"]
    keys = [at.warm_key(j) for j in warm]
    assert len(warm) == len(set(keys)) == 2  # the unsplit call, and the segments' varlen call (h given)
    assert {k[2] for k in keys} == {False, True}
    # and the split's own passes, once per segment count (whatever the inner backend)
    assert sorted(j[2][0][0] for j in jobs if j[1] == "warm_passes") == [2, 4]
    more = at.compile_jobs_of(call, {**cands, "torch@split2": SplitBackend(registry.get_backend("torch"), 2)})
    assert sorted(j[2][0][0] for j in more if j[1] == "warm_passes") == [2, 4]


def test_without_a_reference_the_candidate_most_others_agree_with_is_the_cross_check(kwargs, fakes):
    """A reference that fails (the torch backend out of memory at a training shape) leaves the
    cross-check to agreement: a broken candidate must not become the ground truth and win."""
    call = validate(**kwargs)
    problem = Problem.from_call(call)
    ref = fakes("fake_ref", raises=True)
    ref.reference_rank = -1
    fakes("fake_bad", scale=3.0)  # first to run, fastest, wrong
    fakes("fake_good")
    fakes("fake_good2")
    times = iter([1.0, 2.0, 3.0])
    entry, _ = at.autotune(call, problem, {n: registry.get_backend(n) for n in ("fake_ref", "fake_bad", "fake_good",
                                                                                 "fake_good2")},
                           measure=lambda fn, dev: next(times))
    assert entry["winner"] == "fake_good" and entry["cross_check"]["reference"] == "fake_good"
    assert "disagrees with fake_good" in entry["candidates"]["fake_bad"]["failed"]
    with pytest.raises(dsp.NoBackendError, match="no two candidates agree"):
        at.autotune(call, problem, {n: registry.get_backend(n) for n in ("fake_ref", "fake_bad", "fake_good")},
                    measure=lambda fn, dev: 1.0)
