"""Float64 reference of every operator and pipeline: the semantics that the GPU path matches.

Every function takes NumPy arrays, computes in float64 and returns float64. The code is
written against the array module of its input, so CuPy arrays run the same code in float64 on
the GPU (``python -m cufused check`` computes the canonical references that way). Arguments are
assumed valid (the public functions in ``cufused`` check them) and use PyTorch's
conventions: NCHW / NCDHW data, weights ``(out, in/groups, *k)`` for convolutions and
``(in, out/groups, *k)`` for transposed convolutions, integer options expanded to one value
per spatial dimension. Loops run over kernel offsets and groups, never over pixels.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np

__all__ = [
    "conv", "conv_transpose", "group_norm", "batch_norm", "max_pool", "avg_pool", "clamp",
    "softmax",
    "conv2d_groupnorm_scale_maxpool_clamp", "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
    "conv_transpose3d_avgpool_clamp_softmax_multiply",
]


def _xp(a):
    """The array module of ``a``: CuPy for a CuPy array, else NumPy."""
    cupy = sys.modules.get("cupy")  # no CuPy array exists before CuPy is imported
    return cupy if cupy is not None and isinstance(a, cupy.ndarray) else np


def _f64(a):
    return None if a is None else _xp(a).asarray(a, dtype=np.float64)


def _channel_view(p, ndim):
    """Per-channel vector as an array broadcasting over an (N, C, *spatial) tensor."""
    return _f64(p).reshape((1, -1) + (1,) * (ndim - 2))


def conv(x, weight, bias, stride, padding, dilation, groups):
    """N-d cross-correlation as ``torch.nn.functional.conv{2,3}d``."""
    xp = _xp(x)
    x, weight = _f64(x), _f64(weight)
    nd = x.ndim - 2
    n, c = x.shape[:2]
    o, k = weight.shape[0], weight.shape[2:]
    padded = xp.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding])
    out_size = [(padded.shape[2 + i] - dilation[i] * (k[i] - 1) - 1) // stride[i] + 1
                for i in range(nd)]
    xg = padded.reshape(n, groups, c // groups, *padded.shape[2:])
    wg = weight.reshape(groups, o // groups, c // groups, *k)
    out = xp.zeros((n, groups, o // groups, int(np.prod(out_size))))
    for offs in itertools.product(*(range(kk) for kk in k)):
        window = tuple(slice(f * d, f * d + s * (m - 1) + 1, s)
                       for f, d, s, m in zip(offs, dilation, stride, out_size))
        patch = xg[(slice(None),) * 3 + window].reshape(n, groups, c // groups, -1)
        out += wg[(Ellipsis,) + offs] @ patch  # (G, Og, Cg) @ (N, G, Cg, P)
    out = out.reshape(n, o, *out_size)
    if bias is not None:
        out += _channel_view(bias, out.ndim)
    return out


def conv_transpose(x, weight, bias, stride, padding, output_padding, dilation, groups):
    """N-d transposed convolution as ``torch.nn.functional.conv_transpose{2,3}d``.

    Each input pixel scatters ``weight`` into the output at ``stride`` spacing; the
    ``padding`` rows are cropped from both ends and ``output_padding`` extends the far end.
    """
    xp = _xp(x)
    x, weight = _f64(x), _f64(weight)
    nd = x.ndim - 2
    n, cin = x.shape[:2]
    in_size = x.shape[2:]
    og, k = weight.shape[1], weight.shape[2:]
    out_size = [(in_size[i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (k[i] - 1)
                + output_padding[i] + 1 for i in range(nd)]
    full = [(in_size[i] - 1) * stride[i] + dilation[i] * (k[i] - 1) + 1 + output_padding[i]
            for i in range(nd)]
    buf = xp.zeros((n, groups, og, *full))
    xg = x.reshape(n, groups, cin // groups, -1)
    wg = weight.reshape(groups, cin // groups, og, *k)
    for offs in itertools.product(*(range(kk) for kk in k)):
        contrib = xp.swapaxes(wg[(Ellipsis,) + offs], 1, 2) @ xg  # (G, Og, Cg) @ (N, G, Cg, P)
        window = tuple(slice(f * d, f * d + s * (m - 1) + 1, s)
                       for f, d, s, m in zip(offs, dilation, stride, in_size))
        buf[(slice(None),) * 3 + window] += contrib.reshape(n, groups, og, *in_size)
    crop = tuple(slice(p, p + m) for p, m in zip(padding, out_size))
    out = buf[(slice(None),) * 3 + crop].reshape(n, groups * og, *out_size)
    if bias is not None:
        out = out + _channel_view(bias, out.ndim)
    return out


def group_norm(x, num_groups, weight, bias, eps):
    """GroupNorm: statistics over each (sample, group) of channels, biased variance."""
    xp = _xp(x)
    x = _f64(x)
    n = x.shape[0]
    mean, var = _moments(x.reshape(n, num_groups, -1), (2,))
    shape = (n, num_groups, x.shape[1] // num_groups, -1)
    rstd = (1.0 / xp.sqrt(var + eps)).reshape(n, num_groups, 1, 1)
    return _affine(x.reshape(shape), rstd, mean.reshape(n, num_groups, 1, 1),
                   _grouped(weight, shape), _grouped(bias, shape),
                   zero_bias=weight is not None).reshape(x.shape)


def _moments(x, axes: tuple[int, ...]):
    """Mean and biased variance of ``x`` over ``axes`` (kept as size-1 axes), from the
    deviations to the first value of each set when it is finite (else 0), as the GPU path sums
    them: a constant set's variance is exactly 0 (NaN with eps = 0, and bias with eps > 0, as in
    PyTorch), not the square of the rounding error of its mean."""
    xp = _xp(x)
    first = x[tuple(slice(0, 1) if axis in axes else slice(None) for axis in range(x.ndim))]
    shift = xp.where(xp.isfinite(first), first, 0.0)
    d = x - shift
    mean_d = d.mean(axis=axes, keepdims=True)
    return shift + mean_d, ((d - mean_d) ** 2).mean(axis=axes, keepdims=True)


def _grouped(p, shape):
    """A per-channel parameter as (1, G, C/G, 1) for a (N, G, C/G, L) view, or None."""
    return None if p is None else _f64(p).reshape(1, *shape[1:3], 1)


def _affine(x, rstd, mean, weight, bias, *, zero_bias: bool = True):
    """``weight * (x - mean) * rstd + bias`` in PyTorch's form ``a * x + b`` with
    ``a = rstd * weight`` and ``b = bias - mean * a``, so that an infinite weight or bias gives
    the infinities and NaNs that PyTorch gives. Without a bias, ``b`` is ``0 - mean * a``
    where PyTorch adds a zero bias (a zero shift +0, so a -0 input of a zero-mean channel
    gives +0), else ``-mean * a`` (``zero_bias`` False: PyTorch's GroupNorm without a weight
    either)."""
    a = rstd if weight is None else rstd * weight
    if bias is not None:
        b = bias - mean * a
    else:
        b = 0.0 - mean * a if zero_bias else -mean * a
    return a * x + b


def batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps,
               activation=None):
    """BatchNorm as ``torch.nn.functional.batch_norm``, with an optional fused ``tanh``.

    In training the batch statistics (biased variance) normalize ``x`` and the running
    buffers, when given, are updated in place: ``(1 - momentum) * old + momentum * new``
    with the unbiased batch variance. In inference the running statistics are used.
    """
    xp = _xp(x)
    x = _f64(x)
    axes = (0,) + tuple(range(2, x.ndim))
    if training:
        mean, var = (m.reshape(x.shape[1]) for m in _moments(x, axes))
        count = x.size // x.shape[1]
        if running_mean is not None:
            running_mean[...] = (1 - momentum) * _f64(running_mean) + momentum * mean
        if running_var is not None:
            running_var[...] = ((1 - momentum) * _f64(running_var)
                                + momentum * var * count / (count - 1))
    else:
        mean, var = _f64(running_mean), _f64(running_var)
    out = _affine(x, 1.0 / xp.sqrt(_channel_view(var, x.ndim) + eps),
                  _channel_view(mean, x.ndim),
                  None if weight is None else _channel_view(weight, x.ndim),
                  None if bias is None else _channel_view(bias, x.ndim))
    if activation == "tanh":
        out = xp.tanh(out)
    return out


def _padded(x, padding, fill):
    """An (N, C, *spatial) array in float64, each spatial axis padded by ``fill``."""
    return _xp(x).pad(_f64(x), [(0, 0), (0, 0)] + [(p, p) for p in padding],
                      constant_values=fill)


def _windows(x, kernel_size, stride, padding, fill):
    """Pooling windows of an (N, C, *spatial) array: shape (N, C, *out, *kernel)."""
    xp = _xp(x)
    nd = x.ndim - 2
    padded = _padded(x, padding, fill)
    win = xp.lib.stride_tricks.sliding_window_view(padded, kernel_size,
                                                   axis=tuple(range(2, 2 + nd)))
    return win[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in stride)]


def max_pool(x, kernel_size, stride, padding):
    """Max pooling (floor mode, implicit ``-inf`` padding; NaN in a window gives NaN). A
    window's first of equal values is kept, as PyTorch's scan over the window does (``v >
    max or isnan(v)``): -0 before +0 gives -0. The window's offsets are visited in that
    (row-major) order, each as a strided view of the padded input: the memory taken is the
    padded input's and the output's, whatever the window."""
    xp = _xp(x)
    padded = _padded(x, padding, -np.inf)
    out_size = [(n - k) // s + 1 for n, k, s in zip(padded.shape[2:], kernel_size, stride)]
    out = None
    for offset in itertools.product(*(range(k) for k in kernel_size)):
        value = padded[(slice(None), slice(None)) + tuple(
            slice(o, o + s * (m - 1) + 1, s) for o, s, m in zip(offset, stride, out_size))]
        out = value if out is None else xp.where((value > out) | xp.isnan(value), value, out)
    return out


def avg_pool(x, kernel_size, stride, padding):
    """Average pooling (floor mode, zero padding counted in the divisor as PyTorch's default)."""
    win = _windows(x, kernel_size, stride, padding, 0.0)
    return win.mean(axis=tuple(range(-len(kernel_size), 0)))


def clamp(y, lo, hi):
    """``torch.clamp(y, lo, hi)``: ``min(max(y, lo), hi)`` that keeps ``y`` where it equals a
    bound (a -0 clamped to [0, 1] stays -0) and a NaN as NaN; ``hi`` where ``lo > hi``; NaN
    everywhere for a NaN bound. ``lo`` and ``hi`` are numbers, an infinity for no bound on
    that side (the public functions pass one for a ``None`` bound)."""
    xp = _xp(y)
    y = _f64(y)
    y = xp.where((y < lo) | (lo != lo), lo, y)
    return xp.where((hi < y) | (hi != hi), hi, y)


def _scaled(y, scale):
    """``y`` times a per-channel ``scale``; None leaves it unscaled, as the public calls do."""
    return y if scale is None else y * _channel_view(scale, y.ndim)


def softmax(x, axes):
    """Softmax over ``axes`` (a tuple), max-shifted."""
    x = _f64(x)
    shifted = x - x.max(axis=axes, keepdims=True)
    e = _xp(x).exp(shifted)
    return e / e.sum(axis=axes, keepdims=True)


def conv2d_groupnorm_scale_maxpool_clamp(x, weight, conv_bias, gn_weight, gn_bias, scale, *,
                                         num_groups, pool_kernel, clamp_min, clamp_max,
                                         stride, padding, eps):
    """Pipeline A: ``clamp(max_pool2d(group_norm(conv2d(x)) * scale), clamp_min, clamp_max)``
    (``scale`` None: no scaling)."""
    y = conv(x, weight, conv_bias, stride, padding, (1, 1), 1)
    y = _scaled(group_norm(y, num_groups, gn_weight, gn_bias, eps), scale)
    y = max_pool(y, pool_kernel, pool_kernel, (0, 0))
    return clamp(y, clamp_min, clamp_max)


def conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(x, weight, bn_weight, bn_bias, gn_weight,
                                                      gn_bias, *, num_groups, stride, padding,
                                                      output_padding, groups, conv_bias,
                                                      pool_kernel, eps, running_mean,
                                                      running_var, momentum):
    """Pipeline B: ``group_norm(max_pool2d(tanh(batch_norm(conv_transpose2d(x)))))``."""
    y = conv_transpose(x, weight, conv_bias, stride, padding, output_padding, (1, 1), groups)
    y = batch_norm(y, bn_weight, bn_bias, running_mean, running_var, True, momentum, eps,
                   activation="tanh")
    y = max_pool(y, pool_kernel, pool_kernel, (0, 0))
    return group_norm(y, num_groups, gn_weight, gn_bias, eps)


def conv_transpose3d_avgpool_clamp_softmax_multiply(x, weight, scale, *, stride, padding,
                                                    output_padding, pool_kernel, clamp_min,
                                                    clamp_max, conv_bias, groups):
    """Pipeline C: ``softmax(clamp(conv_transpose3d(avg_pool3d(x))), axis=(2, 3, 4)) * scale``.

    The average pool runs first, on the input; ``scale`` None: no scaling.
    """
    y = avg_pool(x, pool_kernel, pool_kernel, (0, 0, 0))
    y = conv_transpose(y, weight, conv_bias, stride, padding, output_padding, (1, 1, 1), groups)
    y = clamp(y, clamp_min, clamp_max)
    return _scaled(softmax(y, (2, 3, 4)), scale)
