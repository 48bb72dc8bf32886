"""The three pipelines over a dask batch: A and C run the single call per chunk; B computes
its BatchNorm statistics over the whole batch in three phases (package docstring)."""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy

import cufused

from .._arrays import Size, check_bool, get_array_module, per_channel
from .._precision import resolve_precision
from ..pipelines._common import check_pipeline_pool, gpu_method
from ..pipelines.pipeline_b import _chunk_extrema_sums, _chunk_normalized
from ._blocks import _shared_sections, _with_sections
from ._graph import Array, _check_params, _each_chunk, _empty_batch, _Graph, _probing
from ._statistics import (_batch_statistics, _channel_moments, _normalize,
                          _normalized_batch, _shifted_moments, _without_numpy_warnings)


# The docstring of a pipeline that each batch chunk runs whole (independent per sample).
_PER_SAMPLE_DOC = """Pipeline {letter} over a dask batch: each chunk runs
    :func:`cufused.{name}` ({why}).

    Parameters
    ----------
    x : dask.array.Array
        Input {xshape} chunked along the batch axis only, of NumPy or CuPy chunks.
    {params} : array
        Parameters of the chunks' library (``scale`` may be a number), as in the single call.
    {options}
        As in :func:`cufused.{name}`.
    {{precision}}
    {{returns}}
    {{examples}}
    >>> rng = np.random.default_rng(0)
{example}
"""

conv2d_groupnorm_scale_maxpool_clamp = _each_chunk(
    cufused.conv2d_groupnorm_scale_maxpool_clamp, _with_sections(_PER_SAMPLE_DOC.format(
        letter="A", name="conv2d_groupnorm_scale_maxpool_clamp", why="GroupNorm is per sample",
        xshape="(N, C_in, H, W)", params="weight, conv_bias, gn_weight, gn_bias, scale",
        options="num_groups, pool_kernel, clamp_min, clamp_max, stride, padding, eps : "
                "int, float or tuple of int",
        example="""\
    >>> x = rng.random((3, 2, 8, 8), dtype=np.float32)
    >>> w = rng.standard_normal((4, 2, 3, 3), dtype=np.float32)
    >>> opts = dict(num_groups=2, pool_kernel=2, clamp_min=0.0, clamp_max=1.0)
    >>> y = cufused.dask.conv2d_groupnorm_scale_maxpool_clamp(
    ...     da.from_array(x, chunks={0: 2}), w, None, None, None, 2.0, **opts)
    >>> ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(x, w, None, None, None, 2.0, **opts)
    >>> y.shape, y.dtype, np.allclose(y.compute(), ref)
    ((3, 4, 3, 3), dtype('float32'), True)""")))

conv_transpose3d_avgpool_clamp_softmax_multiply = _each_chunk(
    cufused.conv_transpose3d_avgpool_clamp_softmax_multiply,
    _with_sections(_PER_SAMPLE_DOC.format(
        letter="C", name="conv_transpose3d_avgpool_clamp_softmax_multiply",
        why="the softmax is per sample and channel", xshape="(N, C_in, D, H, W)",
        params="weight, scale",
        options="stride, padding, output_padding, pool_kernel, clamp_min, clamp_max, "
                "conv_bias, groups : int, float, tuple of int or array",
        example="""\
    >>> x = rng.random((3, 2, 4, 4, 4))
    >>> w = rng.standard_normal((2, 3, 3, 3, 3))
    >>> opts = dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0,
    ...             clamp_max=1.0)
    >>> y = cufused.dask.conv_transpose3d_avgpool_clamp_softmax_multiply(
    ...     da.from_array(x, chunks={0: 1}), w, 1.0, **opts)
    >>> ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(x, w, 1.0, **opts)
    >>> y.chunks[0], np.allclose(y.compute(), ref)
    ((1, 1, 1), True)""")))


