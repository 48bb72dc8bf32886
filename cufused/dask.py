"""Scale out on Dask: every pipeline and building block over a ``dask.array.Array``.

The input is chunked along the batch axis only (every other axis in one chunk), with NumPy
chunks (the float64 reference runs on each) or CuPy chunks (the GPU path runs on each). Every
function checks its arguments and returns a lazy dask array with the result's shape, dtype,
chunks and chunk type (``meta``); nothing is computed until the result is. Parameters
(weights, biases, norm affines) are NumPy or CuPy arrays of the chunks' library that every
chunk reads whole; each is one key of the graph, which Dask neither traverses nor copies per
task.

Most operations are independent per sample and run the single call on each chunk: the
convolutions, GroupNorm, the pools, softmax over non-batch axes, BatchNorm in inference, and
pipelines A and C. BatchNorm in training mode, alone or inside pipeline B, normalizes with the
statistics of the whole batch, in three phases:

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

With CuPy chunks the tasks of a process take turns on each device (one at a time), so that
the threaded scheduler's threads do not interleave their chunks on the device's stream.

Every call builds its graph directly (a dict of tasks over the keys of ``x``'s chunks) under
key names unique to the call: the readable prefix ``cufused-<function>-`` and a random token,
not a hash of the inputs, since hashing would copy every CuPy parameter to the host. Two
equal calls are therefore not deduplicated: computed together, each runs (and in training
each updates the running buffers, as two single calls would).
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy

try:
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.base import is_dask_collection
    from dask.highlevelgraph import HighLevelGraph
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("cufused.dask needs Dask: install cufused[dask] "
                      "(dask[array,distributed]; dask-cuda for GPU clusters)") from exc

import cufused

from ._arrays import Size, get_array_module, import_cupy, is_cupy_array, per_channel
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


def _is_array(value: Any) -> bool:
    """Whether ``value`` is a NumPy or CuPy array (a key of the graph, not a literal)."""
    return isinstance(value, numpy.ndarray) or is_cupy_array(value)


def _call_keywords(func: Callable, keywords: tuple[str, ...], options: dict[str, Any], chunk,
                   *args):
    """``func(chunk, *args, **options)``, the last ``len(keywords)`` of ``args`` passed by
    those keywords: array parameters travel as task arguments (keys of the graph), keyword-only
    ones included."""
    split = len(args) - len(keywords)
    return func(chunk, *args[:split], **options, **dict(zip(keywords, args[split:])))


# One GPU task at a time per device in this process. Dask's threaded scheduler would run
# several chunks' host work interleaved on the device's one stream: that gains no device
# concurrency, holds every chunk's temporaries at once, and hands each call buffers at new
# addresses, so that the convolutions' CUDA graphs (keyed on them) are captured again and
# again instead of replayed.
_DEVICE_LOCKS: dict[int, threading.Lock] = {}
_DEVICE_LOCKS_GUARD = threading.Lock()


def _one_at_a_time(func: Callable, *args, **kwargs):
    """``func(*args, **kwargs)`` holding the current device's lock."""
    device = import_cupy().cuda.runtime.getDevice()
    lock = _DEVICE_LOCKS.get(device)
    if lock is None:
        with _DEVICE_LOCKS_GUARD:
            lock = _DEVICE_LOCKS.setdefault(device, threading.Lock())
    with lock:
        return func(*args, **kwargs)


