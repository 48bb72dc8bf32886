"""Scope of cufused._call_graphs.without_call_graphs, and the raw-argument keys of warm calls
(no GPU needed)."""

from __future__ import annotations

import contextlib
import threading
import types

import numpy as np
import pytest

from cufused import _call_graphs, default_precision
from cufused._call_graphs import _suspended, value_key_function, without_call_graphs


def test_without_call_graphs_is_scoped_to_its_context():
    # It holds inside its block only, and only for the context that entered it (a Dask
    # worker thread's task, not the other threads).
    seen = []
    assert not _suspended.get()
    with without_call_graphs():
        assert _suspended.get()
        worker = threading.Thread(target=lambda: seen.append(_suspended.get()))
        worker.start()
        worker.join()
        with without_call_graphs():
            assert _suspended.get()
        assert _suspended.get()
    assert not _suspended.get() and seen == [False]
    with pytest.raises(ZeroDivisionError):
        with without_call_graphs():
            1 / 0
    assert not _suspended.get()


class _Array:
    """What a raw-argument key reads of a CuPy array."""

    def __init__(self, ptr, device_id=0):
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device_id)
        self.shape, self.strides, self.dtype = (1,), (4,), np.dtype(np.float32)


class _SubArray(_Array):
    pass


def _array_part(a):
    return ("array", a.data.ptr)


def test_value_keys_tell_apart_what_a_call_tells_apart():
    key = value_key_function(_Array, _array_part, subclasses=False)
    assert key(_Array(7)) == ("array", 7)
    assert key(0.0) != key(-0.0)  # equal as floats, not as arguments
    distinct = [1.0, 1, True, [1, 2], [True, 2], [1.0, 2], (1, 2), [[1, 2]], [(1, 2)], [],
                (), [None], "1"]
    keys = [key(value) for value in distinct]
    assert len(set(keys)) == len(keys)
    assert key(float("nan")) == key(float("nan"))
    assert key([2, 3]) == key([2, 3])
    assert key([0.0]) != key([-0.0])
    assert key([_Array(1), 2]) != key([_Array(2), 2])
    assert key(None) == (type(None), None) and key("ieee") != key("tf32")
    for value in (object(), _SubArray(1), [object()], [1, [_SubArray(1)]]):
        with pytest.raises(TypeError):
            key(value)
    assert value_key_function(_Array, _array_part, subclasses=True)(_SubArray(3)) == (
        "array", 3)


def test_raw_key_ends_with_the_settings_and_the_default_precision():
    # _graph_to_remember and _checked_call read these two from the end of the key.
    fake_cupy = types.ModuleType("fake_cupy")
    fake_cupy.ndarray = _Array
    fake_cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
    stream = types.SimpleNamespace(ptr=5)
    with default_precision("3xtf32"):
        key = _call_graphs._raw_key(len, (_Array(1),), {"eps": 1e-5}, stream, fake_cupy)
    assert key[-2] == tuple(_call_graphs._config.values())
    assert key[-1] == "3xtf32"
    assert key != _call_graphs._raw_key(len, (_Array(1),), {"eps": 1e-5}, stream, fake_cupy)
    assert _call_graphs._raw_key(len, (_Array(1),), {"eps": object()}, stream,
                                 fake_cupy) is None
    # An array at the same address on another device is another argument: its checks (a
    # device mismatch) must run.
    assert (_call_graphs._raw_key(len, (_Array(1, device_id=1),), {}, stream, fake_cupy)
            != _call_graphs._raw_key(len, (_Array(1),), {}, stream, fake_cupy))


