"""Scale out on Dask: every pipeline and building block over a ``dask.array.Array``.

The input is chunked along the batch axis only (every other axis in one chunk), with NumPy
chunks (the float64 reference runs on each) or CuPy chunks (the GPU path runs on each). Every
function checks its arguments and returns a lazy dask array with the result's shape, dtype,
chunks and chunk type (``meta``); nothing is computed until the result is. Parameters
(weights, biases, norm affines) are NumPy or CuPy arrays of the chunks' library that every
chunk reads whole; Dask puts each into the graph once.

Most operations are independent per sample and run the single call on each chunk
(``map_blocks``): the convolutions, GroupNorm, the pools, softmax over non-batch axes, BatchNorm
in inference, and pipelines A and C. BatchNorm in training mode, alone or inside pipeline B,
normalizes with the statistics of the whole batch, in three phases:

1. per chunk, the per-channel partial moments (count, mean, M2) in float64; in pipeline B the
   transposed convolution and each pooling window's extremum (the BatchNorm weight's sign
   decides max or min, since ``tanh(a * v + b)`` is monotone in ``v``) come with them, so the
   convolution output is never stored;
2. a tree reduction of the partial moments (Chan's parallel formula, ``split_every`` parts per
   node) into the batch mean and variance, whose task also updates the running buffers;
3. per chunk, the normalization (``batch_norm`` in inference mode with the batch statistics,
   then in pipeline B ``tanh`` and ``group_norm`` on the pooled data).

The result equals the single call on the concatenated batch to float32 rounding. Pipeline B's
single GPU call fuses phase 1 into one read of the convolution output; the phases here compose
the public operations and one existing statistics kernel, so they read it twice.

Running buffers are updated in place by the statistics task, once each time a computation
runs it (``compute``/``persist`` of the result, or of anything depending on it). The
threaded and synchronous schedulers run it in this process, on the caller's buffers; a
distributed worker updates its own copy, so there ``return_running_stats=True`` returns the
updated buffers as dask arrays to compute along with the result.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy

try:
    import dask
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.base import is_dask_collection, tokenize
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("cufused.dask needs Dask: install cufused[dask] "
                      "(dask[array,distributed]; dask-cuda for GPU clusters)") from exc

import cufused

from ._arrays import Size, get_array_module, is_cupy_array, per_channel
from ._cuda import get_kernel
from ._precision import resolve_precision
from .normalization import split_count
from .softmax import normalize_axes

__all__ = [
    "conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d",
    "group_norm", "batch_norm",
    "max_pool2d", "max_pool3d", "avg_pool2d", "avg_pool3d",
    "softmax",
    "conv2d_groupnorm_scale_maxpool_clamp",
    "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
    "conv_transpose3d_avgpool_clamp_softmax_multiply",
]

Array = da.Array

#: Partial moments of each node of the tree reduction (the default ``split_every``).
SPLIT_EVERY = 8


# --------------------------------------------------------------------------------------------
# Input checks and the per-sample case


def _empty_batch(x: Any, func: str):
    """Check ``x``: a dask array chunked along axis 0 only, of NumPy or CuPy chunks with known
    sizes. Return an empty batch ``(0, *x.shape[1:])`` of its chunk type, on which the single
    call checks the arguments and yields the result's shape and dtype without computing."""
    if not isinstance(x, da.Array):
        raise TypeError(
            f"x must be a dask.array.Array, got {type(x).__name__}: call cufused.{func} for a "
            "NumPy or CuPy array, or wrap it with dask.array.from_array(x, chunks={0: batch})")
    if x.ndim == 0:
        raise ValueError("x must have a batch axis (ndim >= 1), got a 0-d dask array")
    if any(math.isnan(s) for s in x.shape):
        raise ValueError(f"x has unknown chunk sizes (shape {x.shape}): call "
                         "x.compute_chunk_sizes() first")
    split = [axis for axis in range(1, x.ndim) if len(x.chunks[axis]) > 1]
    if split:
        spec = ", ".join(f"{axis}: -1" for axis in range(1, x.ndim))
        raise ValueError(
            f"x must be chunked along the batch axis (0) only, but axes {split} hold "
            f"{[len(x.chunks[a]) for a in split]} chunks: rechunk it explicitly, "
            f"x = x.rechunk({{{spec}}})")
    meta = x._meta
    if not (isinstance(meta, numpy.ndarray) or is_cupy_array(meta)):
        raise TypeError(f"x has chunks of type {type(meta).__module__}.{type(meta).__name__}; "
                        "cufused.dask runs NumPy or CuPy chunks")
    xp = get_array_module(x=meta)
    return xp.empty((0,) + tuple(x.shape[1:]), dtype=x.dtype)


