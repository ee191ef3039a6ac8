"""The `gdr-dispatch` command: `tune` and `explain`."""

import os
import subprocess
import sys

import yaml

from gdr_dispatch import cli


def run_cli(*args, env=None, cwd=None):
    """The command as a user runs it: the installed package, from a directory of its own."""
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "gdr_dispatch", *args], capture_output=True, text=True,
                          timeout=600, env=e, cwd=cwd)


def test_tune_smoke_preset_writes_a_table(tmp_path):
    r = run_cli("tune", "--preset", "smoke", "--out", str(tmp_path), "--warmup", "0", "--reps", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # progress on stderr, one line per shape, and the table on stdout
    assert "[1/4]" in r.stderr and "[4/4]" in r.stderr
    assert "| shape" in r.stdout and "winner" in r.stdout and "vs static order" in r.stdout
    assert "no CUDA device" in r.stderr  # says what a sweep without a GPU can and cannot do
    assert "varlen 1,63,64,65" in r.stdout
    tables = list(tmp_path.glob("*.yaml"))
    assert [t.name for t in tables] == ["cpu.yaml"]
    entries = yaml.safe_load(tables[0].read_text())["entries"]
    assert len(entries) == 4
    for entry in entries.values():
        assert entry["winner"] == "torch" and entry["candidates"]["torch"]["ms"] > 0


def test_tune_without_arguments_runs_the_cpu_default(tmp_path):
    r = run_cli("tune", env={"GDR_TUNING_CACHE": str(tmp_path)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "preset cpu" in r.stderr
    assert (tmp_path / "cpu.yaml").exists()


def test_tune_grid_file(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("shapes:\n  - {B: 1, T: 33, H: 2, K: 16, V: 16, dtype: float32, h: none, dht: false}\n")
    assert cli.main(["tune", "--grid", str(grid), "--out", str(tmp_path), "--reps", "1", "--warmup", "0"]) == 0
    (entry,) = yaml.safe_load((tmp_path / "cpu.yaml").read_text())["entries"].values()
    assert entry["problem"] == "B1 T33 H2 Hg2 K16 V16 float32 h=None h0"


def test_tune_bad_grid_names_the_key(tmp_path, capsys):
    grid = tmp_path / "grid.yaml"
    grid.write_text("- {B: 1, T: 33, H: 2, heads: 4}\n")
    assert cli.main(["tune", "--grid", str(grid), "--out", str(tmp_path)]) == 2
    assert "unknown keys ['heads']" in capsys.readouterr().err


def test_explain_prints_verdicts_and_choice(capsys):
    assert cli.main(["explain", "--seqlens", "1,63,64,65", "--H", "4", "--Hg", "2", "--K", "64", "--V", "64",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "N4 (varlen, max 65) T193 H4 Hg2 K64 V64" in out
    assert "| torch" in out and "yes" in out
    assert "chosen: torch" in out and "cpu tensors are never autotuned" in out
    assert "table key:" in out


def test_explain_bad_shape_is_an_error_not_a_traceback(capsys):
    assert cli.main(["explain", "--dtype", "int8", "--device", "cpu"]) == 2
    assert "dtype" in capsys.readouterr().err
