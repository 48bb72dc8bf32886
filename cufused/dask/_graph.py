"""The task graph of one call over the batch chunks of ``x``: the input checks, ``_Graph``
(a dict of tasks under keys unique to the call), the per-sample case ``_map_chunks`` and the
per-device lock that GPU tasks take (package docstring)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import uuid
from collections.abc import Callable
from typing import Any

import dask.array as da
import numpy
from dask.base import is_dask_collection
from dask.highlevelgraph import HighLevelGraph

from .._arrays import get_array_module, import_cupy, is_cupy_array
from .._call_graphs import without_call_graphs
from .._ops.normalization import part_of_batch
from .._precision import resolve_precision

Array = da.Array


def _empty_batch(x: Any, func: str, params: dict[str, Any] | None = None):
    """Check ``x``: a dask array chunked along axis 0 only, of NumPy or CuPy chunks with known
    sizes. Return an empty batch ``(0, *x.shape[1:])`` of its chunk type, on which the single
    call checks the arguments and yields the result's shape and dtype without computing: on
    the device of the first CuPy array of ``params`` (where the single call needs the chunks),
    else on the meta's (the data's, for ``from_array(..., asarray=False)``)."""
    if not isinstance(x, da.Array):
        raise TypeError(
            f"x must be a dask.array.Array, got {type(x).__name__}: call cufused.{func} for a "
            "NumPy or CuPy array, or wrap it with dask.array.from_array(x, chunks={0: batch})")
    if x.ndim == 0:
        raise ValueError("x must have a batch axis (ndim >= 1), got a 0-d dask array")
    if any(math.isnan(s) for s in x.shape):
        raise ValueError(f"x has unknown chunk sizes (shape {x.shape}): call "
                         "x.compute_chunk_sizes() first")
    split = [axis for axis in range(1, x.ndim) if len(x.chunks[axis]) > 1]
    if split:
        spec = ", ".join(f"{axis}: -1" for axis in range(1, x.ndim))
        raise ValueError(
            f"x must be chunked along the batch axis (0) only, but axes {split} hold "
            f"{[len(x.chunks[a]) for a in split]} chunks: rechunk it explicitly, "
            f"x = x.rechunk({{{spec}}})")
    meta = x._meta
    if meta is None:  # dask's query planning where it could not infer the chunk type
        meta = numpy.empty((0,) * x.ndim, dtype=x.dtype)
    if not (isinstance(meta, numpy.ndarray) or is_cupy_array(meta)):
        raise TypeError(f"x has chunks of type {type(meta).__module__}.{type(meta).__name__}; "
                        "cufused.dask runs NumPy or CuPy chunks")
    xp = get_array_module(x=meta)
    if xp is numpy:
        return numpy.empty((0,) + tuple(x.shape[1:]), dtype=x.dtype)
    device = _first_device((params or {}).values())
    with xp.cuda.Device(meta.device.id if device is None else device):
        return xp.empty((0,) + tuple(x.shape[1:]), dtype=x.dtype)


def _check_params(params: dict[str, Any]) -> None:
    """Parameters are arrays that every chunk reads whole, not dask collections."""
    for name, value in params.items():
        if is_dask_collection(value):
            raise TypeError(
                f"{name} is a dask collection ({type(value).__name__}): pass it as a NumPy or "
                f"CuPy array of the chunks' library ({name}.compute()); every chunk reads all "
                "of it")


def _is_array(value: Any) -> bool:
    """Whether ``value`` is a NumPy or CuPy array (a key of the graph, not a literal)."""
    return isinstance(value, numpy.ndarray) or is_cupy_array(value)


def _call_keywords(func: Callable, keywords: tuple[str, ...], options: dict[str, Any], chunk,
                   *args):
    """``func(chunk, *args, **options)``, the last ``len(keywords)`` of ``args`` passed by
    those keywords: array parameters travel as task arguments (keys of the graph), keyword-only
    ones included."""
    split = len(args) - len(keywords)
    return func(chunk, *args[:split], **options, **dict(zip(keywords, args[split:])))


# One GPU task at a time per device in this process. Dask's threaded scheduler would run
# several chunks' host work interleaved on the device's one stream: that gains no device
# concurrency and holds every chunk's temporaries at once. Each task runs without whole-call
# graphs (without_call_graphs): its result and temporaries come from the pool at addresses that
# change from run to run, so whole-call graphs keyed on them would be captured, and would drop
# others (waiting for the device), far more often than replayed.
_DEVICE_LOCKS: dict[int, threading.Lock] = {}
_DEVICE_LOCKS_GUARD = threading.Lock()


def _first_device(values) -> int | None:
    """The device of the first CuPy array among ``values`` and the tuples among them (a
    statistics task's partial moments), or None."""
    for value in values:
        if is_cupy_array(value):
            return value.device.id
        if isinstance(value, tuple):
            device = _first_device(value)
            if device is not None:
                return device
    return None


def _one_at_a_time(func: Callable, *args, **kwargs):
    """``func(*args, **kwargs)`` on the device of its first CuPy argument (the chunk, or a
    statistics task's moments; the current device if none), made current (a scheduler's thread
    starts on device 0), and holding that device's lock."""
    cupy = import_cupy()
    device = _first_device(args)
    if device is None:
        device = cupy.cuda.runtime.getDevice()
    lock = _DEVICE_LOCKS.get(device)
    if lock is None:
        with _DEVICE_LOCKS_GUARD:
            lock = _DEVICE_LOCKS.setdefault(device, threading.Lock())
    with lock, without_call_graphs(), cupy.cuda.Device(device):
        return func(*args, **kwargs)


def _part_of_batch(func: Callable, n: int, *args, **kwargs):
    """``func(*args, **kwargs)`` on a part of a batch of ``n`` samples: PyTorch's rules
    across the batch count the whole batch, as the graph's probe checked them."""
    with part_of_batch(n):
        return func(*args, **kwargs)


class _Graph:
    """The task graph of one call over the batch chunks of ``x``: a dict of old-style tasks
    ``(func, arg, ...)`` whose arguments are keys of the graph, nested tasks or literals.

    Every key is named ``cufused-<label>[-<part>]-<token>``, with a random token per call
    (module docstring). Each array parameter is one key, which every task reading it names:
    Dask neither traverses nor copies it per task, and a distributed worker fetches it once.
    """

    def __init__(self, label: str, x: Array):
        self.label = label
        self.token = uuid.uuid4().hex
        self.x = x
        self.name = self.key_name()  # the result's
        self.dsk: dict = {}
        self.gpu = is_cupy_array(x._meta)

    def key_name(self, part: str = "") -> str:
        return f"cufused-{self.label}{'-' if part else ''}{part}-{self.token}"

    def task(self, func: Callable) -> Callable:
        """``func`` as a task of this graph: part of the whole batch (``_part_of_batch``)
        and, on CuPy chunks, run one at a time per device."""
        part = functools.partial(_part_of_batch, func, self.x.shape[0])
        return functools.partial(_one_at_a_time, part) if self.gpu else part

    def input_keys(self) -> list[tuple]:
        """The keys of ``x``'s chunks, in batch order (every other axis is one chunk), as
        ``x``'s graph names them: under dask's array query planning that graph is lowered,
        and its keys need not be named after ``x.name``."""
        keys = []
        for block in self.x.__dask_keys__():
            while isinstance(block, list):  # the one chunk of each further axis
                block = block[0]
            keys.append(block)
        return keys

    def constant(self, name: str, value: Any) -> Any:
        """A parameter as a task argument: its key for an array, else the value itself."""
        if not _is_array(value):
            return value
        key = self.key_name(name)
        self.dsk[key] = value
        return key

    def array(self, func: Callable, chunk_args: list[tuple], probe) -> Array:
        """The result: ``func(*chunk_args[i])`` on batch chunk ``i``, with the shape beyond the
        batch axis, dtype and chunk type of ``probe`` (the single call on an empty batch)."""
        rest = (0,) * (probe.ndim - 1)
        for i, args in enumerate(chunk_args):
            self.dsk[(self.name, i) + rest] = (self.task(func), *args)
        chunks = (self.x.chunks[0],) + tuple((s,) for s in probe.shape[1:])
        return new_array(self.name, self.dsk, self.x, chunks, probe)


def new_array(name: str, layer: dict, dependency: Array, chunks: tuple, meta: Any) -> Array:
    """The dask array of the chunk tasks ``(name, i, ...)`` in ``layer`` (with the tasks they
    read) over the collection ``dependency``, of ``chunks`` and ``meta``. Where dask's array
    query planning is on, an expression of the graph (its chunks renamed from ``name``)
    whose token is given (unique to the array, as dask identifies expressions by their
    tokens): dask would hash the graph, parameters included, for one."""
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[dependency])
    if not getattr(da, "array_expr_enabled", bool)():
        return da.Array(graph, name, chunks, meta=meta)
    from dask.array._array_expr._collection import new_collection
    from dask.array._array_expr._io import FromGraph

    keys = sorted(k for k in layer if isinstance(k, tuple) and k[0] == name)
    return new_collection(FromGraph(dict(graph), meta, chunks, keys, name,
                                    _determ_token=uuid.uuid4().hex))


