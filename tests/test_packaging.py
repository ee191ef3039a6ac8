"""What a user installs: every module of the checkout ships (as `gdr_dispatch.*`), the shipped
tables come with it, and nothing the README points to is missing.

`.ci/run` runs this suite against the installed wheel from a directory where the checkout is
not importable; there `gdr_dispatch` is the installed package and these tests compare it with
the checkout the tests came from.
"""

import importlib
import importlib.util
import json
import re
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: checkout folder -> the package it installs as
ROOTS = {"gdr_dispatch": "gdr_dispatch", "backends": "gdr_dispatch.backends", "tuning_cache": "gdr_dispatch.tuning_cache"}


def checkout_modules() -> list[str]:
    names = []
    for folder, package in ROOTS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            names.append(".".join([package, *parts]))
    return names


@pytest.mark.parametrize("module", checkout_modules())
def test_every_module_of_the_checkout_is_installed(module):
    """A wheel that listed its packages by hand left out gdr_dispatch.backends.kernels."""
    assert importlib.util.find_spec(module) is not None, f"{module} is not in the installed package"
    if not module.endswith("__main__"):  # importing that one runs the CLI
        importlib.import_module(module)


def test_the_shipped_tables_are_installed():
    shipped = Path(importlib.import_module("gdr_dispatch.tuning_cache").__file__).parent
    mine = sorted(p.name for p in (ROOT / "tuning_cache").glob("*.yaml"))
    assert mine and sorted(p.name for p in shipped.glob("*.yaml")) == mine


def test_bench_tools_and_tests_do_not_ship():
    dist = metadata.distribution("gdr-dispatch")
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if not str(getattr(dist, "_path", "")).endswith(".dist-info") or direct.get("dir_info", {}).get("editable"):
        pytest.skip("not installed from a wheel here (an editable install ships nothing); .ci/run checks the wheel")
    top = {f.parts[0] for f in dist.files}
    assert "gdr_dispatch" in top
    assert not top & {"bench", "tools", "tests", "backends", "tuning_cache"}, sorted(top)


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(doc):
    """README once linked the contract to a file outside the repository."""
    text = (ROOT / doc).read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if "://" not in link and not (ROOT / doc).parent.joinpath(link).exists()]
    assert not missing, f"{doc} links to files that are not in the repository: {missing}"
    assert "GDR_MATH.md" not in text, f"{doc} names GDR_MATH.md, which is not in the repository"


def test_the_readme_example_runs(capsys):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block, "README has no python example"
    exec(compile(block.group(1), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == ("torch.Size([2, 100, 2, 32]) torch.Size([2, 100, 4]) "
                                               "torch.Size([2, 4, 32, 32])")


def test_the_readme_training_example_runs(capsys):
    """The drop-in example: forward and backward of the op on a CPU, through fused_gdr_bwd."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    training = [b for b in blocks if "chunk_gated_delta_rule(" in b and "cp_group" not in b]
    assert training, "README has no training example"
    exec(compile(training[0], "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == ("torch.Size([1, 80, 4, 32]) torch.Size([1, 4, 32, 32]) "
                                               "torch.Size([1, 80, 4, 32])")


def test_the_readme_torchrun_example_runs(tmp_path):
    """The cross-rank example, as README says to run it: two gloo processes under torchrun."""
    import os
    import subprocess
    import sys

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (example,) = [b for b in blocks if "cp_group" in b]
    script = tmp_path / "cp_example.py"
    script.write_text(example)
    from conftest import free_port

    port = free_port()
    env = {**os.environ, "TRITON_INTERPRET": "1", "GDR_TUNING_CACHE": str(tmp_path / "tables")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # the two ranks' lines may interleave on the shared stdout: each rank's shapes once
    assert done.stdout.count("torch.Size([1, 256, 2, 32]) torch.Size([1, 2, 32, 32]) torch.Size([1, 256, 2, 32])") == 2, \
        done.stdout


def test_readme_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```") + 1: lines.index("```", lines.index("```") + 1)]
    assert [line.split("#")[0].strip() for line in block] == ["make tune", "make test"]


def test_the_core_imports_no_backend_and_its_import_graph_has_no_cycle():
    """gdr_dispatch/ holds no kernel and imports nothing from backends/ (they register with it);
    among its modules no import, at module level or inside a function, closes a cycle."""
    import ast

    core = ROOT / "gdr_dispatch"
    mods = {}
    for p in core.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    graph = {}
    for name, path in mods.items():
        text = path.read_text()
        assert "triton.jit" not in text and "tilelang.language" not in text, f"{name} holds kernel code"
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                assert "backends" not in target.split("."), f"{name} imports {target}"
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    deps.add(full if full in mods else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        # the package's own __init__ imports its modules; a module reaching it back is no cycle of
        # theirs unless it imports a name the __init__ defines, which none does
        graph[name] = {d for d in deps if d in mods and d != name and d != "gdr_dispatch"}
    state, path = {}, []

    def visit(u):
        state[u] = 1
        path.append(u)
        for v in graph[u]:
            assert state.get(v) != 1, f"import cycle: {' -> '.join(path[path.index(v):] + [v])}"
            if v not in state:
                visit(v)
        path.pop()
        state[u] = 2

    for m in graph:
        if m not in state:
            visit(m)


def test_backends_and_tables_come_with_the_core_they_sit_beside():
    """A checkout run from its own directory, with an editable install of another checkout in the
    environment, imports its own backends and tables, not the other checkout's."""
    core = Path(importlib.import_module("gdr_dispatch").__file__).resolve().parent
    for sub in ("backends", "tuning_cache"):
        where = Path(importlib.import_module(f"gdr_dispatch.{sub}").__file__).resolve().parent
        assert where in (core / sub, core.parent / sub), f"gdr_dispatch.{sub} loaded from {where}, the core from {core}"
