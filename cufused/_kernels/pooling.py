"""Launchers of ``pooling.cu``: the N-d pools, the 2-window pool into a channels-last
destination, the pipelines' fused window-extremum + statistics pass and its recomputation of
channels with a non-finite parameter."""

from __future__ import annotations

import numpy

from .._arrays import get_array_module
from .._cuda import MAX_GRID_YZ, fits_grid_yz, get_kernel, launch_1d, optional
from .._layout import stored_in
from ._common import cpp_bool, split_count
from .layout import transpose_channels

_FILE = "pooling.cu"

# Instantiated (K, T) of pool_extremum_stats_nhwc_rows: T = K * C / 128 float4 per lane and
# window row (C = 32 ... 128); larger T would spill.
_ROWS_KERNELS = ((2, 1), (2, 2), (4, 1), (4, 2))
# Floats in one chunk of pool_extremum_stats_nchw_bands (32 lanes x 10 float4): the most
# that one K-row band may hold.
_BAND_CHUNK = 32 * 10 * 4
# The variant that stores the pooled extrema channels-last (one float4 per thread, no
# staging through shared memory), by pool size; the next pass transposes them while reading.
_CHANNELS_LAST_EXT = {2: "vec4", 4: "rows"}


def pool_into(x, y, kernel, stride, padding, *, is_max: bool) -> None:
    """Pool contiguous CuPy ``x`` into ``y`` (logical (N, C, *out); any strides).

    A 2x2 or 2x2x2 window with stride 2 and no padding takes the unrolled kernel, or, when
    ``y`` is channels-last, a tiled kernel that writes it with coalesced stores; other windows
    pool into a contiguous temporary that one tiled transpose moves to a channels-last ``y``.
    """
    nd = x.ndim - 2
    n, c = x.shape[:2]
    fixed = kernel == stride == (2,) * nd and not any(padding)
    if c > 1 and stored_in(y, "nhwc"):
        spatial = y.size // (n * c)
        if (fixed and x.shape[-1] % 2 == 0 and x.data.ptr % 8 == 0 and c * spatial < 2**31
                and fits_grid_yz(c, 32)):  # pool2_to_channels_last's channel tiles
            pool2_to_channels_last(x, y, is_max=is_max)
        else:
            pooled = get_array_module(x=x).empty(y.shape, dtype=y.dtype)
            pool_into(x, pooled, kernel, stride, padding, is_max=is_max)
            transpose_channels(pooled, y, to_channels_last=True)
        return
    pool_nd(x, y, kernel, stride, padding, is_max=is_max)


