"""A convolution plan (:class:`ConvPlan`): a problem's chosen strategy, its cuDNN plans, how
it is fed in its layouts, and the CUDA graphs that replay its warm calls."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy

from .._arrays import _memory_limit, import_cupy
from .._cuda import capturing, own_capture_scope, release_after_devices, stream_key
from .._kernels.layout import add_channel_bias, interleave_classes, transpose_channels
from .._layout import empty_in_layout, stored_in
from .._scoped import scoped_value
from .._settings import _config
from ._config import cudnn_handle
from ._graphs import ConvProblem, Strategy, _aligned, _Part
from .._timing import random_operand

# CUDA graphs kept per plan (one per operand pointers and stream), and how many calls with the
# same operands come before one is captured (a one-off call is not worth a capture).
_MAX_REPLAYS = 8
_CALLS_BEFORE_CAPTURE = 2
_REPLAYS_LOCK = threading.Lock()  # a plan's graphs are evicted and added under it
#: The plans' graphs of one device keep at most this fraction of its memory in buffers
#: (workspace, prepared weight, converted input and output): a new graph first drops the
#: oldest graphs of any plan until its buffers fit, and one whose buffers alone pass it is
#: not captured (its calls run directly, as a call whose buffers do not fit in memory does).
KEPT_FRACTION = 1 / 8
# The kept graphs in capture order: (id(plan), key) -> (a weak reference to the plan,
# bytes). Weak: a plan that nothing else holds (an autotuner's candidate that lost) goes,
# with its graphs, as it did before the budget; its entries then leave at the next capture.
_kept: OrderedDict[tuple, tuple[weakref.ref, int]] = OrderedDict()
_kept_bytes: dict[int, int] = {}  # device -> bytes that its plans' graphs keep
# The count that marks a key whose calls run directly (past the budget): no call reaches a
# capture from it (until a plan's counts are cleared, after 8 * _MAX_REPLAYS keys).
_NEVER = -(2**62)


def operand_key(a) -> tuple:
    """What a captured graph depends on in an operand: its address, shape, strides and dtype
    (one buffer is routinely handed out again holding another layout or shape)."""
    return a.data.ptr, a.shape, a.strides, a.dtype.char


# The plans that run while a caller records them (plans_in_use): a CUDA graph captured from a
# call reads memory that its plans own (the sub-pixel weight index, cuDNN's engines), so its
# owner keeps them alive.
_plans_in_use: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "cufused_plans_in_use", default=None)


# The autotuner's timing of a plan's replayed and direct calls, in this thread only (None:
# set_conv_graph_replay's process-wide setting).
_timed_replay: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "cufused_timed_replay", default=None)


def timed_replay(enabled: bool):
    """Within the block, this thread's plans replay graphs (``enabled``) or run directly,
    whatever the process-wide setting: the autotuner times both ways without changing what
    other threads run."""
    return scoped_value(_timed_replay, enabled)


@contextlib.contextmanager
def plans_in_use():
    """Collect, in the list this yields, every plan that runs inside the block."""
    with scoped_value(_plans_in_use, []) as users:
        yield users


@functools.cache
def _graph_buffer_pool():
    """The memory pool of the buffers that captured plan graphs keep."""
    return import_cupy().cuda.MemoryPool()


_graph_buffer_devices: set[int] = set()  # the devices where that pool has allocated


def free_graph_buffers() -> None:
    """Return to each device the pool's blocks that no graph holds any more (a CuPy pool
    frees its current device's blocks only)."""
    if not _graph_buffer_devices:
        return
    cupy = import_cupy()
    for device in sorted(_graph_buffer_devices):
        with cupy.cuda.Device(device):
            _graph_buffer_pool().free_all_blocks()


def release_graph_buffers() -> None:
    """:func:`free_graph_buffers` as a release does it (``release_after_devices``): not
    during a capture, whose cudaFree would break it."""
    release_after_devices((), [], then=free_graph_buffers)


def _drop_kept(plan_id: int, key: tuple):
    """Remove the graph of ``key`` from the budget and from its plan's table, where the plan
    lives (under ``_REPLAYS_LOCK``); return the graph, to be released after the lock."""
    entry = _kept.pop((plan_id, key), None)
    if entry is None:
        return None
    _kept_bytes[key[1]] -= entry[1]
    plan = entry[0]()
    replays = None if plan is None else plan._replays
    return None if replays is None else replays.pop(key, None)


