"""Static SASS of a warp-specialised kernel, per role group: the report to read before a
device call (docs/kernels.md).

    python tools/sass_report.py                          # the backward, H = Hg = 2, bf16
    python tools/sass_report.py --builds default,timing  # beside its timing build
    python tools/sass_report.py --phases                 # per group and phase
    python tools/sass_report.py --kernel states          # the state kernel
    python tools/sass_report.py --H 16 --Hg 16 --opcodes 8 [--phases]   # instructions by class, top mnemonics
    python tools/sass_report.py --ptxas --builds default,timing          # did ptxas serialize the wgmmas?

Compiles each build on this machine (about a minute each with nvcc for sm_90a; no GPU needed),
then splits its SASS at the `USETMAXREG` instructions that open the role branches and counts
per group (each region runs to the next branch's opening, so it includes the group's epilogue): instructions, shared loads (LDS/LDSM), MUFU
(exp2), HGMMA, local-memory (spill) loads and stores, named barriers. A group issuing one
instruction per few cycles with one warp per scheduler tracks its instruction count (A's
instructions -20 % gave its cycles -28 %).
"""

from __future__ import annotations

import argparse
import re
import sys

#: Each kernel's role groups in source order, its register caps' module, and its builder.
KERNELS = {
    "ws": (("S", "KV", "A", "producer"), "gdr_dispatch.backends.kernels.tilelang_ws_bwd"),
    "states": (("S0", "S1", "X", "producer"), "gdr_dispatch.backends.kernels.tilelang_states"),
}
GROUPS = KERNELS["ws"][0]
COUNTS = {
    "instr": None,
    "LDS": re.compile(r"\bLDS(M)?\b"),
    "MUFU": re.compile(r"\bMUFU\b"),
    "HGMMA": re.compile(r"\bHGMMA\b"),
    "spill": re.compile(r"\b(LDL|STL)\b"),
    "BAR": re.compile(r"\bBAR\b|\bSYNCS\b"),
}


def _cuobjdump_on_path() -> None:
    """TileLang disassembles with nvdisasm or cuobjdump from PATH; Triton's wheel ships a
    cuobjdump (the CPU machines have nvcc but no disassembler)."""
    import os
    import shutil
    from pathlib import Path

    if shutil.which("cuobjdump") or shutil.which("nvdisasm"):
        return
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if (bin_dir / "cuobjdump").exists():
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def kernel_flags(kern) -> list[str]:
    """The nvcc flags a TileLang kernel's pass configs give (TileLang's own `_get_sass` drops
    `--use_fast_math`, and with it exp2's flush-to-zero form: four instructions an exponential
    instead of one)."""
    from tilelang.transform import PassConfigKey

    cfg = kern.pass_configs or {}
    flags = ["--use_fast_math"] if cfg.get(PassConfigKey.TL_ENABLE_FAST_MATH, False) else []
    level = cfg.get(PassConfigKey.TL_PTXAS_REGISTER_USAGE_LEVEL, None)
    if level is not None:
        flags.append(f"--ptxas-options=--register-usage-level={int(level)}")
    return flags


def kernel_sass(kern) -> str:
    """The SASS of a compiled TileLang kernel as it runs: its source compiled with `kernel_flags`."""
    from tilelang.contrib import nvcc as tl_nvcc

    _cuobjdump_on_path()
    with kern.target:
        return tl_nvcc.get_sass_from_source(kern.get_kernel_source(), compile_flags=kernel_flags(kern))


#: ptxas's numbered notes (`ptxas info : (C75xx) ...`) that change how the kernel runs: "...
#: wgmma.mma_async instructions are serialized due to ..." (several codes, one per cause, and the
#: numbers move between CUDA versions: every wgmma of the kernel then waits for the one before,
#: and the overlap of a group's gemms with its element-wise work is gone), and C7517, a
#: `warpgroup.wait` injected where a wgmma's registers are read.
PTXAS_NOTE = re.compile(r"\((C75\d\d)\)\s*(.*)")


