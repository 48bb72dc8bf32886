"""The checked arguments of a convolution (:class:`ConvArgs`): validation that names the
offending argument, the output shape, the memory check, and a cache of recent checks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy

from .._arrays import check_fits, ntuple


@dataclass(frozen=True)
class ConvArgs:
    """Checked, normalized arguments of one convolution."""

    transposed: bool
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    output_padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    out_shape: tuple[int, ...]
    #: Zeros after the input along each spatial axis, beyond ``padding``: PyTorch's
    #: ``padding="same"`` where ``dilation * (k - 1)`` is odd puts its extra element there.
    #: Every route pads symmetrically, so the callers run on :func:`extended_input` (empty:
    #: none).
    extension: tuple[int, ...] = ()


def check_conv_args(x_shape, w_shape, nd: int, *, transposed: bool, stride, padding,
                    output_padding=0, dilation=1, groups=1, x_name: str = "x",
                    weight_name: str = "weight") -> ConvArgs:
    """Validate a (transposed) convolution and compute its output shape.

    Raises ``TypeError`` / ``ValueError`` that name the offending argument.
    """
    stride = ntuple(stride, nd, "stride", minimum=1)
    dilation = ntuple(dilation, nd, "dilation", minimum=1)
    extension = ()
    if isinstance(padding, str) and not transposed:
        padding, extension = _named_padding(padding, stride, dilation, w_shape[2:], nd)
        x_shape = _extended_shape(x_shape, extension)
    padding = ntuple(padding, nd, "padding", minimum=0)
    output_padding = ntuple(output_padding, nd, "output_padding", minimum=0)
    if isinstance(groups, bool) or not isinstance(groups, (int, numpy.integer)):
        raise TypeError(f"groups must be a positive int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    groups = int(groups)
    if len(w_shape) != nd + 2:
        raise ValueError(f"{weight_name} must have ndim {nd + 2}, got shape {tuple(w_shape)}")
    if any(s <= 0 for s in w_shape):
        raise ValueError(f"{weight_name} has a zero-sized dimension: shape {tuple(w_shape)}")
    n, c = x_shape[:2]
    if c % groups:
        raise ValueError(f"groups={groups} must divide the {c} input channels of {x_name}")
    k = w_shape[2:]
    if transposed:
        if w_shape[0] != c:
            raise ValueError(
                f"{weight_name} must have shape (in_channels={c}, out_channels/groups, *kernel) "
                f"for a transposed convolution, got {tuple(w_shape)}"
            )
        for i in range(nd):
            if output_padding[i] >= max(stride[i], dilation[i]):
                raise ValueError(
                    f"output_padding must be smaller than stride or dilation, got "
                    f"output_padding={output_padding}, stride={stride}, dilation={dilation}"
                )
        size = tuple((x_shape[2 + i] - 1) * stride[i] - 2 * padding[i]
                     + dilation[i] * (k[i] - 1) + output_padding[i] + 1 for i in range(nd))
        out_channels = w_shape[1] * groups
    else:
        if any(op for op in output_padding):
            raise ValueError("output_padding applies to transposed convolutions only")
        if w_shape[1] * groups != c or w_shape[0] % groups:
            raise ValueError(
                f"{weight_name} must have shape (out_channels, in_channels/groups={c // groups}, "
                f"*kernel) with out_channels divisible by groups={groups}, got {tuple(w_shape)}"
            )
        size = tuple((x_shape[2 + i] + 2 * padding[i] - dilation[i] * (k[i] - 1) - 1)
                     // stride[i] + 1 for i in range(nd))
        out_channels = w_shape[0]
    if any(s <= 0 for s in size):
        uncropped = tuple(s + 2 * p for s, p in zip(size, padding))
        why = (f"padding {padding} crops its {uncropped} positions to "
               f"{tuple(max(s, 0) for s in size)}"
               if transposed else f"kernel {tuple(k)} with padding {padding}, dilation "
               f"{dilation} is larger than the input")
        raise ValueError(f"the convolution output of {x_name} (shape {tuple(x_shape)}) would "
                         f"be empty: {why}")
    return ConvArgs(transposed, stride, padding, output_padding, dilation, groups,
                    (n, out_channels, *size), extension)


def check_conv_memory(x_shape, args: ConvArgs, xp):
    """Check before any work that the convolution's output, and on the reference path its
    padded (or, transposed, uncropped) intermediate, fit in memory; on the GPU, that every
    spatial size of its input and output, and its output channels, are below 2**31 (32-bit
    kernel arguments, as the pools')."""
    def cause() -> str:  # formatted only for the error: this check runs on every call
        return (f" (from x, weight, stride {args.stride}, padding {args.padding}, dilation "
                f"{args.dilation})")

    check_fits(args.out_shape, xp, "the convolution output", cause)
    given = tuple(x_shape)
    x_shape = _extended_shape(x_shape, args.extension)  # what the routes convolve
    if xp is not numpy:
        if any(s >= 2**31 for s in (*x_shape[2:], *args.out_shape[2:])):
            padded = (f" (padded to {tuple(x_shape)} by padding='same')" if args.extension
                      else "")
            raise ValueError(f"the convolution's spatial sizes must each be below 2**31 on the "
                             f"GPU (32-bit kernel arguments), got x {given}{padded} and "
                             f"output {tuple(args.out_shape)}")
        if args.out_shape[1] >= 2**31:
            raise ValueError(f"the convolution output must have fewer than 2**31 channels on "
                             f"the GPU (32-bit kernel arguments): weight gives "
                             f"{args.out_shape[1]}")
        return
    if args.transposed:
        lead = args.out_shape[:2]
        inner = tuple(o + 2 * p for o, p in zip(args.out_shape[2:], args.padding))
    else:
        lead = x_shape[:2]
        inner = tuple(s + 2 * p for s, p in zip(x_shape[2:], args.padding))
    check_fits((*lead, *inner), xp, "the padded input of the convolution output", cause)


# Checked arguments of recent calls: validating the options costs more host time than
# running a cached cuDNN plan. Keys keep each value's type, so that a cached (1, 1) never
# stands in for an invalid (True, 1).
_ARGS_CACHE: dict[tuple, ConvArgs] = {}


def _typed(value):
    if isinstance(value, (tuple, list)):
        return type(value), tuple((type(v), v) for v in value)
    return type(value), value


def _named_padding(name: str, stride, dilation, kernel, nd: int
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """PyTorch's ``padding="valid"`` (none) or ``"same"`` (the output the input's size, at
    stride 1: ``dilation * (k - 1)`` zeros in all, half before the input and the rest after
    it) as the symmetric padding and the extra zero after the input along each axis (empty
    where there is none: :attr:`ConvArgs.extension`)."""
    if name == "valid":
        return (0,) * nd, ()
    if name != "same":
        raise ValueError(f"padding must be 'valid', 'same' or ints, got {name!r}")
    if any(s != 1 for s in stride):
        raise ValueError(f"padding='same' needs stride 1 (as in PyTorch), got stride={stride}")
    if len(kernel) != nd or min(kernel) < 1:
        return (0,) * nd, ()  # the weight's checks report it
    total = [d * (k - 1) for d, k in zip(dilation, kernel)]
    extension = tuple(t % 2 for t in total)
    return tuple(t // 2 for t in total), extension if any(extension) else ()


def _extended_shape(x_shape, extension: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of :func:`extended_input` for an input of ``x_shape``."""
    if not extension:
        return tuple(x_shape)
    return (*x_shape[:2], *(s + e for s, e in zip(x_shape[2:], extension)))


def extended_input(x, args: ConvArgs, xp):
    """``x`` with ``args.extension`` zeros after it along each spatial axis (a new array),
    or ``x`` itself where there are none: the input that ``args``' symmetric padding
    convolves."""
    if not args.extension:
        return x
    return xp.pad(x, ((0, 0), (0, 0), *((0, e) for e in args.extension)))


def cached_conv_args(x_shape, w_shape, nd: int, **options) -> ConvArgs:
    """:func:`check_conv_args` (keyword options), remembered for recent argument values."""
    try:
        key = (x_shape, w_shape, nd, tuple(options), *(_typed(v) for v in options.values()))
        args = _ARGS_CACHE.get(key)
    except TypeError:  # an unhashable option: validate it the slow way (and fail there)
        return check_conv_args(x_shape, w_shape, nd, **options)
    if args is None:
        args = check_conv_args(x_shape, w_shape, nd, **options)
        if len(_ARGS_CACHE) >= 1024:
            _ARGS_CACHE.clear()
        _ARGS_CACHE[key] = args
    return args
