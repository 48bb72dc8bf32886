"""cufused.dask on CuPy chunks: the threaded scheduler with one or four threads, one task at a
time per device, a local CUDA cluster."""

from __future__ import annotations


import numpy as np
import pytest

import cufused

from conftest import CONSTANT_LEVELS, assert_close, count_calls, mixed, to_gpu
from dask_cases import case_a, case_b, case_c, chunked

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
cdask = pytest.importorskip("cufused.dask")


# --------------------------------------------------------------------------------- on the GPU

@pytest.fixture
def quick_plans():
    """Heuristic cuDNN plans (no autotuning for each new chunk size) keep the tests fast."""
    from cufused._settings import plan_options

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


def check_gpu_pipelines(rng, compute, chunk=chunked):
    """Each pipeline on CuPy chunks (made by ``chunk(x, chunks)``) against the single CuPy call
    (running buffers of B too)."""
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
            lazy = getattr(cdask, name)(chunk(x, chunks), *params, **options, **buffers)
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
def test_gpu_batch_norm_of_values_far_from_zero(rng):
    # Channels uniform in +-1 around 0.1 to 7e4: the chunks' phase 3 centers on the batch's
    # float64 mean, as the single call does (a float32 center is off by up to 0.7 % of a
    # standard deviation); both stay at float32 rounding of the float64 reference.
    import cupy as cp

    x = (CONSTANT_LEVELS[None, :, None, None]
         + rng.uniform(-1.0, 1.0, (9, 8, 5, 7))).astype(np.float32)
    weight, bias = mixed(rng, 8), rng.standard_normal(8)
    ref = cufused.batch_norm(x.astype(np.float64), weight, bias)
    y = cdask.batch_norm(chunked(cp.asarray(x), (4, 4, 1)), *to_gpu(weight, bias))
    assert_close(y.compute().get(), ref, 1e-6)
    assert_close(cufused.batch_norm(cp.asarray(x), *to_gpu(weight, bias)).get(), ref, 1e-6)


@pytest.mark.gpu
def test_gpu_batch_norm_squares_past_float32_range(rng):
    # Channel 0's values (about 1e18) square past float32's range in their sum (the chunks
    # keep theirs in float64) though the variance (about 1e36) fits: the single call's variance
    # is infinite (as PyTorch's float32 sums make it), so its output is the bias and its
    # running variance infinite; the chunks' merged moments give the same. Channel 1 is
    # ordinary.
    import cupy as cp

    x = rng.standard_normal((8, 2, 16, 16)).astype(np.float32)
    x[:, 0] *= np.float32(1e18)
    x = cp.asarray(x)
    weight, bias = to_gpu(mixed(rng, 2), rng.standard_normal(2))
    buffers = [{"running_mean": cp.zeros(2, cp.float32), "running_var": cp.ones(2, cp.float32)}
               for _ in range(2)]
    ref = cufused.batch_norm(x, weight, bias, **buffers[0]).get()
    y = cdask.batch_norm(chunked(x, (4, 4)), weight, bias, **buffers[1]).compute().get()
    assert np.all(ref[:, 0] == np.float32(bias[0].get()))
    assert np.isposinf(buffers[0]["running_var"][0].get())
    assert np.array_equal(y[:, 0], ref[:, 0])
    assert_close(y[:, 1], ref[:, 1], 1e-6)
    for name in ("running_mean", "running_var"):
        got, want = buffers[1][name].get(), buffers[0][name].get()
        assert np.array_equal(np.isinf(got), np.isinf(want))
        assert_close(got[np.isfinite(want)], want[np.isfinite(want)], 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [(3, 3), (1, 2, 2, 1)])
