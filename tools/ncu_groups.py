"""Warp-state samples of the warp-specialised kernel, per role group and per SASS line: the
reading of docs/tilelang_ws.md's "Next" 1 (where group A's cycles go).

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
from sass_report import GROUPS, caps_of, label_regions  # noqa: E402


def number(cell: str) -> float | None:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--group", default="A", help="the group whose hottest lines are listed")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--build", default="default", help="the ws build profiled (its register caps label the groups)")
    args = p.parse_args(argv)
    rows = list(csv.reader(Path(args.csv).read_text(errors="replace").splitlines()))
    head_i = next((i for i, r in enumerate(rows) if any("Source" in c for c in r)), None)
    if head_i is None:
        print(f"{args.csv}: no header with a 'Source' column; first lines: {rows[:3]}", file=sys.stderr)
        return 2
    head, body = rows[head_i], [r for r in rows[head_i + 1:] if len(r) == len(rows[head_i])]
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
    for g, lo, hi in zip(label_regions(caps, caps_of(args.build)), bounds, bounds[1:]):
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
