"""cufused from PyTorch: custom operators ``torch.ops.cufused.*`` and KernelBench modules.

Importing this module registers every cufused function as a PyTorch operator in the
``cufused`` namespace (``torch.library.Library`` with ``define`` / ``impl``, the route with the
least per-call overhead), with fake kernels so that ``torch.compile(fullgraph=True)`` and
``torch.export`` trace models that call them:

* CUDA tensors go to cufused zero-copy as CuPy views of the same memory; the work runs on
  PyTorch's current stream (also inside ``torch.cuda.graph`` capture), into an output that
  PyTorch's caching allocator owns.
* CPU tensors run the float64 reference (NumPy) and come back as tensors of the input dtype.

The operators are forward-only: a call with an input that requires grad while grad mode is on
raises ``RuntimeError`` (run under ``torch.no_grad()`` or ``torch.inference_mode()``).

The three ``nn.Module`` classes take the constructor arguments of the KernelBench level 2
models in their order, create the same submodules and parameters (same initialization, same
``state_dict`` keys) and run the fused pipeline in ``forward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("cufused.torch needs PyTorch: install torch (the oracle extra, or "
                      "PyTorch's CPU build on a machine without a GPU)") from exc

import numpy

import cufused

from ._arrays import import_cupy

__all__ = [
    "Conv2dGroupNormScaleMaxPoolClamp",
    "ConvTranspose2dBatchNormTanhMaxPoolGroupNorm",
    "ConvTranspose3dAvgPoolClampSoftmaxMultiply",
    "OPERATORS",
]


# ------------------------------------------------------------------------------ output shapes
# Plain integer arithmetic, so that the fake kernels also work on symbolic sizes.


def _expand(value: Any, n: int) -> tuple:
    if isinstance(value, (list, tuple)):
        return tuple(value) * n if len(value) == 1 else tuple(value)
    return (value,) * n


def _conv_size(size: Sequence, kernel: Sequence, stride, padding, dilation) -> list:
    n = len(size)
    s, p, d = _expand(stride, n), _expand(padding, n), _expand(dilation, n)
    return [(size[i] + 2 * p[i] - d[i] * (kernel[i] - 1) - 1) // s[i] + 1 for i in range(n)]


def _conv_transpose_size(size: Sequence, kernel: Sequence, stride, padding, output_padding,
                         dilation) -> list:
    n = len(size)
    s, p, d = _expand(stride, n), _expand(padding, n), _expand(dilation, n)
    o = _expand(output_padding, n)
    return [(size[i] - 1) * s[i] - 2 * p[i] + d[i] * (kernel[i] - 1) + o[i] + 1
            for i in range(n)]


def _pool_size(size: Sequence, kernel_size, stride, padding) -> list:
    n = len(size)
    k = _expand(kernel_size, n)
    s = k if stride is None or (isinstance(stride, (list, tuple)) and not stride) else \
        _expand(stride, n)
    p = _expand(padding, n)
    return [(size[i] + 2 * p[i] - k[i]) // s[i] + 1 for i in range(n)]


def _conv_shape(x, weight, bias=None, *, stride=1, padding=0, dilation=1, groups=1,
                precision=None):
    return [x.shape[0], weight.shape[0],
            *_conv_size(x.shape[2:], weight.shape[2:], stride, padding, dilation)]


def _conv_transpose_shape(x, weight, bias=None, *, stride=1, padding=0, output_padding=0,
                          dilation=1, groups=1, precision=None):
    return [x.shape[0], weight.shape[1] * groups,
            *_conv_transpose_size(x.shape[2:], weight.shape[2:], stride, padding,
                                  output_padding, dilation)]


def _same_shape(x, *args, **kwargs):
    return list(x.shape)


def _pool_shape(x, kernel_size, stride=None, padding=0):
    return [*x.shape[:2], *_pool_size(x.shape[2:], kernel_size, stride, padding)]


def _pipeline_a_shape(x, weight, *args, pool_kernel, stride=1, padding=0, **kwargs):
    conv = _conv_size(x.shape[2:], weight.shape[2:], stride, padding, 1)
    return [x.shape[0], weight.shape[0], *(s // pool_kernel for s in conv)]


def _pipeline_b_shape(x, weight, *args, stride=1, padding=0, output_padding=0, groups=1,
                      pool_kernel=2, **kwargs):
    conv = _conv_transpose_size(x.shape[2:], weight.shape[2:], stride, padding,
                                output_padding, 1)
    return [x.shape[0], weight.shape[1] * groups, *(s // pool_kernel for s in conv)]


def _pipeline_c_shape(x, weight, scale, *, stride, padding, output_padding, pool_kernel,
                      groups=1, **kwargs):
    pooled = [s // pool_kernel for s in x.shape[2:]]
    return [x.shape[0], weight.shape[1] * groups,
            *_conv_transpose_size(pooled, weight.shape[2:], stride, padding, output_padding, 1)]


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


# ---------------------------------------------------------------------------------- kernels


def _forward_only(name: str) -> RuntimeError:
    return RuntimeError(
        f"cufused::{name} is forward-only (it has no backward): it got an input that "
        "requires grad while grad mode is enabled. Call it under torch.no_grad() or "
        "torch.inference_mode(), or pass tensors that do not require grad.")


def _check_no_grad(name: str, args: tuple, kwargs: dict) -> None:
    if torch.is_grad_enabled():
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                raise _forward_only(name)


def _fake_kernel(name: str, shape: Callable) -> Callable:
    def fake(*args, **kwargs):
        _check_no_grad(name, args, kwargs)
        return args[0].new_empty(shape(*args, **kwargs))
    return fake


def _numpy(value: Any) -> Any:
    return value.detach().numpy() if isinstance(value, torch.Tensor) else value


def _cpu_kernel(name: str) -> Callable:
    fn = getattr(cufused, name)

    def cpu(*args, **kwargs):
        _check_no_grad(name, args, kwargs)
        y = fn(*(_numpy(a) for a in args), **{k: _numpy(v) for k, v in kwargs.items()})
        # A fresh contiguous tensor, as the fake kernel promises.
        return torch.from_numpy(numpy.ascontiguousarray(y))
    return cpu


_NUMPY_DTYPES = {torch.float16: numpy.dtype(numpy.float16),
                 torch.float32: numpy.dtype(numpy.float32),
                 torch.float64: numpy.dtype(numpy.float64)}
_CUPY = None  # imported on the first CUDA call
# CuPy views of recent tensors, by (address, dtype, shape, strides): creating a view costs
# more host time than looking it up, and weights and recycled activations repeat. A view
# holds no reference to the tensor; the caller's tensor keeps the memory alive during a call.
_VIEWS: dict[tuple, Any] = {}
# CuPy handles of PyTorch's streams, by (stream, device).
_STREAMS: dict[tuple[int, int], Any] = {}
_TORCH_MALLOC = None


def _load_cupy():
    global _CUPY
    _CUPY = import_cupy()
    return _CUPY


def _new_view(t: torch.Tensor, cupy) -> Any:
    if not t.is_cuda:
        raise ValueError(f"a tensor on {t.device} was passed with CUDA tensors; cufused needs "
                         "all tensors of a call on the same device")
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"cufused has no CUDA path for dtype {t.dtype}")
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), span * dtype.itemsize, None,
                                     t.get_device())
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0),
                        tuple(s * dtype.itemsize for s in t.stride()))


def _cupy_view(t: torch.Tensor, cupy) -> Any:
    key = (t.data_ptr(), t.dtype, t.shape, t.stride())
    view = _VIEWS.get(key)
    if view is None:
        if len(_VIEWS) >= 1024:
            _VIEWS.clear()
        view = _VIEWS[key] = _new_view(t, cupy)
    return view


def _current_stream(device: int, cupy) -> Any:
    """CuPy's handle of PyTorch's current stream on ``device`` (cached per stream)."""
    key = (torch._C._cuda_getCurrentRawStream(device), device)
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        stream = _STREAMS[key] = cupy.cuda.ExternalStream(key[0], device)
    return stream


def _torch_allocator(cupy) -> Callable:
    """A CuPy allocator drawing from PyTorch's caching allocator on the current stream: during
    a graph capture a call's temporaries then live in the graph's private pool, as PyTorch's
    own do (CuPy's pool would need new device memory mid-capture, which CUDA refuses)."""
    global _TORCH_MALLOC
    if _TORCH_MALLOC is None:
        _TORCH_MALLOC = cupy.cuda.memory.PythonFunctionAllocator(
            lambda size, device: torch.cuda.caching_allocator_alloc(size, device),
            lambda ptr, device: torch.cuda.caching_allocator_delete(ptr)).malloc
    return _TORCH_MALLOC


def _launch_elsewhere(fn: Callable, args: list, kwargs: dict, device: int, stream, cupy,
                      capturing: bool) -> None:
    """The rare call: on a device other than the current one, or during a graph capture."""
    with contextlib.ExitStack() as scope:
        if device != cupy.cuda.runtime.getDevice():
            scope.enter_context(cupy.cuda.Device(device))
        scope.enter_context(stream)
        if capturing:
            scope.enter_context(cupy.cuda.using_allocator(_torch_allocator(cupy)))
        fn(*args, **kwargs)


def _cuda_kernel(name: str, shape: Callable) -> Callable:
    fn = getattr(cufused, name)

    def cuda(*args, **kwargs):
        cupy = _CUPY or _load_cupy()
        if torch.is_grad_enabled():
            _check_no_grad(name, args, kwargs)
        x = args[0]
        out = torch.empty(shape(*args, **kwargs), dtype=x.dtype, device=x.device)
        cargs = [_cupy_view(a, cupy) if isinstance(a, torch.Tensor) else a for a in args]
        ckwargs = {k: _cupy_view(v, cupy) if isinstance(v, torch.Tensor) else v
                   for k, v in kwargs.items()}
        ckwargs["out"] = _cupy_view(out, cupy)
        device = x.get_device()
        stream = _current_stream(device, cupy)
        capturing = torch.cuda.is_current_stream_capturing()
        if device == cupy.cuda.runtime.getDevice() and not capturing:
            with stream:
                fn(*cargs, **ckwargs)
        else:
            _launch_elsewhere(fn, cargs, ckwargs, device, stream, cupy, capturing)
        return out
    return cuda


_LIB = torch.library.Library("cufused", "DEF")
for _name, (_schema, _shape) in OPERATORS.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _cpu_kernel(_name), "CPU")
    _LIB.impl(_name, _cuda_kernel(_name, _shape), "CUDA")
    torch.library.register_fake(f"cufused::{_name}", _fake_kernel(_name, _shape), lib=_LIB)
