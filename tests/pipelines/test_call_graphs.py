"""Whole-call CUDA graphs of warm pipeline calls: equal to direct calls over reused buffers,
new values, options and streams; launched from the raw arguments where the graph reads only
the caller's arrays; bounded; off with graph replay off; host time."""

from __future__ import annotations

import numpy as np
import pytest

import cufused
from cufused import _call_graphs

from cufused.bench.timing import host_us_per_call

from conftest import GPU, PIPELINE_CASES, assert_close, assert_same_as_direct, to_gpu

pytestmark = pytest.mark.gpu

if GPU:
    import cupy as cp

PIPELINES = {case: (getattr(cufused, name), make) for case, (name, make) in PIPELINE_CASES.items()}


@pytest.fixture
def fresh():
    cufused.clear_caches()
    yield
    cufused.clear_caches()


@pytest.fixture
def launches(monkeypatch):
    """The number of whole-call graph launches so far (a one-element list)."""
    count = [0]
    launch = _call_graphs._launch

    def counted(entry, stream):
        count[0] += 1
        launch(entry, stream)

    monkeypatch.setattr(_call_graphs, "_launch", counted)
    return count


@pytest.fixture
def captures(monkeypatch):
    """The whole-call captures so far (a list with one entry per capture)."""
    count = []
    capture = _call_graphs._capture

    def counted(*args):
        count.append(1)
        return capture(*args)

    monkeypatch.setattr(_call_graphs, "_capture", counted)
    return count


def _direct(fn, *args, **kwargs):
    from cufused._settings import plan_options

    with plan_options(replay=False):
        return fn(*args, **kwargs)


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_warm_calls_equal_direct_calls(rng, layout, fresh, launches, case, precision):
    # Every pinned convolution layout (NCHW, channels-last, NCHW in / channels-last out, the
    # sub-pixel split), so that each fused-pass variant is captured.
    fn, make = PIPELINES[case]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    kwargs = dict(kwargs, precision=precision)
    out = cp.full(fn(*args, **kwargs).shape, cp.nan, dtype=cp.float32)
    for i in range(5):  # counted, captured, replayed; new input values each time
        args[0][...] = cp.asarray(rng.random(args[0].shape), dtype=cp.float32)
        assert fn(*args, **kwargs, out=out) is out
        assert_same_as_direct(out, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))
    assert launches[0] >= 3


@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_unfused_warm_calls(rng, quick_plans, fresh, launches, case):
    fn, make = PIPELINES[case]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    kwargs = dict(kwargs, method="unfused")
    out = cp.empty(fn(*args, **kwargs).shape, dtype=cp.float32)
    for _ in range(4):
        args[0][...] = cp.asarray(rng.random(args[0].shape), dtype=cp.float32)
        fn(*args, **kwargs, out=out)
        assert_same_as_direct(out, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))
    assert launches[0] >= 2


def test_new_parameter_values(rng, quick_plans, fresh, launches):
    # New weight values in place, and scale as a Python number (a temporary array, likely at
    # the same address each call) that changes: every call computes with the current values.
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    x, weight, *params = to_gpu(*args)
    params[-1] = 2.0
    out = cp.empty(fn(x, weight, *params, **kwargs).shape, dtype=cp.float32)
    for scale in (2.0, 3.0, -1.5, 3.0, 2.0, 0.5):
        weight[...] = cp.asarray(rng.standard_normal(weight.shape) * 0.3, dtype=cp.float32)
        params[-1] = scale
        fn(x, weight, *params, **kwargs, out=out)
        ref = _direct(fn, x, weight, *params, **kwargs)
        assert_same_as_direct(out, ref, _direct(fn, x, weight, *params, **kwargs))
    assert launches[0] >= 1


