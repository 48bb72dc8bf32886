"""The three pipelines on the GPU against the float64 NumPy reference (and PyTorch CUDA where
importable): fused and unfused, both precisions, every layout, odd sizes, NaN, CUDA graphs."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import cufused

from conftest import (CONSTANT_LEVELS, GPU, TOL, _pinned, assert_close,
                      assert_nonfinite_placement, count_calls, mixed, pipeline_a_args,
                      pipeline_b_args, pipeline_c_args, poisoned, rel_err, to_gpu, torch_cuda)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("quick_plans")]

if GPU:
    import cupy as cp


# -------------------------------------------------------------------------------- pipelines

# A whole pipeline against the float64 reference: float32 far under 1e-4 (design section 5;
# GroupNorm divides by the spread of a few values), TF32 as one TF32 convolution (TOL).
PIPELINE_TOL = {"ieee": 1e-4, "3xtf32": 1e-4, "tf32": TOL["tf32"]}


@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("sign", [True, False])
def test_pipeline_a(rng, layout, method, precision, sign):
    arrays, opts = pipeline_a_args(rng, sign=sign)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    out = poisoned(ref.shape)
    cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays), **opts, method=method,
                                                 precision=precision, out=out)
    assert_close(out.get(), ref, PIPELINE_TOL[precision])


@pytest.mark.parametrize("route", ["unfused", "fused", "igemm", "measured"])
def test_pipeline_a_same_padding_of_an_even_kernel(rng, route):
    # padding="same" with a 4 x 4 kernel pads one zero more after the input than before it,
    # as PyTorch does, on every route (the epilogue kernel's included, forced or measured
    # against cuDNN's on random operands of the extended input's shape).
    from cufused._settings import plan_options

    arrays, opts = pipeline_a_args(rng, k=4, h=20, w=17, pool=2)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts, padding="same")
    assert ref.shape[2:] == (10, 8)
    out = poisoned(ref.shape)
    precision = {"igemm": "3xtf32", "measured": "tf32"}.get(route, "ieee")
    with plan_options(engine="igemm" if route == "igemm" else "auto"):
        cufused.conv2d_groupnorm_scale_maxpool_clamp(
            *to_gpu(*arrays), **opts, padding="same", precision=precision,
            method="unfused" if route == "unfused" else "fused", out=out)
    assert_close(out.get(), ref, PIPELINE_TOL[precision])


INF = float("inf")


@pytest.mark.parametrize("bounds", [(-INF, INF), (0.1, INF), (-INF, 0.25), (INF, 0.5),
                                    (0.2, -INF), (None, 0.25), (0.1, None)])
@pytest.mark.parametrize("route", ["unfused", "fused", "igemm"])
def test_infinite_clamp_bounds(rng, bounds, route):
    # Pipelines A and C with an infinite clamp bound (no bound, as torch.clamp takes it) on
    # each route: the blocks, the fused kernels after cuDNN, and cufused's implicit GEMM
    # forced (A's pass in its epilogue; C's two passes take clamps at most 60 wide, here the
    # bounds past each other, and C's other calls run on cuDNN), NaN and infinities where the
    # reference puts them.
    from cufused._settings import plan_options

    lo, hi = bounds
    method = "unfused" if route == "unfused" else "fused"
    precision = "3xtf32" if route == "igemm" else "ieee"
    for name, make in (("conv2d_groupnorm_scale_maxpool_clamp", pipeline_a_args),
                       ("conv_transpose3d_avgpool_clamp_softmax_multiply", pipeline_c_args)):
        fn = getattr(cufused, name)
        arrays, opts = make(rng)
        opts.update(clamp_min=lo, clamp_max=hi)
        ref = fn(*arrays, **opts)
        out = cp.full(ref.shape, 12345.0, dtype=cp.float32)  # not NaN: NaN is expected
        with plan_options(engine="igemm" if route == "igemm" else "auto"):
            fn(*to_gpu(*arrays), **opts, method=method, precision=precision, out=out)
        # Relative to the reference's values: C's are small (about 1 / (D*H*W)).
        assert_nonfinite_placement(out.get(), ref, PIPELINE_TOL[precision])


@pytest.mark.parametrize("precision", ["ieee", "tf32", "3xtf32"])
@pytest.mark.parametrize("method", ["fused", "unfused"])
def test_pipeline_a_one_channel_one_window(rng, method, precision):
    # One output channel pooled to one position: the contiguous out's strides are those of
    # both layouts, and the fused pass stores its extrema there as NCHW.
    from cufused._settings import plan_options

    arrays, opts = pipeline_a_args(rng, n=2, cin=3, h=4, w=4, cout=1, groups=1, pool=2)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    assert ref.shape == (2, 1, 1, 1)
    for engine in ("cudnn", "igemm") if precision != "ieee" else ("cudnn",):
        out = poisoned(ref.shape)
        with plan_options(engine=engine):
            cufused.conv2d_groupnorm_scale_maxpool_clamp(
                *to_gpu(*arrays), **opts, method=method, precision=precision, out=out)
        assert_close(out.get(), ref, PIPELINE_TOL[precision])


@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("bounds", [(-1e39, 1e39), (-1e39, 0.5), (-np.inf, 3e38)])
def test_pipeline_a_clamp_bounds_past_float32(rng, bounds, method):
    # A finite bound past float32's range clamps as float32's infinity (every float32 value
    # lies within it), with no NumPy overflow warning on the way (an error here).
    import warnings

    arrays, opts = pipeline_a_args(rng)
    opts.update(clamp_min=bounds[0], clamp_max=bounds[1])
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    out = poisoned(ref.shape)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*overflow", category=RuntimeWarning)
        cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays), **opts, method=method,
                                                     out=out)
    assert_close(out.get(), ref, PIPELINE_TOL["ieee"])


@pytest.mark.parametrize("method", ["fused", "unfused"])
def test_pipeline_a_scale_number_past_float32(rng, method):
    # A scale given as a number past float32's range is float32's infinity, as in NumPy's and
    # PyTorch's float32 arithmetic (the reference's values where it is infinite), with no
    # overflow warning on the way (an error here).
    import warnings

    arrays, opts = pipeline_a_args(rng)
    opts.update(clamp_min=-np.inf, clamp_max=np.inf)
    with np.errstate(invalid="ignore"):
        ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays[:5], np.inf, **opts)
    out = poisoned(ref.shape)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*overflow", category=RuntimeWarning)
        cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays[:5]), 1e39, **opts,
                                                     method=method, out=out)
    assert_nonfinite_placement(out.get(), ref, PIPELINE_TOL["ieee"])


@pytest.mark.parametrize("pool", [2, 3])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_pipeline_a_one_position_out_with_channels_last_strides(rng, pool, precision):
    # A (N, C, 1, 1) out whose strides are a channels-last tensor's (PyTorch's channels_last
    # through DLPack) is contiguous as NCHW too: the fused pass stores NCHW there.
    arrays, opts = pipeline_a_args(rng, n=2, cin=3, h=5, w=5, cout=8, groups=2, pool=pool)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    out = poisoned((2, 1, 1, 8)).transpose(0, 3, 1, 2)
    assert out.shape == ref.shape and out.strides == (32, 4, 32, 32)
    for method in ("fused", "unfused"):
        out[...] = cp.nan
        cufused.conv2d_groupnorm_scale_maxpool_clamp(
            *to_gpu(*arrays), **opts, method=method, precision=precision, out=out)
        assert_close(out.get(), ref, PIPELINE_TOL[precision])


def test_pipeline_a_dropped_rows_count_in_stats(rng, layout):
    # 126 // 4 = 31 windows; rows/cols 124-125 are pooled away but shape the statistics.
    arrays, opts = pipeline_a_args(rng, n=2, cin=3, h=128, w=128, cout=8, groups=2)
    opts.update(clamp_min=-1e3, clamp_max=1e3)  # no saturation can hide the change
    before = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    x = arrays[0]
    x[:, :, 126:, :] += 50.0  # feeds only conv rows 124-125, which the pool drops
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    assert rel_err(before, ref) > 1e-3  # the statistics moved every pooled value
    out = poisoned(ref.shape)
    cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays), **opts, out=out)
    assert_close(out.get(), ref, 1e-4)


@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_pipeline_b(rng, layout, method, precision):
    arrays, opts = pipeline_b_args(rng)
    cb = rng.standard_normal(8)
    rm, rv = rng.standard_normal(8), rng.uniform(0.5, 2, 8)
    rm_g, rv_g = to_gpu(rm, rv)
    opts.update(stride=2, padding=1, output_padding=1)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, **opts, conv_bias=cb, running_mean=rm, running_var=rv)
    out = poisoned(ref.shape)
    cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *to_gpu(*arrays), **opts, conv_bias=to_gpu(cb)[0], running_mean=rm_g,
        running_var=rv_g, method=method, precision=precision, out=out)
    assert_close(out.get(), ref, PIPELINE_TOL[precision])
    assert_close(rm_g.get(), rm, PIPELINE_TOL[precision])
    assert_close(rv_g.get(), rv, PIPELINE_TOL[precision])


@pytest.mark.parametrize("cout", [64, 63])
def test_pipeline_b_large_groups_uncached(rng, layout, cout):
    # A (n, group) row of C * 17 * 17 floats exceeds the shared-memory cache: re-read path,
    # with 16-byte accesses (C = 64) and without (C = 63: odd row length).
    arrays, opts = pipeline_b_args(rng, n=2, cin=4, h=32, w=32, cout=cout, groups=1,
                                   conv_groups=1 if cout % 2 else 2)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*arrays, **opts)
    got = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*to_gpu(*arrays), **opts)
    assert_close(got.get(), ref, 1e-4)


@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("clamp", [(0.0, 1.0), (-50.0, 40.0)])
def test_pipeline_c(rng, layout, method, precision, clamp):
    arrays, opts = pipeline_c_args(rng)
    opts.update(clamp_min=clamp[0], clamp_max=clamp[1])
    cb = rng.standard_normal(5)
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts, conv_bias=cb)
    out = poisoned(ref.shape)
    cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
        *to_gpu(*arrays), **opts, conv_bias=to_gpu(cb)[0], method=method,
        precision=precision, out=out)
    # Outputs are tiny (~1 / (D*H*W)): only a relative check can tell them from zeros.
    assert rel_err(out.get(), ref) < PIPELINE_TOL[precision]


@pytest.mark.parametrize("engine", ["cudnn", "igemm", "fft"])
@pytest.mark.parametrize("precision", ["ieee", "tf32", "3xtf32"])
def test_pipeline_b_non_finite_weight_on_a_tap_that_reaches_no_output(rng, engine, precision):
    # The padding crops every output that the weight's tap (0, 0) would reach, so its infinity
    # and NaN meet no value by the definition and every channel stays finite, on every
    # engine (an algorithm may multiply it by the padding's zeros).
    from cufused._settings import plan_options

    x = rng.random((4, 3, 2, 2))
    w = rng.standard_normal((3, 4, 5, 5))
    w[:, 0, 0, 0], w[1, 2, 0, 0] = np.inf, np.nan
    params = [mixed(rng, 4) for _ in range(4)]
    opts = dict(num_groups=2, padding=2)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(x, w, *params, **opts)
    assert np.isfinite(ref).all()
    out = poisoned(ref.shape)
    with plan_options(engine=engine):
        cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
            *to_gpu(x, w, *params), **opts, precision=precision, out=out)
    assert_close(out.get(), ref, PIPELINE_TOL[precision])


@pytest.mark.parametrize("view", ["zero stride", "negative stride"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_pipeline_c_out_whose_size_1_axis_has_any_stride(rng, precision, view):
    # An output of one position wide: out[..., None] (stride 0) and out[..., ::-1] (stride
    # -4) of that axis are C-contiguous, and the softmax reads the rows of the convolution
    # written into out by their dense strides.
    x = rng.random((2, 4, 6, 6, 2))
    w = rng.standard_normal((4, 5, 3, 3, 1)) * 0.3
    opts = dict(stride=1, padding=0, output_padding=0, pool_kernel=2, clamp_min=-0.2,
                clamp_max=0.4)
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(x, w, 1.5, **opts)
    assert ref.shape == (2, 5, 5, 5, 1)
    dense = poisoned(ref.shape[:-1])
    out = dense[..., None] if view == "zero stride" else poisoned(ref.shape)[..., ::-1]
    assert out.flags.c_contiguous and out.strides[-1] in (0, -4)
    got = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
        *to_gpu(x, w), 1.5, **opts, precision=precision, out=out)
    assert got is out
    assert_close(out.get(), ref, PIPELINE_TOL[precision])


@pytest.mark.parametrize("engine", ["cudnn", "igemm"])
@pytest.mark.parametrize("precision", ["tf32", "3xtf32"])
def test_pipeline_c_nan_with_its_payload_in_the_low_bits(rng, precision, engine):
    # A NaN whose payload lies in the 13 bits that TF32 drops (an infinity where the tensor
    # cores read it as stored): its sample's rows NaN, as the reference's (the pool's
    # arithmetic quiets it before the convolution).
    from cufused._settings import plan_options

    arrays, opts = pipeline_c_args(rng)
    position = (1, 2, 3, 4, 5)
    arrays[0][position] = np.nan
    with np.errstate(invalid="ignore"):
        ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts)
    assert np.isnan(ref[1]).all() and np.isfinite(ref[0]).all()
    gpu = to_gpu(*arrays)
    gpu[0].view(cp.uint32)[position] = 0x7F800001
    out = poisoned(ref.shape)
    with plan_options(engine=engine):
        cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*gpu, **opts,
                                                                precision=precision, out=out)
    assert_nonfinite_placement(out.get(), ref, PIPELINE_TOL[precision])


@pytest.mark.parametrize("bound", [1e10, -1e10, 3e38, -3e38, 1e39, -1e39])
@pytest.mark.parametrize("engine", ["cudnn", "igemm"])
def test_pipeline_c_clamp_bounds_far_from_zero(rng, engine, bound):
    # Both bounds at one huge value: every value clamps to it, and the softmax is uniform
    # (every path forms each exponent from v - clamp_middle(clamp_min, clamp_max)); past
    # float32's range too (the reference's values all at the bound).
    from cufused._settings import plan_options

    arrays, opts = pipeline_c_args(rng)
    opts.update(clamp_min=bound, clamp_max=bound)
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts)
    out = poisoned(ref.shape)
    with plan_options(engine=engine):
        cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            *to_gpu(*arrays), **opts, precision="tf32", out=out)
    assert_close(out.get(), ref, 1e-5)


@pytest.mark.parametrize("geometry", [{}, dict(n=3, cin=4, d=16, h=12, w=4, cout=6)],
                         ids=["two-pass", "one-read"])
@pytest.mark.parametrize("engine,precision", [("cudnn", "ieee"), ("cudnn", "tf32"),
                                              ("igemm", "tf32")])
@pytest.mark.parametrize("clamp,scale_by", [((0.0, 60.0), 1e20), ((-160.0, -100.0), 1e-10)],
                         ids=["large-scale-values-at-the-floor", "small-scale-values-at-the-top"])
def test_pipeline_c_extreme_scales_with_a_60_wide_clamp(rng, engine, precision, geometry, clamp,
                                                        scale_by):
    # A clamp 60 wide skips the softmax's max pass. Exponents taken from clamp_max would make
    # a row's sum ~e^-60 per value near the floor, and a scale of 1e20 would overflow the
    # factor scale / sum (inf where PyTorch's outputs are ~1e20 / (D*H*W)); taken from
    # clamp_min, the sum would be ~e^60 per value at the top, and a scale of 1e-10 would flush
    # the factor to 0. From the clamp's middle both stay normal. On every softmax path: the
    # implicit GEMM's epilogue, the one-read cluster kernel (sm_90) and the statistics +
    # normalize pass.
    from cufused._settings import plan_options

    (x, w, scale), opts = pipeline_c_args(rng, **geometry)
    arrays = (x, w, scale * scale_by)
    opts.update(clamp_min=clamp[0], clamp_max=clamp[1])
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts)
    out = poisoned(ref.shape)
    with plan_options(engine=engine):
        cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            *to_gpu(*arrays), **opts, precision=precision, out=out)
    got = out.get()
    assert np.isfinite(got).all() and (np.abs(got) > 0).all()
    assert rel_err(got, ref) < PIPELINE_TOL[precision]


# Zero weights make every convolution output its channel's bias. In A one bias per GroupNorm
# group makes each group constant far from zero, and the output is exactly
# clamp(gn_bias * scale); in B each BatchNorm channel is constant, and with bn_bias = 0 the
# GroupNorm groups are all zero, so the output is exactly gn_bias. A's routes apply the
# affine in channel_affine (cuDNN, NCHW output), in the transposing affine (a channels-last
# output: 32 channels take the pass's window-row variant, which stores the extrema
# channels-last), in group_affine_rows (the implicit GEMM's epilogue), and in the blocks
# (unfused). B's single call skips the bias in its statistics and extrema (y = 0 here); its
# unfused route normalizes y + bias in BatchNorm's channel_affine.
ZERO_WEIGHT_ROUTES = {
    "unfused": ("unfused", "ieee", {}),
    "cudnn-ieee": ("fused", "ieee", dict(engine="cudnn")),
    "cudnn-nhwc": ("fused", "ieee", dict(engine="cudnn", autotune=False, pins=("nhwc",))),
    "cudnn-tf32": ("fused", "tf32", dict(engine="cudnn")),
    "igemm-tf32": ("fused", "tf32", dict(engine="igemm")),
    "igemm-3xtf32": ("fused", "3xtf32", dict(engine="igemm")),
}


@pytest.mark.parametrize("route", list(ZERO_WEIGHT_ROUTES))
def test_pipelines_of_zero_weights_give_the_bias(rng, route):
    from cufused._settings import plan_options

    method, precision, plans = ZERO_WEIGHT_ROUTES[route]
    (x, w, _, gw, gb, scale), opts = pipeline_a_args(rng, cout=32, groups=4)
    arrays = (x, np.zeros_like(w), np.repeat(CONSTANT_LEVELS[:4], 8), gw, gb, scale)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    want = np.clip(np.float32(gb)[:, None, None] * np.float32(scale), np.float32(-0.5),
                   np.float32(0.7))
    out = poisoned(ref.shape)
    with plan_options(**plans):
        cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays), **opts, method=method,
                                                     precision=precision, out=out)
    assert np.array_equal(out.get(), np.broadcast_to(want, ref.shape))
    (x, w, bw, _, gw, gb), opts = pipeline_b_args(rng)
    arrays = (x, np.zeros_like(w), bw, np.zeros(8), gw, gb)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*arrays, **opts)
    out = poisoned(ref.shape)
    with plan_options(**plans):
        cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
            *to_gpu(*arrays), **opts, conv_bias=cp.asarray(CONSTANT_LEVELS), method=method,
            precision=precision, out=out)
    assert np.array_equal(out.get(), np.broadcast_to(np.float32(gb)[:, None, None], ref.shape))


@pytest.mark.parametrize("route", list(ZERO_WEIGHT_ROUTES))
def test_pipeline_a_without_a_bias_centers_on_the_float64_mean(rng, monkeypatch, route):
    # A 1 x 1 convolution that copies each channel of integers in [1024, 1032) (exact in
    # TF32, 3xTF32 and a GEMM), spread 2.3 around 1028: without a convolution bias the sums
    # are of the normalized values, and each route centers on their float64 mean (the
    # float32 mean's rounding alone would leave about 1e-5 relative error).
    from cufused._settings import plan_options
    from cufused.pipelines import pipeline_a

    method, precision, plans = ZERO_WEIGHT_ROUTES[route]
    epilogue = count_calls(monkeypatch, pipeline_a, "group_affine_rows")
    c = 32
    x = rng.integers(1024, 1032, (2, c, 12, 10)).astype(np.float64)
    w = np.eye(c).reshape(c, c, 1, 1)
    arrays = (x, w, None, mixed(rng, c), rng.standard_normal(c),
              mixed(rng, c).reshape(c, 1, 1))
    opts = dict(num_groups=4, pool_kernel=2, clamp_min=-10.0, clamp_max=10.0)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    out = poisoned(ref.shape)
    with plan_options(**plans):
        cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays), **opts, method=method,
                                                     precision=precision, out=out)
    assert_close(out.get(), ref, 1e-6)
    assert len(epilogue) == route.startswith("igemm")
    # Groups constant at levels far from zero: their float64 mean is their value, and each
    # gives exactly gn_bias * scale.
    x = np.broadcast_to(np.repeat(CONSTANT_LEVELS[:4], 8)[:, None, None], x.shape)
    arrays = (x,) + arrays[1:]
    want = np.clip(np.float32(arrays[4])[:, None, None] * np.float32(arrays[5]),
                   np.float32(-10.0), np.float32(10.0))
    out = poisoned(ref.shape)
    with plan_options(**plans):
        cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays), **opts, method=method,
                                                     precision=precision, out=out)
    assert np.array_equal(out.get(), np.broadcast_to(want, ref.shape))


def test_pipeline_b_chunk_pre_map_of_constant_channels(rng):
    # cufused.dask's phase 3 (_chunk_normalized) on pooled extrema constant at their float32
    # level, with a float64 batch mean a quarter ulp away from it. Sums that include the
    # convolution bias (centered_sums False) center on the float32 mean, the level: each
    # channel maps to tanh(bn_bias) = 0 exactly, and the all-zero GroupNorm groups give
    # exactly gn_bias. Sums of the pooled values themselves center on the float64 mean: each
    # channel maps to tanh(-a * ulp / 4), and GroupNorm spreads those.
    from cufused.pipelines.pipeline_b import _chunk_normalized

    shape = (3, 8, 5, 4)
    pooled = np.ascontiguousarray(np.broadcast_to(CONSTANT_LEVELS[:, None, None], shape))
    mean = CONSTANT_LEVELS.astype(np.float64) + np.spacing(CONSTANT_LEVELS) / 4
    bw, gw, gb = mixed(rng, 8), mixed(rng, 8), rng.standard_normal(8)
    var, eps = 0.25, 1e-5
    pre = np.tanh(bw * (CONSTANT_LEVELS - mean) / np.sqrt(var + eps))
    want = {False: np.broadcast_to(np.float32(gb)[:, None, None], shape),
            True: cufused.group_norm(np.broadcast_to(pre[:, None, None], shape), 2, gw, gb,
                                     eps=eps)}
    for centered_sums, expected in want.items():
        got = _chunk_normalized(cp.asarray(pooled), cp.asarray(mean),
                                cp.full(8, var, dtype=cp.float32),
                                *to_gpu(bw, np.zeros(8), gw, gb), num_groups=2, eps=eps,
                                centered_sums=centered_sums)
        if centered_sums:
            assert_close(got.get(), expected, 1e-5)
        else:
            assert np.array_equal(got.get(), expected)


def test_pipeline_b_odd_group_rows(rng, layout):
    # One channel of 5 * 5 pooled values per group: rows too short for 16-byte accesses.
    arrays, opts = pipeline_b_args(rng, h=8, w=8, cout=8, groups=8)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*arrays, **opts)
    out = poisoned(ref.shape)
    cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*to_gpu(*arrays), **opts, out=out)
    assert_close(out.get(), ref, 1e-4)


@pytest.mark.parametrize("pipeline,cout", [("A", 32), ("A", 64), ("B", 64), ("B", 128)])
def test_pipeline_channels_last_window_rows(rng, pipeline, cout):
    # C_out in {32, 64, 128}, channels-last, with rows and columns the pool drops. A (pool 4):
    # the fused pass reads whole window rows per warp; B (pool 2): 16-byte channel quads, the
    # pooled extrema stored channels-last and read so by the GroupNorm.
    if pipeline == "A":
        arrays, opts = pipeline_a_args(rng, cout=cout, groups=8)
        fn = cufused.conv2d_groupnorm_scale_maxpool_clamp
    else:
        arrays, opts = pipeline_b_args(rng, cout=cout, groups=4)
        fn = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm
    ref = fn(*arrays, **opts)
    out = poisoned(ref.shape)
    with _pinned("nhwc"):
        fn(*to_gpu(*arrays), **opts, out=out)
    assert_close(out.get(), ref, PIPELINE_TOL["ieee"])


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_pipeline_c_channels_last_vectorized(rng, precision):
    # C_out % 4 == 0 and D*H*W % 4 == 0: the 16-byte transposing normalize pass runs.
    arrays, opts = pipeline_c_args(rng, cout=8)
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts)
    out = poisoned(ref.shape)
    with _pinned("nhwc"):
        cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            *to_gpu(*arrays), **opts, precision=precision, out=out)
    assert rel_err(out.get(), ref) < PIPELINE_TOL[precision]


@pytest.mark.parametrize("pin", ["subpixel nchw", "nchw"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_pipeline_c_one_read(rng, monkeypatch, pin, precision):
    # Output D = 16 (whole planes for each of a cluster's 8 blocks) and H * W % 4 == 0: the
    # one-read cluster kernel normalizes the class blocks ("subpixel nchw") or the NCDHW rows
    # ("nchw"). A NaN input turns its sample's rows to NaN.
    softmax_module = importlib.import_module("cufused._kernels.softmax")
    chosen = []
    one_read_geometry = softmax_module.one_read_geometry
    monkeypatch.setattr(softmax_module, "one_read_geometry",
                        lambda *args: chosen.append(one_read_geometry(*args)) or chosen[-1])
    arrays, opts = pipeline_c_args(rng, n=3, cin=4, d=16, h=12, w=4, cout=6)
    arrays[0][2, 1, 3, 5, 1] = np.nan
    cb = rng.standard_normal(6)
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts, conv_bias=cb)
    out = poisoned(ref.shape)
    with _pinned(pin):
        cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            *to_gpu(*arrays), **opts, conv_bias=to_gpu(cb)[0], precision=precision, out=out)
    assert chosen and chosen[-1] is not None
    got = out.get()
    assert np.isnan(ref[2]).all() and np.array_equal(np.isnan(got), np.isnan(ref))
    mask = ~np.isnan(ref)
    assert rel_err(got[mask], ref[mask]) < PIPELINE_TOL[precision]


@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("precision", ["ieee", "3xtf32"])
def test_pipeline_b_running_mean_of_a_small_mean(rng, method, precision):
    # A 1 x 1 transposed convolution of stride 3 leaves 8 of 9 values 0, and inputs of channel
    # means 0.02 (weights summing to 0.5 over the input channels) make the batch mean about a
    # hundredth of the spread, while the shift (the first value) is of the spread's size:
    # float32 sums of the shifted values would drift by it per value and round at its scale.
    # With double sums the running mean has about PyTorch's accuracy (a few 1e-7); the fused
    # pass first sums pairs of values in float32, exact for two of the zeros.
    x = rng.uniform(-1.0, 1.0, (2, 3, 9, 9))
    x -= x.mean(axis=(0, 2, 3), keepdims=True) - 0.02
    x = x.astype(np.float32)
    w = rng.uniform(-0.5, 0.5, (3, 4, 1, 1))
    w[0] = 0.5 - w[1:].sum(axis=0)
    w = w.astype(np.float32)
    bn_w, bn_b, gn_w, gn_b = mixed(rng, 4), rng.standard_normal(4), mixed(rng, 4), None
    y = np.zeros((2, 4, 25, 25))
    y[:, :, ::3, ::3] = np.einsum("nihw,io->nohw", x.astype(np.float64), w[:, :, 0, 0])
    mean = y.mean(axis=(0, 2, 3))
    condition = y.std(axis=(0, 2, 3)) / np.abs(mean)
    assert ((condition > 30) & (condition < 500)).all()  # the premise
    rm, rv = cp.zeros(4, dtype=cp.float32), cp.ones(4, dtype=cp.float32)
    cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *to_gpu(x, w, bn_w, bn_b, gn_w), gn_b, num_groups=2, stride=3, running_mean=rm,
        running_var=rv, momentum=1.0, method=method, precision=precision)
    assert (np.abs(rm.get() - mean) / np.abs(mean)).max() < 1e-6


@pytest.mark.parametrize("method", ["fused", "unfused"])
def test_pipeline_b_nan_reaches_running_buffers(rng, method):
    # A NaN input value reaches every channel's batch statistics: every output and both running
    # buffers turn NaN, as in PyTorch (the variance's clamp at 0 must not drop the NaN).
    arrays, opts = pipeline_b_args(rng)
    arrays[0][1, 0, 3, 4] = np.nan
    rm, rv = rng.standard_normal(8), rng.uniform(0.5, 2, 8)
    rm_g, rv_g = to_gpu(rm, rv)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, **opts, running_mean=rm, running_var=rv)
    got = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *to_gpu(*arrays), **opts, running_mean=rm_g, running_var=rv_g, method=method)
    for expected, result in ((ref, got), (rm, rm_g), (rv, rv_g)):
        assert np.isnan(expected).all() and np.isnan(result.get()).all()


@pytest.mark.parametrize("method", ["fused", "unfused"])
def test_pipeline_b_infinity_at_a_channels_first_value(rng, method):
    # x[0, 0, 0, 0] = inf with positive weights from input channel 0: every channel's
    # convolution output holds +inf at its first positions, its first value among them. The
    # batch mean, and so the running mean, is +inf (the shifted sums must not take the
    # infinity as their shift: inf - inf); the variance and every output are NaN.
    arrays, opts = pipeline_b_args(rng)
    arrays[1][0] = np.abs(arrays[1][0]) + 0.1
    arrays[0][0, 0, 0, 0] = np.inf
    # Where the infinity lands is the convolution algorithm's (an FFT plan spreads NaN): in
    # "tf32" the convolution is a GEMM's, which keeps it.
    y = cufused.conv_transpose2d(*to_gpu(arrays[0], arrays[1]), precision="tf32").get()
    if not np.isposinf(y[0, :, 0, 0]).all():
        pytest.skip("this device's convolution plan does not keep the infinity")
    rm, rv = rng.standard_normal(8), rng.uniform(0.5, 2, 8)
    rm_g, rv_g = to_gpu(rm, rv)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, **opts, running_mean=rm, running_var=rv)
    got = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *to_gpu(*arrays), **opts, running_mean=rm_g, running_var=rv_g, method=method,
        precision="tf32")
    assert np.isposinf(rm).all() and np.isposinf(rm_g.get()).all()
    for expected, result in ((ref, got), (rv, rv_g)):
        assert np.isnan(expected).all() and np.isnan(result.get()).all()


@pytest.mark.parametrize("method", ["fused", "unfused"])
def test_pipeline_b_non_finite_conv_bias_in_the_running_buffers(rng, method):
    # As in PyTorch (and the NumPy path): an infinite bias makes its channel's running mean
    # that infinity and its running variance NaN, a NaN bias both NaN; the other channels
    # as usual.
    arrays, opts = pipeline_b_args(rng)
    bias = rng.standard_normal(8)
    bias[[2, 3, 4]] = [np.inf, -np.inf, np.nan]
    rm, rv = rng.standard_normal(8), rng.uniform(0.5, 2, 8)
    rm_g, rv_g = to_gpu(rm, rv)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, **opts, conv_bias=bias, running_mean=rm, running_var=rv)
    got = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *to_gpu(*arrays), **opts, conv_bias=to_gpu(bias)[0], running_mean=rm_g,
        running_var=rv_g, method=method)
    assert rm[2] == np.inf and rm[3] == -np.inf and np.isnan(rm[4])
    for expected, result in ((ref, got), (rm, rm_g), (rv, rv_g)):
        result = result.get()
        for test in (np.isnan, np.isposinf, np.isneginf):
            assert np.array_equal(test(result), test(expected))
        finite = np.isfinite(expected)
        assert_close(result[finite], expected[finite], 1e-4)


def test_pipelines_propagate_nan(rng):
    # out starts finite (NaN is the expected value), so every NaN in it is the call's.
    arrays, opts = pipeline_a_args(rng)
    arrays[0][1, 2, 5, 5] = np.nan
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    out = cp.full(ref.shape, 12345.0, dtype=cp.float32)
    cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*arrays), **opts, out=out)
    assert np.isnan(ref[1]).all() and not np.isnan(ref[0]).any()
    assert_nonfinite_placement(out.get(), ref, PIPELINE_TOL["ieee"])
    arrays, opts = pipeline_c_args(rng)
    arrays[0][0, 0, 0, 0, 0] = np.inf
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*arrays, **opts)
    out = cp.full(ref.shape, 12345.0, dtype=cp.float32)
    cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*to_gpu(*arrays), **opts, out=out)
    assert_nonfinite_placement(out.get(), ref, PIPELINE_TOL["ieee"])


def test_empty_batch():
    x = cp.empty((0, 5, 9, 9), dtype=cp.float32)
    w, ones = to_gpu(np.ones((8, 5, 3, 3)), np.ones(8))
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(
        x, w, None, ones, None, ones, num_groups=2, pool_kernel=2, clamp_min=0, clamp_max=1)
    assert got.shape == (0, 8, 3, 3)


@pytest.mark.parametrize("method", ["fused", "unfused"])
def test_pipeline_capture_in_cuda_graph(rng, layout, method):
    arrays, opts = pipeline_a_args(rng)
    opts.update(method=method)
    garrays = to_gpu(*arrays)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cp.empty(ref.shape, dtype=cp.float32)
        # Warm on this stream: counted, captured into a whole-call graph, then launched from
        # the raw arguments; inside the caller's capture the same call must record its kernels.
        for _ in range(3):
            cufused.conv2d_groupnorm_scale_maxpool_clamp(*garrays, **opts, out=out)
        # A building block without out; its plan, where pinned sub-pixel, gathers its
        # weight through an index the plan owns.
        ct_x, ct_w = rng.random((2, 4, 5, 6)), rng.standard_normal((4, 3, 3, 3))
        ct_args = to_gpu(ct_x, ct_w)
        for _ in range(3):
            cufused.conv_transpose2d(*ct_args, stride=2, padding=1)
        stream.begin_capture()
        cufused.conv2d_groupnorm_scale_maxpool_clamp(*garrays, **opts, out=out)
        fresh = cufused.conv2d_groupnorm_scale_maxpool_clamp(*garrays, **opts)
        ct_out = cufused.conv_transpose2d(*ct_args, stride=2, padding=1)
        graph = stream.end_capture()
        # The plan cache cleared (clear_caches alone frees what the capture recorded), then
        # arrays of every size up to past the convolution output's, allocated after the
        # capture: the pool must not hand them the captured calls' temporaries, which each
        # launch writes.
        cufused.clear_plan_cache()
        sizes = np.unique(np.geomspace(1, 4 * ref.size * 16, 60).astype(int))
        junk = [cp.full(int(k), 7.0, dtype=cp.float32) for k in sizes for _ in range(3)]
        arrays = (rng.random(arrays[0].shape),) + tuple(arrays[1:])
        garrays[0][...] = cp.asarray(arrays[0], dtype=cp.float32)
        out.fill(cp.nan)
        fresh.fill(cp.nan)
        ct_out.fill(cp.nan)
        graph.launch()
    stream.synchronize()
    want = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    assert_close(out.get(), want, 1e-4)
    assert_close(fresh.get(), want, 1e-4)
    assert_close(ct_out.get(), cufused.conv_transpose2d(ct_x, ct_w, stride=2, padding=1), 1e-4)
    assert all(bool((j == 7.0).all()) for j in junk)


@pytest.mark.parametrize("precision", ["ieee", "tf32", "3xtf32"])
def test_pipeline_a_sample_past_2_31_elements(rng, monkeypatch, precision):
    # One sample whose convolution output has 64 * 5798**2 > 2**31 elements: the fused pass
    # indexes within a sample in 32 bits, so the call takes the unfused blocks ("tf32" and
    # "3xtf32": the convolution on cufused's implicit GEMM, forced); checked against PyTorch
    # CUDA in float32 (a float64 reference of 2**31 values would not fit the test).
    from cufused._settings import plan_options
    from cufused._kernels import conv_gemm

    torch = torch_cuda()
    F = torch.nn.functional
    x = cp.random.default_rng(int(rng.integers(2**31))).random((1, 1, 5800, 5800),
                                                              dtype=cp.float32)
    w, b, gw, gb, s = to_gpu(rng.standard_normal((64, 1, 3, 3)), rng.standard_normal(64),
                             mixed(rng, 64), rng.standard_normal(64), mixed(rng, 64))
    calls = count_calls(monkeypatch, conv_gemm, "conv2d_implicit_gemm")
    with plan_options(engine="cudnn" if precision == "ieee" else "igemm"):
        got = cufused.conv2d_groupnorm_scale_maxpool_clamp(
            x, w, b, gw, gb, s, num_groups=16, pool_kernel=4, clamp_min=-0.5, clamp_max=0.5,
            precision=precision)
    assert calls == ([] if precision == "ieee" else ["conv2d_implicit_gemm"])
    t = [torch.from_dlpack(a) for a in (x, w, b, gw, gb, s)]
    with torch.backends.cudnn.flags(allow_tf32=False):
        y = F.group_norm(F.conv2d(t[0], t[1], t[2]), 16, t[3], t[4]) * t[5].view(1, -1, 1, 1)
        want = torch.clamp(F.max_pool2d(y, 4), -0.5, 0.5)
    del y
    assert_close(got.get(), want.cpu().numpy(), 5e-3 if precision == "tf32" else 1e-4)
    del got, want, t, x
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("precision", ["ieee", "tf32", "3xtf32"])
def test_pipeline_b_batch_past_2_31_elements(rng, precision):
    # A convolution output of 2684355 * 8 * 10 * 10 > 2**31 elements over the batch (a
    # sample's are few): BatchNorm's statistics and running buffers span the whole batch, so
    # the check is against PyTorch CUDA in float32 on the whole batch, on every 4099th
    # sample and the last (the statistics enter every sample).
    torch = torch_cuda()
    F = torch.nn.functional
    n = 2**31 // 800 + 1
    x = cp.random.default_rng(int(rng.integers(2**31))).random((n, 4, 8, 8), dtype=cp.float32)
    w, bw, bb, gw, gb = to_gpu(rng.standard_normal((4, 8, 3, 3)), mixed(rng, 8),
                               rng.standard_normal(8), mixed(rng, 8), rng.standard_normal(8))
    rm, rv = to_gpu(rng.standard_normal(8), rng.uniform(0.5, 2, 8))
    t = [torch.from_dlpack(a) for a in (x, w, bw, bb, gw, gb)]
    trm, trv = torch.from_dlpack(rm).clone(), torch.from_dlpack(rv).clone()
    got = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        x, w, bw, bb, gw, gb, num_groups=2, running_mean=rm, running_var=rv,
        precision=precision)
    assert got.shape == (n, 8, 5, 5) and n * 8 * 10 * 10 > 2**31
    with torch.backends.cudnn.flags(allow_tf32=False):
        y = F.conv_transpose2d(t[0], t[1])
        y = torch.tanh(F.batch_norm(y, trm, trv, t[2], t[3], training=True))
        want = F.group_norm(F.max_pool2d(y, 2), 2, t[4], t[5])
    del y
    tol = 5e-3 if precision == "tf32" else 1e-4
    rows = list(range(0, n, 4099)) + [n - 1]
    assert_close(got[rows].get(), want[rows].cpu().numpy(), tol)
    assert_close(rm.get(), trm.cpu().numpy(), tol)
    assert_close(rv.get(), trv.cpu().numpy(), tol)
    del got, want, t, x
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("precision", ["ieee", "tf32", "3xtf32"])
def test_pipeline_c_batch_past_2_31_elements(rng, monkeypatch, precision):
    # A convolution output (and result) of 65537 * 16 * 8 * 16 * 16 > 2**31 elements over the
    # batch: the softmax is per sample, so samples at the start, middle and end are checked
    # against the float64 reference of each alone. "3xtf32" on cufused's implicit GEMM
    # (forced): the class groups with the softmax sums in their epilogue on the wgmma build.
    from cufused._settings import plan_options
    from cufused._kernels.conv_gemm import _FILE, arch_target
    from cufused.pipelines import pipeline_c

    n = 2**31 // 32768 + 1
    x = cp.random.default_rng(int(rng.integers(2**31))).random((n, 4, 8, 16, 16),
                                                              dtype=cp.float32)
    w, s, b = to_gpu(rng.standard_normal((4, 16, 3, 3, 3)), mixed(rng, 16),
                     rng.standard_normal(16))
    opts = dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=-0.3,
                clamp_max=0.4)
    groups = count_calls(monkeypatch, pipeline_c, "conv_transpose3d_groups_softmax_sums")
    recompute = count_calls(monkeypatch, pipeline_c, "conv_transpose3d_softmax")
    with plan_options(engine="igemm" if precision == "3xtf32" else "auto"):
        got = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            x, w, s, conv_bias=b, precision=precision, **opts)
    assert got.shape == (n, 16, 8, 16, 16) and got.size > 2**31
    if precision == "3xtf32":  # the class groups ran their kernel, not the fallback
        on_groups = arch_target(_FILE) == "sm_90a"
        assert bool(groups) == on_groups and bool(recompute) != on_groups, (groups, recompute)
    else:
        assert not groups
    for i in (0, n // 2, n - 1):
        ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            x[i:i + 1].get(), w.get(), s.get(), conv_bias=b.get(), **opts)
        assert rel_err(got[i:i + 1].get(), ref) < PIPELINE_TOL[precision]
    del got, x
    cp.get_default_memory_pool().free_all_blocks()


# ----------------------------------------------------------------------- canonical shapes


def test_canonical_pipelines_match_torch_cuda(rng):
    from cufused._settings import plan_options

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    from cufused.bench.cases import CASES, torch_reference

    for case in CASES:
        inputs = case.make_inputs(np.random.default_rng(int(rng.integers(2**31))))
        for precision in ("ieee", "tf32"):
            with plan_options(autotune=True):  # the plans the benchmark uses
                got = case.run_cufused(inputs, precision=precision).get()
            ref = torch_reference(case, inputs)
            err = rel_err(got, ref)
            assert err < PIPELINE_TOL[precision], (case.name, precision, err)
