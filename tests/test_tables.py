"""Tuning tables as user-editable data, keys a training run can live with, version tolerance."""

import logging
import os
import random
import stat
from dataclasses import replace

import pytest
import torch
import yaml

from gdr_dispatch import Backend, Problem, fused_gdr_bwd, registry, tuning_table
from gdr_dispatch import dispatch as dsp
from gdr_dispatch.contract import validate
from gdr_dispatch.problem import DeviceInfo
from gdr_dispatch.shapes import ShapeSpec, call_kwargs, make_inputs

SPEC = ShapeSpec(B=1, T=70, H=2, K=8, V=8, dtype="float32", h="given")
H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), 132)


@pytest.fixture
def kwargs():
    return call_kwargs(make_inputs(SPEC, "cpu"))


@pytest.fixture
def problem(kwargs):
    return Problem.from_call(validate(**kwargs))


def write_table(path, entries, fmt=tuning_table.FORMAT_VERSION):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"format": fmt, "device": "cpu", "entries": entries}, sort_keys=False))


def user_table(problem):
    return tuning_table.table_path(tuning_table.user_table_dir(), problem.device.slug)


# -- hand-edited entries ----------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    {"winner": ["torch"]},  # was: TypeError: unhashable type
    {"winner": "torch", "candidates": ["torch"]},  # was: AttributeError on .get
    {"winner": "torch", "candidates": {"torch": 1.5}},
    {"winner": "torch", "candidates": {"torch": {"ms": "fast"}}},
    "torch",
])
def test_a_bad_entry_is_warned_about_once_and_ignored(kwargs, problem, caplog, bad):
    write_table(user_table(problem), {problem.table_key(): bad, "other|key": {"winner": "torch"}})
    with caplog.at_level(logging.WARNING, "gdr_dispatch"):
        fused_gdr_bwd(**kwargs)
        fused_gdr_bwd(**{**kwargs, "h": None})
    warnings = [r.message for r in caplog.records if "ignoring entry" in r.message]
    assert len(warnings) == 1, warnings
    assert str(user_table(problem)) in warnings[0]
    # the good entry beside it is still read
    assert "other|key" in tuning_table.load_entries(user_table(problem))


