"""benchmarks/ncu_source.py on a made-up source page: instructions grouped by runs per warp, stall samples summed."""

import json

import ncu_source  # benchmarks/, on the path from conftest

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
          "stall_long_sb", "stall_long_sb (Not Issued)", "Predicated-On Thread Instructions Executed"]  # fmt: skip
ROWS = [
    ["0x10", "      LDC R1, c[0x0][0x28]", "3", "8", "0", "2", "2", "256"],  # once per warp (8 warps)
    ["0x20", "      HMMA.16816.F32.BF16 R52, R44, R32, R56", "10", "128", "1", "4", "4", "4096"],  # 16 trips
    ["0x30", "@!P3  BRA 0x10", "5", "128", "5", "0", "0", "4096"],
    ["0x40", "      STG.E [R2], R4", "1", "4", "0", "0", "0", "128"],  # half the programs
    ["0x50", "      NOP", "0", "0", "0", "0", "0", "0"],  # never run
]


def write_page(path):
    with open(path, "w") as f:
        f.write('"Kernel Name","_split_kv_kernel",\n')
        for row in (HEADER, *ROWS):
            f.write(",".join(f'"{cell}"' for cell in row) + "\n")


def test_groups_by_runs_per_warp(tmp_path):
    page = tmp_path / "source.csv"
    write_page(page)
    instructions = ncu_source.read_source(page)
    assert [ins.opcode for ins in instructions] == ["LDC", "HMMA", "BRA", "STG", "NOP"]
    assert instructions[1].stalls == {"stall_barrier": 1, "stall_long_sb": 4}  # the not-issued column is left out
    groups = ncu_source.group_by_runs(instructions, warps=8)
    assert list(groups) == [16.0, 1.0, 0.5]  # by instructions per warp, largest first; the NOP never ran
    loop = groups[16.0]
    assert (loop["instructions"], loop["per_warp"], loop["samples"]) == (2, 32.0, 15)
    assert loop["stalls"] == {"stall_barrier": 6, "stall_long_sb": 4}
    assert loop["opcodes"] == {"HMMA": 1, "BRA": 1}
    assert groups[0.5]["per_warp"] == 0.5


def test_main_prints_and_writes_json(tmp_path, capsys):
    page, out = tmp_path / "source.csv", tmp_path / "groups.json"
    write_page(page)
    ncu_source.main([str(page), "--warps", "8", "--top", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert text.startswith("34 instructions per warp, 19 samples")  # 1 + 16 + 16 + 0.5 per warp, rounded
    assert "runs 16: 2 instructions, 32 per warp, 15 samples (barrier 6, long_sb 4)" in text
    assert "HMMA.16816.F32.BF16" in text.split("most-sampled 2:")[1]
    assert json.loads(out.read_text())["16.0"]["stalls"] == {"stall_barrier": 6, "stall_long_sb": 4}
