"""cuDNN graphs of a convolution problem: the problem, the strategies that compute it
(method, layouts, bias), each strategy's graphs (the sub-pixel split included), a graph's
building and its execution with a chosen plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

from .._layout import layout_strides
from .._subpixel import subpixel_parts, subpixel_weight_index
from ._config import import_cudnn

# (input layout, output layout) pairs tried; channels-last engines fed an NCHW input skip
# the input transpose (the fastest choice for pipeline B's TF32 convolution).
_LAYOUT_PAIRS = (("nchw", "nchw"), ("nhwc", "nhwc"), ("nchw", "nhwc"))


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
class _Operand:
    """A tensor of a cuDNN graph: its dims and strides, and where its first element sits in
    the caller's buffer (elements)."""

    dims: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    def shape_key(self) -> tuple:
        return self.dims, self.strides


@dataclass(frozen=True)
class _PartSpec:
    """One cuDNN graph of a strategy: its operands, and the convolution's geometry."""

    kind: str
    x: _Operand
    w: _Operand
    y: _Operand
    pre_padding: tuple[int, ...]
    post_padding: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    bias_strides: tuple[int, ...] | None

    def graph_key(self):
        """The fields that define the graph (parts that differ only in offsets share one)."""
        return (self.kind, self.x.shape_key(), self.w.shape_key(), self.y.shape_key(),
                self.pre_padding, self.post_padding, self.stride, self.dilation,
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
        spec = _PartSpec(problem.kind, _Operand(problem.x_shape, x_strides),
                         _Operand(problem.w_shape, layout_strides(problem.w_shape, xl)),
                         _Operand(problem.y_shape, layout_strides(problem.y_shape, yl)),
                         problem.padding, problem.padding, problem.stride, problem.dilation,
                         bias_strides)
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
            "fprop",
            _Operand((n, c_in, *part.x_size), x_strides,
                     sum(a * b for a, b in zip(part.x_start, x_strides[2:]))),
            _Operand(w_dims, layout_strides(w_dims, xl), w_offset),
            _Operand(class_shape, y_strides, i * block if len(parts) > 1 else 0),
            part.pre_padding, part.post_padding, ones, ones, None))
        w_offset += -(-int(numpy.prod(w_dims)) // _ALIGN) * _ALIGN
    if any((s.x.offset % _ALIGN) or (s.y.offset % _ALIGN) for s in specs):
        raise ValueError("a sub-pixel part would start at a misaligned address")
    index = subpixel_weight_index(problem.w_shape, problem.groups, problem.stride, parts,
                                  channels_last=xl == "nhwc", align=_ALIGN)
    return specs, y_shape, index


def _build_graph(spec: _PartSpec, precision: str, handle, deselect=()):
    """The graph of ``spec`` and its tensors, its plans from cuDNN's heuristics; in "ieee"
    without the tensor cores' plans, and without the plans of the numerical notes named in
    ``deselect``."""
    cudnn = import_cudnn()
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32,
                          handle=handle)
    x = graph.tensor(name="x", dim=list(spec.x.dims), stride=list(spec.x.strides), data_type=f32)
    w = graph.tensor(name="w", dim=list(spec.w.dims), stride=list(spec.w.strides), data_type=f32)
    conv = graph.conv_fprop if spec.kind == "fprop" else graph.conv_dgrad
    operands = {"image": x, "weight": w} if spec.kind == "fprop" else {"loss": x, "filter": w}
    y = conv(**operands, pre_padding=list(spec.pre_padding),
             post_padding=list(spec.post_padding), stride=list(spec.stride),
             dilation=list(spec.dilation), compute_data_type=f32)
    y.set_dim(list(spec.y.dims)).set_stride(list(spec.y.strides)).set_data_type(f32)
    tensors = [x, w]
    if spec.bias_strides is not None:
        b = graph.tensor(name="b", dim=[1, spec.y.dims[1]] + [1] * (len(spec.y.dims) - 2),
                         stride=list(spec.bias_strides), data_type=f32)
        y = graph.bias(input=y, bias=b)
        y.set_dim(list(spec.y.dims)).set_stride(list(spec.y.strides)).set_data_type(f32)
        tensors.append(b)
    y.set_output(True)
    tensors.append(y)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    notes = [getattr(cudnn.numerical_note, name) for name in deselect]
    if precision == "ieee":
        # Keep float32 float32: no TF32 tensor cores, no down-converted inputs.
        notes += [cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS]
    if notes:
        graph.deselect_numeric_notes(notes)
    graph.check_support()
    return graph, tensors


