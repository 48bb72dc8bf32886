"""Normalization: ``group_norm`` and ``batch_norm`` (with a fused ``tanh``).

GPU statistics are float32 shifted sums (the shift is each row's first value, so
``|mean| >> std`` stays accurate) combined in float64; the normalization is folded into a
per-channel ``a * x + b`` applied in one pass.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy

from . import reference
from ._arrays import (check_float_dtype, check_out, check_required, check_scalar, check_sizes,
                      check_writeable, finish_numpy, get_array_module, per_channel,
                      run_reference)
from ._cuda import get_kernel, launch_1d, optional
from ._cudnn import stored_in

__all__ = ["group_norm", "batch_norm"]

ACTIVATIONS = {None: 0, "tanh": 1}
_NORM = "normalization.cu"
# Rows up to this many float32 values stay in shared memory between the two passes.
ROW_CACHE_BYTES = 48 * 1024
# Aim for at least this many blocks in a split reduction.
_TARGET_BLOCKS = 2048


def check_num_groups(num_groups: Any, channels: int) -> int:
    """``num_groups`` must be a positive int dividing ``channels``."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral):
        raise TypeError(f"num_groups must be an int, got {type(num_groups).__name__}")
    if num_groups < 1 or channels % num_groups:
        raise ValueError(f"num_groups={num_groups} must be positive and divide the {channels} "
                         "channels")
    return int(num_groups)


def check_group_values(shape: tuple[int, ...], num_groups: int, name: str) -> None:
    """PyTorch's GroupNorm rule: more than one value per group across the batch
    (N * C / num_groups * spatial values; an empty batch passes)."""
    if math.prod(shape) // num_groups == 1:
        raise ValueError(f"expected more than 1 value per group of {name}, got shape "
                         f"{tuple(shape)} with num_groups={num_groups}")


def check_running_pair(running_mean: Any, running_var: Any) -> None:
    """Both running buffers or neither, as PyTorch requires."""
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must both be given or both be None")