class _Graph:
    """The task graph of one call over the batch chunks of ``x``: a dict of old-style tasks
    ``(func, arg, ...)`` whose arguments are keys of the graph, nested tasks or literals.

    Every key is named ``cufused-<label>[-<part>]-<token>``, with a random token per call
    (module docstring). Each array parameter is one key, which every task reading it names:
    Dask neither traverses nor copies it per task, and a distributed worker fetches it once.
    """

    def __init__(self, label: str, x: Array):
        self.label = label
        self.token = uuid.uuid4().hex
        self.x = x
        self.name = self.key_name()  # the result's
        self.dsk: dict = {}
        self.gpu = is_cupy_array(x._meta)

    def key_name(self, part: str = "") -> str:
        return f"cufused-{self.label}{'-' if part else ''}{part}-{self.token}"

    def task(self, func: Callable) -> Callable:
        """``func`` as a task of this graph: on CuPy chunks, run one at a time per device."""
        return functools.partial(_one_at_a_time, func) if self.gpu else func

    def input_keys(self) -> list[tuple]:
        """The keys of ``x``'s chunks, in batch order (every other axis is one chunk)."""
        rest = (0,) * (self.x.ndim - 1)
        return [(self.x.name, i) + rest for i in range(len(self.x.chunks[0]))]

    def constant(self, name: str, value: Any) -> Any:
        """A parameter as a task argument: its key for an array, else the value itself."""
        if not _is_array(value):
            return value
        key = self.key_name(name)
        self.dsk[key] = value
        return key

    def array(self, func: Callable, chunk_args: list[tuple], probe) -> Array:
        """The result: ``func(*chunk_args[i])`` on batch chunk ``i``, with the shape beyond the
        batch axis, dtype and chunk type of ``probe`` (the single call on an empty batch)."""
        rest = (0,) * (probe.ndim - 1)
        for i, args in enumerate(chunk_args):
            self.dsk[(self.name, i) + rest] = (self.task(func), *args)
        graph = HighLevelGraph.from_collections(self.name, self.dsk, dependencies=[self.x])
        chunks = (self.x.chunks[0],) + tuple((s,) for s in probe.shape[1:])
        return da.Array(graph, self.name, chunks, meta=probe)


def _map_chunks(func: Callable, x: Array, params: dict[str, Any], options: dict[str, Any],
                empty=None) -> Array:
    """``func(chunk, *params.values(), **options)`` on every batch chunk of ``x``."""
    if empty is None:
        empty = _empty_batch(x, func.__name__)
    _check_params({**params, **options})
    probe = func(empty, *params.values(), **options)  # checks everything, computes nothing
    graph = _Graph(func.__name__, x)
    keyed = {k: v for k, v in options.items() if _is_array(v)}
    task = functools.partial(_call_keywords, func, tuple(keyed),
                             {k: v for k, v in options.items() if k not in keyed})
    args = [graph.constant(k, v) for k, v in (*params.items(), *keyed.items())]
    return graph.array(task, [(key, *args) for key in graph.input_keys()], probe)


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


def _batch_statistics(graph: _Graph, moments: list, running_mean, running_var,
                      momentum: float, split_every: int | None) -> str:
    """Phase 2 in ``graph``: each chunk's partial moments (``moments``, a task each) under a
    key of its own, their tree reduction and the statistics task, whose key is returned; its
    value is ``_finish_statistics``'s.

    The key is fresh per graph built, as every key of ``graph``: each graph updates the
    buffers when it computes, even where two are built from equal inputs.
    """
    split_every = SPLIT_EVERY if split_every is None else split_every
    if isinstance(split_every, bool) or not isinstance(split_every, int) or split_every < 2:
        raise ValueError(f"split_every must be an int >= 2, got {split_every!r}")
    keys = [(graph.key_name("moments"), i) for i in range(len(moments))]
    graph.dsk.update(zip(keys, moments))
    merge, depth = graph.key_name("merge"), 0
    while len(keys) > 1:
        depth += 1
        parts = [keys[i:i + split_every] for i in range(0, len(keys), split_every)]
        keys = [(merge, depth, j) for j in range(len(parts))]
        merge_task = graph.task(_merge_moments)
        graph.dsk.update((key, (merge_task, *part)) for key, part in zip(keys, parts))
    key = graph.key_name("statistics")
    graph.dsk[key] = (graph.task(_finish_statistics), keys[0],
                      graph.constant("running_mean", running_mean),
                      graph.constant("running_var", running_var), momentum)
    return key


