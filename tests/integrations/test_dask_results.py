"""cufused.dask against the single call on the concatenated batch: NumPy chunks on the threaded
scheduler and on a two-process ``distributed.LocalCluster``; CuPy chunks on the GPU."""

from __future__ import annotations


import numpy as np
import pytest

import cufused

from conftest import assert_close, mixed
from dask_cases import CHUNKINGS, PER_SAMPLE_PIPELINES, case_b, chunked

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
cdask = pytest.importorskip("cufused.dask")


@pytest.fixture(scope="module")
def cluster():
    """Two single-threaded worker processes, started once for the module."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as local, \
            distributed.Client(local, set_as_default=False) as client:
        yield client


@pytest.fixture(params=["threads", "cluster"])
def scheduler(request):
    """The scheduler a test computes on: the threaded one, or the cluster's client."""
    if request.param == "cluster":
        return request.getfixturevalue("cluster")
    return request.param


# ------------------------------------------------------------------------------- the pipelines


@pytest.mark.parametrize("name, make", PER_SAMPLE_PIPELINES)
@pytest.mark.parametrize("chunks", CHUNKINGS[:2])
def test_per_sample_pipelines_match_the_single_call(rng, scheduler, name, make, chunks):
    x, params, options = make(rng)
    y = getattr(cdask, name)(chunked(x, chunks), *params, **options)
    ref = getattr(cufused, name)(x, *params, **options)
    assert (y.shape, y.dtype, y.chunks[0]) == (ref.shape, ref.dtype, chunks)
    assert all(len(c) == 1 for c in y.chunks[1:])
    got = y.compute(scheduler=scheduler)
    assert type(got) is np.ndarray
    assert_close(got, ref, 1e-6)


def run_b(x, params, options, chunks, scheduler, **extra):
    """Pipeline B through cufused.dask and the single call, each with fresh running buffers;
    returns (dask result, single result, dask buffers, single buffers)."""
    buffers = [(np.linspace(-1, 1, 8).astype(x.dtype), np.linspace(0.5, 2, 8).astype(x.dtype))
               for _ in range(2)]
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        x, *params, **options, running_mean=buffers[1][0], running_var=buffers[1][1])
    result = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        chunked(x, chunks), *params, **options, running_mean=buffers[0][0],
        running_var=buffers[0][1], return_running_stats=True, **extra)
    y, mean, var = dask.compute(*result, scheduler=scheduler)
    return y, ref, (mean, var), buffers


@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_pipeline_b_matches_the_single_call(rng, scheduler, chunks):
    x, params, options = case_b(rng, np.float64)
    y, ref, new, (buffers, ref_buffers) = run_b(x, params, options, chunks, scheduler)
    assert_close(y, ref, 1e-10)  # NumPy chunks run in float64 end to end, as the single call
    for got, want in zip(new, ref_buffers):
        assert_close(got, want, 1e-12)
    if scheduler == "threads":  # in place, in this process
        for got, want in zip(buffers, ref_buffers):
            assert_close(got, want, 1e-12)


def test_pipeline_b_float32_and_a_deep_tree(rng):
    # Chunks of 1 merged two at a time: a tree of depth 3; the result keeps float32.
    x, params, options = case_b(rng, np.float32)
    y, ref, new, (buffers, ref_buffers) = run_b(x, params, options, CHUNKINGS[0], "threads",
                                                split_every=2)
    assert y.dtype == np.float32
    assert_close(y, ref, 1e-5)
    for got, want, kept in zip(new, ref_buffers, buffers):
        assert got.dtype == np.float32
        assert_close(got, want, 1e-6)
        assert_close(kept, want, 1e-6)


def test_pipeline_b_statistics_cover_the_whole_batch(rng):
    # Chunks of very different data: per-chunk statistics would differ from the batch's.
    x, params, options = case_b(rng, np.float64)
    x[3:] = 10 * x[3:] - 4
    y, ref, _, _ = run_b(x, params, options, (3, 2), "threads")
    assert_close(y, ref, 1e-10)
    per_chunk = np.concatenate([cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        part, *params, **options) for part in (x[:3], x[3:])])
    assert np.abs(per_chunk - ref).max() > 1e-3


