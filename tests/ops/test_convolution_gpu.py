"""The convolutions on the GPU against the float64 NumPy reference (and PyTorch CUDA where
importable), with every cuDNN graph form pinned in turn."""

from __future__ import annotations

import numpy as np
import pytest

import cufused

from cufused import reference

from conftest import (GPU, CONV_CASES, TOL, _pinned, assert_close, assert_nonfinite_placement,
                      pipeline_c_args, poisoned, to_gpu)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("quick_plans")]

if GPU:
    import cupy as cp


# ---------------------------------------------------------------------------------- convolutions


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}d{'T' if c[1] else ''}{c[2]}")
def test_conv_matches_reference(rng, case, precision, conv_pin):
    nd, transposed, xs, ws, opts = case
    x = rng.standard_normal(xs)
    w = rng.standard_normal(ws)
    b = rng.standard_normal(ws[1] * opts.get("groups", 1) if transposed else ws[0])
    fn = {(2, False): cufused.conv2d, (3, False): cufused.conv3d,
          (2, True): cufused.conv_transpose2d, (3, True): cufused.conv_transpose3d}[nd, transposed]
    ref = fn(x, w, b, **opts)
    xg, wg, bg = to_gpu(x, w, b)
    out = poisoned(ref.shape)
    got = fn(xg, wg, bg, precision=precision, out=out, **opts)
    assert got is out
    assert_close(got.get(), ref, TOL[precision])


@pytest.mark.parametrize("name, x_shape, w_shape, opts", [
    ("conv2d", (3, 9, 8), (4, 3, 3, 2), dict(padding=1)),
    ("conv_transpose3d", (2, 3, 4, 3), (2, 4, 3, 3, 3), dict(stride=2, padding=1)),
    ("max_pool2d", (3, 9, 8), None, dict(kernel_size=3, stride=2, padding=1)),
    ("avg_pool3d", (2, 5, 6, 4), None, dict(kernel_size=2)),
])
def test_unbatched_input(rng, name, x_shape, w_shape, opts):
    # Without the batch axis, as PyTorch takes it: into a NaN-poisoned out (three calls, the
    # later ones replaying the whole-call graph) and without one.
    fn = getattr(cufused, name)
    args = (rng.standard_normal(x_shape),)
    if w_shape is not None:
        args += (rng.standard_normal(w_shape),)
    ref = fn(*args, **opts)
    assert ref.ndim == len(x_shape)
    out = poisoned(ref.shape)
    for _ in range(3):
        assert fn(*to_gpu(*args), **opts, out=out) is out
        assert_close(out.get(), ref, TOL["ieee"])
    got = fn(*to_gpu(*args), **opts)
    assert got.shape == ref.shape
    assert_close(got.get(), ref, TOL["ieee"])


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_unbatched_channels_last_input_and_out(rng, precision):
    # (C, H, W) views of HWC memory are a batch of one stored channels-last: taken as such,
    # out included (the implicit GEMM writes channels-last results directly).
    x, w = rng.standard_normal((5, 9, 8)), rng.standard_normal((6, 5, 3, 3))
    ref = cufused.conv2d(x, w, padding=1)
    xg = cp.moveaxis(cp.asarray(np.moveaxis(x, 0, -1), dtype=cp.float32), -1, 0)
    out = cp.moveaxis(cp.full((9, 8, 6), cp.nan, dtype=cp.float32), -1, 0)
    (wg,) = to_gpu(w)
    for _ in range(3):
        assert cufused.conv2d(xg, wg, padding=1, precision=precision, out=out) is out
        assert_close(out.get(), ref, TOL[precision])


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("transposed", [False, True])
def test_conv_weight_with_a_strided_unit_axis(rng, transposed, precision, conv_pin):
    # A weight of one filter (one input channel of a transposed convolution) sliced with a
    # step: C-contiguous by its flags, its unit axis's stride not the packed one. Every plan
    # reads it as the weight it is (a transposed weight also through a 1 x k kernel whose
    # unit height axis has stride 0).
    x = rng.standard_normal((2, 1 if transposed else 4, 9, 8))
    w = rng.standard_normal((2, 6 if transposed else 4, 3, 3))[::2]  # (1, ., 3, 3)
    fn = cufused.conv_transpose2d if transposed else cufused.conv2d
    opts = dict(stride=2, padding=1) if transposed else dict(padding=1)
    wg = cp.asarray(rng.standard_normal((2, *w.shape[1:])), dtype=cp.float32)[::2]
    wg[...] = cp.asarray(w, dtype=cp.float32)
    assert wg.flags.c_contiguous and wg.strides[0] != wg[0].nbytes
    (xg,) = to_gpu(x)
    ref = fn(x, w, **opts)
    out = poisoned(ref.shape)
    assert fn(xg, wg, precision=precision, out=out, **opts) is out
    assert_close(out.get(), ref, TOL[precision])
    # A 1 x 3 kernel made with None: its new axis has stride 0.
    w13 = cp.asarray(rng.standard_normal((1, w.shape[1], 3)), dtype=cp.float32)[:, :, None]
    assert w13.strides[2] == 0
    ref = fn(x, w13.get(), **opts)
    assert_close(fn(xg, w13, precision=precision, **opts).get(), ref, TOL[precision])


