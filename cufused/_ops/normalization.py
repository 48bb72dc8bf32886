"""Normalization: ``group_norm`` and ``batch_norm`` (with a fused ``tanh``).

GPU statistics are shifted sums (the shift is each row's first value, so ``|mean| >> std`` stays
accurate; the split statistics take 0 for an infinite one): each thread sums the shifted
values in float64, so that a mean small next to the spread (the running mean) keeps its
accuracy too, and their squares in float32 with the rounding errors carried, so that a first
value far from the mean does too; the threads' sums combine in float64. The normalization is
folded into a per-channel affine ``a * (x - center) + c`` applied in one pass.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from functools import partial
from typing import Any

from .. import reference
from .._arrays import (check_bool, check_choice, check_fits, check_float_dtype, check_out,
                       check_per_channel, check_required, check_scalar, check_sizes,
                       check_writeable, forward, get_array_module, like_x_sections,
                       per_channel)
from .._call_graphs import replayed, warm_calls, without_call_graphs
from .._kernels.normalization import (ROW_CACHE_BYTES, batch_norm_coefficients, channel_affine,
                                     coef_array, group_norm_coefficients, group_norm_rows,
                                     key_stats_partial, reads_channels_last)
from .._scoped import scoped_value

__all__ = ["group_norm", "batch_norm"]

# The activations batch_norm fuses.
ACTIVATIONS = ("tanh",)  # or None: no activation


def check_num_groups(num_groups: Any, channels: int) -> int:
    """``num_groups`` must be a positive int dividing ``channels``."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral):
        raise TypeError(f"num_groups must be an int, got {type(num_groups).__name__}")
    if num_groups < 1 or channels % num_groups:
        raise ValueError(f"num_groups={num_groups} must be positive and divide the {channels} "
                         "channels")
    return int(num_groups)


# The batch size that PyTorch's rules across the batch (the two checks below) count: None,
# the call's own; else that of the whole batch of which the call runs a part or an empty probe
# (cufused.dask checks a batch once, when it builds the graph).
_WHOLE_BATCH: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "cufused_whole_batch", default=None)


@contextlib.contextmanager
def part_of_batch(n: int):
    """Inside, the rules across the batch count ``n`` samples, whatever the call's batch.

    The whole-call graph cache's launches from raw arguments skip the checks, and its keys do
    not hold ``n``: calls inside run ``without_call_graphs``, so the cache neither remembers
    nor replays them."""
    with scoped_value(_WHOLE_BATCH, n), without_call_graphs():
        yield


