"""cuDNN convolutions through cuDNN Frontend's Python API.

A forward convolution is ``conv_fprop``; a transposed convolution is ``conv_dgrad`` with the
ConvTranspose weight unchanged and the output shape set explicitly. Each distinct problem
(device, kind, shapes, parameters, precision) gets a :class:`ConvPlan`, built once: on first
use the candidate plans of both layouts (NCHW and channels-last) are timed with CUDA events,
like ``torch.backends.cudnn.benchmark``, and the fastest (layout, plan) pair is kept. The plan
exposes its layout so that the fused kernels downstream read a channels-last output directly.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy

from ._arrays import import_cupy

LAYOUTS = ("nchw", "nhwc")

_state = threading.local()
_plans: dict[tuple, ConvPlan] = {}
_plans_lock = threading.Lock()
# Plan-choice settings: autotuning on/off and the layouts considered (tests pin one layout).
_config = {"autotune": True, "layouts": LAYOUTS}


def set_conv_autotune(enabled: bool) -> None:
    """Switch plan autotuning on (default) or off.

    With autotuning, the first call for a convolution problem times every cuDNN plan in both
    layouts and keeps the fastest; without it, the first plan of cuDNN's heuristics in the NCHW
    layout is used. Plans already chosen are kept.

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


@contextlib.contextmanager
def plan_options(*, autotune: bool | None = None, layouts: tuple[str, ...] | None = None):
    """Temporarily change how new plans are chosen (tests use it to pin a layout)."""
    saved = dict(_config)
    if autotune is not None:
        _config["autotune"] = autotune
    if layouts is not None:
        _config["layouts"] = tuple(layouts)
    try:
        yield
    finally:
        _config.update(saved)


def import_cudnn():
    """Import cuDNN Frontend or raise an ``ImportError`` naming the extra to install."""
    try:
        import cudnn
    except (ImportError, OSError) as exc:
        raise ImportError(
            "cuDNN Frontend (module 'cudnn') is not importable: install cufused[cuda12] or "
            f"cufused[cuda13] ({exc})"
        ) from exc
    return cudnn


def _handle():
    """One cuDNN handle per (thread, device), bound to CuPy's current stream."""
    cupy = import_cupy()
    cudnn = import_cudnn()
    handles = getattr(_state, "handles", None)
    if handles is None:
        handles = _state.handles = {}
    device = cupy.cuda.runtime.getDevice()
    handle = handles.get(device)
    if handle is None:
        handle = handles[device] = cudnn.create_handle()
    # Cheap when the stream has not changed: the Handle remembers its last stream.
    cudnn.set_stream(handle=handle, stream=cupy.cuda.get_current_stream().ptr)
    return handle