@contextlib.contextmanager
def _probing(x: Array):
    """The single call's checks on ``_empty_batch``'s probe as part of ``x``'s batch
    (``part_of_batch``); an error's message names ``x``'s shape where it names the probe's."""
    probe, shape = str((0, *x.shape[1:])), str(tuple(x.shape))
    try:
        with part_of_batch(x.shape[0]):
            yield
    except (TypeError, ValueError) as err:
        if err.args and isinstance(err.args[0], str) and probe in err.args[0]:
            err.args = (err.args[0].replace(probe, shape), *err.args[1:])
        raise


def _map_chunks(func: Callable, x: Array, params: dict[str, Any], options: dict[str, Any],
                empty=None, *, ndim: int | None = None) -> Array:
    """``func(chunk, *params.values(), **options)`` on every batch chunk of ``x``; ``x``
    of ``ndim`` dimensions where given (a single call that also takes an input without its
    batch axis, which a dask array here always has)."""
    if ndim is not None and isinstance(x, da.Array) and x.ndim != ndim:
        raise ValueError(f"x must have {ndim} dimensions, its batch axis first, got shape "
                         f"{x.shape}")
    if empty is None:
        empty = _empty_batch(x, func.__name__, {**params, **options})
    _check_params({**params, **options})
    with _probing(x):  # checks everything, computes nothing
        probe = func(empty, *params.values(), **options)
    graph = _Graph(func.__name__, x)
    keyed = {k: v for k, v in options.items() if _is_array(v)}
    task = functools.partial(_call_keywords, func, tuple(keyed),
                             {k: v for k, v in options.items() if k not in keyed})
    args = [graph.constant(k, v) for k, v in (*params.items(), *keyed.items())]
    return graph.array(task, [(key, *args) for key in graph.input_keys()], probe)



