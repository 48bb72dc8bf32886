"""cuDNN convolutions through cuDNN Frontend's Python API.

A forward convolution is ``conv_fprop``; a transposed convolution is ``conv_dgrad`` with the
ConvTranspose weight unchanged and the output shape set explicitly, or (the "subpixel"
method, :mod:`cufused._subpixel`) one ``conv_fprop`` per output residue class with a
rearranged weight. Each distinct problem (device, kind, shapes, parameters, precision, bias)
gets a :class:`ConvPlan`, built once: on first use every candidate :class:`Strategy` (method,
input layout, output layout, bias inside the graph or not) has its cuDNN plans timed with
CUDA events, like ``torch.backends.cudnn.benchmark``, and the fastest strategy, timed with the
layout conversions its caller would pay, is kept. The plan exposes its layouts so that the
fused kernels downstream read a channels-last or class-major output directly.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy

from ._arrays import import_cupy
from ._kernels.layout import add_channel_bias, interleave_classes, transpose_channels
from ._layout import empty_in_layout, layout_strides, stored_in
from ._subpixel import subpixel_parts, subpixel_weight_index

# (input layout, output layout) pairs tried; channels-last engines fed an NCHW input skip
# the input transpose (the fastest choice for pipeline B's TF32 convolution).
_LAYOUT_PAIRS = (("nchw", "nchw"), ("nhwc", "nhwc"), ("nchw", "nhwc"))

_state = threading.local()
_plans: dict[tuple, ConvPlan] = {}
_plans_lock = threading.Lock()
# Plan-choice settings: autotuning on/off, and strategy labels to pin (tests), None for all.
_config: dict[str, Any] = {"autotune": True, "pins": None, "replay": True}
# CUDA graphs kept per plan (one per operand pointers and stream), and how many calls with the
# same operands come before one is captured (a one-off call is not worth a capture).
_MAX_REPLAYS = 8
_CALLS_BEFORE_CAPTURE = 2
# How much faster (fraction of device time) direct calls must measure to turn replay off.
_REPLAY_MARGIN = 0.005
# A strategy that first converts the caller's NCHW input competes with its measured cost
# raised by this fraction: the autotuner's timing of the conversion varies between processes
# by more than the gap to a strategy that reads NCHW directly, and a pipeline that converts
# runs no faster (docs/design.rst, "Convolution plans"). A smaller margin lets the choice
# flip from process to process.
_INPUT_CONVERSION_MARGIN = 0.10


def set_conv_autotune(enabled: bool) -> None:
    """Switch plan autotuning on (default) or off.

    With autotuning, the first call for a convolution problem times every cuDNN plan of every
    strategy (layouts, method) and keeps the fastest; without it, the first plan of cuDNN's
    heuristics for a plain NCHW convolution is used. Plans already chosen are kept.

    Parameters
    ----------
    enabled : bool
        Whether new problems are autotuned.

    Examples
    --------
    >>> import cufused
    >>> cufused.set_conv_autotune(False)
    >>> cufused.set_conv_autotune(True)
    """
    _config["autotune"] = bool(enabled)


def set_conv_graph_replay(enabled: bool) -> None:
    """Switch the CUDA-graph replay of warm convolution calls on (default) or off.

    From the second call with the same operand pointers on a stream, a convolution replays one
    CUDA graph of its cuDNN calls, weight preparation and output conversion instead of issuing
    each again, which takes a few tens of microseconds of host time per call where issuing
    the parts takes up to a few hundred (FFT and sub-pixel plans). Each graph keeps its own
    workspace, prepared weight and, where the plan writes another layout than the NCHW
    result, its intermediate output (up to 8 graphs per plan; :func:`clear_plan_cache` frees
    them). A call made while the stream is being captured always runs directly, and so does a
    plan for which the autotuner measured direct calls faster on the device.

    Parameters
    ----------
    enabled : bool
        Whether warm calls replay graphs.

    Examples
    --------
    >>> import cufused
    >>> cufused.set_conv_graph_replay(False)
    >>> cufused.set_conv_graph_replay(True)
    """
    _config["replay"] = bool(enabled)


@contextlib.contextmanager
def plan_options(*, autotune: bool | None = None, pins: tuple[str, ...] | None = None,
                 replay: bool | None = None):
    """Temporarily change how new plans are chosen, and how plans run.

    ``pins`` restricts the strategies to those whose :attr:`Strategy.label` is listed (tests
    pin each one in turn); a problem that has none of them falls back to the direct method in
    the pinned layouts. ``replay=False`` runs every call through cuDNN directly instead of
    replaying the CUDA graph captured for repeated operands (see :meth:`ConvPlan.run`).
    """
    saved = dict(_config)
    if autotune is not None:
        _config["autotune"] = autotune
    if pins is not None:
        _config["pins"] = tuple(pins)
    if replay is not None:
        _config["replay"] = replay
    try:
        yield
    finally:
        _config.update(saved)


_cudnn_module = None


def import_cudnn():
    """Import cuDNN Frontend or raise an ``ImportError`` naming the extra to install."""
    global _cudnn_module
    if _cudnn_module is None:
        try:
            import cudnn
        except (ImportError, OSError) as exc:
            raise ImportError(
                "cuDNN Frontend (module 'cudnn') is not importable: install cufused[cuda12] or "
                f"cufused[cuda13] ({exc})"
            ) from exc
        _cudnn_module = cudnn
    return _cudnn_module


def _handle():
    """One cuDNN handle per (thread, device), bound to CuPy's current stream."""
    cupy = import_cupy()
    handles = getattr(_state, "handles", None)
    if handles is None:
        handles = _state.handles = {}
    device = cupy.cuda.runtime.getDevice()
    stream = cupy.cuda.get_current_stream().ptr
    entry = handles.get(device)
    if entry is None:
        entry = handles[device] = [import_cudnn().create_handle(), None]
    if entry[1] != stream:
        import_cudnn().set_stream(handle=entry[0], stream=stream)
        entry[1] = stream
    return entry[0]