NON_FINITE_WEIGHT_CASES = {
    # the weights' non-finite taps at the edges, where they meet the padding (a tap that meets
    # only padding included: (0, 4) of a 5-wide kernel on a 3-wide padded input)
    "2d groups": ((2, 4, 8, 3), (6, 2, 2, 5), dict(stride=(3, 2), padding=(2, 1), groups=2),
                  {(1, 1, 0, 4): np.nan, (4, 0, 1, 0): np.inf, (5, 1, 0, 0): -np.inf}),
    "2d": ((2, 3, 7, 6), (5, 3, 3, 3), dict(padding=1),
           {(0, 2, 0, 0): np.nan, (3, 1, 2, 2): np.inf}),
    "3d": ((2, 2, 5, 4, 6), (4, 2, 3, 3, 3), dict(padding=1, dilation=(1, 2, 1)),
           {(2, 1, 0, 0, 0): np.nan, (3, 0, 2, 2, 2): -np.inf}),
}


@pytest.mark.parametrize("engine", [None, "igemm"])
@pytest.mark.parametrize("precision", ["ieee", "tf32", "3xtf32"])
@pytest.mark.parametrize("case", list(NON_FINITE_WEIGHT_CASES))
def test_conv_non_finite_weight_meets_the_padding(rng, case, precision, engine, conv_pin):
    # PyTorch's placement, whichever algorithm runs: a non-finite weight times a padding zero
    # is NaN (0 * inf, 0 * NaN), and an infinite one times an input its signed infinity.
    fn = cufused.conv2d if len(NON_FINITE_WEIGHT_CASES[case][0]) == 4 else cufused.conv3d
    _check_non_finite_weight(rng, fn, *NON_FINITE_WEIGHT_CASES[case], precision, engine)


def _check_non_finite_weight(rng, fn, x_shape, w_shape, options, planted, precision,
                             engine) -> None:
    """``fn``'s NaN and infinities on the GPU with ``planted`` weight values (index: value)
    where the float64 reference puts them, its finite values close."""
    from cufused._settings import plan_options

    x = rng.standard_normal(x_shape)
    w = rng.standard_normal(w_shape)
    for index, value in planted.items():
        w[index] = value
    with np.errstate(all="ignore"):
        ref = fn(x, w, **options)
    with plan_options(engine=engine):
        got = fn(*to_gpu(x, w), **options, precision=precision, out=poisoned(ref.shape)).get()
    assert_nonfinite_placement(got, ref, TOL["tf32" if precision == "tf32" else "ieee"])


TRANSPOSED_NON_FINITE_WEIGHT_CASES = {
    # stride 1 (the implicit GEMM's forward route, whose padding meets the weight), a stride
    # that inserts zeros, groups, and pipeline C's 3-D geometry (conv_transpose3d_s2k3)
    "2d stride 1": ((2, 6, 9, 7), (6, 5, 5, 5), dict(padding=1),
                    {(1, 2, 0, 0): np.inf, (4, 0, 4, 4): np.nan}),
    "2d stride 2 groups": ((2, 4, 5, 6), (4, 3, 3, 3),
                           dict(stride=2, padding=1, output_padding=1, groups=2),
                           {(0, 1, 0, 0): -np.inf, (3, 2, 2, 1): np.nan}),
    "3d stride 2": ((2, 8, 4, 5, 6), (8, 6, 3, 3, 3), dict(stride=2, padding=1,
                                                          output_padding=1),
                    {(2, 3, 0, 0, 0): np.inf, (5, 1, 2, 2, 2): np.nan}),
}


@pytest.mark.parametrize("engine", [None, "igemm", "fft"])
@pytest.mark.parametrize("precision", ["ieee", "tf32", "3xtf32"])
@pytest.mark.parametrize("case", list(TRANSPOSED_NON_FINITE_WEIGHT_CASES))
def test_conv_transpose_non_finite_weight_by_the_definition(rng, case, precision, engine):
    # A transposed convolution's weight meets only real inputs (never the zeros a stride
    # inserts, the padding, or the zeros past the input's far edge), whichever engine runs.
    x_shape = TRANSPOSED_NON_FINITE_WEIGHT_CASES[case][0]
    fn = cufused.conv_transpose2d if len(x_shape) == 4 else cufused.conv_transpose3d
    _check_non_finite_weight(rng, fn, *TRANSPOSED_NON_FINITE_WEIGHT_CASES[case], precision,
                             engine)


