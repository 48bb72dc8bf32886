"""cufused.dask against the single call on the concatenated batch: NumPy chunks on the threaded
scheduler and on a two-process ``distributed.LocalCluster``; CuPy chunks on the GPU."""

from __future__ import annotations

import functools
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import cufused

from conftest import GPU, assert_close, mixed

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
cdask = pytest.importorskip("cufused.dask")

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Batch chunkings of N = 5: chunks of 1, an uneven last chunk, the whole batch in one.
CHUNKINGS = [(1, 1, 1, 1, 1), (2, 2, 1), (5,)]


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


def chunked(x, chunks):
    return da.from_array(x, chunks=(chunks,) + tuple(-1 for _ in x.shape[1:]))


# ------------------------------------------------------------------------------- the pipelines

def case_a(rng, dtype=np.float32):
    x = rng.random((5, 3, 12, 10)).astype(dtype)
    params = (rng.standard_normal((8, 3, 3, 3)).astype(dtype), rng.standard_normal(8),
              mixed(rng, 8), rng.standard_normal(8), mixed(rng, 8).reshape(8, 1, 1))
    options = dict(num_groups=4, pool_kernel=3, clamp_min=-0.5, clamp_max=0.8, padding=1)
    return x, params, options


def case_b(rng, dtype=np.float32):
    """Pipeline B with mixed-sign BatchNorm weights, a conv bias and grouped channels."""
    x = rng.random((5, 4, 5, 6)).astype(dtype)
    weight = rng.standard_normal((4, 4, 3, 3)).astype(dtype)  # groups=2: C_out = 8
    params = (weight, mixed(rng, 8, dtype), rng.standard_normal(8).astype(dtype),
              mixed(rng, 8, dtype), rng.standard_normal(8).astype(dtype))
    options = dict(num_groups=2, stride=2, padding=1, output_padding=1, groups=2,
                   conv_bias=rng.standard_normal(8).astype(dtype), pool_kernel=2, eps=1e-4,
                   momentum=0.3)
    return x, params, options


def case_c(rng, dtype=np.float32):
    x = rng.random((5, 2, 4, 6, 4)).astype(dtype)
    params = (rng.standard_normal((2, 3, 3, 3, 3)).astype(dtype), mixed(rng, 3))
    options = dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0,
                   clamp_max=1.0, conv_bias=rng.standard_normal(3))
    return x, params, options


PER_SAMPLE_PIPELINES = [("conv2d_groupnorm_scale_maxpool_clamp", case_a),
                        ("conv_transpose3d_avgpool_clamp_softmax_multiply", case_c)]


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


def test_softmax_over_the_batch_axis_needs_one_chunk(rng):
    x = rng.random((5, 3))
    with pytest.raises(ValueError, match=r"batch axis \(0\).*3 chunks.*rechunk"):
        cdask.softmax(chunked(x, (2, 2, 1)), axis=0)
    y = cdask.softmax(chunked(x, (5,)), axis=(0, 1))
    assert_close(y.compute(), cufused.softmax(x, axis=(0, 1)), 1e-12)


# ------------------------------------------------------------------------ laziness and errors

def test_nothing_is_computed_when_the_graph_is_built(rng):
    x, params, options = case_b(rng, np.float32)

    def boom(block):
        raise RuntimeError("computed")

    lazy = chunked(x, (2, 3)).map_blocks(boom, dtype=x.dtype)
    y = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(lazy, *params, **options)
    z = cdask.batch_norm(cdask.max_pool2d(cdask.conv2d(lazy[:, :, :4], params[0]), 2))
    assert y.shape == (5, 8, 5, 6) and z.shape == (5, 4, 1, 2)
    assert type(y._meta) is np.ndarray and y._meta.ndim == 4 and y.dtype == np.float32
    with pytest.raises(RuntimeError, match="computed"):
        y.compute()


