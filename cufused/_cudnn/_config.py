"""cuDNN Frontend's import and the pool of cuDNN handles."""

from __future__ import annotations

import contextlib
import threading

from .._arrays import import_cupy

_cudnn_module = None


def import_cudnn():
    """Import cuDNN Frontend or raise an ``ImportError`` naming the extra to install."""
    global _cudnn_module
    if _cudnn_module is None:
        try:
            import cudnn

            # A directory named cudnn on the path (a CUDA wheel's headers or libraries)
            # imports as an empty namespace package.
            if not hasattr(cudnn, "pygraph"):
                raise ImportError(
                    f"the module found, at {list(getattr(cudnn, '__path__', []))}, has no pygraph"
                )
        except (ImportError, OSError) as exc:
            raise ImportError(
                "cuDNN Frontend (module 'cudnn') is not importable: install cufused[cuda12] or "
                f"cufused[cuda13] ({exc})"
            ) from exc
        _cudnn_module = cudnn
    return _cudnn_module


# Idle cuDNN handles per device. A call borrows one for as long as it issues cuDNN work: a
# handle is never used by two threads at once (cuDNN's rule), and a process creates only as
# many as it runs calls concurrently, not one per thread (a thread pool such as Dask's would
# otherwise pay for a handle in each new thread).
_idle_handles: dict[int, list] = {}
_idle_lock = threading.Lock()


@contextlib.contextmanager
def cudnn_handle():
    """Borrow a cuDNN handle of the current device, bound to CuPy's current stream."""
    cupy = import_cupy()
    device = cupy.cuda.runtime.getDevice()
    stream = cupy.cuda.get_current_stream().ptr
    with _idle_lock:
        idle = _idle_handles.setdefault(device, [])
        entry = idle.pop() if idle else None
    if entry is None:
        entry = [import_cudnn().create_handle(), None]
    try:
        if entry[1] != stream:
            import_cudnn().set_stream(handle=entry[0], stream=stream)
            entry[1] = stream
        yield entry[0]
    finally:
        with _idle_lock:
            _idle_handles[device].append(entry)