def test_gpu_pipeline_b_constant_channels_with_a_conv_bias(rng, quick_plans, chunks):
    # A 1 x 1 transposed convolution of a constant one-channel input: each output channel is
    # one product, constant and nonzero, which the convolution bias (0.1 to 7e4) rounds.
    # With bn_bias 0 every channel maps to tanh(0) = 0 exactly, so the GroupNorm groups are
    # all zero and the output is exactly gn_bias, on chunks as in the single call: the chunks'
    # sums include the bias without the rounding of y + bias, so their BatchNorm centers on
    # the float32 mean.
    import cupy as cp

    x = cp.full((6, 1, 6, 6), 0.37, dtype=cp.float32)
    weight = cp.asarray(mixed(rng, 8, np.float32).reshape(1, 8, 1, 1) * np.float32(1e-3))
    gn_bias = rng.standard_normal(8)
    params = to_gpu(mixed(rng, 8), np.zeros(8), mixed(rng, 8), gn_bias)
    name = "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm"
    options = dict(num_groups=2, conv_bias=cp.asarray(CONSTANT_LEVELS))
    want = np.broadcast_to(np.float32(gn_bias)[:, None, None], (6, 8, 3, 3))
    single = getattr(cufused, name)(x, weight, *params, **options)
    assert np.array_equal(single.get(), want)
    lazy = getattr(cdask, name)(chunked(x, chunks), weight, *params, **options)
    assert np.array_equal(lazy.compute(scheduler="threads").get(), want)


def b_gpu_case(rng):
    """Pipeline B's case on the GPU (float32), N = 15, with a finite conv bias."""
    import cupy as cp

    x, params, options = case_b(rng, np.float32)
    x = np.concatenate([x] * 3)
    options["conv_bias"] = cp.asarray(options["conv_bias"])
    return cp.asarray(x), [cp.asarray(p) for p in params], options


def check_b_against_the_single_call(x, params, options, chunks, tol):
    """cufused.dask's pipeline B on CuPy chunks against the single call: NaN, inf and -inf
    in the same places, the rest within ``tol``; the running buffers too (an infinite
    convolution bias gives its channel's running mean that infinity)."""
    import cupy as cp

    name = "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm"
    c = params[1].size
    ref_buffers, buffers = ({"running_mean": cp.zeros(c, cp.float32),
                             "running_var": cp.ones(c, cp.float32)} for _ in range(2))
    ref = getattr(cufused, name)(x, *params, **options, **ref_buffers).get()
    y, rm, rv = getattr(cdask, name)(chunked(x, chunks), *params, **options, **buffers,
                                     return_running_stats=True)
    got = [a.get() for a in dask.compute(y, rm, rv, scheduler="threads", num_workers=4)]
    for out, want in zip(got, [ref] + [b.get() for b in ref_buffers.values()]):
        for test in (np.isnan, np.isposinf, np.isneginf):
            assert np.array_equal(test(out), test(want))
        finite = np.isfinite(want)
        assert_close(out[finite], want[finite], tol)
    return ref


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_gpu_pipeline_b_phases_run_the_single_calls_kernels(rng, quick_plans, monkeypatch,
                                                             precision):
    # On CuPy chunks phase 1 is the single call's fused pass (one read of the convolution
    # output for the extrema and the sums) and phase 3 its GroupNorm pass with the BatchNorm
    # coefficients as the pre-map: one launch of each per chunk, no max pool. Channels that
    # are multiples of 4 let the channels-last conv output take the 16-byte variants.
    from cufused.pipelines import pipeline_b

    x = cp_random(rng, (11, 16, 9, 10))
    params = [cp_random(rng, (16, 32, 3, 3), -0.3), to_gpu(mixed(rng, 32))[0],
              cp_random(rng, (32,)), to_gpu(mixed(rng, 32))[0], cp_random(rng, (32,))]
    options = dict(num_groups=8, padding=1, conv_bias=cp_random(rng, (32,)),
                   precision=precision)
    calls = [count_calls(monkeypatch, pipeline_b, name)
             for name in ("pool_extremum_stats", "group_norm_rows")]
    pools = count_calls(monkeypatch, cufused, "max_pool2d")
    y = cdask.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        chunked(x, (4, 4, 3)), *params, **options).compute(scheduler="threads")
    assert [len(c) for c in calls] == [3, 3] and pools == []
    monkeypatch.undo()
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(x, *params, **options)
    # TF32 plans may differ between the chunks' batch size and the whole batch's.
    assert_close(y.get(), ref.get(), 3e-5 if precision == "ieee" else 3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["nan_input", "nan_bias", "inf_bias", "minus_inf_bias",
                                     "zero_nan_bn_weight", "inf_bn_bias", "inf_bn_weight",
                                     "huge_bn_weight", "empty_chunk", "tuple_pool",
                                     "one_channel"])