NON_FINITE_INPUT_CASES = {
    # Shapes where cuDNN's heuristics or timings may take an FFT or Winograd plan, which
    # spreads an input's infinity to NaN past the outputs its products reach.
    "conv2d 3x3": (cufused.conv2d, (4, 64, 28, 28), (64, 64, 3, 3), dict(padding=1)),
    "conv2d 5x5 groups": (cufused.conv2d, (3, 8, 17, 13), (6, 4, 5, 5),
                          dict(padding=2, groups=2)),
    "conv_transpose2d B": (cufused.conv_transpose2d, (4, 64, 32, 32), (64, 128, 5, 5),
                           dict(padding=1)),
    "conv_transpose2d stride 2": (cufused.conv_transpose2d, (3, 6, 7, 5), (6, 4, 3, 3),
                                  dict(stride=2, padding=1, output_padding=1, groups=2)),
    "conv_transpose3d C": (cufused.conv_transpose3d, (2, 32, 6, 8, 8), (32, 64, 3, 3, 3),
                           dict(stride=2, padding=1, output_padding=1)),
}


def _plant_non_finite(rng, x) -> None:
    """An infinity, a negative infinity and a NaN at random positions of the first and last
    samples (the middle ones stay finite)."""
    for n, value in ((0, np.inf), (-1, -np.inf), (-1, np.nan)):
        x[(n, *(int(rng.integers(s)) for s in x.shape[1:]))] = value


@pytest.mark.parametrize("autotune", [False, True])
@pytest.mark.parametrize("case", list(NON_FINITE_INPUT_CASES))
def test_conv_non_finite_input_by_the_definition(rng, case, autotune):
    # Exact float32: an input's infinity gives infinities (or NaN where it meets a zero
    # weight or the opposite infinity) on the outputs whose window holds it, and nowhere
    # else, whichever plan runs.
    from cufused._settings import plan_options

    fn, x_shape, w_shape, options = NON_FINITE_INPUT_CASES[case]
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal(w_shape)
    _plant_non_finite(rng, x)
    with np.errstate(all="ignore"):
        ref = fn(x, w, **options)
    with plan_options(autotune=autotune):
        got = fn(*to_gpu(x, w), **options, precision="ieee", out=poisoned(ref.shape)).get()
    assert_nonfinite_placement(got, ref, TOL["ieee"])


@pytest.mark.parametrize("transposed", [False, True])
def test_non_finite_input_samples_rewrite_only_their_samples(rng, transposed):
    # After a plan that spreads a non-finite input over its sample: the scan flags the
    # samples that hold one, and the rewrite writes every output of those samples by the
    # definition and leaves every other sample's (here a NaN poison) alone.
    from cufused._kernels.conv_gemm import (conv_nonfinite_input_flags,
                                            conv_nonfinite_input_samples)

    options = dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)
    x = rng.standard_normal((300, 4, 9, 7))
    w = rng.standard_normal((4, 3, 3, 3) if transposed else (6, 2, 3, 3))
    b = rng.standard_normal(6)
    flagged = [0, 2, 255, 256, 299]  # in both blocks' samples
    for n, value in zip(flagged, (np.inf, np.nan, -np.inf, np.inf, np.nan)):
        x[(n, *(int(rng.integers(s)) for s in x.shape[1:]))] = value
    fn = reference.conv_transpose if transposed else reference.conv
    extra = ((0, 0),) if transposed else ()
    args = (options["stride"], options["padding"], *extra, options["dilation"], 2)
    with np.errstate(all="ignore"):
        ref = fn(x[flagged], w, b, *args)
    xg, wg, bg = to_gpu(x, w, b)
    y = poisoned((300, 6, *ref.shape[2:]))
    flags = conv_nonfinite_input_flags(cp, xg)
    assert np.flatnonzero(flags.get()).tolist() == flagged
    conv_nonfinite_input_samples(xg, wg, bg, y, flags, transposed=transposed, **options)
    got = y.get()
    assert np.isnan(np.delete(got, flagged, axis=0)).all()
    assert np.isfinite(ref).any() and not np.isfinite(ref).all()
    assert_nonfinite_placement(got[flagged], ref, TOL["ieee"])