@pytest.mark.filterwarnings("error")  # NaN and inf propagate silently
def test_pipeline_b_zero_and_nan_bn_weights(rng):
    # Weight 0 maps a channel to one value (either extremum serves); NaN turns it NaN, and
    # with it the GroupNorm group.
    x, params, options = case_b(rng, np.float64)
    bn_weight = params[1].copy()
    bn_weight[[0, 5]] = [0.0, np.nan]
    params = (params[0], bn_weight) + params[2:]
    y, ref, _, _ = run_b(x, params, options, (2, 3), "threads")
    nan = np.isnan(ref)
    assert nan[:, 4:].all() and not nan[:, :4].any()
    assert np.array_equal(np.isnan(y), nan)
    assert_close(y[~nan], ref[~nan], 1e-10)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.filterwarnings("error")  # NaN and inf propagate silently
def test_pipeline_b_non_finite_conv_bias_and_bn_weight(rng, value):
    # A non-finite conv bias makes its channel's statistics, and so its GroupNorm group, NaN
    # (the single call as PyTorch); an infinite BatchNorm weight goes where the single call
    # takes it.
    x, params, options = case_b(rng, np.float64)
    options["conv_bias"][2] = value
    bn_weight = params[1].copy()
    bn_weight[6] = -value if np.isinf(value) else 1.0
    params = (params[0], bn_weight) + params[2:]
    y, ref, new, _ = run_b(x, params, options, (2, 3), "threads")
    assert np.isnan(ref[:, :4]).all()
    assert np.array_equal(np.isnan(y), np.isnan(ref))
    finite = ~np.isnan(ref)
    assert_close(y[finite], ref[finite], 1e-10)


@pytest.mark.filterwarnings("error")  # NaN and inf propagate silently
def test_pipeline_b_bn_factor_past_float_range(rng):
    # A finite BatchNorm weight whose factor weight * rstd overflows: BatchNorm's values are
    # then NaN on one side of the channel's mean and +-inf on the other (the single call's, as
    # PyTorch's), so a window mixing both is NaN, which its extremum alone does not tell.
    x = np.empty((2, 1, 4, 4))
    x[0] = np.tile([[-0.1, -0.1], [-0.1, 0.3]], (2, 2))  # each window: 3 below the mean, 1 above
    x[1] = 0.3
    args = (np.ones((1, 1, 1, 1)), np.array([-1e308]), None, None, None)
    options = dict(num_groups=1, pool_kernel=2)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(x, *args, **options)
    y = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(chunked(x, (1, 1)), *args,
                                                                **options).compute()
    assert np.isnan(ref[0]).all()
    assert np.array_equal(np.isnan(y), np.isnan(ref))
    assert_close(y[~np.isnan(ref)], ref[~np.isnan(ref)], 1e-10)


@pytest.mark.parametrize("momentum", [np.float16(0.1), np.float32(0.3), np.float64(0.7)])
def test_numpy_scalar_momentum_updates_as_the_single_call(rng, momentum):
    # The single call takes momentum as a Python float: 1 - momentum is not rounded to the
    # scalar's type.
    x, params, options = case_b(rng, np.float64)
    options["momentum"] = momentum
    _, _, new, (_, ref_buffers) = run_b(x, params, options, (2, 3), "threads")
    for got, want in zip(new, ref_buffers):
        assert_close(got, want, 1e-12)
    rm, rv, ref_rm, ref_rv = np.zeros(4), np.ones(4), np.zeros(4), np.ones(4)
    x = rng.random((5, 4, 3))
    cdask.batch_norm(chunked(x, (2, 3)), running_mean=rm, running_var=rv,
                     momentum=momentum).compute()
    cufused.batch_norm(x, running_mean=ref_rm, running_var=ref_rv, momentum=momentum)
    assert_close(rm, ref_rm, 1e-12)
    assert_close(rv, ref_rv, 1e-12)


