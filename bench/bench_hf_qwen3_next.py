"""A Hugging Face Qwen3-Next training step with our op in its Gated DeltaNet layers, beside the
same model on HF's default fast path (fla-core's op, which its modeling module binds where fla
imports): losses over the steps and the median step time, in one process.

    python bench/bench_hf_qwen3_next.py                     # 3 linear-attention layers, 16 value / 8 key heads, B2 T4096 bf16
    python bench/bench_hf_qwen3_next.py --steps 8 --out bench/results/nvidia-h200-sm90-hf.json
    python bench/bench_hf_qwen3_next.py --first-step --out bench/results/nvidia-h200-sm90-hf-first-step.json

`--first-step`: the first training step as a user meets it, each model in processes of its own:
with every disk cache empty (TileLang's, Triton's with fla's autotune results, our user tables:
fresh directories; the tables shipped in the package are read, as a user's install reads them),
then again in a second process on the caches the first one left (warm); ours and HF's default
alike, the same way. Each process's stderr (our log lines, timed from its start) goes beside
`--out` in `<out>-logs/`.

Both runs start from the same weights and data and train with AdamW; the hook is
`gdr_dispatch.integrations.transformers.enable(model)`. HF hands the layers' q, k, v over as
strided views of one projection; the op takes them as they are. Writes JSON and a markdown row.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def build_model(heads: int = 16, key_heads: int = 8, head_dim: int = 128, layers: int = 3, hidden: int = 1024,
                vocab: int = 1024, device: str = "cuda", dtype=torch.bfloat16, seed: int = 0):
    """A small random Qwen3-Next of `layers` Gated DeltaNet layers (dense MLPs), K = V = `head_dim`,
    `heads` value heads and `key_heads` q/k heads (Qwen3-Next's 2:1: its 32 and 16 at tensor
    parallelism 2 by default, a shape of the model grids the shipped tables cover)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          layer_types=["linear_attention"] * layers, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64, linear_num_key_heads=key_heads, linear_num_value_heads=heads,
                          linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
                          mlp_only_layers=list(range(layers)), max_position_embeddings=1 << 16)
    torch.manual_seed(seed)
    return Qwen3NextForCausalLM(cfg).to(device=device, dtype=dtype)


def train(model, ids, steps: int, lr: float = 1e-3):
    """`steps` AdamW steps on `ids`: (losses, step times in ms, the last step's gradient norm)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    return losses, times


def compare(B: int = 2, T: int = 4096, steps: int = 8, **model_kw) -> dict:
    """The hooked and the default model trained side by side: losses, step times."""
    from gdr_dispatch.integrations import transformers as gdr_hf

    base = build_model(**model_kw)
    ids = torch.randint(0, base.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(1)).cuda()
    hooked = copy.deepcopy(base)
    default_losses, default_ms = train(base, ids, steps)
    before = graph_counts()
    with gdr_hf.use_gdr_dispatch(hooked):
        ours_losses, ours_ms = train(hooked, ids, steps)
    graphs_seen = {k: v - before.get(k, 0) for k, v in graph_counts().items() if v != before.get(k, 0)}
    diff = max(abs(a - b) / abs(b) for a, b in zip(ours_losses, default_losses))
    # the first step compiles and autotunes: the medians leave it out
    return {"B": B, "T": T, "steps": steps, **model_kw, "default_losses": default_losses, "ours_losses": ours_losses,
            "max_rel_loss_diff": diff, "default_step_ms": round(statistics.median(default_ms[1:]), 2),
            "ours_step_ms": round(statistics.median(ours_ms[1:]), 2), "default_first_step_s": round(default_ms[0] / 1e3, 1),
            "ours_first_step_s": round(ours_ms[0] / 1e3, 1),
            # the split graphs over the steps: replays in place or with copies, and the MiB copied
            **({"ours_split_graphs": graphs_seen} if graphs_seen else {})}


def graph_counts() -> dict:
    """The split graphs' replays ("in place", "copied") and copied MiB ("MiB in", "MiB out") so far
    (backends/split/graphs.py): whether a model's layers hand the op the same addresses each step."""
    try:
        from gdr_dispatch.backends.split import graphs
    except ImportError:
        return {}
    return {**graphs.replays, **{f"MiB {k}": round(v / 2 ** 20, 1) for k, v in graphs.copied_bytes.items()}}


def one_model(which: str, B: int, T: int, steps: int, **model_kw) -> dict:
    """One model alone (`ours`: hooked; `default`: HF's fast path): its step times and losses."""
    from gdr_dispatch.integrations import transformers as gdr_hf

    import logging

    model = build_model(**model_kw)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(1)).cuda()
    logging.getLogger("gdr_dispatch.bench").info("bench: %s model built, its first step starts", which)
    if which == "ours":
        with gdr_hf.use_gdr_dispatch(model):
            losses, ms = train(model, ids, steps)
    else:
        losses, ms = train(model, ids, steps)
    return {"which": which, "losses": losses, "first_step_s": round(ms[0] / 1e3, 2),
            "step_ms": round(statistics.median(ms[1:]), 2) if len(ms) > 1 else None}