def _check_params(params: dict[str, Any]) -> None:
    """Parameters are arrays that every chunk reads whole, not dask collections."""
    for name, value in params.items():
        if is_dask_collection(value):
            raise TypeError(
                f"{name} is a dask collection ({type(value).__name__}): pass it as a NumPy or "
                f"CuPy array of the chunks' library ({name}.compute()); every chunk reads all "
                "of it")


def _key_name(label: str, *inputs: Any) -> str:
    """A full key name for ``map_blocks``: a readable prefix and the hash of everything the
    output depends on. (Dask's ``token=`` prefix is deprecated in some releases and ``name=``
    is a prefix in some, a full name in others; a full unique name suits them all.)"""
    return f"cufused-{label}-{tokenize(*inputs)}"


def _map_chunks(func: Callable, x: Array, params: dict[str, Any], options: dict[str, Any],
                empty=None) -> Array:
    """``func(chunk, *params.values(), **options)`` on every batch chunk of ``x``."""
    if empty is None:
        empty = _empty_batch(x, func.__name__)
    _check_params({**params, **options})
    probe = func(empty, *params.values(), **options)  # checks everything, computes nothing
    chunks = (x.chunks[0],) + tuple((s,) for s in probe.shape[1:])
    task = functools.partial(func, **options)
    return da.map_blocks(task, x, *params.values(), chunks=chunks, dtype=probe.dtype,
                         meta=meta_from_array(probe),
                         name=_key_name(func.__name__, task, x, *params.values()))


# --------------------------------------------------------------------------------------------
# Batch statistics: phase 1 (partial moments), phase 2 (tree reduction), phase 3 (apply)


def _without_numpy_warnings(func: Callable) -> Callable:
    """NaN and inf propagate silently through the statistics, as through the single call's
    reference (``run_reference``)."""
    @functools.wraps(func)
    def quiet(*args, **kwargs):
        with numpy.errstate(all="ignore"):
            return func(*args, **kwargs)
    return quiet


@_without_numpy_warnings
def _channel_moments(y) -> tuple[int, Any, Any]:
    """Per-channel ``(count, mean, M2)`` of ``y`` (N, C, ...) over every axis but 1, in float64
    arrays of ``y``'s library; ``M2`` is the sum of squared deviations from the mean.

    On the GPU one read of ``y`` gives float32 sums shifted by each channel's first value
    (``key_stats_partial``, as ``batch_norm`` uses), summed in float64.
    """
    xp = get_array_module(y=y)
    n, c = y.shape[:2]
    count = y.size // c
    if count == 0:
        zeros = xp.zeros(c, dtype=numpy.float64)
        return 0, zeros, zeros
    if xp is numpy:
        axes = (0,) + tuple(range(2, y.ndim))
        y = y.astype(numpy.float64, copy=False)
        mean = y.mean(axis=axes)
        m2 = numpy.square(y - mean.reshape((c,) + (1,) * (y.ndim - 2))).sum(axis=axes)
        return count, mean, m2
    y = xp.ascontiguousarray(y)
    hw = count // n
    splits = split_count(c, count)
    partial = xp.empty((c, splits, 2), dtype=xp.float32)
    shift = xp.empty(c, dtype=xp.float32)
    get_kernel("normalization.cu", "key_stats_partial")(
        (c * splits,), (256,),
        (y, partial, shift, numpy.int64(n), numpy.int64(c * hw), numpy.int64(hw),
         numpy.int64(hw), numpy.int32(splits)))
    sums = partial.sum(axis=1, dtype=xp.float64)
    offset = sums[:, 0] / count
    m2 = sums[:, 1] - sums[:, 0] * offset
    # Rounding can push M2 below 0: clamp it, keeping a NaN (NaN < 0 is false).
    return count, shift.astype(xp.float64) + offset, xp.where(m2 < 0, 0.0, m2)


@_without_numpy_warnings
def _merge_moments(*parts: tuple[int, Any, Any]) -> tuple[int, Any, Any]:
    """Chan et al.'s parallel combination of partial ``(count, mean, M2)`` moments."""
    count, mean, m2 = parts[0]
    for n_b, mean_b, m2_b in parts[1:]:
        if n_b == 0:
            continue
        if count == 0:
            count, mean, m2 = n_b, mean_b, m2_b
            continue
        total = count + n_b
        delta = mean_b - mean
        mean = mean + delta * (n_b / total)
        m2 = m2 + m2_b + delta * delta * (count * n_b / total)
        count = total
    return count, mean, m2