def _each_chunk(single: Callable, doc: str | None = None, *, ndim: int | None = None
                ) -> Callable:
    """``single`` over a dask batch, for a call independent per sample: every batch chunk runs
    the single call (on ``x`` of ``ndim`` dimensions where given: :func:`_map_chunks`).

    The function returned takes ``single``'s parameters but ``out`` and ``method`` (each chunk
    runs the default method); the positional parameters after ``x`` are the arrays that every
    chunk reads whole, and ``precision``, where ``single`` has it, is resolved when the graph
    is built (the caller's default, not the workers').
    """
    params = [p for name, p in inspect.signature(single).parameters.items()
              if name not in ("out", "method")]
    params[0] = params[0].replace(annotation=Array)
    signature = inspect.Signature(params, return_annotation=Array)
    arrays = [p.name for p in params[1:] if p.kind is p.POSITIONAL_OR_KEYWORD]

    def over_chunks(*args, **kwargs) -> Array:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{single.__name__}() {exc}") from None
        bound.apply_defaults()
        options = dict(bound.arguments)
        x = options.pop("x")
        if "precision" in options:
            options["precision"] = resolve_precision(options["precision"])
        return _map_chunks(single, x, {name: options.pop(name) for name in arrays}, options,
                           ndim=ndim)

    over_chunks.__signature__ = signature
    over_chunks.__name__ = over_chunks.__qualname__ = single.__name__
    over_chunks.__module__ = "cufused.dask"  # where it is public (and pickled by reference)
    over_chunks.__doc__ = doc
    return over_chunks
