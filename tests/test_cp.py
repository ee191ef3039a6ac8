"""Context parallelism across ranks (backends/split/ranks.py): 2 and 4 gloo processes on the CPU,
every output and gradient of every case against the same call in one process, float64 (<= 1e-10).
The cases: one long sequence, varlen packs whose sequences cross rank edges (lengths 1/63/64/65 at
the edges), ranks holding only the middle of a sequence, a sequence of no tokens, grouped heads,
state_v_first, h0/dht present and absent, and fused_gdr_bwd's own cp_group with h given and not."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_case_matches_the_single_process_call(world, tmp_path):
    port = free_port()
    env = {**os.environ, "TRITON_INTERPRET": "1", "GDR_TUNING_CACHE": str(tmp_path / "tables"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, str(HERE / "cp_worker.py"), str(r), str(world), str(port), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-3000:]
    for r in range(world):
        results = json.loads((tmp_path / f"{r}.json").read_text())
        assert results, f"rank {r} ran no case"
        refusals = results.pop("refusals")
        if r == world - 1:
            assert refusals["bad beta on the last rank"].startswith("beta: expected shape"), refusals
        else:
            assert "refused their arguments" in refusals["bad beta on the last rank"], refusals
        assert refusals["a list as initial_state"].startswith("initial_state: expected a torch.Tensor"), refusals
        for case, errs in results.items():
            assert "error" not in errs, (r, case, errs)
            bad = {n: e for n, e in errs.items() if not e <= 1e-10}
            assert not bad, (world, r, case, errs)
