"""The DFT convolution (``fft_conv.cu``, pipeline B's stride-1 transposed convolution): the
launcher against the float64 definition on odd shapes, the range scaling at float32's
extremes, non-finite inputs and weights where the definition puts them; pipeline B on it
(forced) against the reference, with running buffers, non-finite values and inside a
captured CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest

import cufused
from cufused._settings import plan_options

from conftest import (GPU, assert_close, count_calls, pipeline_b_args, poisoned, rel_err,
                      to_gpu)

pytestmark = pytest.mark.gpu

if GPU:
    import cupy as cp

# A transform sums whole planes: its float32 error is relative to a plane's norm, so the
# outputs are compared relative to the largest one (design.md section 5's float32 bar).
TOL = 1e-5
PIPELINE_TOL = 1e-4


def fft_conv(x, w, padding, passes=1):
    """``conv_transpose2d_fft`` of float32 copies of ``x`` and ``w`` into a NaN-poisoned
    output, its products in float32 (``passes`` 1) or 3xTF32 (3)."""
    from cufused._kernels.fft_conv import conv_transpose2d_fft

    gx, gw = to_gpu(x, w)
    out_hw = [s + k - 1 - 2 * p for s, k, p in zip(x.shape[2:], w.shape[2:], padding)]
    y = poisoned((x.shape[0], w.shape[1], *out_hw))
    conv_transpose2d_fft(gx, gw, y, padding=padding, passes=passes)
    return y.get()


def scaled_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


SHAPES = [
    ((3, 5, 17, 13), (5, 7, 3, 3), (1, 0)),
    ((2, 9, 8, 11), (9, 10, 5, 5), (1, 2)),
    ((1, 1, 1, 1), (1, 1, 1, 1), (0, 0)),
    ((2, 3, 31, 7), (3, 17, 4, 2), (3, 1)),
    ((1, 2, 6, 40), (2, 3, 2, 6), (0, 5)),
    ((1, 2, 1, 1), (2, 3, 3, 3), (1, 1)),        # L1 = 2 < KH: the weight wraps around
    ((1, 2, 2, 1), (2, 9, 4, 3), (2, 1)),
    ((2, 5, 20, 9), (5, 6, 3, 3), (1, 1)),       # columns of 21 = 3 x 7 (prime factors)
    ((5, 64, 32, 32), (64, 128, 5, 5), (1, 1)),  # pipeline B's planes: 35 = 5 x 7
]


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("x_shape, w_shape, padding", SHAPES)
def test_fft_conv_matches_the_definition(rng, x_shape, w_shape, padding, passes):
    from cufused._kernels.fft_conv import fft_conv_takes

    assert fft_conv_takes(x_shape, w_shape, stride=(1, 1), padding=padding,
                          output_padding=(0, 0), dilation=(1, 1), groups=1)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    ref = cufused.conv_transpose2d(x, w, padding=padding)  # float64 reference
    got = fft_conv(x, w, padding, passes)
    assert got.shape == ref.shape
    assert scaled_err(got, ref) < TOL


def test_fft_conv_takes_only_its_problems():
    from cufused._kernels.fft_conv import fft_conv_takes

    base = dict(stride=(1, 1), padding=(1, 1), output_padding=(0, 0), dilation=(1, 1),
                groups=1)
    x_shape, w_shape = (2, 4, 8, 8), (4, 6, 3, 3)
    assert fft_conv_takes(x_shape, w_shape, **base)
    for change in (dict(stride=(2, 1)), dict(padding=(3, 1)), dict(output_padding=(0, 1)),
                   dict(dilation=(1, 2)), dict(groups=2)):
        assert not fft_conv_takes(x_shape, w_shape, **{**base, **change}), change
    assert not fft_conv_takes((2, 4, 8, 8, 8), (4, 6, 3, 3, 3), **base)
    assert not fft_conv_takes((2, 4, 512, 512), w_shape, **base)  # shared memory
    assert not fft_conv_takes((0, 4, 8, 8), w_shape, **base)


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("x_scale, w_scale", [(1e30, 1e5), (3e38, 1e-10), (1e-30, 1e-2),
                                              (1e-33, 1e2)])
def test_fft_conv_scales_operands_at_float32_extremes(rng, x_scale, w_scale, passes):
    # Outputs within float32's range whose transforms, unscaled, would overflow (a plane's
    # sums reach H * W times its largest value) or fall toward the denormals, which the
    # kernels flush (semantics.rst): each operand is scaled by a power of two to below 1 and
    # the output scaled back. The outputs' largest stays far enough above float32's smallest
    # normal number (1.2e-38) that a flushed output is within the tolerance.
    x = rng.uniform(-1.0, 1.0, (2, 6, 16, 12))
    w = rng.uniform(-1.0, 1.0, (6, 5, 5, 5))
    xs, ws = (x * x_scale).astype(np.float32), (w * w_scale).astype(np.float32)
    ref = cufused.conv_transpose2d(xs.astype(np.float64), ws.astype(np.float64), padding=1)
    assert np.isfinite(ref).all() and 1e-32 < np.abs(ref).max() < 1e37
    got = fft_conv(xs, ws, (1, 1), passes)
    assert np.isfinite(got).all()
    assert scaled_err(got, ref) < TOL


@pytest.mark.parametrize("passes", [1, 3])
def test_fft_conv_nonfinite_values_where_the_definition_puts_them(rng, passes):
    # A NaN, +inf and -inf input (their windows' outputs by the definition; every other output
    # from the transforms of the finite values) and a NaN and an infinite weight (their
    # channels' rows by the definition): the same NaN and infinities as the float64 reference,
    # the finite outputs as accurate as without them.
    x = rng.standard_normal((3, 4, 11, 9))
    w = rng.standard_normal((4, 6, 3, 3))
    x[0, 1, 2, 3] = np.nan
    x[1, 3, 0, 8] = np.inf
    x[1, 0, 10, 0] = -np.inf
    x[2, 2, 5, 4] = np.inf
    w[2, 4, 1, 1] = np.inf
    w[0, 5, 2, 0] = np.nan
    ref = cufused.conv_transpose2d(x, w, padding=1)
    got = fft_conv(x, w, (1, 1), passes)
    for cls in (np.isnan, np.isposinf, np.isneginf):
        assert np.array_equal(cls(got), cls(ref)), cls.__name__
    finite = np.isfinite(ref)
    assert 0 < finite.sum() < ref.size
    assert np.abs(got[finite] - ref[finite]).max() < TOL * np.abs(ref[finite]).max()


def test_fft_conv_3xtf32_inverse_on_tensor_cores_and_on_the_fma_kernel(rng, monkeypatch):
    # "3xtf32" runs the inverse transforms on tensor cores where their operands fit a
    # block's shared memory, else on the FMA kernel: each seen to run, each against the
    # definition.
    from cufused._kernels import fft_conv as F

    names = []
    launch = F.get_kernel
    monkeypatch.setattr(F, "get_kernel",
                        lambda file, name, **kw: names.append(name) or launch(file, name, **kw))
    x_shape, w_shape, padding = (2, 5, 20, 9), (5, 6, 3, 3), (1, 1)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    ref = cufused.conv_transpose2d(x, w, padding=padding)
    assert scaled_err(fft_conv(x, w, padding, 3), ref) < TOL
    assert "fft_conv_output_planes_mma" in names and "fft_conv_output_planes" not in names
    sizes = (21, 10)  # transform_size of (20, 9) with a 3 x 3 kernel and padding 1
    out_hw = ref.shape[2:]
    mma_bytes = 4 * F._output_mma_layout(out_hw, sizes)[1]
    assert F._output_planes_bytes(out_hw, sizes) < mma_bytes
    monkeypatch.setattr(F, "shared_per_block", lambda: mma_bytes - 4)
    names.clear()
    assert scaled_err(fft_conv(x, w, padding, 3), ref) < TOL
    assert "fft_conv_output_planes" in names and "fft_conv_output_planes_mma" not in names


def test_output_mma_layout_is_the_kernels(rng):
    # The launcher's mirror of OutputMmaLayout (its table and shared-memory sizes) against
    # the struct itself, compiled beside a probe kernel, over random geometries.
    from cufused._cuda import COMPILE_OPTIONS, source
    from cufused._kernels.fft_conv import _output_mma_layout

    probe = r"""