def pool2_to_channels_last(x, y, *, is_max: bool) -> None:
    """The 2-window, stride-2 pool of contiguous ``x`` into channels-last ``y``."""
    nd = x.ndim - 2
    n, c = x.shape[:2]
    spatial = y.size // (n * c)
    i32 = numpy.int32
    name = f"pool2_to_channels_last<{cpp_bool(is_max)}, {2 if nd == 3 else 1}>"
    get_kernel(_FILE, name)(
        (-(-spatial // 32), -(-c // 32), min(n, MAX_GRID_YZ)), (32, 8),
        (x, y, numpy.int64(n), i32(c), *map(i32, (1,) * (3 - nd) + x.shape[2:]),
         *map(i32, (1,) * (3 - nd) + y.shape[2:])))


def pool_nd(x, y, kernel, stride, padding, *, is_max: bool) -> None:
    """Pool contiguous ``x`` into ``y`` of any strides (2-D as 3-D with a unit depth)."""
    nd = x.ndim - 2
    c = x.shape[1]
    fixed = kernel == stride == (2,) * nd and not any(padding)
    i32 = numpy.int32
    pad3 = (1,) * (3 - nd)
    in3 = pad3 + x.shape[2:]
    out3 = pad3 + y.shape[2:]
    k3, s3, p3 = pad3 + kernel, pad3 + stride, (0,) * (3 - nd) + padding
    ystr = [s // y.itemsize for s in y.strides]
    ystr3 = ystr[:2] + [0] * (3 - nd) + ystr[2:]
    window = f"{k3[0]}, 2" if fixed else "0, 0"
    args = (x, y, numpy.int64(y.size), i32(c), *map(i32, in3), *map(i32, out3),
            *map(i32, k3), *map(i32, s3), *map(i32, p3), *map(numpy.int64, ystr3))
    launch_1d(get_kernel(_FILE, f"pool_nd<{cpp_bool(is_max)}, {window}>"), y.size, args)


def _pass_geometry(y, pool: int) -> tuple[bool, tuple[int, ...], int]:
    """``y``'s (channels-last flag, element strides, the pool size when a kernel has it fixed
    (2 or 4) else 0), as the fused pass's kernels see them."""
    channels_last = y.strides[1] == y.itemsize and y.shape[1] > 1
    return (channels_last, tuple(s // y.itemsize for s in y.strides),
            pool if pool in (2, 4) else 0)


def fused_pass_variant(y, pool: int, variant: str | None = None) -> str:
    """The kernel variant of the fused pass (see ``pool_extremum_stats``) for ``y``.

    ``variant`` forces one (timing comparisons; ValueError where it does not apply); None
    picks the fastest measured one that applies.
    """
    n, c, h, w = y.shape
    channels_last, (sn, sc, sh, sw), fixed = _pass_geometry(y, pool)
    aligned4 = bool(channels_last and fixed and c % 4 == 0 and sh % 4 == 0 and sw % 4 == 0
                    and sn % 4 == 0 and y.data.ptr % 16 == 0)
    rows_t = fixed * c // 128 if aligned4 and sw == c and 32 % (c // 4) == 0 else 0
    bands = bool(not channels_last and fixed and sw == 1 and sh == w and sc == h * w
                 and fixed * w % 4 == 0 and h * w % 4 == 0 and sn % 4 == 0
                 and y.data.ptr % 16 == 0 and fixed * w <= _BAND_CHUNK)
    usable = {"scalar": True, "vec4": aligned4, "rows": (fixed, rows_t) in _ROWS_KERNELS,
              "bands": bands}
    if variant is None:  # the fastest per layout and window on the canonical A and B
        # outputs (timings: docs/design.rst, "The fused pooling + statistics pass")
        return ("rows" if usable["rows"] and fixed == 4 else
                "vec4" if usable["vec4"] and fixed == 2 else
                "bands" if usable["bands"] else "scalar")
    if not usable.get(variant, False):
        raise ValueError(f"kernel variant {variant!r} does not apply to this input")
    return variant


def stores_ext_channels_last(variant: str, pool: int) -> bool:
    """Whether the fused pass's ``variant`` can store the pooled extrema channels-last."""
    return _CHANNELS_LAST_EXT.get(pool) == variant


def _extremum_stats_name(variant: str, *, channels_last: bool, fixed: int, rows_t: int,
                         vec2, ext_channels_last: bool) -> str:
    """The instantiation of the fused pass's kernel ``variant``."""
    if variant == "rows":
        return (f"pool_extremum_stats_nhwc_rows<{fixed}, {rows_t}, "
                f"{cpp_bool(ext_channels_last)}>")
    if variant == "bands":
        return f"pool_extremum_stats_nchw_bands<{fixed}>"
    if variant == "vec4":
        return f"pool_extremum_stats_nhwc4<{fixed}, {cpp_bool(ext_channels_last)}>"
    return f"pool_extremum_stats<{cpp_bool(channels_last)}, {fixed}, {cpp_bool(vec2)}>"


def pool_extremum_stats(xp, y, ext, pool: int, *, bias, sign_a, sign_b, shift_group: int,
                   per_sample: bool, variant: str, ext_block: int):
    """Launch the fused window-extremum + statistics pass; return (partial, shift, splits):
    partial (N, C, splits, 2) float64 sums of ``d`` and ``d * d``, ``d = y + bias - shift``,
    shift each statistics row's first value, 0 where infinite.

    Kernel ``variant`` (from ``fused_pass_variant``): "scalar" (any layout); for
    channels-last inputs "vec4" (16-byte loads, 4 channels per thread) and "rows" (a warp
    reads whole window rows); for NCHW inputs with contiguous planes "bands" (a warp reads
    K-row bands of one plane with 16-byte loads). ``ext`` is NCHW, or 16-byte aligned
    channels-last for a variant that ``stores_ext_channels_last``. A channels-last
    ``ext`` is stored in blocks of ``ext_block`` channels (a multiple of 4 dividing C; see
    ``blocked_channels_last`` in common.cuh), whatever its strides say: pipeline B passes its
    contiguous ``out`` with a GroupNorm group per block. 0: ``ext`` is NCHW. The caller says
    which, since strides cannot: where H = W = 1, or C = 1, an array's strides may fit both.
    """
    n, c, h, w = y.shape
    ho, wo = h // pool, w // pool
    channels_last, (sn, sc, sh, sw), fixed = _pass_geometry(y, pool)
    vec2 = (not channels_last and fixed and sw == 1 and sh % 2 == 0 and sc % 2 == 0
            and sn % 2 == 0 and y.data.ptr % 8 == 0)
    rows_t = fixed * c // 128
    ext_channels_last = ext_block > 0
    if ext_channels_last and not (_CHANNELS_LAST_EXT.get(fixed) == variant
                                  and ext.data.ptr % 16 == 0 and ext_block % 4 == 0
                                  and c % ext_block == 0):
        raise ValueError(f"a channels-last ext needs variant {_CHANNELS_LAST_EXT.get(fixed)!r}"
                         f" for pool {pool} (got {variant!r}), 16-byte alignment and blocks of"
                         f" 4k channels dividing C (got {ext_block})")
    lanes = 8 if channels_last and variant == "scalar" else 16 if variant == "rows" else 32
    c_tiles = 1 if variant == "rows" else -(-c // (32 if channels_last else 8))
    units = ho if variant == "bands" else -(-ho * wo // lanes)  # what splits divide
    splits = max(1, min(split_count(n * c_tiles, 1 << 30), units))
    partial = xp.empty((n, c, splits, 2), dtype=xp.float64)
    shift = xp.empty(n * c // shift_group if per_sample else c // shift_group,
                     dtype=xp.float32)
    name = _extremum_stats_name(variant, channels_last=channels_last, fixed=fixed,
                                rows_t=rows_t, vec2=vec2, ext_channels_last=ext_channels_last)
    i32 = numpy.int32
    get_kernel(_FILE, name)(
        (splits * c_tiles * n,), (32, 8),
        (y, optional(bias), optional(sign_a), optional(sign_b), ext, partial, shift, i32(c),
         i32(h), i32(w), i32(pool), i32(ho), i32(wo), i32(splits), i32(c_tiles),
         numpy.int64(sn), numpy.int64(sc), i32(sh), i32(sw), i32(shift_group),
         i32(per_sample), i32(ext_block)))
    return partial, shift, splits


def _strides(y) -> tuple:
    """``y``'s element strides as ``index_t`` arguments."""
    return tuple(numpy.int64(st // y.itemsize) for st in y.strides)


def pool_affine_nonfinite(y, out, moments, *, bias, gamma, beta, scale, num_groups: int,
                          pool: int, lo: float, hi: float) -> None:
    """Pipeline A's channels with a non-finite GroupNorm parameter or scale, recomputed into
    ``out`` (N, C, Ho, Wo) from the conv output ``y`` by the definition (see the kernel; in
    PyTorch CUDA's centered form where ``y`` has one value per channel); a call with finite
    parameters costs one check per channel on the device."""
    n, c = y.shape[:2]
    i32 = numpy.int32
    get_kernel(_FILE, "pool_affine_nonfinite")(
        (c,), (256,),
        (y, optional(bias), moments, optional(gamma), optional(beta), optional(scale), out,
         i32(n), i32(c), i32(num_groups), i32(pool), i32(out.shape[2]), i32(out.shape[3]),
         *_strides(y), numpy.float32(lo), numpy.float32(hi), i32(y.shape[2] * y.shape[3] == 1)))


def pool_affine_nonfinite_conv(x, w, out, moments, *, bias, gamma, beta, scale,
                               num_groups: int, pool: int, stride: tuple[int, int],
                               padding: tuple[int, int], dilation: tuple[int, int], lo: float,
                               hi: float) -> None:
    """:func:`pool_affine_nonfinite` where the convolution output was never stored: the
    flagged planes' values are computed from ``x`` (N, C_in, H, W) and ``w`` (C, C_in, kh,
    kw) directly."""
    n, c = out.shape[:2]
    cin, h, wd = x.shape[1:]
    kh, kw = w.shape[2:]
    i32 = numpy.int32
    get_kernel(_FILE, "pool_affine_nonfinite_conv")(
        (c,), (256,),
        (x, w, optional(bias), moments, optional(gamma), optional(beta), optional(scale), out,
         i32(n), i32(c), i32(num_groups), i32(pool), i32(out.shape[2]), i32(out.shape[3]),
         i32(cin), i32(h), i32(wd), i32(kh), i32(kw), i32(stride[0]), i32(stride[1]),
         i32(padding[0]), i32(padding[1]), i32(dilation[0]), i32(dilation[1]),
         numpy.float32(lo), numpy.float32(hi)))


def pool_bn_tanh_nonfinite(y, ext, moments, coef, *, bias, gamma, beta, pool: int,
                           ext_block: int) -> None:
    """Pipeline B's channels with a non-finite BatchNorm parameter or bias, recomputed into
    the pooled ``ext`` (N, C, Ho, Wo; channels-last in blocks of ``ext_block`` channels
    where nonzero) from the conv output ``y``, with their pre-map coefficients (see the
    kernel; ``coef``: the (3, C) BatchNorm coefficients)."""
    n, c = y.shape[:2]
    i32 = numpy.int32
    get_kernel(_FILE, "pool_bn_tanh_nonfinite")(
        (c,), (256,),
        (y, optional(bias), moments, optional(gamma), optional(beta), coef, ext,
         i32(n), i32(c), i32(pool), i32(ext.shape[2]), i32(ext.shape[3]), *_strides(y),
         i32(ext_block)))