def test_conv_transpose2d_of_b_on_an_fft_plan(rng):
    # Pipeline B's transposed convolution at batch 16 runs cuDNN's FFT plan in exact float32
    # (H200, cuDNN 9.19), which spreads an input's infinity to NaN over its sample: the
    # samples that hold one are rewritten by the definition. Compared where the samples hold
    # a non-finite value (the float64 reference of three samples), finite elsewhere.
    from cufused._settings import plan_options

    x = rng.standard_normal((16, 64, 32, 32))
    w = rng.standard_normal((64, 128, 5, 5)) * 0.05
    x[0, 1, 5, 5], x[9, 63, 0, 31], x[9, 2, 17, 4] = np.inf, -np.inf, np.nan
    with plan_options(autotune=True):
        got = cufused.conv_transpose2d(*to_gpu(x, w), padding=1, precision="ieee").get()
    with np.errstate(all="ignore"):
        ref = cufused.conv_transpose2d(x[[0, 1, 9]], w, padding=1)
    assert_nonfinite_placement(got[[0, 1, 9]], ref, TOL["ieee"])
    assert np.isfinite(np.delete(got, [0, 9], axis=0)).all()


@pytest.mark.parametrize("pin", ["subpixel nchw", "nchw"])
def test_pipeline_c_rows_of_a_spreading_plan_by_the_definition(rng, monkeypatch, pin):
    # On a plan that spreads a non-finite input (here every plan taken for one), each row of
    # a sample that holds one is recomputed by the definition, the clamp and the softmax.
    from cufused._cudnn import ConvPlan

    monkeypatch.setattr(ConvPlan, "spreads_nonfinite", property(lambda plan: True))
    (x, w, scale), options = pipeline_c_args(rng, n=3)
    x[0, 1, 2, 3, 4], x[2, 2, 7, 9, 5] = np.inf, -np.inf
    fn = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply
    with np.errstate(all="ignore"):
        ref = fn(x, w, scale, **options)
    with _pinned(pin):
        got = fn(*to_gpu(x, w, scale), **options, precision="ieee", method="fused",
                 out=poisoned(ref.shape)).get()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert_close(got, ref, TOL["ieee"])


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_pipeline_a_non_finite_weight_meets_only_the_padding(rng, precision, conv_pin):
    # Tap (0, 4) of channel 1 meets only the padding: its NaN reaches channel 1's outputs and
    # so GroupNorm group 0, as in the public conv2d and the reference.
    x = rng.standard_normal((2, 2, 8, 3))
    w = rng.standard_normal((4, 2, 2, 5))
    w[1, 1, 0, 4] = np.nan
    params = [rng.standard_normal(4) for _ in range(4)]
    options = dict(num_groups=2, pool_kernel=1, clamp_min=-2.0, clamp_max=2.0, stride=(3, 2),
                   padding=(2, 1))
    fn = cufused.conv2d_groupnorm_scale_maxpool_clamp
    with np.errstate(all="ignore"):
        ref = fn(x, w, *params, **options)
    got = fn(*to_gpu(x, w, *params), **options, precision=precision).get()
    assert np.isnan(ref[:, :2]).all() and not np.isnan(ref[:, 2:]).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))


def test_conv_capture_in_cuda_graph(rng, conv_pin):
    # A caller's capture records the cuDNN calls themselves (no graph launch inside it), also
    # after warm calls on that stream have captured the plan's own graph.
    x, w = rng.standard_normal((3, 6, 7, 11)), rng.standard_normal((6, 5, 5, 5))
    ref = cufused.conv_transpose2d(x, w, padding=1)
    xg, wg = to_gpu(x, w)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cp.empty(ref.shape, dtype=cp.float32)
        for _ in range(3):
            cufused.conv_transpose2d(xg, wg, padding=1, out=out)
        stream.begin_capture()
        cufused.conv_transpose2d(xg, wg, padding=1, out=out)
        graph = stream.end_capture()
        out.fill(cp.nan)
        graph.launch()
    stream.synchronize()
    assert_close(out.get(), ref, TOL["ieee"])


def test_conv_non_contiguous_input_and_stream(rng):
    x = rng.standard_normal((4, 3, 12, 10))
    w = rng.standard_normal((5, 3, 3, 3))
    ref = cufused.conv2d(x[:, :, ::2], w, padding=1)
    xg = cp.asarray(x, dtype=cp.float32)[:, :, ::2]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        got = cufused.conv2d(xg, cp.asarray(w, dtype=cp.float32), padding=1)
    stream.synchronize()
    assert_close(got.get(), ref, TOL["ieee"])


def test_conv_matches_torch_cuda(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    x = rng.standard_normal((2, 8, 16, 16)).astype(np.float32)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    ref = torch.nn.functional.conv_transpose2d(
        torch.from_numpy(x).cuda().double(), torch.from_numpy(w).cuda().double(), stride=2,
        padding=1, output_padding=1).cpu().numpy()
    got = cufused.conv_transpose2d(cp.asarray(x), cp.asarray(w), stride=2, padding=1,
                                   output_padding=1)
    assert_close(got.get(), ref, TOL["ieee"])
