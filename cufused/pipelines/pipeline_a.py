"""Pipeline A: conv2d -> GroupNorm -> scale -> MaxPool -> clamp.

GroupNorm * scale is a per-channel affine ``a * y + b`` with ``sign(a) = sign(gamma *
scale)``, and a monotone map commutes with max (or, for ``a < 0``, turns it into min): one
read of the convolution output yields the GroupNorm statistics (over every element, also
those the pool drops) and each window's max or min; a small pass applies the affine and the
clamp.
"""

from __future__ import annotations

import numbers
from dataclasses import replace
from typing import Any

import numpy

from .. import reference
from .._arrays import (Size, as_float32, check_float_dtype, check_ndim, check_out,
                       check_per_channel, check_required, check_scalar, check_sizes, forward,
                       get_array_module, per_channel)
from .._call_graphs import warm_calls
from .._kernels.conv_gemm import channel_tiles_fit, conv2d_pool_stats, halo_geometry
from .._kernels.layout import transpose_channels
from .._kernels.normalization import (channel_affine, coef_array, group_affine_rows,
                                      group_norm_coefficients)
from .._kernels.pooling import (fused_pass_variant, pool_affine_nonfinite,
                                pool_affine_nonfinite_conv, pool_extremum_stats,
                                stores_ext_channels_last)
from .._layout import empty_in_layout
from .._ops._conv_args import cached_conv_args, check_conv_memory, extended_input
from .._ops.convolution import conv2d, conv_on_gpu
from .._ops.normalization import check_group_values, check_num_groups, group_norm
from .._ops.pooling import max_pool2d
from .._precision import mma_passes, resolve_precision
from ._common import (check_method, check_pipeline_pool, clamp_bounds, gpu_method, gpu_path,
                      ones_if_none, runs_on_igemm, shared_doc_sections)


@warm_calls
@shared_doc_sections("(N, C_out, H_conv // k, W_conv // k)")
def conv2d_groupnorm_scale_maxpool_clamp(
        x: Any, weight: Any, conv_bias: Any, gn_weight: Any, gn_bias: Any, scale: Any, *,
        num_groups: int, pool_kernel: int, clamp_min: float | None, clamp_max: float | None,
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
        real number or a 0-d float array), or None for no scaling.
    num_groups : int
        GroupNorm groups; must divide C_out.
    pool_kernel : int or tuple of int
        Max-pool window and stride (floor mode): one side, or a sequence of equal sides (one
        value or one per spatial dimension).
    clamp_min, clamp_max : float or None
        Bounds of the final clamp, infinities included; None for no bound (``clamp_min >
        clamp_max`` gives ``clamp_max``: all as ``torch.clamp``); not NaN.
    stride, padding : int or tuple of int
        Convolution options (``padding`` also ``"valid"`` or ``"same"``, as in
        :func:`cufused.conv2d`).
    eps : float
        GroupNorm epsilon.

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
    check_ndim(x, "x", 4, "NCHW")
    check_sizes(x, "x")
    args = cached_conv_args(x.shape, weight.shape, 2, transposed=False, stride=stride,
                            padding=padding)
    check_conv_memory(x.shape, args, xp)
    c = args.out_shape[1]
    num_groups = check_num_groups(num_groups, c)
    check_group_values(args.out_shape, num_groups, "the convolution output")
    k, pooled = check_pipeline_pool(pool_kernel, args.out_shape[2:],
                                    name="the convolution output")
    lo, hi = clamp_bounds(clamp_min, clamp_max)
    eps = check_scalar(eps, "eps", minimum=0.0)
    precision = resolve_precision(precision)
    check_method(method)
    for name, value in (("conv_bias", conv_bias), ("gn_weight", gn_weight),
                        ("gn_bias", gn_bias)):
        check_per_channel(value, name, c)
    check_per_channel(scale, "scale", c, allow_scalar=True, broadcast_ndim=4)
    check_float_dtype(xp, scale=None if isinstance(scale, numbers.Real) else scale)
    shape = args.out_shape[:2] + pooled
    check_out(out, shape, x.dtype, xp, x, inputs={
        "x": x, "weight": weight, "conv_bias": conv_bias, "gn_weight": gn_weight,
        "gn_bias": gn_bias, "scale": scale})
    # Every check passed: a number for scale or a strided parameter becomes a device array.
    conv_bias, gn_weight, gn_bias, scale = (
        per_channel(v, c, xp) for v in (conv_bias, gn_weight, gn_bias, scale))
    return forward(
        xp, x, out, shape,
        # A lambda: the ones for scale=None are made on the NumPy path only.
        reference=lambda: reference.conv2d_groupnorm_scale_maxpool_clamp(
            extended_input(x, args, xp), weight, conv_bias, gn_weight, gn_bias,
            ones_if_none(scale, c, xp), num_groups=num_groups, pool_kernel=(k, k),
            clamp_min=lo, clamp_max=hi, stride=args.stride, padding=args.padding, eps=eps),
        gpu=gpu_path(gpu_method(method, args.out_shape, groups=num_groups), _fused, _unfused,
                     xp, x, weight, args, precision, k=k, num_groups=num_groups,
                     conv_bias=conv_bias, gn_weight=gn_weight, gn_bias=gn_bias, scale=scale,
                     eps=eps, lo=as_float32(lo), hi=as_float32(hi)))


