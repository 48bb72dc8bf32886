"""Shared test helpers: the GPU and oracle markers, error metrics, random parameters."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import zlib

import numpy as np
import pytest

import cufused
from cufused._arrays import gpu_available
from cufused._cuda import portable_builds
from cufused.bench import cases as bench_cases

GPU = gpu_available()
TORCH = importlib.util.find_spec("torch") is not None
NO_ORACLE = "needs PyTorch, the independent oracle, which is not installed"
# The command of the summary line that counts the oracle tests that did not run: PyTorch's
# CPU build (about 200 MB, without the CUDA libraries of the default Linux wheel).
ORACLE_COMMAND = ("python -m pip install torch --index-url https://download.pytorch.org/whl/cpu"
                  " && python -m pytest")


def pytest_collection_modifyitems(config, items):
    if not GPU and os.environ.get("CUFUSED_REQUIRE_GPU") == "1":
        # On the GPU machine (scripts/gpu_check.sh) a CuPy that sees no device is a failure,
        # not a reason to skip every GPU test.
        raise pytest.UsageError("CUFUSED_REQUIRE_GPU=1 but CuPy sees no CUDA device")
    if not TORCH and os.environ.get("CUFUSED_REQUIRE_GPU") == "1":
        # The GPU tests of NaN and inf placement compare with PyTorch CUDA: without it there,
        # they would skip unseen.
        raise pytest.UsageError("CUFUSED_REQUIRE_GPU=1 but PyTorch, the oracle of the GPU "
                                "tests, is not installed")
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
    # The oracle-marked tests, and those (or whole modules) that import PyTorch themselves.
    missing = sum(NO_ORACLE in str(report.longrepr)
                  or "could not import 'torch'" in str(report.longrepr)
                  for report in reporter.stats.get("skipped", []))
    if missing:
        reporter.write_line(f"{missing} PyTorch-oracle tests (or modules of them) did not run "
                            f"(PyTorch is not installed); to run them: {ORACLE_COMMAND}",
                            yellow=True, bold=True)


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


def assert_nonfinite_placement(got, ref, tol: float) -> None:
    """NaN, +inf and -inf at the same positions; the finite values within ``tol``
    (:func:`assert_close`)."""
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(ref))
    finite = np.isfinite(ref)
    assert_close(got[finite], ref[finite], tol)


def mixed(rng, n, dtype=np.float64):
    """Mixed-sign per-channel parameters bounded away from zero."""
    return (rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)).astype(dtype)


@pytest.fixture
def rng(request):
    # A fresh, distinct stream per test, the same in every run (str hashes change between
    # processes): a failure reproduces from the test id.
    # The test's name without its file: moving a test keeps its data.
    name = request.node.nodeid.split("::", 1)[-1]
    return np.random.default_rng(zlib.crc32(name.encode()))


# ------------------------------------------------------- helpers of the tests marked gpu

if GPU:
    import cupy as cp

TOL = {"ieee": 1e-5, "tf32": 5e-3}
# Values of constant channels, most of them far from zero (a normalization of such a channel
# gives exactly its bias).
CONSTANT_LEVELS = np.float32([5.0, 1234.5, -0.3, 7e4, 1.0, -2.5e3, 0.1, 3.0])


@pytest.fixture(autouse=True)
def _no_call_graph_from_another_test():
    """Every test starts without whole-call graphs: a graph captured by an earlier test whose
    operands happen to sit at the same addresses would replay where a test spies on a
    launcher."""
    from cufused import _call_graphs

    _call_graphs._clear()
    yield


@pytest.fixture
def quick_plans():
    """Heuristic cuDNN plans (no autotuning) keep the suite fast; tests opt back in."""
    from cufused._settings import plan_options

    with plan_options(autotune=False):
        yield


# Convolution strategies pinned in turn (labels of cufused._cudnn.Strategy), so that every
# cuDNN graph form and every layout the fused kernels read runs: NCHW, channels-last, an NCHW
# input with a channels-last output, the bias inside the graph, and the sub-pixel split
# (flipped-kernel forward convolution for stride 1, class-major blocks for stride 2).
CONV_PINS = ["nchw", "nhwc", "nchw>nhwc", "nchw+bias", "subpixel nchw", "subpixel nhwc"]
PIPELINE_PINS = ["nchw", "nhwc", "nchw>nhwc", "subpixel nchw"]


def _pinned(pin):
    from cufused._settings import plan_options

    return plan_options(autotune=False, pins=(pin,))


@pytest.fixture(params=CONV_PINS)
def conv_pin(request):
    with _pinned(request.param):
        yield request.param


@pytest.fixture(params=PIPELINE_PINS)
def layout(request):
    with _pinned(request.param):
        yield request.param


def to_gpu(*arrays):
    return [None if a is None else cp.asarray(a, dtype=cp.float32) for a in arrays]


def assert_same_as_direct(got, ref, again) -> None:
    """``got`` (a replayed or cached call) equal to ``ref`` (the same call run directly) up to
    the order of float32 sums: within 1e-6 where the direct call repeats itself bitwise
    (``again``, a second direct call, equals ``ref``), else within 1e-5. A cuDNN engine may sum
    in a varying order that two runs need not show (one element in thousands differs by an
    ulp); a replay that read another buffer, layout or stale values would be off by O(1).
    Non-finite values of ``ref`` must be exactly where they are."""
    tol = 1e-6 if bool(((ref == again) | (cp.isnan(ref) & cp.isnan(again))).all()) else 1e-5
    got, ref = got.get(), ref.get()
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(got[~finite], ref[~finite])
    assert_close(got[finite], ref[finite], tol)


def poisoned(shape):
    return cp.full(shape, cp.nan, dtype=cp.float32)


def torch_cuda():
    """PyTorch with CUDA, or a skip of the calling test."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    return torch


