"""Launchers of ``layout.cu``: NC(D)HW <-> channels-last transposes, a channel bias, and the
interleave of a sub-pixel convolution's class blocks."""

from __future__ import annotations

import numpy

from .._cuda import MAX_GRID_YZ, get_kernel, launch_1d, optional

_FILE = "layout.cu"


def transpose_channels(src, dst, *, to_channels_last: bool, bias=None, affine=None) -> None:
    """Copy contiguous NC(D)HW ``src`` to channels-last ``dst`` or back (+ ``bias[c]``).

    Both arrays have the same logical shape; ``src``'s memory is in the source layout and
    ``dst``'s in the other one. A tiled transpose, coalesced on both sides (8 channels a
    thread where C is 8 or 16, without bias or affine, buffers 16-byte aligned). Back to
    NC(D)HW, ``affine = (coef, lo, hi)`` instead writes ``clip(coef[0, k] * (src - coef[1, k])
    + coef[2, k], lo, hi)`` with k = n * C + c (coef: (3, N * C), a normalization's
    coefficients as ``stats_finalize`` forms them).
    """
    n, c = src.shape[:2]
    s = src.size // max(n * c, 1)
    a, b = (c, s) if to_channels_last else (s, c)
    if src.size == 0:
        return
    # Few channels idle most of a 32 x 32 tile: 8 channels per thread instead (to
    # channels-last measured faster for C = 8, slower for C >= 32).
    if (bias is None and affine is None and c in (8, 16)
            and src.data.ptr % 16 == 0 and dst.data.ptr % 16 == 0):
        transpose_channels8(src, dst, to_channels_last=to_channels_last, n=n, c=c, s=s)
        return
    if affine is not None:
        coef, lo, hi = affine
        if coef.shape != (3, n * c):
            raise ValueError(f"the affine's coefficients have shape {coef.shape}, not "
                             f"(3, {n * c})")
        epilogue = "EPILOGUE_AFFINE_CLAMP"
    else:
        coef, lo, hi = None, 0.0, 0.0
        epilogue = "EPILOGUE_NONE" if bias is None else "EPILOGUE_BIAS"
    if a * b >= 2**31:  # the kernel's per-sample offsets are 32-bit
        if affine is not None:
            raise ValueError(f"one sample has {a * b} elements; the transposing affine "
                             "supports fewer than 2**31")
        dst[...] = src
        if bias is not None:
            add_channel_bias(dst, bias)
        return
    transpose_batched(src, dst, epilogue=epilogue, bias=bias, coef=coef, lo=lo, hi=hi, n=n,
                      a=a, b=b)


def transpose_channels8(src, dst, *, to_channels_last: bool, n: int, c: int, s: int) -> None:
    """``dst[n, s, c] = src[n, c, s]`` (``to_channels_last``) or ``dst[n, c, s] = src[n, s,
    c]``, for C % 8 == 0 and 16-byte aligned buffers."""
    direction = "true" if to_channels_last else "false"
    launch_1d(get_kernel(_FILE, f"transpose_channels8<{direction}>"), n * (c // 8) * s,
              (src, dst, numpy.int64(n), numpy.int32(c), numpy.int64(s)))


def transpose_batched(src, dst, *, epilogue: str, bias, coef, lo: float, hi: float, n: int,
                      a: int, b: int) -> None:
    """``dst[n, b, a] = epilogue(src[n, a, b])``; ``epilogue`` names an ``EPILOGUE_*`` code."""
    tiles = 4 if b > 64 else 2 if b > 32 else 1  # 32-wide tiles along b per block
    get_kernel(_FILE, f"transpose_batched<{epilogue}, {tiles}>")(
        (-(-b // (32 * tiles)) * -(-a // 32), 1, min(n, MAX_GRID_YZ)), (32, 8),
        (src, dst, optional(bias), optional(coef), numpy.float32(lo), numpy.float32(hi),
         numpy.int64(n), numpy.int64(a), numpy.int64(b)))


def add_channel_bias(y, bias) -> None:
    """``y[:, c] += bias[c]`` in place for a contiguous NC(D)HW ``y``."""
    s = y.size // max(y.shape[0] * y.shape[1], 1)
    vec = 4 if s % 4 == 0 and y.data.ptr % 16 == 0 else 1
    total = y.size // vec
    launch_1d(get_kernel(_FILE, f"add_channel_bias<{vec}>"), total,
              (y, bias, numpy.int64(total), numpy.int64(s), numpy.int32(y.shape[1])))


def class_geometry(classes, out) -> tuple[int, int, int, tuple]:
    """How to launch a kernel built on ``interleave_classes`` (common.cuh).

    ``classes`` holds class blocks of shape (P, N, C, *M) and ``out`` is (N, C, *(s * M)).
    Returns ``(SW, VEC, items, (rows, C, Md, Mh, Mw, sd, sh))``: the template arguments, the
    number of grid-stride items and the geometry arguments, in the kernels' order.
    """
    n, c, *m = classes.shape[1:]
    s = [o // q for o, q in zip(out.shape[2:], m)]
    if len(m) == 2:
        m, s = [1, *m], [1, *s]
    vec = 4 if m[2] % 4 == 0 and classes.data.ptr % 16 == 0 and out.data.ptr % 16 == 0 else 1
    items = n * c * s[0] * m[0] * s[1] * m[1] * (m[2] // vec)
    geometry = (numpy.int64(n * c), numpy.int32(c),
                *(numpy.int32(v) for v in (m[0], m[1], m[2], s[0], s[1])))
    return s[2], vec, items, geometry


def interleave_classes(classes, out, bias=None) -> None:
    """Write a sub-pixel convolution's class blocks into the NC(D)HW ``out`` (+ ``bias[c]``)."""
    sw, vec, items, geometry = class_geometry(classes, out)
    launch_1d(get_kernel(_FILE, f"subpixel_interleave<{sw}, {vec}>"), items,
              (classes, out, optional(bias), *geometry))
