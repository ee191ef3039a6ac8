"""Test fixtures shared by several test modules (not shipped: the package's reference math is
gdr_dispatch/chunked_math.py and gdr_dispatch/reference.py)."""

import contextlib
from dataclasses import replace

import pytest
import torch

from gdr_dispatch.chunk_layout import ChunkLayout
from gdr_dispatch.chunked_math import (chunk_state_grads, chunk_states, dqkwg, dv_local, expand_heads, recompute_w_u,
                                       reverse_chunk_cumsum, wy_bwd)
from gdr_dispatch.contract import chunk_counts, reduce_value_heads
from gdr_dispatch.shapes import make_inputs


def fused_stage_case(spec, dtype: str, seed: int = 7):
    """Inputs and float64 outputs of the fused stage 5 + 6 (what `wy_dqkg_wide` computes).

    Stages 1-4 run here in float64 on random inputs for `spec` (a `shapes.ShapeSpec`, CPU);
    returns `(inputs, kernel_kwargs, expected)`: the forward inputs of `shapes.make_inputs`,
    the launcher's tensor arguments rounded to `dtype`, and `dq, dk, dv, db, dg` in float64.
    Shared by the kernels' CPU tests and their GPU tests.
    """
    f64 = torch.float64
    x = make_inputs(replace(spec, dtype=dtype, h="none"), "cpu", seed=seed)
    lay = ChunkLayout.build(spec.B, spec.T, spec.seq_lens, 64, "cpu")
    H, vf = spec.H, spec.state_v_first
    q, k = expand_heads(lay.gather(x["q"], f64), H), expand_heads(lay.gather(x["k"], f64), H)
    v, do, A, b = (lay.gather(x[n], f64) for n in ("v", "do", "a", "b"))
    G = lay.gather_gate(x["g"], f64)

    def state(s):
        return None if s is None else (s.transpose(-1, -2) if vf else s).to(f64)

    w, u = recompute_w_u(k, v, b, A, G)
    h, v_new, _ = chunk_states(k, w, u, G, state(x["initial_state"]))
    dvl = dv_local(q, k, G, do, x["scale"])
    dh, _, du = chunk_state_grads(q, k, w, G, state(x["dht"]), do, dvl, x["scale"])
    dq, dk, dw, dG = dqkwg(q, k, v_new, w, G, h, du, do, dh, x["scale"], lay.chunk_len)
    dk2, dv, db, dG2 = wy_bwd(k, v, b, A, G, dw, du)
    expected = {
        "dq": reduce_value_heads(lay.scatter(dq, f64), spec.Hg),
        "dk": reduce_value_heads(lay.scatter(dk + dk2, f64), spec.Hg),
        "dv": lay.scatter(dv, f64), "db": lay.scatter(db, f64),
        "dg": lay.scatter(reverse_chunk_cumsum(dG + dG2), f64),
    }
    NT = sum(chunk_counts(spec.seq_lens, 64))
    lead = (1, NT) if spec.seqlens else (spec.B, NT // spec.B)

    def states_out(s, dt):
        out = lay.scatter_chunks(s, lead, dt)
        return out.transpose(-1, -2).contiguous() if vf else out

    dt = x["q"].dtype
    kernel_in = dict(q=x["q"], k=x["k"], v=x["v"], v_new=lay.scatter(v_new, dt), du=lay.scatter(du, dt), do=x["do"],
                     a=x["a"], g=x["g"], b=x["b"], h=states_out(h, dt), dh=states_out(dh, dt))
    return x, kernel_in, expected


def host_growth(step, n: int = 10_000) -> tuple[int, int]:
    """`step()` run `n` times after a warm-up of 500: the bytes host memory grew by (tracemalloc,
    after a cycle collection: what only waits for the collector is not growth) and the entries
    the library's memos gained (caches.sizes)."""
    import gc
    import tracemalloc

    from gdr_dispatch import caches

    for _ in range(500):
        step()
    tracemalloc.start()
    gc.collect()
    before = tracemalloc.take_snapshot()
    sizes_before = sum(caches.sizes().values())
    for _ in range(n):
        step()
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename")), sum(caches.sizes().values()) - sizes_before


@contextlib.contextmanager
def int_reads():
    """The values of every integer tensor's `tolist` inside (a read of lengths, which on a GPU
    waits for the stream): what a step that should read nothing from the device is checked by."""
    real, reads = torch.Tensor.tolist, []

    def counted(self, *a):
        if not self.is_floating_point():
            reads.append(tuple(real(self)))
        return real(self, *a)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.Tensor, "tolist", counted)
        yield reads