def test_every_operand_and_option_is_keyed(rng, quick_plans, fresh, launches):
    # One allocation read as x in two layouts and two shapes, other options, one out per
    # output shape: each warm call equals a direct call on the same operands.
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng, n=2, h=16, w=16)
    params = to_gpu(*args[1:])
    mem = cp.cuda.alloc(2 * 5 * 16 * 16 * 4)
    nchw = cp.ndarray((2, 5, 16, 16), cp.float32, memptr=mem)
    nhwc = cp.ndarray((2, 16, 16, 5), cp.float32, memptr=mem).transpose(0, 3, 1, 2)
    small = cp.ndarray((1, 5, 16, 16), cp.float32, memptr=mem)
    outs = {}
    for _ in range(3):
        for x in (nchw, nhwc, small):
            for clamp_max in (0.7, 0.2):
                x[...] = cp.asarray(rng.random(x.shape), dtype=cp.float32)
                opts = dict(kwargs, clamp_max=clamp_max)
                out = outs.setdefault(x.shape, cp.empty(fn(x, *params, **opts).shape,
                                                        dtype=cp.float32))
                for _ in range(3):
                    fn(x, *params, **opts, out=out)
                assert_same_as_direct(out, _direct(fn, x, *params, **opts),
                                      _direct(fn, x, *params, **opts))
    assert launches[0] >= 12


def test_other_stream(rng, quick_plans, fresh, launches):
    fn, make = PIPELINES["C"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    ref = _direct(fn, *args, **kwargs)
    out, other = cp.empty_like(ref), cp.empty_like(ref)
    stream = cp.cuda.Stream(non_blocking=True)
    for _ in range(3):
        fn(*args, **kwargs, out=out)
        cp.cuda.get_current_stream().synchronize()
        with stream:
            fn(*args, **kwargs, out=other)
        stream.synchronize()
        assert_same_as_direct(out, ref, _direct(fn, *args, **kwargs))
        assert_same_as_direct(other, ref, _direct(fn, *args, **kwargs))
    assert launches[0] >= 2


def test_bounded_and_cleared(rng, quick_plans, fresh, monkeypatch):
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    monkeypatch.setattr(_call_graphs, "MAX_GRAPHS", 2)
    outs = [cp.empty(fn(*args, **kwargs).shape, cp.float32) for _ in range(4)]
    for out in outs:  # four keys (four outputs), two calls each
        fn(*args, **kwargs, out=out)
        fn(*args, **kwargs, out=out)
    assert len(_call_graphs._graphs) == 2
    cufused.clear_caches()
    assert not _call_graphs._graphs


def test_cycling_over_more_keys_than_the_cache_holds(rng, quick_plans, fresh, monkeypatch,
                                                     launches, captures):
    # Four outputs in turn with room for two graphs (as a loop over Dask's chunks): each key
    # is captured at most once; a key whose graph was dropped runs directly from then on,
    # the two graphs that stay are replayed, and every result equals a direct call.
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    monkeypatch.setattr(_call_graphs, "MAX_GRAPHS", 2)
    outs = [cp.full(fn(*args, **kwargs).shape, cp.nan, cp.float32) for _ in range(4)]
    # Each sizing call above ran with an output at the address that its out then took, so
    # its key is counted already: start the count afresh.
    _call_graphs._counts.clear()
    for cycle in range(5):
        for out in outs:
            out[...] = cp.nan
            args[0][...] = cp.asarray(rng.random(args[0].shape), dtype=cp.float32)
            fn(*args, **kwargs, out=out)
            assert_same_as_direct(out, _direct(fn, *args, **kwargs),
                                  _direct(fn, *args, **kwargs))
    assert len(captures) == 4
    assert len(_call_graphs._graphs) == 2 and len(_call_graphs._direct_keys) == 2
    # Counted in the first cycle, captured (each launched once) in the second, then the two
    # kept keys in the last three cycles.
    assert launches[0] == 4 + 2 * 3


def test_large_temporaries_run_directly(rng, quick_plans, fresh, monkeypatch, captures):
    fn, make = PIPELINES["B"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    monkeypatch.setattr(_call_graphs, "MAX_TEMPORARY_FRACTION", 0.0)
    out = cp.empty(fn(*args, **kwargs).shape, cp.float32)
    for _ in range(3):
        fn(*args, **kwargs, out=out)
    assert captures == [1]  # captured once, rejected, then direct
    assert not _call_graphs._graphs and len(_call_graphs._direct_keys) == 1
    assert_same_as_direct(out, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))


def test_replay_off_runs_directly(rng, quick_plans, fresh):
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    for _ in range(3):
        _direct(fn, *args, **kwargs)
    assert not _call_graphs._graphs


def test_running_buffers_updated_by_every_call(rng, quick_plans, fresh, launches):
    fn, make = PIPELINES["B"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    mean, var = cp.zeros(8, cp.float32), cp.ones(8, cp.float32)
    ref_mean, ref_var = mean.copy(), var.copy()
    out = cp.empty(fn(*args, **kwargs).shape, dtype=cp.float32)
    for _ in range(4):
        fn(*args, **kwargs, running_mean=mean, running_var=var, out=out)
        _direct(fn, *args, **kwargs, running_mean=ref_mean, running_var=ref_var)
        assert_close(mean.get(), ref_mean.get(), 1e-6)
        assert_close(var.get(), ref_var.get(), 1e-6)
    assert launches[0] >= 2


def test_warm_calls_launch_from_their_raw_arguments(rng, quick_plans, fresh, launches,
                                                    monkeypatch):
    # From the third call the public function launches the graph without checking its
    # arguments again; new values at the same addresses reach the result, and a new default
    # precision or another stream is another key (checked again, equal to a direct call).
    from cufused.pipelines import pipeline_a

    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    out = cp.full(fn(*args, **kwargs).shape, cp.nan, dtype=cp.float32)
    for _ in range(3):
        fn(*args, **kwargs, out=out)
    assert len(_call_graphs._shortcuts) == 1
    checked = []
    check = pipeline_a.check_pipeline_pool
    monkeypatch.setattr(pipeline_a, "check_pipeline_pool", lambda *a, **k: checked.append(1)
                        or check(*a, **k))
    before = launches[0]
    args[0][...] = cp.asarray(rng.random(args[0].shape), dtype=cp.float32)
    assert fn(*args, **kwargs, out=out) is out
    assert not checked and launches[0] == before + 1
    assert_same_as_direct(out, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))
    checked.clear()  # the direct calls' checks
    with cufused.default_precision("tf32"):
        for _ in range(3):
            fn(*args, **kwargs, out=out)
        assert len(checked) == 2  # counted, captured; then launched from the raw arguments
        assert_same_as_direct(out, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))
    checked.clear()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn(*args, **kwargs, out=out)
        assert len(checked) == 1
        assert_same_as_direct(out, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))


