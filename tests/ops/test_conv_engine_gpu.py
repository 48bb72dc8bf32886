"""The "3xtf32" precision and the implicit-GEMM engine through the public functions: float32
accuracy for 3xTF32, TF32 accuracy on the implicit GEMM (forced) and on whichever engine the
autotuner picks, fallbacks (groups, 3-D, transposed, strided operands) to cuDNN, pipeline
C's transposed 3-D convolution on its engine, the pipelines, non-finite values, outputs past
2**31 elements."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cufused
from cufused import reference
from cufused._cuda import portable_builds
from cufused._settings import plan_options

from conftest import (GPU, assert_close, count_calls, kernels_built, pipeline_a_args,
                      pipeline_b_args, pipeline_c_args, poisoned, to_gpu, torch_cuda)

pytestmark = pytest.mark.gpu

if GPU:
    import cupy as cp

TOL = {"ieee": 1e-5, "3xtf32": 1e-5, "tf32": 5e-3}


@pytest.fixture(autouse=True)
def igemm():
    """The implicit GEMM wherever it applies (the autotuner may prefer cuDNN)."""
    with plan_options(engine="igemm"):
        yield


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("shapes, options", [
    (((3, 5, 17, 13), (7, 5, 3, 3)), dict()),
    (((2, 6, 19, 23), (9, 6, 3, 5)), dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2))),
    (((2, 8, 30, 30), (64, 8, 3, 3)), dict(padding=1)),
    (((2, 6, 9, 9), (6, 2, 3, 3)), dict(groups=3)),            # cuDNN
    (((2, 4, 5, 6, 7), (6, 4, 3, 3, 3)), dict(padding=1)),     # 3-D: cuDNN
])
def test_convolutions(rng, shapes, options, precision):
    x_shape, w_shape = shapes
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal(w_shape)
    b = rng.standard_normal(w_shape[0])
    fn = cufused.conv2d if len(x_shape) == 4 else cufused.conv3d
    ref = fn(x, w, b, **options)  # float64 reference
    got = fn(*to_gpu(x, w, b), **options, precision=precision)
    assert_close(got.get(), ref, TOL[precision])
    with plan_options(engine="auto"):  # the autotuner's choice
        got = fn(*to_gpu(x, w, b), **options, precision=precision)
    assert_close(got.get(), ref, TOL[precision])


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("channels", [64, 8])
def test_3xtf32_is_as_accurate_as_float32(rng, channels, build):
    # 576- and 72-term dot products of standard normal values (8 chunks of input channels:
    # the wgmma build takes the geometry as arguments, the portable one compiles it in with
    # its step sums; one chunk: compiled in, the wgmma build's residuals-first sum): TF32
    # alone errs by ~1e-3 relative; the split recovers float32's rounding (the implicit
    # GEMM's one TF32 pass is the check that the split matters).
    from cufused._kernels.conv_gemm import conv2d_implicit_gemm

    x = rng.standard_normal((2, channels, 40, 40))
    w = rng.standard_normal((64, channels, 3, 3))
    ref = cufused.conv2d(x, w)
    with kernels_built(build):
        err = {p: np.linalg.norm(cufused.conv2d(*to_gpu(x, w), precision=p).get() - ref)
               / np.linalg.norm(ref) for p in ("3xtf32", "ieee")}
        one_pass = cp.empty(ref.shape, dtype=cp.float32)
        conv2d_implicit_gemm(*to_gpu(x, w), None, one_pass, stride=(1, 1), padding=(0, 0),
                             dilation=(1, 1), passes=1)
    err["tf32"] = np.linalg.norm(one_pass.get() - ref) / np.linalg.norm(ref)
    assert err["3xtf32"] < 3 * err["ieee"] + 1e-7 and err["tf32"] > 1e-4, err


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("shapes, options", [
    (((2, 4, 6, 5), (4, 3, 5, 5)), dict(padding=1)),                    # pipeline B's form
    (((1, 3, 7, 6), (3, 2, 3, 2)), dict(padding=(0, 1), dilation=(2, 1))),
    (((2, 8, 9, 9), (8, 16, 3, 3)), dict()),
])
def test_stride1_transposed_as_forward(rng, shapes, options, precision):
    # A stride-1 transposed convolution runs on the implicit GEMM as the forward convolution
    # it equals (flipped kernel, channels swapped, padding d * (k - 1) - p).
    x_shape, w_shape = shapes
    x, w, b = (rng.standard_normal(s) for s in (x_shape, w_shape, (w_shape[1],)))
    ref = cufused.conv_transpose2d(x, w, b, **options)
    got = cufused.conv_transpose2d(*to_gpu(x, w, b), **options, precision=precision)
    assert_close(got.get(), ref, TOL[precision])
    with plan_options(engine="auto"):  # the autotuner's choice, timed on the forward problem
        got = cufused.conv_transpose2d(*to_gpu(x, w, b), **options, precision=precision)
    assert_close(got.get(), ref, TOL[precision])


def test_transposed_and_strided_operands_fall_back(rng):
    x = rng.standard_normal((2, 4, 6, 7))
    w = rng.standard_normal((4, 3, 3, 3))
    ref = cufused.conv_transpose2d(x, w, stride=2)
    got = cufused.conv_transpose2d(*to_gpu(x, w), stride=2, precision="3xtf32")
    assert_close(got.get(), ref, 1e-5)
    xs = cp.asarray(rng.standard_normal((2, 5, 9, 16)), dtype=cp.float32)[..., ::2]
    wd = cp.asarray(rng.standard_normal((3, 5, 3, 3)), dtype=cp.float32)
    assert_close(cufused.conv2d(xs, wd, precision="3xtf32").get(),
                 cufused.conv2d(xs.get().astype(np.float64), wd.get().astype(np.float64)),
                 1e-5)


@pytest.mark.parametrize("case, make", [
    ("conv2d_groupnorm_scale_maxpool_clamp", pipeline_a_args),
    ("conv_transpose2d_batchnorm_tanh_maxpool_groupnorm", pipeline_b_args),
    ("conv_transpose3d_avgpool_clamp_softmax_multiply", pipeline_c_args),
])
def test_pipelines_in_3xtf32(rng, case, make):
    fn = getattr(cufused, case)
    args, kwargs = make(rng)
    ref = fn(*args, **kwargs)
    got = fn(*to_gpu(*args), **kwargs, precision="3xtf32")
    assert_close(got.get(), ref, 1e-4)


@pytest.mark.parametrize("shape, pool, offset, precision, tol", [
    # Rows of 3 channels x 9 x 10 pooled values (the affine one float at a time).
    (dict(n=2, cin=3, h=21, w=23, cout=6, groups=2), 2, 0.0, "tf32", 5e-3),
    # Pipeline A's channels, several runs of tiles per sample, edge tiles.
    (dict(n=3, cin=8, h=38, w=75, cout=64, groups=16), 4, 0.0, "tf32", 5e-3),
    # Means some 30 spreads from 0: each run's shifted sums, moved to a common shift
    # in float64, keep the variance.
    (dict(n=2, cin=8, h=38, w=75, cout=64, groups=16), 4, 10.0, "3xtf32", 1e-4),
])
@pytest.mark.parametrize("one_sm", [False, True])
@pytest.mark.parametrize("build", ["native", "portable"])
def test_pipeline_a_statistics_in_the_epilogue(rng, monkeypatch, shape, pool, offset,
                                               precision, tol, one_sm, build):
    # one_sm: two resident blocks, so that every block takes runs of many tiles (sums carried
    # over a run's tiles, runs of other samples after it).
    from cufused._kernels import conv_gemm

    if one_sm:
        monkeypatch.setattr(conv_gemm, "sm_count", lambda: 1)
    args, kwargs = pipeline_a_args(rng, **shape, pool=pool)
    args = (args[0] + offset,) + args[1:]
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*args, **kwargs)
    with kernels_built(build):
        got = cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*args), **kwargs,
                                                           precision=precision)
    assert_close(got.get(), ref, tol)


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
def test_pipeline_a_path_is_timed_as_a_whole(rng, precision):
    # Under the autotuner, pipeline A's convolution with the pass in its epilogue is timed
    # against the convolution with the pass after it, once per problem (a key of its own
    # beside the convolution's), and either path gives the reference's result.
    from cufused._ops import convolution

    args, kwargs = pipeline_a_args(rng)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(*args, **kwargs)
    with plan_options(engine="auto"):
        got = cufused.conv2d_groupnorm_scale_maxpool_clamp(*to_gpu(*args), **kwargs,
                                                           precision=precision)
    assert_close(got.get(), ref, {"3xtf32": 1e-4, "tf32": 5e-3}[precision])
    keys = [k for k in convolution._ENGINES if k[1] == "conv2d_pool_stats"
            and k[2] == args[0].shape and k[5] == precision]
    assert len(keys) == 1 and convolution._ENGINES[keys[0]] in ("igemm", "cudnn")


def test_pipeline_a_path_is_not_measured_inside_a_capture(rng):
    # Measuring synchronizes on events, which a capture refuses: the first call of a problem
    # under the caller's capture fails clearly, and the same call outside settles the path.
    from cufused._ops import convolution

    args, kwargs = pipeline_a_args(rng, n=2, cin=3, h=13, w=37)
    gpu = to_gpu(*args)
    stream = cp.cuda.Stream(non_blocking=True)
    with plan_options(engine="auto"):
        with stream:
            stream.begin_capture()
            try:
                with pytest.raises(RuntimeError, match="make the same call once before"):
                    cufused.conv2d_groupnorm_scale_maxpool_clamp(*gpu, **kwargs,
                                                                 precision="tf32")
            finally:
                stream.end_capture()
        got = cufused.conv2d_groupnorm_scale_maxpool_clamp(*gpu, **kwargs, precision="tf32")
    assert_close(got.get(), cufused.conv2d_groupnorm_scale_maxpool_clamp(*args, **kwargs),
                 5e-3)
    assert any(k[1] == "conv2d_pool_stats" and k[2] == args[0].shape
               for k in convolution._ENGINES)


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("build", ["native", "portable"])
def test_non_finite_values_as_pytorch(rng, precision, build):
    x = rng.standard_normal((1, 4, 6, 6))
    w = rng.standard_normal((8, 4, 3, 3))
    x[0, 1, 2, 3], x[0, 2, 0, 0], w[5, 0, 1, 1] = np.nan, np.inf, -np.inf
    with np.errstate(all="ignore"):
        ref = reference.conv(x, w, None, (1, 1), (1, 1), (1, 1), 1)
    with kernels_built(build):
        got = cufused.conv2d(*to_gpu(x, w), padding=1, precision=precision).get()
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(ref))


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("shapes, options", [
    (((2, 8, 30, 36), (64, 8, 3, 3)), dict(padding=1)),   # one chunk, two warpgroups' tiles
    (((2, 19, 13, 40), (70, 19, 3, 3)), dict()),          # three chunks, K past one tile
    (((3, 5, 17, 13), (7, 5, 3, 3)), dict(padding=2)),    # C < 8, K < 8, scalar copies
])
def test_builds_agree_with_the_reference(rng, shapes, options, precision):
    # The compiled-in 3 x 3 geometry (FixedHalo) in either build (3xTF32 past one chunk on the
    # wgmma build: the geometry as arguments), on shapes whose channels, chunks and edges
    # exercise the weight staging, the tiles and the sums. In TF32 the two builds sum the
    # same products in the same order per output: equal bits.
    x = rng.standard_normal(shapes[0])
    w = rng.standard_normal(shapes[1]) * 0.3
    b = rng.standard_normal(shapes[1][0])
    ref = cufused.conv2d(x, w, b, **options)
    got = {}
    for build in ("native", "portable"):
        with kernels_built(build):
            got[build] = cufused.conv2d(*to_gpu(x, w, b), **options, precision=precision).get()
        assert_close(got[build], ref, TOL[precision])
    if precision == "tf32":
        np.testing.assert_array_equal(got["native"].view(np.uint32),
                                      got["portable"].view(np.uint32))


def _poisoned_channels_last(shape, *, offset: int = 0):
    """A NaN-filled packed channels-last (NHWC / NDHWC memory) array of logical ``shape``,
    ``offset`` floats into its buffer (4: not 16-byte aligned)."""
    nd = len(shape)
    physical = (shape[0], *shape[2:], shape[1])
    buffer = cp.full(math.prod(physical) + offset, cp.nan, dtype=cp.float32)
    return buffer[offset:].reshape(physical).transpose(0, nd - 1, *range(1, nd - 1))


def _kernel_names(monkeypatch) -> list:
    """The names of the conv_gemm.cu kernels fetched from now on (each launch fetches its
    kernel)."""
    import cufused._kernels.conv_gemm as conv

    names, get_kernel = [], conv.get_kernel
    monkeypatch.setattr(conv, "get_kernel",
                        lambda filename, name, **kw: names.append(name)
                        or get_kernel(filename, name, **kw))
    return names


@pytest.mark.parametrize("out_layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("fn, x_shape, w_shape, options", [
    ("conv2d", (2, 8, 30, 36), (64, 8, 3, 3), dict(padding=1)),  # A's form
    ("conv2d", (1, 5, 17, 13), (7, 5, 3, 3), dict(stride=2)),
    ("conv_transpose2d", (2, 7, 9, 11), (7, 5, 3, 3), dict(padding=1)),  # as forward
])
def test_channels_last_input_2d(rng, monkeypatch, fn, x_shape, w_shape, options, precision,
                                out_layout):
    # A packed channels-last x (PyTorch's channels_last memory) takes the implicit GEMM
    # through an NCHW copy (a tiled transpose): the bits of the same call on the NCHW x.
    import cufused._kernels.layout as layout

    x = rng.standard_normal(x_shape)
    w = rng.standard_normal(w_shape) * 0.3
    b = rng.standard_normal(w_shape[1] if fn.startswith("conv_transpose") else w_shape[0])
    call = getattr(cufused, fn)
    ref = call(x, w, b, **options)
    xg, wg, bg = to_gpu(x, w, b)

    def out():
        return (poisoned(ref.shape) if out_layout == "nchw"
                else _poisoned_channels_last(ref.shape))

    with plan_options(engine="igemm"):
        dense = call(xg, wg, bg, **options, precision=precision, out=out())
        names = _kernel_names(monkeypatch)
        copies = count_calls(monkeypatch, layout, "transpose_channels")
        for _ in range(2):  # a first call, then a warm one (a whole-call graph)
            got = call(_channels_last(xg), wg, bg, **options, precision=precision, out=out())
    assert copies and any(n.startswith("conv2d") for n in names), names
    np.testing.assert_array_equal(got.get().view(np.uint32), dense.get().view(np.uint32))
    assert_close(got.get(), ref, TOL[precision])


@pytest.mark.parametrize("engine", ["igemm", "cudnn"])
@pytest.mark.parametrize("precision", ["3xtf32", "tf32", "ieee"])
@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("fn, x_shape, w_shape, options, offset", [
    ("conv2d", (2, 8, 30, 36), (64, 8, 3, 3), dict(padding=1), 0),  # float4 stores
    ("conv2d", (3, 5, 17, 13), (70, 5, 3, 3), dict(), 0),  # K past one tile, not 4k
    ("conv2d", (1, 6, 19, 23), (12, 6, 3, 5),
     dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2)), 4),  # misaligned out
    ("conv_transpose2d", (2, 7, 9, 11), (7, 5, 3, 3), dict(padding=1), 0),  # as forward
    ("conv_transpose2d", (2, 4, 5, 6), (4, 6, 3, 3), dict(stride=2), 0),  # cuDNN, copied
    ("conv3d", (2, 4, 5, 6, 7), (6, 4, 3, 3, 3), dict(padding=1), 0),  # cuDNN, copied
])
def test_channels_last_out(rng, monkeypatch, fn, x_shape, w_shape, options, offset, precision,
                           engine, build):
    # A packed channels-last out (PyTorch's channels_last memory) gets the result that a
    # contiguous out gets: the implicit GEMM writes a 2-D forward convolution's (and a
    # stride-1 transposed one's) directly (conv2d_halo_nhwc: float4 runs of channels where
    # K % 4 == 0 and out is 16-byte aligned, else a float a thread), the other routes copy
    # their NCHW result in.
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal(w_shape) * 0.3
    b = rng.standard_normal(w_shape[1] if fn.startswith("conv_transpose") else w_shape[0])
    call = getattr(cufused, fn)
    ref = call(x, w, b, **options)
    direct = (engine == "igemm" and precision != "ieee" and len(x_shape) == 4
              and (fn == "conv2d" or options.get("stride", 1) == 1))
    with kernels_built(build), plan_options(engine=engine):
        dense = call(*to_gpu(x, w, b), **options, precision=precision)
        names = _kernel_names(monkeypatch)
        for _ in range(3):  # a first call, then warm ones (whole-call graphs)
            out = _poisoned_channels_last(ref.shape, offset=offset)
            got = call(*to_gpu(x, w, b), **options, precision=precision, out=out)
            assert got is out
            # 3xTF32 on the wgmma build: the weights held in registers, which sum in
            # another order than the NCHW kernel.
            held = "conv2d_nhwc_held_weights" in names
            if direct and not held:  # the same kernel's sums: equal bits
                np.testing.assert_array_equal(got.get().view(np.uint32),
                                              dense.get().view(np.uint32))
            else:  # cuDNN's result copied in (its sums' order may vary by an ulp)
                assert_close(got.get(), dense.get(), 1e-6)
    assert_close(got.get(), ref, TOL[precision])
    passes = 3 if precision == "3xtf32" else 1
    # conv2d_halo_nhwc, or in 3xTF32 on the wgmma build the held weights or the stores from
    # the accumulators.
    writers = (f"conv2d_halo_nhwc<{passes}, ", "conv2d_halo_nhwc_direct<3, 3>",
               "conv2d_nhwc_held_weights")
    assert any(n.startswith(writers) for n in names) == direct, names


@pytest.mark.parametrize("engine", ["igemm", "cudnn"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
def test_non_finite_weight_by_the_definition(rng, monkeypatch, precision, layout, engine):
    # A channel whose weight holds an infinity or a NaN as the definition has it, the
    # padding's zeros meeting every tap (0 * inf: NaN), into a contiguous or a channels-last
    # out: the implicit GEMM multiplies every tap itself (no rewrite after it), but for the
    # held weights (3xTF32 into a channels-last out on the wgmma build), whose high products
    # take a non-finite weight as zero; cuDNN's result and the held weights' get such
    # channels rewritten (conv_nonfinite_weight_rows).
    from cufused._kernels.conv_gemm import _FILE, arch_target

    x = rng.standard_normal((2, 8, 12, 20))
    w = rng.standard_normal((16, 8, 3, 3))
    w[3, 2, 0, 0], w[9, 0, 2, 1], w[12, 7, 1, 1] = np.inf, np.nan, -np.inf
    with np.errstate(all="ignore"):
        ref = reference.conv(x, w, None, (1, 1), (1, 1), (1, 1), 1)
    names = _kernel_names(monkeypatch)
    out = _poisoned_channels_last(ref.shape) if layout == "nhwc" else poisoned(ref.shape)
    with plan_options(engine=engine):
        cufused.conv2d(*to_gpu(x, w), padding=1, precision=precision, out=out)
    held = (engine == "igemm" and precision == "3xtf32" and layout == "nhwc"
            and arch_target(_FILE) == "sm_90a")
    assert ("conv2d_nhwc_held_weights" in names) == held, names
    rows = "conv_nonfinite_weight_rows<ForwardConvDefinition>" in names
    assert rows == (engine == "cudnn" or held), names
    if engine == "igemm":
        kernel = (("conv2d_halo_nhwc", "conv2d_nhwc_held_weights") if layout == "nhwc"
                  else "conv2d_halo<")
        assert any(n.startswith(kernel) for n in names), names
    got = out.get()
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(ref))
    finite = np.isfinite(ref)
    assert_close(got[finite], ref[finite], TOL[precision])


def _s2k3_route(monkeypatch, x_shape, c_out, output_padding) -> list:
    """The launches of the public conv_transpose3d's implicit-GEMM route, counted; a skip
    only where this device's shared memory does not hold ``conv_transpose3d_s2k3``'s block
    (every problem of these tests is one that the route must take)."""
    import cufused._kernels.conv_gemm as conv
    from cufused._cuda import shared_per_block

    if shared_per_block() < conv._CT3_SHARED:
        pytest.skip("conv_transpose3d_s2k3 needs 217 KiB of shared memory a block")
    op = (output_padding,) * 3 if isinstance(output_padding, int) else output_padding
    out_shape = conv_transpose_shape(x_shape, c_out, output_padding)
    assert conv.transposed_s2k3_takes(x_shape[1], (3, 3, 3), (2, 2, 2), (1, 1, 1), op,
                                      (1, 1, 1), 1, out_shape)
    return count_calls(monkeypatch, conv, "conv_transpose3d_implicit_gemm")


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("x_shape, c_out, output_padding, bias", [
    ((2, 32, 4, 6, 17), 64, 1, True),          # pipeline C's form: by four, paired stores
    ((1, 3, 5, 3, 9), 5, (0, 1, 0), False),    # C_in, C_out not multiples of 4; odd W_out
    ((3, 8, 2, 7, 1), 40, (1, 0, 1), True),    # C_out past one channel tile
    ((1, 1, 1, 1, 1), 1, 0, True),             # one input value: only class (0, 0, 0)
    ((2, 7, 9, 5, 20), 33, (1, 0, 1), True),   # 3 x 2 x 2 tiles, each axis's last one partial
])
def test_transposed_3d_stride2_on_the_implicit_gemm(rng, monkeypatch, x_shape, c_out,
                                                    output_padding, bias, build, precision):
    # A transposed 3-D convolution of stride 2, a 3 x 3 x 3 kernel and padding 1 (pipeline
    # C's) runs on conv_transpose3d_s2k3 from the NCDHW x (as it is or through a
    # channels-last copy: transposed_s2k3_reads_ncdhw): into a NaN-poisoned
    # out, into one 4 bytes past an 8-byte boundary (unpaired stores) and into a new array,
    # all equal; the autotuner's engine, whichever it is, agrees with the reference too.
    calls = _s2k3_route(monkeypatch, x_shape, c_out, output_padding)
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal((x_shape[1], c_out, 3, 3, 3))
    b = rng.standard_normal(c_out) if bias else None
    opts = dict(stride=2, padding=1, output_padding=output_padding)
    ref = cufused.conv_transpose3d(x, w, b, **opts)
    args = to_gpu(x, w, b)
    out = poisoned(ref.shape)
    shifted = cp.full(ref.size + 1, cp.nan, dtype=cp.float32)[1:].reshape(ref.shape)
    with kernels_built(build):
        assert cufused.conv_transpose3d(*args, **opts, precision=precision, out=out) is out
        cufused.conv_transpose3d(*args, **opts, precision=precision, out=shifted)
        fresh = cufused.conv_transpose3d(*args, **opts, precision=precision)
    assert len(calls) == 3, "the implicit-GEMM route did not run"
    assert_close(out.get(), ref, TOL[precision])
    np.testing.assert_array_equal(shifted.get(), out.get())
    np.testing.assert_array_equal(fresh.get(), out.get())
    with plan_options(engine="auto"):
        got = cufused.conv_transpose3d(*args, **opts, precision=precision)
    assert_close(got.get(), ref, TOL[precision])


def _channels_last(a, offset: int = 0):
    """``a`` (N, C, *spatial) as a logical view of packed channels-last memory (NHWC / NDHWC)
    that starts ``offset`` float32 values into its allocation."""
    buf = _poisoned_channels_last(a.shape, offset=offset)
    buf[...] = a
    return buf


def conv_transpose_shape(x_shape, c_out: int, output_padding) -> tuple[int, ...]:
    """The output shape of a transposed 3-D convolution of stride 2, padding 1, a 3 x 3 x 3
    kernel."""
    op = (output_padding,) * 3 if isinstance(output_padding, int) else output_padding
    return (x_shape[0], c_out, *(2 * s - 1 + o for s, o in zip(x_shape[2:], op)))


@pytest.mark.parametrize("x_layout", ["ncdhw", "ndhwc", "ndhwc+4"])
@pytest.mark.parametrize("x_shape, c_out, output_padding, bias", [
    ((2, 32, 4, 6, 17), 64, 1, True),           # pipeline C's form
    ((1, 8, 3, 5, 40), 20, (0, 1, 0), False),   # a partial column band; C_out below 64
    ((2, 12, 2, 9, 31), 130, (1, 0, 1), True),  # three channel tiles
    ((1, 4, 1, 1, 1), 2, 0, True),              # one input value: class (0, 0, 0) only
    ((1, 6, 3, 4, 5), 10, 1, True),             # C_in % 4 != 0: another route
    ((1, 8, 3, 4, 5), 9, 1, True),              # odd C_out: another route
])
def test_transposed_3d_stride2_into_channels_last_out(rng, monkeypatch, x_shape, c_out,
                                                      output_padding, bias, x_layout):
    # 3xTF32 into a packed channels-last out (NDHWC memory) on the implicit GEMM:
    # conv_transpose3d_s2k3_groups on the wgmma build where C_in % 4 == 0 and C_out is even,
    # from x as it is (channels-last, 16-byte aligned) or through a channels-last copy; there
    # an input with infinities and a NaN, a weight with an infinity (its channel rewritten by
    # the definition after the kernel): the definition's values and NaN / infinity placement
    # in a NaN-poisoned out, a NaN with its payload in its lowest bits included. Other problems
    # take conv_transpose3d_s2k3's result transposed into out (finite operands), an out whose
    # channels-last memory is C-contiguous too (one position) the contiguous route.
    from cufused._kernels.conv_gemm import _FILE, arch_target

    out = _poisoned_channels_last(conv_transpose_shape(x_shape, c_out, output_padding))
    taken = (x_shape[1] % 4 == 0 and c_out % 2 == 0 and arch_target(_FILE) == "sm_90a"
             and not out.flags.c_contiguous)
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal((x_shape[1], c_out, 3, 3, 3)) * 0.3
    if taken:
        x.flat[rng.integers(x.size, size=3)] = np.inf, -np.inf, np.nan
        w[0, c_out - 1, 1, 2, 0] = np.inf
        # A NaN whose payload lies in the 13 bits below TF32's (an infinity once truncated).
        low_nan = int(rng.integers(x.size))
        x.flat[low_nan] = np.nan
    b = rng.standard_normal(c_out) if bias else None
    opts = dict(stride=2, padding=1, output_padding=output_padding)
    with np.errstate(all="ignore"):
        ref = cufused.conv_transpose3d(x, w, b, **opts)
    xg, wg, bg = to_gpu(x, w, b)
    if taken:
        xg.reshape(-1).view(cp.uint32)[low_nan] = 0x7F800001
    if x_layout != "ncdhw":
        xg = _channels_last(xg, 4 if x_layout == "ndhwc+4" else 0)
    names = _kernel_names(monkeypatch)
    with plan_options(engine="igemm"):
        assert cufused.conv_transpose3d(xg, wg, bg, **opts, precision="3xtf32", out=out) is out
    assert ("conv_transpose3d_s2k3_groups" in names) == taken, names
    assert any(n.startswith("conv_transpose3d_s2k3<3, CT3_CONV") for n in names) != taken, names
    got = out.get()
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(ref))
    finite = np.isfinite(ref)
    assert_close(got[finite], ref[finite], 2e-6)


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("x_shape, c_out, offset", [
    ((2, 32, 4, 6, 17), 64, 0),     # pipeline C's form: the tensor map of x itself
    ((2, 32, 4, 6, 16), 64, 0),     # W % 4 == 0: in TF32 on sm_90a the NCDHW x in place too
    ((2, 32, 4, 6, 17), 64, 1),     # x 4 bytes past a 16-byte boundary: no tensor map
    ((1, 3, 5, 3, 9), 5, 0),        # C_in not a multiple of 4
    ((2, 1, 3, 2, 5), 3, 0),        # C_in 1: the channels-last view is C-contiguous too
])
def test_transposed_3d_stride2_reads_channels_last_x_as_it_is(rng, monkeypatch, x_shape,
                                                               c_out, offset, build,
                                                               precision):
    # An x stored channels-last (PyTorch's channels_last_3d) is read in place, without the
    # copy that an NCDHW x takes where the kernel does not read that in place: the result is
    # bitwise that of the same values in NCDHW. The autotuner times the engines on such an x
    # under a key of its own.
    import cufused._kernels.conv_gemm as conv
    import cufused._kernels.layout as layout
    from cufused._ops import convolution
    from cufused._precision import mma_passes

    calls = _s2k3_route(monkeypatch, x_shape, c_out, 1)
    copies = count_calls(monkeypatch, layout, "transpose_channels")
    host = (rng.standard_normal(x_shape), rng.standard_normal((x_shape[1], c_out, 3, 3, 3)),
            rng.standard_normal(c_out))
    x_first, w, b = to_gpu(*host)
    x_last = _channels_last(x_first, offset)
    opts = dict(stride=2, padding=1, output_padding=1, precision=precision)
    with kernels_built(build):
        ncdhw_copies = 0 if conv.transposed_s2k3_reads_ncdhw(x_first,
                                                             mma_passes(precision)) else 1
        first = cufused.conv_transpose3d(x_first, w, b, **opts)
        assert len(copies) == ncdhw_copies and len(calls) == 1
        out = poisoned(first.shape)
        assert cufused.conv_transpose3d(x_last, w, b, **opts, out=out) is out
    assert len(copies) == ncdhw_copies and len(calls) == 2, "channels-last x took a copy"
    np.testing.assert_array_equal(out.get(), first.get())
    ref = cufused.conv_transpose3d(*host, stride=2, padding=1, output_padding=1)
    assert_close(out.get(), ref, TOL[precision])
    convolution._ENGINES.clear()
    with plan_options(engine="auto"):
        assert_close(cufused.conv_transpose3d(x_last, w, b, **opts).get(), ref, TOL[precision])
    layout_keys = {k[2] for k in convolution._ENGINES if k[1] == x_shape}
    assert layout_keys == {"nchw" if x_last.flags.c_contiguous else "nhwc"}


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("x_shape, c_out, offset, sms", [
    ((2, 32, 9, 6, 32), 64, 0, 1),  # tensor copies; one block takes all 24 tiles
    ((2, 32, 9, 6, 32), 64, 1, 3),  # x 4 bytes past a 16-byte boundary: copies by cp.async
    ((3, 5, 6, 7, 12), 7, 0, 2),    # C_in 5 (zeros past it), a partial tile on every axis
    ((1, 32, 9, 6, 32), 64, 0, 10),  # 5 blocks, 12 tiles: the last two in halves (sm_90a)
])
def test_transposed_3d_stride2_ncdhw_planes_go_round_the_ring(rng, monkeypatch, x_shape, c_out,
                                                                offset, sms, build):
    # In TF32 an NCDHW x goes by input planes through conv_transpose3d_s2k3's ring of 9
    # slots (the launcher called directly: the portable build runs it only where the sm_90a
    # build fails); with few multiprocessors each block takes many tiles, so the ring goes
    # round many times. The result is bitwise that of the same values stored channels-last,
    # and close to the reference.
    import cufused._kernels.conv_gemm as conv

    monkeypatch.setattr(conv, "sm_count", lambda: sms)
    _s2k3_route(monkeypatch, x_shape, c_out, 1)
    maps, make_map = [], conv.float32_tensor_map

    def recorded_map(*args, **kw):
        maps.append((kw, make_map(*args, **kw)))
        return maps[-1][1]

    monkeypatch.setattr(conv, "float32_tensor_map", recorded_map)
    host = (rng.standard_normal(x_shape), rng.standard_normal((x_shape[1], c_out, 3, 3, 3)),
            rng.standard_normal(c_out))
    x_first, w, b = to_gpu(*host)
    x_ncdhw = cp.full(x_first.size + offset, cp.nan, dtype=cp.float32)[offset:].reshape(x_shape)
    x_ncdhw[...] = x_first
    out = poisoned((x_shape[0], c_out) + tuple(2 * s for s in x_shape[2:]))
    last = poisoned(out.shape)
    with kernels_built(build):
        conv.conv_transpose3d_implicit_gemm(x_ncdhw, w, b, out, passes=1)
        conv.conv_transpose3d_implicit_gemm(_channels_last(x_first), w, b, last, passes=1)
    # The planes' map (unswizzled): none asked for where x is misaligned.
    planes = [made for kw, made in maps if kw.get("swizzle") is False]
    assert len(planes) == (0 if offset else 1)
    assert all(made is not None for made in planes), "the driver made no map of the planes"
    np.testing.assert_array_equal(out.get(), last.get())
    ref = cufused.conv_transpose3d(*host, stride=2, padding=1, output_padding=1)
    assert_close(out.get(), ref, TOL["tf32"])


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
def test_transposed_3d_stride2_replays_with_new_values(rng, monkeypatch, precision):
    # Warm calls into the same out replay the whole call's graph (with the channels-last copy
    # of x and that copy's tensor map inside it where it takes one): new values of x reach
    # the result, bitwise that of a call without any replay.
    calls = _s2k3_route(monkeypatch, (2, 8, 4, 6, 6), 16, 1)
    x = cp.empty((2, 8, 4, 6, 6), dtype=cp.float32)
    w = to_gpu(rng.standard_normal((8, 16, 3, 3, 3)))[0]
    opts = dict(stride=2, padding=1, output_padding=1, precision=precision)
    out = poisoned((2, 16, 8, 12, 12))
    for _ in range(2):
        x[...] = cp.asarray(rng.standard_normal(x.shape), dtype=cp.float32)
        for _ in range(3):
            cufused.conv_transpose3d(x, w, **opts, out=out)
        with plan_options(replay=False):
            direct = cufused.conv_transpose3d(x, w, **opts)
        np.testing.assert_array_equal(out.get(), direct.get())
    assert calls, "the implicit-GEMM route did not run"


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("x_shape, sms", [
    ((2, 5, 3, 4, 5), None),
    ((3, 5, 5, 4, 5), 4),  # 4 blocks, 6 tiles: the last two in halves (sm_90a, TF32)
    ((3, 5, 5, 4, 8), 4),  # the same with W % 4 == 0: x read in place (the plane ring)
])
def test_transposed_3d_stride2_non_finite_values_as_the_definition(rng, monkeypatch, build,
                                                                   precision, x_shape, sms):
    # An infinite or NaN weight meets only real inputs, as in the definition (the float64
    # reference): also on the far-edge planes of output_padding 1, where the implicit GEMM
    # multiplies the zeros past the input (in TF32 each block rewrites its tiles' outputs of
    # those channels by the definition, each half of a tile split between two blocks by its
    # own; in 3xTF32 a kernel after it recomputes their rows). An infinite input value gives
    # the reference's infinities and NaNs; the other values agree.
    import cufused._kernels.conv_gemm as conv

    if sms is not None:
        monkeypatch.setattr(conv, "sm_count", lambda: sms)
    calls = _s2k3_route(monkeypatch, x_shape, 6, 1)
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal((5, 6, 3, 3, 3))
    b = rng.standard_normal(6)
    w[1, 2, 0, 1, 2], w[3, 4, 2, 2, 0], x[1, 2, 1, 2, 3] = np.inf, np.nan, -np.inf
    opts = dict(stride=2, padding=1, output_padding=1)
    with np.errstate(all="ignore"):
        ref = cufused.conv_transpose3d(x, w, b, **opts)
    out = poisoned(ref.shape)
    with kernels_built(build):
        got = cufused.conv_transpose3d(*to_gpu(x, w, b), **opts, precision=precision,
                                       out=out).get()
    assert calls, "the implicit-GEMM route did not run"
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(ref))
    assert np.isnan(ref[:, 4]).any() and np.isinf(ref[:, 2]).any()
    finite = np.isfinite(ref)
    assert_close(got[finite], ref[finite], TOL[precision])


def test_native_build_of_the_engine():
    # On a device of compute capability 9.0 the engine's kernels are its own target's build
    # (sm_90a, the wgmma path); elsewhere, and inside portable_builds, CuPy's.
    from cufused._cuda import ARCH_TARGETS, get_kernel

    arch = ARCH_TARGETS["conv_gemm.cu"].get(cp.cuda.Device().compute_capability)
    native = type(get_kernel("conv_gemm.cu", "conv2d_halo<1, 3, 2>"))
    with portable_builds():
        portable = type(get_kernel("conv_gemm.cu", "conv2d_halo<1, 3, 2>"))
    assert portable is cp.RawKernel
    assert (native is not cp.RawKernel) == (arch is not None)


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("x_shape, w_shape, options, halo", [
    # The halo kernel (the compiled-in 3 x 3 geometry): 33 * 64 * 1024**2 outputs.
    ((33, 8, 1026, 1026), (64, 8, 3, 3), dict(), True),
    # The gathering kernel (no chunk of the dilated halo fits): 122 * 64 * 526**2 outputs.
    ((122, 3, 1100, 1100), (64, 3, 5, 5), dict(stride=2, dilation=12), False),
])
def test_output_past_2_31_elements(rng, monkeypatch, precision, x_shape, w_shape, options,
                                   halo):
    # Outputs (and offsets into them) past 2**31 elements, into a NaN-poisoned out, against
    # PyTorch's float32 convolution a few samples at a time (a float64 reference of this size
    # would not fit beside it).
    from cufused._kernels import conv_gemm

    torch = torch_cuda()
    F = torch.nn.functional
    passes = 3 if precision == "3xtf32" else 1
    both = (options.get("stride", 1),) * 2, (options.get("dilation", 1),) * 2
    assert (conv_gemm.halo_geometry(x_shape[1], w_shape[2:], *both, passes) is not None) == halo
    calls = count_calls(monkeypatch, conv_gemm, "conv2d_implicit_gemm")
    x = cp.random.default_rng(int(rng.integers(2**31))).random(x_shape, dtype=cp.float32)
    w, b = to_gpu(rng.standard_normal(w_shape) * 0.3, rng.standard_normal(w_shape[0]))
    p = (x_shape[2] - options.get("dilation", 1) * (w_shape[2] - 1) - 1) \
        // options.get("stride", 1) + 1
    out = poisoned((x_shape[0], w_shape[0], p, p))
    assert out.size > 2**31
    cufused.conv2d(x, w, b, **options, precision=precision, out=out)
    assert calls == ["conv2d_implicit_gemm"]
    tw, tb = torch.from_dlpack(w), torch.from_dlpack(b)
    diff = norm = 0.0
    with torch.backends.cudnn.flags(allow_tf32=False):
        for n0 in range(0, x_shape[0], 8):
            want = F.conv2d(torch.from_dlpack(x[n0:n0 + 8]), tw, tb, **options)
            got = torch.from_dlpack(out[n0:n0 + 8])
            diff += float(torch.linalg.vector_norm((got - want).double()) ** 2)
            norm += float(torch.linalg.vector_norm(want.double()) ** 2)
            del want, got
    assert (diff / norm) ** 0.5 < TOL[precision], (diff / norm) ** 0.5
    del x, out
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


# Finite values that cvt.rna.tf32 carries to an infinity (from (2 - 2^-11) * 2^127), one just
# below that boundary, and float32's largest.
_NEAR_MAX = np.array([3.40199e38, 3.40205e38, 3.4025e38, np.finfo(np.float32).max],
                     dtype=np.float32)


def test_tf32_rounding_is_cvt_rna_below_overflow():
    # to_tf32 over every float32 bit pattern: cvt.rna.tf32.f32's bits below the boundary
    # where it overflows; past it (finite) the truncation, TF32's largest value; infinities
    # as they are; NaNs quieted, their sign kept.
    from cufused._cuda import COMPILE_OPTIONS, source

    probe = r"""