extern "C" __global__ void output_mma_layout_probe(const int* shapes, int* out, int count) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const int* s = shapes + 4 * i;
    const OutputMmaLayout lay = OutputMmaLayout::of(s[0], s[1], s[2], s[3]);
    out[2 * i] = lay.S + lay.K2 * lay.sR;
    out[2 * i + 1] = lay.end;
}
"""
    kernel = cp.RawModule(code=source("fft_conv.cu") + probe,
                          options=COMPILE_OPTIONS).get_function("output_mma_layout_probe")
    l1, l2 = rng.integers(1, 80, 500), rng.integers(1, 80, 500)
    shapes = np.stack([l1, l2, rng.integers(1, l1 + 1), rng.integers(1, l2 + 1)], axis=1)
    got = cp.empty((len(shapes), 2), dtype=cp.int32)
    kernel((2,), (256,), (cp.asarray(shapes, dtype=cp.int32), got, np.int32(len(shapes))))
    want = [_output_mma_layout((ho, wo), (a, b)) for a, b, ho, wo in shapes.tolist()]
    assert got.get().tolist() == [list(v) for v in want]


def run_b(arrays, opts, engine, **kwargs):
    out = poisoned(kwargs.pop("shape"))
    with plan_options(engine=engine):
        cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
            *to_gpu(*arrays), **opts, out=out, **kwargs)
    return out.get()


@pytest.mark.parametrize("precision", ["ieee", "3xtf32"])
@pytest.mark.parametrize("geometry", [
    dict(), dict(n=3, cin=5, h=13, w=10, cout=12, groups=3), dict(n=2, cin=9, h=32, w=32,
                                                                   cout=16, groups=4)])
def test_pipeline_b_on_the_dft_convolution(rng, monkeypatch, precision, geometry):
    from cufused._kernels import fft_conv

    arrays, opts = pipeline_b_args(rng, **geometry)
    opts.update(padding=1)
    c = arrays[1].shape[1]
    rm, rv = rng.standard_normal(c), rng.uniform(0.5, 2, c)
    rm_g, rv_g = to_gpu(rm, rv)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, **opts, running_mean=rm, running_var=rv)
    calls = count_calls(monkeypatch, fft_conv, "conv_transpose2d_fft")
    got = run_b(arrays, opts, "fft", shape=ref.shape, running_mean=rm_g, running_var=rv_g,
                precision=precision)
    assert calls == ["conv_transpose2d_fft"]
    assert_close(got, ref, PIPELINE_TOL)
    assert_close(rm_g.get(), rm, PIPELINE_TOL)
    assert_close(rv_g.get(), rv, PIPELINE_TOL)


def test_pipeline_b_tf32_and_other_problems_keep_their_engines(rng, monkeypatch):
    # TF32 (the DFT engine's products are float32), a strided transposed convolution and the
    # public conv_transpose2d (whose outputs are compared one by one) do not run on it.
    from cufused._kernels import fft_conv

    calls = count_calls(monkeypatch, fft_conv, "conv_transpose2d_fft")
    arrays, opts = pipeline_b_args(rng)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*arrays, **opts, padding=1)
    got = run_b(arrays, {**opts, "padding": 1}, "fft", shape=ref.shape, precision="tf32")
    assert_close(got, ref, 5e-3)
    opts.update(stride=2, padding=1, output_padding=1)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*arrays, **opts)
    assert_close(run_b(arrays, opts, "fft", shape=ref.shape, precision="ieee"), ref,
                 PIPELINE_TOL)
    with plan_options(engine="fft"):
        y = cufused.conv_transpose2d(*to_gpu(*arrays[:2]), padding=1)
    assert_close(y.get(), cufused.conv_transpose2d(*arrays[:2], padding=1), 1e-5)
    assert calls == []


@pytest.mark.parametrize("where", ["x nan", "x inf", "w inf", "w nan"])
def test_pipeline_b_nonfinite_on_the_dft_convolution(rng, where):
    # A non-finite input or weight: the reference's NaN (BatchNorm's batch statistics spread
    # it over the channels it reaches) and running buffers.
    arrays, opts = pipeline_b_args(rng, n=3, cin=4, h=10, w=11, cout=8, groups=2)
    opts.update(padding=1)
    x, w = arrays[0].copy(), arrays[1].copy()
    value = np.nan if where.endswith("nan") else np.inf
    if where.startswith("x"):
        x[1, 2, 4, 7] = value
    else:
        w[3, 5, 0, 2] = value
    arrays = (x, w, *arrays[2:])
    rm, rv = rng.standard_normal(8), rng.uniform(0.5, 2, 8)
    rm_g, rv_g = to_gpu(rm, rv)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, **opts, running_mean=rm, running_var=rv)
    got = run_b(arrays, opts, "fft", shape=ref.shape, precision="ieee", running_mean=rm_g,
                running_var=rv_g)
    for have, want in ((got, ref), (rm_g.get(), rm), (rv_g.get(), rv)):
        for cls in (np.isnan, np.isposinf, np.isneginf):
            assert np.array_equal(cls(have), cls(want)), (where, cls.__name__)
        finite = np.isfinite(want)
        if finite.any():
            assert rel_err(have[finite], want[finite]) < PIPELINE_TOL


@pytest.mark.parametrize("replay", [True, False])
def test_pipeline_b_dft_convolution_in_a_captured_graph(rng, monkeypatch, replay):
    # Warm calls replay one graph of the whole call, the DFT engine's cuBLAS products in it
    # (cufused's own cuBLAS handle, put on the capture's stream before the capture begins):
    # the first call runs directly, the second is captured, the later ones launch the graph,
    # which computes new input values. Inside the caller's capture the call records cuDNN's
    # convolution instead (the handle joins only cufused's own captures). Without
    # graph replay every call runs directly, and the caller's capture takes cuDNN alike.
    from cufused._kernels import fft_conv

    calls = count_calls(monkeypatch, fft_conv, "conv_transpose2d_fft")
    arrays, opts = pipeline_b_args(rng, n=3, cin=6, h=12, w=12, cout=8, groups=2)
    opts.update(padding=1, precision="ieee")
    garrays = to_gpu(*arrays)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*arrays, **opts)
    stream = cp.cuda.Stream(non_blocking=True)
    with plan_options(engine="fft", replay=replay), stream:
        out = cp.empty(ref.shape, dtype=cp.float32)
        for _ in range(3):
            cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*garrays, **opts, out=out)
        assert_close(out.get(), ref, PIPELINE_TOL)
        assert calls == ["conv_transpose2d_fft"] * (2 if replay else 3)
        new_x = rng.random(arrays[0].shape)
        garrays[0][...] = cp.asarray(new_x, dtype=cp.float32)
        out.fill(cp.nan)
        cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*garrays, **opts, out=out)
        assert calls == ["conv_transpose2d_fft"] * (2 if replay else 4)
        want = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
            new_x, *arrays[1:], **opts)
        assert_close(out.get(), want, PIPELINE_TOL)
        del calls[:]
        stream.begin_capture()
        cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*garrays, **opts, out=out)
        graph = stream.end_capture()
        assert calls == []
        arrays = (rng.random(arrays[0].shape),) + tuple(arrays[1:])
        garrays[0][...] = cp.asarray(arrays[0], dtype=cp.float32)
        out.fill(cp.nan)
        graph.launch()
        stream.synchronize()
        want = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*arrays, **opts)
        assert_close(out.get(), want, PIPELINE_TOL)
        out.fill(cp.nan)
        cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*garrays, **opts, out=out)
        assert_close(out.get(), want, PIPELINE_TOL)
    assert calls == ([] if replay else ["conv_transpose2d_fft"])  # a replay, else direct


def test_prepared_pipeline_b_replays_the_dft_convolution(rng, monkeypatch):
    # prepare captures the DFT engine's call, cuBLAS products included: replays compute new
    # input values without calling the engine's launcher again. In a thread that has run no
    # cuBLAS call of cufused's, whose first call replays the graph the main thread cached,
    # the capture creates the thread's handle before it begins.
    import threading

    from cufused._kernels import fft_conv

    calls = count_calls(monkeypatch, fft_conv, "conv_transpose2d_fft")
    arrays, opts = pipeline_b_args(rng, n=2, cin=5, h=9, w=11, cout=8, groups=4)
    opts.update(padding=1, precision="3xtf32")
    garrays = to_gpu(*arrays)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*arrays, **opts)
    out = poisoned(ref.shape)
    pipeline = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm
    with plan_options(engine="fft"):
        prepared = cufused.prepare(pipeline, *garrays, **opts, out=out)
        assert "CUDA graph" in repr(prepared) and prepared.result is out
        assert calls == ["conv_transpose2d_fft"] * 2  # the first call and the capture
        new_x = rng.random(arrays[0].shape)
        garrays[0][...] = cp.asarray(new_x, dtype=cp.float32)
        out.fill(cp.nan)
        assert prepared() is out
        cp.cuda.get_current_stream().synchronize()
    want = pipeline(new_x, *arrays[1:], **opts)
    assert_close(out.get(), want, PIPELINE_TOL)
    assert len(calls) == 2
    with plan_options(engine="fft"):
        for _ in range(2):  # the key's graph cached: the thread's first call replays it
            pipeline(*garrays, **opts, out=out)
    cp.cuda.get_current_stream().synchronize()
    del calls[:]
    prepared_in_thread = []

    def prepare_in_thread():
        with plan_options(engine="fft"):
            prepared_in_thread.append(cufused.prepare(pipeline, *garrays, **opts, out=out))

    thread = threading.Thread(target=prepare_in_thread)
    thread.start()
    thread.join()
    assert prepared_in_thread and "CUDA graph" in repr(prepared_in_thread[0])
    assert calls == ["conv_transpose2d_fft"]  # the capture; the first call replayed
    out.fill(cp.nan)
    prepared_in_thread[0]()
    cp.cuda.get_current_stream().synchronize()
    assert_close(out.get(), want, PIPELINE_TOL)


def test_blas_handle_follows_the_stream_and_refuses_a_foreign_capture():
    import threading

    from cupy_backends.cuda.libs import cublas

    from cufused._blas import BlasCaptureError, bind_blas_stream, blas_handle

    first, second = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with first:
        handle = blas_handle()
        assert cublas.getStream(handle) == first.ptr
    with second:
        second.begin_capture()
        try:
            with pytest.raises(BlasCaptureError):
                blas_handle()  # a capture that the handle was not put on beforehand
        finally:
            second.end_capture()
        bind_blas_stream(second)
        second.begin_capture()
        try:
            assert blas_handle() == handle
        finally:
            second.end_capture()
    other = []
    thread = threading.Thread(target=lambda: other.append(blas_handle()))
    thread.start()
    thread.join()
    assert other and other[0] != handle  # one handle per thread
