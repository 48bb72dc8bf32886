"""The operators' kernels: fake (output shape; cufused's checks on stand-ins), CPU (the
float64 reference) and CUDA (zero-copy CuPy views, PyTorch's current stream, PyTorch's
allocator during a graph capture; a warm call with the raw arguments of one that replayed a
whole-call graph allocates its result and launches the graph cached for that buffer, with no
views and no checks).

Each factory takes the name of a cufused function and returns the kernel that
:mod:`cufused.torch` registers for it; nothing here registers anything.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import numpy
import torch

import cufused
from cufused import _call_graphs
from cufused._arrays import check_fits, import_cupy, memory_unchecked
from cufused._capture import pool_kept_by_caller
from cufused._cuda import stream_key
from cufused._ops.normalization import part_of_batch
from cufused._cudnn import on_clear_plan_cache


# ---------------------------------------------------------------------------------- kernels


def _forward_only(name: str) -> RuntimeError:
    return RuntimeError(
        f"cufused::{name} is forward-only (it has no backward): it got an input that "
        "requires grad while grad mode is enabled. Call it under torch.no_grad() or "
        "torch.inference_mode(), or pass tensors that do not require grad.")


def refuse_backward(name: str, grad: torch.Tensor,
                    inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The kernel of ``cufused::_no_backward``, the backward of a forward-only module's result
    in grad mode (``_modules._NoBackward``): it raises."""
    raise NotImplementedError(
        f"{name} is forward-only: cufused has no backward. Its result in grad mode depends on "
        "the parameters and the input, but no gradient flows through it.")


def no_backward_fake(name: str, grad: torch.Tensor,
                     inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fake kernel of ``cufused::_no_backward``: a gradient's shape for each input, so
    that a traced backward is whole and raises only where it runs."""
    return [torch.empty_like(t) for t in inputs]


def _check_no_grad(name: str, args: tuple, kwargs: dict) -> None:
    if torch.is_grad_enabled():
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                raise _forward_only(name)


def _check_devices(name: str, names: list, args: tuple, kwargs: dict) -> None:
    """Every tensor on ``x``'s device (the fake kernel is also the Meta one, which the
    dispatcher picks where any argument is a meta tensor), as PyTorch's own operators
    require; ``ValueError`` naming the argument, as the eager kernels raise."""
    device = args[0].device
    for arg, a in (*zip(names[1:], args[1:]), *kwargs.items()):
        if isinstance(a, torch.Tensor) and a.device != device:
            raise ValueError(f"cufused::{name}: {arg} is a tensor on {a.device} with x on "
                             f"{device}: every tensor of a call must be on the same device")


def _numpy_dtype(t: torch.Tensor, arg: str) -> numpy.dtype:
    """The NumPy dtype of a tensor for cufused's CPU path (TypeError for another dtype)."""
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"{arg} has dtype {t.dtype}; cufused's CPU path takes "
                        "torch.float16, torch.float32 and torch.float64")
    return dtype


def _call_dtype(t: torch.Tensor, arg: str, cuda: bool) -> numpy.dtype:
    """:func:`_numpy_dtype`; on a CUDA call float32 only, as cufused's GPU path takes."""
    if cuda and t.dtype != torch.float32:
        raise TypeError(f"{arg} has dtype {t.dtype}; supported here: float32")
    return _numpy_dtype(t, arg)


# The most values of a stand-in held in memory of its own; a larger one repeats one zero
# (a weight's shape is all its checks read). The running buffers, which cufused updates in
# place and so checks for contiguity and writeability, get one of their own at any size.
_STAND_IN_VALUES = 2**20
_UPDATED_IN_PLACE = frozenset({"running_mean", "running_var"})


def _stand_in(value: Any, arg: str, cuda: bool) -> Any:
    """A NumPy array of a tensor's shape, dtype and contiguity, holding zeros (else the value
    itself), for cufused's checks."""
    if not isinstance(value, torch.Tensor):
        return value
    dtype, shape = _call_dtype(value, arg, cuda), tuple(value.shape)
    if value.numel() > _STAND_IN_VALUES and arg not in _UPDATED_IN_PLACE:
        return numpy.lib.stride_tricks.as_strided(numpy.zeros(1, dtype), shape,
                                                  (0,) * len(shape), writeable=False)
    if value.is_contiguous():
        return numpy.zeros(shape, dtype)
    return numpy.zeros(2 * value.numel(), dtype)[::2].reshape(shape)


