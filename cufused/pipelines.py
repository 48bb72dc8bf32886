"""The three fused pipelines (KernelBench level 2 / Tensara problem names).

Each runs its convolution through cuDNN and everything after it in cufused's own kernels,
reading the large convolution output as few times as possible:

* A, conv2d -> GroupNorm -> scale -> MaxPool -> clamp: GroupNorm * scale is a per-channel
  affine ``a * y + b`` with ``sign(a) = sign(gamma * scale)``; a monotone map commutes with
  max (or, for ``a < 0``, turns it into min), exactly in floating point too. One read of the
  conv output yields the GroupNorm statistics (over every element, also those the pool drops)
  and each window's max or min; a small pass applies the affine and the clamp.
* B, ConvTranspose2d -> BatchNorm (training) -> tanh -> MaxPool -> GroupNorm: one read gives the
  per-channel batch statistics and each window's extremum (tanh is increasing, so the sign of the
  BatchNorm weight decides max or min); one block per (n, group) then applies BatchNorm + tanh
  and GroupNorm on the 4x smaller pooled tensor, cached in shared memory. The convolution bias
  cancels in training-mode BatchNorm and is only added to the running-mean update.
* C, AvgPool3d -> ConvTranspose3d -> clamp -> softmax over D*H*W -> scale: the pool runs first,
  writing the convolution's input directly in the layout its cuDNN plan wants; after the clamp
  to [lo, hi] the softmax needs no max pass (exp(v - hi) <= 1), so one statistics read and one
  normalize-and-scale pass follow, in place in the output when the layout allows.

``method="unfused"`` runs the same math as separate cufused building blocks (the baseline).
"""

from __future__ import annotations

import math
from typing import Any

import numpy

from . import reference
from ._arrays import (Size, check_float_dtype, check_ndim, check_out, check_required,
                      check_scalar, check_sizes, finish_numpy, get_array_module, ntuple,
                      per_channel, run_reference)
from ._cuda import get_kernel, optional
from ._precision import resolve_precision
from ._cudnn import UnsupportedConvolution, empty_in_layout, stored_in, transpose_channels
from .convolution import (cached_conv_args, check_conv_memory, conv2d, conv_on_gpu,
                          conv_transpose2d, conv_transpose3d, gpu_conv_plan)
from .normalization import (_affine_apply, batch_norm, bn_coefficients, check_group_values,
                            check_num_groups, check_running_buffer, check_running_pair,
                            finalize_threads, group_norm, group_rows_fit_channels_last,
                            launch_group_norm_rows, split_count)
from .pooling import avg_pool3d, check_pool_args, max_pool2d, pool_into
from .softmax import softmax, softmax_rows, softmax_rows_nonfinite_weight

__all__ = [
    "conv2d_groupnorm_scale_maxpool_clamp",
    "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
    "conv_transpose3d_avgpool_clamp_softmax_multiply",
]

METHODS = ("fused", "unfused")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def _gpu_method(method: str, conv_out_shape: tuple[int, ...]) -> str:
    """The GPU method that runs: the fused pass indexes within a sample with 32-bit offsets,
    so a larger sample of the convolution output takes the unfused building blocks, which
    index with 64 bits."""
    if method == "fused" and math.prod(conv_out_shape[1:]) >= 2**31:
        return "unfused"
    return method


def _ones_if_none(value, channels: int, xp):
    """``value``, or one for every channel (``scale=None`` means no scaling)."""
    return xp.ones(channels, dtype=xp.float64 if xp is numpy else xp.float32) if (
        value is None) else value


# Instantiated (K, T) of pool_extremum_stats_nhwc_rows: T = K * C / 128 float4 per lane and
# window row (C = 32 ... 128); larger T would spill.
_ROWS_KERNELS = ((2, 1), (2, 2), (4, 1), (4, 2))
# Floats in one chunk of pool_extremum_stats_nchw_bands (32 lanes x 10 float4): the most
# that one K-row band may hold.
_BAND_CHUNK = 32 * 10 * 4


