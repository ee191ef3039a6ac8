"""A Hugging Face Qwen3-Next training step with our op in its Gated DeltaNet layers, beside the
same model on HF's default fast path (fla-core's op, which its modeling module binds where fla
imports): losses over the steps and the median step time, in one process.

    python bench/bench_hf_qwen3_next.py                     # 3 linear-attention layers, 16 heads, B2 T4096 bf16
    python bench/bench_hf_qwen3_next.py --steps 8 --out bench/results/nvidia-h200-sm90-hf.json

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


def build_model(heads: int = 16, head_dim: int = 128, layers: int = 3, hidden: int = 1024, vocab: int = 1024,
                device: str = "cuda", dtype=torch.bfloat16, seed: int = 0):
    """A small random Qwen3-Next of `layers` Gated DeltaNet layers (dense MLPs), K = V = `head_dim`."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          layer_types=["linear_attention"] * layers, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64, linear_num_key_heads=heads, linear_num_value_heads=heads,
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
    with gdr_hf.use_gdr_dispatch(hooked):
        ours_losses, ours_ms = train(hooked, ids, steps)
    diff = max(abs(a - b) / abs(b) for a, b in zip(ours_losses, default_losses))
    # the first step compiles and autotunes: the medians leave it out
    return {"B": B, "T": T, "steps": steps, **model_kw, "default_losses": default_losses, "ours_losses": ours_losses,
            "max_rel_loss_diff": diff, "default_step_ms": round(statistics.median(default_ms[1:]), 2),
            "ours_step_ms": round(statistics.median(ours_ms[1:]), 2), "default_first_step_s": round(default_ms[0] / 1e3, 1),
            "ours_first_step_s": round(ours_ms[0] / 1e3, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hf_qwen3_next: needs a CUDA device", file=sys.stderr)
        return 2
    row = compare(a.B, a.T, a.steps, heads=a.heads, layers=a.layers)
    print(json.dumps(row, indent=1), flush=True)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": [row]}, indent=1))
        out.with_suffix(".md").write_text(
            "| model | HF default (fla) ms/step | gdr_dispatch hook ms/step | max rel. loss diff |\n|---|---|---|---|\n"
            f"| Qwen3-Next {a.layers} GDN layers, H{a.heads}, B{a.B} T{a.T} bf16 | {row['default_step_ms']} | "
            f"{row['ours_step_ms']} | {row['max_rel_loss_diff']:.1e} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
