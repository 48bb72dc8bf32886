"""The command line without a GPU: help texts, the reference check, bench's refusal."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "cufused", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("args", [["--help"], ["check", "--help"], ["bench", "--help"]])
def test_help(args):
    res = run(*args)
    assert res.returncode == 0
    assert "usage: python -m cufused" in res.stdout


def test_check_without_gpu_runs_the_reference():
    from conftest import GPU

    if GPU:
        pytest.skip("a GPU is present: check runs the GPU path (covered by the GPU tests)")
    res = run("check")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("no CUDA GPU available")
    assert sum(" ok" in line for line in lines) == 3
    assert lines[-1] == "all checks passed"


def test_bench_without_gpu_says_so():
    from conftest import GPU

    if GPU:
        pytest.skip("a GPU is present")
    res = run("bench", "--quick")
    assert res.returncode == 1
    assert "no CUDA GPU available" in res.stdout


def test_unknown_command_fails():
    assert run("frobnicate").returncode != 0


@pytest.mark.parametrize("name", ["bench.json", "bench_h100.json"])
def test_bench_table_and_plot_from_committed_result(tmp_path, name):
    # The committed device results (docs/_static/bench*.json, H200 and H100) render as the
    # bench command prints them, and as a bar chart.
    import json
    import pathlib

    from cufused.__main__ import format_table, plot

    result = json.loads((pathlib.Path(__file__).parent.parent / "docs" / "_static"
                         / name).read_text())
    table = format_table(result)
    assert result["header"]["device"] in table
    rows = [line for line in table.splitlines() if line[:2] in ("A ", "B ", "C ")]
    assert len(rows) == 2 * len(result["rows"])  # pipeline rows and convolution rows
    first = result["rows"][0]
    assert f"{first['torch_eager'] / first['fused']:.2f}" in rows[0]
    post_ratio = (first["fused"] - first["conv"]) / first["post_floor"]
    assert f"{post_ratio:7.2f} " in rows[0]
    pytest.importorskip("matplotlib")
    plot(result, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_post_conv_floor_counts_the_bytes_each_case_moves():
    from cufused.benchmark import CASES

    by_name = {case.name: case for case in CASES}
    # A: conv output (128, 64, 126, 126) read, result (128, 64, 31, 31) written.
    assert by_name["A"].post_conv_bytes() == 4 * 128 * 64 * (126 * 126 + 31 * 31)
    # C pools its input before the conv: input read, pooled input written, then the conv
    # output read and the (same-shaped) result written.
    assert by_name["C"].post_conv_bytes() == 4 * 32 * (32 * 32 * 64 * 64 + 32 * 16 * 32 * 32
                                                       + 2 * 64 * 32 * 64 * 64)