@pytest.mark.filterwarnings("error")  # NaN and inf propagate silently
def test_pipeline_b_nan_input_reaches_the_batch_statistics(rng):
    # One NaN input value reaches the batch statistics of its convolution group's channels
    # (0-3): they turn NaN in every sample, in the output and in both running buffers.
    x, params, options = case_b(rng, np.float64)
    x[4, 1, 2, 3] = np.nan
    y, ref, new, _ = run_b(x, params, options, (2, 2, 1), "threads")
    assert np.isnan(ref[:, :4]).all() and not np.isnan(ref[:, 4:]).any()
    assert np.array_equal(np.isnan(y), np.isnan(ref))
    assert_close(y[:, 4:], ref[:, 4:], 1e-10)
    assert all(np.isnan(buf[:4]).all() and not np.isnan(buf[4:]).any() for buf in new)


def test_pipeline_b_odd_pool_and_no_optional_parameters(rng):
    x = rng.random((4, 3, 7, 6))
    w = rng.standard_normal((3, 6, 2, 2))
    args = (w, None, None, None, None)
    options = dict(num_groups=3, pool_kernel=3)
    y = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(chunked(x, (3, 1)), *args,
                                                                **options)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(x, *args, **options)
    assert y.shape == ref.shape == (4, 6, 2, 2)
    assert_close(y.compute(), ref, 1e-10)


def test_running_buffers_update_once_per_computation(rng):
    x, params, options = case_b(rng, np.float64)
    rm, rv = np.zeros(8), np.ones(8)
    y = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        chunked(x, (2, 3)), *params, **options, running_mean=rm, running_var=rv)
    assert not rm.any() and (rv == 1).all()  # building the graph computes nothing
    y.compute()
    once = rm.copy(), rv.copy()
    ref_rm, ref_rv = np.zeros(8), np.ones(8)
    cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        x, *params, **options, running_mean=ref_rm, running_var=ref_rv)
    assert_close(once[0], ref_rm, 1e-12)
    assert_close(once[1], ref_rv, 1e-12)
    y.compute()  # each computation runs the statistics task again, as a second call would
    cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        x, *params, **options, running_mean=ref_rm, running_var=ref_rv)
    assert_close(rm, ref_rm, 1e-12)
    assert_close(rv, ref_rv, 1e-12)


def test_empty_batch(rng):
    x, params, options = case_b(rng, np.float32)
    rm, rv = np.zeros(8, np.float32), np.ones(8, np.float32)
    y = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        chunked(x[:0], (0,)), *params, **options, running_mean=rm, running_var=rv)
    assert y.compute().shape == (0, 8, 5, 6)
    assert not rm.any() and (rv == 1).all()  # as the single call: no statistics, no update


# --------------------------------------------------------------------------- building blocks

def blocks(rng):
    """(name, x, positional parameters, options) of each per-sample building block."""
    x4, x5 = rng.random((5, 4, 7, 6)), rng.random((5, 4, 5, 4, 6))
    return [
        ("conv2d", x4, (rng.standard_normal((6, 2, 3, 3)), rng.standard_normal(6)),
         dict(stride=(2, 1), padding=1, dilation=(1, 2), groups=2)),
        ("conv3d", x5, (rng.standard_normal((3, 4, 2, 3, 2)),), dict(padding=(0, 1, 1))),
        ("conv_transpose2d", x4, (rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(3)),
         dict(stride=2, output_padding=1)),
        ("conv_transpose3d", x5, (rng.standard_normal((4, 2, 2, 2, 2)),), dict(stride=2)),
        ("group_norm", x4, (2, mixed(rng, 4), rng.standard_normal(4)), dict(eps=1e-3)),
        ("max_pool2d", x4, (3,), dict(stride=2, padding=1)),
        ("max_pool3d", x5, (2,), {}),
        ("avg_pool2d", x4, ((2, 3),), {}),
        ("avg_pool3d", x5, (3,), dict(stride=1, padding=1)),
        ("softmax", x5, (), dict(axis=(1, 3))),
        ("softmax", x4, (), {}),
        ("batch_norm", x4, (mixed(rng, 4),),
         dict(running_mean=rng.random(4), running_var=rng.random(4) + 0.5, training=False,
              activation="tanh")),
    ]


@pytest.mark.parametrize("index", range(12))
def test_building_blocks_match_the_single_call(rng, index):
    name, x, args, options = blocks(rng)[index]
    y = getattr(cdask, name)(chunked(x, (2, 2, 1)), *args, **options)
    ref = getattr(cufused, name)(x, *args, **options)
    assert y.shape == ref.shape and y.chunks[0] == (2, 2, 1)
    assert_close(y.compute(), ref, 1e-12)


