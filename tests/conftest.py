"""Shared test helpers: the GPU marker, error metrics, random parameters."""

from __future__ import annotations

import numpy as np
import pytest

from cufused import benchmark
from cufused._arrays import gpu_available

GPU = gpu_available()


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(out, ref) -> float:
    """:func:`cufused.benchmark.rel_err` after checking that the shapes match."""
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return benchmark.rel_err(out, ref)


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
    # A fresh, distinct stream per test; the seed is printed on failure via the test id.
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))