def layout_strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Element strides of a logical (N, C, *spatial) shape stored in ``layout``.

    Examples
    --------
    >>> layout_strides((2, 3, 4, 5), "nchw")
    (60, 20, 5, 1)
    >>> layout_strides((2, 3, 4, 5), "nhwc")
    (60, 1, 15, 3)
    """
    if layout == "nchw":
        physical = shape
    else:
        physical = (shape[0], *shape[2:], shape[1])
    strides = [1] * len(shape)
    for i in range(len(physical) - 2, -1, -1):
        strides[i] = strides[i + 1] * physical[i + 1]
    if layout == "nchw":
        return tuple(strides)
    return (strides[0], strides[-1], *strides[1:-1])


def empty_in_layout(shape: tuple[int, ...], layout: str):
    """A CuPy float32 array of logical ``shape`` whose memory is in ``layout``."""
    cupy = import_cupy()
    if layout == "nchw":
        return cupy.empty(shape, dtype=cupy.float32)
    nd = len(shape)
    physical = cupy.empty((shape[0], *shape[2:], shape[1]), dtype=cupy.float32)
    return physical.transpose(0, nd - 1, *range(1, nd - 1))


def transpose_channels(src, dst, *, to_channels_last: bool, bias=None) -> None:
    """Copy contiguous NC(D)HW ``src`` to channels-last ``dst`` or back (+ ``bias[c]``).

    Both arrays have the same logical shape; ``src``'s memory is in the source layout and
    ``dst``'s in the other one. One tiled-transpose kernel, coalesced on both sides.
    """
    from ._cuda import get_kernel, launch_1d, optional

    n, c = src.shape[:2]
    s = src.size // max(n * c, 1)
    a, b = (c, s) if to_channels_last else (s, c)
    if src.size == 0:
        return
    # Few channels idle most of a 32 x 32 tile: gather 8 channels per thread instead (measured
    # faster for C = 8, slower for C >= 32).
    if (to_channels_last and c in (8, 16) and src.data.ptr % 16 == 0
            and dst.data.ptr % 16 == 0):
        launch_1d(get_kernel("layout.cu", "nchw_to_nhwc8"), n * (c // 8) * s,
                  (src, dst, numpy.int64(n), numpy.int32(c), numpy.int64(s)))
        return
    if a * b >= 2**31:  # the kernel's per-sample offsets are 32-bit
        dst[...] = src
        return
    kernel = get_kernel("layout.cu", f"transpose_batched<{'false' if bias is None else 'true'}>")
    kernel((-(-b // 128), -(-a // 32), min(n, 65535)), (32, 8),
           (src, dst, optional(bias), numpy.int64(n), numpy.int64(a), numpy.int64(b)))


def to_layout(a, layout: str):
    """``a`` (logical N, C, *spatial) with its memory in ``layout``, copied only if needed."""
    cupy = import_cupy()
    if layout == "nchw":
        return cupy.ascontiguousarray(a)
    want = tuple(s * a.itemsize for s in layout_strides(a.shape, layout))
    if a.strides == want:
        return a
    out = empty_in_layout(a.shape, layout)
    transpose_channels(cupy.ascontiguousarray(a), out, to_channels_last=True)
    return out


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


@dataclass
class ConvPlan:
    """A built cuDNN graph for one problem in one layout, with its chosen execution plan."""

    problem: ConvProblem
    layout: str
    graph: Any
    tensors: tuple[Any, Any, Any]  # the graph's x, w, y tensors: keys of the variant pack
    plan_index: int
    workspace_size: int
    milliseconds: float = float("nan")
    candidates: dict = field(default_factory=dict)  # plan index -> ms, this layout
    layout_costs: dict = field(default_factory=dict)  # layout -> best ms + conversions
    conversion_ms: float = 0.0  # measured layout conversions this layout's plan needs
    _direct: Any = None  # resolved backend call (see _direct_executor), False when unavailable

    def run(self, x, w, y) -> None:
        """Run on arrays whose memory is in ``self.layout`` (raw pointers, current stream)."""
        cupy = import_cupy()
        handle = _handle()
        # A raw workspace pointer: an array would take the DLPack route, whose stream
        # synchronization breaks CUDA-graph capture.
        workspace = (cupy.empty(self.workspace_size, dtype=cupy.uint8)
                     if self.workspace_size else None)
        ws_ptr = 0 if workspace is None else workspace.data.ptr
        if self._direct is None:
            self._direct = _direct_executor(self) or False
        if self._direct:
            execute, cpp_index, uids = self._direct
            execute({uids[0]: x.data.ptr, uids[1]: w.data.ptr, uids[2]: y.data.ptr}, ws_ptr,
                    cpp_index, handle.backend_handle)
            return
        pack = {self.tensors[0]: x.data.ptr, self.tensors[1]: w.data.ptr,
                self.tensors[2]: y.data.ptr}
        self.graph.execute_plan_at_index(pack, ws_ptr or None, self.plan_index, handle=handle)


def _direct_executor(plan: ConvPlan):
    """The backend call that ``execute_plan_at_index`` ends in, resolved once.

    cuDNN Frontend 1.28 re-resolves the plan, the operand uids and the pointers on every
    ``execute_plan_at_index`` call; for a built backend plan the final call only needs
    (uid -> pointer, workspace, plan index, handle). Calling it directly cuts the host time of
    a convolution several-fold. Private API: anything unexpected falls back to the public call.
    """
    try:
        graph = plan.graph
        if graph._engine_for(graph._plans[plan.plan_index]) is not None:
            return None  # a Python engine: only the public path runs it
        cfg = graph._materialize_backend_plan(plan.plan_index)
        if cfg.cpp_index is None:
            return None
        return (graph._lowered_graph._execute_plan_at_index, cfg.cpp_index,
                tuple(t.uid for t in plan.tensors))
    except Exception:  # noqa: BLE001 - internals differ in another cuDNN Frontend version
        return None


def _build_graph(problem: ConvProblem, layout: str):
    cudnn = import_cudnn()
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32,
                          handle=_handle())
    if problem.kind == "fprop":
        x = graph.tensor(name="x", dim=list(problem.x_shape),
                         stride=list(layout_strides(problem.x_shape, layout)), data_type=f32)
        w = graph.tensor(name="w", dim=list(problem.w_shape),
                         stride=list(layout_strides(problem.w_shape, layout)), data_type=f32)
        y = graph.conv_fprop(image=x, weight=w, padding=list(problem.padding),
                             stride=list(problem.stride), dilation=list(problem.dilation),
                             compute_data_type=f32)
    else:
        x = graph.tensor(name="dy", dim=list(problem.x_shape),
                         stride=list(layout_strides(problem.x_shape, layout)), data_type=f32)
        w = graph.tensor(name="w", dim=list(problem.w_shape),
                         stride=list(layout_strides(problem.w_shape, layout)), data_type=f32)
        y = graph.conv_dgrad(loss=x, filter=w, padding=list(problem.padding),
                             stride=list(problem.stride), dilation=list(problem.dilation),
                             compute_data_type=f32)
    y.set_output(True).set_dim(list(problem.y_shape)).set_stride(
        list(layout_strides(problem.y_shape, layout))).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    if problem.precision == "ieee":
        # Keep float32 float32: no TF32 tensor cores, no down-converted inputs.
        graph.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE,
                                      cudnn.numerical_note.DOWN_CONVERT_INPUTS])
    graph.check_support()
    return graph, (x, w, y)


def _time_ms(fn, repeat: int = 5, batch: int = 3) -> float:
    """Median CUDA-event time of ``fn()`` on the current stream after one warm-up run.

    Each sample times ``batch`` back-to-back calls and divides, so that the host overhead of a
    call hides behind the device work of the previous one.
    """
    cupy = import_cupy()
    fn()
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(repeat):
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / batch)
    return float(numpy.median(times))


def _tune(problem: ConvProblem, layout: str, tune: bool) -> ConvPlan | None:
    """Build the graph in ``layout`` and pick its fastest plan (or the heuristic one)."""
    cudnn = import_cudnn()
    cupy = import_cupy()
    try:
        graph, tensors = _build_graph(problem, layout)
    except Exception:  # noqa: BLE001 - cuDNN reports "not supported" in several ways
        return None
    if not tune:  # the first plan, in cuDNN's heuristic order, that builds
        for index in range(graph.get_execution_plan_count()):
            try:
                graph.build_plan_at_index(index)
            except Exception:  # noqa: BLE001
                continue
            return ConvPlan(problem, layout, graph, tensors, index,
                            graph.get_workspace_size_plan_at_index(index))
        return None
    graph.build_plans(cudnn.build_plan_policy.ALL)
    x = empty_in_layout(problem.x_shape, layout)
    w = empty_in_layout(problem.w_shape, layout)
    y = empty_in_layout(problem.y_shape, layout)
    rng = cupy.random.default_rng(0)
    for a in (x, w):
        a[...] = rng.random(a.shape, dtype=cupy.float32)  # not zeros: they can run faster
    best = None
    candidates = {}
    for index in range(graph.get_execution_plan_count()):
        try:
            size = graph.get_workspace_size_plan_at_index(index)
            plan = ConvPlan(problem, layout, graph, tensors, index, size)
            ms = _time_ms(lambda plan=plan: plan.run(x, w, y))
        except Exception:  # noqa: BLE001 - a plan that did not build or run is skipped
            continue
        candidates[index] = ms
        if best is None or ms < best.milliseconds:
            plan.milliseconds = ms
            best = plan
    if best is not None:
        best.candidates = candidates
    return best


def conv_plan(problem: ConvProblem, *, convert_input: bool, convert_output: bool) -> ConvPlan:
    """Return the cached plan for ``problem``, choosing layout and engine on first use.

    ``convert_input`` / ``convert_output`` say whether the caller would pay a layout
    conversion of the input / output for a channels-last plan; its measured cost is added to
    that layout's time before the layouts are compared.
    """
    cupy = import_cupy()
    tune, layouts = _config["autotune"], _config["layouts"]
    if not tune and layouts == LAYOUTS:
        layouts = ("nchw",)
    key = (cupy.cuda.runtime.getDevice(), problem, convert_input, convert_output, tune, layouts)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            return plan
        choices = []
        for layout in layouts:
            candidate = _tune(problem, layout, tune)
            if candidate is None:
                continue
            cost = candidate.milliseconds
            if layout != "nchw" and tune and len(layouts) > 1:
                candidate.conversion_ms = _conversion_ms(problem, convert_input, convert_output)
                cost += candidate.conversion_ms
            choices.append((cost, candidate))
        if not choices:
            raise ValueError(f"cuDNN supports no plan for this convolution: {problem}")
        plan = min(choices, key=lambda c: c[0])[1]
        plan.layout_costs = {c.layout: (c.milliseconds, c.conversion_ms) for _, c in choices}
        _plans[key] = plan
        return plan


def _conversion_ms(problem: ConvProblem, convert_input: bool, convert_output: bool) -> float:
    """Device time of the tiled transposes a channels-last plan adds for this caller."""
    total = 0.0
    for shape, needed, to_cl in ((problem.x_shape, convert_input, True),
                                 (problem.y_shape, convert_output, False)):
        if needed:
            src = empty_in_layout(shape, "nchw" if to_cl else "nhwc")
            dst = empty_in_layout(shape, "nhwc" if to_cl else "nchw")
            src[...] = 0.5
            total += _time_ms(lambda: transpose_channels(src, dst, to_channels_last=to_cl))
    return total


def clear_plan_cache() -> None:
    """Forget every built cuDNN plan; they are rebuilt, and re-tuned, on next use.

    Examples
    --------
    >>> import cufused
    >>> cufused.clear_plan_cache()
    """
    with _plans_lock:
        _plans.clear()
