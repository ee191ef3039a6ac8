"""The compiler's resource report of our Triton kernels (backends/kernels/segment_maps.py) for sm_90a, without a GPU:
registers, spill stack and shared memory per kernel and launch configuration (read it before a
device call; docs/kernels.md, "The split").

    python tools/triton_report.py                              # segment_maps' kernels, K = V = 128
    python tools/triton_report.py --configs 32,8/64,8/16,8     # BC,WARPS pairs
    python tools/triton_report.py --triton /tmp/tri36          # another Triton (the GPU machine has 3.6.0):
        pip install --no-deps --target /tmp/tri36 /opt/pypi/files/triton-3.6.0-cp311-*.whl

Compiles ahead of time (triton.compile with a GPUTarget) and reads the cubin's resource usage
with cuobjdump (Triton's wheel ships one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="32,8/64,8", help="'BC,WARPS' pairs, '/'-separated")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--triton", default=None, help="a folder holding another Triton package, put first on sys.path")
    a = p.parse_args()
    if a.triton:
        sys.path.insert(0, a.triton)
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget

    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
    from gdr_dispatch.backends.kernels import segment_maps as sm

    tool = shutil.which("cuobjdump") or next(Path(triton.__file__).parent.rglob("cuobjdump"), None)
    if tool is None:
        print("no cuobjdump on PATH or in Triton's package", file=sys.stderr)
        return 1
    ptr = f"*{a.dtype}"
    common = dict(g_ptr="*fp32", b_ptr=ptr, cu_ptr="*i32", out_ptr="*fp32")
    kernels = {
        "_forward_maps": (sm._forward_maps, dict(k_ptr=ptr, v_ptr=ptr, a_ptr=ptr, **common, Hg="i32", H="i32",
                                                 NCOL="i32")),
        "_backward_maps": (sm._backward_maps, dict(q_ptr=ptr, k_ptr=ptr, a_ptr=ptr, g_ptr="*fp32", b_ptr=ptr,
                                                   do_ptr=ptr, cu_ptr="*i32", out_ptr="*fp32", scale="fp32",
                                                   Hg="i32", H="i32")),
        "_forward_states": (sm._forward_states, dict(k_ptr=ptr, v_ptr=ptr, a_ptr=ptr, g_ptr="*fp32", b_ptr=ptr,
                                                     cu_ptr="*i32", co_ptr="*i32", init_ptr="*fp32", h_ptr=ptr,
                                                     Hg="i32", H="i32")),
    }
    print(f"Triton {triton.__version__}, sm_90a, K={a.K} V={a.V} {a.dtype}")
    for cfg in a.configs.split("/"):
        bc, warps = (int(x) for x in cfg.split(","))
        for name, (fn, sig) in kernels.items():
            consts = dict(K=a.K, V=a.V, BT=64, BC=bc, **({"V_FIRST": False} if "h_ptr" in sig else {}))
            sig = {**sig, **{name: "constexpr" for name in consts}}
            src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
            kern = triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": warps, "num_stages": 1})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kern.asm["cubin"])
                f.flush()
                usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
            line = [x for x in usage.splitlines() if "REG:" in x][-1].split()
            fields = {k: v for k, v in (x.split(":", 1) for x in line if ":" in x)}
            print(f"{name} BC={bc} warps={warps}: registers {fields.get('REG')}, stack {fields.get('STACK')} B, "
                  f"shared {kern.metadata.shared} B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