del _name, _schema, _shape

_ops = torch.ops.cufused


# ---------------------------------------------------------------------------------- modules


class Conv2dGroupNormScaleMaxPoolClamp(torch.nn.Module):
    """KernelBench level 2 "Conv2d_GroupNorm_Scale_MaxPool_Clamp" as one fused call.

    ``clamp(max_pool2d(group_norm(conv2d(x)) * scale, maxpool_kernel_size), clamp_min,
    clamp_max)`` through ``torch.ops.cufused.conv2d_groupnorm_scale_maxpool_clamp``.

    Parameters
    ----------
    in_channels, out_channels : int
        Convolution channels.
    kernel_size : int or tuple of int
        Convolution window (stride 1, no padding).
    num_groups : int
        GroupNorm groups; must divide ``out_channels``.
    scale_shape : tuple of int
        Shape of the per-channel ``scale`` parameter, e.g. ``(out_channels, 1, 1)``.
    maxpool_kernel_size : int
        Max-pool window and stride.
    clamp_min, clamp_max : float
        Bounds of the final clamp.
    precision : {"ieee", "tf32"}, optional
        Convolution precision on the GPU; ``None`` uses cufused's default.

    Notes
    -----
    The submodules and parameters are the KernelBench model's (``conv``, ``group_norm``,
    ``scale``, ``maxpool``), created in the same order, so the same seed gives the same
    parameters and ``state_dict`` loads both ways. Forward-only (see the module docstring).

    Examples
    --------
    >>> import torch
    >>> from cufused.torch import Conv2dGroupNormScaleMaxPoolClamp
    >>> model = Conv2dGroupNormScaleMaxPoolClamp(3, 8, 3, 4, (8, 1, 1), 2, 0.0, 1.0)
    >>> with torch.no_grad():
    ...     y = model(torch.rand(2, 3, 10, 10))
    >>> y.shape
    torch.Size([2, 8, 4, 4])
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 num_groups: int, scale_shape: tuple[int, ...], maxpool_kernel_size: int,
                 clamp_min: float, clamp_max: float, *, precision: str | None = None):
        super().__init__()
        self.conv = torch.nn.Conv2d(in_channels, out_channels, kernel_size)
        self.group_norm = torch.nn.GroupNorm(num_groups, out_channels)
        self.scale = torch.nn.Parameter(torch.ones(scale_shape))
        self.maxpool = torch.nn.MaxPool2d(kernel_size=maxpool_kernel_size)
        self.clamp_min = float(clamp_min)
        self.clamp_max = float(clamp_max)
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv, gn = self.conv, self.group_norm
        return _ops.conv2d_groupnorm_scale_maxpool_clamp.default(
            x, conv.weight, conv.bias, gn.weight, gn.bias, self.scale,
            num_groups=gn.num_groups, pool_kernel=self.maxpool.kernel_size,
            clamp_min=self.clamp_min, clamp_max=self.clamp_max, stride=conv.stride,
            padding=conv.padding, eps=gn.eps, precision=self.precision)


class ConvTranspose2dBatchNormTanhMaxPoolGroupNorm(torch.nn.Module):
    """KernelBench level 2 "ConvTranspose2d_BatchNorm_Tanh_MaxPool_GroupNorm" on cufused.

    ``group_norm(max_pool2d(tanh(batch_norm(conv_transpose2d(x))), 2, 2))``. In training mode
    (the default of every ``nn.Module``) one fused call runs it,
    ``torch.ops.cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm``, with the batch
    statistics, and updates ``batch_norm.running_mean`` / ``running_var`` /
    ``num_batches_tracked`` as ``nn.BatchNorm2d`` does. In eval mode BatchNorm uses the running
    statistics, which the fused pipeline does not do: four building-block operators run it
    (transposed convolution, BatchNorm + tanh, max pool, GroupNorm).

    Parameters
    ----------
    in_channels, out_channels : int
        Transposed-convolution channels.
    kernel_size, stride, padding : int or tuple of int
        Transposed-convolution options.
    groups : int
        Accepted and stored as ``self.groups`` but not used: the KernelBench model does not
        pass it to its ``nn.ConvTranspose2d`` either, so the weight has shape
        ``(in_channels, out_channels, k, k)`` and the results are the model's.
    num_groups : int
        GroupNorm groups; must divide ``out_channels``.
    precision : {"ieee", "tf32"}, optional
        Convolution precision on the GPU; ``None`` uses cufused's default.

    Notes
    -----
    Submodules and parameters are the KernelBench model's (``conv_transpose``, ``batch_norm``,
    ``tanh``, ``max_pool``, ``group_norm``), so ``state_dict`` loads both ways. The fused call
    uses one epsilon for both norms; when ``batch_norm.eps`` and ``group_norm.eps`` differ, the
    building blocks run instead. Forward-only (see the module docstring).

    Examples
    --------
    >>> import torch
    >>> from cufused.torch import ConvTranspose2dBatchNormTanhMaxPoolGroupNorm
    >>> model = ConvTranspose2dBatchNormTanhMaxPoolGroupNorm(4, 8, 3, 1, 1, 2, 2)
    >>> with torch.no_grad():
    ...     y = model(torch.rand(2, 4, 6, 6))
    >>> y.shape, int(model.batch_norm.num_batches_tracked)
    (torch.Size([2, 8, 3, 3]), 1)
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 stride: int | tuple[int, int], padding: int | tuple[int, int], groups: int,
                 num_groups: int, *, precision: str | None = None):
        super().__init__()
        self.conv_transpose = torch.nn.ConvTranspose2d(in_channels, out_channels, kernel_size,
                                                       stride=stride, padding=padding)
        self.batch_norm = torch.nn.BatchNorm2d(out_channels)
        self.tanh = torch.nn.Tanh()
        self.max_pool = torch.nn.MaxPool2d(kernel_size=2, stride=2)
        self.group_norm = torch.nn.GroupNorm(num_groups=num_groups, num_channels=out_channels)
        self.groups = groups
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct, bn, gn = self.conv_transpose, self.batch_norm, self.group_norm
        # BatchNorm's bookkeeping, as nn.BatchNorm2d.forward does it.
        momentum = 0.0 if bn.momentum is None else bn.momentum
        if self.training and bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(bn.num_batches_tracked)
        batch_stats = self.training or (bn.running_mean is None and bn.running_var is None)
        track = not self.training or bn.track_running_stats
        running_mean = bn.running_mean if track else None
        running_var = bn.running_var if track else None
        if batch_stats and bn.eps == gn.eps:
            return _ops.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm.default(
                x, ct.weight, bn.weight, bn.bias, gn.weight, gn.bias, num_groups=gn.num_groups,
                stride=ct.stride, padding=ct.padding, output_padding=ct.output_padding,
                groups=ct.groups, conv_bias=ct.bias, pool_kernel=2, eps=bn.eps,
                running_mean=running_mean, running_var=running_var, momentum=momentum,
                precision=self.precision)
        y = _ops.conv_transpose2d.default(
            x, ct.weight, ct.bias, stride=ct.stride, padding=ct.padding,
            output_padding=ct.output_padding, dilation=ct.dilation, groups=ct.groups,
            precision=self.precision)
        y = _ops.batch_norm.default(y, bn.weight, bn.bias, running_mean=running_mean,
                                    running_var=running_var, training=batch_stats,
                                    momentum=momentum, eps=bn.eps, activation="tanh")
        y = _ops.max_pool2d.default(y, 2, 2)
        return _ops.group_norm.default(y, gn.num_groups, gn.weight, gn.bias, eps=gn.eps)