def _flip_channels(xp, weight, conv_bias, bn_weight, groups: int, channels: int):
    """ConvTranspose weight and bias with the output channels of negative ``bn_weight``
    negated, and the signs (+-1 per channel; None without ``bn_weight``).

    Negation is exact, so the flipped convolution is ``sign * y`` and a max pool of it is
    ``sign * (the window max of y, or its min where sign < 0)``: the extremum that
    ``tanh(a * v + b)`` maps to the window max. A NaN weight maps every value to NaN, and a
    zero weight to one value, so either extremum serves them.
    """
    if bn_weight is None:
        return weight, conv_bias, None
    negative = per_channel(bn_weight, channels, xp) < 0
    sign = 1 - 2 * negative.astype(weight.dtype)
    c_in, c_group = weight.shape[:2]
    flipped = (weight.reshape(groups, c_in // groups, c_group, -1)
               * sign.reshape(groups, 1, c_group, 1)).reshape(weight.shape)
    if conv_bias is not None:
        conv_bias = per_channel(conv_bias, channels, xp) * sign
    return flipped, conv_bias, sign


def _pool_moments_phase(x, weight, bias, bn_weight, *, stride, padding, output_padding,
                        groups: int, pool: int | None, precision: str):
    """Phase 1 of pipeline B on one chunk, composed of the public operations: ``(pooled
    extrema, channel moments)`` of the transposed convolution (with its bias, as the single
    call's statistics include it), its output channels negated where ``bn_weight < 0``
    (``_flip_channels``, from the parameters as they are when the graph runs).

    NumPy chunks run in float64, as the reference does end to end. ``pool=None`` returns the
    whole convolution output instead of the extrema (for ``_normalize_pooled``'s exact
    route)."""
    xp = get_array_module(x=x)
    if xp is numpy:
        x, weight, bias = (None if a is None else a.astype(numpy.float64, copy=False)
                           for a in (x, weight, bias))
    weight, bias, sign = _flip_channels(xp, weight, bias, bn_weight, groups,
                                        weight.shape[1] * groups)
    y = cufused.conv_transpose2d(x, weight, bias, stride=stride, padding=padding,
                                 output_padding=output_padding, groups=groups,
                                 precision=precision)
    pooled = y if pool is None else cufused.max_pool2d(y, pool)
    moments = _channel_moments(y)
    if sign is not None:
        pooled *= sign.reshape(1, -1, 1, 1)
        moments = moments.flipped(sign)
    return pooled, moments


@_without_numpy_warnings
def _normalize_pooled(pooled, mean, var, bn_weight, bn_bias, gn_weight, gn_bias, *,
                      num_groups: int, eps: float, dtype, pool: int | None = None):
    """Phase 3 of pipeline B on one chunk, composed of the public operations: BatchNorm with
    the batch statistics and tanh on the pooled extrema, then GroupNorm; cast to the input's
    dtype.

    With ``pool``, ``pooled`` is the whole convolution output, pooled after the tanh: the
    exact route for an infinite BatchNorm weight, whose windows hold +-1 and NaN values that no
    single extremum predicts."""
    y = _normalize(pooled, mean, var, bn_weight, bn_bias, eps=eps, activation="tanh")
    if pool is not None:
        y = cufused.max_pool2d(y, pool)
    return cufused.group_norm(y, num_groups, gn_weight, gn_bias, eps=eps).astype(dtype,
                                                                               copy=False)


def _extrema_moments_phase(x, weight, bias, bn_weight, *, stride, padding, output_padding,
                           groups: int, pool: int, precision: str):
    """Phase 1 of pipeline B on one CuPy chunk, on the single call's kernels: one read of the
    transposed convolution's output gives ``(pooled extrema, channel moments)``."""
    if x.shape[0] == 0:  # an empty chunk: the operations' empty results, no moments
        return _pool_moments_phase(x, weight, bias, None, stride=stride, padding=padding,
                                   output_padding=output_padding, groups=groups, pool=pool,
                                   precision=precision)
    pooled, sums, shift, count = _chunk_extrema_sums(
        x, weight, bias, bn_weight, stride=stride, padding=padding,
        output_padding=output_padding, groups=groups, pool=pool, precision=precision)
    return pooled, _shifted_moments(sums, shift, count)


def _normalize_extrema(pooled, mean, var, bn_weight, bn_bias, gn_weight, gn_bias, *,
                       num_groups: int, eps: float, centered_sums: bool):
    """Phase 3 of pipeline B on one CuPy chunk, on the single call's kernels: BatchNorm with
    the batch statistics, tanh and GroupNorm in one pass over the pooled extrema
    (``centered_sums``: phase 1 had no convolution bias; see ``_chunk_normalized``)."""
    if pooled.shape[0] == 0:
        return pooled.copy()
    return _chunk_normalized(pooled, mean, var, bn_weight, bn_bias, gn_weight, gn_bias,
                             num_groups=num_groups, eps=eps, centered_sums=centered_sums)


def _phases(xp, weight, conv_bias, bn_weight, *, conv_shape: tuple[int, ...], pool: int,
            num_groups: int, eps: float, dtype, precision: str, **conv_options):
    """Pipeline B's phases over a batch of ``xp`` chunks: ``(phase1, constants, phase3)``,
    with ``phase1(chunk, *constants.values())`` a chunk's ``(pooled, moments)`` and
    ``phase3(pooled, mean, var, bn_weight, bn_bias, gn_weight, gn_bias)`` its result.

    CuPy chunks run the single call's kernels where its fused pass does (``gpu_method``;
    ``conv_shape`` is the convolution output's). NumPy chunks, samples past 32-bit indexing
    and an infinite BatchNorm factor compose the public operations on weights whose output
    channels are negated where ``bn_weight < 0`` (``_flip_channels``; NumPy's in float64). An
    infinite BatchNorm factor (``_factor_may_overflow``) takes the exact route: the whole
    convolution output crosses to phase 3, which pools after the tanh, as the single call does
    for such channels. The route is chosen from ``bn_weight``'s values when the graph is
    built; the tasks read every parameter when the graph runs.
    """
    exact = _factor_may_overflow(bn_weight, eps, numpy.float64 if xp is numpy else numpy.float32)
    if xp is not numpy and not exact and gpu_method("fused", conv_shape) == "fused":
        return (functools.partial(_extrema_moments_phase, pool=pool, precision=precision,
                                  **conv_options),
                dict(weight=weight, conv_bias=conv_bias, bn_weight=bn_weight),
                functools.partial(_normalize_extrema, num_groups=num_groups, eps=eps,
                                  centered_sums=conv_bias is None))
    return (functools.partial(_pool_moments_phase, pool=None if exact else pool,
                              precision=precision, **conv_options),
            dict(weight=weight, conv_bias=conv_bias, bn_weight=bn_weight),
            functools.partial(_normalize_pooled, num_groups=num_groups, eps=eps, dtype=dtype,
                              pool=pool if exact else None))


def _pool_moments_tasks(graph: _Graph, phase1, constants: dict[str, Any]) -> list[tuple]:
    """Phase 1 in ``graph``: ``phase1(chunk, *constants.values())`` on every batch chunk;
    return the tasks' keys, in batch order."""
    task = graph.task(phase1)
    args = [graph.constant(name, value) for name, value in constants.items()]
    name = graph.key_name("phase1")
    keys = [(name, i) for i in range(len(graph.x.chunks[0]))]
    graph.dsk.update((key, (task, chunk, *args)) for key, chunk in zip(keys, graph.input_keys()))
    return keys


def _factor_may_overflow(bn_weight, eps: float, dtype) -> bool:
    """Whether a BatchNorm factor ``bn_weight * rstd`` can be infinite in ``dtype``: an
    infinite weight, or one whose product with ``rstd`` (at most ``1 / sqrt(eps)``) overflows.
    Where it is, BatchNorm's ``factor * v + shift`` is NaN for some of a window's values and
    infinite for others (``shift = bias - mean * factor``): the window's extremum alone does
    not give its result."""
    if bn_weight is None:
        return False
    w = numpy.abs(bn_weight.get() if hasattr(bn_weight, "get") else numpy.asarray(bn_weight))
    with numpy.errstate(all="ignore"):
        bound = w.astype(dtype) / numpy.sqrt(dtype(eps))
    # Half the largest float: margin for the device's rounding of rstd and of the product.
    return bool((bound > numpy.finfo(dtype).max / 2).any())


@_shared_sections
def conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        x: Array, weight: Any, bn_weight: Any, bn_bias: Any, gn_weight: Any, gn_bias: Any, *,
        num_groups: int, stride: Size = 1, padding: Size = 0, output_padding: Size = 0,
        groups: int = 1, conv_bias: Any = None, pool_kernel: int = 2, eps: float = 1e-5,
        running_mean: Any = None, running_var: Any = None, momentum: float = 0.1,
        precision: str | None = None, split_every: int | None = None,
        return_running_stats: bool = False) -> Array | tuple:
    """Pipeline B over a dask batch, with the BatchNorm statistics of the whole batch.

    Equals :func:`cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm` on the
    concatenated batch: phase 1 per chunk (transposed convolution, partial moments, pooled
    extrema), the tree reduction of the moments, phase 3 per chunk (BatchNorm + tanh on the
    pooled extrema, GroupNorm); see the module docstring.

    Parameters
    ----------
    x : dask.array.Array
        Input (N, C_in, H, W) chunked along the batch axis only, of NumPy or CuPy chunks.
    weight, bn_weight, bn_bias, gn_weight, gn_bias : array
        Parameters of the chunks' library, as in the single call.
    num_groups, stride, padding, output_padding, groups : int or tuple of int
        As in :func:`cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm`.
    conv_bias : array, optional
        Of the chunks' library, as in the single call.
    pool_kernel, eps : int or float
        As in the single call.
    running_mean, running_var : array, optional
        BatchNorm running buffers, updated in place by the statistics task, as in
        :func:`batch_norm`.
    momentum : float
        As in the single call.
    {precision}
    split_every : int, optional
        Partial moments merged per node of the tree reduction (default 8).
    return_running_stats : bool
        Also return the updated running buffers as dask arrays, as :func:`batch_norm` does.

    Returns
    -------
    dask.array.Array or tuple
        Lazy (N, C_out, H_conv // k, W_conv // k), chunked like ``x`` along the batch axis,
        of the chunks' library and dtype; with ``return_running_stats``,
        ``(result, running_mean, running_var)``.

    Raises
    ------
    {type_error}
        Also a ``split_every`` that is not an int.
    ValueError
        ``x`` is chunked along a non-batch axis, ``split_every`` below 2, or the single
        call's ``ValueError``.

    Examples
    --------
    >>> import numpy as np, dask, dask.array as da, cufused, cufused.dask
    >>> rng = np.random.default_rng(0)
    >>> x = rng.random((5, 4, 5, 5))
    >>> w = rng.standard_normal((4, 8, 3, 3))
    >>> bn_w = np.array([1.0, -1.0] * 4)
    >>> rm, rv = np.zeros(8), np.ones(8)
    >>> y, rm_new, rv_new = cufused.dask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
    ...     da.from_array(x, chunks={0: 2}), w, bn_w, None, None, None, num_groups=2,
    ...     running_mean=rm, running_var=rv, return_running_stats=True)
    >>> y, rm_new, rv_new = dask.compute(y, rm_new, rv_new)
    >>> rm2, rv2 = np.zeros(8), np.ones(8)
    >>> ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
    ...     x, w, bn_w, None, None, None, num_groups=2, running_mean=rm2, running_var=rv2)
    >>> np.allclose(y, ref), np.allclose(rm_new, rm2), np.allclose(rv_new, rv2)
    (True, True, True)
    """
    params = dict(weight=weight, bn_weight=bn_weight, bn_bias=bn_bias, gn_weight=gn_weight,
                  gn_bias=gn_bias, conv_bias=conv_bias, running_mean=running_mean,
                  running_var=running_var)
    empty = _empty_batch(x, "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm", params)
    return_running_stats = check_bool(return_running_stats, "return_running_stats")
    _check_params(params)
    precision = resolve_precision(precision)
    conv_options = dict(stride=stride, padding=padding, output_padding=output_padding,
                        groups=groups)
    with _probing(x):
        probe = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
            empty, weight, bn_weight, bn_bias, gn_weight, gn_bias, num_groups=num_groups,
            conv_bias=conv_bias, pool_kernel=pool_kernel, eps=eps, running_mean=running_mean,
            running_var=running_var, momentum=momentum, precision=precision, **conv_options)
        conv_shape = cufused.conv_transpose2d(empty, weight, **conv_options).shape
    graph = _Graph("conv_transpose2d_batchnorm_tanh_maxpool_groupnorm", x)
    phase1, constants, phase3 = _phases(
        get_array_module(x=empty), weight, conv_bias, bn_weight,
        conv_shape=(x.shape[0], *conv_shape[1:]),
        pool=check_pipeline_pool(pool_kernel, conv_shape[2:])[0],
        num_groups=num_groups, eps=eps, dtype=x.dtype, precision=precision, **conv_options)
    keys = _pool_moments_tasks(graph, phase1, constants)
    # The moments reach the reduction alone (a key each, so a distributed worker fetches no
    # pooled data); phase 3 reads the pooled part where phase 1 ran.
    stats = _batch_statistics(graph, [(operator.getitem, key, 1) for key in keys], running_mean,
                              running_var, momentum, split_every)
    return _normalized_batch(
        graph, stats, phase3, [(operator.getitem, key, 0) for key in keys],
        dict(bn_weight=bn_weight, bn_bias=bn_bias, gn_weight=gn_weight, gn_bias=gn_bias),
        probe, running_mean, running_var, return_running_stats)
