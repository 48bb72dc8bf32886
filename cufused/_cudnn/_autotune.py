"""The entry point, :func:`conv_plan`: the plan for the convolution of a call, in the layouts
its caller passes and reads, chosen on first use by timing every strategy's cuDNN plans, and
cached per problem."""

from __future__ import annotations

import functools
import threading

import numpy

from .._arrays import import_cupy
from .._cuda import capturing, release_after_devices
from .._settings import _config
from ._config import cudnn_handle, import_cudnn
from ._graphs import (ConvProblem, Strategy, _build_graph, _Part, _part_specs, runnable_plans,
                      spreads_nonfinite, strategies)
from ._plan import ConvPlan, forget_kept, release_graph_buffers, timed_replay
from .._timing import LONG_CALL_MS, issue_ms, l2_flush_buffer, random_operand, time_ms

_plans: dict[tuple, ConvPlan] = {}
_plans_lock = threading.Lock()
# How much faster (fraction of device time) direct calls must measure to turn replay off.
_REPLAY_MARGIN = 0.005
# A strategy that first converts the caller's NCHW input competes with its measured cost
# raised by this fraction: the autotuner's timing of the conversion varies between processes
# by more than the gap to a strategy that reads NCHW directly, and a pipeline that converts
# runs no faster (docs/design.rst, "Convolution plans"). A smaller margin lets the choice
# flip from process to process.
_INPUT_CONVERSION_MARGIN = 0.10


class _ShortOfMemory(Exception):
    """Every plan of a strategy that cuDNN supports was skipped for its workspace."""


# _chosen_parts' answer where every plan of a graph was skipped for its workspace.
_SHORT_OF_MEMORY = object()


def _make_plan(problem: ConvProblem, strategy: Strategy, tune: bool):
    """Build ``strategy``'s graphs and pick each one's fastest plan (or its heuristic one):
    a ConvPlan, None where cuDNN has none, or _SHORT_OF_MEMORY."""
    # The graphs keep the handle they are built with: it stays borrowed until each chosen
    # plan has resolved its backend call (_direct_executor), the last use of the graph's own.
    with cudnn_handle() as handle:
        chosen = _chosen_parts(problem, strategy, tune, handle)
    if chosen is None or chosen is _SHORT_OF_MEMORY:
        return chosen
    parts, y_shape, index = chosen
    return ConvPlan(problem, strategy, parts, y_shape, index,
                    max(p.workspace_size for p in parts))


# Where a graph's best plan so far takes ``LONG_CALL_MS`` or more, only this many of its plans
# (the first that run, in cuDNN's heuristic order) are timed: each costs at least a run of
# that length, and a graph has dozens.
_LONG_CALL_PLANS = 8


def _long(best) -> bool:
    """Whether the best plan so far takes ``LONG_CALL_MS`` or more; shorter problems time
    every plan in full, since a plan's first run may load its kernels."""
    return best is not None and best.milliseconds >= LONG_CALL_MS


def _enough_plans(best, timed: int) -> bool:
    """Whether a graph whose best plan so far is ``best``, after ``timed`` plans, is done."""
    return _long(best) and timed >= _LONG_CALL_PLANS


def _give_up_ms(best) -> float | None:
    """Beside a long best plan, a plan whose first run takes 3 times as long is not timed
    further (its first run is its time)."""
    return 3 * best.milliseconds if _long(best) else None


