"""Launch limits on the GPU: dynamic shared memory beside a kernel's static shared memory,
more samples than a grid's z takes, and positions past 2**31 in one plane or near 2**31 in
one tensor (32-bit index arithmetic)."""

from __future__ import annotations

import pytest

import cufused

from conftest import GPU, assert_close, count_calls, mixed, to_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("quick_plans")]

if GPU:
    import cupy as cp


@pytest.fixture
def free_memory():
    yield
    cp.get_default_memory_pool().free_all_blocks()


# A GroupNorm row of 12225-12288 values fills the 48 KB that a launch gets without a grant,
# less the kernel's static shared memory: the row cache needs the grant (12224: the last
# length without one).
@pytest.mark.parametrize("shape,groups", [((2, 12224), 1), ((2, 12225), 1),
                                          ((2, 3, 64, 64), 1), ((3, 96, 16, 16), 2)])
def test_group_norm_rows_past_the_default_shared_memory(rng, shape, groups):
    x = 2.0 + rng.standard_normal(shape)
    w, b = mixed(rng, shape[1]), rng.standard_normal(shape[1])
    got = cufused.group_norm(*to_gpu(x), groups, *to_gpu(w, b))
    assert_close(got.get(), cufused.group_norm(x, groups, w, b), 1e-5)


def test_pipeline_b_group_of_12288_values(rng):
    # Pooled output 64 x 12 x 16 in one GroupNorm group: B's in-place GroupNorm rows.
    x = rng.random((2, 8, 24, 32))
    w = 0.3 * rng.standard_normal((8, 64, 1, 1))
    params = [mixed(rng, 64), rng.standard_normal(64), mixed(rng, 64), rng.standard_normal(64)]
    fn = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm
    got = fn(*to_gpu(x, w, *params), num_groups=1, precision="ieee")
    assert_close(got.get(), fn(x, w, *params, num_groups=1), 1e-4)


C_KW = dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0, clamp_max=1.0)


def _pipeline_c_on_gpu(rng, shape, pin):
    """Float64 operands of pipeline C (4 -> 8 channels) and the result of its "ieee" GPU call
    (on the host) with the convolution strategy ``pin``."""
    from cufused._settings import plan_options

    x = rng.random(shape)
    w, s = 0.3 * rng.standard_normal((4, 8, 3, 3, 3)), mixed(rng, 8)
    with plan_options(pins=(pin,)):
        got = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            *to_gpu(x, w, s), **C_KW, precision="ieee")
    return x, w, s, got.get()


# Pipeline C's one-read softmax stages 48 KB a block for an output of 48 x 64 x 32 (the
# control: 48 x 64 x 16, 24 KB), on the cuDNN plan's NCHW output or its sub-pixel classes.
@pytest.mark.parametrize("spatial", [(48, 64, 16), (48, 64, 32)])
@pytest.mark.parametrize("pin", ["nchw", "subpixel nchw"])
def test_one_read_softmax_staging_48_kb(rng, monkeypatch, spatial, pin):
    from cufused._kernels import softmax

    calls = count_calls(monkeypatch, softmax, "softmax_rows_cluster")
    x, w, s, got = _pipeline_c_on_gpu(rng, (1, 4, *spatial), pin)
    if int(cp.cuda.Device().compute_capability) >= 90:  # clusters
        assert calls == ["softmax_rows_cluster"]
    assert_close(got, cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(x, w, s, **C_KW),
                 1e-4)


# Pipeline C over 70000 samples with the convolution output channels-last: the normalize
# pass's blocks take samples blockIdx.z + k * 65535.
@pytest.mark.parametrize("pin", ["nhwc", "nchw>nhwc"])
def test_channels_last_softmax_past_65535_samples(rng, monkeypatch, pin, free_memory):
    from cufused._kernels import softmax

    n = 70000
    calls = count_calls(monkeypatch, softmax, "softmax_apply_transpose")
    x, w, s, got = _pipeline_c_on_gpu(rng, (n, 4, 2, 2, 2), pin)
    assert calls == ["softmax_apply_transpose"]
    fn = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply
    for part in (slice(0, 3), slice(65533, 65538), slice(n - 3, n)):
        assert_close(got[part], fn(x[part], w, s, **C_KW), 1e-4)


