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
