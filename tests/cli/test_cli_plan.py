"""``kvxferd plan`` through :func:`kvxferd.cli.main` (in-process) and ``python -m kvxferd``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvxferd
from kvxferd.cli import main
from kvxferd.commands import plan as plan_cmd
from kvxferd.errors import SpecError
from kvxferd.layout import dump_spec, preset

REPO = Path(__file__).resolve().parents[2]

# docs/domain.md §4: full attention + Mamba, remote ppl 34, local ppl 66, remote IDs [5,6], [2].
HYBRID = [
    "plan",
    "--local",
    "hybrid:ppl=66",
    "--remote",
    "hybrid:ppl=34",
    "--local-ids",
    "0,1;0",
    "--remote-ids",
    "5,6;2",
]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], status: int) -> Any:
    assert main([*argv, "--json"]) == status
    out = capsys.readouterr().out
    return json.loads(out)


def test_hybrid_example_json_expands_each_side_with_its_own_ppl(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = _json(capsys, HYBRID, 0)
    assert doc["compatible"] is True and doc["mismatches"] == [] and doc["error"] is None
    attn, mamba = doc["plan"]["groups"]
    # 2 remote logical blocks x 34 = 68 kernel blocks (170..237); local 2 x 66 = 132, keep
    # the first 68 of each (same token positions); Mamba states are never expanded.
    assert attn["remote_kernel_ids"] == list(range(170, 238))
    assert attn["local_kernel_ids"] == list(range(68))
    assert (attn["local_ppl"], attn["remote_ppl"]) == (66, 34)
    assert mamba["remote_kernel_ids"] == [2] and mamba["local_kernel_ids"] == [0]


def test_hybrid_example_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(HYBRID) == 0
    out = capsys.readouterr().out
    assert "verdict: compatible (TP ratio 1)" in out
    assert "attn.0..attn.3 (4 regions): 1 range, 1114112 bytes each" in out
    # 68 kernel blocks of 16384 bytes, remote block 170 at 170 * 16384 = 2785280
    assert "0        2785280  1114112" in out
    assert "mamba.0.conv..mamba.11.conv (12 regions)" in out
    assert "68 blocks: 0..67 <- 170..237" in out
    assert "1 block: 0 <- 2" in out
    assert "total: 4923392 bytes (4.7 MiB), 28 descriptors after coalescing, 296 naive" in out


def test_json_shape_and_totals_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, HYBRID, 0)
    assert set(doc) == {
        "local",
        "remote",
        "prefix_caching",
        "compatible",
        "tp_ratio",
        "mismatches",
        "error",
        "plan",
    }
    assert doc["local"]["tp"] == {"rank": 0, "size": 1}
    assert [g["ppl"] for g in doc["remote"]["groups"]] == [34, 1]
    plan = doc["plan"]
    assert plan["read_ranks"] == [0] and plan["notify_ranks"] == [0]
    (rank,) = plan["ranks"]
    assert rank["remote_rank"] == 0
    regions = rank["regions"]
    assert sum(e["count"] for e in regions) == 28
    assert all(len(row) == 3 for e in regions for row in e["ranges"])
    assert rank["bytes"] == sum(e["count"] * sum(r[2] for r in e["ranges"]) for e in regions)
    assert rank["descriptors"] == sum(e["count"] * len(e["ranges"]) for e in regions)
    totals = plan["totals"]
    assert (totals["bytes"], totals["descriptors"]) == (rank["bytes"], rank["descriptors"])
    # naive: one descriptor per (region, kernel block): 4 x 68 attention + 24 x 1 Mamba
    assert totals["naive_descriptors"] == 4 * 68 + 24


def test_ppl_mismatch_with_prefix_caching_is_refused_naming_both_ratios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*HYBRID, "--prefix-caching"]) == 1
    out = capsys.readouterr().out
    assert "verdict: INCOMPATIBLE, 1 mismatch" in out
    assert "local 66" in out and "remote 34" in out
    assert "fix: disable prefix caching" in out
    assert "plan:" not in out

    doc = _json(capsys, [*HYBRID, "--prefix-caching"], 1)
    assert doc["compatible"] is False and doc["plan"] is None
    (m,) = doc["mismatches"]
    assert m["local"].startswith("66") and m["remote"].startswith("34")
    assert "disable prefix caching" in m["fix"]


def test_every_mismatch_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--local", "dense", "--remote", "mla", "--local-ids", "0", "--remote-ids", "0"]
    doc = _json(capsys, [*argv, "--local-tp", "0/3", "--remote-tp", "0/2"], 1)
    whats = [m["what"] for m in doc["mismatches"]]
    assert "model fingerprint" in whats and "tensor-parallel size" in whats
    assert all(m["fix"] for m in doc["mismatches"])


def test_out_of_range_id_exits_1_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*HYBRID[:-1], "5,99;2"]  # hybrid presets register 16 logical blocks
    assert main(argv) == 1
    cap = capsys.readouterr()
    assert "verdict: compatible" in cap.out
    assert cap.err.startswith("kvxferd: error: groups[0].remote_block_ids[1]: block ID 99")
    assert "Traceback" not in cap.err

    doc = _json(capsys, argv, 1)
    assert doc["compatible"] is True and doc["plan"] is None
    assert doc["error"]["type"] == "BlockRangeError"
    assert doc["error"]["field"] == "groups[0].remote_block_ids[1]"


def test_wrong_group_count_is_an_invalid_request(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, [*HYBRID[:-3], "0,1", "--remote-ids", "5,6"], 1)
    assert doc["error"]["type"] == "InvalidRequest" and doc["error"]["field"] == "groups"


def test_heterogeneous_tp_reads_head_slices(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "--local",
        "dense:layout=HND,num_kv_heads=4,num_blocks=16",
        "--local-tp",
        "1/2",
        "--remote",
        "dense:layout=HND,num_blocks=16",
        "--local-ids",
        "0-3",
        "--remote-ids",
        "10-13",
    ]
    doc = _json(capsys, argv, 0)
    assert doc["tp_ratio"] == 2
    (entry,) = doc["plan"]["ranks"][0]["regions"]
    assert entry["label"] == "layer.0..layer.31" and entry["count"] == 32
    # 4 blocks x (K, V) slices of 4 heads x 16 tokens x 128 x bf16 = 16384 bytes each
    assert entry["ranges_per_region"] == 8
    assert {r[2] for r in entry["ranges"]} == {16384}

    assert main([*argv, "--max-ranges", "2"]) == 0
    out = capsys.readouterr().out
    assert "layer.0..layer.31 (32 regions): 8 ranges, 131072 bytes each" in out
    assert "... 6 more" in out


def test_gapped_regions_collapse_with_braces(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--local", "fp8:num_blocks=8", "--remote", "fp8:num_blocks=8"]
    assert main([*argv, "--local-ids", "0-3;0", "--remote-ids", "4-7;1"]) == 0
    out = capsys.readouterr().out
    assert "layer.{3,7,11,15,19,23,27,31} (8 regions)" in out
    assert "layer.{0..2,4..6,8..10,12..14,16..18,20..22,24..26,28..30} (24 regions)" in out


def test_spec_from_toml_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dense.toml"
    path.write_text(dump_spec(preset("dense:num_blocks=8")))
    argv = ["plan", "--local", str(path), "--remote", "dense:num_blocks=8"]
    doc = _json(capsys, [*argv, "--local-ids", "0-2", "--remote-ids", "5,6,7"], 0)
    # dense NHD, contiguous on both sides: one descriptor per layer
    assert doc["plan"]["totals"]["descriptors"] == 32
    assert doc["plan"]["totals"]["naive_descriptors"] == 32 * 3


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--remote", "dense", "--local-ids", "0", "--remote-ids", "0"],  # no --local
        ["plan", "--local", "dense", "--remote", "dense", "--local-ids", "a", "--remote-ids", "0"],
        [
            "plan",
            "--local",
            "dense",
            "--remote",
            "dense",
            "--local-ids",
            "3-1",
            "--remote-ids",
            "0",
        ],
        ["plan", "--local", "nope", "--remote", "dense", "--local-ids", "0", "--remote-ids", "0"],
        [*HYBRID[:2], "/no/such.toml", *HYBRID[3:]],  # spec file missing
        [*HYBRID, "--local-tp", "2/2"],
        [*HYBRID, "--remote-tp", "x"],
        [*HYBRID, "--max-ranges", "-1"],
        ["plan"],
        [],
        ["frobnicate"],
    ],
)
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_kvxferd_error_from_a_command_prints_one_line_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom(args: object) -> int:
        raise SpecError("spec is broken", field="regions[3]", fix="repair it")

    monkeypatch.setattr(plan_cmd, "run", boom)
    assert main(HYBRID) == 2
    err = capsys.readouterr().err
    assert err == "kvxferd: error: regions[3]: spec is broken (fix: repair it)\n"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvxferd {kvxferd.__version__}"


def test_python_dash_m_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvxferd", *HYBRID, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["plan"]["groups"][0]["remote_kernel_ids"][0] == 170
    assert doc["plan"]["groups"][1]["remote_kernel_ids"] == [2]
