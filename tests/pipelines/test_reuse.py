"""Warm calls over reused memory: every cached path (convolution plans with CUDA-graph replay,
pipelines) must give the result of a cold call when one device buffer is handed out again
holding another layout, shape or stride pattern (CuPy's memory pool does this routinely)."""

from __future__ import annotations

import numpy as np
import pytest

import cufused

from conftest import GPU, assert_close

pytestmark = pytest.mark.gpu

if GPU:
    import cupy as cp


def _view(mem, shape, layout: str):
    """A float32 array of logical NC(D)HW ``shape`` over ``mem`` stored in ``layout``."""
    nd = len(shape)
    if layout == "nchw":
        return cp.ndarray(shape, dtype=cp.float32, memptr=mem)
    physical = cp.ndarray((shape[0], *shape[2:], shape[1]), dtype=cp.float32, memptr=mem)
    return physical.transpose(0, nd - 1, *range(1, nd - 1))


def _fill(a, rng, low=-1.0, high=1.0):
    a[...] = cp.asarray(rng.uniform(low, high, a.shape), dtype=cp.float32)
    return a


def _cold(fn, *args, **kwargs):
    """The same call without any graph replay (each cuDNN call issued directly)."""
    from cufused._settings import plan_options

    with plan_options(replay=False):
        return fn(*args, **kwargs)


# The strategies whose graphs depend on the input layout: a channels-last plan reads a
# channels-last input in place and converts an NCHW one first.
LAYOUT_PINS = ["nhwc", "nchw>nhwc", "nchw", "subpixel nchw", "subpixel nhwc"]


@pytest.fixture(params=LAYOUT_PINS)
def pin(request):
    from cufused._settings import plan_options

    with plan_options(autotune=False, pins=(request.param,)):
        yield request.param


def _interleave(rng, shape, fn, *, rounds=3, layouts=("nhwc", "nchw")):
    """Call ``fn(x)`` on views of ONE allocation in alternating layouts, each several times
    (so that graphs are captured and replayed), new values each call; compare each warm
    result with a cold call on the same operands."""
    mem = cp.cuda.alloc(int(np.prod(shape)) * 4)
    for _ in range(rounds):
        for layout in layouts:
            x = _fill(_view(mem, shape, layout), rng, 0.0, 1.0)
            for _ in range(3):
                warm = fn(x).copy()
            cold = _cold(fn, x)
            assert not cp.isnan(warm).any()
            assert_close(warm.get(), cold.get(), 1e-6)


@pytest.mark.parametrize("case", ["conv2d", "conv_transpose2d", "conv_transpose3d"])
def test_conv_reused_buffer_layouts(rng, pin, case):
    if case == "conv2d":
        shape, w = (2, 8, 12, 12), _fill(cp.empty((16, 8, 3, 3), cp.float32), rng)
        _interleave(rng, shape, lambda x: cufused.conv2d(x, w, padding=1))
    elif case == "conv_transpose2d":
        shape, w = (2, 8, 9, 9), _fill(cp.empty((8, 16, 4, 4), cp.float32), rng)
        _interleave(rng, shape, lambda x: cufused.conv_transpose2d(x, w, stride=2, padding=1))
    else:
        shape, w = (2, 8, 4, 6, 6), _fill(cp.empty((8, 8, 3, 3, 3), cp.float32), rng)
        _interleave(rng, shape, lambda x: cufused.conv_transpose3d(
            x, w, stride=2, padding=1, output_padding=1))


def test_conv_reused_buffer_shapes_and_strides(rng, pin):
    # One allocation seen as different shapes (the plan of each shape differs) and as a
    # strided view (copied to a contiguous temporary, whose address is also reused).
    mem = cp.cuda.alloc(2 * 8 * 16 * 16 * 4)
    w = _fill(cp.empty((16, 8, 3, 3), cp.float32), rng)
    views = [
        lambda: _view(mem, (2, 8, 16, 16), "nchw"),
        lambda: _view(mem, (2, 8, 16, 16), "nhwc"),
        lambda: _view(mem, (2, 8, 12, 12), "nhwc"),
        lambda: _view(mem, (2, 8, 16, 16), "nchw")[:, :, ::2, ::2],
        lambda: _view(mem, (2, 8, 16, 16), "nhwc")[:, :, 1:13, 2:14],
    ]
    for _ in range(2):
        for make in views:
            x = _fill(make(), rng, 0.0, 1.0)
            for _ in range(3):
                warm = cufused.conv2d(x, w).copy()
            assert_close(warm.get(), _cold(cufused.conv2d, x, w).get(), 1e-6)