# BatchNorm's per-channel affine divides element indices by the plane size in float while the
# tensor has fewer than 2**31 elements: near 2**31 (2**31 - 8 here, planes of 8 values) the
# estimate exceeds the quotient and its check must not wrap.
def test_batch_norm_just_under_2_31_elements(free_memory):
    shape = (89478485, 3, 8)
    x = cp.random.default_rng(0).random(shape, dtype=cp.float32)
    w = cp.asarray([1.0, -2.0, 3.0], dtype=cp.float32)
    b = cp.asarray([0.0, 10.0, 20.0], dtype=cp.float32)
    out = cufused.batch_norm(x, w, b, training=True)
    mean = x.mean(axis=(0, 2), dtype=cp.float64)
    var = (x.astype(cp.float32) ** 2).mean(axis=(0, 2), dtype=cp.float64) - mean**2
    coef_a = w / cp.sqrt(var + 1e-5)
    coef_b = b - mean * coef_a
    for part in (slice(0, 4), slice(shape[0] // 2, shape[0] // 2 + 4), slice(-4, None)):
        want = x[part] * coef_a[:, None] + coef_b[:, None]
        assert_close(out[part].get(), want.get(), 1e-5)


# Output planes of more than 2**31 positions: a max pool with a window of one copies its
# input; the gathering implicit GEMM (a 9 x 9 kernel, past the halo kernel's 72 taps) must
# place the last row's positions past 2**31.
def test_pool_plane_past_2_31(free_memory):
    x = cp.random.default_rng(0).random((1, 1, 46341, 46341), dtype=cp.float32)
    out = cp.full(x.shape, cp.nan, dtype=cp.float32)
    cufused.max_pool2d(x, 1, out=out)
    assert bool((out == x).all())


# An input plane past 2**31 positions whose pooled planes over the channels stay below it:
# the 2 x 2 x 2 pool into a channels-last destination (pipeline C's, before a channels-last
# convolution) against the N-d pool into NCDHW, whose indices are 64-bit.
def test_pool_to_channels_last_input_plane_past_2_31(free_memory):
    from cufused._kernels.pooling import pool_into
    from cufused._layout import empty_in_layout

    x = cp.random.default_rng(0).random((1, 2, 1026, 1024, 2048), dtype=cp.float32)
    assert x[0, 0].size > 2**31 and x.size // 8 < 2**31
    window = (2, 2, 2)
    last = empty_in_layout((1, 2, 513, 512, 1024), "nhwc")
    last.fill(cp.nan)
    pool_into(x, last, window, window, (0, 0, 0), is_max=True)
    want = cp.full(last.shape, cp.nan, dtype=cp.float32)
    pool_into(x, want, window, window, (0, 0, 0), is_max=True)
    del x
    assert bool((last == want).all())


@pytest.mark.parametrize("precision", ["tf32", "3xtf32"])
def test_implicit_gemm_plane_past_2_31(precision, free_memory):
    from cufused._settings import plan_options

    k = 9
    x = cp.random.default_rng(0).random((1, 1, 46349, 46349), dtype=cp.float32)
    w = 0.1 * cp.random.default_rng(1).standard_normal((1, 1, k, k), dtype=cp.float32)
    b = cp.asarray([5.0], dtype=cp.float32)
    with plan_options(engine="igemm"):
        out = cufused.conv2d(x, w, b, precision=precision)
    q = out.shape[3]
    assert (out.shape[2] - 1) * q + q > 2**31
    for p in (0, out.shape[2] - 1):  # the first row, and the last past 2**31
        want = cp.full(q, 5.0, dtype=cp.float64)
        for u in range(k):
            row = x[0, 0, p + u].astype(cp.float64)
            for v in range(k):
                want += float(w[0, 0, u, v]) * row[v:v + q]
        assert_close(out[0, 0, p].get(), want.get(), 5e-3 if precision == "tf32" else 1e-5)


# More (n, group) rows than a grid holds (2**31 rows of two values): GroupNorm's row launches
# run over slices of the batch.
def test_group_norm_past_2_31_rows(rng, free_memory):
    n = 2**28 + 3
    x = cp.random.default_rng(0).random((n, 16, 1, 1), dtype=cp.float32)
    w, b = to_gpu(mixed(rng, 16), rng.standard_normal(16))
    out = cp.full(x.shape, cp.nan, dtype=cp.float32)
    cufused.group_norm(x, 8, w, b, out=out)
    for part in (slice(0, 2), slice(n // 2, n // 2 + 2), slice(n - 2, n)):
        pairs = x[part].astype(cp.float64).reshape(-1, 8, 2)
        half = (pairs[..., :1] - pairs[..., 1:]) / 2
        normalized = cp.concatenate([half, -half], axis=-1) / cp.sqrt(half**2 + 1e-5)
        want = normalized.reshape(-1, 16) * w + b
        assert_close(out[part].reshape(-1, 16).get(), want.get(), 1e-5)
    assert not bool(cp.isnan(out).any())


# More rows than softmax_rows counts as channels in 32 bits: the public softmax runs in parts.
def test_softmax_past_2_31_rows(free_memory):
    x = cp.random.default_rng(0).random((2**31 + 5, 1), dtype=cp.float32)
    out = cp.full(x.shape, cp.nan, dtype=cp.float32)
    cufused.softmax(x, axis=1, out=out)
    assert bool((out == 1.0).all())


def test_softmax_rows_in_parts_read_and_write_their_own_rows(rng, monkeypatch):
    # The parts of 2**31 - 1 rows, made 7 rows here: each part's rows at their own offsets.
    from cufused._ops import softmax

    monkeypatch.setattr(softmax, "_ROWS_PER_CALL", 7)
    x = rng.standard_normal((5, 4, 6))
    for axis in (2, 1):  # the rows in place, or moved last
        got = cufused.softmax(*to_gpu(x), axis=axis)
        assert_close(got.get(), cufused.softmax(x, axis=axis), 1e-6)


# ------------------------------------------- products past 32 bits and grids past their limits

def test_group_norm_coefficients_of_more_than_2_31_planes(free_memory):
    # N * C = 2**31 + 2**14 planes of one value, rows of 16384 values (past the row kernels'
    # cache): the split statistics, then the affine with N * C coefficients.
    n, c = 2**17 + 1, 2**14
    rng = cp.random.default_rng(1)
    x = rng.random((n, c), dtype=cp.float32)
    w, b = rng.standard_normal(c, dtype=cp.float32), rng.standard_normal(c, dtype=cp.float32)
    out = cufused.group_norm(x, 1, w, b)
    for rows in (slice(0, 2), slice(n - 2, n)):
        assert_close(out[rows].get(), cufused.group_norm(x[rows].get(), 1, w.get(), b.get()),
                     1e-5)


def test_group_norm_of_a_channels_last_sample_past_2_31(free_memory):
    # One sample of 2**20 channels of 40 x 64 stored channels-last, groups of 4 channels: the
    # rows read position p of channel c at p * C + c, past 2**31 from p = 2048 on.
    c = 2**20
    x = cp.random.default_rng(2).random((1, 40, 64, c), dtype=cp.float32).transpose(0, 3, 1, 2)
    out = cufused.group_norm(x, c // 4)
    for group in (0, c // 8, c // 4 - 1):
        part = slice(4 * group, 4 * group + 4)
        assert_close(out[:, part].get(), cufused.group_norm(x[:, part].get(), 1), 1e-5)


def test_nonfinite_weight_rows_past_the_grid(free_memory):
    # 2**25 x 64 rows of one value, past the grid's 65535 blocks a channel: the rows of the
    # channel with an infinite weight are rewritten (the softmax of one value is 1), each
    # block's loop taking 512 or 513 samples, the others kept.
    from cufused._kernels.softmax import softmax_rows_nonfinite_weight

    n, c = 2**25, 64
    x = cp.full((n, 1, 1, 1, 1), 0.75, dtype=cp.float32)
    w = cp.ones((1, c, 1, 1, 1), dtype=cp.float32)
    w[0, 63] = cp.inf
    out = cp.full((n, c, 1, 1, 1), 7.0, dtype=cp.float32)
    softmax_rows_nonfinite_weight(cp, x, w, out, groups=1, stride=(1, 1, 1), padding=(0, 0, 0),
                                  dilation=(1, 1, 1), bias=None, scale=None, clamp=(0.0, 1.0))
    assert bool((out[:, 63] == 1.0).all()) and bool((out[:, :63] == 7.0).all())


@pytest.mark.parametrize("precision, n, k", [("tf32", 2**21, 1024), ("3xtf32", 2**21, 1024),
                                             ("3xtf32", 2**25 + 3, 2)])
def test_conv_transpose3d_rows_past_the_grid(precision, n, k, free_memory):
    # n x k rows of one output (stride 2, padding 1: only the centre tap meets the input),
    # exact in TF32; the last channel's corner tap is infinite and meets no input. In 3xTF32
    # the check after the kernel rewrites that channel's rows: 2**25 + 3 samples pass the
    # grid's 65535 blocks a channel (each block's loop takes 512 or 513).
    from cufused._settings import plan_options

    x = ((cp.arange(n) % 8) + 1).astype(cp.float32).reshape(n, 1, 1, 1, 1)
    w = cp.ones((1, k, 3, 3, 3), dtype=cp.float32)
    centre = ((cp.arange(k) % 16) / 8).astype(cp.float32)
    w[0, :, 1, 1, 1] = centre
    w[0, k - 1, 0, 0, 0] = cp.inf
    with plan_options(engine="igemm"):
        out = cufused.conv_transpose3d(x, w, stride=2, padding=1, precision=precision)
    want = x.reshape(n, 1) * centre
    assert bool((out.reshape(n, k) == want).all())


def test_one_read_softmax_rows_past_the_grid(free_memory):
    # (2**24 + 1) x 16 rows of 32 values with a narrow clamp: more rows than the one-read
    # kernel's clusters of blocks fit in a grid.
    from cufused._kernels.softmax import softmax_rows

    n, c, length = 2**24 + 1, 16, 32
    y = cp.random.default_rng(6).random((n, c, length), dtype=cp.float32)
    ends = [y[:2].get(), y[-2:].get()]
    softmax_rows(cp, y, y, rows=n * c, length=length, channels=c, strides=(c * length, length, 1),
                 clamp=(0.0, 1.0))
    for got, part in zip((y[:2].get(), y[-2:].get()), ends):
        assert_close(got, cufused.softmax(part.astype("float64"), axis=2), 1e-5)


def test_subpixel_interleave_of_a_row_past_2_31(free_memory):
    # Class blocks (4, 1, 1, 2**15, 2**14, 1) into an output row of 2**16 x 2**15 (d, h)
    # pairs.
    from cufused._kernels.layout import interleave_classes

    md, mh = 2**15, 2**14
    classes = cp.random.default_rng(14).random((4, 1, 1, md, mh, 1), dtype=cp.float32)
    out = cp.full((1, 1, 2 * md, 2 * mh, 1), cp.nan, dtype=cp.float32)
    interleave_classes(classes, out)
    by_class = out.reshape(md, 2, mh, 2)
    for rd in (0, 1):
        for rh in (0, 1):
            assert bool((by_class[:, rd, :, rh] == classes[2 * rd + rh, 0, 0, :, :, 0]).all())


@pytest.mark.parametrize("case", ["conv2d", "conv_transpose3d", "max_pool2d", "softmax nhwc",
                                  "pipeline A"])
def test_channels_past_the_grids_y_limit(case, free_memory):
    # More output channels than 65535 tiles of the launches that tile channels on grid.y:
    # the implicit GEMMs leave them to cuDNN, the pool and softmax passes take other kernels.
    from cufused._settings import plan_options
    from cufused._kernels.softmax import softmax_rows

    rng = cp.random.default_rng(9)
    with plan_options(engine="igemm"):
        if case == "conv2d":
            k = 65537 * 64
            w = ((cp.arange(k) % 16) / 8).astype(cp.float32).reshape(k, 1, 1, 1)
            out = cufused.conv2d(cp.full((1, 1, 1, 1), 2.0, cp.float32), w, precision="tf32")
            assert bool((out.ravel() == 2.0 * w.ravel()).all())
        elif case == "conv_transpose3d":
            k = 65537 * 32
            w = cp.ones((1, k, 3, 3, 3), dtype=cp.float32)
            w[0, :, 1, 1, 1] = (cp.arange(k) % 16) / 8
            out = cufused.conv_transpose3d(cp.full((1, 1, 1, 1, 1), 3.0, cp.float32), w,
                                           stride=2, padding=1, precision="tf32")
            assert bool((out.ravel() == 3.0 * w[0, :, 1, 1, 1]).all())
        elif case == "max_pool2d":
            c = 2**21 + 32
            x = rng.random((1, c, 2, 2), dtype=cp.float32)
            out = cp.full((1, 1, 1, c), cp.nan, cp.float32).transpose(0, 3, 1, 2)
            cufused.max_pool2d(x, 2, out=out)
            assert bool((out == x.max(axis=(2, 3), keepdims=True)).all())
        elif case == "softmax nhwc":
            c, s = 2**21 + 32, 4
            y = rng.random((1, s, c), dtype=cp.float32).transpose(0, 2, 1)
            out = cp.full((1, c, s), cp.nan, dtype=cp.float32)
            softmax_rows(cp, y, out, rows=c, length=s, channels=c, strides=(s * c, 1, c),
                         layout="nhwc")
            assert_close(out[:, -3:].get(), cufused.softmax(y[:, -3:].get(), axis=2), 1e-5)
        else:
            k = 65537 * 64
            x = cp.asarray([0.5, 1.0, 1.5, 2.0], dtype=cp.float32).reshape(1, 1, 2, 2)
            w = ((cp.arange(k) % 16) / 8 + 0.5).astype(cp.float32).reshape(k, 1, 1, 1)
            params = [rng.uniform(0.5, 1.5, k, dtype=cp.float32),
                      rng.standard_normal(k, dtype=cp.float32),
                      rng.uniform(0.5, 2.0, k, dtype=cp.float32)]
            options = dict(num_groups=k // 2, pool_kernel=2, clamp_min=-4.0, clamp_max=4.0)
            out = cufused.conv2d_groupnorm_scale_maxpool_clamp(x, w, None, *params, **options,
                                                               precision="tf32")
            part = slice(k - 4, k)
            want = cufused.conv2d_groupnorm_scale_maxpool_clamp(
                x.get(), w[part].get(), None, *(p[part].get() for p in params), **options | {
                    "num_groups": 2})
            assert_close(out[:, part].get(), want, 1e-3)


def test_pool_axis_past_32_bits(free_memory):
    # An axis of 2**31 or more positions is refused by name on the GPU (the kernels' sizes
    # are 32-bit; a stride-0 view allocates nothing); the options' own limit, 2**31 - 1,
    # passes.
    wide = cp.broadcast_to(cp.zeros(1, cp.float32), (1, 1, 1, 2**31 + 2))
    with pytest.raises(ValueError, match="x's spatial sizes must each be below 2\\*\\*31"):
        cufused.max_pool2d(wide, (1, 2))
    x = cp.random.default_rng(3).random((2, 3, 5, 4), dtype=cp.float32)
    got = cufused.max_pool2d(x, 2, stride=2**31 - 1)
    assert (got.get() == cufused.max_pool2d(x.get(), 2, stride=2**31 - 1)).all()


def test_pipeline_c_input_axis_and_channels_past_32_bits():
    # Pipeline C pools x itself: an axis of x of 2**31 or more positions is refused by name
    # (its pooled input and output pass: (1, 1, 1, 1, 2**30 + 1)), as 2**31 or more channels
    # are everywhere on the GPU (stride-0 views allocate nothing).
    wide = cp.broadcast_to(cp.zeros(1, cp.float32), (1, 1, 2, 2, 2**31 + 2))
    with pytest.raises(ValueError, match="x's spatial sizes must each be below 2\\*\\*31"):
        cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
            wide, cp.ones((1, 1, 1, 1, 1), cp.float32), 1.0, stride=1, padding=0,
            output_padding=0, pool_kernel=2, clamp_min=0.0, clamp_max=1.0)
    many = cp.broadcast_to(cp.zeros(1, cp.float32), (1, 2**31, 2, 2))
    for call in (lambda: cufused.max_pool2d(many, 2), lambda: cufused.group_norm(many, 1),
                 lambda: cufused.batch_norm(many)):
        with pytest.raises(ValueError, match="x must have fewer than 2\\*\\*31 channels"):
            call()
    # A convolution output of 2**31 channels, refused by name before any work.
    x = cp.ones((2, 1, 1, 1), cp.float32)
    w = cp.broadcast_to(cp.zeros(1, cp.float32), (2**31, 1, 1, 1))
    wt = cp.broadcast_to(cp.zeros(1, cp.float32), (1, 2**31, 1, 1))
    for call in (lambda: cufused.conv2d(x, w), lambda: cufused.conv_transpose2d(x, wt),
                 lambda: cufused.conv2d_groupnorm_scale_maxpool_clamp(
                     x, w, None, None, None, None, num_groups=1, pool_kernel=1,
                     clamp_min=0.0, clamp_max=1.0),
                 lambda: cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
                     x, wt, None, None, None, None, num_groups=1, pool_kernel=1)):
        with pytest.raises(ValueError, match="output must have fewer than 2\\*\\*31 channels"):
            call()


def test_convolution_axis_past_32_bits(free_memory):
    # A convolution whose input or output has an axis of 2**31 or more positions is refused
    # by name on the GPU, before any work (the kernels' sizes are 32-bit; stride-0 views
    # allocate nothing): a forward one's input, a transposed one's output.
    wide = cp.broadcast_to(cp.zeros(1, cp.float32), (1, 1, 1, 2**31 + 2))
    w = cp.ones((1, 1, 1, 3), cp.float32)
    with pytest.raises(ValueError, match="spatial sizes must each be below 2\\*\\*31"):
        cufused.conv2d(wide, w)
    half = cp.broadcast_to(cp.zeros(1, cp.float32), (1, 1, 1, 2**30 + 1))
    with pytest.raises(ValueError, match="spatial sizes must each be below 2\\*\\*31"):
        cufused.conv_transpose2d(half, cp.ones((1, 1, 1, 2), cp.float32), stride=(1, 2))