@dataclass(frozen=True)
class ConvProblem:
    """What identifies a convolution plan (besides the device)."""

    kind: str  # "fprop" (convolution) or "dgrad" (transposed convolution)
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    y_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    precision: str
    bias: bool = False  # the caller adds a bias (only public calls do; pipelines fuse it)

    @property
    def groups(self) -> int:
        if self.kind == "fprop":
            return self.x_shape[1] // self.w_shape[1]
        return self.y_shape[1] // self.w_shape[1]


@dataclass(frozen=True)
class Strategy:
    """How a plan computes its problem.

    ``method`` is "direct" (one cuDNN fprop/dgrad) or "subpixel" (forward convolutions per
    output residue class); ``y_layout`` "classes" means class-major blocks (N, C, *M) per
    residue class, each NCHW-packed.
    """

    method: str
    x_layout: str
    y_layout: str
    bias_in_graph: bool = False

    @property
    def label(self) -> str:
        """A short name: "nchw", "nchw>nhwc", "nchw+bias", "subpixel nchw", ..."""
        xl, yl = self.x_layout, self.y_layout
        name = xl if yl in (xl, "classes") else f"{xl}>{yl}"
        if self.bias_in_graph:
            name += "+bias"
        return name if self.method == "direct" else f"{self.method} {name}"


def strategies(problem: ConvProblem, accept_classes: bool) -> list[Strategy]:
    """Every strategy that can compute ``problem``; the plain NCHW convolution first."""
    found = []
    for xl, yl in _LAYOUT_PAIRS:
        found.append(Strategy("direct", xl, yl))
        if problem.bias and yl == "nchw":
            found.append(Strategy("direct", xl, yl, bias_in_graph=True))
    parts = _subpixel_split(problem)
    if parts is not None:
        if len(parts) == 1:
            found += [Strategy("subpixel", xl, yl) for xl, yl in _LAYOUT_PAIRS]
        elif accept_classes and problem.stride[-1] <= 2:  # the kernels interleave up to 2
            found.append(Strategy("subpixel", "nchw", "classes"))
    return found


