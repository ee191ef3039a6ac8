"""Where a Hugging Face Qwen3-Next training step spends its time with our op, beside HF's default
(fla's op, which runs FlashQLA's op with `auto_cp` where FlashQLA is installed): the step time of each variant in one process, then a torch.profiler table of a few
steps of the chosen ones (docs/kernels.md, "The split"; bench/bench_hf_qwen3_next.py times the
plain comparison).

    python tools/hf_step_profile.py --B 1 --T 8192 --heads 16 --key-heads 8
    python tools/hf_step_profile.py --variants default,ours,ours-eager --profile ours

Variants (each a fresh copy of one model, the environment set around its steps):
  default        HF's fast path (fla's op; FlashQLA's where installed)
  ours           our op as the tables pick (the split replayed from graphs on starved grids)
  ours-eager     the same with GDR_SPLIT_GRAPHS=0 (the split launched eagerly)
  ours-unsplit   GDR_FORWARD=flash_qla, GDR_BACKEND=tilelang_fused: no split either way
Prints one line per variant (median step ms over the steps after the first, the split graphs'
replays and copied MiB) and, for `--profile`, torch.profiler's tables (GPU and host) of
`--profile-steps` steps after the timed ones.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_hf_qwen3_next import build_model, graph_counts  # noqa: E402
from bench_hot_path import environment  # noqa: E402

VARIANTS = {
    "default": None,
    "ours": {},
    "ours-eager": {"GDR_SPLIT_GRAPHS": "0"},
    "ours-unsplit": {"GDR_FORWARD": "flash_qla", "GDR_BACKEND": "tilelang_fused"},
}


def steps(model, ids, n: int, opt, verbose: bool = False) -> list[float]:
    out = []
    for i in range(n):
        torch.cuda.synchronize()
        before = _counts()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
        if verbose:
            after = _counts()
            print(f"  step {i}: {out[-1]:.1f} ms; " + ", ".join(f"{k} +{after[k] - before.get(k, 0):g}" for k in after
                                                            if after[k] != before.get(k, 0)), flush=True)
    return out


def _counts() -> dict:
    """The CUDA allocator's device mallocs and frees so far, the split graphs' captures, and their
    replays and copied MiB (`graph_counts`)."""
    stats = torch.cuda.memory_stats()
    out = {"cudaMalloc": stats.get("num_device_alloc", 0), "cudaFree": stats.get("num_device_free", 0),
           **graph_counts()}
    try:
        from gdr_dispatch.backends.split import graphs
        out.update({f"capture {k}": v for k, v in graphs.captures.items()})
    except ImportError:
        pass
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--key-heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variants", default="default,ours,ours-eager,ours-unsplit")
    p.add_argument("--profile", default="default,ours", help="variants profiled after their timed steps")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="the variants in turn this many times (a host's drift "
                   "falls on all alike); each round's median printed")
    p.add_argument("--address-sets", type=int, default=0,
                   help="in-place graphs kept per split key (graphs.ADDRESS_SETS, with RECENT and the kept "
                        "graphs' limit scaled to it): a model with more layers at one shape than the default "
                        "replays with copies; 0 keeps the default")
    p.add_argument("--log", action="store_true", help="gdr_dispatch's log lines (INFO) on stderr, and per-step counts")
    a = p.parse_args(argv)
    if a.log:
        import logging
        logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
        logging.getLogger("gdr_dispatch").setLevel(logging.INFO)
    from gdr_dispatch.integrations import transformers as gdr_hf

    if a.address_sets:
        from gdr_dispatch.backends.split import graphs
        graphs.ADDRESS_SETS = a.address_sets
        graphs.RECENT = max(graphs.RECENT, 4 * a.address_sets)
        graphs._placed.limit = graphs.LIMIT * a.address_sets
    base = build_model(heads=a.heads, key_heads=a.key_heads, layers=a.layers)
    ids = torch.randint(0, base.config.vocab_size, (a.B, a.T), generator=torch.Generator().manual_seed(1)).cuda()
    tables = []
    for name in [v for _ in range(a.rounds) for v in a.variants.split(",")]:
        env = VARIANTS[name]
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = graph_counts()
        hook = gdr_hf.use_gdr_dispatch(model) if env is not None else contextlib.nullcontext()
        with environment(**(env or {})), hook:
            ms = steps(model, ids, a.steps, opt, a.log)
            seen = {k: round(v - before.get(k, 0), 1) for k, v in graph_counts().items() if v != before.get(k, 0)}
            print(f"{name}: step {statistics.median(ms[1:]):.2f} ms median (first {ms[0] / 1e3:.1f} s, "
                  f"all {[round(x, 1) for x in ms]}); split graphs {seen}", flush=True)
            if name in a.profile.split(",") and not any(t.startswith(f"== {name}:") for t in tables):
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    steps(model, ids, a.profile_steps, opt)
                ka = prof.key_averages()
                tables.append(f"== {name}: {a.profile_steps} steps, by GPU time\n"
                              + ka.table(sort_by="self_device_time_total", row_limit=30)
                              + f"\n== {name}: by host time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=25))
        del model, opt
        torch.cuda.empty_cache()
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
