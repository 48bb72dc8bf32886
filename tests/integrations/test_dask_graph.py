"""cufused.dask's graphs: nothing computed when a graph is built, errors naming the argument,
parameters not hashed, keys unique per call, running buffers updated once; the Dask benchmark
script."""

from __future__ import annotations

import functools
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest

import cufused

from conftest import GPU, assert_close, mixed
from dask_cases import CHUNKINGS, PER_SAMPLE_PIPELINES, case_b, case_c, chunked

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
cdask = pytest.importorskip("cufused.dask")

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------ laziness and errors


def test_every_array_function_has_its_dask_version():
    import inspect

    # Every public function of cufused but the settings and prepare.
    settings = {"get_default_precision", "set_default_precision", "default_precision",
                "set_conv_autotune", "set_conv_graph_replay", "clear_plan_cache", "clear_caches",
                "prepare"}
    assert cdask.__all__ == [name for name in cufused.__all__ if name not in settings]
    for name in cdask.__all__:
        single, lazy = getattr(cufused, name), getattr(cdask, name)
        assert lazy is not single and lazy.__module__.startswith("cufused.dask"), name
        assert pickle.loads(pickle.dumps(lazy)) is lazy, name  # by reference, for workers
        with pytest.raises(TypeError, match=rf"^{name}\(\) "):
            lazy()
        # The same parameters by name, but ``out`` (a dask call returns a new lazy array) and
        # the pipelines' ``method`` (each chunk runs the default).
        params = [p for p in inspect.signature(single).parameters if p not in ("out", "method")]
        assert list(inspect.signature(lazy).parameters)[:len(params)] == params, name

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
    for not_int in (2.5, True, "2"):
        with pytest.raises(TypeError, match="split_every must be an int"):
            b(chunked(x, (5,)), *params, **options, split_every=not_int)
    # The single convolutions and pools also take an input without its batch axis; over a
    # dask batch the first axis is always the batch.
    with pytest.raises(ValueError, match=r"x must have 4 dimensions, its batch axis first"):
        cdask.conv2d(da.ones((3, 6, 6), chunks={0: 1}), np.ones((2, 6, 3, 3)))
    with pytest.raises(ValueError, match=r"x must have 5 dimensions, its batch axis first"):
        cdask.avg_pool3d(da.ones((3, 6, 6, 6), chunks={0: 1}), 2)
    # batch_norm checks it in inference too, where no reduction reads it.
    ones = np.ones(x.shape[1], np.float32)
    for bad, error in ((1, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="split_every"):
            cdask.batch_norm(chunked(x, (5,)), running_mean=ones, running_var=ones,
                             training=False, split_every=bad)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        b(chunked(x[:1, :, :1, :1], (1,)), np.ones((4, 4, 1, 1), np.float32), *params[1:],
          **{**options, "stride": 1, "padding": 0, "output_padding": 0, "pool_kernel": 1})
    unknown = chunked(x, (5,))[da.from_array(np.arange(5) > 1)]
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        cdask.group_norm(unknown, 2)
    with pytest.raises(ValueError, match=r"x must have a batch axis \(ndim >= 1\)"):
        cdask.group_norm(da.from_array(np.float32(1.0)), 1)

    class Chunk:  # a chunk type that is neither NumPy's nor CuPy's
        ndim, shape, dtype = 4, (0, 0, 0, 0), np.dtype(np.float32)

        def __getitem__(self, key):
            return self

        def astype(self, *args, **kwargs):
            return self

    foreign = chunked(x, (5,)).map_blocks(lambda block: block, meta=Chunk())
    with pytest.raises(TypeError, match=r"x has chunks of type .*Chunk; cufused.dask runs"):
        cdask.group_norm(foreign, 2)
    with pytest.raises(TypeError, match="training must be a bool"):
        cdask.batch_norm(chunked(x, (5,)), training="False")
    # PyTorch's rules across the batch count the whole batch, when the graph is built, and
    # name its shape (not that of the empty probe the graph is checked with).
    with pytest.raises(ValueError, match=r"more than 1 value per group .* shape \(1, 6\)"):
        cdask.group_norm(chunked(np.ones((1, 6), np.float32), (1,)), 6)
    with pytest.raises(ValueError, match=r"more than 1 value per channel .* \(1, 4, 1, 1\)"):
        cdask.batch_norm(chunked(np.ones((1, 4, 1, 1), np.float32), (1,)))
    with pytest.raises(ValueError, match=r"x \(shape \(4, 3, 2, 2\)\) would be empty"):
        cdask.conv2d(chunked(np.ones((4, 3, 2, 2)), (2, 2)), np.ones((2, 3, 5, 5)))
    with pytest.raises(ValueError, match=r"zero-sized non-batch dimension: shape \(4, 0, 2, 2\)"):
        cdask.conv2d(chunked(np.ones((4, 0, 2, 2)), (2, 2)), np.ones((2, 0, 1, 1)))
    with pytest.raises(ValueError, match="convolution output would have shape"):
        cdask.conv2d(chunked(np.ones((2, 4, 8, 8)), (1, 1)), np.ones((8, 4, 3, 3)),
                     padding=2**20)  # a sample past memory: at build, not at compute
    with pytest.raises(ValueError, match="return_running_stats applies in training"):
        cdask.batch_norm(chunked(x, (5,)), running_mean=np.zeros(4, np.float32),
                         running_var=np.ones(4, np.float32), training=False,
                         return_running_stats=True)
    xb, params, options = case_b(rng)
    for call in (functools.partial(cdask.batch_norm, chunked(x, (5,))),
                 functools.partial(cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm,
                                   chunked(xb, (2, 3)), *params, **options)):
        with pytest.raises(TypeError, match="return_running_stats must be a bool, got str"):
            call(return_running_stats="no")


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


def test_graphs_computed_together_on_threads_each_land_their_update():
    # The threaded scheduler runs the statistics tasks of graphs computed together at once;
    # each reads and writes the shared buffers (NumPy releases the interpreter lock meanwhile)
    # and no update may be lost. Many channels make each update long enough to overlap.
    channels, graphs = 2_000_000, 8
    x = np.random.default_rng(3).random((2, channels, 1))
    batch_mean = x.mean(axis=(0, 2))
    for _ in range(2):
        rm, rv = np.zeros(channels), np.ones(channels)
        ys = [cdask.batch_norm(chunked(x, (1, 1)), running_mean=rm, running_var=rv,
                               momentum=0.5)[:, :1] for _ in range(graphs)]
        dask.compute(*ys, scheduler="threads", num_workers=graphs)
        # After k updates with momentum 1/2, rm = batch_mean * (1 - 2**-k).
        landed = -np.log2(1.0 - rm / batch_mean)
        np.testing.assert_allclose(landed, graphs, atol=1e-6)


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
                             "running_var", "weight", "conv_bias")),
                        (c, ("weight", "scale", "conv_bias"))):
        layer = dict(lazy.dask.layers[lazy.name])
        constants = {k: v for k, v in layer.items() if isinstance(v, np.ndarray)}
        assert sorted(k.split("-")[-2] for k in constants) == sorted(names)
        assert not any(list(arrays_in(task)) for task in layer.values()
                       if not isinstance(task, np.ndarray))
    assert [s.chunks for s in stats] == [((8,),)] * 2


def test_pipeline_b_reads_its_parameters_when_the_graph_runs(rng):
    # As every cufused.dask function: a parameter changed in place after the graph is built
    # counts (the convolution's weight and bias, and the signs of bn_weight, which decide
    # which extremum each channel's windows keep).
    x, params, options = case_b(rng, np.float64)
    lazy = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(chunked(x, (2, 3)), *params,
                                                                   **options)
    weight, bn_weight = params[:2]
    weight *= 0.5
    bn_weight *= -1.0
    options["conv_bias"] += 1.0
    want = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(x, *params, **options)
    assert_close(lazy.compute(), want, 1e-12)


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
    assert all(row[k] > 0 for k in ("loop", "threads", "sync", "one_call_per_chunk"))
    assert "B    ieee" in res.stdout