def test_input_errors_name_the_argument(rng):
    x, params, options = case_b(rng, np.float32)
    b = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm
    with pytest.raises(TypeError, match=r"x must be a dask.array.Array, got ndarray.*"
                                        r"cufused.conv_transpose2d_batchnorm"):
        b(x, *params, **options)
    with pytest.raises(ValueError, match=r"axes \[1, 3\].*x.rechunk\(\{1: -1, 2: -1, 3: -1\}\)"):
        b(da.from_array(x, chunks=(2, 2, 5, 3)), *params, **options)
    with pytest.raises(TypeError, match="bn_weight is a dask collection"):
        b(chunked(x, (5,)), params[0], da.from_array(params[1]), *params[2:], **options)
    with pytest.raises(TypeError, match="conv_bias is a dask collection"):
        cdask.conv_transpose3d_avgpool_clamp_softmax_multiply(
            da.ones((2, 2, 4, 4, 4), chunks={0: 1}), np.ones((2, 3, 3, 3, 3)), 1.0, stride=2,
            padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0, clamp_max=1.0,
            conv_bias=da.ones(3))
    with pytest.raises(ValueError, match="num_groups=3 must be positive and divide"):
        b(chunked(x, (5,)), *params, **{**options, "num_groups": 3})
    with pytest.raises(ValueError, match="split_every"):
        b(chunked(x, (5,)), *params, **options, split_every=1)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        b(chunked(x[:1, :, :1, :1], (1,)), np.ones((4, 4, 1, 1), np.float32), *params[1:],
          **{**options, "stride": 1, "padding": 0, "output_padding": 0, "pool_kernel": 1})
    unknown = chunked(x, (5,))[da.from_array(np.arange(5) > 1)]
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        cdask.group_norm(unknown, 2)
    with pytest.raises(ValueError, match="return_running_stats applies in training"):
        cdask.batch_norm(chunked(x, (5,)), running_mean=np.zeros(4, np.float32),
                         running_var=np.ones(4, np.float32), training=False,
                         return_running_stats=True)


# ------------------------------------------------------------------------------------ the graph

class Unhashed(np.ndarray):
    """A parameter that fails the test where Dask hashes it (for a CuPy parameter, a copy to
    the host and a synchronization)."""


@pytest.fixture
def no_parameter_hashing(monkeypatch):
    from dask.base import normalize_token

    def refuse(value):
        raise AssertionError("cufused.dask hashed a parameter")

    monkeypatch.setitem(normalize_token._lookup, Unhashed, refuse)


def unhashed(value):
    return value.view(Unhashed) if isinstance(value, np.ndarray) else value


def arrays_in(task):
    """The arrays inside a task of the graph, literal or bound in a functools.partial."""
    if isinstance(task, np.ndarray):
        yield task
    elif isinstance(task, (tuple, list)):
        for item in task:
            yield from arrays_in(item)
    elif isinstance(task, dict):
        yield from arrays_in(list(task.values()))
    elif isinstance(task, functools.partial):
        yield from arrays_in((task.func, task.args, task.keywords))


@pytest.mark.parametrize("name, make", PER_SAMPLE_PIPELINES + [
    ("conv_transpose2d_batchnorm_tanh_maxpool_groupnorm", case_b)])
def test_parameters_are_not_hashed_and_keys_are_unique_per_call(rng, no_parameter_hashing,
                                                                name, make):
    x, params, options = make(rng)
    lazy = [getattr(cdask, name)(chunked(x, (2, 3)), *map(unhashed, params),
                                 **{k: unhashed(v) for k, v in options.items()})
            for _ in range(2)]
    assert lazy[0].name.startswith(f"cufused-{name}-") and lazy[0].name != lazy[1].name
    ref = getattr(cufused, name)(x, *params, **options)
    for got in dask.compute(*lazy, scheduler="sync"):
        assert_close(got, ref, 1e-5)


def test_batch_norm_does_not_hash_its_parameters(rng, no_parameter_hashing):
    x = rng.random((5, 3, 4))
    weight, rm, rv = mixed(rng, 3), np.zeros(3), np.ones(3)
    ref_rm, ref_rv = rm.copy(), rv.copy()
    y = cdask.batch_norm(chunked(x, (2, 3)), unhashed(weight), running_mean=unhashed(rm),
                         running_var=unhashed(rv))
    assert_close(y.compute(scheduler="sync"),
                 cufused.batch_norm(x, weight, running_mean=ref_rm, running_var=ref_rv), 1e-12)
    assert_close(rm, ref_rm, 1e-12)  # the caller's buffer, updated through the view
    assert_close(rv, ref_rv, 1e-12)


