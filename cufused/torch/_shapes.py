"""The operators' schemas and output shapes: the ``OPERATORS`` table of :mod:`cufused.torch`.

The output-shape functions are plain integer arithmetic, so that the fake kernels also work on
symbolic sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["OPERATORS"]


# ------------------------------------------------------------------------------ output shapes


def _expand(value: Any, n: int, name: str, minimum: int) -> tuple:
    """An option as n values, each at least ``minimum`` (the kernels' output shapes are
    computed before cufused checks the call: a stride of 0 would divide by zero here)."""
    if isinstance(value, (list, tuple)):
        value = tuple(value) * n if len(value) == 1 else tuple(value)
    else:
        value = (value,) * n
    if any(v < minimum for v in value):
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _spatial(size: list) -> list:
    """Output sizes, each positive (a fake kernel's empty or negative size would trace a call
    that fails when it runs)."""
    if any(s < 1 for s in size):
        raise ValueError(f"the input's spatial size, the kernel and the options give an output "
                         f"of spatial size {tuple(size)}, not positive")
    return size


def _channels(x, expected, what: str) -> None:
    if x.shape[1] != expected:
        raise ValueError(f"x has {x.shape[1]} channels but {what} expects {expected}")


def _conv_size(size: Sequence, kernel: Sequence, stride, padding, dilation) -> list:
    n = len(size)
    s, d = _expand(stride, n, "stride", 1), _expand(dilation, n, "dilation", 1)
    p = _expand(padding, n, "padding", 0)
    return _spatial([(size[i] + 2 * p[i] - d[i] * (kernel[i] - 1) - 1) // s[i] + 1
                     for i in range(n)])


def _conv_transpose_size(size: Sequence, kernel: Sequence, stride, padding, output_padding,
                         dilation) -> list:
    n = len(size)
    s, d = _expand(stride, n, "stride", 1), _expand(dilation, n, "dilation", 1)
    p = _expand(padding, n, "padding", 0)
    o = _expand(output_padding, n, "output_padding", 0)
    return _spatial([(size[i] - 1) * s[i] - 2 * p[i] + d[i] * (kernel[i] - 1) + o[i] + 1
                     for i in range(n)])


def _pool_size(size: Sequence, kernel_size, stride, padding) -> list:
    n = len(size)
    k = _expand(kernel_size, n, "kernel_size", 1)
    s = k if stride is None or (isinstance(stride, (list, tuple)) and not stride) else \
        _expand(stride, n, "stride", 1)
    p = _expand(padding, n, "padding", 0)
    return _spatial([(size[i] + 2 * p[i] - k[i]) // s[i] + 1 for i in range(n)])


def _pooled(size: list, pool_kernel) -> list:
    """Sizes after a window and stride of ``pool_kernel``."""
    k = _expand(pool_kernel, 1, "pool_kernel", 1)[0]
    return _spatial([s // k for s in size])


def _conv_shape(x, weight, bias=None, *, stride=1, padding=0, dilation=1, groups=1,
                precision=None):
    _channels(x, weight.shape[1] * groups, "weight (times groups)")
    return [x.shape[0], weight.shape[0],
            *_conv_size(x.shape[2:], weight.shape[2:], stride, padding, dilation)]


def _conv_transpose_shape(x, weight, bias=None, *, stride=1, padding=0, output_padding=0,
                          dilation=1, groups=1, precision=None):
    _channels(x, weight.shape[0], "the transposed weight")
    return [x.shape[0], weight.shape[1] * groups,
            *_conv_transpose_size(x.shape[2:], weight.shape[2:], stride, padding,
                                  output_padding, dilation)]


def _same_shape(x, *args, **kwargs):
    return list(x.shape)


def _pool_shape(x, kernel_size, stride=None, padding=0):
    return [*x.shape[:2], *_pool_size(x.shape[2:], kernel_size, stride, padding)]


def _pipeline_a_shape(x, weight, *args, pool_kernel, stride=1, padding=0, **kwargs):
    _channels(x, weight.shape[1], "weight")
    conv = _conv_size(x.shape[2:], weight.shape[2:], stride, padding, 1)
    return [x.shape[0], weight.shape[0], *_pooled(conv, pool_kernel)]


def _pipeline_b_shape(x, weight, *args, stride=1, padding=0, output_padding=0, groups=1,
                      pool_kernel=2, **kwargs):
    _channels(x, weight.shape[0], "the transposed weight")
    conv = _conv_transpose_size(x.shape[2:], weight.shape[2:], stride, padding,
                                output_padding, 1)
    return [x.shape[0], weight.shape[1] * groups, *_pooled(conv, pool_kernel)]


def _pipeline_c_shape(x, weight, scale, *, stride, padding, output_padding, pool_kernel,
                      groups=1, **kwargs):
    _channels(x, weight.shape[0], "the transposed weight")
    return [x.shape[0], weight.shape[1] * groups,
            *_conv_transpose_size(_pooled(x.shape[2:], pool_kernel), weight.shape[2:], stride,
                                  padding, output_padding, 1)]


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
    "conv2d": (_CONV.format(n=2), _conv_shape),
    "conv3d": (_CONV.format(n=3), _conv_shape),
    "conv_transpose2d": (_CONV_T.format(n=2), _conv_transpose_shape),
    "conv_transpose3d": (_CONV_T.format(n=3), _conv_transpose_shape),
    "group_norm": ("(Tensor x, int num_groups, Tensor? weight=None, Tensor? bias=None, *, "
                   "float eps=1e-05) -> Tensor", _same_shape),
    "batch_norm": ("(Tensor x, Tensor? weight=None, Tensor? bias=None, *, "
                   "Tensor(a!)? running_mean=None, Tensor(b!)? running_var=None, "
                   "bool training=True, float momentum=0.1, float eps=1e-05, "
                   "str? activation=None) -> Tensor", _same_shape),
    "max_pool2d": (_POOL.format(n=2), _pool_shape),
    "max_pool3d": (_POOL.format(n=3), _pool_shape),
    "avg_pool2d": (_POOL.format(n=2), _pool_shape),
    "avg_pool3d": (_POOL.format(n=3), _pool_shape),
    "softmax": ("(Tensor x, int[1] axis=-1) -> Tensor", _same_shape),
    "conv2d_groupnorm_scale_maxpool_clamp": (
        "(Tensor x, Tensor weight, Tensor? conv_bias, Tensor? gn_weight, Tensor? gn_bias, "
        "Tensor scale, *, int num_groups, int pool_kernel, float clamp_min, float clamp_max, "
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
        "(Tensor x, Tensor weight, Tensor scale, *, int[3] stride, int[3] padding, "
        "int[3] output_padding, int pool_kernel, float clamp_min, float clamp_max, "
        "Tensor? conv_bias=None, int groups=1, str? precision=None, str method=\"fused\") "
        "-> Tensor",
        _pipeline_c_shape),
}
