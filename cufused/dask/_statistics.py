"""Training-mode BatchNorm's statistics of the whole batch: phase 1 (per-chunk partial
moments), phase 2 (their tree reduction, whose task updates the running buffers) and phase 3
(the normalization with the batch statistics); package docstring."""

from __future__ import annotations

import functools
import numbers
import operator
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy
from dask.array.utils import meta_from_array

import cufused

from .._arrays import get_array_module
from .._kernels.normalization import key_stats_partial
from .._ops.normalization import batch_norm_of_statistics
from ._graph import Array, _Graph, new_array

#: Partial moments of each node of the tree reduction (the default ``split_every``).
SPLIT_EVERY = 8

# Held while a statistics task updates and copies running buffers: the threaded scheduler runs
# the statistics tasks of graphs computed together at once, and two of them sharing a buffer
# would each read it before the other wrote it (NumPy releases the interpreter lock), losing
# an update.
_RUNNING_BUFFERS_LOCK = threading.Lock()


def _without_numpy_warnings(func: Callable) -> Callable:
    """NaN and inf propagate silently through the statistics, as through the single call's
    reference (``run_reference``)."""
    @functools.wraps(func)
    def quiet(*args, **kwargs):
        with numpy.errstate(all="ignore"):
            return func(*args, **kwargs)
    return quiet


class Moments(NamedTuple):
    """Per-channel partial moments of ``count`` values about a ``shift`` (float64 arrays of the
    values' library): their mean is ``shift + offset`` and ``m2`` the sum of their squared
    deviations from it. The shift is a value of the data (each channel's first, 0 where not
    finite, as the single call's statistics take it), so that a constant channel's moments
    stay exact through every merge and a mean far from 0 keeps the accuracy of its spread."""

    count: int
    shift: Any
    offset: Any
    m2: Any

    def flipped(self, sign) -> Moments:
        """The moments of the values times ``sign`` (+-1 per channel)."""
        return self._replace(shift=self.shift * sign, offset=self.offset * sign)


@_without_numpy_warnings
def _channel_moments(y) -> Moments:
    """Per-channel :class:`Moments` of ``y`` (N, C, ...) over every axis but 1, shifted by each
    channel's first value (0 where not finite), as the single call's statistics are.

    On the GPU one read of ``y`` gives the shifted sums (``key_stats_partial``, as
    ``batch_norm`` uses), summed in float64.
    """
    xp = get_array_module(y=y)
    n, c = y.shape[:2]
    count = y.size // c
    if count == 0:
        zeros = xp.zeros(c, dtype=numpy.float64)
        return Moments(0, zeros, zeros, zeros)
    if xp is numpy:
        axes = (0,) + tuple(range(2, y.ndim))
        y = y.astype(numpy.float64, copy=False)
        first = y[(0, slice(None)) + (0,) * (y.ndim - 2)]
        shift = numpy.where(numpy.isfinite(first), first, 0.0)
        d = y - shift.reshape((c,) + (1,) * (y.ndim - 2))
        offset = d.mean(axis=axes)
        m2 = numpy.square(d - offset.reshape((c,) + (1,) * (y.ndim - 2))).sum(axis=axes)
        return Moments(count, shift, offset, m2)
    y = xp.ascontiguousarray(y)
    hw = count // n
    partial, shift, _ = key_stats_partial(xp, y, c, n_outer=n, outer_stride=c * hw,
                                          key_stride=hw, inner=hw)
    return _shifted_moments(partial.sum(axis=1, dtype=xp.float64), shift, count)


def _shifted_moments(sums, shift, count: int) -> Moments:
    """Per-channel :class:`Moments` from each channel's ``count`` values' sums
    ``(sum d, sum d * d)`` (``sums``, (C, 2) float64 CuPy) with ``d = value - shift``."""
    xp = get_array_module(sums=sums)
    offset = sums[:, 0] / count
    m2 = sums[:, 1] - sums[:, 0] * offset
    # Rounding can push M2 below 0: clamp it, keeping a NaN (NaN < 0 is false).
    return Moments(count, shift.astype(xp.float64), offset, xp.where(m2 < 0, 0.0, m2))