@_without_numpy_warnings
def _finish_statistics(moments: tuple[int, Any, Any], running_mean, running_var,
                       momentum: float) -> tuple[Any, Any, Any, Any]:
    """Batch ``(mean, biased variance)`` from the merged moments; the running buffers, when
    given, are updated in place as PyTorch does (unbiased variance) and returned as copies.

    An empty batch leaves the buffers alone, as the single call does."""
    count, mean, m2 = moments
    if count == 0:
        return mean, m2, _copy(running_mean), _copy(running_var)
    var = m2 / count
    unbiased = var * (count / (count - 1))  # count >= 2: checked with the graph
    for buf, batch in ((running_mean, mean), (running_var, unbiased)):
        if buf is not None:
            buf[...] = ((1.0 - momentum) * buf.astype(numpy.float64)
                        + momentum * batch.reshape(buf.shape)).astype(buf.dtype)
    return mean, var, _copy(running_mean), _copy(running_var)


def _copy(buf):
    return None if buf is None else buf.copy()


def _batch_statistics(moments: list, running_mean, running_var, momentum: float,
                      split_every: int | None):
    """Phase 2: the tree reduction of the chunks' moments and the statistics task.

    Returns four ``Delayed``: the batch mean and biased variance (float64, C values), the
    updated running mean and variance (copies; None where not given).
    """
    split_every = SPLIT_EVERY if split_every is None else split_every
    if isinstance(split_every, bool) or not isinstance(split_every, int) or split_every < 2:
        raise ValueError(f"split_every must be an int >= 2, got {split_every!r}")
    merge = dask.delayed(_merge_moments, pure=True)
    while len(moments) > 1:
        moments = [merge(*moments[i:i + split_every])
                   for i in range(0, len(moments), split_every)]
    # Impure (a fresh key per graph): each graph built updates the buffers when it computes,
    # even where two graphs are built from equal inputs.
    return tuple(dask.delayed(_finish_statistics, pure=False, nout=4)(
        moments[0], running_mean, running_var, momentum))


def _normalize(chunk, mean, var, weight, bias, *, eps: float, activation: str | None):
    """Phase 3 of BatchNorm: ``batch_norm`` in inference mode with the batch statistics
    (float32 on the GPU, whose path takes no float64)."""
    if get_array_module(x=chunk) is not numpy:
        mean, var = mean.astype(numpy.float32), var.astype(numpy.float32)
    return cufused.batch_norm(chunk, weight, bias, running_mean=mean, running_var=var,
                              training=False, eps=eps, activation=activation)


def _running_results(stats, running_mean, running_var, meta) -> tuple:
    """The updated running buffers as dask arrays (None where not given)."""
    return tuple(None if buf is None else
                 da.from_delayed(value, shape=buf.shape, dtype=buf.dtype,
                                 meta=meta_from_array(meta, buf.ndim, buf.dtype))
                 for value, buf in zip(stats[2:], (running_mean, running_var)))


def _check_count(count: int) -> None:
    if 0 < count < 2:
        raise ValueError("expected more than 1 value per channel for training-mode BatchNorm")


# --------------------------------------------------------------------------------------------
# Building blocks

_RETURNS = """
    Returns
    -------
    dask.array.Array
        Lazy; chunked like ``x`` along the batch axis, every other axis in one chunk; the
        chunks' library (NumPy or CuPy) and dtype of the single call.

    Raises
    ------
    TypeError
        ``x`` is not a dask array of NumPy or CuPy chunks, a parameter is a dask collection,
        or the single call's ``TypeError``.
    ValueError
        ``x`` is chunked along a non-batch axis, or the single call's ``ValueError``.
"""


def _shared_sections(func: Callable) -> Callable:
    """Put the per-sample functions' common Returns and Raises sections into a docstring."""
    func.__doc__ = func.__doc__.replace("    {returns}\n", _RETURNS + "\n")
    return func

_X = """x : dask.array.Array
        Input chunked along the batch axis only, of NumPy or CuPy chunks."""

_CONV_DOC = """{title}, each batch chunk running :func:`cufused.{name}`.

    Parameters
    ----------
    {x}
    weight, bias : array
        NumPy or CuPy arrays of the chunks' library (``bias`` may be None).
    stride, padding, {extra}dilation, groups
        As in :func:`cufused.{name}`.
    precision : {{"ieee", "tf32"}}, optional
        ``None`` is the caller's default (:func:`cufused.get_default_precision`) when the
        graph is built, not the workers' when it runs.
{returns}
    Examples
    --------
    >>> import numpy as np, dask.array as da, cufused, cufused.dask
    >>> rng = np.random.default_rng(0)
    >>> x = rng.random({xshape})
    >>> w = rng.standard_normal({wshape})
    >>> y = cufused.dask.{name}(da.from_array(x, chunks={{0: 2}}), w, {call})
    >>> y.chunks[0], np.allclose(y.compute(), cufused.{name}(x, w, {call}))
    ((2, 1), True)
"""


