"""Bad input raises TypeError / ValueError naming the argument before any work and any side
effect; NaN and inf inputs raise no NumPy warning; the precision default is process-wide.

Each case runs on NumPy arrays here and, on a GPU machine, on CuPy arrays too (``xp``)."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import cufused

from conftest import GPU

XPS = ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)]


@pytest.fixture(params=XPS)
def xp(request):
    if request.param == "numpy":
        return np
    import cupy

    return cupy


def arrays(xp):
    """Valid arguments for every public function, as ``xp`` float32 arrays."""
    rng = np.random.default_rng(0)

    def a(*shape):
        return xp.asarray(rng.uniform(0.5, 1.5, shape).astype(np.float32))

    return {"x4": a(2, 4, 8, 8), "w": a(8, 4, 3, 3), "wt": a(4, 8, 3, 3), "c8": a(8),
            "x5": a(1, 2, 8, 8, 8), "w5": a(2, 4, 3, 3, 3), "c4": a(4), "c2": a(2)}


def pipeline_a(d, **changes):
    args = dict(x=d["x4"], weight=d["w"], conv_bias=None, gn_weight=d["c8"], gn_bias=None,
                scale=d["c8"])
    opts = dict(num_groups=2, pool_kernel=2, clamp_min=0.0, clamp_max=1.0)
    for k, v in changes.items():
        (args if k in args else opts)[k] = v
    return cufused.conv2d_groupnorm_scale_maxpool_clamp(*args.values(), **opts)


def pipeline_b(d, **changes):
    args = dict(x=d["x4"], weight=d["wt"], bn_weight=d["c8"], bn_bias=None, gn_weight=None,
                gn_bias=None)
    opts = dict(num_groups=2, padding=1)
    for k, v in changes.items():
        (args if k in args else opts)[k] = v
    return cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(*args.values(), **opts)


def pipeline_c(d, **changes):
    args = dict(x=d["x5"], weight=d["w5"], scale=d["c4"])
    opts = dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0,
                clamp_max=1.0)
    for k, v in changes.items():
        (args if k in args else opts)[k] = v
    return cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(*args.values(), **opts)


def _module(d):
    """The array module of the arguments ``d``."""
    if isinstance(d["x4"], np.ndarray):
        return np
    import cupy

    return cupy


def _c_over_its_input(d):
    """Pipeline C with ``out`` and ``x`` in one buffer (out's span covers x's)."""
    xp = _module(d)
    buffer = xp.zeros(4 * 8 * 8 * 8, dtype=xp.float32)
    x = buffer[:d["x5"].size].reshape(d["x5"].shape)
    x[...] = d["x5"]
    return pipeline_c(d, x=x, out=buffer.reshape(1, 4, 8, 8, 8))


CASES = {
    # name: (call(d), exception, fragment of the message)
    "conv x None": (lambda d: cufused.conv2d(None, d["w"]), TypeError, "^x must be"),
    "conv weight None": (lambda d: cufused.conv2d(d["x4"], None), TypeError, "weight"),
    "conv weight str": (lambda d: cufused.conv2d(d["x4"], "w"), TypeError, "weight"),
    "conv stride float": (lambda d: cufused.conv2d(d["x4"], d["w"], stride=1.0), TypeError,
                          "stride"),
    "conv stride None": (lambda d: cufused.conv2d(d["x4"], d["w"], stride=None), TypeError,
                         "stride"),
    "conv padding name": (lambda d: cufused.conv2d(d["x4"], d["w"], padding="full"),
                          ValueError, "padding"),
    "conv padding same strided": (lambda d: cufused.conv2d(d["x4"], d["w"], padding="same",
                                                           stride=2), ValueError, "padding"),
    "transposed conv padding str": (lambda d: cufused.conv_transpose2d(
        d["x4"], d["wt"], padding="same"), TypeError, "padding"),
    "conv groups float": (lambda d: cufused.conv2d(d["x4"], d["w"], groups=1.0), TypeError,
                          "groups"),
    "conv huge padding": (lambda d: cufused.conv2d(d["x4"], d["w"], padding=2**40), ValueError,
                          "padding must be at most 2147483647"),
    "pool huge stride": (lambda d: cufused.max_pool2d(d["x4"], 2, stride=2**40), ValueError,
                         "stride must be at most 2147483647"),
    "conv padding past memory": (
        lambda d: cufused.conv2d(d["x4"], d["w"], padding=2**31 - 1), ValueError,
        r"memory \(from x, weight, stride \(1, 1\), padding \(2147483647, 2147483647\)"),
    "conv huge output": (lambda d: cufused.conv_transpose2d(d["x4"], d["wt"], stride=2**30),
                         ValueError, "memory"),
    "transposed conv output cropped away": (lambda d: cufused.conv_transpose2d(
        d["x4"], d["wt"], padding=100), ValueError, r"padding \(100, 100\) crops its"),
    "pool kernel None": (lambda d: cufused.max_pool2d(d["x4"], None), TypeError, "kernel_size"),
    "pool kernel float": (lambda d: cufused.max_pool2d(d["x4"], 2.0), TypeError, "kernel_size"),
    "pool stride float": (lambda d: cufused.avg_pool2d(d["x4"], 2, 1.5), TypeError, "stride"),
    "pool x None": (lambda d: cufused.max_pool2d(None, 2), TypeError, "^x must be"),
    "avg_pool3d window over unpadded input": (
        lambda d: cufused.avg_pool3d(d["x5"][:, :, :1], 2, padding=1), ValueError, "larger"),
    "group_norm one value per group": (
        lambda d: cufused.group_norm(d["x4"][:1, :, :1, :1], 4), ValueError, "more than 1"),
    "group_norm weight complex": (
        lambda d: cufused.group_norm(d["x4"], 2, 1j), TypeError, "weight"),
    "group_norm 1-d x": (lambda d: cufused.group_norm(d["c8"], 2), ValueError,
                         "x must have at least 2 dimensions"),
    "batch_norm 1-d x": (lambda d: cufused.batch_norm(d["c8"]), ValueError,
                         "x must have at least 2 dimensions"),
    "batch_norm training str": (
        lambda d: cufused.batch_norm(d["x4"], training="yes"), TypeError, "training"),
    "batch_norm training None": (
        lambda d: cufused.batch_norm(d["x4"], training=None), TypeError, "training"),
    "softmax x None": (lambda d: cufused.softmax(None), TypeError, "^x must be"),
    "A x None": (lambda d: pipeline_a(d, x=None), TypeError, "^x must be"),
    "A scale str": (lambda d: pipeline_a(d, scale="2"), TypeError, "scale"),
    "A scale complex": (lambda d: pipeline_a(d, scale=2j), TypeError, "scale"),
    "A gn_weight str": (lambda d: pipeline_a(d, gn_weight="w"), TypeError, "gn_weight"),
    "A clamp_min str": (lambda d: pipeline_a(d, clamp_min="0"), TypeError, "clamp_min"),
    "A clamp_max complex": (lambda d: pipeline_a(d, clamp_max=1j), TypeError, "clamp_max"),
    "A pool_kernel float": (lambda d: pipeline_a(d, pool_kernel=2.0), TypeError, "pool_kernel"),
    "A pool_kernel None": (lambda d: pipeline_a(d, pool_kernel=None), TypeError,
                           "pool_kernel"),
    "A stride None": (lambda d: pipeline_a(d, stride=None), TypeError, "stride"),
    "B weight None": (lambda d: pipeline_b(d, weight=None), TypeError, "weight"),
    "B stride float": (lambda d: pipeline_b(d, stride=1.0), TypeError, "stride"),
    "B momentum str": (lambda d: pipeline_b(d, momentum="0.1"), TypeError, "momentum"),
    "C scale str": (lambda d: pipeline_c(d, scale="1"), TypeError, "scale"),
    "C pool_kernel float": (lambda d: pipeline_c(d, pool_kernel=2.5), TypeError, "pool_kernel"),
    "C pool window over input": (lambda d: pipeline_c(d, x=d["x5"][:, :, :1]), ValueError,
                                 "larger"),
    # PyTorch's GroupNorm and BatchNorm rules inside the pipelines
    "A one value per group of the conv output": (
        lambda d: pipeline_a(d, x=d["x4"][:1, :, :3, :3], num_groups=8, pool_kernel=1,
                             gn_weight=None, scale=None),
        ValueError, "more than 1 value per group"),
    "B one value per group of the pooled output": (
        lambda d: pipeline_b(d, x=d["x4"][:1, :, :1, :1], num_groups=8, padding=0,
                             weight=d["wt"][:, :, :2, :2]), ValueError,
        "more than 1 value per group"),
    "batch_norm running_mean without running_var": (
        lambda d: cufused.batch_norm(d["x4"], running_mean=d["c4"].copy()), ValueError,
        "running_mean and running_var"),
    "B running_var without running_mean": (
        lambda d: pipeline_b(d, running_var=d["c8"].copy()), ValueError,
        "running_mean and running_var"),
    # PyTorch's BatchNorm takes eps > 0 in training (>= 0 in inference); B's is BatchNorm's
    "batch_norm eps 0 in training": (lambda d: cufused.batch_norm(d["x4"], eps=0.0),
                                     ValueError, "eps must be > 0"),
    "B eps 0": (lambda d: pipeline_b(d, eps=0.0), ValueError, "eps must be > 0"),
    "batch_norm eps < 0 in inference": (
        lambda d: cufused.batch_norm(d["x4"], running_mean=d["c4"], running_var=d["c4"],
                                     training=False, eps=-1e-5), ValueError, "eps must be >= 0"),
    "C conv of the pooled x empty": (lambda d: pipeline_c(d, padding=5), ValueError,
                                     "convolution output of the pooled x"),
    # out: exactly the result's shape and dtype, and no memory of an input
    "C out float64": (lambda d: pipeline_c(d, out=_module(d).empty((1, 4, 8, 8, 8))),
                      ValueError, r"^out must have shape \(1, 4, 8, 8, 8\) and dtype float32"),
    "C out with a leading axis": (
        lambda d: pipeline_c(d, out=_module(d).empty((1, 1, 4, 8, 8, 8), np.float32)),
        ValueError, r"^out must have shape \(1, 4, 8, 8, 8\)"),
    "C out over x": (_c_over_its_input, ValueError, "^out overlaps the memory of x"),
    # Per-channel parameters hold one value per channel (one for all is scale's alone)
    "A conv_bias of C - 1 values": (lambda d: pipeline_a(d, conv_bias=d["c8"][:7]),
                                    ValueError, "^conv_bias must hold one value per channel"),
    "A conv_bias of one value": (lambda d: pipeline_a(d, conv_bias=d["c8"][:1]), ValueError,
                                 "^conv_bias must hold one value per channel"),
    "B conv_bias of C - 1 values": (lambda d: pipeline_b(d, conv_bias=d["c8"][:7]),
                                    ValueError, "^conv_bias must hold one value per channel"),
    "B gn_weight of C / 2 values": (lambda d: pipeline_b(d, gn_weight=d["c4"]), ValueError,
                                    "^gn_weight must hold one value per channel"),
    "C conv_bias of one value": (lambda d: pipeline_c(d, conv_bias=d["c4"][:1]), ValueError,
                                 "^conv_bias must hold one value per channel"),
    "batch_norm running buffers of C / 2 values": (
        lambda d: cufused.batch_norm(d["x4"], running_mean=d["c2"].copy(),
                                     running_var=d["c2"].copy()),
        ValueError, "^running_mean must hold one value per channel"),
    "batch_norm running buffers of C / 2 values in inference": (
        lambda d: cufused.batch_norm(d["x4"], running_mean=d["c2"].copy(),
                                     running_var=d["c2"].copy(), training=False),
        ValueError, "^running_mean must hold one value per channel"),
    "softmax axis below -ndim": (lambda d: cufused.softmax(d["x4"], axis=-5), ValueError,
                                 "axis -5 is out of bounds"),
    # A scale broadcasts against (N, C, H, W) as in y * scale: C values off the channel axis
    "A scale (C, 1)": (lambda d: pipeline_a(d, scale=d["c8"].reshape(8, 1)), ValueError,
                       "scale"),
    "A scale (1, 1, 1, C)": (lambda d: pipeline_a(d, scale=d["c8"].reshape(1, 1, 1, 8)),
                             ValueError, "scale"),
    "C scale (C, 1)": (lambda d: pipeline_c(d, scale=d["c4"].reshape(4, 1)), ValueError,
                       "scale"),
    # The message's example has the pipeline's own ndim.
    "C scale (1, 1, C, 1, 1)": (lambda d: pipeline_c(d, scale=d["c4"].reshape(1, 1, 4, 1, 1)),
                                ValueError, r"^scale must .* or \(1, 4, 1, 1, 1\)"),
}


def test_out_may_not_alias_a_parameter_in_any_layout(xp):
    # out is checked against the parameters as passed, before a strided or broadcast one is
    # copied: an out that shares memory with one is refused, untouched.
    d = arrays(xp)
    out = xp.full((2, 8, 6, 6), np.nan, dtype=xp.float32)
    with pytest.raises(ValueError, match="^out overlaps the memory of bias"):
        cufused.conv2d(d["x4"], d["w"], out[0, :, 0, 0], out=out)
    x = d["x4"].copy()
    with pytest.raises(ValueError, match="^out overlaps the memory of weight"):
        cufused.batch_norm(x, x[0, :, 0, 0], out=x)
    assert bool(xp.isnan(out).all()) and bool((x == d["x4"]).all())


@pytest.mark.parametrize("out_shape", [(2, 8, 5, 5), (2, 8, 4)])
def test_pipeline_b_refuses_a_bad_out_before_updating_its_buffers(xp, out_shape):
    # The running buffers are a side effect: a call refused for its out leaves them as given.
    d = arrays(xp)
    rm, rv = xp.zeros(8, xp.float32), xp.ones(8, xp.float32)
    out = xp.full(out_shape, np.nan, dtype=xp.float32)
    with pytest.raises(ValueError, match=r"^out must have shape \(2, 8, 4, 4\)"):
        pipeline_b(d, running_mean=rm, running_var=rv, out=out)
    assert bool((rm == 0).all()) and bool((rv == 1).all()) and bool(xp.isnan(out).all())
    pipeline_b(d, running_mean=rm, running_var=rv)  # the same call with no out updates them
    assert not bool((rm == 0).all())


@pytest.mark.parametrize("shape", [(1,), (1, 1, 1), (1, 1, 1, 1)])
def test_one_channel_running_buffers_update_in_place(xp, shape):
    # With one channel, a running buffer of any per-channel shape is updated through a view.
    x = xp.asarray(np.random.default_rng(0).random((4, 1, 3, 3)), dtype=xp.float32)
    rm, rv = xp.zeros(shape, xp.float32), xp.ones(shape, xp.float32)
    cufused.batch_norm(x, running_mean=rm, running_var=rv)
    mean, var = float(x.mean()), float(x.var()) * 36 / 35
    np.testing.assert_allclose(float(rm.ravel()[0]), 0.1 * mean, rtol=1e-5)
    np.testing.assert_allclose(float(rv.ravel()[0]), 0.9 + 0.1 * var, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises(xp, case):
    call, exc, fragment = CASES[case]
    with pytest.raises(exc, match=fragment):
        call(arrays(xp))


def test_reference_refuses_a_padded_input_beyond_memory():
    # The reference materializes the padded input; cuDNN does not need to.
    d = arrays(np)
    with pytest.raises(ValueError, match="padded input"):
        cufused.conv2d(d["x4"], d["w"], padding=2**30, stride=2**30)


@pytest.mark.parametrize("name", ["softmax", "group_norm", "batch_norm"])
def test_normalizations_refuse_a_result_beyond_memory(xp, name):
    # A broadcast view holds no memory; its result would take 2**52 values.
    x = xp.broadcast_to(xp.asarray(1.0, dtype=xp.float32), (2**36, 2, 2**16))
    args = {"softmax": (-1,), "group_norm": (2,), "batch_norm": ()}[name]
    with pytest.raises(ValueError, match="the result would have shape"):
        getattr(cufused, name)(x, *args)


def test_read_only_out_and_buffers_raise_before_side_effects():
    d = arrays(np)
    out = np.empty((2, 8, 3, 3), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        pipeline_a(d, out=out)
    rm, rv = np.zeros(8, np.float32), np.ones(8, np.float32)
    rv.flags.writeable = False
    with pytest.raises(ValueError, match="running_var is read-only"):
        pipeline_b(d, running_mean=rm, running_var=rv)
    assert (rm == 0).all()  # raised before the running mean was touched
    with pytest.raises(ValueError, match="running_var is read-only"):
        cufused.batch_norm(d["x4"][:, :2].reshape(2, 8, 4, 4), running_mean=rm,
                           running_var=rv)
    assert (rm == 0).all()


def test_inference_reads_running_buffers_it_does_not_update(xp):
    # As PyTorch: in inference the running statistics are only read, so a read-only or
    # strided buffer serves (training needs them contiguous and writeable).
    d = arrays(xp)
    x = d["x4"]
    rm, rv = xp.zeros(8, xp.float32), xp.ones(8, xp.float32)
    rm[::2], rv[::2] = d["c4"], 2 * d["c4"]
    if xp is np:
        rm.flags.writeable = rv.flags.writeable = False
    got = cufused.batch_norm(x, running_mean=rm[::2], running_var=rv[::2], training=False)
    want = cufused.batch_norm(x, running_mean=rm[::2].copy(), running_var=rv[::2].copy(),
                              training=False)
    np.testing.assert_array_equal(_host(got), _host(want))
    expected = (_host(x) - _host(rm[::2])[:, None, None]) / np.sqrt(
        _host(rv[::2])[:, None, None] + 1e-5)
    np.testing.assert_allclose(_host(got), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="running_mean must be contiguous"):
        cufused.batch_norm(x, running_mean=rm[::2], running_var=rv[::2].copy())


def test_out_whose_elements_share_memory_raises():
    # NumPy's out may be any strided view (the GPU's must be C-contiguous), but not one
    # whose elements overlap: a later value would overwrite an earlier one.
    from numpy.lib.stride_tricks import as_strided

    x = np.random.default_rng(1).random((2, 3, 4))
    base = np.zeros(64)
    for strides in [(0, 32, 8), (96, 32, 4), (8, 8, 8)]:  # broadcast, byte overlap, diagonal
        out = as_strided(base, shape=x.shape, strides=strides)
        with pytest.raises(ValueError, match="out has elements that share memory"):
            cufused.softmax(x, out=out)
    assert (base == 0).all()
    # Interleaved strides whose elements are distinct, and a transposed out, are fine.
    y = np.random.default_rng(2).random((3, 2))
    out = as_strided(np.zeros(10), shape=(3, 2), strides=(16, 24))
    np.testing.assert_allclose(cufused.softmax(y, out=out), cufused.softmax(y))
    out = np.zeros((4, 3, 2)).T
    np.testing.assert_allclose(cufused.softmax(x, out=out), cufused.softmax(x))


def test_out_checks_past_their_work_limits(monkeypatch):
    # An irregular out too large to compare element by element is refused; where NumPy cannot
    # tell within its work limit whether out and an input share an element, they are taken to.
    from numpy.lib.stride_tricks import as_strided

    from cufused import _arrays

    y = np.random.default_rng(6).random((3, 2))
    monkeypatch.setattr(_arrays, "_OVERLAP_CHECK_ELEMENTS", 4)
    with pytest.raises(ValueError, match="too large to check"):
        cufused.softmax(y, out=as_strided(np.zeros(10), shape=(3, 2), strides=(16, 24)))

    def too_hard(a, b, max_work=None):
        raise np.exceptions.TooHardError("work limit")

    monkeypatch.setattr(np, "shares_memory", too_hard)
    buf = np.random.default_rng(7).random((2, 3, 8))
    with pytest.raises(ValueError, match="out overlaps the memory of x"):
        cufused.softmax(buf[..., ::2], out=buf[..., 1::2])


def test_numpy_out_interleaved_with_an_input_is_written():
    # NumPy views that interleave share no element (PyTorch accepts them too); the reference
    # computes the result before writing it into out.
    buf = np.random.default_rng(3).random((2, 3, 8))
    x, out = buf[..., ::2], buf[..., 1::2]
    want = cufused.softmax(x.copy())
    np.testing.assert_array_equal(cufused.softmax(x, out=out), want)
    np.testing.assert_array_equal(buf[..., 1::2], want)
    w = np.random.default_rng(4).random((3, 2, 3, 3))
    both = np.zeros((2 * w.size,))
    both[::2] = w.ravel()
    xc = np.random.default_rng(5).random((1, 2, 5, 5))
    want = cufused.conv2d(xc, w)
    out = both[1::2][: want.size].reshape(want.shape)
    np.testing.assert_array_equal(cufused.conv2d(xc, both[::2].reshape(w.shape), out=out), want)


def test_out_overlapping_an_input_raises(xp):
    d = arrays(xp)
    x = d["x4"]
    # Partial overlap: never allowed.
    big = xp.zeros((2 * x.size,), dtype=xp.float32)
    a, b = big[: x.size].reshape(x.shape), big[x.size // 2: x.size // 2 + x.size].reshape(x.shape)
    a[...] = x
    with pytest.raises(ValueError, match="overlaps the memory of x"):
        cufused.group_norm(a, 2, out=b)
    with pytest.raises(ValueError, match="overlaps the memory of x"):
        cufused.softmax(a, axis=1, out=b)
    # Exact aliasing: in place where documented (group_norm, batch_norm, softmax) ...
    ref = cufused.group_norm(x, 2)
    y = x.copy()
    assert cufused.group_norm(y, 2, out=y) is y
    np.testing.assert_allclose(_host(y), _host(ref), rtol=1e-5, atol=1e-6)
    y = x.copy()
    assert cufused.softmax(y, axis=(2, 3), out=y) is y
    np.testing.assert_allclose(_host(y), _host(cufused.softmax(x, axis=(2, 3))), rtol=1e-5)
    # ... and never for ops whose output is read while written (pooling, convolutions).
    flat = xp.zeros(x.size, dtype=xp.float32)
    with pytest.raises(ValueError, match="overlaps the memory of x"):
        cufused.max_pool2d(flat.reshape(x.shape), 2, out=flat[: x.size // 4].reshape(2, 4, 4, 4))
    # The weight in the first half of one allocation, out starting inside it.
    w = d["w"]
    size = 2 * 8 * 6 * 6
    pool = xp.zeros(w.size + size, dtype=xp.float32)
    pool[: w.size] = w.ravel()
    with pytest.raises(ValueError, match="overlaps the memory of weight"):
        cufused.conv2d(x, pool[: w.size].reshape(w.shape),
                       out=pool[w.size // 2: w.size // 2 + size].reshape(2, 8, 6, 6))


def _host(a):
    return a.get() if hasattr(a, "get") else a


def test_scale_none_means_no_scaling(xp):
    d = arrays(xp)
    ones = xp.ones(8, dtype=xp.float32)
    got = pipeline_a(d, scale=None)
    assert not np.isnan(_host(got)).any()
    np.testing.assert_allclose(_host(got), _host(pipeline_a(d, scale=ones)), rtol=1e-6)
    got = pipeline_c(d, scale=None)
    np.testing.assert_allclose(_host(got), _host(pipeline_c(d, scale=xp.ones(4, xp.float32))),
                               rtol=1e-6)


def test_zero_dim_scale_broadcasts(xp):
    d = arrays(xp)
    got = pipeline_a(d, scale=xp.asarray(np.float32(0.5)))
    want = pipeline_a(d, scale=xp.full(8, 0.5, dtype=xp.float32))
    np.testing.assert_allclose(_host(got), _host(want), rtol=1e-6)
    got = pipeline_c(d, scale=xp.asarray(np.float32(3.0)))
    want = pipeline_c(d, scale=3.0)
    np.testing.assert_allclose(_host(got), _host(want), rtol=1e-6)


def test_scale_of_one_value_broadcasts(xp):
    # As y * scale in PyTorch: an array of one value, any ndim up to the output's.
    d = arrays(xp)
    want = pipeline_a(d, scale=0.5)
    for shape in ((1,), (1, 1, 1), (1, 1, 1, 1)):
        got = pipeline_a(d, scale=xp.full(shape, 0.5, dtype=xp.float32))
        np.testing.assert_allclose(_host(got), _host(want), rtol=1e-6)
    got = pipeline_c(d, scale=xp.full((1, 1, 1, 1, 1), 3.0, dtype=xp.float32))
    np.testing.assert_allclose(_host(got), _host(pipeline_c(d, scale=3.0)), rtol=1e-6)


def test_scale_on_the_channel_axis_is_per_channel(xp):
    # The C values on the channel axis of y * scale, or in any of the layouts per channel
    # that every parameter takes ((C,), (C, 1, 1), (1, C, 1, 1), (1, C, 1, 1, 1)).
    d = arrays(xp)
    want = pipeline_a(d, scale=d["c8"])
    for shape in ((8, 1, 1), (1, 8, 1, 1), (1, 8, 1, 1, 1)):
        got = pipeline_a(d, scale=d["c8"].reshape(shape))
        np.testing.assert_allclose(_host(got), _host(want), rtol=1e-6)
    want = pipeline_c(d, scale=d["c4"])
    for shape in ((4, 1, 1), (1, 4, 1, 1), (4, 1, 1, 1), (1, 4, 1, 1, 1)):
        got = pipeline_c(d, scale=d["c4"].reshape(shape))
        np.testing.assert_allclose(_host(got), _host(want), rtol=1e-6)


def test_one_value_option_stands_for_every_dimension(xp):
    # PyTorch reads stride=(2,) as (2, 2) and a pool's stride=() as its window. Both
    # spellings of a convolution run directly: the second call with a key would replay a
    # graph, which may sum in another order than a direct call (float32 rounding).
    from cufused._settings import plan_options

    d = arrays(xp)
    with plan_options(replay=False):
        for fn, w in ((cufused.conv2d, d["w"]), (cufused.conv_transpose2d, d["wt"])):
            got = fn(d["x4"], w, stride=(2,), padding=[1], dilation=(1,))
            want = fn(d["x4"], w, stride=2, padding=1)
            np.testing.assert_array_equal(_host(got), _host(want))
    np.testing.assert_array_equal(_host(cufused.max_pool2d(d["x4"], (3,), ())),
                                  _host(cufused.max_pool2d(d["x4"], 3)))
    np.testing.assert_array_equal(_host(cufused.avg_pool3d(d["x5"], [2], [2], (0,))),
                                  _host(cufused.avg_pool3d(d["x5"], 2)))


def test_reference_path_raises_no_warnings():
    d = arrays(np)
    x = d["x4"].copy()
    x[0, 0, 0, 0], x[1, 1, 2, 2], x[1, 2, 3, 3] = np.nan, np.inf, -np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipeline_a(d, x=x)
        pipeline_b(d, x=x)
        cufused.group_norm(x, 2)
        cufused.batch_norm(x, activation="tanh")
        cufused.softmax(x, axis=(2, 3))
        cufused.max_pool2d(x, 2)
        cufused.conv2d(x, d["w"])
        x5 = d["x5"].copy()
        x5[0, 0, 0, 0, 0] = np.inf
        pipeline_c(d, x=x5)
        pipeline_a(d, scale=np.full(8, np.inf, np.float32))
        # A number past float64's range (a long double) is an infinite scale, cast quietly.
        got = pipeline_c(d, scale=np.longdouble("1e400"))
    assert got.dtype == np.float32 and np.isposinf(got).any()


def test_default_precision_is_process_wide_and_the_block_scoped():
    seen = {}

    def read(key):
        seen[key] = cufused.get_default_precision()

    cufused.set_default_precision("tf32")
    try:
        t = threading.Thread(target=read, args=("setter",))
        t.start()
        t.join()
        with cufused.default_precision("ieee"):
            assert cufused.get_default_precision() == "ieee"
            t = threading.Thread(target=read, args=("other thread in a block",))
            t.start()
            t.join()
        assert cufused.get_default_precision() == "tf32"
    finally:
        cufused.set_default_precision("ieee")
    assert seen == {"setter": "tf32", "other thread in a block": "tf32"}
    with pytest.raises(ValueError, match="precision"):
        cufused.set_default_precision("fp8")
    cufused.set_default_precision(np.str_("tf32"))  # a str subclass; a str comes back
    try:
        assert type(cufused.get_default_precision()) is str
    finally:
        cufused.set_default_precision("ieee")


@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.gpu
def test_bad_input_does_no_gpu_work():
    # A call that fails validation leaves the running buffers and out untouched and
    # queues nothing: checked by the buffers' contents after a synchronize.
    import cupy

    d = arrays(cupy)
    rm, rv = cupy.zeros(8, cupy.float32), cupy.ones(8, cupy.float32)
    out = cupy.full((2, 8, 5, 5), cupy.nan, cupy.float32)
    with pytest.raises(TypeError, match="momentum"):
        pipeline_b(d, running_mean=rm, running_var=rv, out=out, momentum="x")
    cupy.cuda.get_current_stream().synchronize()
    assert (rm == 0).all() and (rv == 1).all() and cupy.isnan(out).all()


@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.gpu
def test_gpu_out_must_be_c_contiguous():
    # The kernels write out densely: a strided out of the right shape is refused, untouched;
    # the convolutions also take a packed channels-last out, the other functions do not.
    import cupy

    d = arrays(cupy)
    base = cupy.full((2, 8, 6, 12), cupy.nan, cupy.float32)
    with pytest.raises(ValueError, match="out must be C-contiguous or packed channels-last"):
        cufused.conv2d(d["x4"], d["w"], out=base[..., ::2])
    with pytest.raises(ValueError, match="out must be C-contiguous or packed channels-last"):
        cufused.conv2d(d["x4"], d["w"], out=base.transpose(0, 1, 3, 2)[:, :, :6, :6])
    assert bool(cupy.isnan(base).all())
    channels_last = cupy.empty((2, 8, 8, 4), cupy.float32).transpose(0, 3, 1, 2)
    with pytest.raises(ValueError, match="out must be C-contiguous$"):
        cufused.softmax(d["x4"], axis=1, out=channels_last)
    with pytest.raises(ValueError, match="out must be C-contiguous$"):
        cufused.softmax(d["x4"], axis=1, out=cupy.empty((2, 4, 8, 16), cupy.float32)[..., ::2])
    y = cufused.conv2d(d["x4"], d["w"])
    out = cupy.empty((2, 6, 6, 8), cupy.float32).transpose(0, 3, 1, 2)
    assert cufused.conv2d(d["x4"], d["w"], out=out) is out
    assert bool(cupy.allclose(out, y, rtol=1e-6, atol=1e-6))


def raises_without_allocating(call, name: str) -> None:
    """``call()`` raises a TypeError or ValueError whose message starts with ``name``, and
    allocates no device memory before it does."""
    import cupy

    allocations = []
    pool = cupy.get_default_memory_pool()

    def counting(size):
        allocations.append(size)
        return pool.malloc(size)

    with cupy.cuda.using_allocator(counting), pytest.raises((TypeError, ValueError),
                                                             match=f"^{name} "):
        call()
    assert allocations == []


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.parametrize("pipeline", [pipeline_a, pipeline_c])
@pytest.mark.parametrize("bad", ["clamp_min", "out"])
def test_bad_option_after_a_number_for_scale_allocates_nothing(pipeline, bad):
    # A number for scale becomes a device array only once every other argument, out
    # included, passed.
    import cupy

    d = arrays(cupy)
    change = {"clamp_min": "low"} if bad == "clamp_min" else {"out": cupy.empty(1, cupy.float32)}
    raises_without_allocating(lambda: pipeline(d, scale=2.0, **change), bad)


STRIDED_PARAMETER_CASES = {
    # name: (call(d, strided per-channel parameter), the bad option's name)
    "conv2d bias, precision": (lambda d, p: cufused.conv2d(d["x4"], d["w"], p,
                                                           precision="fp16"), "precision"),
    "group_norm weight, eps": (lambda d, p: cufused.group_norm(d["x4"], 2, p[:4], eps=-1.0),
                               "eps"),
    "batch_norm weight, momentum": (lambda d, p: cufused.batch_norm(d["x4"], p[:4],
                                                                    momentum=np.inf), "momentum"),
    "batch_norm bias, activation": (lambda d, p: cufused.batch_norm(d["x4"], None, p[:4],
                                                                    activation="relu"),
                                    "activation"),
    "B bn_weight, eps": (lambda d, p: pipeline_b(d, bn_weight=p, eps=-1.0), "eps"),
    "B gn_bias, method": (lambda d, p: pipeline_b(d, gn_bias=p, method="fast"), "method"),
    # A bad parameter, running buffer or out after a good strided parameter: every parameter
    # and out are checked before the first is copied.
    "conv2d bias, out": (lambda d, p: cufused.conv2d(d["x4"], d["w"], p, out=d["out1"]),
                         "out"),
    "group_norm weight, bias": (lambda d, p: cufused.group_norm(d["x4"], 2, p[:4], d["c8"]),
                                "bias"),
    "batch_norm weight, strided running_mean": (
        lambda d, p: cufused.batch_norm(d["x4"], p[:4], running_mean=p[:4],
                                        running_var=d["c4"]), "running_mean"),
    "batch_norm weight, out": (lambda d, p: cufused.batch_norm(d["x4"], p[:4], out=d["out1"]),
                               "out"),
    "A gn_weight, int scale": (lambda d, p: pipeline_a(d, gn_weight=p, scale=d["int1"]),
                               "scale"),
    "A gn_weight, out": (lambda d, p: pipeline_a(d, gn_weight=p, out=d["out1"]), "out"),
    "B bn_weight, gn_weight": (lambda d, p: pipeline_b(d, bn_weight=p, gn_weight=d["c4"]),
                               "gn_weight"),
    "B conv_bias, strided running_mean": (
        lambda d, p: pipeline_b(d, conv_bias=p, running_mean=p, running_var=d["c8"]),
        "running_mean"),
    "B bn_weight, out": (lambda d, p: pipeline_b(d, bn_weight=p, out=d["out1"]), "out"),
    "C conv_bias, out": (lambda d, p: pipeline_c(d, scale=d["c4"], conv_bias=p[:4],
                                                 out=d["out1"]), "out"),
}


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device with CuPy")
@pytest.mark.parametrize("case", list(STRIDED_PARAMETER_CASES))
def test_bad_option_after_a_strided_parameter_allocates_nothing(case):
    # A strided per-channel parameter is copied to a contiguous device array only once every
    # option passed.
    import cupy

    d = arrays(cupy)
    d["out1"], d["int1"] = cupy.empty(1, cupy.float32), cupy.ones(1, cupy.int32)
    strided = cupy.repeat(d["c8"], 2)[::2]  # 8 values, stride 2
    call, option = STRIDED_PARAMETER_CASES[case]
    raises_without_allocating(lambda: call(d, strided), option)