def test_gpu_pipeline_b_non_finite_values_and_odd_chunks(rng, quick_plans, variant):
    # NaN and inf where the single call (as PyTorch) puts them, through the fused phases, and
    # through the composed ones for an infinite BatchNorm weight; odd chunks and options.
    x, params, options = b_gpu_case(rng)
    chunks = (4, 4, 4, 3)
    if variant == "tuple_pool":
        options["pool_kernel"] = (2, 2)
    elif variant == "one_channel":  # one channel, a 1 x 1 pooled map (NCHW and NHWC at once)
        x = cp_random(rng, (15, 2, 1, 1))
        params = [cp_random(rng, (2, 1, 2, 2), -1.0), *to_gpu([-0.7], [0.3], [1.2], [0.1])]
        options = dict(num_groups=1, conv_bias=to_gpu([0.4])[0])
    if variant == "nan_input":
        x[9, 1, 2, 3] = np.nan
    elif variant.endswith("_bias") and not variant.startswith("inf_bn"):
        options["conv_bias"][2] = {"nan_bias": np.nan, "inf_bias": np.inf,
                                   "minus_inf_bias": -np.inf}[variant]
    elif variant == "zero_nan_bn_weight":  # NaN in GroupNorm group 1 only
        params[1][[0, 1, 5]] = to_gpu([0.0, -0.0, np.nan])[0]
    elif variant == "inf_bn_bias":
        params[2][[1, 6]] = to_gpu([np.inf, -np.inf])[0]
    elif variant == "inf_bn_weight":
        params[1][[3, 4]] = to_gpu([np.inf, -np.inf])[0]
    elif variant == "huge_bn_weight":  # finite weights whose factor weight * rstd overflows
        x *= 1e-3
        params[1][[3, 4]] = to_gpu([3e38, -3e38])[0]
    elif variant == "empty_chunk":
        chunks = (1, 0, 13, 1)
    ref = check_b_against_the_single_call(x, params, options, chunks, 3e-5)
    if not variant.endswith("_bn_weight") or variant == "zero_nan_bn_weight":
        # An infinite factor's channels hold +-1 and NaN, by the values' signs.
        assert np.isnan(ref).any() == variant.startswith(("nan", "inf_bias", "minus", "zero"))
    else:  # factor * v + shift = inf - inf for some window of channels 3 and 4
        assert np.isnan(ref).any()


@pytest.mark.gpu
def test_gpu_rules_across_the_batch_count_the_whole_batch(rng, quick_plans):
    # Chunks of one sample with one value per GroupNorm group pass, as the single call on the
    # batch does (the tasks run inside part_of_batch, one at a time on the device).
    x = cp_random(rng, (3, 6))
    weight, bias = to_gpu(mixed(rng, 6))[0], cp_random(rng, (6,))
    y = cdask.group_norm(chunked(x, (1, 1, 1)), 6, weight, bias).compute(scheduler="threads")
    assert_close(y.get(), cufused.group_norm(x, 6, weight, bias).get(), 3e-5)
    with pytest.raises(ValueError, match="more than 1 value per group"):
        cdask.group_norm(chunked(x[:1], (1,)), 6)


def cp_random(rng, shape, low=0.0):
    """A float32 CuPy array uniform in [low, 1)."""
    return to_gpu(rng.uniform(low, 1.0, shape))[0]


@pytest.mark.gpu
def test_gpu_tasks_run_one_at_a_time_per_device(rng, quick_plans, monkeypatch):
    # Four scheduler threads, yet no two chunks' GPU work interleaves on the device.
    import threading
    import time

    from cufused.dask import _graph

    name, x, params, options = gpu_cases(rng)[0]
    chunk_call = _graph._call_keywords  # what each chunk's task runs (pipeline A)
    spans, guard = [], threading.Lock()

    def timed(*args, **kwargs):
        start = time.perf_counter()
        time.sleep(0.005)  # time for another thread to enter if nothing stopped it
        result = chunk_call(*args, **kwargs)
        with guard:
            spans.append((start, time.perf_counter()))
        return result

    monkeypatch.setattr(_graph, "_call_keywords", timed)
    lazy = getattr(cdask, name)(chunked(x, (4, 4, 4, 3)), *params, **options)
    got = lazy.compute(scheduler="threads", num_workers=4)
    spans.sort()
    assert len(spans) == 4
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert_close(got.get(), getattr(cufused, name)(x, *params, **options).get(), 3e-5)


