"""cufused's cuBLAS handles: one per thread and device, apart from CuPy's.

CuPy's cuBLAS wrapper refuses to set a handle's stream while that stream is being captured
into a CUDA graph; cuBLAS itself records its kernels into a capture. So
:func:`~cufused._capture.capture_call` puts the capturing thread's handle on its side stream
before the capture begins (:func:`bind_blas_stream`), and a cuBLAS call inside the capture
finds its handle on that stream already (:func:`blas_handle`). CuPy's own handle, which CuPy
moves to the current stream at each of its calls, is left alone.
"""

from __future__ import annotations

import threading

from ._arrays import import_cupy
from ._cuda import capturing

_local = threading.local()  # handles: {device: cuBLAS handle} of the thread


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