def _subpixel_split(problem: ConvProblem):
    if problem.kind != "dgrad" or any(d != 1 for d in problem.dilation):
        return None
    return subpixel_parts(problem.x_shape[2:], problem.w_shape[2:], problem.stride,
                          problem.padding, problem.y_shape[2:])


@dataclass(frozen=True)
class _PartSpec:
    """One cuDNN graph of a strategy: tensor dims/strides and the operands' element offsets."""

    kind: str
    x_dims: tuple[int, ...]
    x_strides: tuple[int, ...]
    w_dims: tuple[int, ...]
    w_strides: tuple[int, ...]
    y_dims: tuple[int, ...]
    y_strides: tuple[int, ...]
    pre_padding: tuple[int, ...]
    post_padding: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    bias_strides: tuple[int, ...] | None
    x_offset: int = 0
    w_offset: int = 0
    y_offset: int = 0

    def graph_key(self):
        """The fields that define the graph (parts that differ only in offsets share one)."""
        return (self.kind, self.x_dims, self.x_strides, self.w_dims, self.w_strides, self.y_dims,
                self.y_strides, self.pre_padding, self.post_padding, self.stride, self.dilation,
                self.bias_strides)


# cuDNN rejects operand pointers that are not 16-byte aligned (CUDNN_STATUS_BAD_PARAM_
# MISALIGNED_POINTER): sub-pixel parts start at multiples of 4 float32 values.
_ALIGN = 4


def _aligned(a):
    """``a``, or a copy in the same memory order when its pointer is not 16-byte aligned."""
    return a if a is None or a.data.ptr % (4 * _ALIGN) == 0 else a.copy(order="K")


