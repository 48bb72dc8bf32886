"""Launch helpers shared by the launcher modules (the host side of ``common.cuh``)."""

from __future__ import annotations

import numpy

# Aim for at least this many blocks in a split reduction.
_TARGET_BLOCKS = 2048


def split_count(keys: int, elements_per_key: int) -> int:
    """How many blocks share one statistics key (``split_range`` in common.cuh): enough
    blocks overall, at least 1024 values each."""
    want = -(-_TARGET_BLOCKS // max(keys, 1))
    return max(1, min(want, -(-elements_per_key // 1024)))


def transposed_definition_args(x, w, out_shape: tuple[int, ...], *, groups: int, stride,
                               padding, dilation) -> tuple:
    """The arguments of a ``TransposedConvDefinition`` kernel (common.cuh) from the output
    channels ``C`` to the input's element strides: ``x`` (N, C_in, D, H, W) in any strides,
    contiguous ``w``, the output's shape and the transposed convolution's checked options."""
    i32 = numpy.int32
    return (i32(out_shape[1]), i32(x.shape[1] // groups), i32(w.shape[1]),
            *(i32(v) for v in x.shape[2:]), *(i32(v) for v in out_shape[2:]),
            *(i32(v) for v in w.shape[2:]), *(i32(v) for v in stride),
            *(i32(v) for v in padding), *(i32(v) for v in dilation),
            *(numpy.int64(st // x.itemsize) for st in x.strides))


def cpp_bool(flag) -> str:
    """A template argument for a ``bool`` parameter: ``"true"`` or ``"false"``."""
    return "true" if flag else "false"
