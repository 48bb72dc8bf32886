"""Softmax over one axis or a tuple of axes (the "spatial softmax" is ``axis=(2, 3, 4)``)."""

from __future__ import annotations

import numbers
from typing import Any

import numpy

from . import reference
from ._arrays import (Size, check_float_dtype, check_out, check_required, finish_numpy,
                      get_array_module, run_reference)
from ._cuda import get_kernel, launch_1d, optional
from .normalization import split_count

__all__ = ["softmax"]

_SOFTMAX = "softmax.cu"

# softmax_rows_cluster: 8 blocks of 256 threads per row, each holding at most 64 KB of it.
_CLUSTER_BLOCKS = 8
_CLUSTER_THREADS = 256
_CLUSTER_BYTES = 64 * 1024
# exp(-60) ~ 1e-26: with a clamp narrower than this, exp(v - hi) cannot underflow to zero for
# a whole row, so no running maximum is needed.
_MAX_FREE_CLAMP = 60.0


def normalize_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    """Turn an int or a tuple of ints into sorted, non-negative, distinct axes."""
    items = (axis,) if isinstance(axis, numbers.Integral) else axis
    if not isinstance(items, (tuple, list)) or not items or not all(
            isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in items):
        raise TypeError(f"axis must be an int or a non-empty tuple of ints, got {axis!r}")
    axes = []
    for a in items:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of bounds for an array of ndim {ndim}")
        axes.append(int(a) % ndim)
    if len(set(axes)) != len(axes):
        raise ValueError(f"axis contains a repeated axis: {axis!r}")
    return tuple(sorted(axes))