def _eager_checks(fn: Callable, names: list, args: tuple, kwargs: dict) -> None:
    """Run cufused's checks of the call as its eager kernel would, on stand-ins: ``x`` as an
    empty batch (the rules across the batch counting x's, ``part_of_batch``), the other
    tensors as zeros; where a size is symbolic, only the output-shape function's checks run.
    The host's memory limits only a call on the CPU."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not all(type(s) is int for t in tensors for s in t.shape):
        return
    x, cuda = args[0], args[0].device.type == "cuda"
    # x without its batch (a 0-d x as it is: the function refuses it)
    empty = numpy.empty((0, *x.shape[1:]) if x.dim() else (), _call_dtype(x, names[0], cuda))
    with contextlib.ExitStack() as scope:
        if x.dim():
            scope.enter_context(part_of_batch(x.shape[0]))
        if x.device.type != "cpu":
            scope.enter_context(memory_unchecked())
        fn(empty, *(_stand_in(a, arg, cuda) for a, arg in zip(args[1:], names[1:])),
           **{k: _stand_in(v, k, cuda) for k, v in kwargs.items()})


def _function(name: str) -> tuple[Callable, list[str]]:
    """The cufused function ``name`` and its parameters' names, in order."""
    fn = getattr(cufused, name)
    return fn, list(inspect.signature(fn).parameters)


def _fake_kernel(name: str, shape: Callable) -> Callable:
    fn, names = _function(name)

    def fake(*args, **kwargs):
        _check_no_grad(name, args, kwargs)
        _check_devices(name, names, args, kwargs)
        size = shape(*args, **kwargs)
        if args[0].dim() == getattr(shape, "unbatched_ndim", None):
            args = (args[0].unsqueeze(0), *args[1:])  # checked as the batch of one it is
        _eager_checks(fn, names, args, kwargs)
        return args[0].new_empty(size)
    return fake


def _cpu_kernel(name: str) -> Callable:
    fn, names = _function(name)

    def numpy_of(value: Any, arg: str) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        _numpy_dtype(value, arg)
        return value.detach().numpy()

    def cpu(*args, **kwargs):
        _check_no_grad(name, args, kwargs)
        y = fn(*(numpy_of(a, arg) for a, arg in zip(args, names)),
               **{k: numpy_of(v, k) for k, v in kwargs.items()})
        # A fresh contiguous tensor, as the fake kernel promises (torch.from_numpy gives an
        # empty array zero strides).
        if y.size == 0:
            return torch.empty(y.shape, dtype=getattr(torch, y.dtype.name))
        return torch.from_numpy(numpy.ascontiguousarray(y))
    return cpu


_NUMPY_DTYPES = {torch.float16: numpy.dtype(numpy.float16),
                 torch.float32: numpy.dtype(numpy.float32),
                 torch.float64: numpy.dtype(numpy.float64)}
_CUPY = None  # imported on the first CUDA call
# CuPy views of recent tensors, by (address, device, dtype, shape, strides; an address freed
# on one device may come back on another): creating a view costs more host time than looking
# it up, and weights and recycled activations repeat. A view holds no reference to the
# tensor; the caller's tensor keeps the memory alive during a call.
_VIEWS: dict[tuple, Any] = {}
# CuPy handles of PyTorch's streams, by (stream, device).
_STREAMS: dict[tuple[int, int], Any] = {}
_TORCH_MALLOC = None
# Warm calls by their raw arguments (each tensor's address, device, shape, strides and dtype, every
# other value, the device, the stream, cufused's settings) -> the result's shape, byte
# strides and dtype char, and the key of the whole-call graph that the cufused call launched,
# before and after the result's part: a later call allocates its result and launches the
# graph cached for that buffer (cufused._call_graphs), with no CuPy view and no checks.
_WARM: dict[tuple, tuple] = {}
on_clear_plan_cache(_WARM.clear)  # cufused.clear_caches() drops the graphs they name


def _load_cupy():
    global _CUPY
    _CUPY = import_cupy()
    return _CUPY


def _new_view(t: torch.Tensor, cupy, name: str) -> Any:
    if not t.is_cuda:
        raise ValueError(f"{name} is a tensor on {t.device}, passed with CUDA tensors; cufused "
                         "needs all tensors of a call on the same device")
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"{name} has dtype {t.dtype}; supported here: float32")
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), span * dtype.itemsize, None,
                                     t.get_device())
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0),
                        tuple(s * dtype.itemsize for s in t.stride()))


def _cupy_view(t: torch.Tensor, cupy, name: str) -> Any:
    key = (t.data_ptr(), t.get_device(), t.dtype, t.shape, t.stride())
    view = _VIEWS.get(key)
    if view is None:
        if len(_VIEWS) >= 1024:
            _VIEWS.clear()
        view = _VIEWS[key] = _new_view(t, cupy, name)
    return view


