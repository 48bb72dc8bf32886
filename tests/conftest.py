"""Shared test helpers: the GPU and oracle markers, error metrics, random parameters."""

from __future__ import annotations

import importlib.util
import zlib

import numpy as np
import pytest

from cufused._arrays import gpu_available
from cufused.bench import cases as bench_cases

GPU = gpu_available()
TORCH = importlib.util.find_spec("torch") is not None
NO_ORACLE = "needs PyTorch, the independent oracle, which is not installed"
# The command of the summary line that counts the oracle tests that did not run: PyTorch's
# CPU build (about 200 MB, without the CUDA libraries of the default Linux wheel).
ORACLE_COMMAND = ("python -m pip install torch --index-url https://download.pytorch.org/whl/cpu"
                  " && python -m pytest")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device with CuPy")
    skip_oracle = pytest.mark.skip(reason=NO_ORACLE)
    for item in items:
        if not GPU and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        elif not TORCH and "oracle" in item.keywords:
            item.add_marker(skip_oracle)


def pytest_unconfigure(config):
    # After pytest's own closing line, so that it is the last line of the run.
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    missing = sum(NO_ORACLE in str(report.longrepr)
                  for report in reporter.stats.get("skipped", []))
    if missing:
        reporter.write_line(f"{missing} PyTorch-oracle tests did not run (PyTorch is not "
                            f"installed); to run them: {ORACLE_COMMAND}", yellow=True, bold=True)


def rel_err(out, ref) -> float:
    """:func:`cufused.bench.cases.rel_err` after checking that the shapes match."""
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return bench_cases.rel_err(out, ref)


def assert_close(out, ref, tol: float) -> None:
    """Relative-norm check plus a max-abs check scaled to the reference's magnitude."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3e} >= {tol:.1e}"
    scale = np.abs(ref).max() if ref.size else 0.0
    worst = np.abs(out - ref).max() if ref.size else 0.0
    assert worst <= 50 * tol * max(scale, 1e-30), f"max abs error {worst:.3e}, |ref|max {scale:.3e}"


def mixed(rng, n, dtype=np.float64):
    """Mixed-sign per-channel parameters bounded away from zero."""
    return (rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)).astype(dtype)


@pytest.fixture
def rng(request):
    # A fresh, distinct stream per test, the same in every run (str hashes change between
    # processes): a failure reproduces from the test id.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
