"""The building blocks on the GPU (normalizations, pooling, softmax) against the float64 NumPy
reference: NaN-poisoned ``out``, odd shapes, non-finite values, tensors past 2**31 elements."""

from __future__ import annotations

import numpy as np
import pytest

import cufused

from conftest import CONSTANT_LEVELS, GPU, assert_close, mixed, poisoned, to_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("quick_plans")]

if GPU:
    import cupy as cp


# ---------------------------------------------------------------------------- building blocks


# Rows cached and visited by channel (H*W >= 32; (2, 24, 6, 7): more channels per row than
# warps), cached per vector (H*W < 32) and uncached ((2, 6, 67, 131)).
@pytest.mark.parametrize("shape,groups", [((3, 12, 7, 5), 4), ((2, 6, 67, 131), 2),
                                          ((1, 4, 1), 1), ((5, 9, 11), 3),
                                          ((2, 8, 6, 10), 4), ((3, 8, 2, 3), 4),
                                          ((2, 24, 6, 7), 2)])
def test_group_norm(rng, shape, groups):
    # |mean| >> std: the shifted sums must keep the variance accurate. The reference sees the
    # float32 input the GPU sees (rounding 1000 + x to float32 moves a 4-value group's
    # normalized values by ~1e-4 by itself).
    x = (1000.0 + rng.standard_normal(shape)).astype(np.float32).astype(np.float64)
    w, b = mixed(rng, shape[1]), rng.standard_normal(shape[1])
    ref = cufused.group_norm(x, groups, w, b)
    out = poisoned(shape)
    cufused.group_norm(*to_gpu(x), groups, *to_gpu(w, b), out=out)
    assert_close(out.get(), ref, 1e-4)