def _unfused(xp, x, weight, args, precision, out, *, k, num_groups, conv_bias, gn_weight,
             gn_bias, scale, eps, lo, hi):
    """The building blocks one after the other (the baseline, and 64-bit indexing)."""
    c = args.out_shape[1]
    y = conv2d(extended_input(x, args, xp), weight, conv_bias, stride=args.stride,
               padding=args.padding, precision=precision)
    y = group_norm(y, num_groups, gn_weight, gn_bias, eps=eps, out=y)
    if scale is not None:
        xp.multiply(y, scale.reshape(1, c, 1, 1), out=y)
    y = max_pool2d(y, k)
    return xp.minimum(xp.maximum(y, lo), hi, out=out)


def _fused(xp, x, weight, args, precision, out, *, k, num_groups, conv_bias, gn_weight,
           gn_bias, scale, eps, lo, hi, epilogue=None):
    """The convolution; one read of its output for the window extrema and the GroupNorm
    statistics; GroupNorm * scale as per-(n, c) coefficients; their affine and the clamp
    applied to the extrema (or, on cufused's implicit GEMM, the extrema and the statistics in
    the convolution's epilogue, its output never stored, then the coefficients and their
    affine in one pass); channels with a non-finite parameter recomputed.
    ``epilogue``: whether the pass runs in the convolution's epilogue (None: where
    :func:`_epilogue_applies`)."""
    n, c, h, w = args.out_shape
    cg = c // num_groups
    x, y = extended_input(x, args, xp), None
    if epilogue is None:
        epilogue = _epilogue_applies(xp, x, weight, args, precision, k, num_groups,
                                     conv_bias is not None)
    moments = xp.empty((n * num_groups, 2), dtype=xp.float32)
    # Both passes sum y + (bias - shift) and normalize fl(y + bias): without a bias the sums
    # are of the normalized values, and the affine centers on their float64 mean; with one
    # they skip the rounding of y + bias, and the float32 mean rounds a constant row back to
    # its value.
    centered_sums = conv_bias is None
    if epilogue:
        # Both kernels that read x and w index them as contiguous NCHW and OIHW.
        x, weight = xp.ascontiguousarray(x), xp.ascontiguousarray(weight)
        # The extrema straight into out, then the statistics and the affine in one pass.
        partial, _ = conv2d_pool_stats(
            xp, x, weight, conv_bias, out,
            sign_a=gn_weight, sign_b=scale, stride=args.stride, padding=args.padding,
            dilation=args.dilation, pool=k, passes=mma_passes(precision))
        group_affine_rows(out, out, partial, num_groups=num_groups, count=cg * h * w, eps=eps,
                          centered_sums=centered_sums, gamma=gn_weight, beta=gn_bias,
                          scale=scale, lo=lo, hi=hi, moments=moments)
    else:
        # Non-finite operands' NaN and infinities by the definition, as the public conv2d
        # places them.
        y, _ = conv_on_gpu(x, weight, args, precision, convert_output=False,
                           definition_nans=True, definition_inputs=True)
        # From a channels-last conv output the pass stores the extrema channels-last and the
        # affine pass transposes them into out.
        variant = fused_pass_variant(y, k)
        ext_channels_last = stores_ext_channels_last(variant, k)
        ext = empty_in_layout(out.shape, "nhwc") if ext_channels_last else out
        partial, shift, splits = pool_extremum_stats(
            xp, y, ext, k, bias=conv_bias, sign_a=gn_weight, sign_b=scale, shift_group=cg,
            per_sample=True, variant=variant, ext_block=c if ext_channels_last else 0)
        coef = coef_array(xp, n * c)
        group_norm_coefficients(partial, shift, coef, rows=n * num_groups,
                                row_len=cg * splits, count=cg * h * w, channels=c,
                                num_groups=num_groups, eps=eps, centered_sums=centered_sums,
                                gamma=gn_weight, beta=gn_bias, scale=scale, moments=moments)
        if ext is out:
            channel_affine(out, out, coef, inner=out.shape[2] * out.shape[3],
                           activation="clamp", lo=lo, hi=hi)
        else:
            transpose_channels(ext, out, to_channels_last=False,
                               affine=(coef, lo, hi))
    nonfinite = dict(bias=conv_bias, gamma=gn_weight, beta=gn_bias, scale=scale,
                     num_groups=num_groups, pool=k, lo=lo, hi=hi)
    if y is None:
        pool_affine_nonfinite_conv(x, weight, out, moments, stride=args.stride,
                                   padding=args.padding, dilation=args.dilation, **nonfinite)
    else:
        pool_affine_nonfinite(y, out, moments, **nonfinite)
    return out


