"""The compiler's resource report of our Triton kernels (backends/kernels/segment_maps.py, segment_scan.py) for
sm_90a, without a GPU:
registers, spill stack and shared memory per kernel and launch configuration (read it before a
device call; docs/kernels.md, "The split").

    python tools/triton_report.py                              # segment_maps' kernels, K = V = 128
    python tools/triton_report.py --configs 32,8/64,8/16,8     # BC,WARPS pairs
    python tools/triton_report.py --only 'segment_scan'       # the kernels whose name matches
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
    p.add_argument("--configs", default="64,4",
                   help="'BC,WARPS[,STAGES]' of the maps' kernels (stages default 1), '/'-separated")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--triton", default=None, help="a folder holding another Triton package, put first on sys.path")
    p.add_argument("--only", default=None, metavar="REGEX", help="only the kernels whose name matches")
    p.add_argument("--maxnreg", type=int, default=None, help="a register cap for every kernel (the compiler's choice without)")
    p.add_argument("--asm", default=None, metavar="DIR", help="also write each kernel's TTGIR and PTX there")
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
    from gdr_dispatch.backends.kernels import segment_scan as ss

    ptr = f"*{a.dtype}"
    i32, f32 = "*i32", "*fp32"
    tok = dict(k_ptr=ptr, v_ptr=ptr, a_ptr=ptr, g_ptr=f32, b_ptr=ptr, cu_ptr=i32)
    fwd = dict(**tok, m_ptr=f32, r_ptr=f32, plan_ptr=i32, role_ptr=i32, w_ptr=ptr, u_ptr=ptr,
               co_ptr="*i64", Hg="i32", H="i32")
    bwd = dict(q_ptr=ptr, k_ptr=ptr, a_ptr=ptr, g_ptr=f32, b_ptr=ptr, do_ptr=ptr, cu_ptr=i32, out_ptr=f32,
               plan_ptr=i32, role_ptr=i32, w_ptr=ptr, x_ptr=ptr, co_ptr="*i64", scale="fp32", Hg="i32",
               H="i32")
    factors = dict(q_ptr=ptr, k_ptr=ptr, v_ptr=ptr, a_ptr=ptr, g_ptr=f32, b_ptr=ptr, cu_ptr=i32, ci_ptr=i32,
                   plan_ptr=i32, role_ptr=i32, w_ptr=ptr, u_ptr=ptr, x_ptr=ptr, kd_ptr=ptr, scale="fp32", Hg="i32",
                   H="i32")
    def desc(rows, cols):
        return f"tensordesc<{a.dtype}[{rows}, {cols}]>"

    tma_fwd = dict(w_desc=desc(64, a.K), kd_desc=desc(64, a.K), ut_desc=desc(min(sm.BC, a.K, a.V), 64), g_ptr=f32,
                   cu_ptr=i32, m_ptr=f32, r_ptr=f32, plan_ptr=i32, role_ptr=i32, co_ptr="*i64", Hg="i32", H="i32")
    tma_bwd = dict(kd_desc=desc(64, a.K), w_desc=desc(64, a.K), x_desc=desc(64, a.K), do_ptr=ptr, g_ptr=f32,
                   cu_ptr=i32, out_ptr=f32, plan_ptr=i32, role_ptr=i32, co_ptr="*i64", Hg="i32", H="i32")
    tma_chain = dict(m_desc=f"tensordesc<fp32[{a.K}, {a.K}]>", STARTS=f32, ENDS=f32, PLAN=i32, SEG_OFF=i32, S0=f32,
                     G_END=f32, S="i32", H="i32")
    states = dict(**tok, co_ptr=i32, init_ptr=f32, h_ptr=ptr, Hg="i32", H="i32")
    plan = dict(k_ptr=ptr, g_ptr=f32, b_ptr=ptr, cu_ptr=i32, role_ptr=i32, plan_ptr=i32, flag_ptr=i32,
                threshold="fp32", cap="i32", Hg="i32",
                H="i32")
    chain = dict(M=f32, STARTS=f32, ENDS=f32, PLAN=i32, SEG_OFF=i32, S0=f32, G_END=f32, H="i32")
    blocked = dict(M=f32, STARTS=f32, ENDS=f32, PLAN=i32, SEG_OFF=i32, Q=f32, D=f32, NZ=i32, s="i32", S="i32",
                   NH="i32", H="i32")
    groups = {k: v for k, v in blocked.items() if k != "M"}
    groups.update(S0=f32, G_END=f32)
    fill = dict(M=f32, STARTS=f32, ENDS=f32, PLAN=i32, SEG_OFF=i32, s="i32", NH="i32", H="i32")
    listed = dict(list_ptr=i32, count_ptr=i32)
    fpieces = dict(**tok, **listed, pm_ptr=f32, pr_ptr=f32, Hg="i32", H="i32")
    bpieces = dict(q_ptr=ptr, k_ptr=ptr, a_ptr=ptr, g_ptr=f32, b_ptr=ptr, do_ptr=ptr, cu_ptr=i32, **listed,
                   pd_ptr=f32, scale="fp32", Hg="i32", H="i32")
    fcompose = dict(**listed, role_ptr=i32, pm_ptr=f32, pr_ptr=f32, m_ptr=f32, r_ptr=f32, H="i32")
    bcompose = dict(**listed, role_ptr=i32, pm_ptr=f32, pd_ptr=f32, out_ptr=f32, H="i32")
    compact = dict(plan_ptr=i32, role_ptr=i32, list_ptr=i32, count_ptr=i32, n_pairs="i32", H="i32")
    cb, P = sm.COMPOSE_CB, 4  # the pieces kernels as they build with 4 pieces (sm.PIECES may be 1: off)
    maps = dict(K=a.K, V=a.V, BT=64)
    print(f"Triton {triton.__version__}, sm_90a, K={a.K} V={a.V} {a.dtype}")
    done = set()
    for cfg in a.configs.split("/"):
        bc, warps, stages = ([int(x) for x in cfg.split(",")] + [1])[:3]
        kernels = {  # name: (kernel, signature, constexprs, warps, stages)
            "_forward_maps": (sm._forward_maps, fwd, dict(**maps, BC=bc, PLAN=False, SKIP_EXACT=0, FACTORED=0), warps, stages),
            "_forward_maps PLAN": (sm._forward_maps, fwd, dict(**maps, BC=bc, PLAN=True, SKIP_EXACT=0, FACTORED=0), warps, stages),
            "_backward_maps": (sm._backward_maps, bwd, dict(**maps, BC=bc, PLAN=False, SKIP_EXACT=0, FACTORED=0, CROSS=sm.CROSS), warps, stages),
            "_backward_maps PLAN": (sm._backward_maps, bwd, dict(**maps, BC=bc, PLAN=True, SKIP_EXACT=0, FACTORED=0, CROSS=sm.CROSS), warps, stages),
            "_forward_maps PLAN FACTORED": (sm._forward_maps, fwd, dict(**maps, BC=bc, PLAN=True, SKIP_EXACT=0,
                                                                         FACTORED=1), warps, stages),
            "_backward_maps PLAN FACTORED": (sm._backward_maps, bwd, dict(**maps, BC=bc, PLAN=True, SKIP_EXACT=0,
                                                                          FACTORED=1, CROSS=sm.CROSS), warps, stages),
            "_factors": (sm._factors, factors, dict(**maps, PLAN=True, NEED_R=1, NEED_D=1, TMA=0, CROSS=sm.CROSS), sm.FACTOR_WARPS, 1),
            "_factors TMA": (sm._factors, factors, dict(**maps, PLAN=True, NEED_R=1, NEED_D=1, TMA=1, CROSS=sm.CROSS),
                             sm.FACTOR_WARPS, 1),
            "_tma_forward_maps": (sm._tma_forward_maps, tma_fwd, dict(**maps, BC=bc, PLAN=True, NEED_R=1,
                                                                      STAGES=sm.TMA_STAGES), warps, 1),
            "_tma_backward_maps": (sm._tma_backward_maps, tma_bwd, dict(**maps, BC=bc, PLAN=True,
                                                                        STAGES=sm.TMA_STAGES, CROSS=sm.CROSS), warps, 1),
            "_forward_states": (sm._forward_states, states, dict(**maps, BC=bc, V_FIRST=False), warps, stages),
            "_decay_plan": (sm._decay_plan, plan, dict(K=a.K, BT=64, CMAX=64, CROSS=sm.CROSS), 4, 1),
            "_plan_combine": (sm._plan_combine, dict(plan_ptr=i32, flag_ptr=i32, seg_off_ptr=i32, H="i32", P="i32"),
                              dict(NSEG=64, PB=16), 1, 1),
            "_forward_maps PLAN SKIP_EXACT": (sm._forward_maps, fwd, dict(**maps, BC=bc, PLAN=True, SKIP_EXACT=1, FACTORED=0),
                                              warps, stages),
            "_backward_maps PLAN SKIP_EXACT": (sm._backward_maps, bwd, dict(**maps, BC=bc, PLAN=True, SKIP_EXACT=1, FACTORED=0, CROSS=sm.CROSS),
                                               warps, stages),
            "_forward_pieces": (sm._forward_pieces, fpieces, dict(**maps, BC=bc, P=P, NCOL=(a.K + a.V) // bc),
                                warps, stages),
            "_backward_pieces": (sm._backward_pieces, bpieces, dict(**maps, BC=bc, P=P, NCOL=a.V // bc), warps, stages),
            "_compose_forward": (sm._compose_forward, fcompose, dict(K=a.K, V=a.V, P=P, CB=cb,
                                                                     NCOL=(a.K + a.V) // cb),
                                 sm.COMPOSE_WARPS, sm.COMPOSE_STAGES),
            "_compose_backward": (sm._compose_backward, bcompose, dict(K=a.K, V=a.V, P=P, CB=cb, NCOL=a.V // cb),
                                  sm.COMPOSE_WARPS, sm.COMPOSE_STAGES),
            "_compact": (sm._compact, compact, dict(BLOCK=1024), 4, 1),
            "segment_scan._chain": (ss._chain, chain, dict(K=a.K, V=a.V, BV=ss.BV, NSEG=64, HAS_S0=True,
                                                          HAS_G_END=True, FIRST_DIRECTION=0, PREFETCH=0),
                                    ss.NUM_WARPS, ss.NUM_STAGES),
            "segment_scan._chain PREFETCH": (ss._chain, chain, dict(K=a.K, V=a.V, BV=ss.BV, NSEG=64, HAS_S0=True,
                                                                   HAS_G_END=True, FIRST_DIRECTION=0, PREFETCH=1),
                                             ss.NUM_WARPS, ss.NUM_STAGES),
            "segment_scan._tma_chain": (ss._tma_chain, tma_chain, dict(K=a.K, V=a.V, BV=min(ss.TMA_CHAIN_BV, a.V),
                                                                         NSEG=64, HAS_S0=True, HAS_G_END=True,
                                                                         FIRST_DIRECTION=0, STAGES=ss.TMA_CHAIN_STAGES),
                                        ss.TMA_CHAIN_WARPS, 1),
            "segment_scan._blocked_compose": (ss._blocked_compose, blocked, dict(K=a.K, V=a.V, BC=ss.BV, FIRST_DIRECTION=0),
                                              ss.NUM_WARPS, ss.NUM_STAGES),
            "segment_scan._blocked_groups": (ss._blocked_groups, groups, dict(K=a.K, V=a.V, BV=ss.BV, HAS_S0=True,
                                                                            HAS_G_END=True, FIRST_DIRECTION=0),
                                             ss.NUM_WARPS, ss.NUM_STAGES),
            "segment_scan._blocked_fill": (ss._blocked_fill, fill, dict(K=a.K, V=a.V, BV=ss.BV, FIRST_DIRECTION=0),
                                           ss.NUM_WARPS, ss.NUM_STAGES),
        }
        if a.only:
            import re

            kernels = {k: v for k, v in kernels.items() if re.search(a.only, k)}
        for name, (fn, sig, consts, nw, ns) in kernels.items():
            built = (name, nw, ns, tuple(sorted(consts.items())))
            if built in done:  # a kernel whose options do not follow --configs: once
                continue
            done.add(built)
            sig = {**sig, **{c: "constexpr" for c in consts}}
            src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
            kern = triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": nw, "num_stages": ns,
                                                                               **({"maxnreg": a.maxnreg} if a.maxnreg else {})})
            if a.asm:
                Path(a.asm).mkdir(parents=True, exist_ok=True)
                for ext in ("ttgir", "ptx"):
                    (Path(a.asm) / f"{name.replace(' ', '_')}.w{nw}.{ext}").write_text(kern.asm[ext])
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kern.asm["cubin"])
                f.flush()
                usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
            line = [x for x in usage.splitlines() if "REG:" in x][-1].split()
            fields = {k: v for k, v in (x.split(":", 1) for x in line if ":" in x)}
            cols = consts.get("BC", consts.get("BV", consts.get("CB", "-")))
            print(f"{name} BC={cols} warps={nw} stages={ns}: registers {fields.get('REG')}, stack {fields.get('STACK')} B, "
                  f"shared {kern.metadata.shared} B", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
