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
    from cufused._cudnn import plan_options

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
    from cufused._cudnn import plan_options

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