def _check_calls_without_out(fn, args, kwargs, rng, launches, monkeypatch) -> None:
    """Calls without ``out`` in a loop that rebinds each result (``y = fn(x)``: the last
    result lives until the call returns, so two buffers take turns): once both buffers' graphs
    are captured, a call allocates its result as the checked call does and launches the graph
    that writes it, without checking its arguments; each result is a new array, and new input
    values at the same addresses reach it (equal to direct calls)."""
    # Made before the loop, so that the loop allocates nothing but its results.
    inputs = [cp.asarray(rng.random(args[0].shape), dtype=cp.float32) for _ in range(3)]
    y = fn(*args, **kwargs)
    snapshots = [cp.full(y.shape, cp.nan, dtype=y.dtype) for _ in inputs]
    # Enough calls for each buffer the pool hands out in turn to be seen twice (captured).
    for _ in range(12):
        y = fn(*args, **kwargs)
    assert len(_call_graphs._fresh_shortcuts) == 1
    checked = []
    check = _call_graphs._checked_call
    monkeypatch.setattr(_call_graphs, "_checked_call",
                        lambda *a: checked.append(1) or check(*a))
    before = launches[0]
    for x, snapshot in zip(inputs, snapshots):
        args[0][...] = x
        previous = y
        y = fn(*args, **kwargs)
        assert y is not previous and y.data.ptr != previous.data.ptr
        del previous
        snapshot[...] = y
    assert not checked and launches[0] == before + len(inputs)
    monkeypatch.undo()
    for x, snapshot in zip(inputs, snapshots):
        args[0][...] = x
        assert_same_as_direct(snapshot, _direct(fn, *args, **kwargs),
                              _direct(fn, *args, **kwargs))


