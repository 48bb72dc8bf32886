"""scripts/fuzz_blocks.py without a GPU: its ``--cpu`` mode (the NumPy path of every building
block against PyTorch float64, random shapes and options, with and without NaN / inf planted)
passes and runs cases of every block, and it catches a reference that is wrong."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from cufused import reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
BLOCKS = {"conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d", "group_norm",
          "batch_norm", "max_pool2d", "max_pool3d", "avg_pool2d", "avg_pool3d", "softmax"}


def _cases_run(stdout: str) -> dict[str, int]:
    """The per-block counts of the closing ``cases run: {...}; failed: 0`` line."""
    ran = re.search(r"cases run: (\{.*\}); failed: 0$", stdout, re.MULTILINE)
    assert ran, stdout
    return ast.literal_eval(ran.group(1))


@pytest.mark.parametrize("flags", [[], ["--nonfinite"]], ids=["finite", "nonfinite"])
def test_fuzz_of_the_numpy_path_matches_torch(flags):
    """Every block's NumPy path, in random layouts and into ``out``, against PyTorch float64
    at 1e-9 (with ``--nonfinite``: NaN / inf where PyTorch puts them)."""
    pytest.importorskip("torch")
    res = subprocess.run([sys.executable, str(SCRIPTS / "fuzz_blocks.py"), "--cpu", *flags,
                          "--seconds", "8", "--seed", "7"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    ran = _cases_run(res.stdout)
    assert set(ran) == BLOCKS, ran
    assert min(ran.values()) >= 20, res.stdout


def test_fuzz_catches_a_wrong_reference(monkeypatch, capsys):
    """A max pool that pads with zeros instead of -inf fails cases (the fuzzer can fail), and
    each failure names the command that replays it."""
    torch = pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(SCRIPTS))
    # The fuzzer runs PyTorch on one thread; the rest of the test session keeps its own.
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    import fuzz_blocks

    def zero_padded(x, kernel_size, stride, padding):
        windows = reference._windows(x, kernel_size, stride, padding, 0.0)
        return windows.max(axis=tuple(range(-len(kernel_size), 0)))

    monkeypatch.setattr(reference, "max_pool", zero_padded)
    status = fuzz_blocks.main(["--cpu", "--blocks", "max_pool2d", "max_pool3d",
                               "--seconds", "3", "--seed", "7"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert re.search(r"^FAIL max_pool\dd: .*replay: python scripts/fuzz_blocks.py "
                     r"--blocks max_pool\dd --case \d+ --cpu$", out, re.MULTILINE), out


def test_fuzz_stops_where_the_device_faulted(monkeypatch, capsys):
    """A case that ends the CUDA context (a kernel fault) is the run's last: it is reported
    with its replay command, and the cases after it, which could only fail, do not run."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import fuzz_blocks

    def faulting(block, seed, **kwargs):
        raise RuntimeError("cudaErrorMisalignedAddress: misaligned address")

    monkeypatch.setattr(fuzz_blocks, "run_case", faulting)
    monkeypatch.setattr(fuzz_blocks, "_context_lost", lambda: True)
    status = fuzz_blocks.main(["--blocks", "conv2d", "--seconds", "3", "--seed", "7"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert out.count("FAIL conv2d") == 1 and "context is lost" in out, out
    assert "cases run: {'conv2d': 1}; failed: 1" in out, out