# The variant that stores the pooled extrema channels-last (one float4 per thread, no
# staging through shared memory), by pool size; the next pass transposes them while reading.
_CHANNELS_LAST_EXT = {2: "vec4", 4: "rows"}


def _pass_geometry(y, pool: int) -> tuple[bool, tuple[int, ...], int]:
    """``y``'s (channels-last flag, element strides, the pool size when a kernel has it fixed
    (2 or 4) else 0), as the fused pass's kernels see them."""
    channels_last = y.strides[1] == y.itemsize and y.shape[1] > 1
    return (channels_last, tuple(s // y.itemsize for s in y.strides),
            pool if pool in (2, 4) else 0)


def _fused_pass_variant(y, pool: int, variant: str | None = None) -> str:
    """The kernel variant of the fused pass (see ``_pool_extremum_stats``) for ``y``.

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


def _pool_extremum_stats(cupy, y, ext, pool: int, *, bias, sign_a, sign_b, shift_group: int,
                         per_sample: bool, variant: str, ext_block: int | None = None):
    """Launch the fused window-extremum + statistics pass; return (partial, shift, splits).

    Kernel ``variant`` (from ``_fused_pass_variant``): "scalar" (any layout); for
    channels-last inputs "vec4" (16-byte loads, 4 channels per thread) and "rows" (a warp
    reads whole window rows); for NCHW inputs with contiguous planes "bands" (a warp reads
    K-row bands of one plane with 16-byte loads). ``ext`` is NCHW, or 16-byte aligned
    channels-last for the variant ``_CHANNELS_LAST_EXT`` names for ``pool``. A channels-last
    ``ext`` is stored in blocks of ``ext_block`` channels (a multiple of 4 dividing C; see
    ``blocked_channels_last`` in common.cuh), whatever its strides say: pipeline B passes its
    contiguous ``out`` with a GroupNorm group per block. None: C where ``ext`` is stored
    channels-last, else NCHW.
    """
    n, c, h, w = y.shape
    ho, wo = h // pool, w // pool
    channels_last, (sn, sc, sh, sw), fixed = _pass_geometry(y, pool)
    vec2 = (not channels_last and fixed and sw == 1 and sh % 2 == 0 and sc % 2 == 0
            and sn % 2 == 0 and y.data.ptr % 8 == 0)
    rows_t = fixed * c // 128
    if ext_block is None:
        ext_block = c if stored_in(ext, "nhwc") else 0
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
    partial = cupy.empty((n, c, splits, 2), dtype=cupy.float32)
    shift = cupy.empty(n * c // shift_group if per_sample else c // shift_group,
                       dtype=cupy.float32)
    sn, sc, sh, sw = numpy.int64(sn), numpy.int64(sc), numpy.int32(sh), numpy.int32(sw)
    i32 = numpy.int32
    if variant == "rows":
        kernel = get_kernel("pooling.cu", f"pool_extremum_stats_nhwc_rows<{fixed}, {rows_t}, "
                                          f"{str(ext_channels_last).lower()}>")
    elif variant == "bands":
        kernel = get_kernel("pooling.cu", f"pool_extremum_stats_nchw_bands<{fixed}>")
    elif variant == "vec4":
        kernel = get_kernel("pooling.cu", f"pool_extremum_stats_nhwc4<{fixed}, "
                                          f"{str(ext_channels_last).lower()}>")
    else:
        kernel = get_kernel("pooling.cu", f"pool_extremum_stats<{str(channels_last).lower()}, "
                                          f"{fixed}, {str(bool(vec2)).lower()}>")
    kernel((splits * c_tiles * n,), (32, 8),
           (y, optional(bias), optional(sign_a), optional(sign_b), ext, partial, shift, i32(c),
            i32(h), i32(w), i32(pool), i32(ho), i32(wo), i32(splits), i32(c_tiles), sn, sc, sh,
            sw, i32(shift_group), i32(per_sample), i32(ext_block)))
    return partial, shift, splits


def _tuple_pool(pool_kernel, nd: int) -> int:
    """The pipelines pool with square / cubic windows, stride = kernel."""
    k = ntuple(pool_kernel, nd, "pool_kernel", minimum=1)
    if len(set(k)) != 1:
        raise ValueError(f"pool_kernel must be the same along every axis, got {pool_kernel!r}")
    return k[0]


# --------------------------------------------------------------------------------------------
# A: conv2d -> GroupNorm -> scale -> MaxPool -> clamp


def conv2d_groupnorm_scale_maxpool_clamp(
        x: Any, weight: Any, conv_bias: Any, gn_weight: Any, gn_bias: Any, scale: Any, *,
        num_groups: int, pool_kernel: int, clamp_min: float, clamp_max: float,
        stride: Size = 1, padding: Size = 0, eps: float = 1e-5,
        precision: str | None = None, method: str = "fused", out: Any = None) -> Any:
    """Pipeline A: ``clamp(max_pool2d(group_norm(conv2d(x)) * scale, k), clamp_min, clamp_max)``.

    KernelBench level 2 / Tensara "Conv2d_GroupNorm_Scale_MaxPool_Clamp". The GroupNorm
    statistics cover the whole convolution output, including rows and columns the pool drops.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Input, shape (N, C_in, H, W).
    weight : array
        Convolution weight, shape (C_out, C_in, kH, kW).
    conv_bias, gn_weight, gn_bias : array or None
        Per-output-channel convolution bias and GroupNorm affine.
    scale : array, float or None
        Per-channel multiplier after GroupNorm (e.g. shape (C_out, 1, 1)), one number (a
        Python number or a 0-d array), or None for no scaling.
    num_groups : int
        GroupNorm groups; must divide C_out.
    pool_kernel : int
        Max-pool window and stride (floor mode).
    clamp_min, clamp_max : float
        Finite bounds of the final clamp (``clamp_min > clamp_max`` gives ``clamp_max``, as
        ``torch.clamp``).
    stride, padding : int or tuple of int
        Convolution options.
    eps : float
        GroupNorm epsilon.
    precision : {"ieee", "tf32"}, optional
        Convolution precision; ``None`` uses the default.
    method : {"fused", "unfused"}
        ``"unfused"`` runs separate building blocks (GPU baseline); ignored for NumPy input.
    out : array, optional
        Destination of the result's shape and dtype.

    Returns
    -------
    array
        Shape (N, C_out, H_conv // k, W_conv // k), same library and dtype as ``x``.

    Raises
    ------
    TypeError
        Mixed array libraries or an unsupported dtype.
    ValueError
        Inconsistent shapes or options.

    Examples
    --------
    >>> import numpy as np, cufused
    >>> rng = np.random.default_rng(0)
    >>> x = rng.random((2, 3, 10, 10), dtype=np.float32)
    >>> w = rng.standard_normal((8, 3, 3, 3), dtype=np.float32)
    >>> ones = np.ones(8, dtype=np.float32)
    >>> y = cufused.conv2d_groupnorm_scale_maxpool_clamp(
    ...     x, w, None, ones, None, 2 * ones, num_groups=4, pool_kernel=2,
    ...     clamp_min=0.0, clamp_max=1.0)
    >>> y.shape, y.dtype, bool(y.min() >= 0.0 and y.max() <= 1.0)
    ((2, 8, 4, 4), dtype('float32'), True)
    """
    check_required(x=x, weight=weight)
    xp = get_array_module(x=x, weight=weight, conv_bias=conv_bias, gn_weight=gn_weight,
                          gn_bias=gn_bias, scale=None if numpy.isscalar(scale) else scale)
    check_float_dtype(xp, x=x, weight=weight, conv_bias=conv_bias, gn_weight=gn_weight,
                      gn_bias=gn_bias)
    check_ndim(x, "x", (4,), "NCHW")
    check_sizes(x, "x")
    args = cached_conv_args(x.shape, weight.shape, 2, transposed=False, stride=stride,
                            padding=padding)
    check_conv_memory(x.shape, args, xp)
    c = args.out_shape[1]
    conv_bias = per_channel(conv_bias, "conv_bias", c, xp)
    gn_weight = per_channel(gn_weight, "gn_weight", c, xp)
    gn_bias = per_channel(gn_bias, "gn_bias", c, xp)
    scale = per_channel(scale, "scale", c, xp, allow_scalar=True, broadcast_ndim=4)
    if xp is not numpy:
        check_float_dtype(xp, scale=scale)
    num_groups = check_num_groups(num_groups, c)
    check_group_values(args.out_shape, num_groups, "the conv output")
    k = _tuple_pool(pool_kernel, 2)
    _, _, _, pooled = check_pool_args(args.out_shape[2:], 2, k, k, 0, name="the conv output")
    lo = check_scalar(clamp_min, "clamp_min")
    hi = check_scalar(clamp_max, "clamp_max")
    eps = check_scalar(eps, "eps", minimum=0.0)
    precision = resolve_precision(precision)
    _check_method(method)
    shape = args.out_shape[:2] + pooled
    check_out(out, shape, x.dtype, xp, x, inputs={
        "x": x, "weight": weight, "conv_bias": conv_bias, "gn_weight": gn_weight,
        "gn_bias": gn_bias, "scale": scale})
    if xp is numpy and x.size:  # an empty batch falls through to the empty result below
        y = run_reference(
            reference.conv2d_groupnorm_scale_maxpool_clamp, x, weight, conv_bias, gn_weight,
            gn_bias, _ones_if_none(scale, c, xp), num_groups=num_groups, pool_kernel=(k, k),
            clamp_min=lo, clamp_max=hi, stride=args.stride, padding=args.padding, eps=eps)
        return finish_numpy(y, x.dtype, out)
    if out is None:
        out = xp.empty(shape, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    if _gpu_method(method, args.out_shape) == "unfused":
        y = conv2d(x, weight, conv_bias, stride=args.stride, padding=args.padding,
                   precision=precision)
        y = group_norm(y, num_groups, gn_weight, gn_bias, eps=eps, out=y)
        if scale is not None:
            xp.multiply(y, scale.reshape(1, c, 1, 1), out=y)
        y = max_pool2d(y, k)
        return xp.minimum(xp.maximum(y, lo), hi, out=out)
    y, _ = conv_on_gpu(x, weight, args, precision, convert_output=False)
    n, _, h, w = y.shape
    cg = c // num_groups
    # From a channels-last conv output the pass stores the extrema channels-last and the
    # affine pass transposes them into out.
    variant = _fused_pass_variant(y, k)
    ext = empty_in_layout(out.shape, "nhwc") if _CHANNELS_LAST_EXT.get(k) == variant else out
    partial, shift, splits = _pool_extremum_stats(
        xp, y, ext, k, bias=conv_bias, sign_a=gn_weight, sign_b=scale, shift_group=cg,
        per_sample=True, variant=variant)
    coef = xp.empty((2, n * c), dtype=xp.float32)
    moments = xp.empty((n * num_groups, 2), dtype=xp.float32)
    get_kernel("normalization.cu", "stats_finalize<0>")(
        (n * num_groups,), (finalize_threads(cg * splits),),
        (partial, shift, numpy.int64(1), numpy.int64(0), numpy.int32(cg * splits),
         numpy.float64(cg * h * w), optional(gn_weight), optional(gn_bias), optional(scale),
         coef[0], coef[1], numpy.int32(c), numpy.int32(num_groups), numpy.float32(eps),
         numpy.int32(1), numpy.uint64(0), numpy.uint64(0), numpy.uint64(0), numpy.float32(0),
         moments))
    if ext is out:
        _affine_apply(xp, out, out, coef[0], coef[1], pooled[0] * pooled[1], n * c, 2, lo, hi)
    else:
        transpose_channels(ext, out, to_channels_last=False, affine=(coef[0], coef[1], lo, hi))
    sn, sc, sh, sw = (numpy.int64(st // y.itemsize) for st in y.strides)
    get_kernel("pooling.cu", "pool_affine_nonfinite")(
        (c,), (256,),
        (y, optional(conv_bias), moments, optional(gn_weight), optional(gn_bias),
         optional(scale), out, numpy.int32(n), numpy.int32(c), numpy.int32(num_groups),
         numpy.int32(k), numpy.int32(pooled[0]), numpy.int32(pooled[1]), sn, sc, sh, sw,
         numpy.float32(lo), numpy.float32(hi)))
    return out


# --------------------------------------------------------------------------------------------
# B: ConvTranspose2d -> BatchNorm (training) -> tanh -> MaxPool -> GroupNorm


def conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        x: Any, weight: Any, bn_weight: Any, bn_bias: Any, gn_weight: Any, gn_bias: Any, *,
        num_groups: int, stride: Size = 1, padding: Size = 0,
        output_padding: Size = 0, groups: int = 1,
        conv_bias: Any = None, pool_kernel: int = 2, eps: float = 1e-5,
        running_mean: Any = None, running_var: Any = None, momentum: float = 0.1,
        precision: str | None = None, method: str = "fused", out: Any = None) -> Any:
    """Pipeline B: ``group_norm(max_pool2d(tanh(batch_norm(conv_transpose2d(x)))), num_groups)``.

    KernelBench level 2 / Tensara "ConvTranspose2d_BatchNorm_Tanh_MaxPool_GroupNorm". BatchNorm
    runs in training mode (batch statistics, biased variance); ``running_mean`` /
    ``running_var``, when given, are updated in place as PyTorch does. The max pool uses
    window and stride ``pool_kernel``. The same ``eps`` serves both norms.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Input, shape (N, C_in, H, W).
    weight : array
        ConvTranspose2d weight, shape (C_in, C_out / groups, kH, kW).
    bn_weight, bn_bias, gn_weight, gn_bias : array or None
        Per-channel BatchNorm and GroupNorm affines.
    num_groups : int
        GroupNorm groups; must divide C_out.
    stride, padding, output_padding : int or tuple of int
        Transposed-convolution options.
    groups : int
        Transposed-convolution groups.
    conv_bias : array, optional
        Convolution bias (it cancels in the output; it still enters the running mean).
    pool_kernel : int
        Max-pool window and stride.
    eps : float
        Epsilon of both norms.
    running_mean, running_var : array, optional
        BatchNorm running buffers, updated in place.
    momentum : float
        BatchNorm momentum in [0, 1].
    precision : {"ieee", "tf32"}, optional
        Convolution precision; ``None`` uses the default.
    method : {"fused", "unfused"}
        ``"unfused"`` runs separate building blocks (GPU baseline); ignored for NumPy input.
    out : array, optional
        Destination of the result's shape and dtype.

    Returns
    -------
    array
        Shape (N, C_out, H_conv // k, W_conv // k), same library and dtype as ``x``.

    Raises
    ------
    TypeError
        Mixed array libraries or an unsupported dtype.
    ValueError
        Inconsistent shapes or options.

    Examples
    --------
    >>> import numpy as np, cufused
    >>> rng = np.random.default_rng(0)
    >>> x = rng.random((2, 4, 5, 5), dtype=np.float32)
    >>> w = rng.standard_normal((4, 8, 3, 3), dtype=np.float32)
    >>> y = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
    ...     x, w, None, None, None, None, num_groups=2)
    >>> y.shape
    (2, 8, 3, 3)
    >>> bool(abs(y[0, :4].mean()) < 1e-5)   # each (sample, group) is normalized
    True
    """
    check_required(x=x, weight=weight)
    xp = get_array_module(x=x, weight=weight, bn_weight=bn_weight, bn_bias=bn_bias,
                          gn_weight=gn_weight, gn_bias=gn_bias, conv_bias=conv_bias,
                          running_mean=running_mean, running_var=running_var)
    check_float_dtype(xp, x=x, weight=weight, bn_weight=bn_weight, bn_bias=bn_bias,
                      gn_weight=gn_weight, gn_bias=gn_bias, conv_bias=conv_bias,
                      running_mean=running_mean, running_var=running_var)
    check_ndim(x, "x", (4,), "NCHW")
    check_sizes(x, "x")
    args = cached_conv_args(x.shape, weight.shape, 2, transposed=True, stride=stride,
                            padding=padding, output_padding=output_padding, groups=groups)
    check_conv_memory(x.shape, args, xp)
    c = args.out_shape[1]
    bn_weight = per_channel(bn_weight, "bn_weight", c, xp)
    bn_bias = per_channel(bn_bias, "bn_bias", c, xp)
    gn_weight = per_channel(gn_weight, "gn_weight", c, xp)
    gn_bias = per_channel(gn_bias, "gn_bias", c, xp)
    conv_bias = per_channel(conv_bias, "conv_bias", c, xp)
    running_mean = check_running_buffer(running_mean, "running_mean", c, xp)
    running_var = check_running_buffer(running_var, "running_var", c, xp)
    check_running_pair(running_mean, running_var)
    num_groups = check_num_groups(num_groups, c)
    k = _tuple_pool(pool_kernel, 2)
    _, _, _, pooled = check_pool_args(args.out_shape[2:], 2, k, k, 0, name="the conv output")
    check_group_values(args.out_shape[:2] + pooled, num_groups, "the pooled output")
    eps = check_scalar(eps, "eps", minimum=0.0)
    momentum = check_scalar(momentum, "momentum", minimum=0.0, maximum=1.0)
    if x.shape[0] and x.shape[0] * args.out_shape[2] * args.out_shape[3] < 2:
        raise ValueError("expected more than 1 value per channel for training-mode BatchNorm")
    precision = resolve_precision(precision)
    _check_method(method)
    shape = args.out_shape[:2] + pooled
    check_out(out, shape, x.dtype, xp, x, inputs={
        "x": x, "weight": weight, "bn_weight": bn_weight, "bn_bias": bn_bias,
        "gn_weight": gn_weight, "gn_bias": gn_bias, "conv_bias": conv_bias,
        "running_mean": running_mean, "running_var": running_var})
    if xp is numpy and x.size:  # an empty batch falls through to the empty result below
        y = run_reference(
            reference.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm, x, weight, bn_weight,
            bn_bias, gn_weight, gn_bias, num_groups=num_groups, stride=args.stride,
            padding=args.padding, output_padding=args.output_padding, groups=args.groups,
            conv_bias=conv_bias, pool_kernel=(k, k), eps=eps, running_mean=running_mean,
            running_var=running_var, momentum=momentum)
        return finish_numpy(y, x.dtype, out)
    if out is None:
        out = xp.empty(shape, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    if _gpu_method(method, args.out_shape) == "unfused":
        y = conv_transpose2d(x, weight, conv_bias, stride=args.stride, padding=args.padding,
                             output_padding=args.output_padding, groups=args.groups,
                             precision=precision)
        y = batch_norm(y, bn_weight, bn_bias, running_mean=running_mean,
                       running_var=running_var, momentum=momentum, eps=eps,
                       activation="tanh", out=y)
        return group_norm(max_pool2d(y, k), num_groups, gn_weight, gn_bias, eps=eps, out=out)
    y, _ = conv_on_gpu(x, weight, args, precision, convert_output=False)
    # The pooled extrema go into out, and the GroupNorm maps them in place. From a
    # channels-last conv output the pass stores them channels-last with 16-byte stores, in
    # blocks of one group's channels: each (n, group) row then has the bytes it has in NCHW,
    # and the GroupNorm transposes it (in shared memory) where it stands (for B's 2 x 2 pool:
    # the path measured and tested on the GPU). Unlike a separate channels-last buffer, this
    # leaves no dirty lines of a temporary in the L2 to be written back during the GroupNorm.
    variant = _fused_pass_variant(y, k)
    ext_block = 0
    if (k == 2 and _CHANNELS_LAST_EXT[k] == variant and out.data.ptr % 16 == 0
            and group_rows_fit_channels_last(c, num_groups, pooled[0] * pooled[1])):
        ext_block = c // num_groups
    partial, shift, splits = _pool_extremum_stats(
        xp, y, out, k, bias=None, sign_a=bn_weight, sign_b=None, shift_group=1,
        per_sample=False, variant=variant, ext_block=ext_block)
    moments = xp.empty((c, 2), dtype=xp.float32)
    coef = bn_coefficients(xp, y, bn_weight, bn_bias, running_mean, running_var, True,
                           momentum, eps, partial=(partial, shift), splits=splits,
                           mean_offset=conv_bias, moments=moments)
    sn, sc, sh, sw = (numpy.int64(st // y.itemsize) for st in y.strides)
    get_kernel("pooling.cu", "pool_bn_tanh_nonfinite")(
        (c,), (256,),
        (y, optional(conv_bias), moments, optional(bn_weight), optional(bn_bias), coef[0],
         coef[1], out, numpy.int32(x.shape[0]), numpy.int32(c), numpy.int32(k),
         numpy.int32(pooled[0]),
         numpy.int32(pooled[1]), sn, sc, sh, sw, numpy.int32(ext_block)))
    launch_group_norm_rows(out, out, num_groups, gn_weight, gn_bias, eps, pre=coef,
                           x_block=ext_block or None)
    return out


# --------------------------------------------------------------------------------------------
# C: AvgPool3d -> ConvTranspose3d -> clamp -> softmax over D*H*W -> scale


def conv_transpose3d_avgpool_clamp_softmax_multiply(
        x: Any, weight: Any, scale: Any, *, stride: Size, padding: Size,
        output_padding: Size, pool_kernel: int,
        clamp_min: float, clamp_max: float, conv_bias: Any = None, groups: int = 1,
        precision: str | None = None, method: str = "fused", out: Any = None) -> Any:
    """Pipeline C: ``softmax(clamp(conv_transpose3d(avg_pool3d(x, k))), axis=(2, 3, 4)) * scale``.

    KernelBench level 2 / Tensara "ConvTranspose3d_AvgPool_Clamp_Softmax_Multiply". Despite the
    name, the average pool (window and stride ``pool_kernel``) comes first, on the input.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Input, shape (N, C_in, D, H, W).
    weight : array
        ConvTranspose3d weight, shape (C_in, C_out / groups, kD, kH, kW).
    scale : array, float or None
        Per-channel multiplier (e.g. shape (1, C_out, 1, 1, 1)), one number (a Python number
        or a 0-d array), or None for no scaling.
    stride, padding, output_padding : int or tuple of int
        Transposed-convolution options.
    pool_kernel : int
        Average-pool window and stride.
    clamp_min, clamp_max : float
        Finite clamp bounds applied before the softmax.
    conv_bias : array, optional
        Per-channel convolution bias.
    groups : int
        Transposed-convolution groups.
    precision : {"ieee", "tf32"}, optional
        Convolution precision; ``None`` uses the default.
    method : {"fused", "unfused"}
        ``"unfused"`` runs separate building blocks (GPU baseline); ignored for NumPy input.
    out : array, optional
        Destination of the result's shape and dtype.

    Returns
    -------
    array
        Shape (N, C_out, D_out, H_out, W_out), same library and dtype as ``x``.

    Raises
    ------
    TypeError
        Mixed array libraries or an unsupported dtype.
    ValueError
        Inconsistent shapes or options.

    Examples
    --------
    >>> import numpy as np, cufused
    >>> rng = np.random.default_rng(0)
    >>> x = rng.random((1, 2, 4, 4, 4))
    >>> w = rng.standard_normal((2, 3, 3, 3, 3))
    >>> y = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
    ...     x, w, 1.0, stride=2, padding=1, output_padding=1, pool_kernel=2,
    ...     clamp_min=0.0, clamp_max=1.0)
    >>> y.shape, np.allclose(y.sum(axis=(2, 3, 4)), 1.0)
    ((1, 3, 4, 4, 4), True)
    """
    check_required(x=x, weight=weight)
    xp = get_array_module(x=x, weight=weight, scale=None if numpy.isscalar(scale) else scale,
                          conv_bias=conv_bias)
    check_float_dtype(xp, x=x, weight=weight, conv_bias=conv_bias)
    check_ndim(x, "x", (5,), "NCDHW")
    check_sizes(x, "x")
    k = _tuple_pool(pool_kernel, 3)
    _, _, _, pooled = check_pool_args(x.shape[2:], 3, k, k, 0, unpadded_window=True)
    pooled_shape = x.shape[:2] + pooled
    args = cached_conv_args(pooled_shape, weight.shape, 3, transposed=True, stride=stride,
                            padding=padding, output_padding=output_padding, groups=groups)
    check_conv_memory(pooled_shape, args, xp)
    c = args.out_shape[1]
    scale = per_channel(scale, "scale", c, xp, allow_scalar=True, broadcast_ndim=5)
    if xp is not numpy:
        check_float_dtype(xp, scale=scale)
    conv_bias = per_channel(conv_bias, "conv_bias", c, xp)
    lo = check_scalar(clamp_min, "clamp_min")
    hi = check_scalar(clamp_max, "clamp_max")
    precision = resolve_precision(precision)
    _check_method(method)
    shape = args.out_shape
    check_out(out, shape, x.dtype, xp, x, inputs={
        "x": x, "weight": weight, "scale": scale, "conv_bias": conv_bias})
    if xp is numpy and x.size:  # an empty batch falls through to the empty result below
        y = run_reference(
            reference.conv_transpose3d_avgpool_clamp_softmax_multiply, x, weight,
            _ones_if_none(scale, c, xp), stride=args.stride, padding=args.padding,
            output_padding=args.output_padding, pool_kernel=(k, k, k), clamp_min=lo,
            clamp_max=hi, conv_bias=conv_bias, groups=args.groups)
        return finish_numpy(y, x.dtype, out)
    if out is None:
        out = xp.empty(shape, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    if method == "unfused":
        x_pooled = avg_pool3d(x, k)
        y = conv_transpose3d(x_pooled, weight, conv_bias, stride=args.stride,
                             padding=args.padding, output_padding=args.output_padding,
                             groups=args.groups, precision=precision)
        xp.minimum(xp.maximum(y, lo), hi, out=y)
        if scale is None:
            softmax(y, axis=(2, 3, 4), out=out)
        else:
            xp.multiply(softmax(y, axis=(2, 3, 4), out=y), scale.reshape(1, c, 1, 1, 1), out=out)
    else:
        x_pooled = _conv_transpose3d_softmax(xp, x, pooled_shape, weight, out, args, k,
                                             precision, bias=conv_bias, scale=scale,
                                             clamp=(lo, hi))
    softmax_rows_nonfinite_weight(xp, x_pooled, weight, out, args, bias=conv_bias, scale=scale,
                                  clamp=(lo, hi))
    return out


def _conv_transpose3d_softmax(xp, x, pooled_shape, weight, out, args, k: int, precision: str,
                              *, bias, scale, clamp: tuple[float, float]):
    """Pipeline C's fused GPU path into ``out``: the average pool into the plan's input layout,
    the transposed convolution, then the clamped softmax times ``scale`` reading the
    convolution's output layout. Returns the pooled input."""
    n, c = out.shape[:2]
    try:
        plan = gpu_conv_plan(pooled_shape, weight.shape, args, precision, convert_input=False,
                             convert_output=False, accept_classes=True)
    except UnsupportedConvolution:  # conv_on_gpu's route for what no cuDNN plan computes
        x_pooled = avg_pool3d(x, k)
        y, layout = conv_on_gpu(x_pooled, weight, args, precision, out=out,
                                convert_output=False)
    else:
        # The pool writes the conv input straight into the plan's input layout.
        x_pooled = empty_in_layout(pooled_shape, plan.x_layout)
        pool_into(xp.ascontiguousarray(x), x_pooled, (k, k, k), (k, k, k), (0, 0, 0),
                  is_max=False)
        y, layout = plan.apply(x_pooled, weight, out=out, convert_output=False)
    strides = [s // y.itemsize for s in y.strides]
    length = math.prod(out.shape[2:])
    softmax_rows(xp, y, out, n * c, length, c, (strides[0], strides[1], strides[-1]),
                 layout=layout, bias=bias, scale=scale, clamp=clamp)
    return x_pooled