def cluster_row_split(classes: tuple[int, int, int], class_dims: tuple[int, int, int]):
    """``(classes, class_dims, shared bytes)`` for ``softmax_rows_cluster``, or ``None``.

    A row is ``classes`` = (SD, SH, SW) class blocks of ``class_dims`` = (Md, Mh, Mw) values
    each (contiguous rows: classes (1, 1, 1), dims (8, 1, length / 8)). The kernel's 8 blocks
    take Md / 8 planes of every class each, at most 64 KB in all, with 16-byte loads and
    stores: Md % 8 == 0, Mh * Mw % 4 == 0, SW * Mw % 4 == 0, at most 2 classes per axis.
    """
    sd, sh, sw = classes
    md, mh, mw = class_dims
    nbytes = 4 * sd * sh * sw * (md // _CLUSTER_BLOCKS) * mh * mw
    if (max(classes) > 2 or md % _CLUSTER_BLOCKS or (mh * mw) % 4 or (sw * mw) % 4
            or not 0 < nbytes <= _CLUSTER_BYTES):
        return None
    return (sd, sh, sw), (md, mh, mw), nbytes


def stats_quads(channels: int) -> int:
    """Threads per position of ``softmax_stats_nhwc4`` (4 channels each): the largest power of
    two up to 32 that divides ``channels / 4``; 0 where ``channels % 4 != 0``."""
    if channels % 4:
        return 0
    quads = 32
    while (channels // 4) % quads:
        quads //= 2
    return quads


def one_read_geometry(y, out, layout: str, length: int, channels: int, strides,
                      clamp) -> tuple | None:
    """:func:`cluster_row_split` of ``y``'s rows where the one-read kernel applies, else None.

    It needs thread-block clusters (compute capability 9.0), a clamp narrow enough to skip
    the running maximum, 16-byte aligned buffers, and either contiguous rows ("nchw") or a
    sub-pixel convolution's class blocks ("classes").
    """
    import cupy

    if clamp is None or clamp[1] - clamp[0] > _MAX_FREE_CLAMP:
        return None
    if int(cupy.cuda.Device().compute_capability) < 90:
        return None
    if y.data.ptr % 16 or out.data.ptr % 16:
        return None
    if layout == "classes":
        from ._kernels.layout import class_geometry

        sw, _, _, (_, _, md, mh, mw, sd, sh) = class_geometry(y, out)
        return cluster_row_split((int(sd), int(sh), sw), (int(md), int(mh), int(mw)))
    if (layout == "nchw" and tuple(strides[1:]) == (length, 1) and length % _CLUSTER_BLOCKS == 0
            and (strides[0] == channels * length or length * channels == y.size)):
        return cluster_row_split((1, 1, 1), (_CLUSTER_BLOCKS, 1, length // _CLUSTER_BLOCKS))
    return None


def softmax_rows_nonfinite_weight(cupy, x, weight, out, args, *, bias, scale,
                                  clamp: tuple[float, float]) -> None:
    """Pipeline C's rows whose output channel has a non-finite transposed-convolution weight,
    recomputed by the definition after :func:`softmax_rows` (see the kernel): the convolution
    algorithm's NaNs from the zeros it inserts would otherwise differ from PyTorch's. A call
    with a finite weight costs one weight check per row on the device, no host sync.

    ``x`` is the (pooled) convolution input, logical (N, C_in, D, H, W) in any strides;
    ``args`` the transposed convolution's checked options; ``out`` the contiguous result.
    """
    w = cupy.ascontiguousarray(weight)
    n, c = out.shape[:2]
    i32 = numpy.int32
    get_kernel(_SOFTMAX, "softmax_rows_nonfinite_weight")(
        (n * c,), (256,),
        (x, w, optional(bias), optional(scale), out, i32(c), i32(x.shape[1] // args.groups),
         i32(w.shape[1]), *(i32(v) for v in x.shape[2:]), *(i32(v) for v in out.shape[2:]),
         *(i32(v) for v in w.shape[2:]), *(i32(v) for v in args.stride),
         *(i32(v) for v in args.padding), *(i32(v) for v in args.dilation),
         *(numpy.int64(st // x.itemsize) for st in x.strides),
         numpy.float32(clamp[0]), numpy.float32(clamp[1])))


def softmax_rows(cupy, y, out, rows: int, length: int, channels: int, strides, *,
                 layout: str = "nchw", bias=None, scale=None, clamp=None,
                 vec4: bool = True, one_read: bool = True) -> None:
    """Softmax of ``rows`` = N * ``channels`` rows of ``length`` values, into contiguous ``out``.

    ``y`` is read through element ``strides`` (sn, sc, ss) in ``layout``: "nchw",
    "nhwc" (channel stride 1: the thread mapping and a tiled transposing normalize pass change)
    or "classes" (a sub-pixel convolution's class blocks (P, N, C, *M), see
    :func:`cufused._kernels.layout.class_geometry`; ``strides`` unused). ``bias`` is added and
    ``clamp = (lo, hi)`` applied before the softmax; the result is multiplied by ``scale[c]``.
    When ``hi - lo`` is small, exp(v - hi) can neither overflow nor underflow, so no running
    maximum is needed; then, where :func:`one_read_geometry` allows, one kernel reads ``y``
    once (a thread-block cluster per row). Otherwise a statistics pass and a normalize pass
    run. ``vec4=False`` keeps both channels-last passes on their scalar kernels and
    ``one_read=False`` the two passes (timings).
    """
    lo, hi = clamp if clamp is not None else (0.0, 0.0)
    cp = str(clamp is not None).lower()
    f32, i32 = numpy.float32, numpy.int32
    geometry = one_read and one_read_geometry(y, out, layout, length, channels, strides, clamp)
    if geometry:
        classes, dims, nbytes = geometry
        name = f"softmax_rows_cluster<{', '.join(map(str, classes))}>"
        kernel = get_kernel(_SOFTMAX, name, shared_bytes=nbytes)
        kernel((rows * _CLUSTER_BLOCKS,), (_CLUSTER_THREADS,),
               (y, out, optional(bias), optional(scale), i32(channels),
                *(i32(v) for v in dims), f32(lo), f32(hi)), shared_mem=nbytes)
        return
    channels_last = layout == "nhwc"
    parts = y.shape[0] if layout == "classes" else 1
    if layout == "classes":
        # Each class block is an NCHW tensor of rows of length / parts values: the statistics
        # pass sees parts * N samples and the finalize merges a row's parts.
        length //= parts
        strides = (channels * length, length, 1)
    n = rows // channels * parts
    sn, sc, ss = (numpy.int64(s) for s in strides)
    # 16-byte loads of 4 channels of a position (both passes), and stores of 4 positions.
    loads4 = (vec4 and channels_last and channels % 4 == 0 and sn % 4 == 0 and ss % 4 == 0
              and y.data.ptr % 16 == 0)
    stores4 = loads4 and length % 4 == 0 and out.data.ptr % 16 == 0
    quads = stats_quads(channels) if loads4 else 0
    c_tiles = (channels // (4 * quads) if quads else
               -(-channels // (32 if channels_last else 8)))
    splits = split_count(n * c_tiles, length)
    splits = max(1, min(splits, -(-length // 32)))
    online = clamp is None or hi - lo > _MAX_FREE_CLAMP
    cl, on = (str(v).lower() for v in (channels_last, online))
    partial = cupy.empty((parts * rows, splits, 2), dtype=cupy.float32)
    if quads:
        get_kernel(_SOFTMAX, f"softmax_stats_nhwc4<{on}, {cp}>")(
            (splits * c_tiles * n,), (256,),
            (y, optional(bias), partial, i32(channels), numpy.int64(length), i32(splits),
             i32(c_tiles), i32(quads), sn, ss, f32(lo), f32(hi)))
    else:
        get_kernel(_SOFTMAX, f"softmax_stats<{cl}, {on}, {cp}>")(
            (splits * c_tiles * n,), (32, 8),
            (y, optional(bias), partial, i32(channels), numpy.int64(length), i32(splits),
             i32(c_tiles), sn, sc, ss, f32(lo), f32(hi)))
    coef = cupy.empty((2, rows), dtype=cupy.float32)
    get_kernel(_SOFTMAX, "softmax_finalize")(
        (-(-rows * 32 // 256),), (256,),
        (partial, numpy.int64(rows), i32(channels), i32(splits), i32(parts), optional(scale),
         coef[0], coef[1]))
    if layout == "classes":
        from ._kernels.layout import class_geometry

        sw, vec, items, geometry = class_geometry(y, out)
        launch_1d(get_kernel(_SOFTMAX, f"softmax_apply_subpixel<{cp}, {sw}, {vec}>"), items,
                  (y, out, optional(bias), coef[0], coef[1], *geometry, f32(lo), f32(hi)))
        return
    if channels_last:
        get_kernel(_SOFTMAX, f"softmax_apply_transpose{'4' if stores4 else ''}<{cp}>")(
            (-(-length // 128), -(-channels // 32), n), (32, 8),
            (y, out, optional(bias), coef[0], coef[1], numpy.int64(length), i32(channels), sn,
             ss, f32(lo), f32(hi)))
        return
    vec = 4 if length % 4 == 0 and y.data.ptr % 16 == 0 and out.data.ptr % 16 == 0 else 1
    total = rows * length // vec
    launch_1d(get_kernel(_SOFTMAX, f"softmax_apply<{cp}, {vec}>"), total,
              (y, out, optional(bias), coef[0], coef[1], numpy.int64(total),
               numpy.int64(length), i32(channels), f32(lo), f32(hi)))


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
    out : array, optional
        Destination with the shape and dtype of ``x``.

    Returns
    -------
    array
        Same shape, dtype and array library as ``x``.

    Raises
    ------
    TypeError
        Not an array, an unsupported dtype, or a non-integer axis.
    ValueError
        An axis out of range or repeated.

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
    check_out(out, x.shape, x.dtype, xp, x, inputs={"x": x}, in_place=True)
    if xp is numpy and x.size:  # an empty batch falls through to the empty result below
        return finish_numpy(run_reference(reference.softmax, x, axes), x.dtype, out)
    if out is None:
        out = xp.empty(x.shape, dtype=x.dtype)
    if x.size == 0:
        return out
    kept = tuple(a for a in range(x.ndim) if a not in axes)
    perm = kept + axes
    moved = xp.ascontiguousarray(x.transpose(perm))
    length = int(numpy.prod([x.shape[a] for a in axes]))
    rows = x.size // length
    if perm == tuple(range(x.ndim)):
        softmax_rows(xp, moved, out, rows, length, rows, (0, length, 1))
        return out
    result = xp.empty(moved.shape, dtype=x.dtype)
    softmax_rows(xp, moved, result, rows, length, rows, (0, length, 1))
    out[...] = result.transpose(numpy.argsort(perm))
    return out