@pytest.mark.gpu
def test_gpu_tasks_capture_no_graphs(rng, quick_plans, monkeypatch):
    # Tasks get their results and temporaries from the pool at addresses that change from run
    # to run: they run without whole-call graphs, so none is captured (nor dropped) however
    # often the same dask graph runs, while the same call outside Dask, with a fixed out, is
    # captured once and replayed.
    import cupy as cp

    from cufused import _call_graphs

    captures = []
    real_capture = _call_graphs._capture
    monkeypatch.setattr(_call_graphs, "_capture",
                        lambda *args: captures.append("call") or real_capture(*args))
    cufused.clear_caches()
    name, x, params, options = gpu_cases(rng)[1]  # B: phases and a tree reduction
    for _ in range(4):
        lazy = getattr(cdask, name)(chunked(x, (4, 4, 4, 3)), *params, **options)
        got = lazy.compute(scheduler="threads", num_workers=4)
    assert captures == []
    out = cp.empty_like(got)
    for _ in range(3):
        getattr(cufused, name)(x, *params, **options, out=out)
    assert captures == ["call"]
    assert_close(got.get(), out.get(), 3e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("n_gpus", [1, 2])
def test_gpu_pipelines_on_a_local_cuda_cluster(rng, quick_plans, n_gpus):
    # One worker per GPU; with two, each worker computes some of the chunks and B's batch
    # statistics are reduced across both, yet every result equals the single call's.
    import cupy as cp

    dask_cuda = pytest.importorskip("dask_cuda")
    distributed = pytest.importorskip("distributed")
    if cp.cuda.runtime.getDeviceCount() < n_gpus:
        pytest.skip(f"needs {n_gpus} devices")
    with dask_cuda.LocalCUDACluster(n_workers=n_gpus, dashboard_address=None) as local, \
            distributed.Client(local, set_as_default=False) as client:
        client.run(cufused.set_conv_autotune, False)
        devices = client.run(lambda: cp.cuda.Device(0).pci_bus_id)  # domain:bus:device.fn
        assert len(set(devices.values())) == n_gpus  # each worker on a GPU of its own
        workers = sorted(client.scheduler_info()["workers"])

        def spread(x, chunks):
            # Each chunk kept on a worker in turn, as inputs made on the workers are: a whole
            # array sent from the client lives on one worker, and its chunks' tasks with it.
            starts = np.cumsum((0,) + chunks)
            return da.concatenate([
                client.persist(da.from_array(x[a:b], chunks=-1), workers=[workers[i % n_gpus]])
                for i, (a, b) in enumerate(zip(starts[:-1], starts[1:]))])

        with distributed.get_task_stream(client) as tasks:
            check_gpu_pipelines(rng, lambda arrays: dask.compute(*arrays, scheduler=client),
                                spread)
        assert {t["worker"] for t in tasks.data} == set(workers)


@pytest.mark.gpu
def test_gpu_parameters_on_another_device_than_the_current_one(rng, quick_plans):
    # x and the parameters on device 1 while device 0 is current when the graph is built (and
    # in every scheduler thread at its start): the graph's probe runs on the parameters'
    # device, as the single call runs on its x's, and the result and the running buffers are
    # the single call's.
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 devices")
    with cp.cuda.Device(1):
        x = cp.asarray(rng.random((6, 3, 5, 4), dtype=np.float32))
        weight, bias = to_gpu(mixed(rng, 3), rng.standard_normal(3))
        running = [cp.zeros(3, cp.float32), cp.ones(3, cp.float32)]
        ref_running = [cp.zeros(3, cp.float32), cp.ones(3, cp.float32)]
        ref = cufused.batch_norm(x, weight, bias, running_mean=ref_running[0],
                                 running_var=ref_running[1]).get()
    assert cp.cuda.runtime.getDevice() == 0
    lazy = cdask.batch_norm(chunked(x, (2, 2, 2)), weight, bias, running_mean=running[0],
                            running_var=running[1])
    assert_close(lazy.compute(scheduler="threads", num_workers=2).get(), ref, 1e-6)
    for got, want in zip(running, ref_running):
        assert got.device.id == 1
        assert_close(got.get(), want.get(), 1e-6)
