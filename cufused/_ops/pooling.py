"""Pooling: ``max_pool2d``, ``max_pool3d``, ``avg_pool2d``, ``avg_pool3d``.

Floor mode, stride defaulting to the kernel size, implicit ``-inf`` (max) or zero (average,
counted in the divisor as PyTorch's default ``count_include_pad=True``) padding. One N-d
kernel serves both ranks.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy

from .. import reference
from .._arrays import (Size, check_fits, check_float_dtype, check_ndim, check_out,
                       check_required, check_sizes, forward, get_array_module, ntuple,
                       one_sample)
from .._call_graphs import replayed, warm_calls
from .._kernels.pooling import pool_into

__all__ = ["max_pool2d", "max_pool3d", "avg_pool2d", "avg_pool3d"]


def check_gpu_spatial_sizes(x: Any) -> None:
    """A pool's input on the GPU: each spatial size below 2**31 (32-bit kernel arguments; the
    options are below 2**31 by :func:`ntuple`)."""
    if any(s >= 2**31 for s in x.shape[2:]):
        raise ValueError(f"x's spatial sizes must each be below 2**31 on the GPU (32-bit "
                         f"kernel arguments), got shape {x.shape}")


def check_pool_args(in_size, nd: int, kernel_size, stride, padding, *, name: str = "x",
                    unpadded_window: bool = False, kernel_name: str = "kernel_size"):
    """Validate pooling options; return ``(kernel, stride, padding, out_size)`` tuples.

    With ``unpadded_window`` the window must also fit in the unpadded input, as PyTorch's
    ``avg_pool3d`` requires. ``name`` is the pooled array's and ``kernel_name`` the window
    argument's, as the caller's user knows them.
    """
    kernel = ntuple(kernel_size, nd, kernel_name, minimum=1)
    # None or an empty sequence: the window's size, as PyTorch's pools read it.
    empty = isinstance(stride, (tuple, list)) and not stride
    stride = kernel if stride is None or empty else ntuple(stride, nd, "stride", minimum=1)
    padding = ntuple(padding, nd, "padding", minimum=0)
    if any(p > k // 2 for p, k in zip(padding, kernel)):
        raise ValueError(f"padding must be at most half the kernel size, got padding={padding} "
                         f"for kernel_size={kernel}")
    out_size = tuple((in_size[i] + 2 * padding[i] - kernel[i]) // stride[i] + 1
                     for i in range(nd))
    if any(in_size[i] + 2 * padding[i] < kernel[i] for i in range(nd)):
        padded = f"the padded {name} (padding {padding}, " if any(padding) else f"{name} ("
        raise ValueError(f"{kernel_name}: pooling window {kernel} is larger than {padded}"
                         f"spatial size {tuple(in_size)})")
    if unpadded_window and any(in_size[i] < kernel[i] for i in range(nd)):
        raise ValueError(f"{kernel_name}: pooling window {kernel} is larger than {name} "
                         f"(spatial size {tuple(in_size)})")
    return kernel, stride, padding, out_size


def _pool(nd: int, is_max: bool, x, out, *, kernel_size, stride, padding):
    check_required(x=x)
    xp = get_array_module(x=x)
    check_float_dtype(xp, x=x)
    if x.ndim == nd + 1:  # unbatched, as PyTorch takes it
        return one_sample(partial(_pool, nd, is_max, kernel_size=kernel_size, stride=stride,
                                  padding=padding), x, out)
    check_ndim(x, "x", nd + 2, "NCHW" if nd == 2 else "NCDHW", unbatched=True)
    check_sizes(x, "x")
    kernel, stride, padding, out_size = check_pool_args(
        x.shape[2:], nd, kernel_size, stride, padding, unpadded_window=nd == 3 and not is_max)
    if xp is numpy:  # the reference pads its input
        check_fits((*x.shape[:2], *(s + 2 * p for s, p in zip(x.shape[2:], padding))), xp,
                   "the padded input of the pool")
    else:
        check_gpu_spatial_sizes(x)
    fn = reference.max_pool if is_max else reference.avg_pool
    check_out(out, x.shape[:2] + out_size, x.dtype, xp, x, inputs={"x": x})
    return forward(xp, x, out, x.shape[:2] + out_size,
                   reference=partial(fn, x, kernel, stride, padding),
                   gpu=replayed(partial(_pool_gpu, xp, x, kernel, stride, padding, is_max)))


def _pool_gpu(xp, x, kernel, stride, padding, is_max, out):
    pool_into(xp.ascontiguousarray(x), out, kernel, stride, padding, is_max=is_max)
    return out


_DOC = """{title}

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Shape {shape}, or without the batch axis (unbatched, as PyTorch takes it).
    kernel_size : int or tuple of int
        Window size, one value or one per spatial dimension.
    stride : int or tuple of int, optional
        Window step; defaults to ``kernel_size``.
    padding : int or tuple of int
        Implicit padding on both sides ({pad}); at most half the kernel size.
    out : array, optional
        Destination with exactly the result's shape and dtype.

    Returns
    -------
    array
        Shape (N, C, {outdims}) (no N for an unbatched ``x``) with ``out = (in + 2 *
        padding - kernel) // stride + 1``.

    Raises
    ------
    TypeError
        Not an array, an unsupported dtype, or a window, stride or padding that is not an int
        or a tuple of ints.
    ValueError
        Wrong ndim, bad options, a window larger than the padded input (for ``avg_pool3d``,
        as in PyTorch, larger than the unpadded input), or on the GPU a spatial size of
        2**31 or more.

    Examples
    --------
    {example}
"""


def _pool_op(nd: int, is_max: bool, example_input: str, example_result: str):
    """The public pooling function of rank ``nd`` and kind ``is_max``, with its docstring."""
    def pool(x: Any, kernel_size: Size, stride: Size | None = None,
             padding: Size = 0, *, out: Any = None) -> Any:
        return _pool(nd, is_max, x, out, kernel_size=kernel_size, stride=stride,
                     padding=padding)

    name = f"{'max' if is_max else 'avg'}_pool{nd}d"
    pool.__name__ = pool.__qualname__ = name
    dims = ("D", "H", "W")[3 - nd:]
    title = (f"{nd}-D max pooling, as ``torch.nn.functional.{name}``; a NaN in a window "
             "gives NaN." if is_max else
             f"{nd}-D average pooling, as ``torch.nn.functional.{name}``.")
    pool.__doc__ = _DOC.format(
        title=title, shape=f"(N, C, {', '.join(dims)})",
        pad="``-inf``" if is_max else "zeros, counted in the divisor",
        outdims=", ".join(f"{d}_out" for d in dims),
        example=f""">>> import numpy as np, cufused
    >>> x = {example_input}
    >>> cufused.{name}(x, 2)
    {example_result}""")
    return warm_calls(pool)


_X2, _X3 = "np.arange(16.0).reshape(1, 1, 4, 4)", "np.arange(8.0).reshape(1, 1, 2, 2, 2)"
max_pool2d = _pool_op(2, True, _X2, """array([[[[ 5.,  7.],
             [13., 15.]]]])""")
max_pool3d = _pool_op(3, True, _X3, "array([[[[[7.]]]]])")
avg_pool2d = _pool_op(2, False, _X2, """array([[[[ 2.5,  4.5],
             [10.5, 12.5]]]])""")
avg_pool3d = _pool_op(3, False, _X3, "array([[[[[3.5]]]]])")
