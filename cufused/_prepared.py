"""Prepared calls: one call of a cufused function captured into a CUDA graph, bound to its
buffers, replayed at the host cost of one graph launch (:func:`prepare`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

from ._arrays import import_cupy, is_cupy_array, other_device
from ._call_graphs import is_public_function
from ._capture import capture_call
from ._cuda import capturing, release_after_devices
from ._precision import get_default_precision


class PreparedCall:
    """A call of a cufused function bound to its arguments; see :func:`prepare`.

    Attributes
    ----------
    function : callable
        The cufused function.
    args, kwargs : tuple, dict
        The arguments it is bound to (kept alive by this object).
    result : array or None
        The array every replay returns (``out`` when it was given); None where each call
        runs the function and returns its new result (NumPy arrays, or a call that could not
        be captured).
    """

    def __init__(self, function: Callable, args: tuple, kwargs: dict, graph=None,
                 result=None, device: int | None = None, keep=()):
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.result = result
        self._graph = graph
        self._device = device
        # What the graph reads or writes but does not own: its temporaries and the plans
        # (with their memory) that ran in the capture, and the capture's stream.
        self._keep = keep

    def __call__(self) -> Any:
        """Run the bound call again (on the current stream) and return its result.

        Every replay writes the same result and temporaries, so replays on streams that are
        not ordered with each other (two threads' streams, say) must not overlap, as with a
        ``torch.cuda.CUDAGraph``'s replays: order them with an event, or prepare one call
        per stream."""
        if self._graph is None:
            return self.function(*self.args, **self.kwargs)
        cupy = import_cupy()
        if cupy.cuda.runtime.getDevice() == self._device:
            self._graph.launch()  # on the current stream
        else:
            with cupy.cuda.Device(self._device):
                self._graph.launch()
        return self.result

    def __del__(self):
        # A replay may still run: what its graph reads or writes (the bound arrays, a plan's
        # weight index from CuPy's pool) could otherwise go back to a pool on another stream.
        if getattr(self, "_graph", None) is not None:
            # The release holds them alone, so that they go where it drops them.
            held = [self._graph, self._keep, self.args, self.kwargs, self.result]
            self._graph = self._keep = self.args = self.kwargs = self.result = None
            with contextlib.suppress(Exception):  # at interpreter exit CuPy may be gone
                cupy = import_cupy()
                with cupy.cuda.Device(self._device):
                    stream = cupy.cuda.get_current_stream()  # may be under capture
                release_after_devices([self._device], held, stream=stream)

    def __repr__(self) -> str:
        kind = "CUDA graph" if self._graph is not None else "a call each time"
        return f"<PreparedCall of cufused.{self.function.__name__} ({kind})>"


def prepare(function: Callable, *args: Any, **kwargs: Any) -> PreparedCall:
    """Prepare a call for a loop: run it once, capture it into a CUDA graph, and return a
    callable that replays the graph.

    Every call of the returned ``PreparedCall`` runs the same work on the same buffers
    as ``function(*args, **kwargs)`` and gives the same result, at the host cost of one
    CUDA-graph launch instead of the argument checks, plan lookups and kernel launches of a
    functional call (the way ``torch.cuda.graphs`` or cuFFT plans serve a loop). A call that
    replays a graph returns the same array every time: ``out`` when given, else an array that
    the prepared call owns and overwrites on each call (copy it to keep a result). A call
    prepared without a graph (see below) returns what ``function`` returns each time: ``out``
    when given, else a new array; pass ``out`` for one fixed buffer either way.

    The graph reads the bound arrays where they are: to run on new data, copy it into them
    (``x[...] = new_x``, as with the static inputs of ``torch.cuda.graphs``), or prepare a
    new call for other arrays. A parameter given as a Python number is fixed at its value,
    and so is the precision: ``precision=None`` (or none given) means the default precision
    in force when ``prepare`` is called, also for a call prepared without a graph.
    ``prepare`` itself runs the call once (it checks the arguments and builds the plans and
    kernels the graph reuses): that call writes ``out`` and, in pipeline B, updates the
    running buffers, as every later call does. The graph keeps its temporaries (the
    convolution output included) for as long as the prepared call lives, so replays on
    streams not ordered with each other must not overlap (one prepared call per stream). A
    call that cannot be captured (a cuDNN engine that refuses graph capture), or whose
    convolution the autotuner measured faster issued directly than replayed, is prepared
    without a graph: each call then runs the function, as a call on NumPy arrays does.

    Parameters
    ----------
    function : callable
        A cufused function on arrays: a pipeline or a building block
        (e.g. :func:`cufused.conv2d_groupnorm_scale_maxpool_clamp`).
    *args, **kwargs
        Its arguments, as for calling it.

    Returns
    -------
    PreparedCall
        Call it without arguments. With NumPy arrays it calls ``function`` each time (no
        graph: the float64 reference path).

    Raises
    ------
    TypeError
        ``function`` is not one of cufused's functions on arrays, or the call's own
        ``TypeError``.
    ValueError
        The call's own ``ValueError`` (the arguments are checked by running it once).
    RuntimeError
        The current stream is being captured into a CUDA graph (prepare the call before).

    Examples
    --------
    >>> import numpy as np, cufused
    >>> x = np.ones((1, 1, 4, 4), dtype=np.float32)
    >>> w = np.ones((1, 1, 3, 3), dtype=np.float32)
    >>> step = cufused.prepare(cufused.conv2d, x, w)
    >>> step()
    array([[[[9., 9.],
             [9., 9.]]]], dtype=float32)
    """
    if not is_public_function(function):
        raise TypeError(f"function must be one of cufused's functions on arrays (a pipeline or "
                        f"a building block), got {function!r}")
    if ("precision" in inspect.signature(function).parameters
            and kwargs.get("precision") is None):
        kwargs = {**kwargs, "precision": get_default_precision()}
    if (any(map(is_cupy_array, (*args, *kwargs.values())))
            and capturing(import_cupy().cuda.get_current_stream())):
        # Its first call would be recorded into that capture, and its wait for the call then
        # break the capture.
        raise RuntimeError("prepare() cannot run while the current stream is being captured "
                           "into a CUDA graph: prepare the call before the capture")
    device = other_device(args, kwargs)
    if device is not None:  # the call, its capture and its replays on the array's device
        with import_cupy().cuda.Device(device):
            return prepare(function, *args, **kwargs)
    # The first call checks the arguments and, on the GPU, builds what the capture reuses:
    # compiled kernels, cuDNN plans.
    first = function(*args, **kwargs)
    if not is_cupy_array(first):
        return PreparedCall(function, args, kwargs)
    cupy = import_cupy()
    cupy.cuda.get_current_stream().synchronize()
    captured = capture_call(functools.partial(function, *args, **kwargs))
    if captured is None:
        return PreparedCall(function, args, kwargs)
    captured.graph.upload(stream=captured.stream)
    captured.stream.synchronize()
    return PreparedCall(function, args, kwargs, captured.graph, captured.result,
                        cupy.cuda.runtime.getDevice(), (captured.keep, captured.stream))