def conv2d(x: Array, weight: Any, bias: Any = None, *, stride: Size = 1, padding: Size = 0,
           dilation: Size = 1, groups: int = 1, precision: str | None = None) -> Array:
    return _map_chunks(cufused.conv2d, x, dict(weight=weight, bias=bias), dict(
        stride=stride, padding=padding, dilation=dilation, groups=groups,
        precision=resolve_precision(precision)))


def conv3d(x: Array, weight: Any, bias: Any = None, *, stride: Size = 1, padding: Size = 0,
           dilation: Size = 1, groups: int = 1, precision: str | None = None) -> Array:
    return _map_chunks(cufused.conv3d, x, dict(weight=weight, bias=bias), dict(
        stride=stride, padding=padding, dilation=dilation, groups=groups,
        precision=resolve_precision(precision)))


def conv_transpose2d(x: Array, weight: Any, bias: Any = None, *, stride: Size = 1,
                     padding: Size = 0, output_padding: Size = 0, dilation: Size = 1,
                     groups: int = 1, precision: str | None = None) -> Array:
    return _map_chunks(cufused.conv_transpose2d, x, dict(weight=weight, bias=bias), dict(
        stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
        groups=groups, precision=resolve_precision(precision)))


def conv_transpose3d(x: Array, weight: Any, bias: Any = None, *, stride: Size = 1,
                     padding: Size = 0, output_padding: Size = 0, dilation: Size = 1,
                     groups: int = 1, precision: str | None = None) -> Array:
    return _map_chunks(cufused.conv_transpose3d, x, dict(weight=weight, bias=bias), dict(
        stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
        groups=groups, precision=resolve_precision(precision)))


for _func, _title, _xshape, _wshape, _call in (
        (conv2d, "2-D convolution", "(3, 2, 6, 6)", "(4, 2, 3, 3)", "padding=1"),
        (conv3d, "3-D convolution", "(3, 2, 4, 4, 4)", "(4, 2, 3, 3, 3)", "stride=2"),
        (conv_transpose2d, "2-D transposed convolution", "(3, 2, 5, 5)", "(2, 4, 3, 3)",
         "stride=2"),
        (conv_transpose3d, "3-D transposed convolution", "(3, 2, 3, 3, 3)", "(2, 4, 2, 2, 2)",
         "stride=2")):
    _func.__doc__ = _CONV_DOC.format(
        title=_title, name=_func.__name__, x=_X, returns=_RETURNS, xshape=_xshape,
        wshape=_wshape, call=_call,
        extra="output_padding, " if "transpose" in _func.__name__ else "")
del _func, _title, _xshape, _wshape, _call


@_shared_sections
def group_norm(x: Array, num_groups: int, weight: Any = None, bias: Any = None, *,
               eps: float = 1e-5) -> Array:
    """Group normalization, each batch chunk running :func:`cufused.group_norm` (the groups
    are per sample).

    Parameters
    ----------
    x : dask.array.Array
        Input (N, C, ...) chunked along the batch axis only, of NumPy or CuPy chunks.
    num_groups : int
        Number of groups; must divide C.
    weight, bias : array, optional
        One value per channel, of the chunks' library.
    eps : float
        Added to the variance.
    {returns}
    Examples
    --------
    >>> import numpy as np, dask.array as da, cufused, cufused.dask
    >>> x = np.random.default_rng(0).random((3, 4, 5))
    >>> y = cufused.dask.group_norm(da.from_array(x, chunks={0: 2}), 2)
    >>> np.allclose(y.compute(), cufused.group_norm(x, 2))
    True
    """
    return _map_chunks(cufused.group_norm, x,
                       dict(num_groups=num_groups, weight=weight, bias=bias), dict(eps=eps))


