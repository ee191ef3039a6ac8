"""Warp-state samples of the warp-specialised kernel, per role group and per SASS line: where
each group's cycles go (docs/kernels.md, "Where the time goes").

    python tools/ncu_groups.py ncu-ws-source.csv         # from device_run.sh's ncu step
    python tools/ncu_groups.py ncu-ws-source.csv --top 60 --group A

The input is Nsight Compute's source page of one launch as CSV, SASS view
(`ncu -i REPORT --page source --csv --print-source sass`). Rows are split into the role groups
at the `USETMAXREG` instructions that open the branches, as tools/sass_report.py does, and
every numeric column whose name speaks of stalls or samples is summed per group. The column
names differ between Nsight Compute versions, so they are found by words, not fixed: the
first run prints the header it found.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_report import GROUPS, label_regions  # noqa: E402


def number(cell: str) -> float | None:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return None


#: nvcc lays the role branches out in reverse source order; FlashQLA's kernel has the same four
#: roles in the same source order (its S-like, dk/dv and dA/dq groups, then the producer).
NVCC_ORDER = ("producer", "A", "KV", "S")
#: SASS opcodes of an mbarrier polling loop (a try-wait, then a branch back or a sleep): samples
#: there are waiting, not work.
POLL_OPS = ("BRA", "NANOSLEEP")


def group_profile(rows: list, head: list, warps_steps: float) -> dict:
    """Per role group (positionally, NVCC_ORDER): instructions executed per warp and chunk step,
    samples split into polling (waiting at an mbarrier) and working, and the working samples per
    stall reason. `warps_steps`: CTAs x chunk steps x 4 warps per group."""
    src = head.index("Source")
    inst = head.index("Instructions Executed")
    samp = head.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
    starts = [i for i, r in enumerate(rows) if "USETMAXREG" in r[src]]
    out = {}
    for g, lo, hi in zip(NVCC_ORDER, starts, starts[1:] + [len(rows)]):
        p = {"instructions": 0.0, "polling": 0.0, "working": 0.0, "reasons": {}}
        for r in rows[lo:hi]:
            words = r[src].split()
            op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else ""))
            p["instructions"] += (number(r[inst]) or 0.0) / warps_steps
            n = number(r[samp]) or 0.0
            if op.split(".")[0] in POLL_OPS:
                p["polling"] += n
                continue
            p["working"] += n
            for i in reasons:
                p["reasons"][head[i][6:]] = p["reasons"].get(head[i][6:], 0.0) + (number(r[i]) or 0.0)
        out[g] = p
    return out


def compare(ours: tuple[list, list], peer: Path, warps_steps: float) -> None:
    """Ours (`_rows` of our page, already read) beside a peer's kernel (FlashQLA's), group by
    group (docs/kernels.md: A's working samples are 1.37x its counterpart's)."""
    profiles = [group_profile(*ours, warps_steps), group_profile(*_rows(peer), warps_steps)]
    print("\ngroup | instructions per warp and step (ours / peer) | working samples | polling samples | "
          "top working stall reasons (ours / peer)")
    for g in NVCC_ORDER:
        a, b = profiles[0][g], profiles[1][g]
        top = sorted(set(a["reasons"]) | set(b["reasons"]),
                     key=lambda k: -(a["reasons"].get(k, 0) + b["reasons"].get(k, 0)))[:6]
        print(f"{g} | {a['instructions']:.0f} / {b['instructions']:.0f} | {a['working']:.0f} / {b['working']:.0f} | "
              f"{a['polling']:.0f} / {b['polling']:.0f} | "
              + ", ".join(f"{k} {a['reasons'].get(k, 0):.0f} / {b['reasons'].get(k, 0):.0f}" for k in top))


def _rows(path: Path) -> tuple[list, list]:
    """A source page's SASS rows and its header (the first row with a 'Source' column)."""
    rows = list(csv.reader(Path(path).read_text(errors="replace").splitlines()))
    i = next((i for i, r in enumerate(rows) if any("Source" in c for c in r)), None)
    if i is None:
        raise ValueError(f"{path}: no header with a 'Source' column; first lines: {rows[:3]}")
    return [r for r in rows[i + 1:] if len(r) == len(rows[i])], rows[i]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--group", default="A", help="the group whose hottest lines are listed")
    p.add_argument("--caps", type=lambda s: tuple(int(c) for c in s.split(",")), default=None,
                   help="the profiled build's register caps S,KV,A,producer (default tilelang_ws_bwd.NREG; "
                        "a \"kvregs\" build: tilelang_ws_bwd.NREG_KVREGS)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--peer", help="a peer kernel's source page (ncu-flashqla-source.csv): compared group by group")
    p.add_argument("--warps-steps", type=float, default=64 * 64 * 4,
                   help="CTAs x chunk steps x 4 warps, for per-warp-and-step counts (default: B4 T4096 H16)")
    args = p.parse_args(argv)
    try:
        body, head = _rows(Path(args.csv))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    src = next(i for i, c in enumerate(head) if "Source" in c)
    stats = [i for i, c in enumerate(head) if re.search(r"stall|sampl", c, re.I)]
    print("columns found:", [head[i] for i in stats])
    if not stats:
        print("no stall/sample columns: header was", head, file=sys.stderr)
        return 2
    starts = [i for i, r in enumerate(body) if "USETMAXREG" in r[src]]
    if len(starts) != len(GROUPS):
        print(f"expected {len(GROUPS)} USETMAXREG lines, found {len(starts)}", file=sys.stderr)
        return 2
    caps = [int(re.search(r"0x([0-9a-f]+)", body[i][src].split("USETMAXREG", 1)[1]).group(1), 16) for i in starts]
    bounds = starts + [len(body)]
    region = {}
    for g, lo, hi in zip(label_regions(caps, nreg=args.caps), bounds, bounds[1:]):
        region[g] = (lo, hi)
    region["prologue"] = (0, starts[0])
    main_col = stats[0]
    print(f"\nper group, sum of each column ({len(body)} SASS lines)")
    print("group | " + " | ".join(head[i] for i in stats))
    for g in ("prologue",) + GROUPS:
        lo, hi = region[g]
        sums = [sum(number(r[i]) or 0.0 for r in body[lo:hi]) for i in stats]
        print(f"{g} | " + " | ".join(f"{s:.0f}" for s in sums))
    lo, hi = region[args.group]
    hot = sorted(range(lo, hi), key=lambda i: -(number(body[i][main_col]) or 0.0))[:args.top]
    print(f"\ngroup {args.group}: the {args.top} lines with most '{head[main_col]}' (line index in the group, SASS, "
          "then the nonzero stall columns)")
    for i in sorted(hot):
        cells = {head[c]: body[i][c] for c in stats[1:] if (number(body[i][c]) or 0) > 0}
        print(f"{i - lo:5d} {number(body[i][main_col]) or 0:8.0f}  {body[i][src].strip()[:70]:<70} {cells}")
    if args.peer:
        compare((body, head), Path(args.peer), args.warps_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