def _epilogue_applies(xp, x, weight, args, precision, k, num_groups, bias: bool) -> bool:
    """Whether the convolution runs with the pass as its epilogue (conv2d_pool_stats): a
    tensor-core precision, 2 x 2 or 4 x 4 windows, a halo that fits, and cufused's implicit
    GEMM forced or the whole fused call measured faster with the pass in the convolution's
    epilogue than after the convolution (:func:`~._common.runs_on_igemm`, once per
    problem)."""
    if not (precision != "ieee" and k in (2, 4) and channel_tiles_fit(args.out_shape[1])
            and halo_geometry(x.shape[1], weight.shape[2:], args.stride, args.dilation,
                              mma_passes(precision), pool=k) is not None):
        return False

    # x is the extended input already (_fused), and so is the random one of its shape.
    unextended = replace(args, extension=())

    def path_of(random_x, random_weight, out):
        c = args.out_shape[1]
        ones, zeros = xp.ones(c, dtype=xp.float32), xp.zeros(c, dtype=xp.float32)
        return lambda epilogue: _fused(
            xp, random_x, random_weight, unextended, precision, out, k=k, num_groups=num_groups,
            conv_bias=zeros if bias else None, gn_weight=ones, gn_bias=zeros, scale=ones,
            eps=1e-5, lo=0.0, hi=1.0, epilogue=epilogue)

    key = ("conv2d_pool_stats", x.shape, weight.shape, args, precision, k, num_groups, bias)
    pooled = args.out_shape[:2] + tuple(s // k for s in args.out_shape[2:])
    return runs_on_igemm(xp, key, x.shape, weight.shape, pooled, path_of)
