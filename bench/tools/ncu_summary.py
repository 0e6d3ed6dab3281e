"""Summarize an Nsight Compute report's raw and source pages (bench/tools/ncu_epilogue.sh): each warp
stall reason's share of the sampled stalls, the SASS instructions with the most samples, and
the samples by opcode, where a predicated branch right after an mbarrier try-wait counts as
the wait on that barrier (the spin loop a warp sits in while it waits; in a gluon-hopper kernel
the barrier's shared-memory offset tells which one: the rings' ready/empty, turn, eturn).

    python3 bench/tools/ncu_summary.py RAW_CSV [SOURCE_CSV]

RAW_CSV is `ncu --import R --page raw --csv`: a header row of metric names, a row of units, then
one row per profiled kernel. SOURCE_CSV is `ncu --import R --page source --csv --print-source sass`:
one row per SASS instruction, with sampling columns. Both are read tolerantly (columns found by
name), since their layout varies across ncu versions; what cannot be found is said, not guessed.
"""

from __future__ import annotations

import csv
import re
import sys

STALL = re.compile(r"smsp__pcsamp_warps_issue_stalled_(\w+?)(?:_not_issued)?$")


def stall_shares(rows: list[list[str]]) -> list[tuple[str, float]]:
    """(reason, share of all stall samples) per stall reason, largest first, from a raw page."""
    header, data = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]
    if not data:
        return []
    counts: dict[str, float] = {}
    for i, name in enumerate(header):
        m = STALL.match(name)
        if m and not name.endswith("_not_issued"):
            try:
                counts[m.group(1)] = counts.get(m.group(1), 0.0) + float(data[-1][i].replace(",", ""))
            except ValueError:
                continue
    total = sum(counts.values())
    return sorted(((k, v / total) for k, v in counts.items() if v), key=lambda kv: -kv[1]) if total else []


def sampled_instructions(rows: list[list[str]]) -> list[tuple[str, float]]:
    """(SASS text, stall samples) of every instruction of a source page, in program order."""
    header = next((r for r in rows if any("Source" == c or "# Address" in c for c in r)), None)
    if header is None:
        return []
    src = next((i for i, c in enumerate(header) if c == "Source"), None)
    samp = next((i for i, c in enumerate(header) if "Warp Stall Sampling (All" in c), None)
    if src is None or samp is None:
        return []
    out = []
    for r in rows[rows.index(header) + 1:]:
        if len(r) > max(src, samp):
            try:
                out.append((r[src].strip(), float(r[samp].replace(",", "") or 0)))
            except ValueError:
                continue
    return out


def hot_instructions(rows: list[list[str]], top: int = 15) -> list[tuple[str, float]]:
    """(SASS text, stall samples) of the instructions with the most samples, from a source page."""
    return sorted(sampled_instructions(rows), key=lambda kv: -kv[1])[:top]


WAIT = re.compile(r"SYNCS\.PHASECHK\S*TRYWAIT\s+\S+,\s*\[([^\]]+)\]")


def by_opcode(rows: list[list[str]], top: int = 12) -> list[tuple[str, float]]:
    """(opcode, stall samples) summed over a source page, largest first; a predicated BRA that
    follows an mbarrier try-wait is 'wait [address]' of that barrier."""
    counts: dict[str, float] = {}
    previous = ""
    for text, n in sampled_instructions(rows):
        words = text.split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
        wait = WAIT.search(previous)
        key = f"wait [{wait.group(1)}]" if op == "BRA" and words[0].startswith("@") and wait else op.split(".")[0]
        counts[key] = counts.get(key, 0.0) + n
        previous = text
    return sorted(((k, v) for k, v in counts.items() if v), key=lambda kv: -kv[1])[:top]


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    with open(sys.argv[1], newline="") as f:
        shares = stall_shares(list(csv.reader(f)))
    print("stall reasons (share of sampled stalls):" if shares else "stall reasons: no pcsamp stall metrics in the raw page")
    for reason, share in shares[:12]:
        print(f"  {reason:32s} {share:6.1%}")
    if len(sys.argv) > 2:
        with open(sys.argv[2], newline="") as f:
            source = list(csv.reader(f))
        hot = hot_instructions(source)
        print("hottest SASS (stall samples):" if hot else "hottest SASS: no source page with sampling columns")
        for text, n in hot:
            print(f"  {n:8.0f}  {text}")
        ops = by_opcode(source)
        total = sum(n for _, n in sampled_instructions(source)) or 1.0
        if ops:
            print("stall samples by opcode (a spin on an mbarrier as 'wait [its address]'):")
        for key, n in ops:
            print(f"  {n:8.0f} {n / total:6.1%}  {key}")


if __name__ == "__main__":
    main()
