"""Launchers of ``softmax.cu``: softmax over rows (a statistics pass, a finalize and a
normalize pass, or one read per row with a thread-block cluster), with an optional bias,
clamp and scale fused; and pipeline C's recomputation of rows with a non-finite weight."""

from __future__ import annotations

import numpy

from .._cuda import MAX_GRID_X, MAX_GRID_YZ, fits_grid_yz, get_kernel, launch_1d, optional
from ._common import channel_sample_grid, cpp_bool, definition_args, skips_max, split_count
from .layout import class_geometry

_FILE = "softmax.cu"

# softmax_rows_cluster: 8 blocks of 256 threads per row, each holding at most 64 KB of it.
_CLUSTER_BLOCKS = 8
_CLUSTER_THREADS = 256
_CLUSTER_BYTES = 64 * 1024


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


def _compute_capability() -> int:
    """The current device's compute capability as an int (90 for 9.0)."""
    import cupy

    return int(cupy.cuda.Device().compute_capability)


def one_read_geometry(y, out, layout: str, length: int, channels: int, strides,
                      clamp) -> tuple | None:
    """:func:`cluster_row_split` of ``y``'s rows where the one-read kernel applies, else None.

    It needs thread-block clusters (compute capability 9.0), a clamp narrow enough to skip
    the running maximum, 16-byte aligned buffers, and either contiguous rows ("nchw") or a
    sub-pixel convolution's class blocks ("classes").
    """
    if not skips_max(clamp):
        return None
    if _compute_capability() < 90:
        return None
    if y.data.ptr % 16 or out.data.ptr % 16:
        return None
    if layout == "classes":
        sw, _, _, (_, _, md, mh, mw, sd, sh) = class_geometry(y, out)
        return cluster_row_split((int(sd), int(sh), sw), (int(md), int(mh), int(mw)))
    if (layout == "nchw" and tuple(strides[1:]) == (length, 1) and length % _CLUSTER_BLOCKS == 0
            and (strides[0] == channels * length or length * channels == y.size)):
        return cluster_row_split((1, 1, 1), (_CLUSTER_BLOCKS, 1, length // _CLUSTER_BLOCKS))
    return None


def _bounds(clamp) -> tuple[float, float]:
    """The clamp's (lo, hi) kernel arguments; (0, 0), unused, without a clamp."""
    return clamp if clamp is not None else (0.0, 0.0)


def softmax_rows(xp, y, out, *, rows: int, length: int, channels: int, strides,
                 layout: str = "nchw", bias=None, scale=None, clamp=None,
                 vec4: bool = True) -> None:
    """Softmax of ``rows`` = N * ``channels`` rows of ``length`` values, into contiguous ``out``.

    ``y`` is read through element ``strides`` (sn, sc, ss) in ``layout``: "nchw",
    "nhwc" (channel stride 1: the thread mapping and a tiled transposing normalize pass change)
    or "classes" (a sub-pixel convolution's class blocks (P, N, C, *M), see
    :func:`cufused._kernels.layout.class_geometry`; ``strides`` unused). ``bias`` is added
    and ``clamp = (lo, hi)`` applied before the softmax; the result is multiplied by
    ``scale[c]``. When ``hi - lo`` is small (:func:`skips_max`), exp(v - the clamp's middle) can
    neither overflow nor underflow, so no running maximum is needed; then, where
    :func:`one_read_geometry` allows, one kernel reads ``y`` once (a thread-block cluster per
    row). Otherwise a statistics pass and a normalize pass run. ``vec4=False`` keeps both
    channels-last passes on their scalar kernels (tests, timings).
    """
    if layout == "nhwc" and not fits_grid_yz(channels, 32):
        # More channel tiles than the transposing normalize pass's grid holds: the rows
        # made contiguous first.
        sn, sc, ss = strides
        logical = xp.lib.stride_tricks.as_strided(
            y, (rows // channels, channels, length),
            tuple(s * y.itemsize for s in (sn, sc, ss)))
        y, layout = xp.ascontiguousarray(logical), "nchw"
        strides = (channels * length, length, 1)
    # The one-read kernel launches a cluster of blocks per row.
    geometry = (one_read_geometry(y, out, layout, length, channels, strides, clamp)
                if rows * _CLUSTER_BLOCKS <= MAX_GRID_X else None)
    if geometry:
        softmax_rows_cluster(y, out, rows=rows, channels=channels, geometry=geometry,
                             bias=bias, scale=scale, clamp=clamp)
        return
    channels_last = layout == "nhwc"
    parts = y.shape[0] if layout == "classes" else 1
    if layout == "classes":
        # Each class block is an NCHW tensor of rows of length / parts values: the statistics
        # pass sees parts * N samples and the finalize merges a row's parts.
        length //= parts
        strides = (channels * length, length, 1)
    n = rows // channels * parts
    loads4, stores4 = _vec4_accesses(y, out, length, channels, strides,
                                     vec4 and channels_last)
    partial, splits = softmax_stats(
        xp, y, n=n, partial_rows=parts * rows, length=length, channels=channels,
        strides=strides, quads=stats_quads(channels) if loads4 else 0,
        channels_last=channels_last, bias=bias, clamp=clamp)
    coef = softmax_finalize(xp, partial, rows=rows, channels=channels, splits=splits, parts=parts,
                            scale=scale)
    if layout == "classes":
        softmax_apply_subpixel(y, out, coef[0], coef[1], bias=bias, clamp=clamp)
    elif channels_last:
        softmax_apply_transpose(y, out, coef[0], coef[1], n=n, length=length,
                                channels=channels, strides=strides, stores4=stores4, bias=bias,
                                clamp=clamp)
    else:
        softmax_apply(y, out, coef[0], coef[1], rows=rows, length=length, channels=channels,
                      bias=bias, clamp=clamp)


def _vec4_accesses(y, out, length: int, channels: int, strides, vec4: bool):
    """(loads4, stores4) of the channels-last passes over ``y`` (element ``strides`` (sn, sc,
    ss)) into ``out``: 16-byte loads of 4 channels of a position (both passes), and stores
    of 4 positions."""
    sn, _, ss = strides
    loads4 = (vec4 and channels % 4 == 0 and sn % 4 == 0 and ss % 4 == 0
              and y.data.ptr % 16 == 0)
    return loads4, loads4 and length % 4 == 0 and out.data.ptr % 16 == 0


def softmax_normalize_channels_last(xp, y, out, partial, *, n: int, length: int, channels: int,
                                    strides, scale, clamp) -> None:
    """The normalize pass of :func:`softmax_rows` from channels-last ``y`` (element
    ``strides`` (sn, sc, ss)) into contiguous ``out``, from the (reference, sum) pairs of
    each row, ``partial`` (N * channels, splits, 2), that a pass of the caller's took:
    clamped, times ``scale[c]``."""
    coef = softmax_finalize(xp, partial, rows=n * channels, channels=channels,
                            splits=partial.shape[1], parts=1, scale=scale)
    softmax_apply_transpose(y, out, coef[0], coef[1], n=n, length=length, channels=channels,
                            strides=strides,
                            stores4=_vec4_accesses(y, out, length, channels, strides, True)[1],
                            bias=None, clamp=clamp)


def softmax_rows_cluster(y, out, *, rows: int, channels: int, geometry, bias, scale,
                         clamp) -> None:
    """The one-read softmax: a cluster of 8 blocks per row (``geometry`` from
    :func:`one_read_geometry`), ``clamp`` required."""
    classes, dims, nbytes = geometry
    lo, hi = _bounds(clamp)
    i32 = numpy.int32
    name = f"softmax_rows_cluster<{', '.join(map(str, classes))}>"
    kernel = get_kernel(_FILE, name, shared_bytes=nbytes)
    kernel((rows * _CLUSTER_BLOCKS,), (_CLUSTER_THREADS,),
           (y, out, optional(bias), optional(scale), i32(channels),
            *(i32(v) for v in dims), numpy.float32(lo), numpy.float32(hi)), shared_mem=nbytes)


def softmax_stats(xp, y, *, n: int, partial_rows: int, length: int, channels: int, strides,
                  quads: int, channels_last: bool, bias, clamp):
    """The statistics pass over ``n`` samples of ``channels`` rows; returns ``(partial,
    splits)``: per row, ``splits`` partial (max, sum) pairs. ``quads`` > 0 takes the 16-byte
    channels-last kernel with that many threads per position."""
    lo, hi = _bounds(clamp)
    cp = cpp_bool(clamp is not None)
    f32, i32 = numpy.float32, numpy.int32
    sn, sc, ss = (numpy.int64(s) for s in strides)
    c_tiles = (channels // (4 * quads) if quads else
               -(-channels // (32 if channels_last else 8)))
    splits = split_count(n * c_tiles, length)
    splits = max(1, min(splits, -(-length // 32)))
    on = cpp_bool(not skips_max(clamp))
    partial = xp.empty((partial_rows, splits, 2), dtype=xp.float32)
    if quads:
        get_kernel(_FILE, f"softmax_stats_nhwc4<{on}, {cp}>")(
            (splits * c_tiles * n,), (256,),
            (y, optional(bias), partial, i32(channels), numpy.int64(length), i32(splits),
             i32(c_tiles), i32(quads), sn, ss, f32(lo), f32(hi)))
    else:
        get_kernel(_FILE, f"softmax_stats<{cpp_bool(channels_last)}, {on}, {cp}>")(
            (splits * c_tiles * n,), (32, 8),
            (y, optional(bias), partial, i32(channels), numpy.int64(length), i32(splits),
             i32(c_tiles), sn, sc, ss, f32(lo), f32(hi)))
    return partial, splits


def softmax_finalize(xp, partial, *, rows: int, channels: int, splits: int, parts: int, scale):
    """Each row's (shift, factor) from its ``parts * splits`` partials, times ``scale[c]``:
    a new (2, rows) float32 array, the shifts in row 0 and the factors in row 1."""
    coef = xp.empty((2, rows), dtype=xp.float32)
    i32 = numpy.int32
    get_kernel(_FILE, "softmax_finalize")(
        (-(-rows * 32 // 256),), (256,),
        (partial, numpy.int64(rows), i32(channels), i32(splits), i32(parts), optional(scale),
         coef[0], coef[1]))
    return coef


def softmax_apply_subpixel(y, out, coef_a, coef_b, *, bias, clamp) -> None:
    """The normalize pass from class blocks ``y`` into the NC(D)HW ``out``."""
    lo, hi = _bounds(clamp)
    sw, vec, items, geometry = class_geometry(y, out)
    launch_1d(get_kernel(_FILE, f"softmax_apply_subpixel<{cpp_bool(clamp is not None)}, {sw}, "
                                f"{vec}>"), items,
              (y, out, optional(bias), coef_a, coef_b, *geometry, numpy.float32(lo),
               numpy.float32(hi)))


def softmax_apply_transpose(y, out, coef_a, coef_b, *, n: int, length: int, channels: int,
                            strides, stores4: bool, bias, clamp) -> None:
    """The normalize pass from channels-last ``y`` into contiguous ``out``, tiled; 16-byte
    stores with ``stores4``."""
    lo, hi = _bounds(clamp)
    sn, _, ss = strides
    cp = cpp_bool(clamp is not None)
    get_kernel(_FILE, f"softmax_apply_transpose<{cp}, {4 if stores4 else 1}>")(
        (-(-length // 128), -(-channels // 32), min(n, MAX_GRID_YZ)), (32, 8),
        (y, out, optional(bias), coef_a, coef_b, numpy.int64(n), numpy.int64(length),
         numpy.int32(channels), numpy.int64(sn), numpy.int64(ss), numpy.float32(lo),
         numpy.float32(hi)))


def softmax_apply(y, out, coef_a, coef_b, *, rows: int, length: int, channels: int, bias,
                  clamp) -> None:
    """The normalize pass over contiguous rows, 16-byte accesses where aligned."""
    lo, hi = _bounds(clamp)
    vec = 4 if length % 4 == 0 and y.data.ptr % 16 == 0 and out.data.ptr % 16 == 0 else 1
    total = rows * length // vec
    launch_1d(get_kernel(_FILE, f"softmax_apply<{cpp_bool(clamp is not None)}, {vec}>"), total,
              (y, out, optional(bias), coef_a, coef_b, numpy.int64(total),
               numpy.int64(length), numpy.int32(channels), numpy.float32(lo),
               numpy.float32(hi)))


def softmax_rows_nonfinite_weight(xp, x, weight, out, *, groups: int, stride, padding,
                                  dilation, bias, scale, clamp: tuple[float, float],
                                  sample_flags=None) -> None:
    """Pipeline C's rows whose output channel has a non-finite transposed-convolution weight,
    recomputed by the definition after :func:`softmax_rows` (see the kernel): the convolution
    algorithm's NaNs from the zeros it inserts would otherwise differ from PyTorch's. A call
    with a finite weight costs a few checks of each channel's weight on the device
    (:func:`~cufused._kernels._common.channel_sample_grid`), no host sync.

    ``x`` is the (pooled) convolution input, logical (N, C_in, D, H, W) in any strides;
    ``groups``, ``stride``, ``padding``, ``dilation`` the transposed convolution's checked
    options; ``out`` the contiguous result. ``sample_flags`` (uint32, N; optional): the
    samples whose rows are all recomputed too, those where x holds a non-finite value after
    an algorithm that spreads it (``conv_gemm.conv_nonfinite_input_flags``).
    """
    w = xp.ascontiguousarray(weight)
    get_kernel(_FILE, "softmax_rows_nonfinite_weight")(
        channel_sample_grid(out.shape[1], out.shape[0]), (256,),
        (x, w, optional(bias), optional(scale), optional(sample_flags), out,
         numpy.int64(out.shape[0]),
         numpy.int32(out.shape[1]),
         *definition_args(x, w, out.shape, groups=groups, c_out_group=w.shape[1], stride=stride,
                          padding=padding, dilation=dilation),
         numpy.float32(clamp[0]), numpy.float32(clamp[1])))