def test_equal_graphs_each_update_the_running_buffers(rng):
    # No deduplication of equal calls: computed together, each runs its statistics task.
    x, params, options = case_b(rng, np.float64)
    rm, rv = np.zeros(8), np.ones(8)
    ref_rm, ref_rv = rm.copy(), rv.copy()
    lazy = [cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        chunked(x, (2, 3)), *params, **options, running_mean=rm, running_var=rv)
        for _ in range(2)]
    dask.compute(*lazy, scheduler="threads")
    for _ in range(2):
        cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
            x, *params, **options, running_mean=ref_rm, running_var=ref_rv)
    assert_close(rm, ref_rm, 1e-12)
    assert_close(rv, ref_rv, 1e-12)


@pytest.mark.parametrize("chunks", CHUNKINGS[:2])
def test_each_array_parameter_is_one_key_of_the_graph(rng, chunks):
    # Tasks name the parameters by key: Dask neither traverses nor copies them per task.
    x, params, options = case_b(rng, np.float64)
    rm, rv = np.zeros(8), np.ones(8)
    y, *stats = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        chunked(x, chunks), *params, **options, running_mean=rm, running_var=rv,
        split_every=2, return_running_stats=True)
    xc, params_c, options_c = case_c(rng, np.float64)
    c = cdask.conv_transpose3d_avgpool_clamp_softmax_multiply(chunked(xc, chunks), *params_c,
                                                              **options_c)
    for lazy, names in ((y, ("bn_weight", "bn_bias", "gn_weight", "gn_bias", "running_mean",
                             "running_var", "weight", "conv_bias", "sign")),
                        (c, ("weight", "scale", "conv_bias"))):
        layer = dict(lazy.dask.layers[lazy.name])
        constants = {k: v for k, v in layer.items() if isinstance(v, np.ndarray)}
        assert sorted(k.split("-")[-2] for k in constants) == sorted(names)
        assert not any(list(arrays_in(task)) for task in layer.values()
                       if not isinstance(task, np.ndarray))
    assert [s.chunks for s in stats] == [((8,),)] * 2


# ------------------------------------------------------------------------------ the benchmark

def test_bench_script_help():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_dask.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--small" in res.stdout and "--json" in res.stdout


def test_bench_script_smoke_run_on_numpy_chunks(tmp_path):
    if GPU:
        pytest.skip("a GPU is present: the script times CuPy chunks (run on the device)")
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_dask.py"), "--small",
                          "--cases", "B", "--batch", "1", "--factor", "3", "--repeat", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    import json

    (row,) = json.loads(out.read_text())["rows"]
    assert (row["case"], row["images"], row["chunk"]) == ("B", 3, 1)
    assert all(row[k] > 0 for k in ("loop", "threads", "one_call_per_chunk"))
    assert "B    ieee" in res.stdout


# --------------------------------------------------------------------------------- on the GPU

@pytest.fixture
def quick_plans():
    """Heuristic cuDNN plans (no autotuning for each new chunk size) keep the tests fast."""
    from cufused._cudnn import plan_options

    with plan_options(autotune=False):
        yield


@pytest.fixture(params=[1, 4])
def gpu_threads(request, quick_plans):
    """The threaded scheduler with one worker thread (one CUDA stream's order) or four."""
    with dask.config.set(scheduler="threads", num_workers=request.param):
        yield request.param


def gpu_cases(rng):
    """(pipeline, x, positional parameters, options, chunks) on the GPU, float32."""
    import cupy as cp

    def gpu(a):
        return a if a is None or np.isscalar(a) else cp.asarray(a, dtype=cp.float32)

    out = []
    for name, make in (("conv2d_groupnorm_scale_maxpool_clamp", case_a),
                       ("conv_transpose2d_batchnorm_tanh_maxpool_groupnorm", case_b),
                       ("conv_transpose3d_avgpool_clamp_softmax_multiply", case_c)):
        x, params, options = make(rng)
        x = np.concatenate([x] * 3)  # N = 15: chunks (4, 4, 4, 3) and (1, 14)
        options = {k: gpu(v) for k, v in options.items()}
        out.append((name, gpu(x), tuple(gpu(p) for p in params), options))
    return out