def _whole_batch(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with the batch that the rules across the batch count (:func:`part_of_batch`)."""
    n = _WHOLE_BATCH.get()
    return tuple(shape) if n is None else (n, *shape[1:])


def check_group_values(shape: tuple[int, ...], num_groups: int, name: str) -> None:
    """PyTorch's GroupNorm rule: more than one value per group across the batch
    (N * C / num_groups * spatial values; an empty batch passes)."""
    shape = _whole_batch(shape)
    if math.prod(shape) // num_groups == 1:
        raise ValueError(f"expected more than 1 value per group of {name}, got shape "
                         f"{shape} with num_groups={num_groups}")


def check_channel_values(shape: tuple[int, ...], name: str) -> None:
    """PyTorch's training-mode BatchNorm rule: more than one value per channel across the
    batch (N * spatial values; an empty batch passes)."""
    shape = _whole_batch(shape)
    if math.prod(shape) // shape[1] == 1:
        raise ValueError(f"expected more than 1 value per channel of {name} when training, "
                         f"got shape {shape}")


def check_running_pair(running_mean: Any, running_var: Any) -> None:
    """Both running buffers or neither, as PyTorch requires."""
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must both be given or both be None")


def _group_norm_gpu(xp, x, num_groups, weight, bias, eps, out):
    if not reads_channels_last(x, num_groups):
        x = xp.ascontiguousarray(x)  # a channels-last x is read in place
    n, c = x.shape[:2]
    hw = x.size // (n * c)
    length = (c // num_groups) * hw
    rows = n * num_groups
    if length * 4 <= ROW_CACHE_BYTES:
        group_norm_rows(x, out, weight, bias, num_groups=num_groups, eps=eps)
        return out
    partial, shift, splits = key_stats_partial(xp, x, rows, n_outer=1, outer_stride=0,
                                               key_stride=length, inner=length)
    coef = coef_array(xp, n * c)
    group_norm_coefficients(partial, shift, coef, rows=rows, row_len=splits,
                            count=length, channels=c, num_groups=num_groups, eps=eps,
                            centered_sums=True, gamma=weight, beta=bias,
                            centered_only=hw == 1)  # as group_norm_rows for one value
    channel_affine(x, out, coef, inner=hw)
    return out


@warm_calls
@like_x_sections("``num_groups`` does not divide C, a single value per group across the batch,\n"
                 "        wrong parameter sizes, bad ``eps``.",
                 type_error="Mixed array libraries, an unsupported dtype, or ``num_groups`` or\n"
                            "        ``eps`` of the wrong type.")
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
    check_fits(x.shape, xp, "the result")
    c = x.shape[1]
    num_groups = check_num_groups(num_groups, c)
    check_group_values(x.shape, num_groups, "x")
    eps = check_scalar(eps, "eps", minimum=0.0)
    check_per_channel(weight, "weight", c)
    check_per_channel(bias, "bias", c)
    check_out(out, x.shape, x.dtype, xp, x, inputs={"x": x, "weight": weight, "bias": bias},
              in_place=True)
    # Every check passed: a strided parameter becomes a contiguous device array.
    weight, bias = per_channel(weight, c, xp), per_channel(bias, c, xp)
    return forward(xp, x, out, x.shape,
                   reference=partial(reference.group_norm, x, num_groups, weight, bias, eps),
                   gpu=replayed(partial(_group_norm_gpu, xp, x, num_groups, weight, bias, eps)))


def check_running_buffer(buf: Any, name: str, channels: int, *, updated: bool = True) -> None:
    """A running-statistics buffer: C values; contiguous and writeable where it is
    ``updated`` in place (training), as PyTorch reads any strided buffer in inference."""
    if buf is None:
        return
    check_per_channel(buf, name, channels)
    if updated:
        if not buf.flags.c_contiguous:
            raise ValueError(f"{name} must be contiguous: it is updated in place")
        check_writeable(buf, name)


@warm_calls
@like_x_sections("Wrong parameter sizes, a single value per channel in training, missing running\n"
                 "        statistics in inference, bad ``momentum`` / ``eps``, an unknown\n"
                 "        ``activation``.",
                 type_error="Mixed array libraries, an unsupported dtype, or ``training``,\n"
                            "        ``momentum``, ``eps`` or ``activation`` of the wrong type.")
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
        Weight of the batch statistics in the running update; finite (past [0, 1] it
        extrapolates, as in PyTorch).
    eps : float
        Added to the variance; finite, > 0 in training and >= 0 in inference (as in
        PyTorch).
    activation : {None, "tanh"}
        Activation fused after the affine.

    Examples
    --------
    >>> import numpy as np, cufused
    >>> x = np.array([[[1.0], [10.0]], [[3.0], [30.0]]])   # N=2, C=2, L=1
    >>> rm, rv = np.zeros(2), np.ones(2)
    >>> cufused.batch_norm(x, running_mean=rm, running_var=rv)[:, :, 0]
    array([[-0.999995  , -0.99999995],
           [ 0.999995  ,  0.99999995]])
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
    check_fits(x.shape, xp, "the result")
    c = x.shape[1]
    training = check_bool(training, "training")
    momentum = check_scalar(momentum, "momentum")
    # PyTorch's rule: a positive eps in training (a constant channel's variance is 0).
    eps = check_scalar(eps, "eps", minimum=0.0, positive=training)
    check_choice(activation, "activation", ACTIVATIONS, none=True)
    if training:
        check_channel_values(x.shape, "x")
    if not training and (running_mean is None or running_var is None):
        raise ValueError("running_mean and running_var are required when training=False")
    check_per_channel(weight, "weight", c)
    check_per_channel(bias, "bias", c)
    check_running_buffer(running_mean, "running_mean", c, updated=training)
    check_running_buffer(running_var, "running_var", c, updated=training)
    check_running_pair(running_mean, running_var)
    check_out(out, x.shape, x.dtype, xp, x, in_place=True, inputs={
        "x": x, "weight": weight, "bias": bias, "running_mean": running_mean,
        "running_var": running_var})
    centered_only = torch_cuda_native_form(_whole_batch(x.shape), weight, bias, training)
    # Every check passed: a strided parameter becomes a contiguous device array.
    weight, bias, running_mean, running_var = (
        per_channel(v, c, xp) for v in (weight, bias, running_mean, running_var))
    stats = (running_mean, running_var, training, momentum, eps)
    return forward(xp, x, out, x.shape,
                   reference=partial(reference.batch_norm, x, weight, bias, *stats, activation),
                   gpu=replayed(partial(_batch_norm_gpu, xp, x, weight, bias, stats, activation,
                                        centered_only)))


# The largest batches, and the elements below which, PyTorch hands a BatchNorm to cuDNN.
CUDNN_TRAINING_BATCH, CUDNN_INFERENCE_BATCH, CUDNN_ELEMENTS = 880801, 65535, 2**31 - 1


def torch_cuda_native_form(shape: tuple[int, ...], weight, bias, training: bool) -> bool:
    """Whether PyTorch CUDA (cuDNN enabled) runs a BatchNorm of the whole batch's ``shape``
    with its native kernel, which keeps the centered form ``weight * (x - mean) * rstd + bias``
    for every coefficient: without a weight or a bias, for an (N, C) input, past the batches
    it hands to cuDNN or from 2**31 - 1 elements. Otherwise cuDNN's kernels run, and cufused
    keeps ``a * x + b`` for non-finite coefficients (ChannelAffine in common.cuh), as cuDNN
    does on small inputs. (PyTorch's eps condition, cuDNN 9's minimum of 0, holds for every
    eps that ``batch_norm`` accepts.)"""
    limit = CUDNN_TRAINING_BATCH if training else CUDNN_INFERENCE_BATCH
    return (weight is None or bias is None or len(shape) == 2 or shape[0] > limit
            or math.prod(shape) >= CUDNN_ELEMENTS)


def _batch_norm_gpu(xp, x, weight, bias, stats, activation, centered_only, out):
    x = xp.ascontiguousarray(x)
    coef = bn_coefficients(xp, x, weight, bias, *stats, centered_only=centered_only)
    hw = x.size // (x.shape[0] * x.shape[1])
    channel_affine(x, out, coef, inner=hw, activation=activation)
    return out


def split_mean(xp, mean):
    """A per-channel float64 ``mean`` as float32 ``(head, remainder)``: the running mean and
    ``running_mean_lo`` of :func:`bn_coefficients` in inference, which then centers on the
    float64 mean as a training call does (remainder 0 where the head is not finite)."""
    mean = xp.asarray(mean, dtype=xp.float64)
    head = mean.astype(xp.float32)
    finite = xp.isfinite(head)
    return head, xp.where(finite, mean - xp.where(finite, head, 0.0), 0.0).astype(xp.float32)


def coefficients_of_statistics(xp, x, weight, bias, mean, var, *, eps: float,
                               float64_center: bool = True, centered_only: bool = False):
    """BatchNorm's inference coefficients (:func:`bn_coefficients`) for ``x`` from a batch's
    float64 per-channel ``mean`` and biased ``var`` formed elsewhere (cufused.dask's, across
    chunks). ``float64_center`` centers on the float64 mean as the single training call does
    (:func:`split_mean`); otherwise on its float32 rounding. ``weight`` and ``bias`` are
    ``batch_norm``'s (None or per channel); ``centered_only`` as :func:`bn_coefficients`'s."""
    c = x.shape[1]
    if float64_center:
        head, remainder = split_mean(xp, mean)
    else:
        head, remainder = xp.asarray(mean, dtype=xp.float32), None
    return bn_coefficients(xp, x, per_channel(weight, c, xp), per_channel(bias, c, xp), head,
                           xp.asarray(var, dtype=xp.float32), False, 0.0, eps,
                           running_mean_lo=remainder, centered_only=centered_only)


def batch_norm_of_statistics(x, weight, bias, mean, var, *, eps: float,
                             activation: str | None, centered_only: bool = False):
    """``batch_norm`` of a CuPy ``x`` in inference with a batch's float64 ``mean`` and ``var``
    (:func:`coefficients_of_statistics`, on the float64 mean). Returns a new array; the
    arguments are ones that ``batch_norm`` accepts (the dask graph's probe checked them);
    ``centered_only`` the whole batch's :func:`torch_cuda_native_form`."""
    xp = get_array_module(x=x)
    check_float_dtype(xp, x=x)
    out = xp.empty(x.shape, dtype=x.dtype)
    if x.size == 0:
        return out
    x = xp.ascontiguousarray(x)
    coef = coefficients_of_statistics(xp, x, weight, bias, mean, var, eps=eps,
                                      centered_only=centered_only)
    channel_affine(x, out, coef, inner=x.size // (x.shape[0] * x.shape[1]),
                   activation=activation)
    return out


def bn_coefficients(xp, x, weight, bias, running_mean, running_var, training, momentum, eps,
                    *, partial=None, splits=None, mean_offset=None, moments=None,
                    running_mean_lo=None, centered_only=False):
    """BatchNorm's per-channel affine coefficients on the GPU, a (3, C) array
    (``coef_array``).

    In training the batch statistics come from ``partial`` (shifted sums laid out
    ``[n][c][split]``, as the pipelines' fused pass writes them) or, without it, from a
    split reduction over contiguous ``x``; the running buffers are updated in place. In
    inference the mean is ``running_mean`` plus ``running_mean_lo`` when given
    (:func:`split_mean`). ``moments``, a (C, 2) float32 array, receives each channel's
    (mean, rstd). ``centered_only`` keeps the centered form for non-finite coefficients too
    (:func:`torch_cuda_native_form`).
    """
    n, c = x.shape[:2]
    hw = x.size // (n * c)
    coef = coef_array(xp, c)
    if training and partial is None:
        partial, shift, splits = key_stats_partial(xp, x, c, n_outer=n, outer_stride=c * hw,
                                                   key_stride=hw, inner=hw)
        n_outer, outer_stride = 1, 0
    elif training:
        partial, shift = partial
        n_outer, outer_stride = n, c * splits
    else:
        partial, shift, n_outer, outer_stride, splits = None, None, 0, 0, 1
    batch_norm_coefficients(partial, shift, coef, n_outer=n_outer,
                            outer_stride=outer_stride, row_len=splits, count=n * hw,
                            channels=c, eps=eps, training=training, gamma=weight, beta=bias,
                            running_mean=running_mean, running_var=running_var,
                            mean_offset=mean_offset, momentum=momentum, moments=moments,
                            running_mean_lo=running_mean_lo, centered_only=centered_only)
    return coef
