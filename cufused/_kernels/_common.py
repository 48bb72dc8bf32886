"""Launch helpers shared by the launcher modules (the host side of ``common.cuh``)."""

from __future__ import annotations

import numpy

from .._cuda import MAX_GRID_YZ

# Aim for at least this many blocks in a split reduction.
_TARGET_BLOCKS = 2048
# The widest clamp after which a softmax skips its running maximum: exponents taken from the
# clamp's middle (common.cuh's clamp_middle) lie within +-30, so a row's sum and the factor
# scale / sum stay within float32's normal range for |scale| between about 1e-25 * (values a
# row) and 1e25.
_MAX_FREE_CLAMP = 60.0


def split_count(keys: int, elements_per_key: int) -> int:
    """How many blocks share one statistics key (``split_range`` in common.cuh): enough
    blocks overall, at least 1024 values each."""
    want = -(-_TARGET_BLOCKS // max(keys, 1))
    return max(1, min(want, -(-elements_per_key // 1024)))


def _float32_bounds(clamp) -> tuple[float, float]:
    """``clamp`` = (lo, hi) as the kernels get them, float32."""
    lo, hi = (float(numpy.float32(v)) for v in clamp)
    return lo, hi


def skips_max(clamp) -> bool:
    """Whether a softmax after ``clamp`` = (lo, hi) (None: no clamp) needs no running
    maximum: the float32 bounds at most ``_MAX_FREE_CLAMP`` apart (lo > hi, which clamps
    every value to hi, included; two infinite bounds excluded)."""
    if clamp is None:
        return False
    lo, hi = _float32_bounds(clamp)
    return hi - lo <= _MAX_FREE_CLAMP


def clamp_middle(clamp) -> float:
    """The exponents' reference of a softmax that :func:`skips_max`, as common.cuh's
    ``clamp_middle`` forms it: halfway between min(lo, hi) and hi."""
    lo, hi = _float32_bounds(clamp)
    floor = min(lo, hi)
    return floor + 0.5 * (hi - floor)


def element_strides_3d(a) -> tuple:
    """``a``'s (N, C, *spatial) element strides as int64 kernel arguments, a 2-D array's
    with a unit depth's (0)."""
    strides = [s // a.itemsize for s in a.strides]
    return tuple(numpy.int64(s) for s in strides[:2] + [0] * (5 - a.ndim) + strides[2:])


def channel_sample_grid(channels: int, samples: int) -> tuple[int, int]:
    """The grid of a kernel whose block (c, j) checks output channel c's weight and returns
    where it is finite, else recomputes the channel's rows of the samples j, j + gridDim.y,
    ...: enough blocks for a recomputation to fill the device (256, where there are as many
    rows, and a block for every 256 samples), about 1/256 of a block per (sample, channel)
    row for the checks."""
    return channels, min(samples, MAX_GRID_YZ, max(-(-256 // channels), -(-samples // 256)))


def definition_args(x, w, out_shape: tuple[int, ...], *, groups: int, c_out_group: int, stride,
                    padding, dilation) -> tuple:
    """The geometry of a convolution-by-definition kernel (common.cuh's
    ``TransposedConvDefinition``, conv_gemm.cu's ``conv_nonfinite_weight_rows``) from the
    input channels per group to the input's element strides: ``x`` (N, C_in, *spatial) in
    any strides, contiguous ``w``, the output's shape and the convolution's checked options;
    2-D as 3-D with a unit depth."""
    i32 = numpy.int32
    lift = (1,) * (5 - x.ndim)
    return (i32(x.shape[1] // groups), i32(c_out_group),
            *(i32(v) for v in lift + tuple(x.shape[2:])),
            *(i32(v) for v in lift + tuple(out_shape[2:])),
            *(i32(v) for v in lift + tuple(w.shape[2:])), *(i32(v) for v in lift + tuple(stride)),
            *(i32(v) for v in (0,) * len(lift) + tuple(padding)),
            *(i32(v) for v in lift + tuple(dilation)), *element_strides_3d(x))


def cpp_bool(flag) -> str:
    """A template argument for a ``bool`` parameter: ``"true"`` or ``"false"``."""
    return "true" if flag else "false"