def test_conv_reused_weight_buffer_layouts(rng, pin):
    # The weight too: one allocation read as an NCHW and as a channels-last weight.
    x = _fill(cp.empty((2, 8, 10, 10), cp.float32), rng, 0.0, 1.0)
    mem = cp.cuda.alloc(16 * 8 * 9 * 4)
    for _ in range(2):
        for layout in ("nchw", "nhwc"):
            w = _fill(_view(mem, (16, 8, 3, 3), layout), rng)
            for _ in range(3):
                warm = cufused.conv2d(x, w).copy()
            assert_close(warm.get(), _cold(cufused.conv2d, x, w).get(), 1e-6)


@pytest.mark.parametrize("pipeline", ["A", "B", "C"])
def test_pipelines_reused_buffer_layouts(rng, pin, pipeline):
    if pipeline == "A":
        w, gw, gb, s = (_fill(cp.empty(sh, cp.float32), rng)
                        for sh in ((16, 8, 3, 3), (16,), (16,), (16,)))
        shape = (2, 8, 14, 14)

        def fn(x):
            return cufused.conv2d_groupnorm_scale_maxpool_clamp(
                x, w, None, gw, gb, s, num_groups=4, pool_kernel=2, clamp_min=0.0,
                clamp_max=1.0)
    elif pipeline == "B":
        w, bw, bb, gw, gb = (_fill(cp.empty(sh, cp.float32), rng)
                             for sh in ((8, 16, 3, 3), (16,), (16,), (16,), (16,)))
        shape = (3, 8, 8, 8)

        def fn(x):
            return cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
                x, w, bw, bb, gw, gb, num_groups=4, stride=1, padding=1)
    else:
        w, s = (_fill(cp.empty(sh, cp.float32), rng) for sh in ((8, 8, 3, 3, 3), (8,)))
        shape = (2, 8, 8, 8, 8)

        def fn(x):
            return cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
                x, w, s, stride=2, padding=1, output_padding=1, pool_kernel=2,
                clamp_min=0.0, clamp_max=1.0)
    _interleave(rng, shape, fn)


def test_randomized_reuse_warm_equals_cold(rng):
    # Random sequences of calls over a small set of allocations, each call picking a shape,
    # a layout, a stride pattern and a precision; on heuristic plans, which replay their
    # graphs (the autotuner's choice of direct calls is not exercised here). Every warm
    # result must equal a cold one on the same operands.
    from cufused._settings import plan_options

    mems = [cp.cuda.alloc(2 * 8 * 16 * 16 * 4) for _ in range(2)]
    w = _fill(cp.empty((8, 8, 3, 3), cp.float32), rng)
    wt = _fill(cp.empty((8, 8, 3, 3), cp.float32), rng)
    shapes = [(2, 8, 16, 16), (2, 8, 12, 12), (1, 8, 16, 16)]
    with plan_options(autotune=False, pins=None):
        for _ in range(60):
            mem = mems[rng.integers(len(mems))]
            shape = shapes[rng.integers(len(shapes))]
            layout = ("nchw", "nhwc")[rng.integers(2)]
            x = _view(mem, shape, layout)
            if rng.random() < 0.3:
                x = x[:, :, ::2, ::2]
            _fill(x, rng, 0.0, 1.0)
            precision = ("ieee", "tf32")[rng.integers(2)]
            op = rng.integers(3)
            if op == 0:
                def call(x):
                    return cufused.conv2d(x, w, padding=1, precision=precision)
            elif op == 1:
                def call(x):
                    return cufused.conv_transpose2d(x, wt, stride=2, padding=1,
                                                    precision=precision)
            else:
                def call(x):
                    return cufused.conv2d_groupnorm_scale_maxpool_clamp(
                        x, w, None, None, None, 2.0, num_groups=2, pool_kernel=2,
                        clamp_min=-1.0, clamp_max=1.0, precision=precision)
            for _ in range(int(rng.integers(1, 4))):
                warm = call(x).copy()
            cold = _cold(call, x)
            assert_close(warm.get(), cold.get(), 1e-6)
