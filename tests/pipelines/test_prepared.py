"""cufused.prepare: a call captured into a CUDA graph and replayed, bitwise equal to the
functional call; bound buffers, new data copied in, running buffers, host time; the NumPy path
and bad arguments without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import cufused

from cufused.bench.timing import host_us_per_call

from conftest import (GPU, PIPELINE_CASES, assert_close, assert_same_as_direct, pipeline_b_args,
                      to_gpu)

if GPU:
    import cupy as cp

PIPELINES = {case: (getattr(cufused, name), make) for case, (name, make) in PIPELINE_CASES.items()}


# ------------------------------------------------------------------------------- without GPU


def test_numpy_path_calls_the_function_each_time(rng):
    x = rng.random((2, 3, 6, 5)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    step = cufused.prepare(cufused.conv2d, x, w, padding=1)
    first = step()
    np.testing.assert_array_equal(first, cufused.conv2d(x, w, padding=1))
    x[...] = rng.random(x.shape)  # the bound array, new data
    np.testing.assert_array_equal(step(), cufused.conv2d(x, w, padding=1))
    assert step() is not first and step.result is None
    assert "a call each time" in repr(step)


def test_the_precision_is_the_default_when_prepared(rng):
    # A prepared call keeps the precision in force when prepare ran, with a graph or without
    # one (then each call runs the function, under whatever default is current then).
    x = rng.random((2, 3, 6, 5)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    with cufused.default_precision("tf32"):
        step = cufused.prepare(cufused.conv2d, x, w, padding=1)
        given = cufused.prepare(cufused.conv2d, x, w, precision="3xtf32")
        norm = cufused.prepare(cufused.group_norm, x, 3)
    assert step.kwargs == {"padding": 1, "precision": "tf32"}
    assert given.kwargs == {"precision": "3xtf32"}
    assert norm.kwargs == {}  # a function without a precision


def test_numpy_path_updates_running_buffers_on_each_call(rng):
    args, kwargs = pipeline_b_args(rng)
    mean, var = np.zeros(8), np.ones(8)
    step = cufused.prepare(cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm, *args,
                           **kwargs, running_mean=mean, running_var=var)
    after_first = mean.copy()  # prepare ran the call once
    step()
    ref_mean, ref_var = np.zeros(8), np.ones(8)
    for _ in range(2):
        cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
            *args, **kwargs, running_mean=ref_mean, running_var=ref_var)
    assert not np.array_equal(after_first, mean)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-12)
    np.testing.assert_allclose(var, ref_var, rtol=1e-12)


@pytest.mark.parametrize("function", [np.add, cufused.set_default_precision, cufused.prepare,
                                      "conv2d", None])
def test_only_cufused_array_functions(function):
    with pytest.raises(TypeError, match="function must be one of cufused's functions"):
        cufused.prepare(function, np.ones((1, 1, 3, 3), np.float32))


def test_bad_arguments_raise_the_calls_error(rng):
    x = rng.random((1, 2, 5, 5)).astype(np.float32)
    with pytest.raises(ValueError, match="stride"):
        cufused.prepare(cufused.conv2d, x, np.ones((3, 2, 3, 3), np.float32), stride=0)


# ---------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_pipelines_bitwise_equal_to_the_functional_call(rng, quick_plans, case, precision):
    fn, make = PIPELINES[case]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    kwargs = dict(kwargs, precision=precision)
    step = cufused.prepare(fn, *args, **kwargs)
    for _ in range(3):  # new data in the bound input, each replay against a functional call
        got = step().copy()
        ref = fn(*args, **kwargs)
        assert_same_as_direct(got, ref, fn(*args, **kwargs))
        args[0][...] = cp.asarray(rng.random(args[0].shape), dtype=cp.float32)
    assert step() is step.result


@pytest.mark.gpu
def test_out_is_the_result_and_other_work_does_not_disturb_it(rng, quick_plans):
    fn, make = PIPELINES["A"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    out = cp.full(fn(*args, **kwargs).shape, cp.nan, dtype=cp.float32)
    step = cufused.prepare(fn, *args, **kwargs, out=out)
    # Other calls allocate and free in between: the graph's temporaries are its own.
    for _ in range(3):
        other = [fn(*to_gpu(*make(rng)[0]), **kwargs) for _ in range(2)]
        assert step() is out
        assert_same_as_direct(out, fn(*args, **kwargs), fn(*args, **kwargs))
        del other


@pytest.mark.gpu
def test_running_buffers_updated_by_every_replay(rng, quick_plans):
    fn, make = PIPELINES["B"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    mean, var = cp.zeros(8, cp.float32), cp.ones(8, cp.float32)
    ref_mean, ref_var = mean.copy(), var.copy()
    step = cufused.prepare(fn, *args, **kwargs, running_mean=mean, running_var=var)
    fn(*args, **kwargs, running_mean=ref_mean, running_var=ref_var)  # prepare's own call
    for _ in range(3):
        step()
        fn(*args, **kwargs, running_mean=ref_mean, running_var=ref_var)
        assert_close(mean.get(), ref_mean.get(), 1e-6)
        assert_close(var.get(), ref_var.get(), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("name, make", [
    ("conv2d", lambda rng: ((rng.random((2, 3, 9, 8)), rng.random((4, 3, 3, 3))),
                            dict(padding=1))),
    ("group_norm", lambda rng: ((rng.random((2, 6, 5, 7)), 3), {})),
    ("max_pool2d", lambda rng: ((rng.random((2, 3, 9, 8)), 3), dict(stride=2))),
    ("softmax", lambda rng: ((rng.random((2, 3, 4, 5)),), dict(axis=(2, 3)))),
])
def test_building_blocks(rng, quick_plans, name, make):
    fn = getattr(cufused, name)
    args, kwargs = make(rng)
    args = [cp.asarray(a, dtype=cp.float32) if isinstance(a, np.ndarray) else a for a in args]
    step = cufused.prepare(fn, *args, **kwargs)
    assert_same_as_direct(step(), fn(*args, **kwargs), fn(*args, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_host_time_of_a_prepared_call(rng, quick_plans, case):
    # Issue 24's target: a prepared call costs the host at most 10 us (back-to-back calls
    # without synchronizing, small inputs, median of rounds).
    fn, make = PIPELINES[case]
    args, kwargs = make(rng)
    step = cufused.prepare(fn, *to_gpu(*args), **kwargs)
    host_us = host_us_per_call(step, calls=50, repeat=15)
    print(f"{case}: prepared call {host_us:.1f} us of host time")
    assert host_us <= 10.0


@pytest.mark.gpu
def test_a_plan_is_not_built_inside_a_capture(rng):
    # Building a plan times it with synchronizing events, which a capture refuses: the call
    # must fail clearly and leave no plan marked unsupported behind.
    from cufused._cudnn import clear_plan_cache

    x = cp.asarray(rng.random((2, 3, 9, 8)), dtype=cp.float32)
    w = cp.asarray(rng.random((4, 3, 3, 3)), dtype=cp.float32)
    clear_plan_cache()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="make the same call once before capturing"):
                cufused.conv2d(x, w)
        finally:
            stream.end_capture()
    cp.testing.assert_array_equal(cufused.conv2d(x, w), cufused.conv2d(x, w))


@pytest.mark.gpu
def test_prepare_refuses_a_stream_under_capture(rng, quick_plans):
    # Its first call would be recorded into the caller's capture and its wait for the call
    # would break that capture: it says so before any work, and the capture goes on.
    x = cp.asarray(rng.random((2, 3, 9, 8)), dtype=cp.float32)
    w = cp.asarray(rng.random((4, 3, 3, 3)), dtype=cp.float32)
    ref = cufused.conv2d(x, w)
    out = cp.empty_like(ref)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cufused.conv2d(x, w, out=out)
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="being captured"):
                cufused.prepare(cufused.conv2d, x, w, out=out)
            cufused.conv2d(x, w, out=out)
        finally:
            graph = stream.end_capture()
        out.fill(cp.nan)
        graph.launch()
    stream.synchronize()
    cp.testing.assert_array_equal(out, ref)


@pytest.mark.gpu
def test_the_graph_keeps_the_plans_it_reads(rng, quick_plans):
    # A sub-pixel plan gathers its weight through an index that the plan owns: clearing the
    # plan cache must not free what the prepared call's graph reads.
    from cufused._cudnn import clear_plan_cache

    fn, make = PIPELINES["C"]
    args, kwargs = make(rng)
    args = to_gpu(*args)
    step = cufused.prepare(fn, *args, **kwargs)
    ref = fn(*args, **kwargs)
    clear_plan_cache()
    junk = [cp.full(1 << 20, cp.nan, dtype=cp.float32) for _ in range(8)]  # reuse freed memory
    assert_same_as_direct(step().copy(), ref, fn(*args, **kwargs))
    del junk
