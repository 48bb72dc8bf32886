"""cufused's cuBLAS handles (one per thread and device, apart from CuPy's) and the batched
complex GEMM of the DFT convolution on them.

cuBLAS records its kernels into a stream capture; CuPy's cuBLAS wrappers set the handle's
stream at every call and refuse to while that stream is captured. So the GEMM goes to the
libcublas that CuPy loaded through ctypes, on a handle of cufused's, and
:func:`~cufused._capture.capture_call` puts the capturing thread's handle on its side stream
before the capture begins (:func:`bind_blas_stream`), where a call inside the capture finds it
(:func:`blas_handle`). cufused moves its handles only outside captures: a caller's capture,
which cufused does not see begin, takes the convolution on cuDNN instead
(``cufused._ops.convolution``), which keeps cuBLAS's memory nodes out of the caller's graph.
CuPy's own handle is left alone.

cuBLAS 12.2 and later allocate a captured call's workspace in the graph (stream-ordered), so
graphs replayed side by side do not share one; before 12.2 a capture refuses the GEMM (the
call then runs directly). The handles live as long as their threads' storage and are not
destroyed, as CuPy's are not.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy

from ._arrays import import_cupy
from ._cuda import capturing

_local = threading.local()  # handles: {device: cuBLAS handle} of the thread
# Set once the GEMM has run in the process: from then on captures create the capturing
# thread's handle before they begin.
_in_use = threading.Event()
# GEMM scalars, passed by host address (the handles' pointer mode).
_ONE, _ZERO = numpy.ones(1, numpy.complex64), numpy.zeros(1, numpy.complex64)
_CUDA_C_32F = 4  # cudaDataType of complex64
_CAPTURED_WORKSPACE_VERSION = 120200  # cuBLAS 12.2: workspace allocated in the graph


class BlasCaptureError(RuntimeError):
    """A cuBLAS call of cufused's inside a capture that it cannot join (a capture that is not
    cufused's, or a cuBLAS before 12.2)."""


def _handle(device: int) -> int:
    """The current thread's handle of ``device`` (the current device), created outside any
    capture where the thread has none."""
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    handle = handles.get(device)
    if handle is None:
        from cupy_backends.cuda.libs import cublas

        handle = handles[device] = cublas.create()
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    return handle


def blas_handle() -> int:
    """The current thread's cuBLAS handle of the current device, on CuPy's current stream,
    in host pointer mode (scalars such as alpha and beta passed by host address).

    Raises
    ------
    BlasCaptureError
        Where the current stream is being captured and :func:`bind_blas_stream` did not put
        the thread's handle on it before (a capture that is not cufused's), or where the
        cuBLAS version allocates no workspace in the graph (before 12.2).
    """
    cupy = import_cupy()
    from cupy_backends.cuda.libs import cublas

    stream = cupy.cuda.get_current_stream()
    if capturing(stream):
        handle = getattr(_local, "handles", {}).get(cupy.cuda.runtime.getDevice())
        if handle is None or cublas.getStream(handle) != stream.ptr:
            raise BlasCaptureError("cufused's cuBLAS handle is not on the captured stream")
        if cublas.getVersion(handle) < _CAPTURED_WORKSPACE_VERSION:
            raise BlasCaptureError("this cuBLAS shares one workspace among captured graphs")
        return handle
    handle = _handle(cupy.cuda.runtime.getDevice())
    if cublas.getStream(handle) != stream.ptr:
        cublas.setStream(handle, stream.ptr)
    _in_use.set()
    return handle


def bind_blas_stream(stream) -> None:
    """Put the current thread's handle of the current device on ``stream``, whose capture is
    about to begin, once cufused's cuBLAS calls have run in the process (the handle created
    where the thread has none: its first call may be the captured one)."""
    if _in_use.is_set():
        from cupy_backends.cuda.libs import cublas

        cublas.setStream(_handle(import_cupy().cuda.runtime.getDevice()), stream.ptr)


@functools.cache
def _libcublas(major: int) -> ctypes.CDLL:
    """The libcublas that CuPy loaded: dlopen of its soname finds the loaded library."""
    lib = ctypes.CDLL(f"libcublas.so.{major}")
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