extern "C" __global__ void to_tf32_probe(unsigned long long* mismatches) {
    unsigned long long bad = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < (1ull << 32); i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned raw = (unsigned)i, magnitude = raw & 0x7FFFFFFFu;
        const unsigned got = to_tf32(__uint_as_float(raw));
        unsigned want;
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(want) : "f"(__uint_as_float(raw)));
        if (magnitude >= 0x7F7FF000u && magnitude < 0x7F800000u)
            want = (raw & 0x80000000u) | 0x7F7FE000u;
        else if (magnitude == 0x7F800000u)
            want = raw;
        else if (magnitude > 0x7F800000u)
            want = ((got & 0x80000000u) == (raw & 0x80000000u)
                    && (got & 0x7FFFFFFFu) > 0x7F800000u) ? got : ~got;
        bad += got != want;
    }
    atomicAdd(mismatches, bad);
}
"""
    kernel = cp.RawModule(code=source("common.cuh") + probe,
                          options=COMPILE_OPTIONS).get_function("to_tf32_probe")
    mismatches = cp.zeros(1, dtype=cp.uint64)
    kernel((4096,), (256,), (mismatches,))
    assert int(mismatches.get()[0]) == 0


@pytest.mark.parametrize("precision", ["3xtf32", "tf32"])
@pytest.mark.parametrize("fn, x_shape, w_shape, options, out_layout", [
    ("conv2d", (2, 8, 30, 36), (64, 8, 3, 3), dict(padding=1), "nchw"),   # FixedHalo
    ("conv2d", (2, 8, 30, 36), (64, 8, 3, 3), dict(padding=1), "nhwc"),   # held weights
    ("conv2d", (3, 5, 17, 13), (70, 5, 3, 3), dict(), "nchw"),            # C < 8
    ("conv2d", (1, 6, 19, 23), (12, 6, 3, 5),
     dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2)), "nchw"),      # the geometry as data
    ("conv_transpose2d", (2, 7, 9, 11), (7, 5, 3, 3), dict(padding=1), "nchw"),  # as forward
    ("conv_transpose3d", (2, 32, 4, 6, 17), (32, 64, 3, 3, 3),
     dict(stride=2, padding=1, output_padding=1), "nchw"),               # pipeline C's form
    ("conv_transpose3d", (2, 32, 4, 6, 17), (32, 64, 3, 3, 3),
     dict(stride=2, padding=1, output_padding=1), "nhwc"),               # the class groups
])
def test_values_near_float32_max_and_nan_payloads_as_float32(rng, monkeypatch, fn, x_shape,
                                                             w_shape, options, out_layout,
                                                             precision):
    # Finite operands near float32's largest value give finite products where float32's do,
    # in either precision (TF32 rounding carried them to infinity, and 3xTF32 made NaN of
    # an infinite high part and its residual); in "3xtf32" a NaN whose payload lies in the 13
    # bits that TF32 drops stays a NaN. Inputs and weights within 0.25, one large value a
    # sample in x (input channel 1) and one large weight (input channel 0), so that every
    # float32 sum stays finite.
    transposed = fn.startswith("conv_transpose")
    x = rng.uniform(-0.25, 0.25, x_shape).astype(np.float32)
    w = rng.uniform(-0.25, 0.25, w_shape).astype(np.float32)
    for n in range(x_shape[0]):
        position = tuple(rng.integers(s) for s in x_shape[2:])
        x[(n, 1, *position)] = _NEAR_MAX[rng.integers(4)] * rng.choice([-1, 1])
    k = rng.integers(w_shape[1] if transposed else w_shape[0])
    tap = tuple(rng.integers(s) for s in w_shape[2:])
    w[(0, k, *tap) if transposed else (k, 0, *tap)] = -_NEAR_MAX[2]
    low_nan = (0, 0, *(s // 2 for s in x_shape[2:]))
    if precision == "3xtf32":
        x[low_nan] = np.nan
    call = getattr(cufused, fn)
    with np.errstate(all="ignore"):
        ref = call(x.astype(np.float64), w.astype(np.float64), **options)
    xg, wg = to_gpu(x, w)
    if precision == "3xtf32":
        xg.view(cp.uint32)[low_nan] = 0x7F800001
    out = (poisoned(ref.shape) if out_layout == "nchw"
           else _poisoned_channels_last(ref.shape))
    names = _kernel_names(monkeypatch)
    assert call(xg, wg, **options, precision=precision, out=out) is out
    route = "conv_transpose3d_s2k3" if fn == "conv_transpose3d" else "conv2d_"
    assert any(n.startswith(route) for n in names), names
    from cufused._kernels.conv_gemm import _FILE, arch_target

    if out_layout == "nhwc" and precision == "3xtf32" and arch_target(_FILE) == "sm_90a":
        wanted = ("conv_transpose3d_s2k3_groups" if fn == "conv_transpose3d"
                  else "conv2d_nhwc_held_weights")
        assert any(n.startswith(wanted) for n in names), names
    got = out.get()
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(ref))
    assert np.isnan(ref).any() == (precision == "3xtf32")
    large = np.isfinite(ref) & (np.abs(ref) > 1e30)
    small = np.isfinite(ref) & ~large
    assert large.any() and small.any()
    assert_close(got[large], ref[large], TOL[precision])
    assert_close(got[small], ref[small], TOL[precision])