@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_calls_without_out_launch_from_their_raw_arguments(rng, quick_plans, fresh, launches,
                                                           monkeypatch, case):
    fn, make = PIPELINES[case]
    args, kwargs = make(rng)
    _check_calls_without_out(fn, to_gpu(*args), kwargs, rng, launches, monkeypatch)


@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_calls_without_out_keep_every_result(rng, quick_plans, fresh, case):
    # Keys remembered in each default precision (a key each), then calls whose results all
    # stay alive: each gets a buffer of its own (a graph's buffer launched, a new one
    # checked), none overwritten by a later call, each equal to a direct call.
    fn, make = PIPELINES[case]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    precisions = ("ieee", "tf32")
    for precision in precisions:
        with cufused.default_precision(precision):
            y = None
            for _ in range(6):
                y = fn(*args, **kwargs)
            del y
    assert {key[-1] for key in _call_graphs._fresh_shortcuts} == set(precisions)
    kept = []
    for i in range(6):
        args[0][...] = cp.asarray(rng.random(args[0].shape), dtype=cp.float32)
        with cufused.default_precision(precisions[i % 2]):
            kept.append((args[0].copy(), fn(*args, **kwargs)))
    assert len({y.data.ptr for _, y in kept}) == len(kept)
    for i, (x, y) in enumerate(kept):
        args[0][...] = x
        with cufused.default_precision(precisions[i % 2]):
            assert_same_as_direct(y, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))


def test_running_buffers_updated_by_every_call_without_out(rng, quick_plans, fresh, launches,
                                                           monkeypatch):
    # Calls launched from their raw arguments update the running statistics once each: after
    # as many direct calls on copies, both are equal.
    fn, make = PIPELINES["B"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    mean, var = cp.zeros(8, cp.float32), cp.ones(8, cp.float32)
    stats = dict(running_mean=mean, running_var=var)
    y = None
    for _ in range(12):
        y = fn(*args, **kwargs, **stats)
    checked = []
    check = _call_graphs._checked_call
    monkeypatch.setattr(_call_graphs, "_checked_call",
                        lambda *a: checked.append(1) or check(*a))
    before = launches[0]
    for _ in range(4):
        y = fn(*args, **kwargs, **stats)
    assert not checked and launches[0] == before + 4
    del y
    ref_mean, ref_var = cp.zeros(8, cp.float32), cp.ones(8, cp.float32)
    for _ in range(16):
        _direct(fn, *args, **kwargs, running_mean=ref_mean, running_var=ref_var)
    assert_close(mean.get(), ref_mean.get(), 1e-6)
    assert_close(var.get(), ref_var.get(), 1e-6)


def test_calls_without_out_past_the_buffer_cap(rng, quick_plans, fresh, captures, monkeypatch):
    # Past _MAX_FRESH_BUFFERS results given graphs, a call whose new buffer has none is checked
    # and runs directly (no capture that could drop other graphs), and is right.
    monkeypatch.setattr(_call_graphs, "_MAX_FRESH_BUFFERS", 1)
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    y = None
    for _ in range(12):
        y = fn(*args, **kwargs)
    (entry,) = _call_graphs._fresh_shortcuts.values()
    assert len(entry[4]) == 1
    captured = len(captures)
    kept = []
    for _ in range(3):
        args[0][...] = cp.asarray(rng.random(args[0].shape), dtype=cp.float32)
        kept.append((args[0].copy(), fn(*args, **kwargs)))
    assert len(captures) == captured and len(entry[4]) == 1
    for x, y in kept:
        args[0][...] = x
        assert_same_as_direct(y, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))


def test_calls_without_out_past_a_temporary(rng, quick_plans, fresh, launches):
    # A number for scale becomes a device array in each checked call: no launch from the raw
    # arguments of a call without out either.
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    args[5] = 1.5
    y = None
    for _ in range(5):
        args[0][...] = cp.asarray(rng.random(args[0].shape), dtype=cp.float32)
        y = fn(*args, **kwargs)
        assert_same_as_direct(y, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))
    assert launches[0] >= 2 and not _call_graphs._fresh_shortcuts


