"""The building blocks over a dask batch (the convolutions, GroupNorm, BatchNorm, the pools,
softmax) and the docstring sections and templates they share with the pipelines."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import cufused

from .._arrays import Size, check_bool
from .._ops.normalization import torch_cuda_native_form
from .._ops.softmax import normalize_axes
from ._graph import (Array, _check_params, _each_chunk, _empty_batch, _Graph, _map_chunks,
                     _probing)
from ._statistics import (_batch_statistics, _channel_moments, _normalize, check_split_every,
                          _normalized_batch)

_TYPE_ERROR = """    TypeError
        ``x`` is not a dask array of NumPy or CuPy chunks, a parameter is a dask collection,
        or the single call's ``TypeError``."""

_RETURNS = f"""
    Returns
    -------
    dask.array.Array
        Lazy; chunked like ``x`` along the batch axis, every other axis in one chunk; the
        chunks' library (NumPy or CuPy) and dtype of the single call.

    Raises
    ------
{_TYPE_ERROR}
    ValueError
        ``x`` is chunked along a non-batch axis, or the single call's ``ValueError``.
"""

# The docstring lines that the functions over a dask batch share, by placeholder line.
_SECTIONS = {
    "    {returns}\n": _RETURNS + "\n",
    "    {type_error}\n": _TYPE_ERROR + "\n",
    "    {precision}\n": """    precision : {"ieee", "tf32", "3xtf32"}, optional
        ``None`` is the caller's default when the graph is built.
""",
    "    {examples}\n": """    Examples
    --------
    >>> import numpy as np, dask.array as da, cufused, cufused.dask
""",
}


def _with_sections(doc: str) -> str:
    """``doc`` with the shared docstring lines (``_SECTIONS``) in place of their placeholders."""
    for placeholder, text in _SECTIONS.items():
        doc = doc.replace(placeholder, text)
    return doc


def _shared_sections(func: Callable) -> Callable:
    """Put the shared docstring lines (``_SECTIONS``) into ``func``'s docstring."""
    func.__doc__ = _with_sections(func.__doc__)
    return func

_X = """x : dask.array.Array
        Input chunked along the batch axis only, of NumPy or CuPy chunks."""

_CONV_DOC = """{title}, each batch chunk running :func:`cufused.{name}`.

    Parameters
    ----------
    {x}
    weight, bias : array
        NumPy or CuPy arrays of the chunks' library (``bias`` may be None).
    stride, padding, {extra}dilation : int or tuple of int
        As in :func:`cufused.{name}`.
    groups : int
        As in :func:`cufused.{name}`.
    precision : {{"ieee", "tf32", "3xtf32"}}, optional
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


conv2d = _each_chunk(cufused.conv2d, ndim=4)
conv3d = _each_chunk(cufused.conv3d, ndim=5)
conv_transpose2d = _each_chunk(cufused.conv_transpose2d, ndim=4)
conv_transpose3d = _each_chunk(cufused.conv_transpose3d, ndim=5)

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


@_shared_sections
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
        threaded or synchronous scheduler or in-process distributed workers, on another
        process's copy where the task runs in another process (see
        ``return_running_stats``). In inference both are required and read.
    training : bool
        Normalize with the batch statistics (biased variance) instead of the running ones.
    momentum : float
        Weight of the batch statistics in the running update; finite (past [0, 1] it
        extrapolates, as in PyTorch).
    eps : float
        Added to the variance; > 0 in training, >= 0 in inference.
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
    {type_error}
        Also a ``split_every`` that is not an int.
    ValueError
        ``x`` is chunked along a non-batch axis, ``return_running_stats`` in inference,
        ``split_every`` below 2, or the single call's ``ValueError``.

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
    return_running_stats = check_bool(return_running_stats, "return_running_stats")
    check_split_every(split_every)  # in inference too, where no reduction reads it
    if not check_bool(training, "training"):
        if return_running_stats:
            raise ValueError("return_running_stats applies in training only: inference leaves "
                             "the running buffers unchanged")
        return _map_chunks(cufused.batch_norm, x, dict(weight=weight, bias=bias), dict(
            running_mean=running_mean, running_var=running_var, training=False,
            momentum=momentum, eps=eps, activation=activation))
    empty = _empty_batch(x, "batch_norm", params)
    _check_params(params)
    with _probing(x):
        probe = cufused.batch_norm(empty, weight, bias, running_mean=running_mean,
                                   running_var=running_var, momentum=momentum, eps=eps,
                                   activation=activation)
    graph = _Graph("batch_norm", x)
    inputs = graph.input_keys()
    moments = graph.task(_channel_moments)
    stats = _batch_statistics(graph, [(moments, key) for key in inputs], running_mean,
                              running_var, momentum, split_every)
    centered_only = torch_cuda_native_form(x.shape, weight, bias, True)
    return _normalized_batch(graph, stats, functools.partial(
        _normalize, eps=eps, activation=activation, centered_only=centered_only), inputs,
        dict(weight=weight, bias=bias), probe, running_mean, running_var, return_running_stats)


_POOL_DOC = """{title}, each batch chunk running :func:`cufused.{name}`.

    Parameters
    ----------
    {x}
    kernel_size, stride, padding : int or tuple of int
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


def _chunked_pool(name: str, title: str, xshape: str, yshape: str) -> Callable:
    """The pool ``cufused.<name>`` over a dask batch, with its docstring."""
    def pool(x: Array, kernel_size: Size, stride: Size | None = None,
             padding: Size = 0) -> Array:
        return _map_chunks(getattr(cufused, name), x, {},
                           dict(kernel_size=kernel_size, stride=stride, padding=padding),
                           ndim=int(name[-2]) + 2)

    pool.__name__ = pool.__qualname__ = name
    pool.__doc__ = _POOL_DOC.format(title=title, name=name, x=_X, returns=_RETURNS,
                                    xshape=xshape, yshape=yshape)
    return pool


max_pool2d = _chunked_pool("max_pool2d", "2-D max pooling", "(3, 2, 4, 6)", "(3, 2, 2, 3)")
max_pool3d = _chunked_pool("max_pool3d", "3-D max pooling", "(3, 2, 4, 4, 2)", "(3, 2, 2, 2, 1)")
avg_pool2d = _chunked_pool("avg_pool2d", "2-D average pooling", "(3, 2, 4, 6)", "(3, 2, 2, 3)")
avg_pool3d = _chunked_pool("avg_pool3d", "3-D average pooling", "(3, 2, 4, 4, 2)",
                           "(3, 2, 2, 2, 1)")


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

