"""The `gdr-dispatch` command: `tune` and `explain`."""

import os
import subprocess
import sys

import pytest
import torch
import yaml

from gdr_dispatch import cli, registered_backends
from gdr_dispatch.shapes import ShapeSpec


def run_cli(*args, env=None, cwd=None):
    """The command as a user runs it: the installed package, from a directory of its own."""
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "gdr_dispatch", *args], capture_output=True, text=True,
                          timeout=600, env=e, cwd=cwd)


def test_tune_smoke_preset_writes_a_table(tmp_path):
    r = run_cli("tune", "--preset", "smoke", "--out", str(tmp_path), "--warmup", "0", "--reps", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # progress on stderr, one line per shape and one per candidate as it is measured, and the table on stdout
    assert "[1/4]" in r.stderr and "[4/4]" in r.stderr
    assert "    autotune [1/" in r.stderr and "torch: " in r.stderr
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
    # the training op's forward: only the torch reference takes CPU tensors; fla's says why not
    assert "training op forward: torch (lowest forward_rank that takes it; passed over fla: needs a CUDA device" in out


def test_explain_names_a_forced_forward_or_why_it_cannot(capsys, monkeypatch):
    monkeypatch.setenv("GDR_FORWARD", "fla")
    assert cli.main(["explain", "--device", "cpu"]) == 0
    assert "training op forward: none -- GDR_FORWARD=fla: its forward cannot take" in capsys.readouterr().out
    monkeypatch.setenv("GDR_FORWARD", "torch")
    assert cli.main(["explain", "--device", "cpu"]) == 0
    assert "training op forward: torch (GDR_FORWARD)" in capsys.readouterr().out


def test_explain_bad_shape_is_an_error_not_a_traceback(capsys):
    assert cli.main(["explain", "--dtype", "int8", "--device", "cpu"]) == 2
    assert "dtype" in capsys.readouterr().err


# -- a call that fused_gdr_bwd refuses is refused by explain, without a traceback -------------
@pytest.mark.parametrize("args,words", [
    (["--H", "3", "--Hg", "2"], ["H=3", "Hg=2", "multiple"]),
    (["--T", "0"], ["T >= 1"]),
    (["--K", "0"], ["K=0"]),
    (["--chunk-size", "0"], ["chunk_size", "positive"]),
    (["--seqlens", "0,0"], ["T >= 1"]),
])
def test_explain_refuses_what_a_call_refuses(args, words, capsys):
    assert cli.main(["explain", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and all(w in err for w in words), err


def test_explain_on_a_machine_without_cuda_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["explain", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_is_taken_before_or_after_the_subcommand(where, tmp_path):
    args = ["explain", "--device", "cpu", "--K", "16", "--V", "16"]
    args = ["-v", *args] if where == "before" else [*args, "-v"]
    assert cli.build_parser().parse_args(args).verbose is True  # taken in either place
    r = run_cli(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "chosen: torch" in r.stdout


# -- tune says what it did, and checks its counts -------------------------------------------
def test_tune_with_only_unsupported_backends_writes_nothing_and_says_so(tmp_path, capsys):
    gpu_only = next(n for n, b in registered_backends().items()
                    if not b.supported(ShapeSpec(B=1, T=128, H=2, K=32, V=32).problem(torch.device("cpu")))[0])
    assert cli.main(["tune", "--backends", gpu_only, "--out", str(tmp_path), "--reps", "1", "--warmup", "0"]) == 1
    out = capsys.readouterr()
    assert "table written" not in out.out
    assert "nothing written" in out.err
    assert not list(tmp_path.glob("*.yaml"))


@pytest.mark.parametrize("flag,value,words", [("--reps", "0", ">= 1"), ("--warmup", "-1", ">= 0"),
                                              ("--reps", "two", "integer")])
def test_tune_rejects_counts_it_cannot_use(flag, value, words, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["tune", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and words in err


def test_tune_compiles_each_kernel_once_in_parallel_processes_first(tmp_path, capsys, monkeypatch, with_backends):
    """A sweep collects the builds its backends would make on first use (`compile_jobs`),
    runs each distinct one once in a worker process before timing, and says how long it took."""
    from gdr_dispatch.backends.exact_torch import TorchBackend

    class Compiling(TorchBackend):
        name = "torch_compiling"
        reference_rank = None

        def compile_jobs(self, call):
            return [("math", "sqrt", (float(call.K),))]  # the same build for every shape of the grid

    with_backends(Compiling())
    assert cli.main(["tune", "--out", str(tmp_path), "--backends", "torch,torch_compiling", "--reps", "1",
                     "--warmup", "0", "--compile-jobs", "2"]) == 0
    err = capsys.readouterr().err
    assert "compiling 1 kernels in 1 processes first" in err
    assert "compiled torch_compiling: sqrt(32.0,) in" in err
    assert err.index("compiled torch_compiling") < err.index("[1/")  # before any timing
    assert cli.main(["tune", "--out", str(tmp_path), "--backends", "torch,torch_compiling", "--reps", "1",
                     "--warmup", "0", "--compile-jobs", "0"]) == 0
    assert "kernels in" not in capsys.readouterr().err


def test_tune_compiles_and_measures_one_head_group_at_a_time(tmp_path, capsys, with_backends):
    """A sweep's shapes go in groups of head counts and dtype, each compiled then measured before
    the next (a sweep stopped part way keeps its finished groups' entries); a build two groups
    share runs once."""
    from gdr_dispatch.backends.exact_torch import TorchBackend

    class Compiling(TorchBackend):
        name = "torch_compiling"
        reference_rank = None

        def compile_jobs(self, call):
            return [("math", "sqrt", (float(call.H),)), ("math", "floor", (float(call.K),))]

    with_backends(Compiling())
    grid = tmp_path / "grid.yaml"
    grid.write_text("shapes:\n  - {B: 1, T: 64, H: 2, K: 32, V: 32, dtype: float32, h: given}\n"
                    "  - {B: 1, T: 64, H: 4, K: 32, V: 32, dtype: float32, h: given}\n"
                    "  - {B: 2, T: 64, H: 2, K: 32, V: 32, dtype: float32, h: given}\n")
    assert cli.main(["tune", "--grid", str(grid), "--device", "cpu", "--out", str(tmp_path), "--backends",
                     "torch,torch_compiling", "--reps", "1", "--warmup", "0", "--compile-jobs", "2"]) == 0
    err = capsys.readouterr().err
    h2, h4 = err.index("compiled torch_compiling: sqrt(2.0,)"), err.index("compiled torch_compiling: sqrt(4.0,)")
    assert err.count("compiled torch_compiling: floor(32.0,)") == 1  # shared by both groups: once
    assert err.count("compiled torch_compiling: sqrt(2.0,)") == 1
    # H2's two shapes (B1, then B2) are measured before H4's build, H4's shape after it
    assert h2 < err.index("[1/3] B1 T64 H2") < err.index("[2/3] B2 T64 H2") < h4 < err.index("[3/3] B1 T64 H4")


@pytest.mark.parametrize("no_splits", [False, True])
def test_tune_measures_split_candidates_on_starved_grids(tmp_path, capsys, monkeypatch, no_splits, with_backends):
    """As the dispatcher's own autotuner does, the sweep cuts each candidate into 2/4/8 segments
    where a (faked) GPU has more SMs than sequence x head programs, and stores the winner; the
    table printed shows them. `--no-splits` leaves them out."""
    from dataclasses import replace

    from conftest import TorchAsPlain

    from gdr_dispatch import registry
    from gdr_dispatch.problem import DeviceInfo

    with_backends(TorchAsPlain())
    monkeypatch.setattr(cli, "measure_ms", lambda fn, device_type, warmup, reps: (fn(), 1.0)[1])  # no CUDA timing
    real = registry.Problem.from_call
    monkeypatch.setattr(registry.Problem, "from_call",
                        staticmethod(lambda call: replace(real(call), device=DeviceInfo("cuda", "Fake GPU", (9, 0), 132))))
    grid = tmp_path / "grid.yaml"
    grid.write_text("- {B: 1, T: 600, H: 2, K: 8, V: 8, dtype: float64, h: none}\n")
    out_dir = tmp_path / "tables"
    args = ["tune", "--grid", str(grid), "--out", str(out_dir), "--backends", "torch,fake_plain", "--reps", "1",
            "--warmup", "0", "--compile-jobs", "0"] + (["--no-splits"] if no_splits else [])
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    (table,) = out_dir.glob("*.yaml")
    text = table.read_text()
    for n in (2, 4, 8):
        assert (f"fake_plain@split{n}" in text) != no_splits
        assert (f"fake_plain@split{n} ms" in out) != no_splits
    assert "torch@split" not in text  # the reference is never split


def test_tune_prune_leaves_out_the_families_that_never_won_here(tmp_path, capsys, monkeypatch, with_backends):
    """`tune --prune`: a family the device's tables show never winning in the shape's regime is
    neither compiled nor timed, and its entry says why; without `--prune` it is both."""
    import os as _os

    from gdr_dispatch import tuning_table
    from gdr_dispatch.backends.exact_torch import TorchBackend
    from gdr_dispatch.problem import device_info

    timed = []

    class Fast(TorchBackend):
        name, family_name, reference_rank, reference = "torch_fast", "fastfam", None, False

        def run(self, call):
            timed.append(self.name)
            return super().run(call)

    class Slow(Fast):
        name, family_name = "torch_slow", "slowfam"

        def compile_jobs(self, call):
            return [("math", "sqrt", (float(call.K),))]

    with_backends(Fast(), Slow())
    out_dir = tmp_path / "user_tables"  # the user table the autouse fixture points GDR_TUNING_CACHE at
    assert _os.environ["GDR_TUNING_CACHE"] == str(out_dir)
    dev = device_info(torch.device("cpu"))
    for T in (64, 128, 256):  # three other shapes (as many programs: one regime) where the slow family lost by 1.5x
        p = ShapeSpec(B=1, T=T, H=2, K=32, V=32, dtype="float32", h="given").problem(torch.device("cpu"))
        tuning_table.record(dev.slug, dev.name, {p.table_key(): {
            "problem": p.describe(), "winner": "torch_fast",
            "candidates": {"torch_fast": {"ms": 1.0}, "torch_slow": {"ms": 1.5}, "torch": {"ms": 20.0}}}}, out_dir)
    grid = tmp_path / "grid.yaml"
    grid.write_text("shapes:\n  - {B: 1, T: 100, H: 2, K: 32, V: 32, dtype: float32, h: given}\n")
    args = ["tune", "--grid", str(grid), "--device", "cpu", "--out", str(out_dir), "--backends",
            "torch,torch_fast,torch_slow", "--reps", "1", "--warmup", "0", "--compile-jobs", "2"]
    assert cli.main(args + ["--prune"]) == 0
    err = capsys.readouterr().err
    assert "torch_slow" not in timed and "torch_fast" in timed, err
    assert "compiled torch_slow" not in err
    (table,) = out_dir.glob("*.yaml")
    key = ShapeSpec(B=1, T=100, H=2, K=32, V=32, dtype="float32", h="given").problem(torch.device("cpu")).table_key()
    entry = tuning_table.load_entries(table)[key]
    assert "the slowfam family never won at the 3 " in entry["candidates"]["torch_slow"]["skipped"]
    assert "ms" in entry["candidates"]["torch"]  # it never won either, but the cross-check reads it
    assert entry["cross_check"]["reference"] == "torch"
    timed.clear()
    assert cli.main(args) == 0
    assert "torch_slow" in timed and "compiled torch_slow" in capsys.readouterr().err
    # the one winning family needs an optional peer: pruning would leave users without it no entry
    monkeypatch.setattr(Fast, "optional_lib", "somepeer")
    p = ShapeSpec(B=1, T=100, H=2, K=32, V=32, dtype="float32", h="given").problem(torch.device("cpu"))
    cands = {n: registered_backends()[n] for n in ("torch", "torch_fast", "torch_slow")}
    assert cli._losing(p, cands) == (cands, {})


def test_tune_with_an_optional_peer_writes_the_entry_for_users_without_it(tmp_path, capsys, monkeypatch, with_backends):
    """A shipped table is tuned with flash_qla installed; users without it look up the key
    without it. The sweep writes both from one measurement: the peer's winner under its key,
    the fastest of the rest under the other (not a stale entry from an older sweep)."""
    from dataclasses import replace

    from conftest import TorchAsPlain

    from gdr_dispatch import registry

    class Peer(TorchAsPlain):
        name, optional_lib = "fake_peer", "flash_qla"

        def run(self, call):
            ran.append(self.name)
            return super().run(call)

    ran = []
    with_backends(Peer())
    monkeypatch.setattr(cli, "measure_ms", lambda fn, device_type, warmup, reps: (ran.clear(), fn(), 0.5 if ran else 1.0)[2])
    real = registry.Problem.from_call
    with_peer = lambda call: replace(real(call), versions=real(call).versions + (("flash_qla", "9.9"),))  # noqa: E731
    monkeypatch.setattr(registry.Problem, "from_call", staticmethod(with_peer))
    grid = tmp_path / "grid.yaml"
    grid.write_text("- {B: 1, T: 70, H: 2, K: 8, V: 8, dtype: float64, h: given}\n")
    out_dir = tmp_path / "tables"
    assert cli.main(["tune", "--grid", str(grid), "--out", str(out_dir), "--backends", "torch,fake_peer", "--reps", "1",
                     "--warmup", "0", "--compile-jobs", "0", "--no-splits"]) == 0
    (table,) = out_dir.glob("*.yaml")
    entries = yaml.safe_load(table.read_text())["entries"]
    assert len(entries) == 2
    peer = next(e for k, e in entries.items() if "flash_qla=9.9" in k)
    rest = next(e for k, e in entries.items() if "flash_qla" not in k)
    assert peer["winner"] == "fake_peer" and rest["winner"] == "torch"
    assert rest["candidates"]["fake_peer"] == {"unsupported": "flash_qla not installed"} and "flash_qla=9.9" in rest["derived_from"]


def test_the_tools_grids_load_and_cover_the_models_tensor_parallel_degrees():
    """Every grid in tools/ loads; the model grids hold Qwen3-Next's and Qwen3.5's head layouts at
    TP 1, 2, 4 and 8 (key heads as HF's hook passes them, and repeated)."""
    from pathlib import Path

    from gdr_dispatch.shapes import load_grid

    tools = Path(__file__).resolve().parent.parent / "tools"
    layouts = set()
    for path in sorted(tools.glob("tune_*.yaml")):
        shapes = load_grid(path)
        assert shapes, path
        if path.name.startswith("tune_models"):
            layouts |= {(s.H, s.Hg) for s in shapes}
            assert {s.B * s.T for s in shapes} == {8192, 16384, 32768}, path
    for H, Hk in ((32, 16), (64, 16)):
        for tp in (1, 2, 4, 8):
            assert (H // tp, Hk // tp) in layouts and (H // tp, H // tp) in layouts, (H, Hk, tp)


def test_tune_missing_resumes_where_the_table_stops(tmp_path, capsys):
    """`tune --missing`: the shapes the table already holds for this device and these versions are
    left as they are, the rest tuned; with nothing left, nothing runs."""
    grid = tmp_path / "grid.yaml"
    grid.write_text("shapes:\n  - {B: 1, T: 33, H: 2, K: 16, V: 16, dtype: float32, h: none, dht: false}\n")
    base = ["tune", "--grid", str(grid), "--out", str(tmp_path), "--reps", "1", "--warmup", "0"]
    assert cli.main(base) == 0
    first = yaml.safe_load((tmp_path / "cpu.yaml").read_text())["entries"]
    grid.write_text("shapes:\n  - {B: 1, T: 33, H: 2, K: 16, V: 16, dtype: float32, h: none, dht: false}\n"
                    "  - {B: 2, T: 40, H: 2, K: 16, V: 16, dtype: float32, h: given}\n")
    capsys.readouterr()
    assert cli.main(base + ["--missing"]) == 0
    err = capsys.readouterr().err
    assert "--missing: 1 of 2 shapes already in" in err and "[1/1] B2 T40" in err
    entries = yaml.safe_load((tmp_path / "cpu.yaml").read_text())["entries"]
    assert len(entries) == 2 and all(entries[k] == v for k, v in first.items())
    assert cli.main(base + ["--missing"]) == 0
    assert "--missing: 2 of 2 shapes already in" in capsys.readouterr().err


def test_tune_precompile_builds_the_op_forward_candidates_once_per_provider(monkeypatch):
    """At a starved shape the sweep measures the op's forward (`_tune_forward`): its pre-compile
    holds one build for the whole provider and one its splits share (their segments' varlen call
    builds the same kernels at every count); at a full grid, where nothing is measured, none."""
    from gdr_dispatch import training
    from gdr_dispatch.shapes import ShapeSpec, make_inputs

    inputs = make_inputs(ShapeSpec(B=1, T=256, H=2, K=16, V=16, dtype="float32", h="none"), torch.device("cpu"), seed=0)
    prov = object()
    whole = {"prov": prov}
    split = {"prov": prov, "prov@split2": prov, "prov@split4": prov, "prov@split8": prov}
    monkeypatch.setattr(training, "forward_candidates", lambda problem: (whole, split, []))
    key, jobs = cli._forward_jobs(inputs)
    assert key == training.forward_problem(inputs["q"], inputs["v"], inputs["b"], inputs["initial_state"],
                                           inputs["cu_seqlens"], inputs["state_v_first"]).table_key()
    assert sorted(jobs.values()) == ["prov", "prov@split2"]
    for job, name in jobs.items():  # as _tune_forward runs it: the raw gate, the final state, no chunk states
        assert job[1] == "warm_forward" and job[2][0] == name
        spec = dict(job[2][1])
        assert spec["need_final"] is True and spec["need_states"] is False and spec["scale"] == 16 ** -0.5
        assert spec["g_dtype"] == "float32" and spec["T"] == 256 and spec["H"] == 2
    monkeypatch.setattr(training, "forward_candidates", lambda problem: (whole, whole, []))
    assert cli._forward_jobs(inputs) == (key, {})

    def none(problem):
        raise RuntimeError("no backend's forward takes it")

    monkeypatch.setattr(training, "forward_candidates", none)
    assert cli._forward_jobs(inputs) == (key, {})

    def broken(problem):
        raise KeyError("a bug")

    monkeypatch.setattr(training, "forward_candidates", broken)
    assert cli._forward_jobs(inputs) == (None, {})  # said, and the sweep goes on