def test_negative_zero_is_another_key(rng, quick_plans, fresh):
    # -0.0 == 0.0 as floats, but a clamp to -0.0 writes -0.0 where a clamp to 0.0 writes 0.0.
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    out = cp.empty(fn(*args, **kwargs).shape, cp.float32)
    for _ in range(3):
        fn(*args, **dict(kwargs, clamp_min=0.0), out=out)
    fn(*args, **dict(kwargs, clamp_min=-0.0), out=out)
    ref = _direct(fn, *args, **dict(kwargs, clamp_min=-0.0))
    assert bool(cp.signbit(ref).any())  # the clamp to -0.0 wrote some
    cp.testing.assert_array_equal(cp.signbit(out), cp.signbit(ref))


def test_default_precision_changed_during_a_call(rng, quick_plans, fresh, monkeypatch):
    # Another thread sets the process default while a call is being checked: the call runs
    # at the default its key holds, and its graph is remembered under that key only.
    from cufused._ops import convolution

    x, w = to_gpu(rng.random((2, 3, 9, 8)), rng.random((4, 3, 3, 3)))
    out = cp.empty((2, 4, 9, 8), cp.float32)
    with cufused.default_precision("tf32"):
        for _ in range(3):
            cufused.conv2d(x, w, padding=1, out=out)
    check = convolution.cached_conv_args

    def flipping(*a, **k):
        cufused.set_default_precision("tf32")
        return check(*a, **k)

    monkeypatch.setattr(convolution, "cached_conv_args", flipping)
    try:
        for _ in range(3):
            cufused.set_default_precision("ieee")
            cufused.conv2d(x, w, padding=1, out=out)
    finally:
        cufused.set_default_precision("ieee")
    monkeypatch.undo()
    for raw, graph in _call_graphs._shortcuts.items():  # precision: bound in the graph's key
        assert ("str", raw[-1]) in graph[1], (raw[-1], graph[1])
    assert any(raw[-1] == "ieee" for raw in _call_graphs._shortcuts)
    cufused.conv2d(x, w, padding=1, out=out)
    assert_same_as_direct(out, _direct(cufused.conv2d, x, w, padding=1),
                          _direct(cufused.conv2d, x, w, padding=1))


def test_settings_changed_during_a_capture(rng, quick_plans, fresh, monkeypatch):
    # Another thread changes a plan setting while a call is captured: the capture may have
    # read either setting, so its graph is kept under neither key, and the call runs directly.
    from cufused._settings import _config

    x, w = to_gpu(rng.random((2, 3, 9, 8)), rng.random((4, 3, 3, 3)))
    out = cp.empty((2, 4, 9, 8), cp.float32)
    capture = _call_graphs._capture

    def changing(*args):
        _config["replay"] = False  # a setting that the capture itself survives
        entry = capture(*args)
        captured.append(entry is not None)
        return entry

    captured: list[bool] = []
    monkeypatch.setattr(_call_graphs, "_capture", changing)
    try:
        for _ in range(3):
            _config["replay"] = True
            cufused.conv2d(x, w, padding=1, out=out)
    finally:
        _config["replay"] = True
    assert captured == [True] and not _call_graphs._graphs
    assert_same_as_direct(out, _direct(cufused.conv2d, x, w, padding=1),
                          _direct(cufused.conv2d, x, w, padding=1))


def test_no_launch_from_raw_arguments_past_a_temporary(rng, quick_plans, fresh, launches):
    # A number for scale becomes a device array in each checked call: the graph reads the
    # one of the call it captured, so only checked calls (which make it again) launch it.
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    args[5] = 1.5
    out = cp.empty(fn(*args, **kwargs).shape, cp.float32)
    for _ in range(4):
        args[0][...] = cp.asarray(rng.random(args[0].shape), dtype=cp.float32)
        fn(*args, **kwargs, out=out)
        assert_same_as_direct(out, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))
    assert launches[0] >= 2 and not _call_graphs._shortcuts