def finalize_threads(partials_per_row: int) -> int:
    """Threads of a ``stats_finalize`` block: fewer for short rows (pipeline A sums 16)."""
    return min(256, 32 * max(1, -(-partials_per_row // 32)))


def split_count(keys: int, elements_per_key: int) -> int:
    """How many blocks share one statistics key: enough blocks overall, at least 1024 values
    each."""
    want = -(-_TARGET_BLOCKS // max(keys, 1))
    return max(1, min(want, -(-elements_per_key // 1024)))


def _affine_apply(cupy, x, y, coef_a, coef_b, inner: int, n_coef: int, act: int,
                  lo: float = 0.0, hi: float = 0.0) -> None:
    """``y = act(a[k] * x + b[k])`` over contiguous planes of ``inner`` values,
    k = plane % n_coef: one flat grid-stride pass, 16-byte accesses where aligned."""
    vec = 4 if (x.size % 4 == 0 and inner >= 4 and x.data.ptr % 16 == 0
                and y.data.ptr % 16 == 0) else 1
    n_vec = x.size // vec
    launch_1d(get_kernel(_NORM, f"channel_affine<{act}, {vec}>"), -(-n_vec // 4),  # 4 per thread
              (x, y, coef_a, coef_b, numpy.int64(n_vec), numpy.int64(inner),
               numpy.int64(n_coef), numpy.float32(lo), numpy.float32(hi)))


def group_rows_fit_channels_last(c: int, num_groups: int, hw: int) -> bool:
    """Whether GroupNorm rows of this shape can be read from a channels-last (N, HW, C)
    input: groups of 4, 8, ..., 128 channels (a thread keeps one 16-byte channel quad), rows
    that stay cached in shared memory."""
    cg = c // num_groups
    return cg % 4 == 0 and 32 % (cg // 4) == 0 and cg * hw * 4 <= ROW_CACHE_BYTES


def reads_channels_last(x, num_groups: int) -> bool:
    """Whether ``launch_group_norm_rows`` reads ``x`` in place as channels-last: stored so,
    16-byte aligned, with rows that ``group_rows_fit_channels_last`` allows."""
    n, c = x.shape[:2]
    hw = x.size // max(n * c, 1)
    return (x.ndim > 2 and c > 1 and hw > 1 and stored_in(x, "nhwc") and x.data.ptr % 16 == 0
            and group_rows_fit_channels_last(c, num_groups, hw))


def group_norm_threads(shared_bytes: int) -> int:
    """Threads of a GroupNorm row block that caches ``shared_bytes``: 128 while 8 blocks fit
    in an SM's shared memory (more blocks per SM overlap one block's reductions with another's
    loads: the fastest block size for B's GroupNorm, docs/design.rst), else 256, so that an
    SM still runs 1024 threads."""
    return 128 if 8 * shared_bytes <= 224 * 1024 else 256


def launch_group_norm_rows(x, y, num_groups: int, weight, bias, eps: float, *,
                           pre=None, x_block: int | None = None) -> None:
    """GroupNorm of ``x`` (N, C, ...) into contiguous ``y`` with one block per (n, group) row.

    ``x`` is contiguous, or channels-last where ``reads_channels_last`` allows. With
    ``x_block``, the memory of ``x`` holds channels-last values in blocks of ``x_block``
    channels, a whole number of groups (``blocked_channels_last`` in common.cuh), whatever
    its strides say, with rows that ``group_rows_fit_channels_last`` allows and 16-byte
    alignment; ``x`` may then be ``y`` when a block is one group.
    ``pre = (a, b)`` first maps each value to ``tanh(a[c] * x + b[c])``.
    The row stays in shared memory between statistics and normalize when it fits in
    ``ROW_CACHE_BYTES``, and is then visited one warp per channel where a channel has at
    least 32 values; 16-byte accesses when the row length and pointers allow.
    """
    n, c = x.shape[:2]
    hw = x.size // max(n * c, 1)
    length = (c // num_groups) * hw
    cache = length * 4 <= ROW_CACHE_BYTES
    vec = 4 if (length % 4 == 0 and hw >= 4 and x.data.ptr % 16 == 0
                and y.data.ptr % 16 == 0) else 1
    pre_a, pre_b = pre if pre is not None else (None, None)
    if x_block is None and reads_channels_last(x, num_groups):
        x_block = c
    elif x_block is not None and not (x_block % (c // num_groups) == 0 and c % x_block == 0
                                      and group_rows_fit_channels_last(c, num_groups, hw)
                                      and x.data.ptr % 16 == 0):
        raise ValueError(f"x_block={x_block} needs whole groups of 4k channels per block, rows "
                         "that fit in shared memory and 16-byte alignment")
    if x_block is not None:
        name = f"group_norm_rows_from_nhwc<{int(pre is not None)}, {vec}>"
    elif not x.flags.c_contiguous:
        raise ValueError("x must be contiguous, or channels-last as reads_channels_last allows")
    elif cache and hw >= 32:
        name = f"group_norm_rows_by_channel<{int(pre is not None)}, {vec}>"
    else:
        name = f"group_norm_rows<{int(pre is not None)}, {str(cache).lower()}, {vec}>"
    shared = length * 4 if cache else 0
    args = (x, y, optional(pre_a), optional(pre_b), optional(weight), optional(bias),
            numpy.int32(c), numpy.int32(num_groups), numpy.int32(hw), numpy.float32(eps))
    if x_block is not None:
        args += (numpy.int32(x_block),)
    get_kernel(_NORM, name)((n * num_groups,), (group_norm_threads(shared),), args,
                            shared_mem=shared)


def _group_norm_gpu(cupy, x, num_groups, weight, bias, eps, out):
    n, c = x.shape[:2]
    hw = x.size // (n * c)
    length = (c // num_groups) * hw
    rows = n * num_groups
    if length * 4 <= ROW_CACHE_BYTES:
        launch_group_norm_rows(x, out, num_groups, weight, bias, eps)
        return out
    splits = split_count(rows, length)
    partial = cupy.empty((rows, splits, 2), dtype=cupy.float32)
    shift = cupy.empty(rows, dtype=cupy.float32)
    get_kernel(_NORM, "key_stats_partial")(
        (rows * splits,), (256,),
        (x, partial, shift, numpy.int64(1), numpy.int64(0), numpy.int64(length),
         numpy.int64(length), numpy.int32(splits)))
    coef = cupy.empty((2, n * c), dtype=cupy.float32)
    get_kernel(_NORM, "stats_finalize<0>")(
        (rows,), (finalize_threads(splits),),
        (partial, shift, numpy.int64(1), numpy.int64(0), numpy.int32(splits),
         numpy.float64(length), optional(weight), optional(bias), numpy.uint64(0), coef[0],
         coef[1], numpy.int32(c), numpy.int32(num_groups), numpy.float32(eps), numpy.int32(1),
         numpy.uint64(0), numpy.uint64(0), numpy.uint64(0), numpy.float32(0), numpy.uint64(0)))
    _affine_apply(cupy, x, out, coef[0], coef[1], hw, n * c, 0)
    return out


def group_norm(x: Any, num_groups: int, weight: Any = None, bias: Any = None, *,
               eps: float = 1e-5, out: Any = None) -> Any:
    """Group normalization, as ``torch.nn.functional.group_norm``.

    The channels are split into ``num_groups`` groups; each (sample, group) is normalized by
    its own mean and biased variance, then the per-channel affine ``weight * y + bias`` applies.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Shape ``(N, C, ...)`` with at least 2 dimensions.
    num_groups : int
        Number of groups; must divide C.
    weight, bias : array, optional
        One value per channel (``(C,)``, ``(C, 1, 1)``, ``(1, C, 1, 1)``, ...).
    eps : float
        Added to the variance; finite and >= 0.
    out : array, optional
        Destination with the shape and dtype of ``x``.

    Returns
    -------
    array
        Same shape, dtype and array library as ``x``.

    Raises
    ------
    TypeError
        Mixed array libraries or an unsupported dtype.
    ValueError
        ``num_groups`` does not divide C, wrong parameter sizes, bad ``eps``.

    Examples
    --------
    >>> import numpy as np, cufused
    >>> x = np.arange(8, dtype=np.float64).reshape(1, 2, 4)
    >>> cufused.group_norm(x, 1).round(3)
    array([[[-1.528, -1.091, -0.655, -0.218],
            [ 0.218,  0.655,  1.091,  1.528]]])
    """
    check_required(x=x)
    xp = get_array_module(x=x, weight=weight, bias=bias)
    check_float_dtype(xp, x=x, weight=weight, bias=bias)
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (N, C, ...), got shape {x.shape}")
    check_sizes(x, "x")
    c = x.shape[1]
    num_groups = check_num_groups(num_groups, c)
    check_group_values(x.shape, num_groups, "x")
    weight = per_channel(weight, "weight", c, xp)
    bias = per_channel(bias, "bias", c, xp)
    eps = check_scalar(eps, "eps", minimum=0.0)
    check_out(out, x.shape, x.dtype, xp, x, inputs={"x": x, "weight": weight, "bias": bias},
              in_place=True)
    if xp is numpy and x.size:  # an empty batch falls through to the empty result below
        y = run_reference(reference.group_norm, x, num_groups, weight, bias, eps)
        return finish_numpy(y, x.dtype, out)
    if out is None:
        out = xp.empty(x.shape, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    if not reads_channels_last(x, num_groups):
        x = xp.ascontiguousarray(x)  # a channels-last x is read in place
    return _group_norm_gpu(xp, x, num_groups, weight, bias, eps, out)


def check_running_buffer(buf: Any, name: str, channels: int, xp) -> Any:
    """A running-statistics buffer: C values, contiguous (it is updated in place)."""
    if buf is None:
        return None
    flat = per_channel(buf, name, channels, xp)
    if not buf.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous: it is updated in place")
    check_writeable(buf, name)
    return flat


def check_training(training: Any) -> bool:
    """``training`` must be a bool (NumPy's too), as in PyTorch."""
    if not isinstance(training, (bool, numpy.bool_)):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")
    return bool(training)


def batch_norm(x: Any, weight: Any = None, bias: Any = None, *, running_mean: Any = None,
               running_var: Any = None, training: bool = True, momentum: float = 0.1,
               eps: float = 1e-5, activation: str | None = None, out: Any = None) -> Any:
    """Batch normalization, as ``torch.nn.functional.batch_norm``, with an optional fused tanh.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Shape ``(N, C, ...)`` with at least 2 dimensions.
    weight, bias : array, optional
        One value per channel.
    running_mean, running_var : array, optional
        Running statistics, C values each. In training they are updated in place when given
        (``(1 - momentum) * old + momentum * batch``, with the unbiased batch variance for
        ``running_var``); in inference both are required and used.
    training : bool
        Normalize with the batch statistics (biased variance) instead of the running ones.
    momentum : float
        Weight of the batch statistics in the running update, in [0, 1].
    eps : float
        Added to the variance; finite and >= 0.
    activation : {None, "tanh"}
        Activation fused after the affine.
    out : array, optional
        Destination with the shape and dtype of ``x``.

    Returns
    -------
    array
        Same shape, dtype and array library as ``x``.

    Raises
    ------
    TypeError
        Mixed array libraries or an unsupported dtype.
    ValueError
        Wrong parameter sizes, a single value per channel in training, missing running
        statistics in inference, bad ``momentum`` / ``eps`` / ``activation``.

    Examples
    --------
    >>> import numpy as np, cufused
    >>> x = np.array([[[1.0], [10.0]], [[3.0], [30.0]]])   # N=2, C=2, L=1
    >>> rm, rv = np.zeros(2), np.ones(2)
    >>> cufused.batch_norm(x, running_mean=rm, running_var=rv, eps=0.0)[:, :, 0]
    array([[-1., -1.],
           [ 1.,  1.]])
    >>> rm, rv
    (array([0.2, 2. ]), array([ 1.1, 20.9]))
    """
    check_required(x=x)
    xp = get_array_module(x=x, weight=weight, bias=bias, running_mean=running_mean,
                          running_var=running_var)
    check_float_dtype(xp, x=x, weight=weight, bias=bias, running_mean=running_mean,
                      running_var=running_var)
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (N, C, ...), got shape {x.shape}")
    check_sizes(x, "x")
    c = x.shape[1]
    weight = per_channel(weight, "weight", c, xp)
    bias = per_channel(bias, "bias", c, xp)
    running_mean = check_running_buffer(running_mean, "running_mean", c, xp)
    running_var = check_running_buffer(running_var, "running_var", c, xp)
    check_running_pair(running_mean, running_var)
    momentum = check_scalar(momentum, "momentum", minimum=0.0, maximum=1.0)
    eps = check_scalar(eps, "eps", minimum=0.0)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or 'tanh', got {activation!r}")
    training = check_training(training)
    if training and x.shape[0] and x.size // c < 2:
        raise ValueError("expected more than 1 value per channel when training, got x of "
                         f"shape {x.shape}")
    if not training and (running_mean is None or running_var is None):
        raise ValueError("running_mean and running_var are required when training=False")
    check_out(out, x.shape, x.dtype, xp, x, in_place=True,
              inputs={"x": x, "weight": weight, "bias": bias, "running_mean": running_mean,
                      "running_var": running_var})
    if xp is numpy and x.size:  # an empty batch falls through to the empty result below
        y = run_reference(reference.batch_norm, x, weight, bias, running_mean, running_var,
                          training, momentum, eps, activation)
        return finish_numpy(y, x.dtype, out)
    if out is None:
        out = xp.empty(x.shape, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    x = xp.ascontiguousarray(x)
    coef = bn_coefficients(xp, x, weight, bias, running_mean, running_var, training, momentum,
                           eps)
    hw = x.size // (x.shape[0] * c)
    _affine_apply(xp, x, out, coef[0], coef[1], hw, c, ACTIVATIONS[activation])
    return out


def bn_coefficients(cupy, x, weight, bias, running_mean, running_var, training, momentum, eps,
                    *, partial=None, splits=None, mean_offset=None, moments=None):
    """Per-channel ``(a, b)`` (a (2, C) array) of BatchNorm's affine on the GPU.

    In training the batch statistics come from ``partial`` (shifted sums laid out
    ``[n][c][split]``, as the pipelines' fused pass writes them) or, without it, from a
    split reduction over contiguous ``x``; the running buffers are updated in place.
    ``moments``, a (C, 2) float32 array, receives each channel's (mean, rstd).
    """
    n, c = x.shape[:2]
    hw = x.size // (n * c)
    coef = cupy.empty((2, c), dtype=cupy.float32)
    if training and partial is None:
        splits = split_count(c, n * hw)
        partial = cupy.empty((c, splits, 2), dtype=cupy.float32)
        shift = cupy.empty(c, dtype=cupy.float32)
        get_kernel(_NORM, "key_stats_partial")(
            (c * splits,), (256,),
            (x, partial, shift, numpy.int64(n), numpy.int64(c * hw), numpy.int64(hw),
             numpy.int64(hw), numpy.int32(splits)))
        n_outer, outer_stride = 1, 0
    elif training:
        partial, shift = partial
        n_outer, outer_stride = n, c * splits
    else:
        partial, shift, n_outer, outer_stride, splits = numpy.uint64(0), numpy.uint64(0), 0, 0, 1
    get_kernel(_NORM, "stats_finalize<1>")(
        (c,), (finalize_threads(n_outer * splits),),
        (partial, shift, numpy.int64(n_outer), numpy.int64(outer_stride), numpy.int32(splits),
         numpy.float64(n * hw), optional(weight), optional(bias), numpy.uint64(0), coef[0],
         coef[1], numpy.int32(c), numpy.int32(c), numpy.float32(eps), numpy.int32(training),
         optional(running_mean), optional(running_var), optional(mean_offset),
         numpy.float32(momentum), optional(moments)))
    return coef