def _part_specs(problem: ConvProblem, strategy: Strategy):
    """The graphs of ``strategy``, the output shape it writes, and its weight gather index."""
    xl, yl = strategy.x_layout, strategy.y_layout
    x_strides = layout_strides(problem.x_shape, xl)
    nd = len(problem.x_shape) - 2
    c_out = problem.y_shape[1]
    bias_strides = (layout_strides((1, c_out) + (1,) * nd, yl)
                    if strategy.bias_in_graph else None)
    if strategy.method == "direct":
        spec = _PartSpec(problem.kind, problem.x_shape, x_strides, problem.w_shape,
                         layout_strides(problem.w_shape, xl), problem.y_shape,
                         layout_strides(problem.y_shape, yl), problem.padding, problem.padding,
                         problem.stride, problem.dilation, bias_strides)
        return [spec], problem.y_shape, None
    parts = _subpixel_split(problem)
    n, c_in = problem.x_shape[:2]
    ones = (1,) * nd
    if yl == "classes":
        class_shape = (n, c_out, *(o // s for o, s in zip(problem.y_shape[2:], problem.stride)))
        y_shape = (len(parts), *class_shape)
    else:
        class_shape = y_shape = problem.y_shape
    y_strides = layout_strides(class_shape, "nchw" if yl == "classes" else yl)
    block = int(numpy.prod(class_shape))
    specs, w_offset = [], 0
    for i, part in enumerate(parts):
        w_dims = (c_out, c_in // problem.groups, *part.taps)
        specs.append(_PartSpec(
            "fprop", (n, c_in, *part.x_size), x_strides, w_dims, layout_strides(w_dims, xl),
            class_shape, y_strides, part.pre_padding, part.post_padding, ones, ones, None,
            x_offset=sum(a * b for a, b in zip(part.x_start, x_strides[2:])),
            w_offset=w_offset, y_offset=i * block if len(parts) > 1 else 0))
        w_offset += -(-int(numpy.prod(w_dims)) // _ALIGN) * _ALIGN
    if any((s.x_offset % _ALIGN) or (s.y_offset % _ALIGN) for s in specs):
        raise ValueError("a sub-pixel part would start at a misaligned address")
    index = subpixel_weight_index(problem.w_shape, problem.groups, problem.stride, parts,
                                  channels_last=xl == "nhwc", align=_ALIGN)
    return specs, y_shape, index


def _build_graph(spec: _PartSpec, precision: str):
    cudnn = import_cudnn()
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32,
                          handle=_handle())
    x = graph.tensor(name="x", dim=list(spec.x_dims), stride=list(spec.x_strides), data_type=f32)
    w = graph.tensor(name="w", dim=list(spec.w_dims), stride=list(spec.w_strides), data_type=f32)
    conv = graph.conv_fprop if spec.kind == "fprop" else graph.conv_dgrad
    operands = {"image": x, "weight": w} if spec.kind == "fprop" else {"loss": x, "filter": w}
    y = conv(**operands, pre_padding=list(spec.pre_padding),
             post_padding=list(spec.post_padding), stride=list(spec.stride),
             dilation=list(spec.dilation), compute_data_type=f32)
    y.set_dim(list(spec.y_dims)).set_stride(list(spec.y_strides)).set_data_type(f32)
    tensors = [x, w]
    if spec.bias_strides is not None:
        b = graph.tensor(name="b", dim=[1, spec.y_dims[1]] + [1] * (len(spec.y_dims) - 2),
                         stride=list(spec.bias_strides), data_type=f32)
        y = graph.bias(input=y, bias=b)
        y.set_dim(list(spec.y_dims)).set_stride(list(spec.y_strides)).set_data_type(f32)
        tensors.append(b)
    y.set_output(True)
    tensors.append(y)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    if precision == "ieee":
        # Keep float32 float32: no TF32 tensor cores, no down-converted inputs.
        graph.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE,
                                      cudnn.numerical_note.DOWN_CONVERT_INPUTS])
    graph.check_support()
    return graph, tensors


@dataclass
class _Part:
    """A built graph with its chosen execution plan, and where its operands start."""

    spec: _PartSpec
    graph: Any
    tensors: list  # the graph's x, w, [bias], y tensors: keys of the variant pack
    plan_index: int
    workspace_size: int
    milliseconds: float = float("nan")
    _direct: Any = None  # resolved backend call (see _direct_executor), False when unavailable

    def execute(self, x_ptr: int, w_ptr: int, y_ptr: int, b_ptr: int, ws_ptr: int,
                handle) -> None:
        spec = self.spec
        ptrs = [x_ptr + 4 * spec.x_offset, w_ptr + 4 * spec.w_offset]
        if spec.bias_strides is not None:
            ptrs.append(b_ptr)
        ptrs.append(y_ptr + 4 * spec.y_offset)
        if self._direct is None:
            self._direct = _direct_executor(self) or False
        if self._direct:
            execute, cpp_index, uids = self._direct
            execute(dict(zip(uids, ptrs)), ws_ptr, cpp_index, handle.backend_handle)
            return
        self.graph.execute_plan_at_index(dict(zip(self.tensors, ptrs)), ws_ptr or None,
                                         self.plan_index, handle=handle)


def operand_key(a) -> tuple:
    """What a captured graph depends on in an operand: its address, shape, strides and dtype
    (one buffer is routinely handed out again holding another layout or shape)."""
    return a.data.ptr, a.shape, a.strides, a.dtype.char


@functools.cache
def _graph_buffer_pool():
    """The memory pool of the buffers that captured plan graphs keep."""
    return import_cupy().cuda.MemoryPool()


def _launch_graph(graph, stream, buffers) -> None:
    """Launch a captured plan on ``stream``; ``buffers`` (its workspace, prepared weight and
    intermediates) are only held here, so that they live as long as the graph that uses them."""
    graph.launch(stream=stream)


def _direct_executor(part: _Part):
    """The backend call that ``execute_plan_at_index`` ends in, resolved once.

    cuDNN Frontend 1.28 re-resolves the plan, the operand uids and the pointers on every
    ``execute_plan_at_index`` call; for a built backend plan the final call only needs
    (uid -> pointer, workspace, plan index, handle). Calling it directly cuts the host time of
    a convolution several-fold. Private API: anything unexpected falls back to the public call.
    """
    try:
        graph = part.graph
        if graph._engine_for(graph._plans[part.plan_index]) is not None:
            return None  # a Python engine: only the public path runs it
        cfg = graph._materialize_backend_plan(part.plan_index)
        if cfg.cpp_index is None:
            return None
        return (graph._lowered_graph._execute_plan_at_index, cfg.cpp_index,
                tuple(t.uid for t in part.tensors))
    except Exception:  # noqa: BLE001 - internals differ in another cuDNN Frontend version
        return None


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
    # directly (a failed capture, or direct calls measured faster: see _decide_replay)
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
    def layout(self) -> str:
        """The layout of the output as written: "nchw", "nhwc" or "classes"."""
        return self.strategy.y_layout

    def example_operands(self):
        """``(x, w, y)`` for :meth:`run` (timings): random inputs, an empty output."""
        return (_random(self.problem.x_shape, self.x_layout), _random(self.problem.w_shape),
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
        well over 100 us; unless the autotuner measured direct calls faster (see
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
        the workspace, or None)."""
        cupy = import_cupy()
        if self.weight_index is not None:  # the gathered sub-kernels (subpixel)
            w_buffer = cupy.empty(self.weight_index.shape, dtype=numpy.float32)
        elif stored_in(w, self.x_layout):
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
        handle = _handle()
        for part in self.parts:
            part.execute(x.data.ptr, w.data.ptr, y.data.ptr, b_ptr, ws_ptr, handle)

    def _launch(self, kind: str, operands, buffers, work) -> None:
        """``work(buffers())`` on the current stream, or the replay of its CUDA graph: the
        graph for (``kind``, the device, the stream, each operand's address, shape, strides
        and dtype) once these have been seen before, captured with buffers of its own that it
        keeps (``buffers`` allocates them; ``work`` must not allocate)."""
        replay = self._replay(kind, operands, buffers, work)
        if replay is not None:
            replay()
        else:
            work(buffers())

    def _replay(self, kind, operands, buffers, work):
        """The graph launcher for ``_launch``: cached, captured now (on the second call with
        these operands), or None (replay off, a capture in progress, a failed capture)."""
        if not _config["replay"] or self._replays is None:
            return None
        cupy = import_cupy()
        stream = cupy.cuda.get_current_stream()
        try:
            if stream.is_capturing():  # the caller's capture records the cuDNN calls
                return None
        except Exception:  # noqa: BLE001 - the query is illegal during some global captures
            return None
        key = (kind, cupy.cuda.runtime.getDevice(), stream.ptr,
               *(None if a is None else operand_key(a) for a in operands))
        replay = self._replays.get(key)
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
        with cupy.cuda.using_allocator(_graph_buffer_pool().malloc):
            kept = buffers()
        side = cupy.cuda.Stream(non_blocking=True)
        try:
            with side:
                side.begin_capture()
                try:
                    work(kept)
                finally:
                    graph = side.end_capture()
        except Exception:  # noqa: BLE001 - an engine that cannot be captured runs directly
            self._replays = None
            return None
        replay = functools.partial(_launch_graph, graph, stream, kept)
        if len(self._replays) >= _MAX_REPLAYS:
            self._replays.pop(next(iter(self._replays)))  # the oldest
        self._replays[key] = replay
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

        self._launch(("apply", convert_output), (x, w, bias, result), buffers, work)
        if out is not None and result is not out and layout == "nchw":
            out[...] = result  # a misaligned out
            result = out
        return result, "nchw" if convert_y else layout


def _time_ms(fn, repeat: int = 5, batch: int = 3, flush=None) -> float:
    """Median CUDA-event time of ``fn()`` on the current stream after one warm-up run.

    Each sample times ``batch`` back-to-back calls and divides, so that the host overhead of a
    call hides behind the device work of the previous one; with a ``flush`` array, which is
    overwritten before each sample, the L2 holds none of the operands.
    """
    cupy = import_cupy()
    fn()
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
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


def _random(shape, layout="nchw"):
    """Random (not zero: zeros can run faster) float32 test data in ``layout``."""
    cupy = import_cupy()
    a = empty_in_layout(shape, layout)
    a[...] = cupy.random.default_rng(0).random(a.shape, dtype=cupy.float32)
    return a


def _make_plan(problem: ConvProblem, strategy: Strategy, tune: bool) -> ConvPlan | None:
    """Build ``strategy``'s graphs and pick each one's fastest plan (or its heuristic one)."""
    cudnn = import_cudnn()
    cupy = import_cupy()
    try:
        specs, y_shape, index = _part_specs(problem, strategy)
        graphs = {}
        for spec in specs:
            if spec.graph_key() not in graphs:
                graphs[spec.graph_key()] = _build_graph(spec, problem.precision)
    except Exception:  # noqa: BLE001 - cuDNN reports "not supported" in several ways
        return None
    index = None if index is None else cupy.asarray(index)
    if tune:
        x = _random(problem.x_shape, strategy.x_layout)
        w = _random((int(index.size),) if index is not None else problem.w_shape,
                    "nchw" if index is not None else strategy.x_layout)
        b = _random((problem.y_shape[1],))
        y = cupy.empty(y_shape, dtype=cupy.float32)
        handle = _handle()
    parts, built = [], set()
    for spec in specs:
        graph, tensors = graphs[spec.graph_key()]
        best = None
        if tune and spec.graph_key() not in built:
            graph.build_plans(cudnn.build_plan_policy.ALL)
            built.add(spec.graph_key())
        for i in range(graph.get_execution_plan_count()):
            try:
                if not tune:
                    graph.build_plan_at_index(i)
                part = _Part(spec, graph, tensors, i, graph.get_workspace_size_plan_at_index(i))
                if not tune:
                    best = part
                    break
                ws = cupy.empty(max(part.workspace_size, 1), dtype=cupy.uint8)
                part.milliseconds = _time_ms(lambda p=part, ws=ws: p.execute(
                    x.data.ptr, w.data.ptr, y.data.ptr, b.data.ptr, ws.data.ptr, handle))
            except Exception:  # noqa: BLE001 - a plan that did not build or run is skipped
                continue
            if best is None or part.milliseconds < best.milliseconds:
                best = part
        if best is None:
            return None
        parts.append(best)
    return ConvPlan(problem, strategy, parts, y_shape, index,
                    max(p.workspace_size for p in parts))


class UnsupportedConvolution(ValueError):
    """No cuDNN plan computes this convolution (the caller may take another route)."""


def _pinned(found: list[Strategy], pins) -> list[Strategy]:
    if pins is None:
        return found
    chosen = [s for s in found if s.label in pins]
    # Then the direct method in the pinned layouts: for a problem without the pinned method
    # (subpixel for a forward convolution) or whose pinned graph cuDNN cannot build.
    layouts = {p.split()[-1].replace("+bias", "") for p in pins}
    return chosen + [s for s in found if s.label in layouts and s not in chosen]


def conv_plan(problem: ConvProblem, *, convert_input: bool, convert_output: bool,
              accept_classes: bool = False) -> ConvPlan:
    """Return the cached plan for ``problem``, choosing its strategy and plans on first use.

    ``convert_input`` / ``convert_output`` say whether the caller passes an NCHW input / needs
    an NCHW output, so that the layout conversions it would pay count in the comparison;
    ``accept_classes`` whether it reads class-major output (without ``convert_output``).
    """
    cupy = import_cupy()
    tune, pins = _config["autotune"], _config["pins"]
    key = (cupy.cuda.runtime.getDevice(), problem, convert_input, convert_output,
           accept_classes, tune, pins)
    plan = _plans.get(key, False)
    if plan is False:
        with _plans_lock:
            plan = _plans.get(key, False)
            if plan is False:
                try:
                    plan = _choose(problem, convert_input, convert_output, accept_classes, tune,
                                   pins)
                except UnsupportedConvolution:
                    plan = None  # remembered: the search is not repeated on every call
                _plans[key] = plan
    if plan is None:
        raise UnsupportedConvolution(f"cuDNN supports no plan for this convolution: {problem}")
    return plan


def strategy_score(cost: float, strategy: Strategy, convert_input: bool) -> float:
    """What the autotuner compares: the measured ``cost`` (ms, conversions included), raised
    by ``_INPUT_CONVERSION_MARGIN`` for a strategy that converts an NCHW input first."""
    converts = convert_input and strategy.x_layout != "nchw"
    return cost * (1 + _INPUT_CONVERSION_MARGIN) if converts else cost


def _choose(problem, convert_input, convert_output, accept_classes, tune, pins) -> ConvPlan:
    found = _pinned(strategies(problem, accept_classes or convert_output), pins)
    if not tune:  # the first strategy, in order, that builds
        found = [s for s in found if not s.bias_in_graph] or found
    best, best_score, candidates = None, float("inf"), {}
    for strategy in found:
        plan = _make_plan(problem, strategy, tune)
        if plan is None:
            continue
        if not tune:
            best = plan
            break
        x = _random(problem.x_shape, "nchw" if convert_input else strategy.x_layout)
        w = _random(problem.w_shape)
        b = _random((problem.y_shape[1],)) if problem.bias else None
        plan.milliseconds = sum(p.milliseconds for p in plan.parts)
        call = functools.partial(plan.apply, x, w, bias=b, convert_output=convert_output)
        plan.cost = _time_ms(call)
        candidates[strategy.label] = (plan.milliseconds, plan.cost)
        score = strategy_score(plan.cost, strategy, convert_input)
        if score < best_score:
            best, best_call, best_score = plan, call, score
    if best is None:
        raise UnsupportedConvolution(f"cuDNN supports no plan for this convolution: {problem}")
    best.candidates = candidates
    # Also for a plan whose output feeds a fused pass: the pipeline's argument checks are
    # short enough that its head start still hides a direct call's host work, so the choice
    # made from the convolution alone holds inside the pipeline (docs/design.rst).
    if tune and _config["replay"]:
        _decide_replay(best, best_call)
    return best


def _l2_flush_buffer():
    """A float32 array twice the size of the current device's L2 cache, or None when that
    much memory is not free (the autotuner then times without flushing)."""
    cupy = import_cupy()
    try:
        return cupy.empty(cupy.cuda.Device().attributes["L2CacheSize"] // 2,
                          dtype=cupy.float32)
    except cupy.cuda.memory.OutOfMemoryError:
        return None


def _decide_replay(plan: ConvPlan, call, rounds: int = 11) -> None:
    """Let ``plan`` replay CUDA graphs of warm calls unless direct calls measure faster.

    A replay saves host time, which costs device time only where the device would wait for
    the host; but a captured plan can also run slower on the device than issued directly
    (B's FFT data-gradient plan, whose kernels overlap on several streams in another order
    when captured: docs/design.rst). ``call`` (the autotuner's operands) is timed both ways,
    alternately, one call at a time after an L2 flush, as a call that follows other work
    runs: there a direct call's host work counts where the device waits for it. (Back to
    back, which hides all host work, such a plan's two ways are within noise and the choice
    would not be stable between processes.) Direct calls must win by more than
    ``_REPLAY_MARGIN`` to turn replay off for this plan.
    """
    flush = _l2_flush_buffer()
    times = {True: [], False: []}
    for _ in range(rounds):
        for replay in (True, False):
            with plan_options(replay=replay):
                times[replay].append(_time_ms(call, repeat=1, batch=1, flush=flush))
    if plan._replays is not None:
        plan._replays.clear()  # the graphs of the autotuner's operands
    plan._calls.clear()
    if numpy.median(times[False]) * (1 + _REPLAY_MARGIN) < numpy.median(times[True]):
        plan._replays = None


def clear_plan_cache() -> None:
    """Forget every built cuDNN plan; they are rebuilt, and re-tuned, on next use.

    Examples
    --------
    >>> import cufused
    >>> cufused.clear_plan_cache()
    """
    with _plans_lock:
        _plans.clear()
    if _graph_buffer_pool.cache_info().currsize:  # the dropped graphs' buffers
        _graph_buffer_pool().free_all_blocks()