def _threads_calling(case: str, rng, outs_per_thread: int, rounds: int) -> tuple:
    """Four threads, each on its own stream, call pipeline ``case`` on shared inputs, ``rounds``
    times into each of its ``outs_per_thread`` outs (captures, launches and evictions race on
    the shared cache); returns the outs and the reference. Every call must succeed."""
    import threading

    fn, make = PIPELINES[case]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    ref = _direct(fn, *args, **kwargs)
    outs = [[cp.full(ref.shape, cp.nan, dtype=cp.float32) for _ in range(outs_per_thread)]
            for _ in range(4)]
    errors = []

    def work(mine):
        try:
            with cp.cuda.Stream(non_blocking=True) as stream:
                for _ in range(rounds):
                    for out in mine:
                        fn(*args, **kwargs, out=out)
                stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(mine,)) for mine in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for out in (o for mine in outs for o in mine):
        assert_same_as_direct(out, ref, _direct(fn, *args, **kwargs))


def test_threads(rng, quick_plans, fresh, launches):
    # Four threads call the same pipeline, each into its own out on its own stream (keys
    # differ by out and stream).
    _threads_calling("C", rng, outs_per_thread=1, rounds=6)
    assert launches[0] >= 4 * 4 and len(_call_graphs._shortcuts) == 4


def test_threads_evicting_while_others_capture(rng, quick_plans, fresh, monkeypatch):
    # More keys than the cache holds: graphs are dropped (their release waits for the device)
    # while other threads capture theirs, which a device's synchronization during a capture
    # would break (an error in the dropping thread, the capturing key run directly from then
    # on).
    monkeypatch.setattr(_call_graphs, "MAX_GRAPHS", 2)
    _threads_calling("A", rng, outs_per_thread=3, rounds=4)
    assert len(_call_graphs._graphs) <= 2


def test_devices(rng, quick_plans, fresh, launches):
    # The same call on each device, operands there: a key per device, each result its own.
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two devices")
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    for device in (0, 1, 0, 1):
        with cp.cuda.Device(device):
            gargs = to_gpu(*args)
            out = cp.full(fn(*gargs, **kwargs).shape, cp.nan, dtype=cp.float32)
            for _ in range(3):
                fn(*gargs, **kwargs, out=out)
            assert_same_as_direct(out, _direct(fn, *gargs, **kwargs),
                                  _direct(fn, *gargs, **kwargs))
    assert {key[4] for key in _call_graphs._graphs} == {0, 1}


def test_arrays_on_another_device(rng, quick_plans, fresh):
    # Operands on device 1 while device 0 is current: every call runs on the arrays' device
    # (results there, device 0 still current after it), warm calls and prepared calls too,
    # and gives what the same call gives with device 1 current.
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two devices")
    x4 = rng.standard_normal((2, 4, 9, 9), dtype=np.float32)
    calls = {PIPELINE_CASES[case][0]: (fn, make(rng)) for case, (fn, make) in PIPELINES.items()}
    calls.update({
        "conv2d": (cufused.conv2d, ((x4, rng.standard_normal((3, 4, 3, 3), np.float32)), {})),
        "max_pool2d": (cufused.max_pool2d, ((x4,), {"kernel_size": 2})),
        "group_norm": (cufused.group_norm, ((x4,), {"num_groups": 2})),
        "batch_norm": (cufused.batch_norm, ((x4,), {"activation": "tanh"})),
        "softmax": (cufused.softmax, ((x4,), {"axis": (2, 3)})),
    })
    for name, (fn, (args, kwargs)) in calls.items():
        with cp.cuda.Device(1):
            gargs = to_gpu(*args)
            want = fn(*gargs, **kwargs).get()
            out = cp.full(want.shape, cp.nan, dtype=cp.float32)
        with cp.cuda.Device(0):
            for _ in range(3):
                got = fn(*gargs, **kwargs)
                assert got.device.id == 1 and cp.cuda.runtime.getDevice() == 0, name
                assert_close(got.get(), want, 1e-5)
                assert fn(*gargs, **kwargs, out=out) is out
                assert_close(out.get(), want, 1e-5)
            step = cufused.prepare(fn, *gargs, **kwargs)
            assert_close(step().get(), want, 1e-5)
            assert cp.cuda.runtime.getDevice() == 0, name