def _chosen_parts(problem: ConvProblem, strategy: Strategy, tune: bool, handle):
    """``(parts, y_shape, weight index)`` of ``_make_plan``, None where cuDNN has none, or
    _SHORT_OF_MEMORY where a graph's every plan that builds was skipped for its workspace."""
    cudnn = import_cudnn()
    cupy = import_cupy()
    try:
        specs, y_shape, index = _part_specs(problem, strategy)
        graphs = {}
        for spec in specs:
            if spec.graph_key() not in graphs:
                graphs[spec.graph_key()] = _build_graph(spec, problem.precision, handle)
    except Exception:  # noqa: BLE001 - cuDNN reports "not supported" in several ways
        return None
    index = None if index is None else cupy.asarray(index)
    if tune:
        x = random_operand(problem.x_shape, strategy.x_layout)
        w = random_operand((int(index.size),) if index is not None else problem.w_shape,
                    "nchw" if index is not None else strategy.x_layout)
        b = random_operand((problem.y_shape[1],))
        y = cupy.empty(y_shape, dtype=cupy.float32)
    parts, built = [], set()
    for spec in specs:
        graph, tensors = graphs[spec.graph_key()]
        best, short_of_memory, timed = None, False, 0
        if tune and spec.graph_key() not in built:
            graph.build_plans(cudnn.build_plan_policy.ALL)
            built.add(spec.graph_key())
        for i in runnable_plans(spec, graph):
            if _enough_plans(best, timed):
                break
            try:
                if not tune:
                    graph.build_plan_at_index(i)
                part = _Part(spec, graph, tensors, i, graph.get_workspace_size_plan_at_index(i))
                if not tune:
                    best = part
                    break
                ws = cupy.empty(max(part.workspace_size, 1), dtype=cupy.uint8)
                part.milliseconds = time_ms(lambda p=part, ws=ws: p.execute(
                    x.data.ptr, w.data.ptr, y.data.ptr, b.data.ptr, ws.data.ptr, handle),
                    give_up_ms=_give_up_ms(best))
            except cupy.cuda.memory.OutOfMemoryError:  # its workspace does not fit
                short_of_memory = True
                continue
            except Exception:  # noqa: BLE001 - a plan that did not build or run is skipped
                continue
            timed += 1
            if best is None or part.milliseconds < best.milliseconds:
                best = part
        if best is None:
            return _SHORT_OF_MEMORY if short_of_memory else None
        best.spreads_nonfinite = spreads_nonfinite(spec, problem.precision, handle, graph,
                                                   best.plan_index)
        best.resolve_direct()
        parts.append(best)
    return parts, y_shape, index


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
        if capturing(cupy.cuda.get_current_stream()):
            # Building times plans with synchronizing events, which a capture refuses: every
            # candidate would fail and the problem would be remembered as unsupported.
            raise RuntimeError("a convolution plan cannot be built while the stream is being "
                               "captured into a CUDA graph: make the same call once before "
                               "capturing")
        with _plans_lock:
            plan = _plans.get(key, False)
            if plan is False:
                try:
                    plan = _choose_fitting(problem, convert_input, convert_output,
                                           accept_classes, tune, pins)
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


def _choose_fitting(problem, convert_input, convert_output, accept_classes, tune,
                    pins) -> ConvPlan:
    """:func:`_choose`; where the timing operands of a problem near the device's memory do
    not fit beside the caller's, the first plan that builds, untimed (once the failed
    attempt's operands are freed)."""
    try:
        return _choose(problem, convert_input, convert_output, accept_classes, tune, pins)
    except (import_cupy().cuda.memory.OutOfMemoryError, _ShortOfMemory):
        if not tune:
            raise
    return _choose(problem, convert_input, convert_output, accept_classes, False, pins)


def _choose(problem, convert_input, convert_output, accept_classes, tune, pins) -> ConvPlan:
    found = _pinned(strategies(problem, accept_classes or convert_output), pins)
    if not tune and pins is None:  # the first strategy, in order, that builds; pinned ones
        found = [s for s in found if not s.bias_in_graph] or found  # as pinned
    best, best_score, candidates, short_of_memory = None, float("inf"), {}, False
    for strategy in found:
        plan = _make_plan(problem, strategy, tune)
        if plan is _SHORT_OF_MEMORY:
            short_of_memory = True
            continue
        if plan is None:
            continue
        if not tune:
            best = plan
            break
        x = random_operand(problem.x_shape, "nchw" if convert_input else strategy.x_layout)
        w = random_operand(problem.w_shape)
        b = random_operand((problem.y_shape[1],)) if problem.bias else None
        plan.milliseconds = sum(p.milliseconds for p in plan.parts)
        call = functools.partial(plan.apply, x, w, bias=b, convert_output=convert_output)
        plan.cost = time_ms(call)
        candidates[strategy.label] = (plan.milliseconds, plan.cost)
        score = strategy_score(plan.cost, strategy, convert_input)
        if score < best_score:
            best, best_call, best_score = plan, call, score
    if best is None:
        if short_of_memory:  # not unsupported: _choose_fitting chooses untimed
            raise _ShortOfMemory(problem)
        raise UnsupportedConvolution(f"cuDNN supports no plan for this convolution: {problem}")
    best.candidates = candidates
    # Also for a plan whose output feeds a fused pass: the pipeline's argument checks are
    # short enough that its head start still hides a direct call's host work, so the choice
    # made from the convolution alone holds inside the pipeline (docs/design.rst).
    if tune and _config["replay"]:
        _decide_replay(best, best_call)
    return best