@pytest.mark.parametrize("activation", [None, "tanh"])
def test_batch_norm_training_matches_the_single_call(rng, scheduler, activation):
    x = (rng.random((5, 3, 4, 2)) * np.array([1, 10, 100]).reshape(1, 3, 1, 1) + 50)
    x = x.astype(np.float32)
    weight, bias = mixed(rng, 3, np.float32), rng.standard_normal(3).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    ref_rm, ref_rv = rm.copy(), rv.copy()
    result = cdask.batch_norm(chunked(x, (1, 3, 1)), weight, bias, running_mean=rm,
                              running_var=rv, momentum=0.2, activation=activation,
                              return_running_stats=True)
    y, new_rm, new_rv = dask.compute(*result, scheduler=scheduler)
    ref = cufused.batch_norm(x, weight, bias, running_mean=ref_rm, running_var=ref_rv,
                             momentum=0.2, activation=activation)
    assert y.dtype == np.float32
    assert_close(y, ref, 1e-5)
    assert_close(new_rm, ref_rm, 1e-6)
    assert_close(new_rv, ref_rv, 1e-6)


def test_one_value_per_group_in_chunks_of_one(rng, scheduler):
    # PyTorch's "more than one value per group" counts the whole batch: chunks of one sample
    # with one value per (sample, group) pass, as the single call on the batch does, and
    # pipeline B's running buffers update once.
    x = rng.random((3, 6))
    weight, bias = mixed(rng, 6), rng.random(6)
    y = cdask.group_norm(chunked(x, (1, 1, 1)), 6, weight, bias).compute(scheduler=scheduler)
    assert_close(y, cufused.group_norm(x, 6, weight, bias), 1e-12)
    xb, wb = rng.random((2, 4, 1, 1)), rng.standard_normal((4, 4, 2, 2))
    rm, rv, ref_rm, ref_rv = np.zeros(4), np.ones(4), np.zeros(4), np.ones(4)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        xb, wb, None, None, None, None, num_groups=4, running_mean=ref_rm, running_var=ref_rv)
    y, rm, rv = dask.compute(*cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        chunked(xb, (1, 1)), wb, None, None, None, None, num_groups=4, running_mean=rm,
        running_var=rv, return_running_stats=True), scheduler=scheduler)
    assert_close(y, ref, 1e-12)
    assert_close(rm, ref_rm, 1e-12)
    assert_close(rv, ref_rv, 1e-12)


@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_batch_statistics_about_a_shift_whatever_the_chunks(rng, chunks):
    # The chunks' moments are shifted by their first values, as the single call's sums are by
    # the batch's: a constant channel far from 0 (1e30: its float64 mean of a sum rounds) has
    # variance exactly 0 and the single call's result in every chunking (not +-1 from the
    # square of a rounded mean); a mean 1e10 times its spread keeps the single call's
    # accuracy in the running variance.
    x = rng.standard_normal((5, 2, 3, 2)) + np.array([0.0, 1e10]).reshape(1, 2, 1, 1)
    x[:, 0] = 1e30
    bias = rng.standard_normal(2)
    got, want = [(np.zeros(2), np.ones(2)) for _ in range(2)]
    y = cdask.batch_norm(chunked(x, chunks), None, bias, running_mean=got[0],
                         running_var=got[1], momentum=1.0).compute()
    ref = cufused.batch_norm(x, None, bias, running_mean=want[0], running_var=want[1],
                             momentum=1.0)
    assert np.array_equal(y[:, 0], ref[:, 0]) and np.all(np.abs(ref[:, 0]) < 1)
    assert got[1][0] == want[1][0] == 0.0 and got[0][0] == want[0][0] == 1e30
    assert_close(y[:, 1], ref[:, 1], 1e-6)
    assert abs(got[1][1] / want[1][1] - 1) < 1e-9