# The numerical notes of cuDNN's algorithms that transform their operands (FFT, Winograd): an
# infinite input meets the other values of its tile or plane there and comes back as NaN
# beyond the outputs that its products reach (semantics.rst).
_SPREADING_NOTES = ("FFT", "WINOGRAD", "WINOGRAD_TILE_4x4", "WINOGRAD_TILE_6x6",
                    "WINOGRAD_TILE_13x13")


def spreads_nonfinite(spec: _PartSpec, precision: str, handle, graph, index: int) -> bool:
    """Whether plan ``index`` of ``spec``'s ``graph`` is an FFT or Winograd algorithm's:
    the Python binding gives no plan's numerical notes, so a graph built alike with those
    notes deselected is asked to build the plan, which it refuses for such an engine. True
    where the probe lists another plan at ``index`` or fails otherwise: the outputs are then
    checked for a non-finite input, which costs a scan of the input and never changes a
    correct output."""
    cudnn = import_cudnn()
    names = [n for n in _SPREADING_NOTES if hasattr(cudnn.numerical_note, n)]
    if not names:  # a binding without the notes: every plan is taken for one that spreads
        return True
    try:
        probe, _ = _build_graph(spec, precision, handle, deselect=names)
        if probe.get_plan_name_at_index(index) != graph.get_plan_name_at_index(index):
            return True
        probe.build_plan_at_index(index)
    except Exception:  # noqa: BLE001 - cuDNN refuses a deselected plan in several ways
        return True
    return False


# Engines that fault on problems that cuDNN accepts, by the graphs they fault in: a fault ends
# the process's CUDA context, so the plan search cannot run such a plan and move on. cuDNN
# 9.19 on an H200: engine 52 of a convolution with its bias in the graph, misaligned address
# on a 2 x 6 x 2 x 1 input in 3 groups (12 x 2 x 4 x 1 weight, stride 3, padding (2, 1)).
# Engine numbers belong to the graph's pattern (the convolution alone lists other engines):
# an engine is barred in the pattern it faulted in.
_FAULTING_WITH_BIAS = frozenset({"eng52"})


def runnable_plans(spec: _PartSpec, graph) -> list[int]:
    """The indices of ``graph``'s execution plans (built from ``spec``) that may run, in
    cuDNN's order: every one but those of an engine that faults in such a graph."""
    barred = _FAULTING_WITH_BIAS if spec.bias_strides is not None else frozenset()
    return [i for i in range(graph.get_execution_plan_count())
            if not barred or _engine_name(graph, i) not in barred]


def _engine_name(graph, index: int) -> str:
    """The engine of plan ``index`` ("eng52" of "eng52_k2=4"); "" where cuDNN names none
    (the plan is then tried, as any other)."""
    try:
        return graph.get_plan_name_at_index(index).split("_")[0]
    except Exception:  # noqa: BLE001 - cuDNN reports an unnamed plan in several ways
        return ""


@dataclass
class _Part:
    """A built graph with its chosen execution plan, and where its operands start."""

    spec: _PartSpec
    graph: Any
    tensors: list  # the graph's x, w, [bias], y tensors: keys of the variant pack
    plan_index: int
    workspace_size: int
    milliseconds: float = float("nan")
    spreads_nonfinite: bool = False  # an FFT or Winograd plan (see spreads_nonfinite)
    _direct: Any = None  # resolved backend call (see _direct_executor), False when unavailable

    def resolve_direct(self) -> None:
        """Resolve the backend call of the chosen plan (see ``_direct_executor``)."""
        self._direct = _direct_executor(self) or False

    def execute(self, x_ptr: int, w_ptr: int, y_ptr: int, b_ptr: int, ws_ptr: int,
                handle) -> None:
        spec = self.spec
        ptrs = [x_ptr + 4 * spec.x.offset, w_ptr + 4 * spec.w.offset]
        if spec.bias_strides is not None:
            ptrs.append(b_ptr)
        ptrs.append(y_ptr + 4 * spec.y.offset)
        if self._direct is None:
            self.resolve_direct()
        if self._direct:
            execute, cpp_index, uids = self._direct
            execute(dict(zip(uids, ptrs)), ws_ptr, cpp_index, handle.backend_handle)
            return
        self.graph.execute_plan_at_index(dict(zip(self.tensors, ptrs)), ws_ptr or None,
                                         self.plan_index, handle=handle)


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
