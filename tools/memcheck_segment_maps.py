"""Pass 1's and pass 3's Triton kernels (backends/kernels/segment_maps.py) once each on a small
varlen call (K = V = 128, bf16, grouped heads, segments of 1/63/64/65/200 tokens), for
`compute-sanitizer --tool memcheck` (a launch configuration can read out of bounds on the H200
while the interpreter's runs are clean: segment_maps.BC says which ones do).
Prints each kernel's finish; values are random.

    python tools/memcheck_segment_maps.py [LENS [BC,WARPS,STAGES [maps,states]]]
    compute-sanitizer --tool memcheck python tools/memcheck_segment_maps.py 1,63,64,65,200 32,8,1 maps
"""
import os
import sys

import torch

from gdr_dispatch.backends.kernels import segment_maps as sm
from gdr_dispatch.contract import validate


def main() -> int:
    torch.manual_seed(0)
    lens = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,63,64,65,200").split(",")]
    if len(sys.argv) > 2:  # a launch configuration other than the shipped one: BC,WARPS,STAGES
        sm.BC, sm.NUM_WARPS, sm.NUM_STAGES = (int(x) for x in sys.argv[2].split(","))
    only = sys.argv[3] if len(sys.argv) > 3 else "maps,states"
    T, H, Hg, K, V = sum(lens), 2, 1, 128, 128
    dev, dt = ("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"), torch.bfloat16
    q, k = (torch.randn(1, T, Hg, K, device=dev, dtype=dt) * 0.1 for _ in range(2))
    v, do = (torch.randn(1, T, H, V, device=dev, dtype=dt) for _ in range(2))
    a = (torch.randn(1, T, H, 64, device=dev) * 0.1).to(dt)
    g = -torch.rand(1, T, H, device=dev).cumsum(1) * 0.1
    b = torch.rand(1, T, H, device=dev, dtype=dt)
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    call = validate(q, k, v, a, g, b, do, scale=K ** -0.5, cu_seqlens=cu, chunk_size=64)
    for need_r in (False, True) if "maps" in only else ():
        m, r, d = sm.segment_maps(call, need_r=need_r)
        torch.cuda.synchronize() if dev == "cuda" else None
        print(f"segment_maps(need_r={need_r}): finite {bool(m.isfinite().all() and d.isfinite().all())}", flush=True)
    init = torch.randn(len(lens), H, K, V, device=dev)
    for v_first in (False, True) if "states" in only else ():
        h = sm.segment_states(call, init, state_v_first=v_first)
        torch.cuda.synchronize() if dev == "cuda" else None
        print(f"segment_states(state_v_first={v_first}): {tuple(h.shape)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