def _decide_replay(plan: ConvPlan, call, rounds: int = 11) -> None:
    """Let ``plan`` replay CUDA graphs of warm calls unless direct calls measure faster by
    more than they cost the host (:func:`_direct_wins`).

    A replay saves host time, which costs device time only where the device would wait for
    the host; but a captured plan can also run slower on the device than issued directly
    (B's FFT data-gradient plan, whose kernels overlap on several streams in another order
    when captured: docs/design.rst). ``call`` (the autotuner's operands) is timed both ways,
    alternately, one call at a time after an L2 flush, as a call that follows other work
    runs: there a direct call's host work counts where the device waits for it. (Back to
    back, which hides all host work, such a plan's two ways are within noise and the choice
    would not be stable between processes.) The host time of issuing each call is measured
    beside it.
    """
    flush = l2_flush_buffer()
    times = {True: [], False: []}
    issue = {True: [], False: []}
    for _ in range(rounds):
        for replay in (True, False):
            with timed_replay(replay):
                times[replay].append(time_ms(call, repeat=1, batch=1, flush=flush))
                issue[replay].append(issue_ms(call))
    plan._calls.clear()
    replayed, direct, replayed_issue, direct_issue = (
        float(numpy.median(t)) for t in (times[True], times[False], issue[True], issue[False]))
    # The graphs of the autotuner's operands go, and with them replay where direct wins.
    plan.drop_replays(keep_replaying=not _direct_wins(replayed, direct, replayed_issue,
                                                      direct_issue))


def _direct_wins(replayed_ms: float, direct_ms: float, replayed_issue_ms: float,
                 direct_issue_ms: float) -> bool:
    """Whether direct calls beat replayed ones: by more than ``_REPLAY_MARGIN`` of the device
    time, and by more device time than the host time they add.

    A policy that favours replay: the flushed single-call times already hold whatever part of
    a direct call's host work the device waits for, and the host time is charged once more,
    because it is what other work of the process waits for (the calls of another GPU's
    thread, the next batch's preparation). A direct call that saves the device less than it
    costs the host is no win (B's FFT plan: a small device saving for far more host time than
    a graph launch; figures in docs/design.rst)."""
    gain = replayed_ms - direct_ms
    return gain > _REPLAY_MARGIN * replayed_ms and gain > direct_issue_ms - replayed_issue_ms


# What a higher layer caches on top of the plans (its clear function), cleared with them.
_clear_hooks: list = []


def on_clear_plan_cache(hook) -> None:
    """Call ``hook()`` whenever the plan cache is cleared."""
    _clear_hooks.append(hook)


def clear_plan_cache() -> None:
    """Forget every built cuDNN plan, and the CUDA graphs of warm calls that ran them; they
    are rebuilt, and re-tuned, on next use. The plans that calls recorded into the caller's
    own CUDA-graph captures ran stay until :func:`cufused.clear_caches`.

    Examples
    --------
    >>> import cufused
    >>> cufused.clear_plan_cache()
    """
    with _plans_lock:
        dropped = list(_plans.items())
        _plans.clear()
    # A call queued on another stream than the one a plan's memory (the sub-pixel weight
    # index) was allocated on may still read it.
    release_after_devices({key[0] for key, _ in dropped}, dropped)
    forget_kept()
    for hook in _clear_hooks:
        hook()
    release_graph_buffers()  # the dropped graphs' buffers, after their releases
