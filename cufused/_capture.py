"""Capture of one call into a CUDA graph on a side stream, for the whole-call graphs
(:mod:`cufused._call_graphs`) and prepared calls (:mod:`cufused._prepared`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import Any, NamedTuple

from ._arrays import import_cupy
from ._blas import bind_blas_stream
from ._cuda import own_capture_scope, release_after_devices
from ._cudnn import plans_in_use
from ._scoped import scoped_value

# Inside a call being captured or run by the graph cache: nested pipeline calls (the unfused
# path composes the public operations) run directly, recorded into the caller's graph.
_inside = contextvars.ContextVar("cufused_inside_call_graph", default=False)
# Inside capture_call: the current stream's capture is cufused's own (a caller's capture
# sets nothing), so an engine that refuses capture may fail it.
_own_capture = contextvars.ContextVar("cufused_own_capture", default=False)


def in_own_capture() -> bool:
    """Whether the current call runs inside cufused's own capture (:func:`capture_call`)."""
    return _own_capture.get()


# What the calls recorded into the caller's own captures allocated (each call's blocks, freed
# by it or not), the plans they ran and the device: the caller's graphs, which cufused does
# not see, read and write them at every replay. Kept until clear_caches()
# (release_caller_captures).
_caller_captures: list = []
# Inside a call that records what it allocates for the caller's capture, or whose caller's
# capture has a pool of its own that keeps the blocks (PyTorch's private graph pool).
_allocations_kept = contextvars.ContextVar("cufused_allocations_kept", default=False)


@contextlib.contextmanager
def pool_kept_by_caller():
    """Around a call whose allocations come from the caller's capture's own pool, which keeps
    every block for the graph: :func:`kept_for_caller_capture` keeps only the plans."""
    with scoped_value(_allocations_kept, True), _plans_kept_for_caller_capture():
        yield


@contextlib.contextmanager
def _plans_kept_for_caller_capture(blocks: list | None = None):
    """Keep the plans that run inside (and ``blocks``) until :func:`release_caller_captures`:
    the caller's graph reads their memory (a sub-pixel plan's weight index)."""
    cupy = import_cupy()
    with plans_in_use() as plans:
        try:
            yield
        finally:
            if plans or blocks:
                _caller_captures.append((blocks or [], plans, cupy.cuda.runtime.getDevice()))


@contextlib.contextmanager
def kept_for_caller_capture():
    """Around a call made while the caller captures the current stream: every block the call
    allocates, also those it frees before returning, and every plan that runs stay until
    :func:`release_caller_captures`. Freed into the pool, a temporary would be handed to the
    caller's next array, which each replay of the caller's graph would then overwrite."""
    if _allocations_kept.get() or _inside.get():  # kept already (capture_call keeps its own)
        yield
        return
    cupy = import_cupy()
    allocate = cupy.cuda.get_allocator()
    blocks: list = []

    def malloc(size: int):
        block = allocate(size)
        blocks.append(block)
        return block

    with (scoped_value(_allocations_kept, True), _plans_kept_for_caller_capture(blocks),
          cupy.cuda.using_allocator(malloc)):
        yield


def release_caller_captures() -> None:
    """Let go of what :func:`kept_for_caller_capture` kept, once the devices it was used on
    are idle (a caller's graph launched last may still run; the caller's graphs that recorded
    those calls must not be launched again)."""
    entries = _caller_captures[:]
    del _caller_captures[:len(entries)]  # those appended meanwhile by other threads stay
    release_after_devices({entry[2] for entry in entries}, entries)


class _TooLarge(MemoryError):
    """The capture's temporaries passed the limit given to :func:`capture_call`."""


class Capture(NamedTuple):
    """A call captured by :func:`capture_call`."""

    graph: Any
    result: Any  # what the captured call returned
    nbytes: int  # its temporaries
    stream: Any  # the side stream it was captured on
    keep: tuple  # what the graph reads or writes but does not own


def capture_call(call: Callable[[], Any], *, limit: float | None = None) -> Capture | None:
    """``call()`` captured into a CUDA graph on a side stream (nothing runs), or None where it
    is not to be replayed: the capture failed (an engine that refuses it, or temporaries past
    ``limit`` bytes), or a convolution in it runs faster issued directly (as the autotuner
    measured).

    Every block the capture allocates stays allocated as long as the result's ``keep``, also
    those the call frees: every replay reads and writes them, and a pool that ran short during
    the capture would otherwise release them. The plans that ran are kept too (the graph reads
    their memory, such as a sub-pixel weight index). Relaxed mode lets the pool allocate
    device memory during the capture. Calls nested in it run directly, recorded into it.
    """
    cupy = import_cupy()
    pool = cupy.cuda.MemoryPool()
    blocks: list = []

    def malloc(size: int):
        if limit is not None and pool.total_bytes() + size > limit:
            raise _TooLarge
        block = pool.malloc(size)
        blocks.append(block)
        return block

    side = cupy.cuda.Stream(non_blocking=True)
    plans: list = []
    result = None
    try:
        with (scoped_value(_inside, True), scoped_value(_own_capture, True),
              own_capture_scope(), plans_in_use() as plans,
              cupy.cuda.using_allocator(malloc), side):
            bind_blas_stream(side)
            side.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
            try:
                result = call()
            except BaseException:
                with contextlib.suppress(Exception):  # the call's error is the one to report
                    side.end_capture()
                raise
            graph = side.end_capture()
    except Exception:  # noqa: BLE001 - an engine that refuses capture, or _TooLarge
        graph = None
    if graph is None or not all(plan.replays for plan in plans):
        # Its pool's memory goes back to the device (cudaFree) as a release does, not
        # during another thread's capture.
        held = [pool, blocks, graph, result]
        del pool, blocks, graph, result
        release_after_devices((), held)
        return None
    return Capture(graph, result, pool.total_bytes(), side, (blocks, pool, plans))