class ConvTranspose3dAvgPoolClampSoftmaxMultiply(torch.nn.Module):
    """KernelBench level 2 "ConvTranspose3d_AvgPool_Clamp_Softmax_Multiply" as one fused call.

    ``softmax(clamp(conv_transpose3d(avg_pool3d(x)), clamp_min, clamp_max)) * scale`` with the
    softmax over D*H*W of each (sample, channel), through
    ``torch.ops.cufused.conv_transpose3d_avgpool_clamp_softmax_multiply``. The average pool
    comes first, on the input, as in the KernelBench model.

    Parameters
    ----------
    in_channels, out_channels : int
        Transposed-convolution channels.
    kernel_size, stride, padding, output_padding : int or tuple of int
        Transposed-convolution options.
    pool_kernel_size : int
        Average-pool window and stride.
    clamp_min, clamp_max : float
        Clamp bounds before the softmax.
    precision : {"ieee", "tf32"}, optional
        Convolution precision on the GPU; ``None`` uses cufused's default.

    Notes
    -----
    Submodules and parameters are the KernelBench model's (``avg_pool``, ``conv_transpose``,
    ``scale`` of shape ``(1, out_channels, 1, 1, 1)``), so ``state_dict`` loads both ways.
    Forward-only (see the module docstring).

    Examples
    --------
    >>> import torch
    >>> from cufused.torch import ConvTranspose3dAvgPoolClampSoftmaxMultiply
    >>> model = ConvTranspose3dAvgPoolClampSoftmaxMultiply(2, 3, 3, 2, 1, 1, 2, 0.0, 1.0)
    >>> with torch.no_grad():
    ...     y = model(torch.rand(1, 2, 4, 4, 4))
    >>> y.shape, bool(torch.allclose(y.sum(dim=(2, 3, 4)), torch.ones(1, 3)))
    (torch.Size([1, 3, 4, 4, 4]), True)
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, ...],
                 stride: int | tuple[int, ...], padding: int | tuple[int, ...],
                 output_padding: int | tuple[int, ...], pool_kernel_size: int,
                 clamp_min: float, clamp_max: float, *, precision: str | None = None):
        super().__init__()
        self.avg_pool = torch.nn.AvgPool3d(pool_kernel_size)
        self.conv_transpose = torch.nn.ConvTranspose3d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding,
            output_padding=output_padding)
        self.clamp_min = float(clamp_min)
        self.clamp_max = float(clamp_max)
        self.scale = torch.nn.Parameter(torch.ones(1, out_channels, 1, 1, 1))
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = self.conv_transpose
        return _ops.conv_transpose3d_avgpool_clamp_softmax_multiply.default(
            x, ct.weight, self.scale, stride=ct.stride, padding=ct.padding,
            output_padding=ct.output_padding, pool_kernel=self.avg_pool.kernel_size,
            clamp_min=self.clamp_min, clamp_max=self.clamp_max, conv_bias=ct.bias,
            groups=ct.groups, precision=self.precision)
