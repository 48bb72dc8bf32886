"""Whole-call CUDA graphs of warm calls (:func:`replayed`) and :func:`clear_caches`.

The GPU half of a pipeline or building block (the partial that it hands to ``forward``) is
keyed on everything that decides what its kernels read and write: the function, each array's
address, shape, strides and dtype (``out`` included), every other bound value, the device,
the stream and the convolution settings. From the second call with a key, the call is
captured into one CUDA graph (the convolution and every other kernel) and later calls launch
it: one graph launch instead of the kernel launches and plan lookups of the call. The graph
reads its operands where they are, so new values at the same addresses are computed afresh;
whatever differs (another buffer, layout, stride pattern, option or stream) is another key.

A public function wrapped by :func:`warm_calls` also remembers, by its raw arguments (each
array's address, device, shape, strides and dtype, every other value, the device, the stream and the
settings), the graph that its checked call launched: a later call with the same raw arguments
launches that graph without checking them again, since the checks read nothing else. A call
without ``out`` remembers the shape and dtype of its result and the graph's key without it:
a later call allocates its result as the checked call would and launches the graph that
writes to that buffer, where one is cached. Only graphs that read and write nothing but the
caller's arrays, the result and their own temporaries are remembered so.

A graph keeps its temporaries (the convolution output included) and the plans that ran in it.
So that this memory stays bounded, at most ``MAX_GRAPHS`` graphs live, holding at most
``MAX_TOTAL_FRACTION`` of a device's memory (least recently used first out); a call whose
temporaries pass ``MAX_TEMPORARY_FRACTION`` of the device's memory is not kept as a graph,
and neither is one whose convolution the autotuner measured faster issued directly, or which
refuses capture; such keys run directly from then on, and so do keys whose graph was dropped
to make room (a loop over more buffers than the cache holds, such as Dask's chunks, replays
the graphs that stay and runs the others directly, instead of capturing at every call). With
``cufused.set_conv_graph_replay(False)`` every call runs directly.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import struct
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ._arrays import _byte_span, _memory_limit, import_cupy, is_cupy_array, other_device
from ._capture import _inside, capture_call, kept_for_caller_capture, release_caller_captures
from ._cuda import capturing, release_after_devices, stream_key
from ._cudnn import clear_plan_cache, on_clear_plan_cache
from ._precision import default_precision, resolve_precision
from ._scoped import scoped_value
from ._settings import _config

#: Whole-call graphs kept at once (all devices); the least recently used goes first.
MAX_GRAPHS = 8
#: A call whose temporaries take more than this fraction of the device's memory runs directly.
MAX_TEMPORARY_FRACTION = 1 / 16
#: The graphs of one device keep at most this fraction of its memory in temporaries (the least
#: recently used go first).
MAX_TOTAL_FRACTION = 1 / 4
# Calls seen once per key before the second captures (bounded like the graphs).
_CALLS_BEFORE_CAPTURE = 2
_MAX_COUNTED = 64

_graphs: OrderedDict = OrderedDict()  # key -> _Graph, least recently used first
_direct_keys: OrderedDict = OrderedDict()  # keys that run directly (bounded like _counts)
_counts: dict = {}
_lock = threading.Lock()
# Raw-argument key of a public call -> the key of the graph its checked call launched.
_shortcuts: dict = {}
# Raw-argument key of a public call without out -> its result's shape and dtype, the key of
# the graph its checked call launched before and after the result's part, and the addresses of
# the results whose graphs it has launched.
_fresh_shortcuts: dict = {}
# Results of one such key given graphs: past them a call is checked and runs directly, so that
# the buffers a memory pool cycles over do not drop the graphs of other calls.
_MAX_FRESH_BUFFERS = 4
_MAX_SHORTCUTS = 256
# The functions that warm_calls returned: cufused's public functions on arrays.
_public_functions: set = set()
# The graph keys that _run launches, recorded for the public call around it (warm_calls).
_launched: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "cufused_launched_graphs", default=None)
_SCALARS = frozenset({bool, int, str, type(None)})
_INTS = frozenset({int})
_float_bits = struct.Struct("d").pack  # -0.0 apart from 0.0, equal as floats
# Inside without_call_graphs(): the cache neither counts, captures nor replays.
_suspended: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cufused_call_graphs_suspended", default=False)


class _Graph:
    """A captured call: the graph and what it reads or writes without owning it."""

    def __init__(self, graph, device: int, nbytes: int, keep: tuple):
        self.graph = graph
        self.device = device
        self.nbytes = nbytes  # its temporaries
        self.keep = keep


def _release(graphs: list) -> None:
    """Drop graphs that may still run on the device (emptying ``graphs``): each waits for
    its device first, since what they read (a plan's weight index from CuPy's pool) may go
    back to a pool on another stream than the one they run on (outside ``_lock``; see
    :func:`~cufused._cuda.release_after_devices`)."""
    if graphs:
        release_after_devices({g.device for g in graphs}, graphs)


def _value_key(value: Any):
    """The part of the key for one bound value; raises ``TypeError`` for a value it cannot key
    (the call then runs directly)."""
    if value is None or isinstance(value, (bool, int, str)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", value.hex())  # NaN keys equal to NaN
    if is_cupy_array(value):
        return array_key(value.data.ptr, value.shape, value.strides, value.dtype.char)
    if isinstance(value, tuple):
        return ("tuple", *(_value_key(v) for v in value))
    if getattr(value, "__dataclass_fields__", None) is not None and value.__hash__ is not None:
        return ("dataclass", value)  # frozen: the checked convolution arguments
    if type(value).__name__ == "module":
        return ("module", value.__name__)
    raise TypeError(f"no key for {type(value).__name__}")


class _GraphKey(tuple):
    """A graph's key (:func:`_call_key`) that is hashed once: a warm call launched from its raw
    arguments looks its graph up (and moves it to the cache's end) with the key it kept, and
    hashing the nested key takes about half a microsecond each time. Equal to, and hashed as,
    the plain tuple of its items."""

    def __new__(cls, items):
        key = super().__new__(cls, items)
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self):
        return self._hash


def _call_key(gpu: functools.partial, out, cupy):
    try:
        bound = tuple(_value_key(a) for a in gpu.args)
        options = tuple(sorted((k, _value_key(v)) for k, v in gpu.keywords.items()))
        stream = cupy.cuda.get_current_stream()
        return _GraphKey((gpu.func, bound, options, _value_key(out),
                          cupy.cuda.runtime.getDevice(), stream_key(stream),
                          tuple(_config.values())))
    except TypeError:  # a value without a key, or an unhashable one
        return None


def split_at_result(graph_key: tuple) -> tuple[tuple, tuple, tuple]:
    """A graph's key (:func:`_call_key`) as its parts before ``out``'s, ``out``'s, and
    after it."""
    return graph_key[:3], graph_key[3], graph_key[4:]


def launch_with_result(head: tuple, result: tuple, tail: tuple, stream) -> bool:
    """:func:`launch_cached` for the graph whose key is ``head`` and ``tail``
    (:func:`split_at_result`) around the part ``result`` of the array it writes."""
    return launch_cached((*head, result, *tail), stream)


@contextlib.contextmanager
def without_call_graphs():
    """Run the calls made inside (in this context only) without whole-call graphs: the cache
    neither counts, captures nor replays them; a convolution plan still replays its own
    graphs, keyed on its operands. For callers whose results and temporaries come from the
    pool at addresses that change between runs (Dask's chunk tasks): a key that rarely
    repeats only costs a capture, and each graph kept drops another, which waits for the
    device."""
    with scoped_value(_suspended, True):
        yield


def replayed(gpu: functools.partial) -> Callable:
    """``gpu`` (a pipeline's bound GPU half, called with ``out``) through the graph cache."""
    return functools.partial(_run, gpu)


def _run(gpu: functools.partial, out):
    if _inside.get():
        return gpu(out)
    if not _config["replay"] or _suspended.get():  # set_conv_graph_replay(False) or
        return _direct(gpu, out)                     # without_call_graphs()
    cupy = import_cupy()
    stream = cupy.cuda.get_current_stream()
    if capturing(stream):  # the caller's capture records the kernels
        return gpu(out)
    key = _call_key(gpu, out, cupy)
    if key is None:
        return _direct(gpu, out)
    # The lock covers the cache's bookkeeping and the launches, not a direct call's work
    # (a first call's plan search takes seconds, which other threads' warm launches would
    # wait for).
    with _lock:
        entry = _graphs.get(key)
        if entry is not None:
            _graphs.move_to_end(key)
            _launch_recorded(entry, key, stream)
            return out
        direct = key in _direct_keys
        if not direct:
            calls = _counts.get(key, 0) + 1
            direct = calls < _CALLS_BEFORE_CAPTURE
            if direct:
                if len(_counts) >= _MAX_COUNTED:
                    _counts.clear()
                _counts[key] = calls
            else:
                _counts.pop(key, None)
    if direct:
        return _direct(gpu, out)
    entry = _capture(gpu, out, cupy)
    if entry is not None and tuple(_config.values()) != key[-1]:
        # Another thread changed the settings during the capture, whose plan choices may have
        # read either: the graph is not kept under this key's settings.
        dropped, entry = [entry], None  # the release holds it alone
        _release(dropped)
        return _direct(gpu, out)
    dropped: list = []
    with _lock:
        if entry is None:
            _run_directly(key)
        else:
            replaced = _graphs.pop(key, None)  # another thread's capture of this key
            if replaced is not None:
                dropped.append(replaced)
                replaced = None
            _graphs[key] = entry
            # Eviction keeps the newest graph, so this one is in the cache to launch.
            dropped += _evict(_memory_limit(cupy) * MAX_TOTAL_FRACTION, key[4])
            _launch_recorded(entry, key, stream)
    _release(dropped)
    return out if entry is not None else _direct(gpu, out)


def _launch_recorded(entry: _Graph, key: tuple, stream) -> None:
    """Launch a cached graph (under ``_lock``: a graph dropped from the cache waits in
    ``_release`` for its device, which then includes this launch) and record its key for the
    public call around it (:func:`warm_calls`)."""
    launched = _launched.get()
    if launched is not None:
        launched.append(key)
    _launch(entry, stream)


def _launch(entry: _Graph, stream) -> None:
    entry.graph.launch(stream=stream)


def warm_calls(public: Callable) -> Callable:
    """``public`` (a pipeline or building block taking ``out`` as a keyword) with its warm
    calls launched straight from their raw arguments: a call whose raw arguments, device,
    stream and settings equal those of an earlier call that replayed a graph launches that
    graph again (without ``out``: the one writing to the result it allocates), skipping the
    argument checks (module docstring)."""
    # A call without "out" among its keywords then has none.
    if inspect.signature(public).parameters["out"].kind is not inspect.Parameter.KEYWORD_ONLY:
        raise TypeError(f"{public.__name__} must take out as a keyword-only parameter")

    @functools.wraps(public)
    def call(*args, **kwargs):
        device = other_device(args, kwargs)
        if device is not None:
            with sys.modules["cupy"].cuda.Device(device):
                return call(*args, **kwargs)
        # Only a CuPy input can have a graph (and reading the stream needs a device).
        cupy = sys.modules.get("cupy")
        if cupy is None or not is_cupy_array(args[0] if args else kwargs.get("x")):
            return public(*args, **kwargs)
        stream = cupy.cuda.get_current_stream()
        if capturing(stream):
            with kept_for_caller_capture():
                return public(*args, **kwargs)
        if not _config["replay"] or _inside.get() or _suspended.get():
            return public(*args, **kwargs)
        out = kwargs.get("out")
        if out is None:
            return _call_without_out(public, args, kwargs, stream, cupy)
        if not is_cupy_array(out):
            return public(*args, **kwargs)
        key = _raw_key(public, args, kwargs, stream, cupy)
        if key is None:
            return public(*args, **kwargs)
        graph_key = _shortcuts.get(key)
        if graph_key is not None and launch_cached(graph_key, stream):
            return out
        result, launched = _checked_call(public, args, kwargs, key)
        graph_key = _graph_to_remember(launched, key, args, kwargs)
        if graph_key is not None and result is out:
            if len(_shortcuts) >= _MAX_SHORTCUTS:
                _shortcuts.clear()
            _shortcuts[key] = graph_key
        return result

    _public_functions.add(call)
    return call


def is_public_function(function: Any) -> bool:
    """Whether ``function`` is one of cufused's public functions on arrays (the building
    blocks and the pipelines: the functions that :func:`warm_calls` returned)."""
    try:
        return function in _public_functions
    except TypeError:  # unhashable
        return False


def _call_without_out(public: Callable, args: tuple, kwargs: dict, stream, cupy):
    """A public call without ``out`` of a CuPy input on ``stream``: where its raw arguments
    equal those of a checked call whose graph wrote the result, the result is allocated as
    that call allocated it, and the graph cached for that buffer (if any) launches without
    the checks (:func:`warm_calls`)."""
    if not args or type(args[0]) is not cupy.ndarray:
        return public(*args, **kwargs)
    key = _raw_key(public, args, kwargs, stream, cupy)
    if key is None:
        return public(*args, **kwargs)
    fresh = _fresh_shortcuts.get(key)
    if fresh is not None:
        shape, dtype, head, tail, buffers = fresh
        out = cupy.empty(shape, dtype)
        if launch_with_result(head, _value_key(out), tail, stream):
            return out
        del out  # back to the pool, where the checked call's allocation finds it
        if len(buffers) >= _MAX_FRESH_BUFFERS:
            with without_call_graphs():
                return public(*args, **kwargs)
    result, launched = _checked_call(public, args, kwargs, key)
    if not is_cupy_array(result):
        return result
    graph_key = _graph_to_remember(launched, key, (*args, result), kwargs)
    if graph_key is None:
        return result
    head, written, tail = split_at_result(graph_key)
    # The graph wrote the result, allocated by the call as the launch above allocates it.
    if written == _value_key(result):
        if len(_fresh_shortcuts) >= _MAX_SHORTCUTS:
            _fresh_shortcuts.clear()
        current = _fresh_shortcuts.get(key)  # not the entry read before a clear_caches()
        buffers = current[4] if current is not None else set()
        buffers.add(result.data.ptr)
        _fresh_shortcuts[key] = (result.shape, result.dtype, head, tail, buffers)
    return result


def _graph_to_remember(launched: list, key: tuple, arrays: tuple, kwargs: dict):
    """The key of the one graph that a checked call with raw-argument ``key`` launched, where
    it was captured under the key's settings (another thread may have changed them meanwhile)
    and read only ``arrays`` and ``kwargs``' arrays (views included); else None."""
    if len(launched) == 1 and launched[0][-1] == key[-2] and _reads_only(launched[0], arrays,
                                                                         kwargs):
        return launched[0]
    return None


def _checked_call(public: Callable, args: tuple, kwargs: dict, key: tuple):
    """``public``'s checked call under the default precision of its raw-argument ``key``
    (another thread may change the process default meanwhile), and the keys of the graphs it
    launched."""
    with scoped_value(_launched, []) as launched, default_precision(key[-1]):
        result = public(*args, **kwargs)
    return result, launched


def value_key_function(array_type: type, array_part: Callable,
                       subclasses: bool) -> Callable:
    """The function giving the part of a raw-argument key for one value: an array of
    ``array_type`` (or of a subclass, where ``subclasses``) is ``array_part(value)``; a number,
    string or None is its type and value (a float its bits); a list or tuple is its type and
    its items' keys (plain ints as they are); any other value raises ``TypeError``."""
    def value_key(value):
        kind = type(value)
        if kind is array_type:
            return array_part(value)
        if kind is float:
            return (kind, _float_bits(value))
        if kind in _SCALARS:
            return (kind, value)
        if kind is tuple or kind is list:
            items = tuple(value)
            if _INTS.issuperset(map(type, items)):  # the common shape or stride list
                return (kind, items)
            return (kind, tuple(map(value_key, items)))
        if subclasses and issubclass(kind, array_type):
            return array_part(value)
        raise TypeError
    return value_key


@functools.cache
def _cupy_value_key(cupy) -> Callable:
    return value_key_function(
        cupy.ndarray,
        lambda a: (a.data.ptr, a.data.device_id, a.shape, a.strides, a.dtype.char), False)


def _raw_key(public: Callable, args: tuple, kwargs: dict, stream, cupy):
    """The key of a public call's raw arguments and everything else its checks and path read
    (device, stream, and last the settings and the default precision), or None for a value
    it cannot key."""
    value_key = _cupy_value_key(cupy)
    try:
        return (public, tuple(map(value_key, args)), tuple(kwargs),
                tuple(map(value_key, kwargs.values())), cupy.cuda.runtime.getDevice(),
                stream_key(stream), tuple(_config.values()), resolve_precision(None))
    except TypeError:
        return None


def settings_key() -> tuple | None:
    """What a raw-argument key holds besides the arguments, device and stream: the settings
    and the default precision; None where calls are not launched from their raw arguments
    (graph replay off, inside a cufused call, or in :func:`without_call_graphs`)."""
    if not _config["replay"] or _inside.get() or _suspended.get():
        return None
    return tuple(_config.values()), resolve_precision(None)


def array_key(ptr: int, shape: tuple, strides: tuple, char: str) -> tuple:
    """The part of a graph's key for an array (address, shape, byte strides, dtype char)."""
    return ("array", ptr, shape, strides, char)


def shortcut_graph(public: Callable, args: tuple, kwargs: dict, stream) -> tuple | None:
    """The key of the graph that a call of ``public`` (a function that :func:`warm_calls`
    returned) with these raw arguments, ``out`` among them, launches without its checks, or
    None where it has none yet."""
    key = _raw_key(public.__wrapped__, args, kwargs, stream, sys.modules["cupy"])
    return None if key is None else _shortcuts.get(key)


def launch_cached(graph_key: tuple, stream) -> bool:
    """Launch the cached graph of ``graph_key`` on ``stream``; False where none is cached."""
    with _lock:  # launched under it: see _launch_recorded
        entry = _graphs.get(graph_key)
        if entry is None:
            return False
        _graphs.move_to_end(graph_key)
        _launch(entry, stream)
    return True


def _reads_only(graph_key: tuple, args: tuple, kwargs: dict) -> bool:
    """Whether every array that the graph of ``graph_key`` was bound to starts inside one of
    the caller's CuPy arrays (a view of it), and so is no temporary of the checked call that a
    launch from the raw arguments would not recreate."""
    spans = []

    def caller_arrays(value):
        if is_cupy_array(value):
            spans.append(_byte_span(value))
        elif isinstance(value, (tuple, list)):
            for v in value:
                caller_arrays(v)

    caller_arrays(args)
    caller_arrays(tuple(kwargs.values()))

    def inside(part) -> bool:
        if not isinstance(part, tuple):
            return True
        if part and part[0] == "array":
            ptr, shape = part[1], part[2]
            return 0 in shape or any(low <= ptr < high for low, high in spans)
        return all(inside(p) for p in part)

    return inside(graph_key[1]) and inside(graph_key[2]) and inside(graph_key[3])


def _evict(budget: float, device: int) -> list:
    """Remove the least recently used graphs beyond ``MAX_GRAPHS``, and those of ``device``
    beyond its memory ``budget`` (under ``_lock``); return them for ``_release``. Their keys
    run directly from then on: calls cycling over more keys than the cache holds would
    otherwise capture a graph, and wait for the device to drop another, at every call."""
    dropped = []
    while len(_graphs) > MAX_GRAPHS:
        key, graph = _graphs.popitem(last=False)
        _run_directly(key)
        dropped.append(graph)
    held = [(k, g) for k, g in _graphs.items() if g.device == device]
    total = sum(g.nbytes for _, g in held)
    for k, g in held[:-1]:  # oldest first; the newest stays
        if total <= budget:
            break
        dropped.append(_graphs.pop(k))
        _run_directly(k)
        total -= g.nbytes
    return dropped


def _run_directly(key: tuple) -> None:
    """Let ``key``'s calls run directly from now on (under ``_lock``)."""
    _direct_keys[key] = True
    if len(_direct_keys) > _MAX_COUNTED:
        _direct_keys.popitem(last=False)


def _direct(gpu: functools.partial, out):
    with scoped_value(_inside, True):
        return gpu(out)


def _capture(gpu: functools.partial, out, cupy) -> _Graph | None:
    """The call captured (not run) as a cache entry, or None where it is not to be kept."""
    captured = capture_call(functools.partial(gpu, out),
                            limit=MAX_TEMPORARY_FRACTION * _memory_limit(cupy))
    if captured is None:
        return None
    if captured.result is not out:  # its memory goes as a release's (capture_call)
        held = [captured]
        del captured
        release_after_devices((), held)
        return None
    return _Graph(captured.graph, cupy.cuda.runtime.getDevice(), captured.nbytes,
                  (captured.keep, captured.stream))


def clear_caches() -> None:
    """Forget every cached plan and whole-call graph, freeing the memory they keep.

    cufused caches, per device, the cuDNN plan of each convolution problem it has run (with
    the CUDA graphs of warm convolution calls), the engine the autotuner measured fastest for
    each tensor-core problem, and the CUDA graphs of up to 8 warm pipeline or building-block
    calls across all devices, each with its temporaries (fewer where those pass a quarter of
    a device's memory). The plans and engines grow by one per new problem (a new batch size
    is one), as PyTorch's cuDNN benchmark cache does, and stay until this call: a process that
    meets many shapes may call it now and then. All are rebuilt, or measured again, on next
    use. It also
    frees the buffers and plans of the calls recorded into the caller's own CUDA-graph
    captures, which nothing else frees (each such call keeps its temporaries and result):
    those graphs must not be launched afterwards.

    Examples
    --------
    >>> import cufused
    >>> cufused.clear_caches()
    """
    # The captures first: the plans they hold then go with the cache, and their graphs'
    # buffers back to the device.
    release_caller_captures()
    clear_plan_cache()  # calls _clear (registered below)


def _clear() -> None:
    """Forget every whole-call graph (also when only the plan cache is cleared: the graphs
    keep the plans they ran)."""
    with _lock:
        dropped = list(_graphs.values())
        _graphs.clear()
        _direct_keys.clear()
        _counts.clear()
        _shortcuts.clear()
        _fresh_shortcuts.clear()
    _release(dropped)


on_clear_plan_cache(_clear)
