"""cufused's cuBLAS handles (one per thread and device, apart from CuPy's) and the batched
complex GEMM of the DFT convolution on them.

CuPy's cuBLAS wrappers set the handle's stream at every call and refuse to while that stream
is being captured into a CUDA graph; cuBLAS itself records its kernels into a capture. So
:func:`~cufused._capture.capture_call` puts the capturing thread's handle on its side stream
before the capture begins (:func:`bind_blas_stream`), a call inside the capture finds its
handle on that stream already (:func:`blas_handle`), and the GEMM goes to libcublas through
ctypes (the library CuPy loaded), not through CuPy's wrapper. CuPy's own handle is left
alone.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy

from ._arrays import import_cupy
from ._cuda import capturing

_local = threading.local()  # handles: {device: cuBLAS handle} of the thread
# GEMM scalars, passed by host address (the handles' pointer mode).
_ONE, _ZERO = numpy.ones(1, numpy.complex64), numpy.zeros(1, numpy.complex64)
_CUDA_C_32F = 4  # cudaDataType of complex64


class BlasCaptureError(RuntimeError):
    """A cuBLAS call inside a capture whose stream the thread's handle is not on."""


def _handles() -> dict[int, int]:
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    return handles


def blas_handle() -> int:
    """The current thread's cuBLAS handle of the current device, on CuPy's current stream,
    in host pointer mode (scalars such as alpha and beta passed by host address).

    Raises
    ------
    BlasCaptureError
        Where the current stream is being captured and the handle is not on it: a caller's
        capture, or a capture that began before the thread's first cuBLAS call on the
        device (the handle is created outside any capture).
    """
    cupy = import_cupy()
    from cupy_backends.cuda.libs import cublas

    stream = cupy.cuda.get_current_stream()
    device = cupy.cuda.runtime.getDevice()
    handles = _handles()
    handle = handles.get(device)
    if handle is None:
        if capturing(stream):
            raise BlasCaptureError("no cuBLAS handle of cufused's before this capture")
        handle = handles[device] = cublas.create()
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    if cublas.getStream(handle) != stream.ptr:
        if capturing(stream):
            raise BlasCaptureError("cufused's cuBLAS handle is not on the captured stream")
        cublas.setStream(handle, stream.ptr)
    return handle


def bind_blas_stream(stream) -> None:
    """Put the current thread's handle of the current device, where it has one, on
    ``stream``, whose capture is about to begin."""
    handle = _handles().get(import_cupy().cuda.runtime.getDevice())
    if handle is not None:
        from cupy_backends.cuda.libs import cublas

        cublas.setStream(handle, stream.ptr)


@functools.cache
def _libcublas(major: int) -> ctypes.CDLL:
    """The libcublas that CuPy loaded: dlopen of its soname finds the loaded library (else
    the path where cuda.pathfinder, which CuPy loads it with, finds it)."""
    try:
        lib = ctypes.CDLL(f"libcublas.so.{major}")
    except OSError:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
    ptr, int32, int64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasCgemmStridedBatched.argtypes = [
        ptr, int32, int32, int32, int32, int32, ptr, ptr, int32, int64, ptr, int32, int64, ptr,
        ptr, int32, int64, int32]
    lib.cublasGemmStridedBatchedEx.argtypes = [
        ptr, int32, int32, int32, int32, int32, ptr, ptr, int32, int32, int64, ptr, int32,
        int32, int64, ptr, ptr, int32, int32, int64, int32, int32, int32]
    return lib


def complex_gemm_strided_batched(m: int, n: int, k: int, a: int, lda: int, stride_a: int,
                                 b: int, ldb: int, stride_b: int, c: int, ldc: int,
                                 stride_c: int, batches: int, *, tf32: bool) -> None:
    """``C[i] = A[i] @ B[i]`` for i < ``batches``: column-major complex64 matrices at device
    addresses ``a + i * stride_a`` (m x k), ``b + i * stride_b`` (k x n) and ``c + i *
    stride_c`` (m x n; strides in elements), on CuPy's current stream (:func:`blas_handle`),
    also while it is captured. In float32 (``cublasCgemmStridedBatched``), or with ``tf32``
    on TF32 tensor cores with float32 accumulation (``cublasGemmStridedBatchedEx``)."""
    from cupy_backends.cuda.libs import cublas

    handle = blas_handle()
    lib = _libcublas(cublas.getVersion(handle) // 10000)
    op = cublas.CUBLAS_OP_N
    one, zero = _ONE.ctypes.data, _ZERO.ctypes.data
    if tf32:
        status = lib.cublasGemmStridedBatchedEx(
            handle, op, op, m, n, k, one, a, _CUDA_C_32F, lda, stride_a, b, _CUDA_C_32F, ldb,
            stride_b, zero, c, _CUDA_C_32F, ldc, stride_c, batches,
            cublas.CUBLAS_COMPUTE_32F_FAST_TF32, cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP)
    else:
        status = lib.cublasCgemmStridedBatched(
            handle, op, op, m, n, k, one, a, lda, stride_a, b, ldb, stride_b, zero, c, ldc,
            stride_c, batches)
    cublas.check_status(status)