def serialized(notes) -> bool:
    """Whether `ptxas_notes` says the kernel's wgmmas are serialized (by the note's words)."""
    return any("are serialized" in text for _, text in notes)


def ptxas_notes(kern) -> list[tuple[str, str]]:
    """ptxas's numbered notes `(code, text)` for the kernel compiled as `kernel_sass` compiles it
    (`-Xptxas -v`; TileLang logs the compiler's output, captured here)."""
    import logging

    from tilelang.contrib import nvcc as tl_nvcc

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = tl_nvcc.logger
    kept = (log.handlers[:], log.level, log.propagate)
    log.handlers[:], log.propagate = [Keep(logging.INFO)], False  # the compiler's output here only
    log.setLevel(logging.INFO)
    try:
        with kern.target:
            tl_nvcc.compile_cuda(kern.get_kernel_source(), target_format="cubin", verbose=True,
                                 options=tl_nvcc.default_compile_options(kernel_flags(kern) + ["-Xptxas", "-v"]))
    finally:
        log.handlers[:], log.propagate = kept[0], kept[2]
        log.setLevel(kept[1])
    lines = [line for text in seen for line in text.splitlines()]
    if not any(re.search(r"ptxas info\s*: Used \d+ registers", line) for line in lines):
        raise RuntimeError("ptxas_notes: no ptxas report in TileLang's log (its compile_cuda no longer logs "
                           "the compiler's output?): no notes is not no serialization")
    return [m.groups() for line in lines if (m := PTXAS_NOTE.search(line))]


def build_of(build: str, H: int, Hg: int, dtype: str, kernel: str = "ws"):
    """The compiled kernel a `--builds` word names."""
    if kernel == "states":
        if build not in ("default", "timing"):
            raise ValueError(f"--builds: default or timing for {kernel}, got {build!r}")
        from gdr_dispatch.backends.kernels.tilelang_states import build_states

        return build_states(H, Hg, dtype, False, timing=build == "timing")
    from gdr_dispatch.backends.kernels.tilelang_ws_bwd import build_keywords, build_ws_bwd

    return build_ws_bwd(H, Hg, 128 ** -0.5, dtype, dtype, **build_keywords(build))


def sass_of(build: str, H: int, Hg: int, dtype: str, kernel: str = "ws") -> str:
    return kernel_sass(build_of(build, H, Hg, dtype, kernel))


def read_build(build: str, args) -> tuple:
    """A `--builds` word's SASS and the register caps its groups are named by (`caps_of`)."""
    return (sass_of(build, args.H, args.Hg, args.dtype, args.kernel),
            caps_of(build, args.kernel, args.dtype))


def caps_of(build: str, kernel: str = "ws", dtype: str = "bfloat16"):
    """The register caps a `--builds` word's kernel is built with (None: the module's NREG)."""
    if kernel != "ws":
        return None
    from gdr_dispatch.backends.kernels.tilelang_ws_bwd import build_keywords, nreg_of

    return nreg_of(build_keywords(build)["hoist"], dtype)


def label_regions(caps: list[int], kernel: str = "ws", nreg=None) -> list[str]:
    """Role of each branch, in SASS order: nvcc lays the branches out in reverse source order
    (producer first). Their register caps must be the build's (`nreg`, else the kernel module's
    NREG) in that order: the default's and "kvregs"' caps are the same four numbers in another
    order, so caps alone cannot name the groups, and a wrong set is refused, not mislabelled."""
    import importlib

    groups, module = KERNELS[kernel]
    NREG = tuple(nreg or importlib.import_module(module).NREG)
    if tuple(caps) != NREG[::-1]:
        raise SystemExit(f"the branches' register caps {tuple(caps)} (SASS order) are not the build's "
                         f"{NREG} in reverse source order: another build's caps?")
    return list(groups[::-1])


