"""Softmax over one axis or a tuple of axes (the "spatial softmax" is ``axis=(2, 3, 4)``)."""

from __future__ import annotations

import numbers
from functools import partial
from typing import Any

import numpy

from .. import reference
from .._arrays import (Size, check_fits, check_float_dtype, check_out, check_required,
                       forward, get_array_module, like_x_sections)
from .._call_graphs import replayed, warm_calls
from .._kernels.softmax import softmax_rows

__all__ = ["softmax"]

_ROWS_PER_CALL = 2**31 - 1  # rows that one softmax_rows call counts as channels


def normalize_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    """Turn an int or a tuple of ints into sorted, non-negative, distinct axes."""
    items = (axis,) if isinstance(axis, numbers.Integral) else axis
    if not isinstance(items, (tuple, list)) or not all(
            isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in items):
        raise TypeError(f"axis must be an int or a non-empty tuple of ints, got {axis!r}")
    if not items:
        raise ValueError(f"axis must be an int or a non-empty tuple of ints, got {axis!r}")
    axes = []
    for a in items:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of bounds for an array of ndim {ndim}")
        axes.append(int(a) % ndim)
    if len(set(axes)) != len(axes):
        raise ValueError(f"axis contains a repeated axis: {axis!r}")
    return tuple(sorted(axes))


@warm_calls
@like_x_sections("A 0-d ``x``, no axis (``axis=()``), or an axis out of range or repeated.",
                 type_error="Not an array, an unsupported dtype, or a non-integer axis.")
def softmax(x: Any, axis: Size = -1, *, out: Any = None) -> Any:
    """Softmax over ``axis``, as ``torch.softmax``, where ``axis`` may be a tuple of axes.

    ``exp(x - max) / sum(exp(x - max))`` over the elements that share every other index.
    On the GPU: one pass for the per-row (max, sum) pairs (an online softmax, split across
    blocks) and one normalize pass.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Any shape with at least one dimension.
    axis : int or tuple of int
        The axis or axes normalized together.

    Examples
    --------
    >>> import numpy as np, cufused
    >>> cufused.softmax(np.log(np.array([[1.0, 3.0], [2.0, 2.0]])), axis=1)
    array([[0.25, 0.75],
           [0.5 , 0.5 ]])
    >>> float(cufused.softmax(np.zeros((1, 2, 2, 2, 2)), axis=(2, 3, 4))[0, 0].sum())
    1.0
    """
    check_required(x=x)
    xp = get_array_module(x=x)
    check_float_dtype(xp, x=x)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension")
    axes = normalize_axes(axis, x.ndim)
    check_fits(x.shape, xp, "the result")
    check_out(out, x.shape, x.dtype, xp, x, inputs={"x": x}, in_place=True)
    return forward(xp, x, out, x.shape,
                   reference=partial(reference.softmax, x, axes),
                   gpu=replayed(partial(_softmax_gpu, xp, x, axes)))


def _softmax_gpu(xp, x, axes, out):
    """Softmax over ``axes`` moved last and contiguous: rows of their product's length."""
    kept = tuple(a for a in range(x.ndim) if a not in axes)
    perm = kept + axes
    moved = xp.ascontiguousarray(x.transpose(perm))
    length = int(numpy.prod([x.shape[a] for a in axes]))
    if perm == tuple(range(x.ndim)):
        _contiguous_rows(xp, moved, out, length)
        return out
    result = xp.empty(moved.shape, dtype=x.dtype)
    _contiguous_rows(xp, moved, result, length)
    out[...] = result.transpose(numpy.argsort(perm))
    return out


def _contiguous_rows(xp, x, out, length: int) -> None:
    """Softmax of the contiguous rows of ``length`` values of ``x`` into contiguous ``out``,
    one sample of the rows as channels: the kernels count channels in 32 bits, so more rows
    than that run in parts."""
    rows = x.size // length
    if rows <= _ROWS_PER_CALL:
        softmax_rows(xp, x, out, rows=rows, length=length, channels=rows,
                     strides=(0, length, 1))
        return
    x, out = x.reshape(rows, length), out.reshape(rows, length)
    for first in range(0, rows, _ROWS_PER_CALL):
        part = slice(first, first + _ROWS_PER_CALL)
        count = min(rows - first, _ROWS_PER_CALL)
        softmax_rows(xp, x[part], out[part], rows=count, length=length, channels=count,
                     strides=(0, length, 1))