@pytest.mark.filterwarnings("error")  # NaN and inf propagate silently
def test_infinite_values_make_the_running_mean_infinite(rng):
    # As the single call (and PyTorch), on NumPy chunks: the batch mean of a channel holding
    # +inf is +inf, and its variance NaN, whichever chunks hold the infinities. (On CuPy the
    # chunks' sums are shifted by their first values: an infinite one turns the chunk's mean
    # NaN, as the single call's does where the batch's first value is infinite.)
    x = rng.random((4, 2, 3))
    x[1:3, 0, 0] = np.inf
    got, want = [(np.zeros(2), np.ones(2)) for _ in range(2)]
    cdask.batch_norm(chunked(x, (1, 2, 1)), running_mean=got[0], running_var=got[1]).compute()
    cufused.batch_norm(x, running_mean=want[0], running_var=want[1])
    assert got[0][0] == want[0][0] == np.inf and np.isnan(got[1][0]) and np.isnan(want[1][0])
    assert_close(got[0][1:], want[0][1:], 1e-12)
    assert_close(got[1][1:], want[1][1:], 1e-12)


@pytest.mark.filterwarnings("error")  # the cast to float16 overflows silently
def test_pipeline_b_float16_overflow_is_silent(rng):
    x, params, options = case_b(rng, np.float16)
    params = params[:3] + (np.full(8, 6e4, np.float16),) + params[4:]  # gn_weight
    y = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(chunked(x, (2, 3)), *params,
                                                                **options).compute()
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(x, *params, **options)
    assert y.dtype == np.float16 and np.isinf(ref).any()
    assert np.array_equal(y, ref, equal_nan=True)


def test_softmax_over_the_batch_axis_needs_one_chunk(rng):
    x = rng.random((5, 3))
    with pytest.raises(ValueError, match=r"batch axis \(0\).*3 chunks.*rechunk"):
        cdask.softmax(chunked(x, (2, 2, 1)), axis=0)
    y = cdask.softmax(chunked(x, (5,)), axis=(0, 1))
    assert_close(y.compute(), cufused.softmax(x, axis=(0, 1)), 1e-12)


_QUERY_PLANNING_SCRIPT = """
import numpy as np, dask, dask.array as da, cufused, cufused.dask as cdask
from dask_cases import PER_SAMPLE_PIPELINES, case_b, chunked
assert da.array_expr_enabled()
rng = np.random.default_rng(5)
for name, make in PER_SAMPLE_PIPELINES:
    x, params, options = make(rng)
    y = getattr(cdask, name)(chunked(x, (2, 2, 1)), *params, **options)
    ref = getattr(cufused, name)(x, *params, **options)
    np.testing.assert_allclose(y.compute(), ref, rtol=1e-6, atol=0)
# An input whose lowered graph names its chunks after another expression (a rechunk's).
split = da.from_array(x, chunks=(5,) + (1,) * (x.ndim - 1))
y = cdask.softmax(split.rechunk({0: 2, **{axis: -1 for axis in range(1, x.ndim)}}), 1)
np.testing.assert_allclose(y.compute(), cufused.softmax(x, 1), rtol=1e-12)
# A chunk type that dask cannot infer (the function fails on its empty probe): NumPy's.
unknown = chunked(x, (2, 2, 1)).map_blocks(lambda b: b + 0 * b[0].max(), dtype=x.dtype)
assert unknown._meta is None
np.testing.assert_allclose(cdask.softmax(unknown, axis=1).compute(), cufused.softmax(x, 1),
                           rtol=1e-6, atol=0)
x, params, options = case_b(rng, np.float64)
rm, rv = np.zeros(8), np.ones(8)
y, mean, var = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
    chunked(x, (2, 2, 1)), *params, **options, running_mean=rm.copy(), running_var=rv.copy(),
    return_running_stats=True)
ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
    x, *params, **options, running_mean=rm, running_var=rv)
got = dask.compute(y, mean, var)
for a, b in zip(got, (ref, rm, rv)):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
print("matched")
"""


def test_results_under_dask_array_query_planning():
    # Dask's array query planning (the array.query-planning option, read once when
    # dask.array is first imported) makes dask arrays expressions: a process of its own.
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not hasattr(da, "array_expr_enabled"):
        pytest.skip("this dask has no array query planning")
    here = Path(__file__).parent
    env = dict(os.environ, DASK_ARRAY__QUERY_PLANNING="True",
               PYTHONPATH=os.pathsep.join([str(here), str(here.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _QUERY_PLANNING_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "matched" in res.stdout, res.stderr[-3000:]