@contextlib.contextmanager
def kernels_built(build: str):
    """The engine's kernels as this device's own target builds them ("native": sm_90a's
    wgmma path on an H100 or H200) or as every other architecture does ("portable"). The
    cached plans and graphs are dropped around the portable calls: a graph captured with one
    build must not replay in the other."""
    if build == "native":
        yield
        return
    cufused.clear_caches()
    try:
        with portable_builds():
            yield
    finally:
        cufused.clear_caches()


def count_calls(monkeypatch, module, name: str) -> list:
    """``module.name`` (a launcher) wrapped for the test: each call appends ``name`` to the
    returned list."""
    calls, launcher = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return launcher(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


# ---------------------------------------------------------------------------------- convolutions

CONV_CASES = [
    # nd, transposed, x shape, w shape, options
    (2, False, (3, 5, 17, 13), (7, 5, 3, 3), dict(stride=1, padding=0)),
    (2, False, (2, 6, 19, 23), (9, 2, 3, 5),
     dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=3)),
    (2, False, (1, 3, 11, 11), (4, 3, 1, 1), dict(stride=3)),
    (3, False, (2, 4, 7, 9, 8), (6, 2, 3, 3, 3), dict(stride=2, padding=1, groups=2)),
    (2, True, (3, 6, 7, 11), (6, 5, 5, 5), dict(stride=1, padding=1)),
    (2, True, (2, 4, 9, 7), (4, 3, 3, 4),
     dict(stride=(2, 3), padding=(1, 0), output_padding=(1, 2), groups=2)),
    (2, True, (1, 3, 5, 5), (3, 2, 3, 3), dict(stride=2, dilation=2, output_padding=1)),
    (3, True, (2, 5, 4, 5, 3), (5, 7, 3, 3, 3), dict(stride=2, padding=1, output_padding=1)),
    (2, True, (2, 6, 8, 12), (6, 4, 4, 4), dict(stride=2, padding=1, groups=2)),
    (2, True, (2, 4, 3, 8), (4, 3, 2, 2), dict(stride=2, padding=(1, 0))),  # sub-pixel crops
    (2, False, (2, 3, 8, 9), (4, 3, 3, 5), dict(padding="same", dilation=(2, 1))),
    (2, False, (2, 3, 8, 9), (4, 3, 2, 4), dict(padding="same")),  # one more zero after
    (3, False, (1, 2, 5, 6, 4), (3, 2, 2, 3, 4), dict(padding="same", dilation=(3, 1, 1))),
]


def pipeline_a_args(rng, n=3, cin=5, h=23, w=19, cout=12, k=3, groups=4, pool=4, sign=True):
    x = rng.random((n, cin, h, w))
    wt = rng.standard_normal((cout, cin, k, k)) * 0.3
    cb = rng.standard_normal(cout)
    gw = mixed(rng, cout) if sign else rng.random(cout)
    gb = rng.standard_normal(cout) * 0.5
    scale = mixed(rng, cout).reshape(cout, 1, 1) if sign else rng.random((cout, 1, 1))
    return (x, wt, cb, gw, gb, scale), dict(num_groups=groups, pool_kernel=pool,
                                            clamp_min=-0.5, clamp_max=0.7)


def pipeline_b_args(rng, n=4, cin=6, h=9, w=7, cout=8, groups=2, conv_groups=1):
    x = rng.random((n, cin, h, w))
    wt = rng.standard_normal((cin, cout // conv_groups, 3, 3)) * 0.3
    return (x, wt, mixed(rng, cout), rng.standard_normal(cout), mixed(rng, cout),
            rng.standard_normal(cout)), dict(num_groups=groups, groups=conv_groups)


def pipeline_c_args(rng, n=2, cin=3, d=8, h=10, w=6, cout=5, groups=1):
    x = rng.random((n, cin, d, h, w))
    wt = rng.standard_normal((cin, cout // groups, 3, 3, 3))
    return (x, wt, mixed(rng, cout).reshape(1, cout, 1, 1, 1)), dict(
        stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0, clamp_max=1.0,
        groups=groups)


# The three pipelines with their small-argument makers, by case.
PIPELINE_CASES = {
    "A": ("conv2d_groupnorm_scale_maxpool_clamp", pipeline_a_args),
    "B": ("conv_transpose2d_batchnorm_tanh_maxpool_groupnorm", pipeline_b_args),
    "C": ("conv_transpose3d_avgpool_clamp_softmax_multiply", pipeline_c_args),
}
