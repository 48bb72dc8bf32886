"""The operators' schemas and output shapes: the ``OPERATORS`` table of :mod:`cufused.torch`.

The output-shape functions are plain integer arithmetic, so that the fake kernels also work on
symbolic sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["OPERATORS"]


# ------------------------------------------------------------------------------ output shapes


def _expand(value: Any, n: int, name: str, minimum: int, check: bool) -> tuple:
    """An option as ``n`` values; with ``check``, each an int of at least ``minimum``
    (symbolic values are left to cufused's checks when the call runs)."""
    if isinstance(value, (list, tuple)):
        if check and len(value) not in (1, n):
            raise ValueError(f"{name} must be an int or a sequence of {n} ints, got {value!r}")
        value = tuple(value) * n if len(value) == 1 else tuple(value)
    else:
        value = (value,) * n
    if check:
        for v in value:
            if type(v) is int and v < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _spatial(size: list, check: bool) -> list:
    """Output sizes; with ``check``, each (concrete one) positive: a fake kernel's empty or
    negative size would trace a call that fails when it runs."""
    if check:
        for s in size:
            if type(s) is int and s < 1:
                raise ValueError("the input's spatial size, the kernel and the options give an "
                                 f"output of spatial size {tuple(size)}, not positive")
    return size


def _layout(x, nd: int, check: bool, weight=None, groups=1) -> None:
    """With ``check``: ``x`` is (N, C, *nd spatial sizes), and ``weight`` (if given) a
    convolution weight of ``nd`` spatial sizes in ``groups >= 1`` groups; the shapes are
    indexed, and the channels counted with ``groups``, after this."""
    if not check:
        return
    if x.dim() != nd + 2:
        raise ValueError(f"x must have {nd + 2} dimensions (N, C and {nd} spatial), got shape "
                         f"{tuple(x.shape)}")
    if weight is not None and weight.dim() != nd + 2:
        raise ValueError(f"weight must have {nd + 2} dimensions ({nd} spatial), got shape "
                         f"{tuple(weight.shape)}")
    _expand(groups, 1, "groups", 1, check)


def _channels(x, channels, what: str, check: bool) -> None:
    """With ``check``: ``x`` has the channels ``what`` expects."""
    if check and type(channels) is int and type(x.shape[1]) is int and x.shape[1] != channels:
        raise ValueError(f"x has {x.shape[1]} channels but {what} expects {channels}")


def _conv_size(size: Sequence, kernel: Sequence, stride, padding, dilation,
               check: bool) -> list:
    n = len(size)
    s, d = _expand(stride, n, "stride", 1, check), _expand(dilation, n, "dilation", 1, check)
    p = _expand(padding, n, "padding", 0, check)
    return _spatial([(size[i] + 2 * p[i] - d[i] * (kernel[i] - 1) - 1) // s[i] + 1
                     for i in range(n)], check)


def _conv_transpose_size(size: Sequence, kernel: Sequence, stride, padding, output_padding,
                         dilation, check: bool) -> list:
    n = len(size)
    s, d = _expand(stride, n, "stride", 1, check), _expand(dilation, n, "dilation", 1, check)
    p = _expand(padding, n, "padding", 0, check)
    o = _expand(output_padding, n, "output_padding", 0, check)
    return _spatial([(size[i] - 1) * s[i] - 2 * p[i] + d[i] * (kernel[i] - 1) + o[i] + 1
                     for i in range(n)], check)


def _pool_size(size: Sequence, kernel_size, stride, padding, check: bool,
               unpadded_window: bool = False) -> list:
    n = len(size)
    k = _expand(kernel_size, n, "kernel_size", 1, check)
    s = k if stride is None or (isinstance(stride, (list, tuple)) and not stride) else \
        _expand(stride, n, "stride", 1, check)
    p = _expand(padding, n, "padding", 0, check)
    if check and any(type(a) is int and type(b) is int and a > b // 2 for a, b in zip(p, k)):
        raise ValueError(f"padding must be at most half the kernel size, got padding={p} for "
                         f"kernel_size={k}")
    if check and unpadded_window and any(type(a) is int and type(b) is int and a < b
                                         for a, b in zip(size, k)):
        raise ValueError(f"kernel_size: pooling window {k} is larger than x (spatial size "
                         f"{tuple(size)})")
    return _spatial([(size[i] + 2 * p[i] - k[i]) // s[i] + 1 for i in range(n)], check)


def _pooled(size: Sequence, pool_kernel, check: bool) -> list:
    """Sizes after a window and stride of ``pool_kernel``."""
    k = _expand(pool_kernel, 1, "pool_kernel", 1, check)[0]
    return _spatial([s // k for s in size], check)


# Each output-shape function takes the operator's arguments and ``_check``: True (the fake
# kernel) checks what the shape needs (layout, channels, options, a positive output), so that
# a traced call fails where its eager call would; False (the CUDA kernel, whose output shape
# comes before cufused's own checks) only computes, and the kernel calls it again with
# ``_check`` where the computation fails.

def _conv_shape(x, weight, bias=None, *, nd: int, stride=1, padding=0, dilation=1, groups=1,
                precision=None, _check=True):
    _layout(x, nd, _check, weight, groups)
    _channels(x, weight.shape[1] * groups, "weight (times groups)", _check)
    return [x.shape[0], weight.shape[0],
            *_conv_size(x.shape[2:], weight.shape[2:], stride, padding, dilation, _check)]


def _conv_transpose_shape(x, weight, bias=None, *, nd: int, stride=1, padding=0,
                          output_padding=0, dilation=1, groups=1, precision=None, _check=True):
    _layout(x, nd, _check, weight, groups)
    _channels(x, weight.shape[0], "the transposed weight", _check)
    return [x.shape[0], weight.shape[1] * groups,
            *_conv_transpose_size(x.shape[2:], weight.shape[2:], stride, padding,
                                  output_padding, dilation, _check)]


def _also_unbatched(shape: Callable, nd: int, **options: Any) -> Callable:
    """``partial(shape, nd=nd, **options)`` (a convolution's or pool's output shape) also for
    ``x`` without its batch axis, as the cufused functions take it: the batch of one's shape
    without it. Its ``unbatched_ndim`` tells the fake kernel which ``x`` that is."""
    def of(x, *args, **kwargs):
        if x.dim() == nd + 1:
            return shape(x.unsqueeze(0), *args, nd=nd, **options, **kwargs)[1:]
        if x.dim() != nd + 2 and kwargs.get("_check", True):
            raise ValueError(f"x must have {nd + 2} dimensions (N, C and {nd} spatial) or "
                             f"{nd + 1} (unbatched), got shape {tuple(x.shape)}")
        return shape(x, *args, nd=nd, **options, **kwargs)
    of.unbatched_ndim = nd + 1
    return of


def _same_shape(x, *args, _check=True, **kwargs):
    return list(x.shape)


def _pool_shape(x, kernel_size, stride=None, padding=0, *, nd: int, unpadded_window=False,
                _check=True):
    _layout(x, nd, _check)
    return [*x.shape[:2], *_pool_size(x.shape[2:], kernel_size, stride, padding, _check,
                                      unpadded_window)]


def _pipeline_a_shape(x, weight, *args, pool_kernel, stride=1, padding=0, _check=True,
                      **kwargs):
    _layout(x, 2, _check, weight)
    _channels(x, weight.shape[1], "weight", _check)
    conv = _conv_size(x.shape[2:], weight.shape[2:], stride, padding, 1, _check)
    return [x.shape[0], weight.shape[0], *_pooled(conv, pool_kernel, _check)]


def _pipeline_b_shape(x, weight, *args, stride=1, padding=0, output_padding=0, groups=1,
                      pool_kernel=2, _check=True, **kwargs):
    _layout(x, 2, _check, weight, groups)
    _channels(x, weight.shape[0], "the transposed weight", _check)
    conv = _conv_transpose_size(x.shape[2:], weight.shape[2:], stride, padding,
                                output_padding, 1, _check)
    return [x.shape[0], weight.shape[1] * groups, *_pooled(conv, pool_kernel, _check)]


def _pipeline_c_shape(x, weight, scale, *, stride, padding, output_padding, pool_kernel,
                      groups=1, _check=True, **kwargs):
    _layout(x, 3, _check, weight, groups)
    _channels(x, weight.shape[0], "the transposed weight", _check)
    return [x.shape[0], weight.shape[1] * groups,
            *_conv_transpose_size(_pooled(x.shape[2:], pool_kernel, _check), weight.shape[2:],
                                  stride, padding, output_padding, 1, _check)]


# ------------------------------------------------------------------------------- the schemas

_CONV = ("(Tensor x, Tensor weight, Tensor? bias=None, *, int[{n}] stride=1, int[{n}] padding=0, "
         "int[{n}] dilation=1, int groups=1, str? precision=None) -> Tensor")
_CONV_T = ("(Tensor x, Tensor weight, Tensor? bias=None, *, int[{n}] stride=1, "
           "int[{n}] padding=0, int[{n}] output_padding=0, int[{n}] dilation=1, int groups=1, "
           "str? precision=None) -> Tensor")
_POOL = "(Tensor x, int[{n}] kernel_size, int[{n}]? stride=None, int[{n}] padding=0) -> Tensor"

#: Every operator: name -> (schema, output-shape function). The argument names, order and
#: defaults are those of the cufused function of the same name.
OPERATORS: dict[str, tuple[str, Callable]] = {
    "conv2d": (_CONV.format(n=2), _also_unbatched(_conv_shape, 2)),
    "conv3d": (_CONV.format(n=3), _also_unbatched(_conv_shape, 3)),
    "conv_transpose2d": (_CONV_T.format(n=2), _also_unbatched(_conv_transpose_shape, 2)),
    "conv_transpose3d": (_CONV_T.format(n=3), _also_unbatched(_conv_transpose_shape, 3)),
    "group_norm": ("(Tensor x, int num_groups, Tensor? weight=None, Tensor? bias=None, *, "
                   "float eps=1e-05) -> Tensor", _same_shape),
    "batch_norm": ("(Tensor x, Tensor? weight=None, Tensor? bias=None, *, "
                   "Tensor(a!)? running_mean=None, Tensor(b!)? running_var=None, "
                   "bool training=True, float momentum=0.1, float eps=1e-05, "
                   "str? activation=None) -> Tensor", _same_shape),
    "max_pool2d": (_POOL.format(n=2), _also_unbatched(_pool_shape, 2)),
    "max_pool3d": (_POOL.format(n=3), _also_unbatched(_pool_shape, 3)),
    "avg_pool2d": (_POOL.format(n=2), _also_unbatched(_pool_shape, 2)),
    # As PyTorch's, avg_pool3d's window must fit in the unpadded input.
    "avg_pool3d": (_POOL.format(n=3), _also_unbatched(_pool_shape, 3, unpadded_window=True)),
    "softmax": ("(Tensor x, int[1] axis=-1) -> Tensor", _same_shape),
    "conv2d_groupnorm_scale_maxpool_clamp": (
        "(Tensor x, Tensor weight, Tensor? conv_bias, Tensor? gn_weight, Tensor? gn_bias, "
        "Tensor? scale, *, int num_groups, int pool_kernel, float? clamp_min, float? clamp_max, "
        "int[2] stride=1, int[2] padding=0, float eps=1e-05, str? precision=None, "
        "str method=\"fused\") -> Tensor",
        _pipeline_a_shape),
    "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm": (
        "(Tensor x, Tensor weight, Tensor? bn_weight, Tensor? bn_bias, Tensor? gn_weight, "
        "Tensor? gn_bias, *, int num_groups, int[2] stride=1, int[2] padding=0, "
        "int[2] output_padding=0, int groups=1, Tensor? conv_bias=None, int pool_kernel=2, "
        "float eps=1e-05, Tensor(a!)? running_mean=None, Tensor(b!)? running_var=None, "
        "float momentum=0.1, str? precision=None, str method=\"fused\") -> Tensor",
        _pipeline_b_shape),
    "conv_transpose3d_avgpool_clamp_softmax_multiply": (
        "(Tensor x, Tensor weight, Tensor? scale, *, int[3] stride, int[3] padding, "
        "int[3] output_padding, int pool_kernel, float? clamp_min, float? clamp_max, "
        "Tensor? conv_bias=None, int groups=1, str? precision=None, str method=\"fused\") "
        "-> Tensor",
        _pipeline_c_shape),
}
