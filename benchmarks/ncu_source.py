"""Where one kernel's instructions and stall samples go, from Nsight Compute's source page (SASS).

    ncu --import REPORT.ncu-rep --page source --print-source sass --csv > SOURCE.csv
    python3 benchmarks/ncu_source.py SOURCE.csv --warps 512 [--top 20] [--json OUT]

``--warps``: the warps that ran the kernel (programs x warps per program; ncu's details page gives the grid and block
sizes). Each instruction's "Instructions Executed" divided by it is how many times one warp ran it: instructions run
n > 1 times form a loop body of n trips, those run once the straight-line part, fractions the parts only some programs
run (the merge of the last split, a masked tail tile). Per group the summary gives the instruction count, the
instructions per warp, the stall samples by reason and the opcode mix; then the most-sampled instructions.
docs/tuning/decode.md compares decode steps with cuDNN's kernel this way (2026-12-03)."""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

STALL_PREFIX = "stall_"
NOT_ISSUED = "(Not Issued)"


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction of the source page: its text, how many times all warps ran it, its warp-state samples
    and their split by stall reason (ncu's ``stall_*`` columns without the not-issued ones)."""

    sass: str
    executed: int
    samples: int
    stalls: dict[str, int]

    @property
    def opcode(self) -> str:
        """The opcode without predicate and modifiers: ``@!P3 BRA 0x..`` -> ``BRA``, ``HMMA.16816.F32`` -> ``HMMA``."""
        text = re.sub(r"^@!?U?P\w+\s+", "", self.sass.strip())
        return text.split()[0].split(".")[0] if text else "?"


def read_source(path: Path) -> list[Instruction]:
    """The instructions of a ``--page source --print-source sass --csv`` export (its first line names the kernel, the
    second holds the column names)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[1]
    sass, executed, samples = (header.index(name) for name in ("Source", "Instructions Executed",
                                                                 "Warp Stall Sampling (All Samples)"))  # fmt: skip
    stall_columns = [
        (i, name) for i, name in enumerate(header) if name.startswith(STALL_PREFIX) and NOT_ISSUED not in name
    ]
    instructions = []
    for row in rows[2:]:
        if len(row) <= max(sass, executed, samples):
            continue
        stalls = {name: int(row[i]) for i, name in stall_columns if row[i] and int(row[i])}
        instructions.append(Instruction(row[sass], int(row[executed] or 0), int(row[samples] or 0), stalls))
    return instructions


def group_by_runs(instructions: list[Instruction], warps: int) -> dict[float, dict]:
    """The instructions grouped by runs per warp (rounded to 1/100; never-run ones left out), each group's summary:
    instructions, instructions per warp, samples, stall samples by reason, opcode counts."""
    groups: dict[float, dict] = {}
    for ins in instructions:
        if ins.executed == 0:
            continue
        runs = round(ins.executed / warps, 2)
        group = groups.setdefault(runs, {"instructions": 0, "per_warp": 0.0, "samples": 0, "stalls": Counter(),
                                         "opcodes": Counter()})  # fmt: skip
        group["instructions"] += 1
        group["per_warp"] += runs
        group["samples"] += ins.samples
        group["stalls"].update(ins.stalls)
        group["opcodes"][ins.opcode] += 1
    return dict(sorted(groups.items(), key=lambda item: -item[1]["per_warp"]))


def stall_text(stalls: Counter | dict, most: int | None = None) -> str:
    """``stalls`` (reason -> samples) as "reason n, ...", largest first (the ``most`` largest, or all)."""
    ranked = sorted(stalls.items(), key=lambda item: -item[1])[:most]
    return ", ".join(f"{name.removeprefix(STALL_PREFIX)} {n}" for name, n in ranked)


def report(instructions: list[Instruction], groups: dict[float, dict], warps: int, top: int) -> str:
    """The ``groups`` of ``instructions`` (``group_by_runs``) and the ``top`` most-sampled instructions as text."""
    lines = []
    total = sum(ins.executed for ins in instructions) / warps
    lines.append(f"{total:.0f} instructions per warp, {sum(ins.samples for ins in instructions)} samples")
    for runs, group in groups.items():
        stalls = stall_text(group["stalls"], 6)
        opcodes = " ".join(f"{op} {n}" for op, n in group["opcodes"].most_common(12))
        lines.append(f"runs {runs:g}: {group['instructions']} instructions, {group['per_warp']:.0f} per warp, "
                     f"{group['samples']} samples ({stalls})\n    {opcodes}")  # fmt: skip
    lines.append(f"most-sampled {top}:")
    for ins in sorted(instructions, key=lambda ins: -ins.samples)[:top]:
        runs = ins.executed / warps
        lines.append(f"{ins.samples:6d}  x{runs:<6.2f} {ins.sass.strip()[:72]:72}  {stall_text(ins.stalls)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the source page exported as CSV")
    parser.add_argument("--warps", type=int, required=True, help="warps that ran the kernel (programs x warps each)")
    parser.add_argument("--top", type=int, default=20, help="most-sampled instructions to list (default 20)")
    parser.add_argument("--json", type=Path, default=None, help="also write the groups to this file")
    args = parser.parse_args(argv)
    if args.warps <= 0:
        parser.error(f"--warps must be positive, got {args.warps}")
    instructions = read_source(args.source)
    groups = group_by_runs(instructions, args.warps)
    print(report(instructions, groups, args.warps, args.top))
    if args.json:
        plain = {str(runs): dict(group, stalls=dict(group["stalls"]), opcodes=dict(group["opcodes"]))
                 for runs, group in groups.items()}  # fmt: skip
        args.json.write_text(json.dumps(plain, indent=1))


if __name__ == "__main__":
    main()