def test_caller_captures_keep_every_block_until_clear_caches(monkeypatch):
    # What a call recorded into the caller's capture allocates, freed by the call or not,
    # stays referenced (the caller's graph writes it at every replay) until clear_caches(),
    # which first waits for the device; clear_plan_cache() keeps it. Inside cufused's own
    # capture nothing more is kept, and under a caller's pool that keeps its blocks itself
    # (PyTorch's graph pool) only the plans are.
    cupy = pytest.importorskip("cupy")
    from cufused import _capture, _cudnn, clear_caches, clear_plan_cache

    synchronized = []
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: types.SimpleNamespace(
        synchronize=lambda: synchronized.append(d)))
    plan = object()

    def fake_malloc(size):
        return ("block", size)

    def run_plan():
        _cudnn._plan._plans_in_use.get().append(plan)

    _capture.release_caller_captures()
    with cupy.cuda.using_allocator(fake_malloc):
        with _capture.kept_for_caller_capture():
            cupy.cuda.get_allocator()(512)  # a temporary the call frees
            with _capture.kept_for_caller_capture():  # a nested public call
                cupy.cuda.get_allocator()(1024)
        assert _capture._caller_captures == [([("block", 512), ("block", 1024)], [], 0)]
        _capture.release_caller_captures()
        with _capture.pool_kept_by_caller(), _capture.kept_for_caller_capture():
            assert cupy.cuda.get_allocator() is fake_malloc
            run_plan()
        assert _capture._caller_captures == [([], [plan], 0)]
        _capture.release_caller_captures()
        token = _capture._inside.set(True)
        try:
            with _capture.kept_for_caller_capture():
                assert cupy.cuda.get_allocator() is fake_malloc
        finally:
            _capture._inside.reset(token)
        with _capture.kept_for_caller_capture():
            pass  # nothing allocated, no plan: nothing kept
        assert _capture._caller_captures == []
        with _capture.kept_for_caller_capture():
            cupy.cuda.get_allocator()(64)
    synchronized.clear()
    clear_plan_cache()
    assert len(_capture._caller_captures) == 1
    clear_caches()
    assert _capture._caller_captures == [] and synchronized == [0]


def test_stream_keys_tell_the_threads_per_thread_default_streams_apart():
    # Handle 2 names each thread's own default stream; any other handle is one stream.
    from cufused._cuda import stream_key

    streams = [types.SimpleNamespace(ptr=p) for p in (0, 2, 0x7F00)]
    here = [stream_key(s) for s in streams]
    there = []
    worker = threading.Thread(target=lambda: there.extend(stream_key(s) for s in streams))
    worker.start()
    worker.join()
    assert here[0] == there[0] == 0 and here[2] == there[2] == 0x7F00
    assert here[1] != there[1]


def test_warm_calls_keep_what_calls_inside_a_caller_capture_allocate(monkeypatch):
    # A wrapped public function called while the current stream is being captured runs inside
    # kept_for_caller_capture, x given by position or by keyword, with or without out; a call
    # on a stream that is not captured does not.
    cupy = pytest.importorskip("cupy")
    entered = []

    @contextlib.contextmanager
    def recorded():
        entered.append(True)
        yield

    capturing = [True]
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: "stream")
    monkeypatch.setattr(_call_graphs, "capturing", lambda stream: capturing[0])
    monkeypatch.setattr(_call_graphs, "is_cupy_array", lambda a: isinstance(a, list))
    monkeypatch.setattr(_call_graphs, "kept_for_caller_capture", recorded)
    monkeypatch.setattr(_call_graphs, "other_device", lambda args, kwargs: None)

    def public(x, *, out=None):
        return "ran"

    call = _call_graphs.warm_calls(public)
    assert call([1]) == call(x=[1]) == call([1], out=[2]) == "ran"
    assert entered == [True] * 3
    capturing[0] = False
    with without_call_graphs():
        assert call([1]) == "ran"
    assert call(np.ones(2)) == "ran"  # not a CuPy input: no capture query
    assert len(entered) == 3


def test_graph_keys_hash_once_and_equal_their_items():
    # A graph's key keeps its hash (warm calls look their graph up with the key they kept)
    # and is the plain tuple of its items as a dict key: the out-less launch builds the key
    # around its fresh result as a plain tuple and must find the graph cached under it.
    hashed = []

    class Counted:
        def __hash__(self):
            hashed.append(1)
            return 7

    items = ("f", (("array", 1, (2, 3), (12, 4), "f"),), (), Counted(), 0)
    key = _call_graphs._GraphKey(items)
    assert key == items and hash(key) == hash(items) and len(hashed) == 2
    cache = {key: "graph"}
    assert cache[key] == "graph" and len(hashed) == 2  # the kept hash, then identity
    assert cache[tuple(items)] == "graph" and len(hashed) == 3
    head, result, tail = _call_graphs.split_at_result(key)
    assert (*head, result, *tail) == items and type(head) is tuple


