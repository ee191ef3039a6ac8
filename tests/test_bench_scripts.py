"""The GPU-only bench scripts, checked where a CPU can check them: a typo there costs device time."""

import inspect
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))


def test_every_stage56_config_binds_to_its_launcher():
    import bench_stage56 as s56

    for cfg in s56.CONFIGS:
        cfg = dict(cfg)
        launcher = s56.KERNELS[cfg.pop("kernel")][0]
        inspect.signature(launcher).bind_partial(**cfg)  # raises TypeError on an unknown knob


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


def test_device_script_probes_exist():
    from gdr_dispatch.backends.kernels.tilelang_fused_bwd import PROBES

    text = (BENCH / "device_run.sh").read_text()
    loop = re.search(r'for pr in (.*?); do', text)
    assert loop, "tlprobe step not found in device_run.sh"
    named = [p.strip('"') for p in loop.group(1).split()]
    assert named and all(p in PROBES for p in named), (named, PROBES)


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_scripts_import(script):
    """Import errors and syntax errors surface here rather than on the GPU machine."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(script[:-3], BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert hasattr(module, "main")