def batch_norm(x: Array, weight: Any = None, bias: Any = None, *, running_mean: Any = None,
               running_var: Any = None, training: bool = True, momentum: float = 0.1,
               eps: float = 1e-5, activation: str | None = None,
               split_every: int | None = None,
               return_running_stats: bool = False) -> Array | tuple:
    """Batch normalization over the whole dask batch, as :func:`cufused.batch_norm` on the
    concatenated batch, with an optional fused tanh.

    In training the per-channel statistics of the whole batch come from per-chunk partial
    moments merged in a tree (module docstring); in inference each chunk runs the single
    call with the running statistics.

    Parameters
    ----------
    x : dask.array.Array
        Input (N, C, ...) chunked along the batch axis only, of NumPy or CuPy chunks.
    weight, bias : array, optional
        One value per channel, of the chunks' library.
    running_mean, running_var : array, optional
        Running statistics (C values each, of the chunks' library). In training they are
        updated in place (``(1 - momentum) * old + momentum * batch``, unbiased variance)
        by the statistics task, each time a computation runs it: in this process with the
        threaded or synchronous scheduler, on a worker's copy with a distributed one (see
        ``return_running_stats``). In inference both are required and read.
    training : bool
        Normalize with the batch statistics (biased variance) instead of the running ones.
    momentum : float
        Weight of the batch statistics in the running update, in [0, 1].
    eps : float
        Added to the variance.
    activation : {None, "tanh"}
        Activation fused after the affine.
    split_every : int, optional
        Partial moments merged per node of the tree reduction (default 8).
    return_running_stats : bool
        Also return the updated running buffers (training only) as dask arrays:
        ``y, mean, var = batch_norm(..., return_running_stats=True)``; compute them together
        with ``y`` (``dask.compute(y, mean, var)``), which runs the statistics task once.

    Returns
    -------
    dask.array.Array or tuple
        Lazy, chunked like ``x``, of the chunks' library and dtype; with
        ``return_running_stats``, ``(result, running_mean, running_var)`` where each buffer
        not given is None.

    Raises
    ------
    TypeError
        ``x`` is not a dask array of NumPy or CuPy chunks, a parameter is a dask collection,
        or the single call's ``TypeError``.
    ValueError
        ``x`` is chunked along a non-batch axis, ``return_running_stats`` in inference, a bad
        ``split_every``, or the single call's ``ValueError``.

    Examples
    --------
    >>> import numpy as np, dask.array as da, cufused, cufused.dask
    >>> x = np.random.default_rng(0).random((5, 2, 3))
    >>> rm, rv = np.zeros(2), np.ones(2)
    >>> y = cufused.dask.batch_norm(da.from_array(x, chunks={0: 2}), running_mean=rm,
    ...                             running_var=rv)
    >>> np.allclose(y.compute(), cufused.batch_norm(x))
    True
    >>> np.allclose(rm, 0.1 * x.mean(axis=(0, 2)))  # updated in place by compute()
    True
    """
    params = dict(weight=weight, bias=bias, running_mean=running_mean, running_var=running_var)
    if not training:
        if return_running_stats:
            raise ValueError("return_running_stats applies in training only: inference leaves "
                             "the running buffers unchanged")
        return _map_chunks(cufused.batch_norm, x, dict(weight=weight, bias=bias), dict(
            running_mean=running_mean, running_var=running_var, training=False,
            momentum=momentum, eps=eps, activation=activation))
    empty = _empty_batch(x, "batch_norm")
    _check_params(params)
    probe = cufused.batch_norm(empty, weight, bias, running_mean=running_mean,
                               running_var=running_var, momentum=momentum, eps=eps,
                               activation=activation)
    _check_count(x.size // x.shape[1])
    blocks = x.to_delayed(optimize_graph=False).ravel()
    moments = [dask.delayed(_channel_moments, pure=True)(block) for block in blocks]
    stats = _batch_statistics(moments, running_mean, running_var, momentum, split_every)
    task = functools.partial(_normalize, eps=eps, activation=activation)
    args = (x, stats[0], stats[1], weight, bias)
    out = da.map_blocks(task, *args, dtype=x.dtype, meta=meta_from_array(probe),
                        name=_key_name("batch_norm", task, *args))
    if return_running_stats:
        return (out,) + _running_results(stats, running_mean, running_var, empty)
    return out


_POOL_DOC = """{title}, each batch chunk running :func:`cufused.{name}`.

    Parameters
    ----------
    {x}
    kernel_size, stride, padding
        As in :func:`cufused.{name}`.
{returns}
    Examples
    --------
    >>> import numpy as np, dask.array as da, cufused, cufused.dask
    >>> x = np.random.default_rng(0).random({xshape})
    >>> y = cufused.dask.{name}(da.from_array(x, chunks={{0: 2}}), 2)
    >>> y.shape, np.allclose(y.compute(), cufused.{name}(x, 2))
    ({yshape}, True)
"""


def max_pool2d(x: Array, kernel_size: Size, stride: Size | None = None,
               padding: Size = 0) -> Array:
    return _map_chunks(cufused.max_pool2d, x, {},
                       dict(kernel_size=kernel_size, stride=stride, padding=padding))


def max_pool3d(x: Array, kernel_size: Size, stride: Size | None = None,
               padding: Size = 0) -> Array:
    return _map_chunks(cufused.max_pool3d, x, {},
                       dict(kernel_size=kernel_size, stride=stride, padding=padding))


def avg_pool2d(x: Array, kernel_size: Size, stride: Size | None = None,
               padding: Size = 0) -> Array:
    return _map_chunks(cufused.avg_pool2d, x, {},
                       dict(kernel_size=kernel_size, stride=stride, padding=padding))


def avg_pool3d(x: Array, kernel_size: Size, stride: Size | None = None,
               padding: Size = 0) -> Array:
    return _map_chunks(cufused.avg_pool3d, x, {},
                       dict(kernel_size=kernel_size, stride=stride, padding=padding))


for _func, _title, _xshape, _yshape in (
        (max_pool2d, "2-D max pooling", "(3, 2, 4, 6)", "(3, 2, 2, 3)"),
        (max_pool3d, "3-D max pooling", "(3, 2, 4, 4, 2)", "(3, 2, 2, 2, 1)"),
        (avg_pool2d, "2-D average pooling", "(3, 2, 4, 6)", "(3, 2, 2, 3)"),
        (avg_pool3d, "3-D average pooling", "(3, 2, 4, 4, 2)", "(3, 2, 2, 2, 1)")):
    _func.__doc__ = _POOL_DOC.format(title=_title, name=_func.__name__, x=_X, returns=_RETURNS,
                                     xshape=_xshape, yshape=_yshape)
del _func, _title, _xshape, _yshape


@_shared_sections
def softmax(x: Array, axis: Size = -1) -> Array:
    """Softmax over ``axis`` (an int or a tuple), each batch chunk running
    :func:`cufused.softmax`.

    Axes other than the batch axis are per sample; the batch axis (0) is allowed only where
    ``x`` holds the whole batch in one chunk.

    Parameters
    ----------
    x : dask.array.Array
        Input chunked along the batch axis only, of NumPy or CuPy chunks.
    axis : int or tuple of int
        The axis or axes normalized together.
    {returns}
    Examples
    --------
    >>> import numpy as np, dask.array as da, cufused, cufused.dask
    >>> x = np.random.default_rng(0).random((3, 2, 4, 4, 4))
    >>> y = cufused.dask.softmax(da.from_array(x, chunks={0: 2}), axis=(2, 3, 4))
    >>> np.allclose(y.compute(), cufused.softmax(x, axis=(2, 3, 4)))
    True
    """
    empty = _empty_batch(x, "softmax")
    if 0 in normalize_axes(axis, x.ndim) and len(x.chunks[0]) > 1:
        raise ValueError(
            "softmax over the batch axis (0) needs the whole batch in one chunk, got "
            f"{len(x.chunks[0])} chunks: leave axis 0 out, or x.rechunk({{0: -1}})")
    return _map_chunks(cufused.softmax, x, {}, dict(axis=axis), empty)


# --------------------------------------------------------------------------------------------
# Pipelines


@_shared_sections
def conv2d_groupnorm_scale_maxpool_clamp(
        x: Array, weight: Any, conv_bias: Any, gn_weight: Any, gn_bias: Any, scale: Any, *,
        num_groups: int, pool_kernel: int, clamp_min: float, clamp_max: float,
        stride: Size = 1, padding: Size = 0, eps: float = 1e-5,
        precision: str | None = None) -> Array:
    """Pipeline A over a dask batch: each chunk runs
    :func:`cufused.conv2d_groupnorm_scale_maxpool_clamp` (GroupNorm is per sample).

    Parameters
    ----------
    x : dask.array.Array
        Input (N, C_in, H, W) chunked along the batch axis only, of NumPy or CuPy chunks.
    weight, conv_bias, gn_weight, gn_bias, scale
        Parameters of the chunks' library (``scale`` may be a number), as in the single call.
    num_groups, pool_kernel, clamp_min, clamp_max, stride, padding, eps
        As in :func:`cufused.conv2d_groupnorm_scale_maxpool_clamp`.
    precision : {"ieee", "tf32"}, optional
        ``None`` is the caller's default when the graph is built.
    {returns}
    Examples
    --------
    >>> import numpy as np, dask.array as da, cufused, cufused.dask
    >>> rng = np.random.default_rng(0)
    >>> x = rng.random((3, 2, 8, 8), dtype=np.float32)
    >>> w = rng.standard_normal((4, 2, 3, 3), dtype=np.float32)
    >>> opts = dict(num_groups=2, pool_kernel=2, clamp_min=0.0, clamp_max=1.0)
    >>> y = cufused.dask.conv2d_groupnorm_scale_maxpool_clamp(
    ...     da.from_array(x, chunks={0: 2}), w, None, None, None, 2.0, **opts)
    >>> ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(x, w, None, None, None, 2.0, **opts)
    >>> y.shape, y.dtype, np.allclose(y.compute(), ref)
    ((3, 4, 3, 3), dtype('float32'), True)
    """
    return _map_chunks(
        cufused.conv2d_groupnorm_scale_maxpool_clamp, x,
        dict(weight=weight, conv_bias=conv_bias, gn_weight=gn_weight, gn_bias=gn_bias,
             scale=scale),
        dict(num_groups=num_groups, pool_kernel=pool_kernel, clamp_min=clamp_min,
             clamp_max=clamp_max, stride=stride, padding=padding, eps=eps,
             precision=resolve_precision(precision)))


@_shared_sections
def conv_transpose3d_avgpool_clamp_softmax_multiply(
        x: Array, weight: Any, scale: Any, *, stride: Size, padding: Size,
        output_padding: Size, pool_kernel: int, clamp_min: float, clamp_max: float,
        conv_bias: Any = None, groups: int = 1, precision: str | None = None) -> Array:
    """Pipeline C over a dask batch: each chunk runs
    :func:`cufused.conv_transpose3d_avgpool_clamp_softmax_multiply` (the softmax is per
    sample and channel).

    Parameters
    ----------
    x : dask.array.Array
        Input (N, C_in, D, H, W) chunked along the batch axis only, of NumPy or CuPy chunks.
    weight, scale, conv_bias
        Parameters of the chunks' library (``scale`` may be a number), as in the single call.
    stride, padding, output_padding, pool_kernel, clamp_min, clamp_max, groups
        As in :func:`cufused.conv_transpose3d_avgpool_clamp_softmax_multiply`.
    precision : {"ieee", "tf32"}, optional
        ``None`` is the caller's default when the graph is built.
    {returns}
    Examples
    --------
    >>> import numpy as np, dask.array as da, cufused, cufused.dask
    >>> rng = np.random.default_rng(0)
    >>> x = rng.random((3, 2, 4, 4, 4))
    >>> w = rng.standard_normal((2, 3, 3, 3, 3))
    >>> opts = dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0,
    ...             clamp_max=1.0)
    >>> y = cufused.dask.conv_transpose3d_avgpool_clamp_softmax_multiply(
    ...     da.from_array(x, chunks={0: 1}), w, 1.0, **opts)
    >>> ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(x, w, 1.0, **opts)
    >>> y.chunks[0], np.allclose(y.compute(), ref)
    ((1, 1, 1), True)
    """
    return _map_chunks(
        cufused.conv_transpose3d_avgpool_clamp_softmax_multiply, x,
        dict(weight=weight, scale=scale),
        dict(stride=stride, padding=padding, output_padding=output_padding,
             pool_kernel=pool_kernel, clamp_min=clamp_min, clamp_max=clamp_max,
             conv_bias=conv_bias, groups=groups, precision=resolve_precision(precision)))


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
    negative = per_channel(bn_weight, "bn_weight", channels, xp) < 0
    sign = 1 - 2 * negative.astype(weight.dtype)
    c_in, c_group = weight.shape[:2]
    flipped = (weight.reshape(groups, c_in // groups, c_group, -1)
               * sign.reshape(groups, 1, c_group, 1)).reshape(weight.shape)
    if conv_bias is not None:
        conv_bias = per_channel(conv_bias, "conv_bias", channels, xp) * sign
    return flipped, conv_bias, sign


def _pool_moments_phase(x, prepared, *, stride, padding, output_padding, groups: int,
                        pool: int | None, precision: str):
    """Phase 1 of pipeline B on one chunk: ``(pooled extrema, channel moments)`` of the
    transposed convolution (with its bias, as the single call's statistics include it).

    ``prepared`` = ``_flip_channels``'s (weight, bias, sign). NumPy chunks run in float64, as
    the reference does end to end. ``pool=None`` returns the whole convolution output instead
    of the extrema (for ``_normalize_pooled``'s exact route)."""
    weight, bias, sign = prepared
    if get_array_module(x=x) is numpy:
        x = x.astype(numpy.float64, copy=False)
    y = cufused.conv_transpose2d(x, weight, bias, stride=stride, padding=padding,
                                 output_padding=output_padding, groups=groups,
                                 precision=precision)
    pooled = y if pool is None else cufused.max_pool2d(y, pool)
    count, mean, m2 = _channel_moments(y)
    if sign is not None:
        pooled *= sign.reshape(1, -1, 1, 1)
        mean = mean * sign
    return pooled, (count, mean, m2)


def _normalize_pooled(pooled, mean, var, bn_weight, bn_bias, gn_weight, gn_bias, *,
                      num_groups: int, eps: float, dtype, pool: int | None = None):
    """Phase 3 of pipeline B on one chunk: BatchNorm with the batch statistics and tanh on
    the pooled extrema, then GroupNorm; cast to the input's dtype.

    With ``pool``, ``pooled`` is the whole convolution output, pooled after the tanh: the
    exact route for an infinite BatchNorm weight, whose windows hold +-1 and NaN values that no
    single extremum predicts."""
    y = _normalize(pooled, mean, var, bn_weight, bn_bias, eps=eps, activation="tanh")
    if pool is not None:
        y = cufused.max_pool2d(y, pool)
    return cufused.group_norm(y, num_groups, gn_weight, gn_bias, eps=eps).astype(dtype,
                                                                               copy=False)


def _has_infinity(a) -> bool:
    """Whether the parameter ``a`` (NumPy, CuPy or None) holds an infinite value."""
    if a is None:
        return False
    return bool(numpy.isinf(a.get() if hasattr(a, "get") else numpy.asarray(a)).any())


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
    weight, bn_weight, bn_bias, gn_weight, gn_bias, conv_bias
        Parameters of the chunks' library, as in the single call.
    num_groups, stride, padding, output_padding, groups, pool_kernel, eps, momentum
        As in :func:`cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm`.
    running_mean, running_var : array, optional
        BatchNorm running buffers, updated in place by the statistics task, as in
        :func:`batch_norm`.
    precision : {"ieee", "tf32"}, optional
        ``None`` is the caller's default when the graph is built.
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
    TypeError
        ``x`` is not a dask array of NumPy or CuPy chunks, a parameter is a dask collection,
        or the single call's ``TypeError``.
    ValueError
        ``x`` is chunked along a non-batch axis, a bad ``split_every``, or the single call's
        ``ValueError``.

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
    empty = _empty_batch(x, "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm")
    params = dict(weight=weight, bn_weight=bn_weight, bn_bias=bn_bias, gn_weight=gn_weight,
                  gn_bias=gn_bias, conv_bias=conv_bias, running_mean=running_mean,
                  running_var=running_var)
    _check_params(params)
    precision = resolve_precision(precision)
    conv_options = dict(stride=stride, padding=padding, output_padding=output_padding,
                        groups=groups)
    probe = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        empty, weight, bn_weight, bn_bias, gn_weight, gn_bias, num_groups=num_groups,
        conv_bias=conv_bias, pool_kernel=pool_kernel, eps=eps, running_mean=running_mean,
        running_var=running_var, momentum=momentum, precision=precision, **conv_options)
    conv_shape = cufused.conv_transpose2d(empty, weight, **conv_options).shape
    _check_count(x.shape[0] * conv_shape[2] * conv_shape[3])
    xp = get_array_module(x=empty)
    if xp is numpy:  # the reference's float64 end to end
        weight, conv_bias = (None if a is None else a.astype(numpy.float64)
                             for a in (weight, conv_bias))
    # Prepared once, a constant of the graph (read by every phase-1 task).
    prepared = dask.delayed(_flip_channels(xp, weight, conv_bias, bn_weight, groups,
                                           probe.shape[1]), pure=True, traverse=False)
    phase1 = dask.delayed(_pool_moments_phase, pure=True, nout=2)
    work_dtype = numpy.float64 if xp is numpy else x.dtype
    work_meta = meta_from_array(probe, dtype=work_dtype)
    # An infinite BatchNorm weight pools after the tanh (the whole convolution output crosses
    # to phase 3), as the single call does for such channels.
    exact = _has_infinity(bn_weight)
    phase1_shape = conv_shape[1:] if exact else probe.shape[1:]
    pooled, moments = [], []
    for block, n in zip(x.to_delayed(optimize_graph=False).ravel(), x.chunks[0]):
        ext, part = phase1(block, prepared, pool=None if exact else pool_kernel,
                           precision=precision, **conv_options)
        pooled.append(da.from_delayed(ext, shape=(n,) + phase1_shape, dtype=work_dtype,
                                      meta=work_meta))
        moments.append(part)
    stats = _batch_statistics(moments, running_mean, running_var, momentum, split_every)
    task = functools.partial(_normalize_pooled, num_groups=num_groups, eps=eps, dtype=x.dtype,
                             pool=pool_kernel if exact else None)
    args = (da.concatenate(pooled, axis=0), stats[0], stats[1], bn_weight, bn_bias, gn_weight,
            gn_bias)
    out = da.map_blocks(task, *args, dtype=x.dtype, meta=meta_from_array(probe),
                        chunks=(x.chunks[0], *((s,) for s in probe.shape[1:])),
                        name=_key_name("conv_transpose2d_batchnorm_tanh_maxpool_groupnorm", task,
                                       *args))
    if return_running_stats:
        return (out,) + _running_results(stats, running_mean, running_var, empty)
    return out