@_without_numpy_warnings
def _merge_moments(*parts: Moments) -> Moments:
    """The parallel combination of partial :class:`Moments` (Chan et al.'s, over all parts at
    once) about the first counted part's shift, which is the batch's first value as in the
    single call: each part's mean moves to ``(shift_i - shift) + offset_i``, exactly 0 for a
    constant channel; the offset is their count-weighted mean, which keeps an infinite part's
    infinity as the single call does (NaN where parts hold opposite ones), and M2 adds to the
    parts' own each part's squared distance from it."""
    counted = [part for part in parts if part.count > 0]
    if len(counted) < 2:
        return counted[0] if counted else parts[0]
    total = sum(part.count for part in counted)
    shift = counted[0].shift
    moved = [(part.shift - shift) + part.offset for part in counted]
    offset = sum(m * part.count for m, part in zip(moved, counted)) / total
    m2 = sum(part.m2 + (m - offset) ** 2 * part.count for m, part in zip(moved, counted))
    return Moments(total, shift, offset, m2)


@_without_numpy_warnings
def _finish_statistics(moments: Moments, running_mean, running_var,
                       momentum: float) -> tuple[Any, Any, Any, Any]:
    """Batch ``(mean, biased variance)`` from the merged moments; the running buffers, when
    given, are updated in place as PyTorch does (unbiased variance) and returned as copies.

    On the GPU (float32 data) a sum of squared deviations from the shift past float32's range
    gives an infinite variance, as the single call's statistics (and PyTorch's float32 sums)
    give it. An empty batch leaves the buffers alone, as the single call does."""
    count, shift, offset, m2 = moments
    mean = shift + offset
    var = m2 / count if count else m2
    xp = get_array_module(shift=shift)
    if xp is not numpy:
        shifted_squares = m2 + offset * offset * count
        var = xp.where(shifted_squares > float(numpy.finfo(numpy.float32).max), numpy.inf, var)
    with _RUNNING_BUFFERS_LOCK:
        if count:
            unbiased = var * (count / (count - 1))  # count >= 2: checked with the graph
            for buf, batch in ((running_mean, mean), (running_var, unbiased)):
                if buf is not None:
                    buf[...] = ((1.0 - momentum) * buf.astype(numpy.float64)
                                + momentum * batch.reshape(buf.shape)).astype(buf.dtype)
        return mean, var, _copy(running_mean), _copy(running_var)


def _copy(buf):
    return None if buf is None else buf.copy()


def check_split_every(split_every: int | None) -> int:
    """The tree reduction's ``split_every`` checked (an int >= 2; None: ``SPLIT_EVERY``)."""
    split_every = SPLIT_EVERY if split_every is None else split_every
    if isinstance(split_every, bool) or not isinstance(split_every, numbers.Integral):
        raise TypeError(f"split_every must be an int, got {split_every!r}")
    if split_every < 2:
        raise ValueError(f"split_every must be an int >= 2, got {split_every!r}")
    return int(split_every)


def _batch_statistics(graph: _Graph, moments: list, running_mean, running_var,
                      momentum: float, split_every: int | None) -> str:
    """Phase 2 in ``graph``: each chunk's partial moments (``moments``, a task each) under a
    key of its own, their tree reduction and the statistics task, whose key is returned; its
    value is ``_finish_statistics``'s.

    The key is fresh per graph built, as every key of ``graph``: each graph updates the
    buffers when it computes, even where two are built from equal inputs.
    """
    momentum = float(momentum)  # checked by the caller's probe; the single call's float
    split_every = check_split_every(split_every)
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


def _normalize(chunk, mean, var, weight, bias, *, eps: float, activation: str | None,
               centered_only: bool = False):
    """Phase 3 of BatchNorm: ``batch_norm`` in inference mode with the batch statistics; on
    the GPU centered on their float64 mean, as the single call is, and with the single
    call's form for non-finite coefficients (``centered_only``: the whole batch's
    ``torch_cuda_native_form``)."""
    if get_array_module(x=chunk) is not numpy:
        return batch_norm_of_statistics(chunk, weight, bias, mean, var, eps=eps,
                                        activation=activation, centered_only=centered_only)
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
        results.append(new_array(name, layer, out, tuple((s,) for s in buf.shape),
                                 meta_from_array(probe, buf.ndim, buf.dtype)))
    return tuple(results)