@pytest.mark.parametrize("eps", [0.0, 1e-46, 1e-5])
@pytest.mark.parametrize("shape", [(2, 4, 3, 3), (2, 8, 6, 10)])
def test_group_norm_of_a_constant_group(rng, shape, eps):
    # A constant group's variance is exactly 0 (the sums of x - x0): NaN with eps = 0, and
    # with eps > 0 its bias (NaN for an infinite weight), where the reference puts them; an
    # eps below float32's smallest value (1e-46) too.
    x = rng.standard_normal(shape).astype(np.float32).astype(np.float64)
    c = shape[1]
    x[0, :c // 2] = 0.1
    x[1, c // 2:] = -7.3
    w = mixed(rng, c)
    w[1] = np.inf
    b = rng.standard_normal(c)
    ref = cufused.group_norm(x, 2, w, b, eps=eps)
    if eps > 0:
        # The GPU's centered form gives such a group exactly its bias; the reference's
        # a * x + b is within ulp(mean * rstd * weight) of it, 2e7 for rstd = 1e23.
        ref[0, :c // 2] = b[:c // 2, None, None]
        ref[0, 1] = np.nan
        ref[1, c // 2:] = b[c // 2:, None, None]
    out = poisoned(shape)
    cufused.group_norm(*to_gpu(x), 2, *to_gpu(w, b), eps=eps, out=out)
    got = out.get()
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(got[0, 1]).all()
    assert np.array_equal(np.isinf(got), np.isinf(ref))
    finite = np.isfinite(ref)
    assert_close(got[finite], ref[finite], 1e-4)


@pytest.mark.parametrize("eps,want", [
    (1e-5, [-np.inf, np.nan, -np.inf, 0.25, np.nan, 0.75]),
    (0.0, [-np.inf, np.nan, -np.inf, np.nan, np.nan, np.nan])])
@pytest.mark.parametrize("shape", [(1, 6), (1, 6, 1), (1, 6, 1, 1)])
def test_group_norm_of_one_value_per_channel_in_the_centered_form(shape, eps, want):
    # PyTorch CUDA's form for one value per channel, (x - mean) * rstd * w + b, whatever the
    # coefficients: an infinite weight gives +-inf, and NaN where the value is the mean (the
    # group 1, 2, 3 has mean 2 exactly); the constant group 5, 5, 5 gives its bias for a
    # finite weight and NaN for an infinite one, and NaN throughout with eps = 0.
    x = np.array([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]).reshape(shape)
    w = np.array([np.inf, np.inf, -np.inf, 2.0, np.inf, 0.0])
    b = np.array([0.5, 0.5, 0.5, 0.25, 0.5, 0.75])
    out = poisoned(shape)
    cufused.group_norm(*to_gpu(x), 2, *to_gpu(w, b), eps=eps, out=out)
    np.testing.assert_array_equal(out.get().reshape(-1), np.array(want, dtype=np.float32))


# Deviations whose squares pass float32's range (3.4e38): the variance is infinite, rstd 0 and
# every output its channel's bias, as PyTorch's float32 kernels give (semantics.rst,
# Statistics), on each GroupNorm route: rows cached by channel ((3, 12, 7, 5)) and per vector
# ((3, 8, 2, 3)), and the split statistics ((2, 6, 67, 131)). Then BatchNorm in training: its
# outputs are the bias, running_var becomes inf and running_mean takes the batch mean.
@pytest.mark.parametrize("shape", [(3, 12, 7, 5), (3, 8, 2, 3), (2, 6, 67, 131)])
def test_group_norm_past_float32_squares(rng, shape):
    x = (1e30 * rng.uniform(-1.0, 1.0, shape)).astype(np.float32)
    c = shape[1]
    w, b = mixed(rng, c), rng.standard_normal(c)
    out = poisoned(shape)
    cufused.group_norm(*to_gpu(x), 2, *to_gpu(w, b), out=out)
    bias = np.float32(b).reshape((c,) + (1,) * (len(shape) - 2))
    assert np.array_equal(out.get(), np.broadcast_to(bias, shape))


# Squares that each stay in float32's range, as does a thread's sum of them, while a row's sum
# passes it: values of +-1.5e17 (deviations of 3e17 from the row's first value, squares 9e34)
# over rows of 12288 values (two channels of 64 x 96, one block per row). The combined sum of
# squares is clamped to float32's range (shifted_moments), so the variance is infinite, rstd 0
# and every output its channel's bias: the threshold of semantics.rst, "Statistics", not that
# of PyTorch's Welford sums around the mean (which stay finite here).
def test_group_norm_sum_of_squares_past_float32_range(rng):
    shape = (2, 4, 64, 96)
    x = (1.5e17 * rng.choice([-1.0, 1.0], shape)).astype(np.float32)
    c = shape[1]
    w, b = mixed(rng, c), rng.standard_normal(c)
    out = poisoned(shape)
    cufused.group_norm(*to_gpu(x), 2, *to_gpu(w, b), out=out)
    bias = np.float32(b).reshape(c, 1, 1)
    assert np.array_equal(out.get(), np.broadcast_to(bias, shape))


# Deviations of 2e37 from the shift (each row's first value is -1e37, the others 1e37): a
# row's sum of them passes float32's range, a thread's share of a few values does not. The
# threads' sums combine in float64, so the mean stays finite, the squares give rstd 0 and
# every output is its channel's bias, as PyTorch gives, whose Welford mean stays finite. Rows
# cached by channel ((3, 12, 7, 5), (2, 4, 16, 16)), per vector ((3, 8, 2, 3)) and read
# channels-last in place ((2, 8, 6, 6) "nhwc").
@pytest.mark.parametrize("shape,layout", [((3, 12, 7, 5), "nchw"), ((3, 8, 2, 3), "nchw"),
                                          ((2, 4, 16, 16), "nchw"), ((2, 8, 6, 6), "nhwc")])
def test_group_norm_sum_of_deviations_past_float32_range(rng, shape, layout):
    from cufused._layout import empty_in_layout

    n, c = shape[:2]
    x = np.full(shape, 1e37, dtype=np.float32)
    x.reshape(n, 2, -1)[:, :, 0] = -1e37
    x_gpu = empty_in_layout(shape, layout)
    x_gpu[...] = cp.asarray(x)
    w, b = mixed(rng, c), rng.standard_normal(c)
    out = poisoned(shape)
    cufused.group_norm(x_gpu, 2, *to_gpu(w, b), out=out)
    bias = np.float32(b).reshape((c,) + (1,) * (len(shape) - 2))
    assert np.array_equal(out.get(), np.broadcast_to(bias, shape))


def test_batch_norm_past_float32_squares(rng):
    shape = (4, 5, 9, 11)
    x = (1e30 * rng.uniform(-1.0, 1.0, shape)).astype(np.float32)
    w, b = mixed(rng, 5), rng.standard_normal(5)
    rm, rv = cp.zeros(5, dtype=cp.float32), cp.ones(5, dtype=cp.float32)
    out = poisoned(shape)
    cufused.batch_norm(*to_gpu(x, w, b), running_mean=rm, running_var=rv, training=True,
                       momentum=0.25, out=out)
    assert np.array_equal(out.get(), np.broadcast_to(np.float32(b)[:, None, None], shape))
    assert np.isposinf(rv.get()).all()
    batch_mean = x.astype(np.float64).mean(axis=(0, 2, 3))
    assert np.abs(rm.get() - 0.25 * batch_mean).max() <= 1e-5 * 1e30


# Deviations of 2e17 from the shift (squares of 4e34, far inside float32's range) over 65536
# values per channel: each thread's float32 sum of squares stays finite, the channel's, about
# 1e39, does not, so the variance is infinite, every output the bias and running_var
# infinite, as where PyTorch's float32 sums overflow (semantics.rst, "Statistics").
def test_batch_norm_sum_of_squares_past_float32_range(rng):
    shape = (64, 4, 32, 32)
    x = (1e17 * rng.choice([-1.0, 1.0], shape)).astype(np.float32)
    w, b = mixed(rng, 4), rng.standard_normal(4)
    rm, rv = cp.zeros(4, dtype=cp.float32), cp.ones(4, dtype=cp.float32)
    out = poisoned(shape)
    cufused.batch_norm(*to_gpu(x, w, b), running_mean=rm, running_var=rv, training=True,
                       out=out)
    assert np.array_equal(out.get(), np.broadcast_to(np.float32(b)[:, None, None], shape))
    assert np.isposinf(rv.get()).all() and np.isfinite(rm.get()).all()


# A batch mean a hundredth of the spread, and a shift (each channel's first value, 1.5) about
# 1.5 spreads from it: float32 sums of the shifted values would drift by the shift per value
# and round at that scale, far above the mean's own; the running mean keeps about PyTorch's
# accuracy (a few 1e-7 relative).
@pytest.mark.parametrize("shape", [(2, 3, 25, 25), (64, 3, 7, 9)])
def test_batch_norm_running_mean_of_a_small_mean(rng, shape):
    x = rng.standard_normal(shape)
    axes = (0, 2, 3)
    x[:, :, 0, 0] = 0.0
    x -= x.mean(axis=axes, keepdims=True) - 0.01 * x.std(axis=axes, keepdims=True)
    x[0, :, 0, 0] = 1.5  # the shift
    x = x.astype(np.float32)
    mean = x.astype(np.float64).mean(axis=axes)
    assert (x.astype(np.float64).std(axis=axes) > 50 * np.abs(mean)).all()  # the premise
    rm, rv = cp.zeros(3, dtype=cp.float32), cp.ones(3, dtype=cp.float32)
    cufused.batch_norm(cp.asarray(x), running_mean=rm, running_var=rv, momentum=1.0)
    assert (np.abs(rm.get() - mean) / np.abs(mean)).max() < 1e-6


# One row of 4 values, [0, 3e38, -3e38, -3e38], summed in order by one thread: the sum of
# deviations stays finite (-3e38), their squares overflow, so rstd is 0 and every output is
# the bias, also that of 3e38, which lies farther than float32's range from the mean (-7.5e37).
def test_group_norm_of_a_value_past_float32_range_from_the_mean():
    x = cp.asarray(np.float32([0.0, 3e38, -3e38, -3e38]).reshape(1, 1, 2, 2))
    w, b = cp.asarray([1.5], dtype=cp.float32), cp.asarray([0.25], dtype=cp.float32)
    assert np.array_equal(cufused.group_norm(x, 1, w, b).get(),
                          np.full((1, 1, 2, 2), np.float32(0.25)))


# A constant channel (BatchNorm) or group (GroupNorm) far from zero: its values equal the
# mean, so every output is exactly the bias, as in PyTorch's native kernels (a * x + b with
# b = beta - mean * a would leave about ulp(mean * rstd * gamma): 0.016 at 1234.5). GroupNorm
# on each route: rows cached by channel ((3, 8, 7, 5)) and per vector ((3, 8, 2, 3)), and the
# split statistics ((2, 8, 67, 131)); BatchNorm in training, without affine parameters, and
# from running statistics.
@pytest.mark.parametrize("shape", [(3, 8, 7, 5), (3, 8, 2, 3), (2, 8, 67, 131)])
def test_normalization_of_constant_values_gives_the_bias(rng, shape):
    c = shape[1]
    planes = (c,) + (1,) * (len(shape) - 2)
    w, b = mixed(rng, c), rng.standard_normal(c)
    bias = np.broadcast_to(np.float32(b).reshape(planes), shape)
    group_constant = np.ascontiguousarray(np.broadcast_to(
        np.repeat(CONSTANT_LEVELS[1::2], 2).reshape(planes), shape))
    out = poisoned(shape)
    cufused.group_norm(cp.asarray(group_constant), 4, *to_gpu(w, b), out=out)
    assert np.array_equal(out.get(), bias)
    x = cp.asarray(np.ascontiguousarray(np.broadcast_to(CONSTANT_LEVELS.reshape(planes), shape)))
    for stats in (dict(training=True),
                  dict(training=False, running_mean=cp.asarray(CONSTANT_LEVELS),
                       running_var=cp.ones(c, dtype=cp.float32))):
        out = poisoned(shape)
        cufused.batch_norm(x, *to_gpu(w, b), **stats, out=out)
        assert np.array_equal(out.get(), bias)
    assert not cp.any(cufused.batch_norm(x))


# Channels (BatchNorm) or groups (GroupNorm) uniform in +-1 far from zero, on the same routes:
# a float32 mean is off by up to half its ulp (0.004 at 7e4, 0.7 % of a standard deviation),
# which the affine takes out, centering on the float64 mean; the outputs stay at float32
# rounding of the float64 reference's (about 5e-8 relative; a float32 center gives 2e-5 to
# 2e-3).
@pytest.mark.parametrize("shape", [(3, 8, 7, 5), (3, 8, 2, 3), (2, 8, 67, 131)])
def test_normalization_of_values_far_from_zero(rng, shape):
    c = shape[1]
    planes = (c,) + (1,) * (len(shape) - 2)
    w, b = mixed(rng, c), rng.standard_normal(c)
    spread = rng.uniform(-1.0, 1.0, shape)

    def group_norm(x, w, b, **kw):
        return cufused.group_norm(x, 4, w, b, **kw)

    for norm, offsets in ((group_norm, np.repeat(CONSTANT_LEVELS[1::2], 2)),
                          (cufused.batch_norm, CONSTANT_LEVELS)):
        x = (offsets.reshape(planes) + spread).astype(np.float32)
        out = poisoned(shape)
        norm(cp.asarray(x), *to_gpu(w, b), out=out)
        assert_close(out.get(), norm(x.astype(np.float64), w, b), 1e-6)


# Each statistics row's first value 1000 from a unit spread (z of about 110 to 450 standard
# deviations of its row): the shift scales sum d*d by about 1 + z^2, and a float32 sum's
# rounding with it (1.4e-4 of rstd); the float64 sums keep float32 accuracy. Rows of
# 12288 cached by channel, read channels-last in place, and split over blocks (35108 values);
# BatchNorm's channels of 65536.
@pytest.mark.parametrize("norm, shape, layout", [
    ("group", (4, 8, 48, 64), "nchw"), ("group", (4, 8, 48, 64), "nhwc"),
    ("group", (2, 8, 67, 131), "nchw"), ("batch", (16, 8, 64, 64), "nchw")])
def test_normalization_of_a_first_value_far_out(rng, norm, shape, layout):
    from cufused._layout import empty_in_layout

    c = shape[1]
    x = rng.standard_normal(shape).astype(np.float32)
    if norm == "group":
        x[:, ::c // 2, 0, 0] = 1000.0  # each (sample, group) row's first value

        def run(a, w, b, **kw):
            return cufused.group_norm(a, 2, w, b, **kw)
    else:
        x[0, :, 0, 0] = 1000.0  # each channel's first value
        run = cufused.batch_norm
    w, b = mixed(rng, c), rng.standard_normal(c)
    x_gpu = empty_in_layout(shape, layout)
    x_gpu[...] = cp.asarray(x)
    out = poisoned(shape)
    run(x_gpu, *to_gpu(w, b), out=out)
    assert_close(out.get(), run(x.astype(np.float64), w, b), 2e-6)


# Channels-last inputs read in place (groups of 4, 8, 32 channels; 16-byte output vectors
# where H*W >= 4, scalar ones for (2, 16, 1, 3)) and one that is copied (groups of 3).
@pytest.mark.parametrize("shape,groups", [((3, 24, 5, 7), 3), ((2, 16, 1, 3), 4),
                                          ((2, 64, 9, 10), 2), ((2, 12, 4, 4), 4)])
def test_group_norm_channels_last_input(rng, shape, groups):
    from cufused._layout import empty_in_layout

    x = (1000.0 + rng.standard_normal(shape)).astype(np.float32).astype(np.float64)
    w, b = mixed(rng, shape[1]), rng.standard_normal(shape[1])
    ref = cufused.group_norm(x, groups, w, b)
    x_gpu = empty_in_layout(shape, "nhwc")
    x_gpu[...] = cp.asarray(x, dtype=cp.float32)
    out = poisoned(shape)
    cufused.group_norm(x_gpu, groups, *to_gpu(w, b), out=out)
    assert_close(out.get(), ref, 1e-4)


# (6, 7, 9, 11): scalar apply pass; (4, 7, 9, 11): 16-byte vectors that straddle the odd
# 99-value planes; (5, 3, 2): planes shorter than a vector.
@pytest.mark.parametrize("shape", [(6, 7, 9, 11), (4, 7, 9, 11), (5, 3, 2)])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("activation", [None, "tanh"])
@pytest.mark.parametrize("momentum", [0.3, 1.6])  # past 1 it extrapolates, as in PyTorch
def test_batch_norm(rng, shape, training, activation, momentum):
    x = 5.0 + 3.0 * rng.standard_normal(shape)
    c = shape[1]
    w, b = mixed(rng, c), rng.standard_normal(c)
    rm, rv = rng.standard_normal(c), rng.uniform(0.5, 2.0, c)
    rm_g, rv_g = to_gpu(rm, rv)
    ref = cufused.batch_norm(x, w, b, running_mean=rm, running_var=rv, training=training,
                             momentum=momentum, activation=activation)
    out = poisoned(x.shape)
    cufused.batch_norm(*to_gpu(x, w, b), running_mean=rm_g, running_var=rv_g,
                       training=training, momentum=momentum, activation=activation, out=out)
    assert_close(out.get(), ref, 1e-5)
    assert_close(rm_g.get(), rm, 1e-5)
    assert_close(rv_g.get(), rv, 1e-5)


@pytest.mark.parametrize("nd", [2, 3])
@pytest.mark.parametrize("is_max", [True, False])
def test_pooling(rng, nd, is_max):
    shape = (2, 3, 11, 13) if nd == 2 else (2, 3, 7, 9, 8)
    x = rng.standard_normal(shape)
    if is_max:
        x[0, 0, 1, 1] = np.nan
    fn = getattr(cufused, f"{'max' if is_max else 'avg'}_pool{nd}d")
    for opts in (dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1)):
        ref = fn(x, **opts)
        out = poisoned(ref.shape)
        fn(*to_gpu(x), **opts, out=out)
        got = out.get()
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        mask = ~np.isnan(ref)
        assert_close(got[mask], ref[mask], 1e-6)


@pytest.mark.parametrize("first", [np.inf, -np.inf])
def test_batch_norm_infinity_as_a_channels_first_value(rng, first):
    # The running mean of a channel whose first value is infinite (the others finite) is that
    # infinity, as in PyTorch; its running variance and outputs are NaN; other channels as
    # usual.
    x = rng.standard_normal((3, 4, 5, 6))
    x[0, 1, 0, 0] = first
    rm, rv = rng.standard_normal(4), rng.uniform(0.5, 2, 4)
    rm_g, rv_g = to_gpu(rm, rv)
    ref = cufused.batch_norm(x, running_mean=rm, running_var=rv, training=True)
    out = poisoned(x.shape)
    cufused.batch_norm(*to_gpu(x), running_mean=rm_g, running_var=rv_g, training=True, out=out)
    got = out.get()
    assert rm[1] == first and rm_g.get()[1] == first
    assert np.isnan(rv[1]) and np.isnan(rv_g.get()[1])
    assert np.isnan(ref[:, 1]).all() and np.isnan(got[:, 1]).all()
    keep = [0, 2, 3]
    assert_close(got[:, keep], ref[:, keep], 1e-5)
    assert_close(rm_g.get()[keep], rm[keep], 1e-5)
    assert_close(rv_g.get()[keep], rv[keep], 1e-5)


def test_batch_norm_inference_of_denormal_and_odd_running_variances(rng):
    # 1 / sqrt(running_var + eps) from the exact values (the kernels flush float32 denormals):
    # a denormal variance with eps 0 gives a large finite factor as in PyTorch, not an
    # infinity; a negative or NaN variance NaN, an infinite one zeros. A zero one with eps 0
    # gives an infinite factor, whose NaN or infinity depends on the affine's form (PyTorch
    # CUDA's centered one, CPU's a * x + b; semantics.rst): not finite, either way.
    running_var = np.array([1e-40, 3e-45, 0.0, -1.0, np.nan, np.inf, 2.0], dtype=np.float32)
    c = running_var.size
    x = rng.standard_normal((2, c, 3, 5)).astype(np.float32)
    running_mean = rng.standard_normal(c).astype(np.float32)
    tiny = float(np.float32(3e-45))  # 2**-148: eps the same in float32 and float64
    for eps, weight in ((0.0, None), (tiny, rng.standard_normal(c).astype(np.float32))):
        with np.errstate(all="ignore"):
            ref = cufused.batch_norm(x.astype(np.float64), weight, running_mean=running_mean,
                                     running_var=running_var, training=False, eps=eps)
        got = cufused.batch_norm(*to_gpu(x), *to_gpu(weight), running_mean=cp.asarray(
            running_mean), running_var=cp.asarray(running_var), training=False, eps=eps,
            out=poisoned(x.shape)).get()
        zero = running_var == 0
        if eps == 0:
            assert not np.isfinite(got[:, zero]).any()
            got, ref = got[:, ~zero], ref[:, ~zero]
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(got), test(ref))
        finite = np.isfinite(ref)
        assert finite[:, :2].all() and np.abs(ref[:, 0]).max() > 1e18
        assert_close(got[finite], ref[finite], 1e-5)


# avg_pool3d's window must fit in the unpadded input, as in PyTorch.
@pytest.mark.parametrize("nd, is_max", [(2, True), (2, False), (3, True)])
def test_pooling_windows_far_larger_than_the_input(rng, nd, is_max):
    # A window of 2**30 (padding 2**29, within the checks) visits only its positions inside
    # the input: the call returns at once, the max, or the sum over the whole window size.
    # Positive values: the average's float32 sum of 81 values has no cancellation.
    x = rng.uniform(0.5, 1.5, (2, 3) + (9,) * nd).astype(np.float32)
    fn = getattr(cufused, f"{'max' if is_max else 'avg'}_pool{nd}d")
    k, p = 2**30, 2**29
    out = poisoned((2, 3) + (1,) * nd)
    fn(*to_gpu(x), k, None, p, out=out)
    axes = tuple(range(2, 2 + nd))
    x64 = x.astype(np.float64)
    want = x64.max(axis=axes) if is_max else x64.sum(axis=axes) / float(k) ** nd
    assert_close(out.get().reshape(2, 3), want, 1e-6 if is_max else 1e-5)


@pytest.mark.parametrize("shape,axis", [((3, 5, 7), -1), ((2, 3, 4, 5, 6), (2, 3, 4)),
                                        ((4, 6, 5), 1), ((2, 3, 4), (0, 2)), ((1000, 3), 0),
                                        ((2, 200_000), -1)])
def test_softmax(rng, shape, axis):
    x = 10 * rng.standard_normal(shape)
    ref = cufused.softmax(x, axis)
    out = poisoned(shape)
    cufused.softmax(*to_gpu(x), axis, out=out)
    assert_close(out.get(), ref, 1e-5)


def test_softmax_nan_and_inf():
    x = np.zeros((3, 4))
    x[0, 1] = np.nan
    x[1, 2] = -np.inf
    x[2, 3] = np.inf
    got = cufused.softmax(cp.asarray(x, dtype=cp.float32), axis=1).get()
    assert np.isnan(got[0]).all() and np.isnan(got[2]).all()
    assert_close(got[1], cufused.softmax(x, 1)[1], 1e-6)


def test_tanh_accuracy():
    # The kernels' branch-free tanh (through batch_norm's inference affine, a = 1, b = 0):
    # both sides of its 0.25 cutoff, tiny and saturated values, +-inf and NaN.
    x = np.concatenate([np.linspace(-12.0, 12.0, 400_001), [0.2499999, 0.25, 0.2500001],
                        [1e-30, -1e-8, 3e-4, np.inf, -np.inf, np.nan]]).astype(np.float32)
    xg = cp.asarray(x.reshape(1, 1, -1))
    ones, zeros = cp.ones(1, dtype=cp.float32), cp.zeros(1, dtype=cp.float32)
    got = cufused.batch_norm(xg, ones, zeros, running_mean=zeros, running_var=ones, eps=0.0,
                             training=False, activation="tanh").get().ravel()
    ref = np.tanh(x.astype(np.float64))
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    finite = ~np.isnan(ref)
    assert np.abs(got[finite] - ref[finite]).max() < 2e-7
    nonzero = finite & (ref != 0)
    assert (np.abs(got[nonzero] - ref[nonzero]) / np.abs(ref[nonzero])).max() < 6e-7
    # A zero keeps its sign: with a bias of -0, x = -0 maps to -0 and x = +0 to +0.
    signed = (np.array([-0.0, 0.0], dtype=np.float32).reshape(1, 1, 2), ones.get(),
              np.full(1, -0.0, dtype=np.float32))
    opts = dict(running_mean=zeros.get(), running_var=ones.get(), eps=0.0, training=False,
                activation="tanh")
    want = cufused.batch_norm(*signed, **opts).ravel()
    got = cufused.batch_norm(*(cp.asarray(a) for a in signed),
                             **{k: cp.asarray(v) if isinstance(v, np.ndarray) else v
                                for k, v in opts.items()}).get().ravel()
    assert np.signbit(want).tolist() == [True, False]
    assert np.signbit(got).tolist() == [True, False] and (got == 0).all()


def test_tensor_past_2_31_elements(rng):
    # (n, 1, 256, 256) with n = 2**15 + 1: 2**31 + 65536 elements. Each sample is independent,
    # so the first and last samples are checked against the reference.
    n = 2**15 + 1
    x = cp.random.default_rng(int(rng.integers(2**31))).random((n, 1, 256, 256),
                                                              dtype=cp.float32)
    assert x.size > 2**31
    x[-1, 0, 7, 9] = 9.0
    for fn, kwargs in ((cufused.max_pool2d, dict(kernel_size=2)),
                       (cufused.group_norm, dict(num_groups=1)),
                       (cufused.softmax, dict(axis=(2, 3)))):
        y = fn(x, **kwargs)
        for i in (0, n - 1):
            ref = fn(x[i:i + 1].get(), **kwargs)
            assert_close(y[i:i + 1].get(), ref, 1e-5)
        del y
    del x
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("pool", [cufused.max_pool2d, cufused.max_pool3d])
def test_max_pool_of_signed_zeros_keeps_the_first(pool):
    # PyTorch keeps a window's first of equal values: the max of (-0, +0) is -0, of (+0, -0)
    # is +0.
    nd = 2 if pool is cufused.max_pool2d else 3
    x = np.zeros((1, 2) + (2,) * nd, np.float32)
    x[0, 0].flat[0] = -0.0  # -0 first, then +0
    x[0, 1].flat[1:] = -0.0  # +0 first, then -0
    got = pool(cp.asarray(x), 2).get()
    assert got.shape == (1, 2) + (1,) * nd
    assert np.signbit(got[0, 0]).all() and not np.signbit(got[0, 1]).any()

