"""Convolutions: ``conv2d``, ``conv3d``, ``conv_transpose2d``, ``conv_transpose3d``.

NumPy arrays run the float64 reference (:mod:`cufused.reference`); CuPy float32 arrays run
cuDNN through :mod:`cufused._cudnn`, or at a tensor-core precision cufused's implicit GEMM
(:mod:`cufused._kernels.conv_gemm`) where the autotuner measured it faster; pipeline B's
convolution also has the DFT engine (:mod:`cufused._kernels.fft_conv`). Layouts, weight
shapes and output-size formulas are PyTorch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy

from .. import reference
from .._arrays import (Size, check_float_dtype, check_ndim, check_out, check_per_channel,
                       check_required, check_sizes, forward, get_array_module, one_sample,
                       per_channel)
from .._call_graphs import replayed, warm_calls
from .._cuda import capturing
from .._cudnn import on_clear_plan_cache
from .._layout import stored_in
from .._precision import mma_passes, resolve_precision
from ._conv_args import ConvArgs, cached_conv_args, check_conv_memory, extended_input

__all__ = ["conv2d", "conv3d", "conv_transpose2d", "conv_transpose3d"]

_LAYOUT_NAMES = {2: "NCHW", 3: "NCDHW"}


def conv_on_gpu(x, weight, args: ConvArgs, precision: str, *, convert_output: bool = True,
                out=None, bias=None, batch_statistics: bool = False,
                definition_nans: bool = False, definition_inputs: bool = False):
    """Run the convolution of checked CuPy arrays on cuDNN (the plan converts ``x`` to its
    input layout where it needs to) or on an engine of cufused's (:func:`own_engine`).

    Returns ``(y, layout)``: with ``convert_output`` the result is NCHW/NCDHW (written to
    ``out`` if given: contiguous, or packed channels-last) plus ``bias``; without it ``y`` is
    in the plan's output layout ("nchw", or a channels-last view for "nhwc") for a fused
    kernel to read, and ``bias`` must be None.
    ``batch_statistics``: the caller normalizes each output channel by its batch statistics
    (pipeline B), which admits the DFT engine, whose error is relative to a plane's norm
    rather than to each output. ``definition_nans``: an output channel whose weight holds a
    non-finite value gets the definition's values: a forward convolution's taps multiply the
    input or a padding zero (0 * inf is NaN), a transposed one's only real inputs. cufused's
    implicit GEMM computes forward convolutions and ``conv_transpose3d_s2k3``'s so; after the
    other routes (cuDNN's plans, which may skip the padding or spread the value, the DFT
    engine, a transposed convolution run as a forward one) :func:`_nonfinite_weight_rows`
    rewrites such channels. ``definition_inputs``: after a cuDNN plan that spreads a
    non-finite input over its sample's outputs (FFT, Winograd), the outputs of a sample that
    holds one get the definition's values (:func:`_nonfinite_input_samples`); the other
    engines compute them so.
    A caller that puts the input in the plan's layout itself, or reads class blocks, uses
    :func:`gpu_conv_plan`.
    """
    from .._cudnn import UnsupportedConvolution

    engine = own_engine(x, weight, args, precision, bias=bias, out=out,
                        batch_statistics=batch_statistics)
    if engine is not None:
        if engine[0] == "fft":
            # Inside a capture of the caller's the call runs on cuDNN (own_engine), whose plan
            # cannot be built there: it is built (or found) here. Where cuDNN has none, a
            # capture's call takes the forward route (_transposed_as_forward) and fails as any
            # plan built during a capture does.
            try:
                _plan(x.shape, weight.shape, args, precision, bias is not None, True,
                      convert_output, False)
            except UnsupportedConvolution:
                pass
        y = out if out is not None else _empty_nchw(args.out_shape)
        engine[1](x, weight, bias, y)
        # The DFT engine, the implicit GEMM's forward convolutions and conv_transpose3d_s2k3
        # (3-D) take a non-finite weight as the definition does; a stride-1 transposed 2-D
        # one runs as a forward one, whose padding meets the weight.
        if definition_nans and engine[0] == "igemm" and args.transposed and x.ndim == 4:
            _nonfinite_weight_rows(x, weight, bias, y, args)
        return y, _layout_of(y)
    try:
        plan = _plan(x.shape, weight.shape, args, precision, bias is not None, True,
                     convert_output, False)
    except UnsupportedConvolution:
        if not args.transposed:
            y = _forward_by_definition(x, weight, bias, args, out)
            return y, _layout_of(y)
        y = _transposed_as_forward(x, weight, args, precision, bias=bias, out=out,
                                   definition_inputs=definition_inputs)
        if definition_nans:
            _nonfinite_weight_rows(x, weight, bias, y, args)
        return y, _layout_of(y)
    y, layout = _apply_plan(plan, x, weight, bias, out, convert_output=convert_output)
    if definition_nans:
        _nonfinite_weight_rows(x, weight, bias, y, args)
    if definition_inputs and plan.spreads_nonfinite:
        _nonfinite_input_samples(x, weight, bias, y, args)
    return y, layout


def _nonfinite_weight_rows(x, weight, bias, y, args: ConvArgs) -> None:
    """The output channels of ``y`` (any strides) whose weight holds a non-finite value,
    rewritten by the definition of the convolution ``args``
    (:func:`~cufused._kernels.conv_gemm.conv_nonfinite_weight_rows`)."""
    from .._kernels.conv_gemm import conv_nonfinite_weight_rows

    conv_nonfinite_weight_rows(x, weight, bias, y, groups=args.groups, stride=args.stride,
                               padding=args.padding, dilation=args.dilation,
                               transposed=args.transposed)


def _forward_by_definition(x, weight, bias, args: ConvArgs, out):
    """A forward convolution that no cuDNN plan computes, every output summed by its
    definition in float32 (:func:`~cufused._kernels.conv_gemm.conv_nonfinite_input_samples`
    with every sample marked): slow, exact to float32, and the definition's NaN and
    infinities; into ``out`` (any strides) or a new NC(D)HW array."""
    import cupy

    from .._kernels.conv_gemm import conv_nonfinite_input_samples

    y = out if out is not None else _empty_nchw(args.out_shape)
    conv_nonfinite_input_samples(x, weight, bias, y, cupy.ones(x.shape[0], dtype=cupy.uint32),
                                 transposed=False, groups=args.groups, stride=args.stride,
                                 padding=args.padding, dilation=args.dilation)
    return y


def _nonfinite_input_samples(x, weight, bias, y, args: ConvArgs) -> None:
    """Every output of ``y`` (any strides) of a sample where ``x`` holds a non-finite value,
    rewritten by the definition of the convolution ``args`` after a plan that spreads such a
    value over its sample (:func:`~cufused._kernels.conv_gemm.conv_nonfinite_input_samples`);
    a scan of x flags the samples on the device."""
    import cupy

    from .._kernels.conv_gemm import conv_nonfinite_input_flags, conv_nonfinite_input_samples

    conv_nonfinite_input_samples(x, weight, bias, y, conv_nonfinite_input_flags(cupy, x),
                                 transposed=args.transposed, groups=args.groups,
                                 stride=args.stride, padding=args.padding,
                                 dilation=args.dilation)


def _apply_plan(plan, x, weight, bias, out, *, convert_output: bool = True):
    """``plan.apply``; a packed channels-last ``out`` (which the plans' results are not
    written into) gets the NCHW result copied in."""
    if out is None or out.flags.c_contiguous:
        return plan.apply(x, weight, bias=bias, out=out, convert_output=convert_output)
    y, _ = plan.apply(x, weight, bias=bias)
    out[...] = y
    return out, _layout_of(out)


def _layout_of(y) -> str:
    """The layout of a result in NCHW or packed channels-last memory (``out``'s, where the
    caller gave one)."""
    return "nchw" if y.flags.c_contiguous else "nhwc"


def own_engine(x, weight, args: ConvArgs, precision: str, *, bias=None, out=None,
               batch_statistics: bool = False) -> tuple[str, Callable[..., None]] | None:
    """``(name, run)`` of the engine of cufused's on which :func:`conv_on_gpu` runs the
    convolution, ``run(x, weight, bias, y)``: among those whose route takes the problem
    (:func:`_igemm_route`, and with ``batch_statistics`` :func:`_fft_route`), the one that
    :func:`_settled_conv_engine` chose; None where it chose cuDNN, where none takes the
    problem, and for the DFT engine inside the caller's capture (:func:`_caller_capturing`).
    """
    routes = {"igemm": _igemm_route(x, weight, args, precision, bias, out)}
    if batch_statistics:
        routes["fft"] = _fft_route(x, weight, args, precision, bias, out)
    routes = {name: run for name, run in routes.items() if run is not None}
    if not routes:
        return None
    name = _settled_conv_engine(x, weight.shape, args, bias is not None, precision, routes,
                                out)
    if name not in routes or (name == "fft" and _caller_capturing()):
        return None
    return name, routes[name]


# The engine of each problem that an engine of cufused's takes, by (device, the problem's key):
# "igemm" (the implicit GEMM, conv_gemm.cu), "fft" (the DFT convolution, fft_conv.cu) or
# "cudnn", whichever the autotuner measured fastest ("3xtf32" against cuDNN's exact float32,
# which is at least as accurate). A convolution's key is its shapes, arguments, bias,
# precision and the engines that take it; a pipeline's convolution with a pass in its epilogue
# has a key of its own (settled_engine). Cleared with the plans, whose timings chose them.
_ENGINES: dict[tuple, str] = {}
on_clear_plan_cache(_ENGINES.clear)


def settled_engine(key: tuple, measure: Callable[[], str]) -> str:
    """The engine of the problem ``key``: the one the settings force (``plan_options(engine=
    ...)``), cuDNN without autotuning or with cuDNN strategies pinned, else ``measure()``'s
    choice, measured once per device and key (cuDNN where the measurement's operands do not
    fit in the device's memory)."""
    from .._settings import _config

    if _config["engine"] is not None:
        return _config["engine"]
    if not _config["autotune"] or _config["pins"] is not None:
        return "cudnn"
    import cupy

    key = (cupy.cuda.runtime.getDevice(), *key)
    engine = _ENGINES.get(key)
    if engine is None:
        if capturing(cupy.cuda.get_current_stream()):
            # Measuring synchronizes on events, which a capture refuses.
            raise RuntimeError("the convolution engine cannot be measured while the stream "
                               "is being captured into a CUDA graph: make the same call once "
                               "before capturing")
        try:
            engine = measure()
        except cupy.cuda.memory.OutOfMemoryError:
            engine = "cudnn"
        _ENGINES[key] = engine
    return engine


def fastest(candidates: dict[str, Callable[[], Any]]) -> str:
    """The name of the fastest of ``candidates`` (calls of the device's work, each timed after
    a warm-up, median of CUDA events, the L2 flushed between samples; a tie goes to the
    first)."""
    from .._timing import l2_flush_buffer, time_ms

    flush = l2_flush_buffer()
    times = {name: time_ms(fn, flush=flush) for name, fn in candidates.items()}
    return min(times, key=times.get)


def _igemm_route(x, weight, args: ConvArgs, precision: str, bias,
                 out) -> Callable[..., None] | None:
    """How cufused's implicit GEMM computes the convolution ``args`` of ``x`` and ``weight``:
    ``run(x, weight, bias, y)`` writes it, plus ``bias``, into ``y`` (``out``'s layout:
    contiguous NCHW / NCDHW where ``out`` is None); None where the engine does not take the
    problem ("ieee", which runs on cuDNN or the DFT engine, included).

    The implicit GEMM computes 2-D convolutions of one group on dense NCHW operands (any
    sizes, strides, padding, dilation; a packed channels-last input through an NCHW copy,
    :func:`_nchw_copy`) into NCHW or, where its halo kernel takes the problem
    (:func:`~cufused._kernels.conv_gemm.takes_channels_last`), packed channels-last outputs,
    a stride-1 transposed one as the forward convolution
    of the flipped weight (:func:`_stride1_forward_args`), and the transposed 3-D
    convolutions that ``conv_transpose3d_s2k3`` takes (pipeline C's: stride 2, a 3 x 3 x 3
    kernel, padding 1; :func:`~cufused._kernels.conv_gemm.transposed_s2k3_takes`) from a
    packed channels-last input (NDHWC memory) as it is, and from a dense NCDHW one as it is
    (:func:`~cufused._kernels.conv_gemm.transposed_s2k3_reads_ncdhw`) or through a
    channels-last copy, into a contiguous output; into a packed channels-last one in 3xTF32
    where ``conv_transpose3d_s2k3_groups`` takes the problem
    (:func:`~cufused._kernels.conv_gemm.transposed_s2k3_groups_take`), else through a
    contiguous result transposed into it."""
    from .._kernels.conv_gemm import (channel_tiles_fit, takes_channels_last,
                                      transposed_s2k3_groups_take, transposed_s2k3_takes)

    if (precision == "ieee" or (bias is not None and not bias.flags.c_contiguous)
            or x.shape[0] >= 2**31):  # the launchers' 32-bit sample counts
        return None
    passes = mma_passes(precision)
    channels_last = out is not None and not out.flags.c_contiguous
    if x.ndim == 4:
        forward_args = (_stride1_forward_args(args, weight.shape[2:]) if args.transposed
                        else args)
        if (not (x.flags.c_contiguous or stored_in(x, "nhwc")) or forward_args is None
                or forward_args.groups != 1
                or (channels_last and not takes_channels_last(
                    x.shape[1], weight.shape[2:], forward_args.stride, forward_args.dilation,
                    passes))
                or not (args.transposed or weight.flags.c_contiguous)
                or not channel_tiles_fit(args.out_shape[1])
                # the int32 reduction (and its tile's end)
                or x.shape[1] * math.prod(weight.shape[2:]) >= 2**31 - 64
                or any(d * (k - 1) + p >= 2**31 for d, k, p in zip(  # the kernel's int32 rows
                    forward_args.dilation, weight.shape[2:], forward_args.padding))):
            return None
        return partial(_igemm_2d, args=forward_args, flip=args.transposed, passes=passes)
    if not ((x.flags.c_contiguous or stored_in(x, "nhwc")) and args.transposed
            and transposed_s2k3_takes(x.shape[1], weight.shape[2:], args.stride, args.padding,
                                      args.output_padding, args.dilation, args.groups,
                                      args.out_shape)):
        return None
    if not channels_last:
        return partial(_igemm_transposed_3d, passes=passes)
    if transposed_s2k3_groups_take(x.shape[1], out, passes):
        return _igemm_transposed_3d_groups
    return partial(_igemm_transposed_3d_copied, passes=passes) if stored_in(out, "nhwc") else None


def _caller_capturing() -> bool:
    """Whether the caller is capturing the current stream into a CUDA graph, where the call
    runs on cuDNN instead of the DFT engine: cufused moves its cuBLAS handle onto a stream
    only before a capture of its own begins (``_call_graphs``, ``prepare``; :mod:`cufused._blas`),
    which also keeps cuBLAS's memory nodes out of the caller's graph."""
    import cupy

    from .._capture import in_own_capture

    return capturing(cupy.cuda.get_current_stream()) and not in_own_capture()


def _fft_route(x, weight, args: ConvArgs, precision: str, bias,
               out) -> Callable[..., None] | None:
    """How the DFT engine computes the convolution ``args`` of ``x`` and ``weight``:
    ``run(x, weight, bias, y)`` writes it into a contiguous NCHW ``y``; None where the engine
    does not take the problem. It takes float32 precisions ("ieee": its products per
    frequency in float32; "3xtf32": as three TF32 products) of contiguous operands without
    bias, and the transposed convolutions that
    :func:`~cufused._kernels.fft_conv.fft_conv_takes`."""
    from .._kernels.fft_conv import fft_conv_takes

    if (precision == "tf32" or bias is not None or not args.transposed
            or not x.flags.c_contiguous or (out is not None and not out.flags.c_contiguous)
            or not fft_conv_takes(x.shape, weight.shape, stride=args.stride,
                                  padding=args.padding, output_padding=args.output_padding,
                                  dilation=args.dilation, groups=args.groups)):
        return None
    return partial(_fft_transposed_2d, padding=args.padding, passes=mma_passes(precision))


def _fft_transposed_2d(x, weight, bias, y, *, padding: tuple[int, int], passes: int) -> None:
    """The DFT engine's transposed convolution (``bias`` is None: :func:`_fft_route`)."""
    import cupy

    from .._kernels.fft_conv import conv_transpose2d_fft

    conv_transpose2d_fft(x, cupy.ascontiguousarray(weight), y, padding=padding, passes=passes)


def _settled_conv_engine(x, w_shape, args: ConvArgs, bias: bool, precision: str,
                         routes: dict[str, Callable[..., None]], out=None) -> str:
    """The engine of a problem that the engines ``routes`` (name: ``run``) compute from ``x``
    into ``out`` (settled_engine), keyed and timed with the layouts that ``x`` and ``out``
    are stored in: packed NC(D)HW, else packed channels-last (the only other layout the
    routes take; no ``out``: NC(D)HW)."""
    x_layout = "nchw" if x.flags.c_contiguous else "nhwc"
    y_layout = "nchw" if out is None or out.flags.c_contiguous else "nhwc"
    return settled_engine(
        (tuple(x.shape), x_layout, y_layout, tuple(w_shape), args, bias, precision,
         tuple(routes)),
        lambda: _fastest_engine(x.shape, x_layout, y_layout, w_shape, args, bias, precision,
                                routes))


def _fastest_engine(x_shape, x_layout: str, y_layout: str, w_shape, args: ConvArgs,
                    bias: bool, precision: str, routes: dict[str, Callable[..., None]]) -> str:
    """Time the engines' ``routes`` and the cuDNN plan that ``precision`` runs on cuDNN
    (TF32, or exact float32 for "ieee" and 3xTF32) on random operands, the input in
    ``x_layout`` and the output in ``y_layout`` (cuDNN's through :func:`_apply_plan`), L2
    flushed; the fastest of the routes where cuDNN has no plan."""
    from .._cudnn import UnsupportedConvolution
    from .._layout import empty_in_layout
    from .._timing import random_operand

    x, w = random_operand(x_shape, x_layout), random_operand(w_shape)
    b = random_operand((args.out_shape[1],)) if bias else None
    y = empty_in_layout(args.out_shape, y_layout)
    candidates = {name: partial(run, x, w, b, y) for name, run in routes.items()}
    try:
        plan = _plan(x_shape, w_shape, args, precision, bias, True, True, False)
    except UnsupportedConvolution:
        plan = None
    if plan is None and len(candidates) == 1:
        return next(iter(candidates))
    if plan is not None:
        candidates = {"cudnn": lambda: _apply_plan(plan, x, w, b, y), **candidates}
    return fastest(candidates)


def _stride1_forward_args(args: ConvArgs, kernel_size: tuple[int, ...]) -> ConvArgs | None:
    """The forward convolution that a stride-1 transposed one (one group, no output padding)
    equals with :func:`_flipped` weights: padded by ``dilation * (k - 1) - padding``; None for
    any other transposed convolution."""
    pad = tuple(d * (k - 1) - p for d, k, p in zip(args.dilation, kernel_size, args.padding))
    if (any(s != 1 for s in args.stride) or args.groups != 1 or any(args.output_padding)
            or min(pad) < 0):
        return None
    return ConvArgs(False, args.stride, pad, (0,) * len(pad), args.dilation, 1, args.out_shape)


def _flipped(weight):
    """A transposed convolution's weight as its forward convolution's: flipped spatially,
    in and out channels swapped (dense)."""
    import cupy

    nd = weight.ndim - 2
    return cupy.ascontiguousarray(
        weight.swapaxes(0, 1)[(Ellipsis, *(slice(None, None, -1),) * nd)])


def _igemm_2d(x, weight, bias, y, *, args: ConvArgs, flip: bool, passes: int) -> None:
    """The 2-D implicit GEMM of the forward convolution ``args`` (of the :func:`_flipped`
    weight where ``flip``) on a contiguous ``x``, else on an NCHW copy of it."""
    from .._kernels.conv_gemm import conv2d_implicit_gemm

    conv2d_implicit_gemm(x if x.flags.c_contiguous else _nchw_copy(x),
                         _flipped(weight) if flip else weight, bias, y, stride=args.stride,
                         padding=args.padding, dilation=args.dilation, passes=passes)


def _igemm_transposed_3d(x, weight, bias, y, *, passes: int) -> None:
    """``conv_transpose3d_s2k3`` on ``x`` stored channels-last, on a contiguous (NCDHW) ``x``
    where the kernel reads one in place, or on a channels-last copy of it."""
    import cupy

    from .._kernels.conv_gemm import conv_transpose3d_implicit_gemm, transposed_s2k3_reads_ncdhw

    if not stored_in(x, "nhwc") and not transposed_s2k3_reads_ncdhw(x, passes):
        x = _channels_last_copy(x)
    conv_transpose3d_implicit_gemm(x, cupy.ascontiguousarray(weight), bias, y, passes=passes)


def _igemm_transposed_3d_groups(x, weight, bias, y) -> None:
    """``conv_transpose3d_s2k3_groups`` (3xTF32) into the packed channels-last ``y`` from
    ``x`` stored channels-last and 16-byte aligned, else from a channels-last copy of it;
    where the driver makes no tensor map of that input, :func:`_igemm_transposed_3d_copied`."""
    import cupy

    from .._kernels.conv_gemm import conv_transpose3d_groups

    weight = cupy.ascontiguousarray(weight)
    if not (stored_in(x, "nhwc") and x.data.ptr % 16 == 0):
        x = _channels_last_copy(x)
    if not conv_transpose3d_groups(x, weight, bias, y):
        _igemm_transposed_3d_copied(x, weight, bias, y, passes=3)


def _igemm_transposed_3d_copied(x, weight, bias, y, *, passes: int) -> None:
    """:func:`_igemm_transposed_3d` into a contiguous result, transposed into the packed
    channels-last ``y``."""
    from .._kernels.layout import transpose_channels

    y_nc = _empty_nchw(y.shape)
    _igemm_transposed_3d(x, weight, bias, y_nc, passes=passes)
    transpose_channels(y_nc, y, to_channels_last=True)


def _channels_last_copy(x):
    """A packed channels-last copy of ``x`` (N, C, *spatial): the transpose of a contiguous
    ``x`` (:func:`~cufused._kernels.layout.transpose_channels`), else an element-wise copy
    (``x`` stored channels-last, unaligned)."""
    from .._kernels.layout import transpose_channels
    from .._layout import empty_in_layout

    x_last = empty_in_layout(x.shape, "nhwc")
    if x.flags.c_contiguous:
        transpose_channels(x, x_last, to_channels_last=True)
    else:
        x_last[...] = x
    return x_last


def _nchw_copy(x):
    """A contiguous (NCHW / NCDHW) copy of ``x`` stored packed channels-last
    (:func:`~cufused._kernels.layout.transpose_channels`)."""
    from .._kernels.layout import transpose_channels

    x_nc = _empty_nchw(x.shape)
    transpose_channels(x, x_nc, to_channels_last=False)
    return x_nc


def _empty_nchw(shape):
    import cupy

    return cupy.empty(shape, dtype=cupy.float32)


def _transposed_as_forward(x, weight, args: ConvArgs, precision: str, *, bias=None, out=None,
                           definition_inputs: bool = False):
    """A transposed convolution that no cuDNN data-gradient plan computes, as a forward one:
    the input spread out by the stride (zeros between its values) and padded by
    ``dilation * (k - 1) - padding`` on each side (plus ``output_padding`` at the far end;
    cropped where negative), convolved with the spatially flipped weight, in and out channels
    swapped per group. The spread input costs stride**d times the input's memory.
    ``definition_inputs`` as :func:`conv_on_gpu`'s, for the forward convolution, whose
    outputs of a non-finite input are the transposed one's (those of a non-finite weight are
    not: the caller rewrites such channels)."""
    import cupy

    nd = x.ndim - 2
    n, c_in = x.shape[:2]
    k = weight.shape[2:]
    g = args.groups
    before = [d * (kk - 1) - p for d, kk, p in zip(args.dilation, k, args.padding)]
    after = [b + op for b, op in zip(before, args.output_padding)]
    spread = [(s - 1) * st + 1 for s, st in zip(x.shape[2:], args.stride)]
    full = [sp + max(b, 0) + max(a, 0) for sp, b, a in zip(spread, before, after)]
    z = cupy.zeros((n, c_in, *full), dtype=cupy.float32)
    z[(slice(None), slice(None), *(slice(max(b, 0), max(b, 0) + sp, st) for b, sp, st
                                   in zip(before, spread, args.stride)))] = x
    z = z[(slice(None), slice(None), *(slice(max(-b, 0), f - max(-a, 0)) for b, a, f
                                       in zip(before, after, full)))]
    c_out_g = weight.shape[1]
    flipped = weight.reshape(g, c_in // g, c_out_g, *k).swapaxes(1, 2).reshape(
        g * c_out_g, c_in // g, *k)[(Ellipsis, *(slice(None, None, -1),) * nd)]
    as_forward = ConvArgs(False, (1,) * nd, (0,) * nd, (0,) * nd, args.dilation, g,
                          args.out_shape)
    y, _ = conv_on_gpu(cupy.ascontiguousarray(z), cupy.ascontiguousarray(flipped), as_forward,
                       precision, out=out, bias=bias, definition_inputs=definition_inputs)
    return y


def gpu_conv_plan(x_shape, w_shape, args: ConvArgs, precision: str, *,
                  convert_input: bool, convert_output: bool, accept_classes: bool):
    """The cached cuDNN plan of this problem (no bias), for a caller that puts the input in
    the plan's ``x_layout`` itself before calling its ``apply``."""
    return _plan(x_shape, w_shape, args, precision, False, convert_input, convert_output,
                 accept_classes)


def _plan(x_shape, w_shape, args: ConvArgs, precision: str, bias: bool, convert_input: bool,
          convert_output: bool, accept_classes: bool):
    from .._cudnn import ConvProblem, conv_plan

    # cuDNN has no 3xTF32: its exact float32 stands in (at least as accurate).
    problem = ConvProblem("dgrad" if args.transposed else "fprop", tuple(x_shape),
                          tuple(w_shape), args.out_shape, args.stride, args.padding,
                          args.dilation, "ieee" if precision == "3xtf32" else precision, bias)
    return conv_plan(problem, convert_input=convert_input, convert_output=convert_output,
                     accept_classes=accept_classes)


def _convolve(nd: int, transposed: bool, x, weight, bias, *, stride, padding, output_padding,
              dilation, groups, precision, out):
    check_required(x=x, weight=weight)
    xp = get_array_module(x=x, weight=weight, bias=bias)
    check_float_dtype(xp, x=x, weight=weight, bias=bias)
    if x.ndim == nd + 1:  # unbatched, as PyTorch takes it
        return one_sample(partial(_convolve, nd, transposed, weight=weight, bias=bias,
                                  stride=stride, padding=padding,
                                  output_padding=output_padding, dilation=dilation,
                                  groups=groups, precision=precision), x, out)
    check_ndim(x, "x", nd + 2, _LAYOUT_NAMES[nd], unbatched=True)
    check_sizes(x, "x")
    args = cached_conv_args(x.shape, weight.shape, nd, transposed=transposed, stride=stride,
                            padding=padding, output_padding=output_padding,
                            dilation=dilation, groups=groups)
    precision = resolve_precision(precision)
    check_conv_memory(x.shape, args, xp)
    check_per_channel(bias, "bias", args.out_shape[1])
    check_out(out, args.out_shape, x.dtype, xp, x, inputs={"x": x, "weight": weight,
                                                          "bias": bias}, channels_last=True)
    # Every check passed: a strided bias becomes a contiguous device array.
    bias = per_channel(bias, args.out_shape[1], xp)
    if transposed:
        ref = partial(reference.conv_transpose, x, weight, bias, args.stride, args.padding,
                      args.output_padding, args.dilation, args.groups)
    else:
        ref = partial(reference.conv, extended_input(x, args, xp) if xp is numpy else x,
                      weight, bias, args.stride, args.padding, args.dilation, args.groups)
    return forward(xp, x, out, args.out_shape, reference=ref,
                   gpu=replayed(partial(_conv_gpu, x, weight, args, precision, bias)))


def _conv_gpu(x, weight, args: ConvArgs, precision: str, bias, out):
    import cupy

    # The definition's NaN and infinities of non-finite operands (semantics.rst).
    return conv_on_gpu(extended_input(x, args, cupy), weight, args, precision, out=out,
                       bias=bias, definition_nans=True, definition_inputs=True)[0]


_COMMON_DOC = """
    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        Input of shape {xshape}, or without the batch axis (unbatched, as PyTorch takes
        it; the result then has none either). NumPy arrays (float16/32/64) run the float64
        reference on the CPU; CuPy arrays (float32) run on the array's device and CuPy's
        current stream.
    weight : array
        {wdesc}
    bias : array, optional
        One value per output channel.
    stride, padding : int or tuple of int
        As in PyTorch; one value or one per spatial dimension.{padnote}{extra}
    dilation : int or tuple of int
        Spacing between the kernel's taps, as in PyTorch; one value or one per spatial
        dimension.
    groups : int
        Blocked channel connections; must divide the input (and output) channels.
    precision : {{"ieee", "tf32", "3xtf32"}}, optional
        ``"ieee"`` is exact float32 (cuDNN). ``"tf32"`` runs on TF32 tensor cores and
        ``"3xtf32"`` sums three TF32 products per multiply for float32 accuracy, each on
        cuDNN or on cufused's implicit GEMM, whichever the autotuner measured faster for the
        problem (cuDNN's exact float32 stands in for ``"3xtf32"``). ``None`` uses the
        default (:func:`cufused.get_default_precision`). Ignored on the NumPy path.
    out : array, optional
        Destination with exactly the result's shape and dtype. On the GPU it is C-contiguous
        or packed channels-last (NHWC / NDHWC memory, PyTorch's ``channels_last``); the
        implicit GEMM writes a 2-D forward convolution's channels-last result directly.

    Returns
    -------
    array
        {rdesc}, same array library and dtype as ``x`` (``out`` where given, else
        C-contiguous).

    Raises
    ------
    TypeError
        An argument of the wrong type (``x`` or ``weight`` not an array, a non-int size, a
        ``precision`` that is not a string), arrays of different libraries, or an
        unsupported dtype.
    ValueError
        Shapes or options that do not form a valid convolution, an option sequence of the
        wrong length, an ``out`` of the wrong shape or dtype or sharing memory with an input,
        or CuPy arrays on different devices.

    Examples
    --------
    >>> import numpy as np, cufused
"""


def _convolution_op(nd: int, transposed: bool) -> Callable:
    """The public convolution of rank ``nd``, transposed or not (docstrings set below)."""
    if transposed:
        def conv(x: Any, weight: Any, bias: Any = None, *, stride: Size = 1,
                 padding: Size = 0, output_padding: Size = 0, dilation: Size = 1,
                 groups: int = 1, precision: str | None = None, out: Any = None) -> Any:
            return _convolve(nd, True, x, weight, bias, stride=stride, padding=padding,
                             output_padding=output_padding, dilation=dilation, groups=groups,
                             precision=precision, out=out)
    else:
        def conv(x: Any, weight: Any, bias: Any = None, *, stride: Size = 1,
                 padding: Size = 0, dilation: Size = 1, groups: int = 1,
                 precision: str | None = None, out: Any = None) -> Any:
            return _convolve(nd, False, x, weight, bias, stride=stride, padding=padding,
                             output_padding=0, dilation=dilation, groups=groups,
                             precision=precision, out=out)
    conv.__name__ = conv.__qualname__ = f"conv{'_transpose' if transposed else ''}{nd}d"
    return warm_calls(conv)


conv2d, conv3d = _convolution_op(2, False), _convolution_op(3, False)
conv_transpose2d, conv_transpose3d = _convolution_op(2, True), _convolution_op(3, True)


_NAMED_PADDING = """ ``padding`` may also be
        ``"valid"`` (none) or ``"same"`` (stride 1; where ``dilation * (k - 1)`` is odd, the
        extra zero goes after the input, as in PyTorch)."""

_OUTPAD = """
    output_padding : int or tuple of int
        Extra size added to one side of the output (must be below stride or dilation)."""

conv2d.__doc__ = """2-D convolution (cross-correlation), as ``torch.nn.functional.conv2d``.
""" + _COMMON_DOC.format(
    xshape="(N, C_in, H, W)", wdesc="Shape (C_out, C_in / groups, kH, kW).", extra="",
    padnote=_NAMED_PADDING,
    rdesc="Shape (N, C_out, H_out, W_out)") + """\
    >>> x = np.ones((1, 1, 3, 3), dtype=np.float32)
    >>> w = np.ones((1, 1, 2, 2), dtype=np.float32)
    >>> cufused.conv2d(x, w)
    array([[[[4., 4.],
             [4., 4.]]]], dtype=float32)
"""

conv3d.__doc__ = """3-D convolution (cross-correlation), as ``torch.nn.functional.conv3d``.
""" + _COMMON_DOC.format(
    xshape="(N, C_in, D, H, W)", wdesc="Shape (C_out, C_in / groups, kD, kH, kW).", extra="",
    padnote=_NAMED_PADDING,
    rdesc="Shape (N, C_out, D_out, H_out, W_out)") + """\
    >>> x = np.ones((1, 2, 3, 3, 3))
    >>> w = np.ones((4, 2, 3, 3, 3))
    >>> cufused.conv3d(x, w, padding=1).shape
    (1, 4, 3, 3, 3)
"""

conv_transpose2d.__doc__ = """2-D transposed convolution, as PyTorch's ``conv_transpose2d``.

    On the GPU this is cuDNN's data-gradient convolution with the output shape set explicitly
    (stride 1 at a tensor-core precision: the forward convolution of the flipped kernel on
    cufused's implicit GEMM, where the autotuner measured it faster).
""" + _COMMON_DOC.format(
    xshape="(N, C_in, H, W)", wdesc="Shape (C_in, C_out / groups, kH, kW) (PyTorch's layout).",
    extra=_OUTPAD, padnote="", rdesc="Shape (N, C_out, H_out, W_out) with "
    "H_out = (H - 1) * stride - 2 * padding + dilation * (kH - 1) + output_padding + 1") + """\
    >>> x = np.ones((1, 1, 2, 2))
    >>> w = np.ones((1, 1, 2, 2))
    >>> cufused.conv_transpose2d(x, w)
    array([[[[1., 2., 1.],
             [2., 4., 2.],
             [1., 2., 1.]]]])
"""

conv_transpose3d.__doc__ = """3-D transposed convolution, as PyTorch's ``conv_transpose3d``.
""" + _COMMON_DOC.format(
    xshape="(N, C_in, D, H, W)",
    wdesc="Shape (C_in, C_out / groups, kD, kH, kW) (PyTorch's layout).", extra=_OUTPAD,
    padnote="", rdesc="Shape (N, C_out, D_out, H_out, W_out)") + """\
    >>> x = np.ones((1, 2, 2, 2, 2))
    >>> w = np.ones((2, 3, 3, 3, 3))
    >>> cufused.conv_transpose3d(x, w, stride=2, padding=1, output_padding=1).shape
    (1, 3, 4, 4, 4)
"""