def _drop_graphs(plan_id: int, replays: dict, keys) -> list:
    """Remove the graphs of ``keys`` from a plan's table and from the budget (under
    ``_REPLAYS_LOCK``); return them, to be released after the lock."""
    return [graph for key in keys
            for graph in (_drop_kept(plan_id, key), replays.pop(key, None))]


def _drop_dead() -> None:
    """Remove from the budget the graphs of plans that are gone (under ``_REPLAYS_LOCK``)."""
    for plan_id, key in [k for k, (ref, _) in _kept.items() if ref() is None]:
        _drop_kept(plan_id, key)


def forget_kept() -> None:
    """Empty the budget's record (the plan cache is cleared: its graphs go with the plans)."""
    with _REPLAYS_LOCK:
        _kept.clear()
        _kept_bytes.clear()


def _launch_graph(graph, stream, buffers) -> None:
    """Launch a captured plan on ``stream``; ``buffers`` (its workspace, prepared weight and
    intermediates) are only held here, so that they live as long as the graph that uses them."""
    graph.launch(stream=stream)


@dataclass
class ConvPlan:
    """A problem's chosen strategy: its cuDNN graphs and plans, and how to feed them."""

    problem: ConvProblem
    strategy: Strategy
    parts: list[_Part]
    y_shape: tuple[int, ...]  # the output as written: the problem's, or (P, N, C, *M) classes
    weight_index: Any  # CuPy gather index of the sub-kernels (subpixel), else None
    workspace_size: int
    milliseconds: float = float("nan")  # the convolution alone (strategy timing)
    cost: float = float("nan")  # with the caller's layout conversions
    candidates: dict = field(default_factory=dict)  # strategy label -> (ms, cost)
    # CUDA graphs of warm calls (see run): operand key -> launcher; None where calls run
    # directly (a failed capture, or the autotuner's choice: see _decide_replay)
    _replays: dict | None = field(default_factory=dict, repr=False)
    _calls: dict = field(default_factory=dict, repr=False)  # calls per key not yet captured

    @property
    def x_layout(self) -> str:
        return self.strategy.x_layout

    @property
    def replays(self) -> bool:
        """Whether warm calls replay a captured CUDA graph; False where they go to cuDNN
        directly (the autotuner measured that faster, see ``_decide_replay``)."""
        return self._replays is not None

    @property
    def spreads_nonfinite(self) -> bool:
        """Whether a part runs an FFT or Winograd plan, which spreads a non-finite input past
        the outputs its products reach (``spreads_nonfinite`` of ``_graphs``)."""
        return any(part.spreads_nonfinite for part in self.parts)

    @property
    def layout(self) -> str:
        """The layout of the output as written: "nchw", "nhwc" or "classes"."""
        return self.strategy.y_layout

    def example_operands(self):
        """``(x, w, y)`` for :meth:`run` (timings): random inputs, an empty output."""
        return (random_operand(self.problem.x_shape, self.x_layout),
                random_operand(self.problem.w_shape),
                self.empty_output())

    def empty_output(self):
        """An uninitialized output buffer in the plan's output layout."""
        if self.layout == "classes":
            return import_cupy().empty(self.y_shape, dtype=numpy.float32)
        return empty_in_layout(self.y_shape, self.layout)

    def run(self, x, w, y, bias=None) -> None:
        """Run on ``x`` in ``x_layout``, the PyTorch-layout weight ``w`` and ``y`` from
        :meth:`empty_output` (or a contiguous NCHW array for an "nchw" plan); ``bias`` is used
        only by a plan that has it inside its graph. Raw pointers, CuPy's current stream.

        From the second call with the same operand pointers on a stream, the call replays a
        CUDA graph of the whole plan (the weight preparation and every cuDNN execution): one
        launch instead of the host work of each part, which for FFT and sub-pixel plans is
        many graph launches' worth; unless the autotuner chose direct calls (see
        ``_decide_replay``). The graph keeps its own workspace and prepared weight.
        """
        x, w, bias = self._operands(x, w, bias)

        def work(buffers):
            self._execute(x, w, y, bias, *buffers)

        self._launch("run", (x, w, y, bias), lambda: self._buffers(w), work)

    def _operands(self, x, w, bias):
        """16-byte aligned operands; ``w`` contiguous unless already stored in ``x_layout``."""
        if self.weight_index is not None or not stored_in(w, self.x_layout):
            w = import_cupy().ascontiguousarray(w)
        return _aligned(x), _aligned(w), _aligned(bias)

    def _buffers(self, w):
        """(where the prepared weight goes, or None where the graphs read ``w`` itself;
        the workspace, or None). ``w`` comes from :meth:`_operands`: in ``x_layout``, or
        C-contiguous, which for an NCHW plan is its layout in memory (the contiguity flags
        pass a unit axis of any stride, which ``stored_in`` does not)."""
        cupy = import_cupy()
        if self.weight_index is not None:  # the gathered sub-kernels (subpixel)
            w_buffer = cupy.empty(self.weight_index.shape, dtype=numpy.float32)
        elif self.x_layout == "nchw" or stored_in(w, self.x_layout):
            w_buffer = None
        else:
            w_buffer = empty_in_layout(w.shape, self.x_layout)
        workspace = (cupy.empty(self.workspace_size, dtype=cupy.uint8)
                     if self.workspace_size else None)
        return w_buffer, workspace

    def _execute(self, x, w, y, bias, w_buffer, workspace) -> None:
        """Prepare the weight ``w`` (see :meth:`_operands`) into ``w_buffer`` and run every
        part."""
        if self.weight_index is not None:
            import_cupy().take(w.ravel(), self.weight_index, out=w_buffer)
        elif w_buffer is not None:
            transpose_channels(w, w_buffer, to_channels_last=True)
        w = w if w_buffer is None else w_buffer
        # Raw pointers: an array would take the DLPack route, whose stream synchronization
        # breaks CUDA-graph capture.
        ws_ptr = 0 if workspace is None else workspace.data.ptr
        b_ptr = 0 if bias is None else bias.data.ptr
        with cudnn_handle() as handle:
            for part in self.parts:
                part.execute(x.data.ptr, w.data.ptr, y.data.ptr, b_ptr, ws_ptr, handle)

    def _launch(self, kind: str, operands, buffers, work) -> None:
        """``work(buffers())`` on the current stream, or the replay of its CUDA graph: the
        graph for (``kind``, the device, the stream, each operand's address, shape, strides
        and dtype) once these have been seen before, captured with buffers of its own that it
        keeps (``buffers`` allocates them; ``work`` must not allocate)."""
        users = _plans_in_use.get()
        if users is not None:
            users.append(self)
        replay = self._replay(kind, operands, buffers, work)
        if replay is not None:
            replay()
        else:
            work(buffers())

    def drop_replays(self, *, keep_replaying: bool = True) -> None:
        """Drop this plan's graphs (from the budget too); without ``keep_replaying`` its calls
        run directly from then on."""
        with _REPLAYS_LOCK:
            replays = self._replays
            dropped = [] if replays is None else _drop_graphs(id(self), replays, list(replays))
            if not keep_replaying:
                self._replays = None
        del dropped  # released after the lock: a graph's destruction takes time

    def _replay(self, kind, operands, buffers, work):
        """The graph launcher for ``_launch``: cached, captured now (on the second call with
        these operands), or None (replay off, a capture in progress, a failed capture)."""
        replays = self._replays  # another thread's failed capture may set it to None
        enabled = _timed_replay.get()
        if not (_config["replay"] if enabled is None else enabled) or replays is None:
            return None
        cupy = import_cupy()
        stream = cupy.cuda.get_current_stream()
        if capturing(stream):  # the caller's capture records the cuDNN calls
            return None
        key = (kind, cupy.cuda.runtime.getDevice(), stream_key(stream),
               *(None if a is None else operand_key(a) for a in operands))
        replay = replays.get(key)
        if replay is not None:
            return replay
        calls = self._calls.get(key, 0) + 1
        if calls < _CALLS_BEFORE_CAPTURE:
            if len(self._calls) >= 8 * _MAX_REPLAYS:
                self._calls.clear()
            self._calls[key] = calls
            return None
        self._calls.pop(key, None)
        # Allocated on the caller's stream, outside the capture, from a pool of their own:
        # buffers that outlive the call would shift the addresses that the default pool hands
        # out to later calls' temporaries, and new addresses mean new keys and more captures.
        pool = _graph_buffer_pool()
        _graph_buffer_devices.add(key[1])
        try:
            with cupy.cuda.using_allocator(pool.malloc):
                kept = buffers()
        except cupy.cuda.memory.OutOfMemoryError:
            # The direct call takes its buffers from the default pool, which may hold them;
            # what this pool took before the failure goes back to the device.
            self._calls[key] = _NEVER
            release_graph_buffers()
            return None
        nbytes = sum(b.nbytes for b in kept if b is not None)
        limit = KEPT_FRACTION * _memory_limit(cupy)
        if nbytes > limit:
            self._calls[key] = _NEVER
            del kept
            release_graph_buffers()
            return None
        side = cupy.cuda.Stream(non_blocking=True)
        try:
            with own_capture_scope(), side:
                side.begin_capture()
                try:
                    work(kept)
                finally:
                    graph = side.end_capture()
        except Exception:  # noqa: BLE001 - an engine that cannot be captured runs directly
            self.drop_replays(keep_replaying=False)
            return None
        replay = functools.partial(_launch_graph, graph, stream, kept)
        evicted = []  # released after the lock: a graph's destruction takes time
        with _REPLAYS_LOCK:  # threads capturing at once must not evict the same graph
            if self._replays is not replays:  # dropped meanwhile: this graph runs once
                return replay
            _drop_dead()
            evicted += _drop_graphs(id(self), replays, [key])  # another thread's capture
            if len(replays) >= _MAX_REPLAYS:
                evicted += _drop_graphs(id(self), replays, [next(iter(replays))])  # oldest
            device = key[1]
            for plan_id, kept_key in [k for k in _kept if k[1][1] == device]:  # oldest first
                if _kept_bytes.get(device, 0) + nbytes <= limit:
                    break
                evicted.append(_drop_kept(plan_id, kept_key))
            replays[key] = replay
            _kept[id(self), key] = (weakref.ref(self), nbytes)
            _kept_bytes[device] = _kept_bytes.get(device, 0) + nbytes
        del evicted
        return replay

    def apply(self, x, w, *, bias=None, out=None, convert_output: bool = True):
        """The convolution of NCHW (or ``x_layout``) ``x``; returns ``(y, layout)``.

        With ``convert_output`` the result is contiguous NCHW (``out`` if given) plus
        ``bias``; without it ``y`` is in the plan's output layout (for "nchw", ``out`` if given)
        and ``bias`` must be None. Warm calls replay one graph (see :meth:`run`) that also
        holds the input's conversion to ``x_layout``, the output's conversion back and the
        bias; it keeps the converted input and the intermediate output.
        """
        cupy = import_cupy()
        layout = self.layout
        in_graph = self.strategy.bias_in_graph
        if bias is not None and not (convert_output or in_graph):
            raise ValueError("a bias needs convert_output=True, or a plan with it in its graph")
        convert_x = self.x_layout != "nchw" and not stored_in(x, self.x_layout)
        if convert_x or self.x_layout == "nchw":
            x = cupy.ascontiguousarray(x)
        convert_y = layout != "nchw" and convert_output
        direct_out = layout == "nchw" and out is not None and out.data.ptr % 16 == 0
        if convert_y:
            result = out if out is not None else cupy.empty(self.problem.y_shape,
                                                             dtype=cupy.float32)
        else:
            result = out if direct_out else self.empty_output()
        add_bias = bias is not None and not in_graph and convert_output and layout == "nchw"
        x, w, run_bias = self._operands(x, w, bias if in_graph else None)

        def buffers():
            return (*self._buffers(w),
                    empty_in_layout(x.shape, self.x_layout) if convert_x else None,
                    self.empty_output() if convert_y else None)

        def work(buffers):
            w_buffer, workspace, x_buffer, y_buffer = buffers
            if x_buffer is not None:
                transpose_channels(x, x_buffer, to_channels_last=True)
            y = result if y_buffer is None else y_buffer
            self._execute(x if x_buffer is None else x_buffer, w, y, run_bias, w_buffer,
                          workspace)
            if layout == "nhwc" and convert_y:  # the bias rides along with the transpose back
                transpose_channels(y, result, to_channels_last=False, bias=bias)
            elif convert_y:
                interleave_classes(y, result, bias)
            elif add_bias:
                add_channel_bias(y, bias)

        # run_bias is the aligned copy of a misaligned bias, made outside the graph: its
        # address is keyed beside the caller's bias, which the conversion passes read.
        self._launch(("apply", convert_output), (x, w, bias, run_bias, result), buffers, work)
        if out is not None and result is not out and layout == "nchw":
            out[...] = result  # a misaligned out
            result = out
        return result, "nchw" if convert_y else layout