def check_gpu_pipelines(rng, compute):
    """Each pipeline on CuPy chunks against the single CuPy call (running buffers of B too)."""
    import cupy as cp

    for name, x, params, options in gpu_cases(rng):
        for chunks in ((4, 4, 4, 3), (1, 14)):
            ref_buffers, buffers = {}, {}
            if "batchnorm" in name:
                ref_buffers, buffers = ({"running_mean": cp.zeros(8, cp.float32),
                                         "running_var": cp.ones(8, cp.float32)}
                                        for _ in range(2))
                buffers["return_running_stats"] = True
            ref = getattr(cufused, name)(x, *params, **options, **ref_buffers)
            lazy = getattr(cdask, name)(chunked(x, chunks), *params, **options, **buffers)
            results = compute(lazy if isinstance(lazy, tuple) else (lazy,))
            assert type(results[0]) is cp.ndarray, name
            assert_close(results[0].get(), ref.get(), 3e-5)
            for got, want in zip(results[1:], ref_buffers.values()):
                assert_close(got.get(), want.get(), 1e-5)


@pytest.mark.gpu
def test_gpu_pipelines_threaded(rng, gpu_threads):
    check_gpu_pipelines(rng, lambda arrays: dask.compute(*arrays))


@pytest.mark.gpu
def test_gpu_batch_norm_and_blocks_threaded(rng, gpu_threads):
    import cupy as cp

    x = cp.asarray(rng.random((9, 6, 5, 7)) * 3 + 1, dtype=cp.float32)
    weight, bias = cp.asarray(mixed(rng, 6, np.float32)), cp.asarray(rng.random(6), cp.float32)
    rm, rv = cp.zeros(6, cp.float32), cp.ones(6, cp.float32)
    ref_rm, ref_rv = rm.copy(), rv.copy()
    y = cdask.batch_norm(chunked(x, (4, 4, 1)), weight, bias, running_mean=rm, running_var=rv,
                         activation="tanh")
    ref = cufused.batch_norm(x, weight, bias, running_mean=ref_rm, running_var=ref_rv,
                             activation="tanh")
    assert_close(y.compute().get(), ref.get(), 3e-5)
    assert_close(rm.get(), ref_rm.get(), 1e-5)  # in place: the threads share this process
    assert_close(rv.get(), ref_rv.get(), 1e-5)
    w = cp.asarray(rng.standard_normal((4, 6, 3, 3)), cp.float32)
    z = cdask.softmax(cdask.group_norm(cdask.max_pool2d(cdask.conv2d(chunked(x, (2, 7)), w,
                                                                       padding=1), 2), 2),
                      axis=(2, 3))
    ref = cufused.softmax(cufused.group_norm(cufused.max_pool2d(cufused.conv2d(x, w, padding=1),
                                                                2), 2), axis=(2, 3))
    assert_close(z.compute().get(), ref.get(), 3e-5)


@pytest.mark.gpu
def test_gpu_tasks_run_one_at_a_time_per_device(rng, quick_plans, monkeypatch):
    # Four scheduler threads, yet no two chunks' GPU work interleaves on the device.
    import threading
    import time

    name, x, params, options = gpu_cases(rng)[0]
    single = getattr(cufused, name)
    spans, guard = [], threading.Lock()

    def timed(*args, **kwargs):
        start = time.perf_counter()
        time.sleep(0.005)  # time for another thread to enter if nothing stopped it
        result = single(*args, **kwargs)
        with guard:
            spans.append((start, time.perf_counter()))
        return result

    monkeypatch.setattr(cufused, name, timed)
    lazy = getattr(cdask, name)(chunked(x, (4, 4, 4, 3)), *params, **options)
    spans.clear()  # the argument check on an empty batch, while the graph was built
    got = lazy.compute(scheduler="threads", num_workers=4)
    spans.sort()
    assert len(spans) == 4
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert_close(got.get(), single(x, *params, **options).get(), 3e-5)


@pytest.mark.gpu
def test_gpu_pipelines_on_a_local_cuda_cluster(rng, quick_plans):
    dask_cuda = pytest.importorskip("dask_cuda")
    distributed = pytest.importorskip("distributed")
    with dask_cuda.LocalCUDACluster(n_workers=1, dashboard_address=None) as local, \
            distributed.Client(local, set_as_default=False) as client:
        client.run(cufused.set_conv_autotune, False)
        check_gpu_pipelines(rng, lambda arrays: dask.compute(*arrays, scheduler=client))
