"""Timing for the autotuners (cuDNN plans, convolution engines) and the benchmark: CUDA-event
times of a call, host issue time, random operands, the L2 flush."""

from __future__ import annotations

import time

import numpy

from ._arrays import import_cupy
from ._layout import empty_in_layout


# A call of at least this many milliseconds is timed in at most 3 single runs: its host
# overhead is nothing beside it, and a problem that large (a batch of millions of images) would
# otherwise keep the autotuner busy for minutes on its first call.
LONG_CALL_MS = 20.0


def time_ms(fn, repeat: int = 5, batch: int = 3, flush=None,
             give_up_ms: float | None = None) -> float:
    """Median CUDA-event time of ``fn()`` on the current stream after one warm-up run.

    Each sample times ``batch`` back-to-back calls and divides, so that the host overhead of a
    call hides behind the device work of the previous one; with a ``flush`` array, which is
    overwritten before each sample, the L2 holds none of the operands. The warm-up run is
    timed too: past ``give_up_ms`` its time is the answer (a candidate far slower than the
    best one so far), and from ``LONG_CALL_MS`` on the samples are at most 3 single runs.
    """
    cupy = import_cupy()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    first = cupy.cuda.get_elapsed_time(start, stop)
    if give_up_ms is not None and first > give_up_ms:
        return first
    if first >= LONG_CALL_MS:
        repeat, batch = min(repeat, 3), 1
    times = []
    for _ in range(repeat):
        if flush is not None:
            flush.fill(0)
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / batch)
    return float(numpy.median(times))


def issue_ms(fn) -> float:
    """Host milliseconds of issuing ``fn()`` to an idle current stream (not waiting for the
    work it queues)."""
    stream = import_cupy().cuda.get_current_stream()
    stream.synchronize()
    start = time.perf_counter()
    fn()
    issued = time.perf_counter() - start
    stream.synchronize()
    return issued * 1e3


def random_operand(shape, layout="nchw"):
    """Random (not zero: zeros can run faster) float32 test data in ``layout``."""
    cupy = import_cupy()
    a = empty_in_layout(shape, layout)
    a[...] = cupy.random.default_rng(0).random(a.shape, dtype=cupy.float32)
    return a


def l2_flush_buffer():
    """A float32 array twice the size of the current device's L2 cache, or None when that
    much memory is not free (the autotuner then times without flushing)."""
    cupy = import_cupy()
    try:
        return cupy.empty(cupy.cuda.Device().attributes["L2CacheSize"] // 2,
                          dtype=cupy.float32)
    except cupy.cuda.memory.OutOfMemoryError:
        return None