@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_host_time_of_a_warm_call(rng, quick_plans, fresh, case):
    # Issue 24's target: a warm functional pipeline call costs the host at most 40 us
    # (out given, back-to-back calls without synchronizing, small inputs, median of rounds).
    fn, make = PIPELINES[case]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    out = cp.empty(fn(*args, **kwargs).shape, cp.float32)
    host_us = host_us_per_call(lambda: fn(*args, **kwargs, out=out), calls=50, repeat=15)
    print(f"{case}: warm call {host_us:.1f} us of host time")
    assert host_us <= 40.0


@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_host_time_of_a_warm_call_without_out(rng, quick_plans, fresh, case):
    # The same bound for a call that allocates its result (each result dropped before the
    # next call, as a loop that discards them does).
    fn, make = PIPELINES[case]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    for _ in range(3):
        fn(*args, **kwargs)
    host_us = host_us_per_call(lambda: fn(*args, **kwargs), calls=50, repeat=15)
    print(f"{case}: warm call without out {host_us:.1f} us of host time")
    assert host_us <= 40.0


def test_memory_budget_evicts_the_oldest(rng, quick_plans, fresh, monkeypatch):
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    monkeypatch.setattr(_call_graphs, "MAX_TOTAL_FRACTION", 1e-15)  # less than one graph
    first, second = (cp.empty(fn(*args, **kwargs).shape, cp.float32) for _ in range(2))
    for out in (first, second, first, second):
        for _ in range(2):
            fn(*args, **kwargs, out=out)
        assert_same_as_direct(out, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))
    # Only the newest graph stays (a graph is never evicted by its own insertion).
    assert len(_call_graphs._graphs) == 1
    assert next(iter(_call_graphs._graphs))[3][1] == second.data.ptr


BLOCKS = [
    ("conv2d", lambda rng: ((rng.random((2, 3, 9, 8)), rng.random((4, 3, 3, 3))),
                            dict(padding=1))),
    ("group_norm", lambda rng: ((rng.random((2, 6, 5, 7)), 3), {})),
    ("batch_norm", lambda rng: ((rng.random((4, 5, 3, 7)),), dict(training=True))),
    ("max_pool2d", lambda rng: ((rng.random((2, 3, 9, 8)), 3), dict(stride=2))),
    ("avg_pool3d", lambda rng: ((rng.random((1, 2, 6, 5, 4)), 2), {})),
    ("softmax", lambda rng: ((rng.random((2, 3, 4, 5)),), dict(axis=(2, 3)))),
]


def _block_args(rng, make):
    args, kwargs = make(rng)
    return [cp.asarray(a, dtype=cp.float32) if isinstance(a, np.ndarray) else a
            for a in args], kwargs


@pytest.mark.parametrize("name, make", BLOCKS)
def test_building_blocks_warm_calls(rng, quick_plans, fresh, launches, name, make):
    fn = getattr(cufused, name)
    args, kwargs = _block_args(rng, make)
    out = cp.empty(fn(*args, **kwargs).shape, dtype=cp.float32)
    for _ in range(4):
        args[0][...] = cp.asarray(rng.random(args[0].shape), dtype=cp.float32)
        assert fn(*args, **kwargs, out=out) is out
        assert_same_as_direct(out, _direct(fn, *args, **kwargs), _direct(fn, *args, **kwargs))
    assert launches[0] >= 2


@pytest.mark.parametrize("name, make", BLOCKS)
def test_building_blocks_calls_without_out(rng, quick_plans, fresh, launches, monkeypatch,
                                           name, make):
    fn = getattr(cufused, name)
    args, kwargs = _block_args(rng, make)
    _check_calls_without_out(fn, args, kwargs, rng, launches, monkeypatch)


@pytest.mark.parametrize("name, make", BLOCKS)
def test_host_time_of_a_warm_building_block_call(rng, quick_plans, fresh, name, make):
    # Issue 24's target: a warm building-block call costs the host at most 20 us (out given,
    # back-to-back calls without synchronizing, small inputs, median of rounds).
    fn = getattr(cufused, name)
    args, kwargs = _block_args(rng, make)
    out = cp.empty(fn(*args, **kwargs).shape, dtype=cp.float32)
    host_us = host_us_per_call(lambda: fn(*args, **kwargs, out=out), calls=50, repeat=15)
    print(f"{name}: warm call {host_us:.1f} us of host time")
    assert host_us <= 20.0
