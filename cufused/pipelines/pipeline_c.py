"""Pipeline C: AvgPool3d -> ConvTranspose3d -> clamp -> softmax over D*H*W -> scale.

The pool runs first, writing the convolution's input directly in the layout its cuDNN plan
wants; after the clamp to [lo, hi] the softmax needs no max pass (exp(v - the clamp's middle)
within e^+-30 for hi - lo <= 60), so one statistics read and one normalize-and-scale pass
follow, in place in the output when the layout allows. On cufused's tensor-core convolution
(stride 2, 3 x 3 x 3 kernels) in TF32 the convolution output is never stored: one pass takes
the softmax sums in the convolution's epilogue, a second computes the convolution again and
writes the result. In 3xTF32, whose convolution costs three times the MMAs, the class groups'
kernel writes it once, channels-last, with the softmax sums in its epilogue, and the
softmax's normalize pass reads it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy

from .. import reference
from .._arrays import (Size, check_float_dtype, check_ndim, check_out, check_per_channel,
                       check_required, check_sizes, forward, get_array_module, per_channel)
from .._cudnn import UnsupportedConvolution
from .._call_graphs import warm_calls
from .._kernels.conv_gemm import (conv_nonfinite_input_flags,
                                  conv_transpose3d_groups_softmax_sums,
                                  conv_transpose3d_softmax, conv_transpose3d_softmax_sums,
                                  transposed_s2k3_groups_sums_fit,
                                  transposed_s2k3_groups_take_channels, transposed_s2k3_takes)
from .._kernels.pooling import pool_into
from .._kernels.softmax import (softmax_finalize, softmax_normalize_channels_last, softmax_rows,
                                softmax_rows_nonfinite_weight)
from .._layout import empty_in_layout, layout_strides
from .._ops._conv_args import cached_conv_args, check_conv_memory
from .._ops.convolution import conv_on_gpu, conv_transpose3d, gpu_conv_plan
from .._ops.pooling import avg_pool3d, check_gpu_spatial_sizes
from .._ops.softmax import softmax
from .._precision import mma_passes, resolve_precision
from ._common import (check_method, check_pipeline_pool, clamp_bounds, gpu_path, ones_if_none,
                      runs_on_igemm, shared_doc_sections)


@warm_calls
@shared_doc_sections("(N, C_out, D_out, H_out, W_out)")
def conv_transpose3d_avgpool_clamp_softmax_multiply(
        x: Any, weight: Any, scale: Any, *, stride: Size, padding: Size,
        output_padding: Size, pool_kernel: int,
        clamp_min: float | None, clamp_max: float | None, conv_bias: Any = None, groups: int = 1,
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
        Per-channel multiplier (e.g. shape (1, C_out, 1, 1, 1)), one number (a real number
        or a 0-d float array), or None for no scaling.
    stride, padding, output_padding : int or tuple of int
        Transposed-convolution options.
    pool_kernel : int or tuple of int
        Average-pool window and stride: one side, or a sequence of equal sides (one value or
        one per spatial dimension).
    clamp_min, clamp_max : float or None
        Clamp bounds applied before the softmax, infinities included; None for no bound
        (``clamp_min > clamp_max`` gives ``clamp_max``: all as ``torch.clamp``); not NaN.
    conv_bias : array, optional
        Per-channel convolution bias.
    groups : int
        Transposed-convolution groups.

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
    check_ndim(x, "x", 5, "NCDHW")
    check_sizes(x, "x")
    if xp is not numpy:  # the pool reads x itself
        check_gpu_spatial_sizes(x)
    k, pooled = check_pipeline_pool(pool_kernel, x.shape[2:], unpadded_window=True)
    pooled_shape = x.shape[:2] + pooled
    args = cached_conv_args(pooled_shape, weight.shape, 3, transposed=True, stride=stride,
                            padding=padding, output_padding=output_padding, groups=groups,
                            x_name="the pooled x")
    check_conv_memory(pooled_shape, args, xp)
    c = args.out_shape[1]
    lo, hi = clamp_bounds(clamp_min, clamp_max)
    precision = resolve_precision(precision)
    check_method(method)
    check_per_channel(conv_bias, "conv_bias", c)
    check_per_channel(scale, "scale", c, allow_scalar=True, broadcast_ndim=5)
    check_float_dtype(xp, scale=None if isinstance(scale, numbers.Real) else scale)
    check_out(out, args.out_shape, x.dtype, xp, x, inputs={
        "x": x, "weight": weight, "scale": scale, "conv_bias": conv_bias})
    # Every check passed: a number for scale or a strided parameter becomes a device array.
    conv_bias, scale = per_channel(conv_bias, c, xp), per_channel(scale, c, xp)
    return forward(
        xp, x, out, args.out_shape,
        # A lambda: the ones for scale=None are made on the NumPy path only.
        reference=lambda: reference.conv_transpose3d_avgpool_clamp_softmax_multiply(
            x, weight, ones_if_none(scale, c, xp), stride=args.stride, padding=args.padding,
            output_padding=args.output_padding, pool_kernel=(k, k, k), clamp_min=lo,
            clamp_max=hi, conv_bias=conv_bias, groups=args.groups),
        gpu=gpu_path(method, _fused, _unfused, xp, x, weight, args, precision, k=k,
                     pooled_shape=pooled_shape, conv_bias=conv_bias, scale=scale,
                     lo=_float32_bound(lo), hi=_float32_bound(hi)))


def _float32_bound(bound: float) -> float:
    """A clamp bound as the float32 GPU path takes it: a finite bound past float32's range
    saturates to its largest value. The clamped values then lie where the reference's do
    (every one of a row at a bound beyond the data gives a uniform softmax), where the bound
    cast to float32, an infinity, would clamp a row to infinities and its softmax to NaN."""
    if not math.isfinite(bound):
        return bound
    return min(max(bound, -_FLOAT32_MAX), _FLOAT32_MAX)


_FLOAT32_MAX = float(numpy.finfo(numpy.float32).max)


def _nonfinite_weight_rows(xp, x_pooled, weight, args, out, *, conv_bias, scale, lo, hi,
                           sample_flags=None):
    """Rows of an output channel with a non-finite weight, and every row of a sample that
    ``sample_flags`` marks, recomputed by the definition."""
    softmax_rows_nonfinite_weight(xp, x_pooled, weight, out, groups=args.groups,
                                  stride=args.stride, padding=args.padding,
                                  dilation=args.dilation, bias=conv_bias, scale=scale,
                                  clamp=(lo, hi), sample_flags=sample_flags)
    return out


def _unfused(xp, x, weight, args, precision, out, *, k, pooled_shape, conv_bias, scale, lo,
             hi):
    """The building blocks one after the other (the baseline)."""
    c = out.shape[1]
    x_pooled = avg_pool3d(x, k)
    y = conv_transpose3d(x_pooled, weight, conv_bias, stride=args.stride,
                         padding=args.padding, output_padding=args.output_padding,
                         groups=args.groups, precision=precision)
    xp.minimum(xp.maximum(y, lo), hi, out=y)
    if scale is None:
        softmax(y, axis=(2, 3, 4), out=out)
    else:
        xp.multiply(softmax(y, axis=(2, 3, 4), out=y), scale.reshape(1, c, 1, 1, 1), out=out)
    return _nonfinite_weight_rows(xp, x_pooled, weight, args, out, conv_bias=conv_bias,
                                  scale=scale, lo=lo, hi=hi)


def _fused(xp, x, weight, args, precision, out, *, k, pooled_shape, conv_bias, scale, lo, hi,
           recompute=None):
    """The average pool into the convolution's input layout, the transposed convolution, then
    the clamped softmax times ``scale`` into ``out``: on cuDNN, the softmax reads the plan's
    output layout; on cufused's implicit GEMM (``recompute``; None: where
    :func:`_recompute_applies`), in 3xTF32 where the class groups take the problem and their
    softmax partials fit (:func:`_fused_class_groups`) the normalize pass reads their
    channels-last result, otherwise the convolution runs twice, the softmax sums in its first
    pass's epilogue and the result written by its second."""
    if recompute is None:
        recompute = _recompute_applies(xp, x, weight, args, precision, k, pooled_shape,
                                       conv_bias is not None, lo, hi)
    if recompute:
        x_pooled = _pooled_in_layout(xp, x, k, pooled_shape, "nhwc")
        options = dict(conv_bias=conv_bias, scale=scale, lo=lo, hi=hi)
        if (transposed_s2k3_groups_sums_fit(out.shape)
                and transposed_s2k3_groups_take_channels(pooled_shape[1], out.shape[1],
                                                         mma_passes(precision))
                and _fused_class_groups(xp, x_pooled, weight, args, out, **options)):
            return out
        return _fused_recompute(xp, x_pooled, weight, args, precision, out, **options)
    n, c = out.shape[:2]
    sample_flags = None
    try:
        plan = gpu_conv_plan(pooled_shape, weight.shape, args, precision, convert_input=False,
                             convert_output=False, accept_classes=True)
    except UnsupportedConvolution:  # conv_on_gpu's route for what no cuDNN plan computes
        # A channel with a non-finite weight gets its rows by the definition at the end.
        x_pooled = avg_pool3d(x, k)
        y, layout = conv_on_gpu(x_pooled, weight, args, precision, out=out,
                                convert_output=False, definition_inputs=True)
    else:
        # The pool writes the conv input straight into the plan's input layout.
        x_pooled = _pooled_in_layout(xp, x, k, pooled_shape, plan.x_layout)
        y, layout = plan.apply(x_pooled, weight, out=out, convert_output=False)
        if plan.spreads_nonfinite:
            # A sample holding a non-finite value: each of its rows by the definition.
            sample_flags = conv_nonfinite_input_flags(xp, x_pooled)
    # y is dense in its layout (out itself, or the plan's own buffer): its strides follow from
    # the shape, where y.strides may give a size-1 axis any stride (out[..., None] has a 0).
    strides = layout_strides(y.shape, layout)
    length = math.prod(out.shape[2:])
    softmax_rows(xp, y, out, rows=n * c, length=length, channels=c,
                 strides=(strides[0], strides[1], strides[-1]),
                 layout=layout, bias=conv_bias, scale=scale, clamp=(lo, hi))
    return _nonfinite_weight_rows(xp, x_pooled, weight, args, out, conv_bias=conv_bias,
                                  scale=scale, lo=lo, hi=hi, sample_flags=sample_flags)