def first_steps(a) -> dict:
    """`--first-step`: per model, a process on empty cache directories, then a second on the
    same (now warm) ones; the first step's wall time of each."""
    import os
    import subprocess
    import tempfile

    root = Path(a.cache_root or tempfile.mkdtemp(prefix="gdr-first-step-"))
    if root.exists() and any(root.iterdir()):  # a second run there would read warm caches as fresh
        raise SystemExit(f"--cache-root {root}: not empty (its caches would be warm); give an empty or new folder")
    out = getattr(a, "out", "")
    logs = Path(out).parent / f"{Path(out).stem}-logs" if out else root
    logs.mkdir(parents=True, exist_ok=True)
    rows = {}
    for which in getattr(a, "models", "default,ours").split(","):
        caches = {"TRITON_CACHE_DIR": root / which / "triton", "TILELANG_CACHE_DIR": root / which / "tilelang",
                  "GDR_TUNING_CACHE": root / which / "tables"}
        env = {**os.environ, **{k: str(v) for k, v in caches.items()}}
        for when in ("fresh", "warm"):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--only", which, "--steps", str(a.steps), "--B",
                   str(a.B), "--T", str(a.T), "--heads", str(a.heads), "--key-heads", str(a.key_heads),
                   "--layers", str(a.layers)]
            t0 = time.perf_counter()
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.child_timeout)
            except subprocess.TimeoutExpired:
                rows[f"{which} {when}"] = {"failed": f"no result within {a.child_timeout} s"}
                print(f"{which} {when}: {rows[f'{which} {when}']}", file=sys.stderr, flush=True)
                continue
            wall = time.perf_counter() - t0
            log = logs / f"{which}-{when}.log"  # the child's stderr: our progress lines, timed
            log.write_text(done.stderr)
            result = None
            for line in reversed(done.stdout.strip().splitlines()):  # its JSON line, whatever else printed
                try:
                    result = json.loads(line)
                    break
                except ValueError:
                    continue
            if done.returncode != 0 or not isinstance(result, dict):
                rows[f"{which} {when}"] = {"failed": (done.stderr.strip().splitlines() or ["no JSON line"])[-1][:300]}
            else:
                rows[f"{which} {when}"] = {**result, "process_s": round(wall, 1), "log": str(log)}
            print(f"{which} {when}: {rows[f'{which} {when}']}", file=sys.stderr, flush=True)
    return {"B": a.B, "T": a.T, "heads": a.heads, "key_heads": a.key_heads, "layers": a.layers, "steps": a.steps,
            "caches": str(root), "runs": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16, help="value heads")
    p.add_argument("--key-heads", type=int, default=8, help="q/k heads (Qwen3-Next: half the value heads)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="")
    p.add_argument("--first-step", action="store_true",
                   help="the first step with empty disk caches and again warm, each model in its own processes")
    p.add_argument("--cache-root", default="", help="with --first-step: an empty folder for the fresh caches")
    p.add_argument("--child-timeout", type=float, default=1500.0, help="with --first-step: seconds per process")
    p.add_argument("--only", choices=["ours", "default"], help="one model alone; prints one JSON line")
    p.add_argument("--models", default="default,ours",
                   help="with --first-step: the models to run, comma-separated (default,ours)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hf_qwen3_next: needs a CUDA device", file=sys.stderr)
        return 2
    if a.only:  # our progress lines on stderr with the ms since the process started (--first-step keeps them)
        import logging

        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(relativeCreated)9.0f ms  %(message)s"))
        logging.getLogger("gdr_dispatch").addHandler(handler)
        logging.getLogger("gdr_dispatch").setLevel(logging.INFO)
        print(json.dumps(one_model(a.only, a.B, a.T, a.steps, heads=a.heads, key_heads=a.key_heads, layers=a.layers)), flush=True)
        return 0
    if a.first_step:
        doc = first_steps(a)
        print(json.dumps(doc, indent=1), flush=True)
        if a.out:
            out = Path(a.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"device": torch.cuda.get_device_name(), **doc}, indent=1))
            r = doc["runs"]
            cell = lambda k: (f"{r[k]['first_step_s']} s" if "first_step_s" in r.get(k, {})  # noqa: E731
                              else r.get(k, {}).get("failed", "-"))
            out.with_suffix(".md").write_text(
                "First training step (s), each in its own process: empty disk caches / the caches the first left\n\n"
                "| model | HF default (fla's op) | gdr_dispatch hook |\n|---|---|---|\n"
                f"| Qwen3-Next {a.layers} GDN layers, H{a.heads} Hg{a.key_heads}, B{a.B} T{a.T} bf16 | {cell('default fresh')} / "
                f"{cell('default warm')} | {cell('ours fresh')} / {cell('ours warm')} |\n")
        return 0
    row = compare(a.B, a.T, a.steps, heads=a.heads, key_heads=a.key_heads, layers=a.layers)
    print(json.dumps(row, indent=1), flush=True)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": [row]}, indent=1))
        out.with_suffix(".md").write_text(
            "| model | HF default (fla) ms/step | gdr_dispatch hook ms/step | max rel. loss diff |\n|---|---|---|---|\n"
            f"| Qwen3-Next {a.layers} GDN layers, H{a.heads} Hg{a.key_heads}, B{a.B} T{a.T} bf16 | {row['default_step_ms']} | "
            f"{row['ours_step_ms']} | {row['max_rel_loss_diff']:.1e} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