class _RawStream:
    """A raw ``cudaStream_t`` handle under the CUDA stream protocol, the form in which CuPy
    takes a foreign stream (``cupy.cuda.Stream.from_external``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _current_stream(device: int, cupy, raw: int | None = None) -> Any:
    """CuPy's handle of PyTorch's current stream on ``device`` (cached per stream); ``raw`` is
    that stream's handle where the caller has read it already."""
    key = (torch._C._cuda_getCurrentRawStream(device) if raw is None else raw, device)
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        # The stream carries no device (CuPy's -1): callers launch on it only with its
        # device current.
        stream = _STREAMS[key] = cupy.cuda.Stream.from_external(_RawStream(key[0]))
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
            scope.enter_context(pool_kept_by_caller())
        fn(*args, **kwargs)


# The part of a warm call's key for one argument (TypeError for one it cannot key).
_raw = _call_graphs.value_key_function(
    torch.Tensor, lambda t: (t.data_ptr(), t.get_device(), t.shape, t.stride(), t.dtype), True)


def _warm_key(name: str, args: tuple, kwargs: dict, device: int) -> tuple | None:
    """The raw-argument key of a call on ``device`` (PyTorch's current stream there), or None
    for arguments it cannot key or where cufused launches nothing from raw arguments."""
    settings = _call_graphs.settings_key()
    if settings is None:
        return None
    raw = torch._C._cuda_getCurrentRawStream(device)
    try:
        # The raw handle (key[5]) and the stream's identity: the per-thread default stream's
        # handle names each thread's own.
        return (name, tuple(map(_raw, args)), tuple(kwargs), tuple(map(_raw, kwargs.values())),
                device, raw, stream_key(_RawStream(raw)), settings)
    except TypeError:
        return None


def _cuda_kernel(name: str, shape: Callable) -> Callable:
    fn, names = _function(name)

    def cuda(*args, **kwargs):
        cupy = _CUPY or _load_cupy()
        if torch.is_grad_enabled():
            _check_no_grad(name, args, kwargs)
        x = args[0]
        device = x.get_device()
        out = key = None
        if x.is_cuda and _WARM:
            key = _warm_key(name, args, kwargs, device)
            warm = _WARM.get(key)
            if (warm is not None and device == cupy.cuda.runtime.getDevice()
                    and not torch._C._cuda_isCurrentStreamCapturing()):
                out_shape, out_strides, char, head, tail = warm
                out = x.new_empty(out_shape)  # x's dtype and device, contiguous
                if _call_graphs.launch_with_result(
                        head, _call_graphs.array_key(out.data_ptr(), out_shape, out_strides,
                                                     char),
                        tail, _current_stream(device, cupy, key[5])):
                    return out
        if out is None:
            try:
                out = torch.empty(shape(*args, **kwargs, _check=False), dtype=x.dtype,
                                  device=x.device)
            except (ZeroDivisionError, RuntimeError, IndexError):
                # The checks say what is wrong: the shape's, then cufused's refusal of a
                # result past the device's memory (PyTorch's allocator would raise
                # OutOfMemoryError or an overflow of its size computation).
                check_fits(tuple(shape(*args, **kwargs)), cupy, "the result")
                raise
        cargs = [_cupy_view(a, cupy, arg) if isinstance(a, torch.Tensor) else a
                 for a, arg in zip(args, names)]
        ckwargs = {k: _cupy_view(v, cupy, k) if isinstance(v, torch.Tensor) else v
                   for k, v in kwargs.items()}
        ckwargs["out"] = result = _cupy_view(out, cupy, "out")
        stream = _current_stream(device, cupy)
        capturing = torch._C._cuda_isCurrentStreamCapturing()
        if device != cupy.cuda.runtime.getDevice() or capturing:
            _launch_elsewhere(fn, cargs, ckwargs, device, stream, cupy, capturing)
            return out
        if key is None:
            key = _warm_key(name, args, kwargs, device)
        if cupy.cuda.get_current_stream().ptr == stream.ptr:  # already CuPy's
            fn(*cargs, **ckwargs)
        else:
            with stream:
                fn(*cargs, **ckwargs)
        if key is not None:
            # The graph that writes this result (the shortcut's key holds out's address), with
            # the settings unchanged since this call's key was taken.
            graph_key = _call_graphs.shortcut_graph(fn, cargs, ckwargs, stream)
            if graph_key is not None and _call_graphs.settings_key() == key[-1]:
                if len(_WARM) >= 256:
                    _WARM.clear()
                head, _, tail = _call_graphs.split_at_result(graph_key)
                _WARM[key] = (result.shape, result.strides, result.dtype.char, head, tail)
        return out
    return cuda
