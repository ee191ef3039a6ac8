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
  ours-torch-l2norm  `ours` with the hook's q/k l2norm in its torch form (not the one-pass kernels)
  ours@N         `ours` with N in-place graphs kept per split key (graphs.ADDRESS_SETS; a model
                 with more layers at one shape than kept replays the rest with copies in)
Prints one line per variant (median step ms over the steps after the first, the split graphs'
replays and copied MiB, the peak of allocated memory; each variant starts with no split graph kept) and, for `--profile`, torch.profiler's tables (GPU and host) of
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
    "ours-torch-l2norm": {},
}


@contextlib.contextmanager
def torch_l2norm(on: bool):
    """The hook's q/k l2norm in its torch form for the block (`on`), else as it is."""
    from gdr_dispatch.integrations import transformers as gdr_hf

    saved = gdr_hf._fused_l2norm
    if on:
        gdr_hf._fused_l2norm = lambda: None  # no kernel: `l2norm` takes its own torch form
    try:
        yield
    finally:
        gdr_hf._fused_l2norm = saved


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


@contextlib.contextmanager
def address_sets(n: int):
    """`graphs.ADDRESS_SETS = n` for the block (0: as it is), with `RECENT` and the in-place graphs'
    limit scaled to it; every memo is forgotten before and after (`clear_caches`: each variant's
    graph captures and memory are its own; compiled kernels stay)."""
    from gdr_dispatch import clear_caches

    try:
        from gdr_dispatch.backends.split import graphs
    except ImportError:
        yield
        return
    saved = graphs.ADDRESS_SETS, graphs.RECENT, graphs._placed.limit
    clear_caches()
    if n:
        graphs.ADDRESS_SETS, graphs.RECENT, graphs._placed.limit = n, max(saved[1], 4 * n), graphs.LIMIT * n
    try:
        yield
    finally:
        clear_caches()
        torch.cuda.synchronize()
        graphs.ADDRESS_SETS, graphs.RECENT, graphs._placed.limit = saved


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
    p.add_argument("--rows", type=int, default=30, help="rows of each profiler table")
    p.add_argument("--trace", default="", help="a folder for each profiled variant's Chrome trace (<variant>.json.gz)")
    p.add_argument("--rounds", type=int, default=1, help="the variants in turn this many times (a host's drift "
                   "falls on all alike); each round's median printed")
    p.add_argument("--log", action="store_true", help="gdr_dispatch's log lines (INFO) on stderr, and per-step counts")
    a = p.parse_args(argv)
    if a.log:
        import logging
        logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
        logging.getLogger("gdr_dispatch").setLevel(logging.INFO)
    from gdr_dispatch.integrations import transformers as gdr_hf

    base = build_model(heads=a.heads, key_heads=a.key_heads, layers=a.layers)
    ids = torch.randint(0, base.config.vocab_size, (a.B, a.T), generator=torch.Generator().manual_seed(1)).cuda()
    tables = []
    for name in [v for _ in range(a.rounds) for v in a.variants.split(",")]:
        base_name, _, sets = name.partition("@")
        env = VARIANTS[base_name]
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = graph_counts()
        hook = gdr_hf.use_gdr_dispatch(model) if env is not None else contextlib.nullcontext()
        torch.cuda.reset_peak_memory_stats()
        with environment(**(env or {})), hook, address_sets(int(sets or 0)), \
                torch_l2norm(base_name == "ours-torch-l2norm"):
            ms = steps(model, ids, a.steps, opt, a.log)
            seen = {k: round(v - before.get(k, 0), 1) for k, v in graph_counts().items() if v != before.get(k, 0)}
            print(f"{name}: step {statistics.median(ms[1:]):.2f} ms median (first {ms[0] / 1e3:.1f} s, "
                  f"all {[round(x, 1) for x in ms]}); peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} "
                  f"GiB; split graphs {seen}", flush=True)
            if name in a.profile.split(",") and not any(t.startswith(f"== {name}:") for t in tables):
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    steps(model, ids, a.profile_steps, opt)
                if a.trace:
                    import gzip
                    import shutil
                    Path(a.trace).mkdir(parents=True, exist_ok=True)
                    raw = Path(a.trace) / f"{name}.json"
                    prof.export_chrome_trace(str(raw))
                    with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    raw.unlink()
                ka = prof.key_averages()
                tables.append(f"== {name}: {a.profile_steps} steps, by GPU time\n"
                              + ka.table(sort_by="self_device_time_total", row_limit=a.rows)
                              + f"\n== {name}: by host time\n" + ka.table(sort_by="self_cpu_time_total", row_limit=25))
        del model, opt
        torch.cuda.empty_cache()
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