def _pooled_in_layout(xp, x, k: int, pooled_shape, layout: str):
    """``x``'s average pool (window and stride ``k``) into a new array of ``pooled_shape`` in
    ``layout``."""
    x_pooled = empty_in_layout(pooled_shape, layout)
    pool_into(xp.ascontiguousarray(x), x_pooled, (k, k, k), (k, k, k), (0, 0, 0), is_max=False)
    return x_pooled


def _fused_recompute(xp, x_pooled, weight, args, precision, out, *, conv_bias, scale, lo, hi):
    """From the channels-last pooled input ``x_pooled``: the softmax sums in the
    convolution's epilogue, each row's factor, then the convolution again with the normalize
    and the scale as its epilogue, into ``out``."""
    n, c = out.shape[:2]
    w = xp.ascontiguousarray(weight)
    passes = mma_passes(precision)
    partial_sums, splits = conv_transpose3d_softmax_sums(
        xp, x_pooled, w, conv_bias, out_shape=out.shape, clamp=(lo, hi), passes=passes)
    coef = softmax_finalize(xp, partial_sums, rows=n * c, channels=c, splits=splits, parts=1,
                            scale=scale)
    conv_transpose3d_softmax(x_pooled, w, conv_bias, out, coef[1], clamp=(lo, hi),
                             passes=passes)
    return _nonfinite_weight_rows(xp, x_pooled, weight, args, out, conv_bias=conv_bias,
                                  scale=scale, lo=lo, hi=hi)