def _normalize(chunk, mean, var, weight, bias, *, eps: float, activation: str | None):
    """Phase 3 of BatchNorm: ``batch_norm`` in inference mode with the batch statistics
    (float32 on the GPU, whose path takes no float64)."""
    if get_array_module(x=chunk) is not numpy:
        mean, var = mean.astype(numpy.float32), var.astype(numpy.float32)
    return cufused.batch_norm(chunk, weight, bias, running_mean=mean, running_var=var,
                              training=False, eps=eps, activation=activation)


def _normalized_batch(graph: _Graph, statistics: str, task: Callable, inputs: list,
                      params: dict[str, Any], probe, running_mean, running_var,
                      return_running_stats: bool) -> Array | tuple:
    """Phase 3 in ``graph``: ``task(inputs[i], mean, var, *params.values())`` on chunk ``i``
    with the batch statistics of the task ``statistics``; with ``return_running_stats``, also
    the updated running buffers as dask arrays of one chunk (None where not given)."""
    shared = ((operator.getitem, statistics, 0), (operator.getitem, statistics, 1),
              *(graph.constant(name, value) for name, value in params.items()))
    out = graph.array(task, [(first, *shared) for first in inputs], probe)
    if not return_running_stats:
        return out
    results = [out]
    for index, part, buf in ((2, "running_mean", running_mean), (3, "running_var", running_var)):
        if buf is None:
            results.append(None)
            continue
        name = graph.key_name(f"updated_{part}")
        layer = {(name,) + (0,) * buf.ndim: (operator.getitem, statistics, index)}
        results.append(da.Array(HighLevelGraph.from_collections(name, layer, dependencies=[out]),
                                name, tuple((s,) for s in buf.shape),
                                meta=meta_from_array(probe, buf.ndim, buf.dtype)))
    return tuple(results)


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
    graph = _Graph("batch_norm", x)
    inputs = graph.input_keys()
    moments = graph.task(_channel_moments)
    stats = _batch_statistics(graph, [(moments, key) for key in inputs], running_mean,
                              running_var, momentum, split_every)
    return _normalized_batch(graph, stats, functools.partial(
        _normalize, eps=eps, activation=activation), inputs, dict(weight=weight, bias=bias),
        probe, running_mean, running_var, return_running_stats)


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
    graph = _Graph("conv_transpose2d_batchnorm_tanh_maxpool_groupnorm", x)
    # Prepared once: each array a constant of the graph, read by every phase-1 task.
    prepared = graph.key_name("prepared")
    graph.dsk[prepared] = (tuple, [graph.constant(name, value) for name, value in zip(
        ("weight", "conv_bias", "sign"),
        _flip_channels(xp, weight, conv_bias, bn_weight, groups, probe.shape[1]))])
    # An infinite BatchNorm weight pools after the tanh (the whole convolution output crosses
    # to phase 3), as the single call does for such channels.
    exact = _has_infinity(bn_weight)
    phase1 = functools.partial(_pool_moments_phase, pool=None if exact else pool_kernel,
                               precision=precision, **conv_options)
    name = graph.key_name("phase1")
    keys = [(name, i) for i in range(len(x.chunks[0]))]
    phase1 = graph.task(phase1)
    graph.dsk.update((key, (phase1, chunk, prepared))
                     for key, chunk in zip(keys, graph.input_keys()))
    # The moments reach the reduction alone (a key each, so a distributed worker fetches no
    # pooled data); phase 3 reads the pooled part where phase 1 ran.
    stats = _batch_statistics(graph, [(operator.getitem, key, 1) for key in keys], running_mean,
                              running_var, momentum, split_every)
    return _normalized_batch(
        graph, stats, functools.partial(_normalize_pooled, num_groups=num_groups, eps=eps,
                                        dtype=x.dtype, pool=pool_kernel if exact else None),
        [(operator.getitem, key, 0) for key in keys],
        dict(bn_weight=bn_weight, bn_bias=bn_bias, gn_weight=gn_weight, gn_bias=gn_bias),
        probe, running_mean, running_var, return_running_stats)

