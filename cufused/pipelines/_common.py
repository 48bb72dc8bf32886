"""What the three pipelines share: the method and pool-window options, the choice of their GPU
half and the end of their docstrings."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy

from .._arrays import check_choice, check_scalar, insert_sections, ntuple
from .._call_graphs import replayed
from .._cuda import MAX_GRID_X
from .._ops.convolution import fastest, settled_engine
from .._ops.pooling import check_pool_args

METHODS = ("fused", "unfused")

# The numpydoc entries and sections every pipeline's docstring has after its own parameters.
_SHARED_DOC = """\
    precision : {{"ieee", "tf32", "3xtf32"}}, optional
        Convolution precision; ``None`` uses the default.
    method : {{"fused", "unfused"}}
        ``"unfused"`` runs separate building blocks (GPU baseline); ignored for NumPy input.
    out : array, optional
        Destination of the result's shape and dtype.

    Returns
    -------
    array
        Shape {shape}, same library and dtype as ``x``.

    Raises
    ------
    TypeError
        An argument of the wrong type (a required array given as ``None``, a non-int size),
        mixed array libraries or an unsupported dtype.
    ValueError
        Inconsistent shapes or options, an ``out`` of the wrong shape or dtype or sharing
        memory with an input, or CuPy arrays on different devices.

"""


def shared_doc_sections(shape: str):
    """Decorator: insert the shared ``precision`` / ``method`` / ``out`` entries and the
    Returns (an array of ``shape``) and Raises sections before the docstring's Examples."""
    return lambda fn: insert_sections(fn, _SHARED_DOC.format(shape=shape))


def clamp_bounds(clamp_min, clamp_max) -> tuple[float, float]:
    """The clamp's bounds as floats: real numbers, infinities included, and None for no
    bound (the infinity on its side), as ``torch.clamp`` takes them; NaN, which
    ``torch.clamp`` spreads to every value, is refused."""
    return (-math.inf if clamp_min is None else
            check_scalar(clamp_min, "clamp_min", finite=False, nan=False),
            math.inf if clamp_max is None else
            check_scalar(clamp_max, "clamp_max", finite=False, nan=False))


def check_method(method: str) -> None:
    """``method`` must be one of :data:`METHODS` ("fused" or "unfused"): ``ValueError``
    naming it otherwise."""
    check_choice(method, "method", METHODS)


# The most values of a sample that the fused pass takes: its in-plane positions are 32-bit
# ints, which its loops step past the plane's end by up to a step of 256 positions and its
# split ranges (up to 2048 a plane) round up, so a margin below 2**31 keeps them from wrapping.
FUSED_SAMPLE_VALUES = 2**31 - 2**16


def gpu_method(method: str, conv_out_shape: tuple[int, ...], *, groups: int = 1) -> str:
    """The GPU method that runs: the fused pass indexes within a sample with 32-bit offsets
    (:data:`FUSED_SAMPLE_VALUES`), and launches a block per (sample, group) where ``groups``
    is given, so a larger sample of the convolution output, or more (sample, group) rows than
    a grid holds, takes the unfused building blocks, which index with 64 bits and launch over
    slices of the batch."""
    if method == "fused" and (math.prod(conv_out_shape[1:]) > FUSED_SAMPLE_VALUES
                              or conv_out_shape[0] * groups > MAX_GRID_X):
        return "unfused"
    return method


def gpu_path(method: str, fused, unfused, xp, x, weight, args, precision, **options):
    """A pipeline's GPU half as :func:`~cufused._arrays.forward` calls it, with ``out``:
    ``fused`` or, for ``method="unfused"``, ``unfused``, the checked arguments bound; warm
    calls replay a CUDA graph of the whole call (:mod:`cufused._call_graphs`)."""
    run = unfused if method == "unfused" else fused
    return replayed(partial(run, xp, x, weight, args, precision, **options))


def ones_if_none(value, channels: int, xp):
    """``value``, or one for every channel (``scale=None`` means no scaling)."""
    return xp.ones(channels, dtype=xp.float64 if xp is numpy else xp.float32) if (
        value is None) else value


def check_pipeline_pool(pool_kernel, size: tuple[int, ...], *, name: str = "x",
                        unpadded_window: bool = False) -> tuple[int, tuple[int, ...]]:
    """The pipelines pool ``name`` (spatial ``size``) with square / cubic windows, stride =
    kernel, no padding; returns the window's side and the pooled spatial size."""
    nd = len(size)
    k = ntuple(pool_kernel, nd, "pool_kernel", minimum=1)
    if len(set(k)) != 1:
        raise ValueError(f"pool_kernel must be the same along every axis, got {pool_kernel!r}")
    _, _, _, pooled = check_pool_args(size, nd, k[0], k[0], 0, name=name,
                                      unpadded_window=unpadded_window,
                                      kernel_name="pool_kernel")
    return k[0], pooled


def runs_on_igemm(xp, key: tuple, x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                  out_shape: tuple[int, ...], path_of: Callable[..., Callable[[bool], Any]]
                  ) -> bool:
    """Whether the pipeline problem ``key`` runs on cufused's implicit GEMM: the engine that
    the settings force, else the faster (measured once per device and key,
    :func:`~cufused._ops.convolution.settled_engine`) of ``path(True)`` (its fused path on
    the implicit GEMM) and ``path(False)`` (on the convolution that the autotuner picks for
    it alone), ``path = path_of(x, weight, out)`` on random float32 operands of these
    shapes."""

    def measure() -> str:
        rng = xp.random.default_rng(0)
        x = rng.random(x_shape, dtype=xp.float32)
        weight = rng.standard_normal(w_shape, dtype=xp.float32)
        path = path_of(x, weight, xp.empty(out_shape, dtype=xp.float32))
        return fastest({"cudnn": partial(path, False), "igemm": partial(path, True)})

    return settled_engine(key, measure) == "igemm"