class _Held:
    """A reference whose release the test observes (a graph and its memory)."""


def test_releases_wait_for_cufused_captures_in_any_thread(monkeypatch):
    # Synchronizing a device (or freeing its memory) while one of its streams is captured is
    # illegal and invalidates the capture: a release asked for during one of cufused's
    # captures, in another thread, waits until the capture ends and then runs; a capture
    # asked for during a release starts after it.
    import weakref

    cupy = pytest.importorskip("cupy")
    from cufused import _cuda

    synced, capturing = [], [0]
    syncing, go_on = threading.Event(), threading.Event()

    class Device:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            assert not capturing[0], "synchronized during a capture"
            synced.append(self.device)
            syncing.set()
            assert go_on.wait(10)

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    go_on.set()
    held = _Held()
    gone = weakref.ref(held)
    items = [held]
    del held
    _cuda.release_after_devices([0], items)  # no capture: at once
    assert synced == [0] and gone() is None and items == []

    in_capture, leave = threading.Event(), threading.Event()

    def capture():
        with _cuda.own_capture_scope():
            capturing[0] += 1
            in_capture.set()
            assert leave.wait(10)
            capturing[0] -= 1

    worker = threading.Thread(target=capture)
    worker.start()
    assert in_capture.wait(10)
    held = _Held()
    gone = weakref.ref(held)
    freed = []
    _cuda.release_after_devices([1], [held], then=lambda: freed.append(gone() is None))
    del held
    assert synced == [0] and gone() is not None and not freed  # waits for the capture
    leave.set()
    worker.join(10)
    # The capture's end released it, then ran what follows the release (a pool's free).
    assert synced == [0, 1] and gone() is None and freed == [True]

    # A capture asked for while a release synchronizes starts once the release is done.
    syncing.clear()
    go_on.clear()
    releaser = threading.Thread(target=_cuda.release_after_devices, args=([2], [_Held()]))
    releaser.start()
    assert syncing.wait(10)
    in_capture.clear()
    leave.clear()
    worker = threading.Thread(target=capture)
    worker.start()
    assert not in_capture.wait(0.2)
    go_on.set()
    releaser.join(10)
    assert in_capture.wait(10)
    leave.set()
    worker.join(10)
    assert synced == [0, 1, 2] and not _cuda._queued and not _cuda._captures_under_way


def test_release_queue_failures_finalizers_and_captured_streams(monkeypatch):
    # A failed synchronization keeps its release queued (its memory may still be read) and
    # the others are done; a release asked for during a release (a finalizer) is done by it;
    # while a stream a queued release names is captured, the queue waits.
    import weakref

    cupy = pytest.importorskip("cupy")
    from cufused import _cuda

    synced, failing, nested = [], {3}, []

    class Device:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            if self.device in failing:
                raise RuntimeError("sticky")
            synced.append(self.device)
            if nested:  # a finalizer that runs here and releases its own graph
                _cuda.release_after_devices([7], [nested.pop()])

    class Stream:
        def __init__(self):
            self.captured = True

        def is_capturing(self):
            return self.captured

    monkeypatch.setattr(cupy.cuda, "Device", Device)

    def queued(devices, **kwargs):
        held = _Held()
        _cuda.release_after_devices(devices, [held], **kwargs)
        return weakref.ref(held)

    with _cuda.own_capture_scope():  # both queued, done at its end
        on3, on4 = queued([3]), queued([4])
    assert synced == [4] and on4() is None and on3() is not None and len(_cuda._queued) == 1
    failing.clear()
    _cuda.release_after_devices([], [])
    assert synced == [4, 3] and on3() is None and not _cuda._queued

    nested.append(_Held())
    on7 = weakref.ref(nested[0])
    on6 = queued([6])
    assert synced == [4, 3, 6, 7] and on6() is None and on7() is None and not _cuda._queued

    stream = Stream()
    on8 = queued([8], stream=stream)
    on9 = queued([9])
    assert synced == [4, 3, 6, 7] and on8() is not None and on9() is not None
    stream.captured = False
    _cuda.release_after_devices([], [])
    assert synced[4:] in ([8, 9], [9, 8]) and on8() is None and on9() is None
    assert not _cuda._queued