def _fused_class_groups(xp, x_pooled, weight, args, out, *, conv_bias, scale, lo,
                        hi) -> bool:
    """From the channels-last pooled input ``x_pooled``: the transposed convolution plus
    ``conv_bias`` in 3xTF32 on the class groups
    (:func:`~cufused._kernels.conv_gemm.conv_transpose3d_groups`) into a channels-last y with
    the softmax sums in its epilogue, then the normalize pass of the clamped softmax times
    ``scale`` from y into ``out``. False, with nothing written to ``out``, where the driver
    makes no tensor map of the pooled input."""
    n, c = out.shape[:2]
    y = empty_in_layout(out.shape, "nhwc")
    partial = conv_transpose3d_groups_softmax_sums(xp, x_pooled, xp.ascontiguousarray(weight),
                                                   conv_bias, y, clamp=(lo, hi))
    if partial is None:
        return False
    sn, sc, *_, ss = (s // y.itemsize for s in y.strides)
    softmax_normalize_channels_last(xp, y, out, partial, n=n, length=math.prod(out.shape[2:]),
                                    channels=c, strides=(sn, sc, ss), scale=scale,
                                    clamp=(lo, hi))
    _nonfinite_weight_rows(xp, x_pooled, weight, args, out, conv_bias=conv_bias, scale=scale,
                           lo=lo, hi=hi)
    return True


def _recompute_applies(xp, x, weight, args, precision, k, pooled_shape, bias: bool, lo,
                       hi) -> bool:
    """Whether :func:`_fused` runs on cufused's implicit GEMM (``conv_transpose3d_s2k3``, in
    3xTF32 its class groups where they take the problem): a tensor-core precision, a problem
    that its kernels take, and the implicit GEMM forced or this path measured faster than
    cuDNN's (:func:`~._common.runs_on_igemm`, once per problem)."""
    if precision == "ieee" or not transposed_s2k3_takes(
            pooled_shape[1], weight.shape[2:], args.stride, args.padding, args.output_padding,
            args.dilation, args.groups, args.out_shape, (lo, hi)):
        return False

    def path_of(random_x, random_weight, out):
        c = args.out_shape[1]
        conv_bias = xp.zeros(c, dtype=xp.float32) if bias else None
        scale = xp.ones(c, dtype=xp.float32)
        return lambda recompute: _fused(
            xp, random_x, random_weight, args, precision, out, k=k, pooled_shape=pooled_shape,
            conv_bias=conv_bias, scale=scale, lo=0.0, hi=1.0, recompute=recompute)

    key = ("conv_transpose3d_s2k3", x.shape, weight.shape, args, precision, k, bias)
    return runs_on_igemm(xp, key, x.shape, weight.shape, args.out_shape, path_of)
