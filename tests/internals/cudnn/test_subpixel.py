"""The sub-pixel split of a transposed convolution, checked on the CPU with the reference."""

from __future__ import annotations

import numpy as np
import pytest

from cufused import reference
from cufused._cudnn import ConvProblem, strategies
from cufused._subpixel import subpixel_parts, subpixel_weight_index


def _split_conv_transpose(x, w, stride, padding, out_spatial, groups, channels_last):
    """conv_transpose computed part by part as forward convolutions, as the GPU plan does."""
    nd = x.ndim - 2
    parts = subpixel_parts(x.shape[2:], w.shape[2:], stride, padding, out_spatial)
    flat = w.ravel()[subpixel_weight_index(w.shape, groups, stride, parts, channels_last)]
    out = np.full((x.shape[0], w.shape[1] * groups, *out_spatial), np.nan)
    offset = 0
    for part in parts:
        dims = (w.shape[1] * groups, x.shape[1] // groups, *part.taps)
        size = int(np.prod(dims))
        sub = flat[offset:offset + size]
        offset += size
        sub = (np.moveaxis(sub.reshape(dims[0], *dims[2:], dims[1]), -1, 1) if channels_last
               else sub.reshape(dims))
        window = x[(slice(None), slice(None)) + tuple(
            slice(a, a + b) for a, b in zip(part.x_start, part.x_size))]
        window = np.pad(window, [(0, 0), (0, 0)] + list(zip(part.pre_padding,
                                                             part.post_padding)))
        y = reference.conv(window, sub, None, (1,) * nd, (0,) * nd, (1,) * nd, groups)
        out[(slice(None), slice(None)) + tuple(
            slice(r, None, s) for r, s in zip(part.residue, stride))] = y
    assert offset == flat.size
    return out


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("channels_last", [False, True])
def test_split_matches_conv_transpose(seed, channels_last):
    rng = np.random.default_rng(seed)
    nd = int(rng.integers(1, 4))
    groups = int(rng.choice([1, 2]))
    while True:
        size = tuple(int(v) for v in rng.integers(1, 6, nd))
        kernel = tuple(int(v) for v in rng.integers(1, 5, nd))
        stride = tuple(int(v) for v in rng.integers(1, 4, nd))
        padding = tuple(int(rng.integers(0, k + 1)) for k in kernel)
        output_padding = tuple(int(rng.integers(0, s)) for s in stride)
        out = tuple((i - 1) * s - 2 * p + k + o for i, s, p, k, o in
                    zip(size, stride, padding, kernel, output_padding))
        if min(out) > 0 and subpixel_parts(size, kernel, stride, padding, out) is not None:
            break
    x = rng.standard_normal((2, 2 * groups, *size))
    w = rng.standard_normal((2 * groups, 3, *kernel))
    ref = reference.conv_transpose(x, w, None, stride, padding, output_padding, (1,) * nd,
                                   groups)
    got = _split_conv_transpose(x, w, stride, padding, out, groups, channels_last)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_split_of_pipeline_c():
    # ConvTranspose3d k3 s2 p1 op1 on 16 x 32 x 32: 8 classes of 16 x 32 x 32, 1 or 2 taps.
    parts = subpixel_parts((16, 32, 32), (3, 3, 3), (2, 2, 2), (1, 1, 1), (32, 64, 64))
    assert len(parts) == 8
    assert sorted(int(np.prod(p.taps)) for p in parts) == [1, 2, 2, 2, 4, 4, 4, 8]
    assert all(p.x_size == (16, 32, 32) and p.x_start == (0, 0, 0) for p in parts)


@pytest.mark.parametrize("size,kernel,stride,out", [
    ((4,), (3,), (2,), (9,)),  # output not a multiple of the stride
    ((4,), (1,), (2,), (8,)),  # a class without taps
])
def test_no_split(size, kernel, stride, out):
    assert subpixel_parts(size, kernel, stride, (0,), out) is None


def _problem(kind, stride, y_spatial, bias=False, dilation=(1, 1)):
    w = (8, 4, 3, 3) if kind == "fprop" else (4, 8, 3, 3)
    return ConvProblem(kind, (2, 4, 8, 8), w, (2, 8, *y_spatial), stride, (1, 1), dilation,
                       "ieee", bias)


def test_strategy_candidates():
    labels = lambda *a, **k: [s.label for s in strategies(*a, **k)]  # noqa: E731
    assert labels(_problem("fprop", (1, 1), (8, 8)), False) == ["nchw", "nhwc", "nchw>nhwc"]
    assert labels(_problem("fprop", (1, 1), (8, 8), bias=True), False) == [
        "nchw", "nchw+bias", "nhwc", "nchw>nhwc"]
    assert labels(_problem("dgrad", (1, 1), (8, 8)), False)[3:] == [
        "subpixel nchw", "subpixel nhwc", "subpixel nchw>nhwc"]
    stride2 = _problem("dgrad", (2, 2), (16, 16))
    assert "subpixel nchw" not in labels(stride2, False)  # class blocks need a reader
    assert labels(stride2, True)[-1] == "subpixel nchw"
    assert [s.y_layout for s in strategies(stride2, True)][-1] == "classes"
    assert len(labels(_problem("dgrad", (1, 1), (10, 10), dilation=(2, 2)), True)) == 3


def test_part_specs_of_pipeline_c_are_aligned_class_blocks():
    from cufused._cudnn import Strategy, _part_specs

    problem = ConvProblem("dgrad", (32, 32, 16, 32, 32), (32, 64, 3, 3, 3), (32, 64, 32, 64, 64),
                          (2, 2, 2), (1, 1, 1), (1, 1, 1), "ieee")
    specs, y_shape, index = _part_specs(problem, Strategy("subpixel", "nchw", "classes"))
    block = 32 * 64 * 16 * 32 * 32
    assert y_shape == (8, 32, 64, 16, 32, 32)
    assert [s.y.offset for s in specs] == [i * block for i in range(8)]
    assert all(s.kind == "fprop" and s.y.dims == (32, 64, 16, 32, 32) for s in specs)
    assert all(s.x.offset == 0 and s.w.offset % 4 == 0 for s in specs)
    sizes = [int(np.prod(s.w.dims)) for s in specs]
    assert [b - a for a, b in zip([s.w.offset for s in specs], [s.w.offset for s in specs[1:]])
            ] == [-(-n // 4) * 4 for n in sizes[:-1]]
    assert index.size == specs[-1].w.offset + -(-sizes[-1] // 4) * 4


def test_part_specs_of_direct_strategies_follow_the_layouts():
    from cufused._cudnn import Strategy, _part_specs
    from cufused._layout import layout_strides

    problem = _problem("fprop", (1, 1), (8, 8), bias=True)
    (spec,), y_shape, index = _part_specs(problem, Strategy("direct", "nchw", "nhwc"))
    assert index is None and y_shape == problem.y_shape and spec.bias_strides is None
    assert spec.x.strides == layout_strides(problem.x_shape, "nchw")
    assert spec.y.strides == layout_strides(problem.y_shape, "nhwc")
    (spec,), _, _ = _part_specs(problem, Strategy("direct", "nchw", "nchw", bias_in_graph=True))
    assert spec.bias_strides == (8, 1, 1, 1)