def role_regions(sass: str, kernel: str = "ws", nreg=None) -> tuple[list[tuple[str, list[str]]], int]:
    """The SASS instruction lines of each role branch, in GROUPS order, and the count before the
    first branch (the prologue). A branch opens at its `USETMAXREG` and runs to the next one's,
    so it includes the group's epilogue."""
    lines = [l for l in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", l)]
    starts = [i for i, l in enumerate(lines) if "USETMAXREG" in l]
    groups = KERNELS[kernel][0]
    if len(starts) != len(groups):
        raise SystemExit(f"expected {len(groups)} USETMAXREG instructions (one per role), found {len(starts)}")
    caps = [int(re.search(r"0x([0-9a-f]+)", lines[i].split("USETMAXREG", 1)[1]).group(1), 16) for i in starts]
    bounds = starts + [len(lines)]
    regions = sorted(zip(label_regions(caps, kernel, nreg), bounds, bounds[1:]), key=lambda r: groups.index(r[0]))
    return [(g, lines[lo:hi]) for g, lo, hi in regions], starts[0]


def per_group(sass: str, kernel: str = "ws", nreg=None) -> dict:
    regions, prologue = role_regions(sass, kernel, nreg)
    out = {g: {name: (len(body) if pat is None else sum(bool(pat.search(l)) for l in body))
               for name, pat in COUNTS.items()}
           for g, body in regions}
    out["prologue"] = {"instr": prologue}
    return out


def per_phase(sass: str, kernel: str = "ws", nreg=None) -> dict:
    """Each consumer group's SASS cut at its mbarrier arrivals (`SYNCS.ARRIVE`: the producer's
    `full` is waited on, the phase barriers are arrived at), so segment k runs from one arrival to
    the next: instructions / spill instructions / named barriers (`BAR.SYNC`, the group's own
    128-thread syncs): TileLang can put one before every store of an unrolled loop, which this
    shows as a phase with dozens of them."""
    return {g: [(len(seg), sum(bool(COUNTS["spill"].search(l)) for l in seg), sum("BAR.SYNC" in l for l in seg))
                for seg in phase_segments(body)]
            for g, body in role_regions(sass, kernel, nreg)[0] if g != "producer"}


def phase_segments(body: list[str]) -> list[list[str]]:
    """A consumer group's SASS lines cut before each mbarrier arrival (`SYNCS.ARRIVE`)."""
    cuts = [i for i, l in enumerate(body) if "SYNCS.ARRIVE" in l]
    return [body[lo:hi] for lo, hi in zip([0] + cuts, cuts + [len(body)])]


#: Instruction classes for `--opcodes`, by the mnemonic's base (before the first '.'): what each
#: element-wise cut the fused kernel weighs would remove (docs/kernels.md, the next decomposition).
CLASSES = {
    "gemm": {"HGMMA", "WARPGROUP"},
    "fp32": {"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK", "FRND", "FSWZADD"},
    "16-bit math": {"HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2"},
    "conversion": {"F2F", "F2FP", "F2I", "I2F", "I2FP", "F2IP"},
    "exp2": {"MUFU"},
    "shared": {"LDS", "STS", "LDSM", "STSM", "ATOMS"},
    "global/TMA": {"LDG", "STG", "UTMALDG", "UTMASTG", "UBLKCP", "LDGSTS", "UTMACMDFLUSH", "UTMAPF"},
    "spill": {"LDL", "STL"},
    "shuffle": {"SHFL"},
    "sync": {"BAR", "SYNCS", "MEMBAR", "FENCE", "DEPBAR", "ERRBAR", "CCTL", "WARPSYNC"},
    "integer/address": {"IMAD", "IADD3", "LEA", "LOP3", "SHF", "ISETP", "IABS", "IMNMX", "SGXT", "POPC",
                        "FLO", "BMSK", "IDP", "VIADD", "VIMNMX", "PRMT"},
    "moves/predicates": {"MOV", "SEL", "PLOP3", "P2R", "R2P", "S2R", "S2UR", "CS2R", "R2UR", "UMOV", "ELECT", "VOTE",
                         "VOTEU", "NOP"},
}


def opcode_counts(body: list[str]) -> dict:
    """The instruction lines' mnemonic bases (predicates and modifiers dropped), counted."""
    counts: dict = {}
    for line in body:
        text = line.split("*/", 1)[1].strip() if "*/" in line else line.strip()
        text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
        op = text.split()[0].split(".")[0] if text else ""
        counts[op] = counts.get(op, 0) + 1
    return counts


def classify(counts: dict) -> dict:
    """`opcode_counts` summed by `CLASSES` (uniform-datapath forms `U...` with their base; the
    rest under "other")."""
    out = {c: 0 for c in CLASSES}
    out["other"] = 0
    for op, n in counts.items():
        base = op[1:] if op.startswith("U") else op
        cls = next((c for c, ops in CLASSES.items() if op in ops or base in ops), "other")
        out[cls] += n
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=sorted(KERNELS), default="ws",
                   help="ws: the backward (tilelang_ws_bwd.py); states: the state kernel (tilelang_states.py)")
    p.add_argument("--builds", default="default",
                   help="comma-separated builds, each words joined by '-': default, timing (with cycle counters), "
                        "a mode of tilelang_ws_bwd.MODES (reconly, nowait), a form as tools/ws_probe.py spells "
                        "it (warp+gam): timing-reconly, timing-warp, transpose+gam+row")
    p.add_argument("--H", type=int, default=2)
    p.add_argument("--Hg", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--phases", action="store_true",
                   help="per consumer group, the SASS between consecutive mbarrier arrivals (its phases): "
                        "instructions/spills/named barriers")
    p.add_argument("--opcodes", type=int, default=0, metavar="N",
                   help="per group, the instructions by class (CLASSES) and the N most frequent mnemonics")
    p.add_argument("--ptxas", action="store_true",
                   help="per build, ptxas's numbered notes (PTXAS_NOTE): above all whether it serialized the "
                        "kernel's wgmma instructions")
    args = p.parse_args(argv)
    if args.ptxas:
        for build in args.builds.split(","):
            notes = ptxas_notes(build_of(build, args.H, args.Hg, args.dtype, args.kernel))
            print(f"{build} | wgmma {'SERIALIZED' if serialized(notes) else 'pipelined'} | "
                  + "; ".join(f"{code} {text}" for code, text in notes), flush=True)
        return 0
    if args.opcodes:  # with --phases, per segment between a consumer group's mbarrier arrivals
        for build in args.builds.split(","):
            sass, caps = read_build(build, args)
            for g, body in role_regions(sass, args.kernel, caps)[0]:
                segs = phase_segments(body) if args.phases and g != "producer" else [body]
                for k, seg in enumerate(segs):
                    counts = opcode_counts(seg)
                    top = sorted(counts.items(), key=lambda kv: -kv[1])[:args.opcodes]
                    where = f"{g} {k}" if len(segs) > 1 else g
                    print(f"{build} | {where} | {len(seg)} | " + ", ".join(f"{c} {n}" for c, n in classify(counts).items() if n)
                          + " | " + ", ".join(f"{op} {n}" for op, n in top), flush=True)
        return 0
    if args.phases:
        for build in args.builds.split(","):
            sass, caps = read_build(build, args)
            for g, segs in per_phase(sass, args.kernel, caps).items():
                print(f"{build} | {g} | " + "  ".join(f"{n}/{sp}/{b}" for n, sp, b in segs), flush=True)
        return 0
    print("build | group | " + " | ".join(COUNTS))
    for build in args.builds.split(","):
        sass, caps = read_build(build, args)
        for g, c in per_group(sass, args.kernel, caps).items():
            if g != "prologue":
                print(f"{build} | {g} | " + " | ".join(str(c[n]) for n in COUNTS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
