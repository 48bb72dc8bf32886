"""Pipeline B: ConvTranspose2d -> BatchNorm (training) -> tanh -> MaxPool -> GroupNorm.

One read of the convolution output gives the per-channel batch statistics and each window's
extremum (tanh is increasing, so the sign of the BatchNorm weight decides max or min); one
block per (n, group) then applies BatchNorm + tanh and GroupNorm on the 4x smaller pooled
tensor, cached in shared memory. The convolution bias cancels in training-mode BatchNorm and
is only added to the running-mean update.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from .. import reference
from .._arrays import (Size, check_float_dtype, check_ndim, check_out, check_per_channel,
                       check_required, check_scalar, check_sizes, forward, get_array_module,
                       per_channel)
from .._call_graphs import warm_calls
from .._kernels.normalization import (channel_affine, group_norm_rows,
                                      group_rows_fit_channels_last)
from .._kernels.pooling import (fused_pass_variant, pool_bn_tanh_nonfinite,
                                pool_extremum_stats, stores_ext_channels_last)
from .._ops._conv_args import cached_conv_args, check_conv_memory
from .._ops.convolution import conv_on_gpu, conv_transpose2d
from .._ops.normalization import (bn_coefficients, check_channel_values,
                                  check_group_values, check_num_groups, check_running_buffer,
                                  check_running_pair, coefficients_of_statistics, group_norm)
from .._ops.pooling import max_pool2d
from .._precision import resolve_precision
from ._common import (check_method, check_pipeline_pool, gpu_method, gpu_path,
                      shared_doc_sections)


@warm_calls
@shared_doc_sections("(N, C_out, H_conv // k, W_conv // k)")
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
    pool_kernel : int or tuple of int
        Max-pool window and stride: one side, or a sequence of equal sides (one value or one
        per spatial dimension).
    eps : float
        Epsilon of both norms; finite and > 0 (BatchNorm in training needs it positive, as
        in PyTorch).
    running_mean, running_var : array, optional
        BatchNorm running buffers, updated in place.
    momentum : float
        BatchNorm momentum; finite (past [0, 1] it extrapolates, as in PyTorch).

    Examples
    --------
    >>> import numpy as np, cufused
    >>> rng = np.random.default_rng(0)
    >>> x, w = rng.random((2, 4, 5, 5)), rng.standard_normal((4, 8, 3, 3))
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
    check_ndim(x, "x", 4, "NCHW")
    check_sizes(x, "x")
    args = cached_conv_args(x.shape, weight.shape, 2, transposed=True, stride=stride,
                            padding=padding, output_padding=output_padding, groups=groups)
    check_conv_memory(x.shape, args, xp)
    c = args.out_shape[1]
    num_groups = check_num_groups(num_groups, c)
    k, pooled = check_pipeline_pool(pool_kernel, args.out_shape[2:],
                                    name="the convolution output")
    check_group_values(args.out_shape[:2] + pooled, num_groups, "the pooled output")
    eps = check_scalar(eps, "eps", positive=True)
    momentum = check_scalar(momentum, "momentum")
    check_channel_values(args.out_shape, "the convolution output")
    precision = resolve_precision(precision)
    check_method(method)
    params = {"bn_weight": bn_weight, "bn_bias": bn_bias, "gn_weight": gn_weight,
              "gn_bias": gn_bias, "conv_bias": conv_bias}
    for name, value in params.items():
        check_per_channel(value, name, c)
    check_running_buffer(running_mean, "running_mean", c)
    check_running_buffer(running_var, "running_var", c)
    check_running_pair(running_mean, running_var)
    shape = args.out_shape[:2] + pooled
    check_out(out, shape, x.dtype, xp, x, inputs={
        "x": x, "weight": weight, **params, "running_mean": running_mean,
        "running_var": running_var})
    # Every check passed: a strided parameter becomes a contiguous device array.
    bn_weight, bn_bias, gn_weight, gn_bias, conv_bias, running_mean, running_var = (
        per_channel(v, c, xp) for v in (bn_weight, bn_bias, gn_weight, gn_bias, conv_bias,
                                         running_mean, running_var))
    return forward(
        xp, x, out, shape,
        reference=partial(
            reference.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm, x, weight, bn_weight,
            bn_bias, gn_weight, gn_bias, num_groups=num_groups, stride=args.stride,
            padding=args.padding, output_padding=args.output_padding, groups=args.groups,
            conv_bias=conv_bias, pool_kernel=(k, k), eps=eps, running_mean=running_mean,
            running_var=running_var, momentum=momentum),
        gpu=gpu_path(gpu_method(method, args.out_shape), _fused, _unfused, xp, x, weight, args,
                     precision, k=k, num_groups=num_groups, conv_bias=conv_bias,
                     bn_weight=bn_weight, bn_bias=bn_bias, gn_weight=gn_weight, gn_bias=gn_bias,
                     running_mean=running_mean, running_var=running_var, momentum=momentum,
                     eps=eps))


def _unfused(xp, x, weight, args, precision, out, *, k, num_groups, conv_bias, bn_weight,
             bn_bias, gn_weight, gn_bias, running_mean, running_var, momentum, eps):
    """The building blocks one after the other (the baseline, and 64-bit indexing)."""
    y = conv_transpose2d(x, weight, conv_bias, stride=args.stride, padding=args.padding,
                         output_padding=args.output_padding, groups=args.groups,
                         precision=precision)
    # BatchNorm + tanh as a * y + b, as the fused route and the reference compute them also
    # without a weight or a bias (the public batch_norm then takes PyTorch CUDA's centered
    # form, which keeps a channel with an infinite weight finite).
    coef = bn_coefficients(xp, y, bn_weight, bn_bias, running_mean, running_var, True,
                           momentum, eps, centered_only=False)
    channel_affine(y, y, coef, inner=y.shape[2] * y.shape[3], activation="tanh")
    return group_norm(max_pool2d(y, k), num_groups, gn_weight, gn_bias, eps=eps, out=out)


def _fused(xp, x, weight, args, precision, out, *, k, num_groups, conv_bias, bn_weight,
           bn_bias, gn_weight, gn_bias, running_mean, running_var, momentum, eps):
    """The transposed convolution; one read of its output for the window extrema (into
    ``out``) and the batch statistics; BatchNorm as per-channel coefficients (and the running
    buffers updated); channels with a non-finite parameter recomputed; BatchNorm + tanh and
    the GroupNorm applied to the extrema in place."""
    # Non-finite weights and inputs by the definition: a weight's tap or an input that
    # reaches no output (cropped by the padding) leaves its channel or sample finite, where
    # an algorithm may multiply it by padding zeros or spread it.
    y, _ = conv_on_gpu(x, weight, args, precision, convert_output=False,
                       batch_statistics=True, definition_nans=True, definition_inputs=True)
    c = y.shape[1]
    # The pooled extrema go into out, and the GroupNorm maps them in place. From a
    # channels-last conv output the pass stores them channels-last with 16-byte stores, in
    # blocks of one group's channels: each (n, group) row then has the bytes it has in NCHW,
    # and the GroupNorm transposes it (in shared memory) where it stands (for B's 2 x 2 pool:
    # the path measured and tested on the GPU). Unlike a separate channels-last buffer, this
    # leaves no dirty lines of a temporary in the L2 to be written back during the GroupNorm.
    # A pooled plane of one value takes PyTorch CUDA's GroupNorm form for one value per
    # channel, which the GroupNorm pass applies to NCHW extrema only.
    variant = fused_pass_variant(y, k)
    ext_block = 0
    hw = out.shape[2] * out.shape[3]
    if (k == 2 and stores_ext_channels_last(variant, k) and out.data.ptr % 16 == 0 and hw > 1
            and group_rows_fit_channels_last(c, num_groups, hw)):
        ext_block = c // num_groups
    partial, shift, splits = pool_extremum_stats(
        xp, y, out, k, bias=None, sign_a=bn_weight, sign_b=None, shift_group=1,
        per_sample=False, variant=variant, ext_block=ext_block)
    moments = xp.empty((c, 2), dtype=xp.float32)
    coef = bn_coefficients(xp, y, bn_weight, bn_bias, running_mean, running_var, True,
                           momentum, eps, partial=(partial, shift), splits=splits,
                           mean_offset=conv_bias, moments=moments)
    pool_bn_tanh_nonfinite(y, out, moments, coef, bias=conv_bias, gamma=bn_weight, beta=bn_bias,
                           pool=k, ext_block=ext_block)
    group_norm_rows(out, out, gn_weight, gn_bias, num_groups=num_groups, eps=eps, pre=coef,
                    x_block=ext_block or None)
    return out


# The phases of a batch split in chunks (cufused.dask): BatchNorm's statistics span the whole
# batch, so each chunk's fused pass keeps its extrema and shifted sums (phase 1), the chunks'
# moments are merged (phase 2, cufused.dask), and each chunk's extrema are normalized with the
# batch's mean and variance (phase 3). Both run the kernels of the single call above on CuPy
# chunks with the arguments that a call of the pipeline checked.

def _chunk_extrema_sums(x, weight, conv_bias, bn_weight, *, stride, padding, output_padding,
                        groups: int, pool: int, precision: str):
    """Phase 1 on a CuPy chunk: the transposed convolution and one read of its output ``y``.

    Returns ``(pooled, sums, shift, count)``: the window extrema of ``y + conv_bias`` (the
    min where ``bn_weight < 0``), and each channel's sums ``(sum d, sum d * d)`` over its
    ``count`` values, ``d = y + conv_bias - shift`` (``sums`` (C, 2) float64 of the pass's
    partial sums, ``shift`` (C,) the channel's first value, 0 where infinite). The bias is in
    them, so that the chunks' merged moments give the running mean's update, and an
    infinite bias makes its channel's mean that infinity and its variance NaN, as in the
    single call (whose statistics skip the bias and add it to the mean) and PyTorch. The
    sample of ``y`` has at most ``FUSED_SAMPLE_VALUES`` elements (``gpu_method``).
    """
    xp = get_array_module(x=x)
    args = cached_conv_args(x.shape, weight.shape, 2, transposed=True, stride=stride,
                            padding=padding, output_padding=output_padding, groups=groups)
    check_conv_memory(x.shape, args, xp)
    n, c, h, w = args.out_shape
    y, _ = conv_on_gpu(x, weight, args, precision, convert_output=False,  # as _fused's
                       batch_statistics=True, definition_nans=True, definition_inputs=True)
    pooled = xp.empty((n, c, h // pool, w // pool), dtype=x.dtype)
    partial, shift, _ = pool_extremum_stats(
        xp, y, pooled, pool, bias=per_channel(conv_bias, c, xp),
        sign_a=per_channel(bn_weight, c, xp), sign_b=None, shift_group=1,
        per_sample=False, variant=fused_pass_variant(y, pool), ext_block=0)
    return pooled, partial.sum(axis=(0, 2), dtype=xp.float64), shift, n * h * w


def _chunk_normalized(pooled, mean, var, bn_weight, bn_bias, gn_weight, gn_bias, *,
                      num_groups: int, eps: float, centered_sums: bool):
    """Phase 3 on a CuPy chunk: BatchNorm with the batch's ``mean`` and biased ``var``
    (float64, per channel) and tanh, then GroupNorm, in one pass over phase 1's ``pooled``
    extrema: the single call's GroupNorm pass with the BatchNorm coefficients as its pre-map.
    ``centered_sums``: phase 1 summed the pooled values themselves (no convolution bias),
    so BatchNorm centers on the float64 mean, as the single call does; with a bias the sums
    skip the rounding of y + bias, and the float32 mean is as close. Returns a new array."""
    xp = get_array_module(x=pooled)
    c = pooled.shape[1]
    coef = coefficients_of_statistics(xp, pooled, bn_weight, bn_bias, mean, var, eps=eps,
                                      float64_center=centered_sums)
    out = xp.empty_like(pooled)
    group_norm_rows(pooled, out, per_channel(gn_weight, c, xp), per_channel(gn_bias, c, xp),
                    num_groups=num_groups, eps=eps, pre=coef)
    return out