# -- files ------------------------------------------------------------------------------
def test_tables_are_readable_by_others_sharing_the_cache(tmp_path):
    old = os.umask(0o022)
    try:
        path = tuning_table.record("dev", "Dev", {"p|v": {"winner": "torch"}}, tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # was 0o600 (mkstemp's mode)
    os.chmod(path, 0o664)
    tuning_table.record("dev", "Dev", {"p|w": {"winner": "torch"}}, tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o664  # a rewrite keeps the mode the user chose


def test_a_second_corrupt_table_does_not_overwrite_the_first(tmp_path, caplog):
    path = tmp_path / "dev.yaml"
    for text in ("entries: [one\n", "entries: [two\n"):
        path.write_text(text)
        with caplog.at_level(logging.WARNING, "gdr_dispatch"):
            tuning_table.record("dev", "Dev", {"p|v": {"winner": "torch"}}, tmp_path)
    kept = sorted(p.read_text() for p in tmp_path.glob("dev.yaml.corrupt*"))
    assert kept == ["entries: [one\n", "entries: [two\n"]


def test_a_format_1_table_is_reported_and_ignored(tmp_path, caplog):
    path = tmp_path / "x.yaml"
    write_table(path, {"a|b": {"winner": "torch"}}, fmt=1)
    with caplog.at_level(logging.WARNING, "gdr_dispatch"):
        assert tuning_table.load_entries(path) == {}
    assert "format 1" in caplog.text and "gdr-dispatch tune" in caplog.text


# -- other library versions ------------------------------------------------------------
class Picky(Backend):
    def __init__(self, name, ok=True):
        self.name, self.ok, self.calls = name, ok, 0

    def not_supported_reasons(self, problem):
        return [] if self.ok else ["cannot here"]

    def run(self, call):
        self.calls += 1
        return registry.get_backend("torch").run(call)


@pytest.fixture
def pickies(with_backends):
    def add(name, ok=True):
        return with_backends(Picky(name, ok))

    yield add


def _other_versions(problem, **changes):
    versions = tuple((k, changes.get(k, v)) for k, v in problem.versions)
    return replace(problem, versions=versions)


def test_an_entry_from_other_library_versions_is_used_and_said(kwargs, problem, pickies, caplog):
    b = pickies("picky_a")
    older = _other_versions(problem, triton="3.6.0")
    assert older.table_key() != problem.table_key() and older.problem_key() == problem.problem_key()
    tuning_table.record(problem.device.slug, "cpu", {older.table_key(): {"winner": "picky_a",
                                                                        "measured_at": "2026-01-01T00:00:00+00:00"}})
    with caplog.at_level(logging.INFO, "gdr_dispatch"):
        fused_gdr_bwd(**kwargs)
    assert b.calls == 1
    line = next(r.message for r in caplog.records if "backend 'picky_a'" in r.message)
    assert "measured with triton 3.6.0, running " in line and "gdr-dispatch tune" in line
    choice = dsp.select_backend(problem)
    assert choice.source == dsp.TABLE and not choice.table_hit.exact
    assert choice.table_hit.key == older.table_key()


def test_the_exact_key_comes_first_and_a_winner_that_cannot_run_is_passed_over(problem, pickies):
    pickies("picky_a")
    pickies("picky_b")
    pickies("picky_no", ok=False)
    slug = problem.device.slug
    tuning_table.record(slug, "cpu", {
        _other_versions(problem, torch="9.9.9").table_key(): {"winner": "picky_no", "measured_at": "2026-12-01"},
        _other_versions(problem, fla="0.5.0").table_key(): {"winner": "picky_b", "measured_at": "2026-06-01"},
        _other_versions(problem, tilelang="0.0.1").table_key(): {"winner": "picky_a", "measured_at": "2026-01-01"},
    })
    choice = dsp.select_backend(problem)
    assert choice.backend.name == "picky_b"  # the newest measurement whose winner can run
    dsp.clear_caches()
    tuning_table.record(slug, "cpu", {problem.table_key(): {"winner": "picky_a"}})
    choice = dsp.select_backend(problem)
    assert choice.backend.name == "picky_a" and choice.table_hit.exact


def test_explain_shows_which_entry_matched(problem, pickies, capsys):
    from gdr_dispatch import cli

    pickies("picky_a")
    spec = ShapeSpec(B=1, T=70, H=2, K=8, V=8, dtype="float32", h="given")
    p = spec.problem(torch.device("cpu"))
    older = _other_versions(p, torch="2.0.0")
    tuning_table.record(p.device.slug, "cpu", {older.table_key(): {"winner": "picky_a"}})
    assert cli.main(["explain", "--T", "70", "--H", "2", "--K", "8", "--V", "8", "--dtype", "float32",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "chosen: picky_a (table " in out and "measured with torch 2.0.0" in out
    assert f"entry {older.table_key()!r} (measured with torch 2.0.0, running " in out


def test_explain_says_an_entry_was_measured_with_other_optional_inputs(problem, pickies, capsys):
    from gdr_dispatch import cli

    pickies("picky_a")
    p = ShapeSpec(B=1, T=70, H=2, K=8, V=8, dtype="float32", h="given").problem(torch.device("cpu"))
    bare = replace(p, has_dht=False, has_initial_state=False)
    tuning_table.record(p.device.slug, "cpu", {bare.table_key(): {"winner": "picky_a"}})
    assert cli.main(["explain", "--T", "70", "--H", "2", "--K", "8", "--V", "8", "--dtype", "float32",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "chosen: picky_a (table " in out
    assert f"entry {bare.table_key()!r} (measured without dht and without initial_state (the same shape" in out


# -- keys a training run can live with ------------------------------------------------
def _packings(n, total, rng):
    """`n` packed batches of `total` tokens: document lengths log-normal around 1k tokens
    (a long tail of long documents), the last one cut to fit."""
    out = []
    for _ in range(n):
        lens, left = [], total
        while left > 0:
            lens.append(min(left, max(1, int(rng.lognormvariate(7.0, 1.2)))))
            left -= lens[-1]
        out.append(tuple(lens))
    return out


@pytest.mark.parametrize("H", [16, 32])
def test_random_packings_share_a_handful_of_keys(H):
    keys, old_keys = set(), set()
    for lens in _packings(50, 32768, random.Random(0)):
        p = replace(ShapeSpec(seqlens=lens, H=H, K=128, V=128).problem(torch.device("cpu")), device=H200)
        keys.add(p.table_key())
        old_keys.add((p.seq_head_ctas, p.B * p.T / p.N))  # the exact sequences x heads the key held before
    assert len(keys) <= 8, sorted(keys)
    assert len(old_keys) > 20  # the packings do vary: a key with the exact count would miss at most steps


def test_the_key_takes_the_longest_sequence_from_max_seqlen_never_from_cu_seqlens():
    x = make_inputs(ShapeSpec(seqlens=(5, 70, 250), H=2, K=8, V=8, dtype="float32", h="given"), "cpu")
    kw = call_kwargs(x)  # make_inputs passes max_seqlen=250, as a training loop would
    assert "max256|" in Problem.from_call(validate(**kw)).table_key()
    assert "max512|" in Problem.from_call(validate(**{**kw, "max_seqlen": 300})).table_key()
    unknown = Problem.from_call(validate(**{**kw, "max_seqlen": None}))
    assert "max-|" in unknown.table_key() and unknown.max_seqlen is None
    fixed = Problem.from_call(validate(**call_kwargs(make_inputs(SPEC, "cpu"))))
    assert fixed.max_seqlen == 70 and "max128|" in fixed.table_key()


def test_the_versions_note_says_which_library_changed_or_appeared():
    """A key names an optional peer (flash_qla) only when it is installed: installing one makes
    the shipped entries inexact, and the note says why instead of printing '?'."""
    from gdr_dispatch.tuning_table import TableHit

    def note(then, now):
        return TableHit({}, None, "", False, then, now).versions_note

    base = "torch=2.11.0,triton=3.6.0,tilelang=0.1.15,fla=0.6.0"
    assert note(base, base.replace("3.6.0", "3.7.1")) == "measured with triton 3.6.0, running 3.7.1"
    assert note(base, base + ",flash_qla=0.1.3") == "measured without flash_qla, running flash_qla 0.1.3"
    both = note(base, base.replace("3.6.0", "3.7.1") + ",flash_qla=0.1.3")
    assert both == "measured with triton 3.6.0 and without flash_qla, running triton 3.7.1, flash_qla 0.1.3"


def test_a_tune_with_an_optional_peer_also_serves_users_without_it():
    """The shipped table is tuned with flash_qla installed; a user without it has a key without
    it and must get the fastest of the rest from the same measurement, not a stale entry."""
    base = "torch=2.11.0,triton=3.6.0,tilelang=0.1.15,fla=0.6.0"
    key = f"PROBLEM|{base},flash_qla=0.1.3"
    entry = {"problem": "P", "winner": "flash_qla@split2", "measured_at": "t",
             "candidates": {"flash_qla": {"ms": 1.0}, "flash_qla@split2": {"ms": 0.5}, "fla": {"ms": 2.0},
                            "tilelang_ws": {"failed": "disagrees", "ms": 0.9}, "fla@split2": {"ms": 1.5},
                            "torch": {"unsupported": "left out by --backends"}}}
    derived = tuning_table.without_optional(key, entry, {"flash_qla": {"flash_qla"}})
    assert list(derived) == [f"PROBLEM|{base}"]
    got = derived[f"PROBLEM|{base}"]
    assert got["winner"] == "fla@split2" and got["derived_from"] == key
    assert got["candidates"]["flash_qla"] == got["candidates"]["flash_qla@split2"] == {"unsupported": "flash_qla not installed"}
    assert entry["candidates"]["flash_qla"] == {"ms": 1.0}  # the measured entry is left as it was
    # a key measured without the library, or nothing left to win: nothing derived
    assert tuning_table.without_optional(f"PROBLEM|{base}", entry, {"flash_qla": {"flash_qla"}}) == {}
    only = {"problem": "P", "winner": "flash_qla", "candidates": {"flash_qla": {"ms": 1.0}}}
    assert tuning_table.without_optional(key, only, {"flash_qla": {"flash_qla"}}) == {}


def test_a_derived_entry_is_written_in_full(tmp_path):
    """The derived entry shares its measured candidates' dicts with the measured one; the file
    spells both out (the shipped table had `&id001` anchors and `*id001` aliases once)."""
    base = "torch=2.11.0,triton=3.6.0,tilelang=0.1.15,fla=0.6.0"
    key = f"PROBLEM|{base},flash_qla=0.1.3"
    entry = {"problem": "P", "winner": "flash_qla", "measured_at": "t",
             "candidates": {"flash_qla": {"ms": 1.0}, "fla": {"ms": 2.0}, "cross_check": {"ok": True}}}
    entries = {key: entry, **tuning_table.without_optional(key, entry, {"flash_qla": {"flash_qla"}})}
    path = tuning_table.record("dev", "Dev", entries, tmp_path)
    text = path.read_text()
    assert "&id" not in text and "*id" not in text
    assert text.count("ms: 2.0") == 2
    assert dict(tuning_table._read_entries(path)) == entries


def test_the_shipped_h200_table_holds_every_model_grid_problem_with_flashqla_and_without():
    """The model grids (tools/tune_models_*.yaml: Qwen3-Next's and Qwen3.5's layers at TP 1, 2, 4
    and 8, q/k at the key-head count and repeated, 8K/16K/32K tokens per GPU, h given and None)
    each have an entry in the shipped H200 table measured with FlashQLA installed and one for
    users without it, so a first call at them is a table hit, not an autotune."""
    from pathlib import Path

    from gdr_dispatch.shapes import load_grid

    root = Path(__file__).resolve().parent.parent
    held: dict[bool, set] = {True: set(), False: set()}
    for key in tuning_table.load_entries(root / "tuning_cache" / "nvidia-h200-sm90.yaml"):
        problem_key, versions = key.split("|")[:-1], key.rsplit("|", 1)[1]
        held["flash_qla=" in versions].add("|".join(problem_key))
    grids = sorted((root / "tools").glob("tune_models_*.yaml"))
    assert len(grids) >= 3
    missing, count = [], 0
    for path in grids:
        for variant in (v for s in load_grid(path) for v in s.variants()):
            count += 1
            key = replace(variant.problem(torch.device("cpu")), device=H200).problem_key()
            missing += [(path.name, variant.label(), peer) for peer in (True, False) if key not in held[peer]]
    assert count > 200 and not missing, missing[:10]
