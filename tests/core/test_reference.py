"""The float64 NumPy reference against PyTorch CPU (float64), the independent oracle."""

from __future__ import annotations

import numpy as np
import pytest

import cufused

from conftest import assert_close, mixed, rel_err

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # collected and skipped as oracle tests (see conftest.py)
    torch = F = None

pytestmark = pytest.mark.oracle
TOL = 1e-10


def t(a):
    return None if a is None else torch.from_numpy(np.asarray(a, dtype=np.float64))


# ------------------------------------------------------------------------------ convolutions

# (function name, x shape, weight shape, options); every case also gets a bias.
CONV_CASES = [
    ("conv2d", (2, 3, 9, 11), (4, 3, 3, 3), {}),
    ("conv2d", (1, 1, 5, 5), (1, 1, 1, 1), {}),
    ("conv2d", (3, 4, 13, 7), (6, 2, 3, 2), dict(groups=2, stride=(2, 1), padding=(1, 0))),
    ("conv2d", (2, 6, 17, 19), (9, 2, 5, 3), dict(groups=3, dilation=(2, 1), padding=2)),
    ("conv2d", (1, 5, 8, 8), (5, 1, 3, 3), dict(groups=5, stride=3, padding=1)),
    ("conv2d", (4, 2, 7, 11), (3, 2, 7, 11), {}),
    ("conv2d", (2, 3, 31, 29), (7, 3, 4, 4), dict(stride=2, padding=3, dilation=2)),
    ("conv3d", (2, 3, 5, 6, 7), (4, 3, 3, 3, 3), {}),
    ("conv3d", (1, 4, 7, 5, 6), (6, 2, 2, 3, 1),
     dict(groups=2, stride=(1, 2, 1), padding=(1, 0, 1))),
    ("conv3d", (2, 2, 9, 9, 9), (3, 2, 3, 3, 3), dict(dilation=2, stride=2)),
    ("conv2d", (2, 3, 8, 9), (4, 3, 3, 5), dict(padding="same")),
    ("conv2d", (2, 3, 8, 9), (4, 3, 2, 5), dict(padding="same", dilation=(2, 1))),
    ("conv2d", (1, 2, 6, 7), (3, 2, 3, 4), dict(padding="valid", stride=2)),
    ("conv3d", (1, 2, 5, 6, 7), (3, 2, 3, 1, 5), dict(padding="same")),
    # An odd dilation * (k - 1): PyTorch puts the extra zero after the input.
    ("conv2d", (2, 3, 8, 9), (4, 3, 2, 4), dict(padding="same")),
    ("conv2d", (1, 4, 7, 6), (2, 2, 3, 2), dict(padding="same", dilation=(1, 3), groups=2)),
    ("conv3d", (1, 2, 5, 6, 4), (3, 2, 2, 3, 4), dict(padding="same", dilation=(3, 1, 1))),
    ("conv_transpose2d", (2, 3, 5, 7), (3, 4, 3, 3), {}),
    ("conv_transpose2d", (2, 4, 8, 8), (4, 8, 5, 5), dict(stride=1, padding=1)),
    ("conv_transpose2d", (2, 4, 6, 5), (4, 3, 3, 4),
     dict(stride=(2, 3), padding=(1, 0), output_padding=(1, 2))),
    ("conv_transpose2d", (1, 6, 4, 4), (6, 2, 3, 3), dict(groups=3, stride=2, output_padding=1)),
    ("conv_transpose2d", (3, 2, 7, 3), (2, 5, 2, 2), dict(stride=2, dilation=3, output_padding=2)),
    ("conv_transpose2d", (1, 1, 1, 1), (1, 1, 1, 1), {}),
    ("conv_transpose2d", (2, 3, 5, 6), (3, 2, 5, 5), dict(padding=2, dilation=(1, 2))),
    ("conv_transpose3d", (2, 3, 3, 4, 5), (3, 4, 3, 3, 3),
     dict(stride=2, padding=1, output_padding=1)),
    ("conv_transpose3d", (1, 4, 2, 3, 2), (4, 2, 2, 3, 2),
     dict(groups=2, stride=(1, 2, 3), output_padding=(0, 1, 2))),
    ("conv_transpose3d", (2, 2, 3, 3, 3), (2, 3, 3, 3, 3), dict(dilation=2, padding=2)),
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("name,xs,ws,opts", CONV_CASES)
def test_convolutions(rng, name, xs, ws, opts):
    out_channels = ws[1] * opts.get("groups", 1) if "transpose" in name else ws[0]
    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(out_channels)
    got = getattr(cufused, name)(x, w, b, **opts)
    ref = getattr(F, name)(t(x), t(w), t(b), **opts).numpy()
    assert rel_err(got, ref) < TOL


@pytest.mark.parametrize("name, x_shape, w_shape, opts", [
    ("conv2d", (3, 9, 8), (4, 3, 3, 2), dict(padding=1, stride=(2, 1))),
    ("conv3d", (2, 5, 6, 4), (3, 2, 2, 3, 2), dict(dilation=(1, 2, 1))),
    ("conv_transpose2d", (3, 5, 4), (3, 2, 3, 3), dict(stride=2, output_padding=1)),
    ("conv_transpose3d", (2, 3, 4, 3), (2, 4, 3, 3, 3), dict(stride=2, padding=1)),
    ("max_pool2d", (3, 9, 8), None, dict(kernel_size=3, stride=2, padding=1)),
    ("avg_pool3d", (2, 5, 6, 4), None, dict(kernel_size=2, padding=1)),
])
def test_unbatched_input_as_pytorch(rng, name, x_shape, w_shape, opts):
    # Without its batch axis, as PyTorch's convolutions and pools take it: the result has none
    # either, and is out where given.
    x = rng.standard_normal(x_shape)
    args = (x,) if w_shape is None else (x, rng.standard_normal(w_shape))
    want = getattr(F, name)(*map(t, args), **opts).numpy()
    got = getattr(cufused, name)(*args, **opts)
    assert got.shape == want.shape and rel_err(got, want) < TOL
    out = np.full(want.shape, np.nan)
    assert getattr(cufused, name)(*args, **opts, out=out) is out
    assert rel_err(out, want) < TOL


# ---------------------------------------------------------------------------- normalization


@pytest.mark.parametrize("shape,groups", [((2, 6, 5, 7), 3), ((3, 8, 11), 8), ((1, 4, 2, 3, 5), 1),
                                          ((5, 12, 1, 1), 4), ((2, 7), 7)])
@pytest.mark.parametrize("affine", [False, True])
def test_group_norm(rng, shape, groups, affine):
    x = rng.standard_normal(shape) * 3 + 2
    w, b = (mixed(rng, shape[1]), rng.standard_normal(shape[1])) if affine else (None, None)
    got = cufused.group_norm(x, groups, w, b, eps=1e-3)
    assert rel_err(got, F.group_norm(t(x), groups, t(w), t(b), eps=1e-3).numpy()) < TOL


@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_group_norm_of_a_constant_group(rng, eps):
    # A constant group has variance 0: 0 / 0 = NaN with eps = 0; otherwise its bias (NaN for
    # an infinite weight, inf - inf), as PyTorch gives. The mean of a constant row rounds
    # (0.1 * 3 / 3 != 0.1): its error must not become a variance (+-1 where PyTorch has NaN).
    x = rng.standard_normal((2, 4, 3, 3))
    x[0, :2] = 0.1
    x[1, 2:] = -7.3
    w = np.array([1.5, np.inf, -2.0, 0.5])
    b = rng.standard_normal(4)
    got = cufused.group_norm(x, 2, w, b, eps=eps)
    want = F.group_norm(t(x), 2, t(w), t(b), eps=eps).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[0, 1]).all()
    finite = np.isfinite(want)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    assert rel_err(got[finite], want[finite]) < TOL


def test_group_norm_mean_much_larger_than_std(rng):
    x = 1e6 + rng.standard_normal((2, 4, 8, 8))
    got = cufused.group_norm(x, 2)
    assert rel_err(got, F.group_norm(t(x), 2).numpy()) < 1e-8


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (7, 5), (2, 3, 2, 3, 4)])
@pytest.mark.parametrize("activation", [None, "tanh"])
@pytest.mark.parametrize("momentum", [0.2, 1.7, -0.4])  # past [0, 1] it extrapolates
def test_batch_norm(rng, training, shape, activation, momentum):
    c = shape[1]
    x = rng.standard_normal(shape) * 2 - 1
    w, b = mixed(rng, c), rng.standard_normal(c)
    rm, rv = rng.standard_normal(c), rng.uniform(0.5, 2, c)
    rm_t, rv_t = t(rm.copy()), t(rv.copy())
    got = cufused.batch_norm(x, w, b, running_mean=rm, running_var=rv, training=training,
                             momentum=momentum, eps=1e-4, activation=activation)
    ref = F.batch_norm(t(x), rm_t, rv_t, t(w), t(b), training=training, momentum=momentum,
                       eps=1e-4)
    if activation:
        ref = torch.tanh(ref)
    assert rel_err(got, ref.numpy()) < TOL
    assert rel_err(rm, rm_t.numpy()) < TOL and rel_err(rv, rv_t.numpy()) < TOL


@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_batch_norm_of_an_infinite_first_value(rng, value):
    # The statistics shift each channel by a value of its own: an infinite first value must
    # still give PyTorch's infinite mean (the running mean's update too) and NaN variance.
    x = rng.standard_normal((3, 2, 4, 4))
    x[0, 1, 0, 0] = value
    rm, rv = np.zeros(2), np.ones(2)
    rm_t, rv_t = t(rm.copy()), t(rv.copy())
    got = cufused.batch_norm(x, running_mean=rm, running_var=rv)
    ref = F.batch_norm(t(x), rm_t, rv_t, training=True).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert rel_err(got[:, 0], ref[:, 0]) < TOL
    assert rm[1] == rm_t[1].item() == value and np.isnan(rv[1]) and np.isnan(rv_t[1].item())
    assert rel_err(rm[:1], rm_t[:1].numpy()) < TOL and rel_err(rv[:1], rv_t[:1].numpy()) < TOL


def test_batch_norm_without_running_stats_leaves_nothing_to_update(rng):
    x = rng.standard_normal((3, 2, 4))
    got = cufused.batch_norm(x)
    assert rel_err(got, F.batch_norm(t(x), None, None, training=True).numpy()) < TOL


# ---------------------------------------------------------------------------------- pooling

POOL_CASES = [
    ((2, 3, 8, 8), dict(kernel_size=2)),
    ((1, 2, 9, 7), dict(kernel_size=3, stride=2, padding=1)),
    ((2, 1, 11, 13), dict(kernel_size=(2, 3), stride=(1, 2))),
    ((1, 1, 5, 5), dict(kernel_size=5)),
    ((2, 2, 4, 6, 8), dict(kernel_size=2)),
    ((1, 3, 7, 5, 6), dict(kernel_size=3, stride=2, padding=1)),
]


@pytest.mark.parametrize("xs,opts", POOL_CASES)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling(rng, xs, opts, kind):
    name = f"{kind}_pool{len(xs) - 2}d"
    x = rng.standard_normal(xs)
    got = getattr(cufused, name)(x, **opts)
    ref = getattr(F, name)(t(x), **opts).numpy()
    assert rel_err(got, ref) < TOL


@pytest.mark.parametrize("dims", [2, 3])
def test_max_pool_padding_is_minus_infinity(dims):
    # The padding never wins a window, not even over an input of -inf (a finite fill would).
    x = np.full((1, 2) + (5,) * dims, -np.inf)
    x[0, 0, (1,) * dims] = -1e300
    name = f"max_pool{dims}d"
    got = getattr(cufused, name)(x, 3, stride=2, padding=1)
    ref = getattr(F, name)(t(x), 3, stride=2, padding=1).numpy()
    np.testing.assert_array_equal(got, ref)
    assert np.isneginf(got[0, 1]).all()


def test_max_pool_propagates_nan(rng):
    x = rng.standard_normal((1, 2, 6, 6))
    x[0, 1, 2, 3] = np.nan
    got = cufused.max_pool2d(x, 2)
    ref = F.max_pool2d(t(x), 2).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(got[0, 1, 1, 1])
    assert np.allclose(got[~np.isnan(ref)], ref[~np.isnan(ref)], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling_takes_no_memory_per_window_value(rng, kind):
    # Overlapping 9 x 9 x 9 windows at stride 1: the pools keep the padded input and the
    # output, 2.8 MiB each in float64 (one copy per window value would be 1.5 GiB).
    import tracemalloc

    x = rng.standard_normal((1, 1, 64, 64, 64))
    tracemalloc.start()
    try:
        got = getattr(cufused, f"{kind}_pool3d")(x, 9, 1, 4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 48 * 2**20, f"{peak / 2**20:.0f} MiB"
    ref = getattr(F, f"{kind}_pool3d")(t(x), 9, 1, 4).numpy()
    assert rel_err(got, ref) < TOL


def _same_zeros(got, ref) -> bool:
    """Equal values with equal signs of zero."""
    return np.array_equal(got, ref) and np.array_equal(np.signbit(got), np.signbit(ref))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_signed_zeros_like_torch(dtype):
    # PyTorch CPU's zero signs: a max pool keeps a window's first of equal values (-0 before
    # +0), a clamp keeps a value equal to its bound, and a norm without a bias adds a zero
    # bias (+0) except GroupNorm without a weight either.
    zeros = np.array([[[[-0.0, 0.0], [0.0, -0.0]]]], dtype)  # (1, 1, 2, 2)
    pooled = cufused.max_pool2d(zeros.reshape(1, 1, 1, 4), (1, 2))
    assert _same_zeros(pooled, F.max_pool2d(torch.from_numpy(zeros.reshape(1, 1, 1, 4)),
                                            (1, 2)).numpy())
    assert np.signbit(pooled).tolist() == [[[[True, False]]]]
    pooled3 = cufused.max_pool3d(zeros.reshape(1, 1, 1, 2, 2), (1, 2, 2))
    assert _same_zeros(pooled3, F.max_pool3d(torch.from_numpy(zeros.reshape(1, 1, 1, 2, 2)),
                                             (1, 2, 2)).numpy())
    assert np.signbit(pooled3).all()
    from cufused import reference

    signed = np.array([-0.0, 0.0, -1.0, 1.0], dtype)  # zeros on the bound 0 of [0, 1], and -0
    for lo, hi in ((0.0, 1.0), (-0.0, 1.0), (-1.0, -0.0), (-1.0, 0.0)):  # on 0 as the upper one
        assert _same_zeros(reference.clamp(signed, lo, hi),
                           torch.clamp(torch.from_numpy(signed), lo, hi).numpy())
    x = np.array([[[-0.0, 0.0, 1.0, -1.0], [0.0, -0.0, 2.0, -2.0]]], dtype)  # (1, 2, 4)
    for w in (None, np.array([2.0, 0.0], dtype)):
        for b in (None, np.array([-0.0, 0.0], dtype)):
            tw, tb = (None if a is None else torch.from_numpy(a) for a in (w, b))
            tx = torch.from_numpy(x)
            assert _same_zeros(cufused.group_norm(x, 2, w, b),
                               F.group_norm(tx, 2, tw, tb).numpy())
            assert _same_zeros(cufused.batch_norm(x, w, b),
                               F.batch_norm(tx, None, None, tw, tb, training=True).numpy())
            rm, rv = np.zeros(2, dtype), np.ones(2, dtype)
            assert _same_zeros(
                cufused.batch_norm(x, w, b, running_mean=rm, running_var=rv, training=False),
                F.batch_norm(tx, torch.from_numpy(rm), torch.from_numpy(rv), tw, tb,
                             training=False).numpy())
    # Pipeline A with a zero scale: every value a signed zero through the pool and the clamp.
    rng = np.random.default_rng(0)
    arrays, opts = args_a(rng, positive=False)
    arrays = list(arrays)
    arrays[-1] = np.zeros_like(arrays[-1])
    arrays[-2] = None  # no GroupNorm bias: the zero scale keeps each value's sign
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    ref = torch_a(*arrays, **opts)
    assert _same_zeros(got, ref) and np.signbit(ref).any() and not np.signbit(ref).all()


# ---------------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_reference_functions_return_float64(dtype):
    # The module's promise: float64 out whatever float dtype comes in (clamp included).
    from cufused import reference

    x = np.linspace(-2, 2, 2 * 4 * 6 * 6, dtype=dtype).reshape(2, 4, 6, 6)
    results = {
        "clamp": reference.clamp(x, 0.0, 0.5),
        "max_pool": reference.max_pool(x, (2, 2), (2, 2), (0, 0)),
        "softmax": reference.softmax(x, (2, 3)),
    }
    for name, y in results.items():
        assert y.dtype == np.float64, name
    np.testing.assert_array_equal(results["clamp"], np.clip(x.astype(np.float64), 0.0, 0.5))


def test_softmax_of_values_whose_exp_overflows(rng):
    # exp(1e3) overflows float64: the result needs the max shift (or its equivalent).
    x = 1e3 + 50 * rng.standard_normal((2, 3, 4, 5))
    got = cufused.softmax(x, (2, 3))
    ref = F.softmax(t(x).flatten(2), dim=-1).reshape(x.shape).numpy()
    assert np.isfinite(got).all() and rel_err(got, ref) < TOL


@pytest.mark.parametrize("shape,axis", [((3, 4), -1), ((2, 3, 5), 1), ((2, 3, 4, 5, 6), (2, 3, 4)),
                                        ((4, 3, 2), (0, 2)), ((7,), 0)])
def test_softmax(rng, shape, axis):
    x = 20 * rng.standard_normal(shape)
    got = cufused.softmax(x, axis)
    axes = (axis,) if isinstance(axis, int) else axis
    xt = t(x)
    # PyTorch's softmax takes one dim: move the axes to the end and flatten them.
    kept = [a for a in range(x.ndim) if a not in [a % x.ndim for a in axes]]
    perm = kept + [a % x.ndim for a in axes]
    moved = xt.permute(perm)
    ref = torch.softmax(moved.reshape(*moved.shape[:len(kept)], -1), dim=-1).reshape(moved.shape)
    ref = ref.permute(list(np.argsort(perm))).numpy()
    assert rel_err(got, ref) < TOL


# -------------------------------------------------------------------------------- pipelines


def torch_a(x, w, cb, gw, gb, scale, *, num_groups, pool_kernel, clamp_min, clamp_max, stride=1,
            padding=0, eps=1e-5):
    y = F.conv2d(t(x), t(w), t(cb), stride=stride, padding=padding)
    y = F.group_norm(y, num_groups, t(gw), t(gb), eps=eps) * t(scale).reshape(1, -1, 1, 1)
    return torch.clamp(F.max_pool2d(y, pool_kernel), clamp_min, clamp_max).numpy()


def args_a(rng, n=2, cin=3, h=14, w=11, cout=8, k=3, groups=4, pool=2, positive=False):
    x = rng.random((n, cin, h, w))
    wt = rng.standard_normal((cout, cin, k, k))
    cb = rng.standard_normal(cout)
    gw = rng.random(cout) if positive else mixed(rng, cout)
    gb = rng.standard_normal(cout)
    scale = (rng.random(cout) if positive else mixed(rng, cout)).reshape(cout, 1, 1)
    return (x, wt, cb, gw, gb, scale), dict(num_groups=groups, pool_kernel=pool,
                                            clamp_min=-0.4, clamp_max=0.6)


@pytest.mark.parametrize("positive", [False, True])
@pytest.mark.parametrize("geometry", [dict(), dict(n=1, h=13, w=17, pool=3, groups=2),
                                      dict(n=3, cin=1, cout=4, groups=1, k=1, pool=4),
                                      dict(stride=2, padding=1), dict(eps=0.5),
                                      dict(k=4, padding="same"), dict(k=2, padding="same"),
                                      dict(clamp_min=None), dict(clamp_max=None)])
def test_pipeline_a(rng, positive, geometry):
    conv_opts = {k: geometry.pop(k) for k in ("stride", "padding", "eps") if k in geometry}
    clamp = {k: geometry.pop(k) for k in ("clamp_min", "clamp_max") if k in geometry}
    arrays, opts = args_a(rng, positive=positive, **geometry)
    opts.update(clamp)  # None: no bound on that side, as torch.clamp takes it
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts, **conv_opts)
    assert rel_err(got, torch_a(*arrays, **opts, **conv_opts)) < TOL


def test_pipeline_a_statistics_include_rows_the_pool_drops(rng):
    # 126 x 126 conv output, pool 4 -> 31 x 31: rows/cols 124-125 are dropped by the pool but
    # count in the GroupNorm statistics. Changing only what feeds them must change the result.
    arrays, opts = args_a(rng, n=1, cin=2, h=128, w=128, cout=4, groups=2, pool=4)
    opts.update(clamp_min=-1e3, clamp_max=1e3)  # no saturation can hide the change
    base = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    x = arrays[0].copy()
    x[:, :, 126:, :] += 10.0
    moved = cufused.conv2d_groupnorm_scale_maxpool_clamp(x, *arrays[1:], **opts)
    assert rel_err(moved, torch_a(x, *arrays[1:], **opts)) < TOL
    assert not np.allclose(base, moved)


def torch_b(x, w, bw, bb, gw, gb, *, num_groups, stride=1, padding=0, output_padding=0,
            groups=1, conv_bias=None, pool_kernel=2, eps=1e-5, running_mean=None,
            running_var=None, momentum=0.1):
    y = F.conv_transpose2d(t(x), t(w), t(conv_bias), stride=stride, padding=padding,
                           output_padding=output_padding, groups=groups)
    y = torch.tanh(F.batch_norm(y, running_mean, running_var, t(bw), t(bb), training=True,
                                momentum=momentum, eps=eps))
    return F.group_norm(F.max_pool2d(y, pool_kernel, pool_kernel), num_groups, t(gw), t(gb),
                        eps=eps).numpy()


def args_b(rng, n=3, cin=4, h=6, w=5, cout=8, k=3, conv_groups=1):
    x = rng.random((n, cin, h, w))
    wt = rng.standard_normal((cin, cout // conv_groups, k, k))
    return (x, wt, mixed(rng, cout), rng.standard_normal(cout), mixed(rng, cout),
            rng.standard_normal(cout))


@pytest.mark.parametrize("opts", [dict(num_groups=2),
                                  dict(num_groups=4, stride=2, padding=1, output_padding=1),
                                  dict(num_groups=8, groups=2, pool_kernel=3),
                                  dict(num_groups=1, eps=1e-3, momentum=0.5)])
def test_pipeline_b(rng, opts):
    arrays = args_b(rng, conv_groups=opts.get("groups", 1))
    cb = rng.standard_normal(8)
    rm, rv = rng.standard_normal(8), rng.uniform(0.5, 2, 8)
    rm_t, rv_t = t(rm.copy()), t(rv.copy())
    got = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, **opts, conv_bias=cb, running_mean=rm, running_var=rv)
    ref = torch_b(*arrays, **opts, conv_bias=cb, running_mean=rm_t, running_var=rv_t)
    assert rel_err(got, ref) < TOL
    assert rel_err(rm, rm_t.numpy()) < TOL and rel_err(rv, rv_t.numpy()) < TOL


def test_pipeline_b_conv_bias_cancels_but_moves_running_mean(rng):
    arrays = args_b(rng)
    rm0, rm1 = np.zeros(8), np.zeros(8)
    out0 = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, num_groups=2, running_mean=rm0, running_var=np.ones(8))
    out1 = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *arrays, num_groups=2, conv_bias=np.full(8, 5.0), running_mean=rm1,
        running_var=np.ones(8))
    assert rel_err(out1, out0) < 1e-12
    assert np.allclose(rm1 - rm0, 0.1 * 5.0)


def torch_c(x, w, scale, *, stride, padding, output_padding, pool_kernel, clamp_min, clamp_max,
            conv_bias=None, groups=1):
    y = F.avg_pool3d(t(x), pool_kernel)
    y = F.conv_transpose3d(y, t(w), t(conv_bias), stride=stride, padding=padding,
                           output_padding=output_padding, groups=groups)
    y = torch.clamp(y, clamp_min, clamp_max)
    n, c = y.shape[:2]
    return (torch.softmax(y.reshape(n, c, -1), 2).reshape(y.shape)
            * t(scale).reshape(1, -1, 1, 1, 1)).numpy()


@pytest.mark.parametrize("opts", [
    dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0, clamp_max=1.0),
    dict(stride=1, padding=0, output_padding=0, pool_kernel=3, clamp_min=-0.5, clamp_max=0.25),
    dict(stride=2, padding=0, output_padding=1, pool_kernel=2, clamp_min=-2.0, clamp_max=2.0,
         groups=2),
    # None: no bound on that side, as torch.clamp takes it.
    dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=None, clamp_max=0.5),
    dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=-0.5, clamp_max=None),
])
def test_pipeline_c(rng, opts):
    g = opts.get("groups", 1)
    x = rng.random((2, 4, 6, 7, 8))
    w = rng.standard_normal((4, 6 // g, 3, 3, 3))
    scale, cb = mixed(rng, 6).reshape(1, 6, 1, 1, 1), rng.standard_normal(6)
    got = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(x, w, scale, **opts, conv_bias=cb)
    ref = torch_c(x, w, scale, **opts, conv_bias=cb)
    # Outputs are ~1 / (D*H*W): only a relative measure can tell them from zeros.
    assert rel_err(got, ref) < TOL
    assert rel_err(np.zeros_like(ref), ref) == 1.0


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_results_keep_input_dtype_and_shape(rng, dtype):
    arrays, opts = args_a(rng)
    arrays = tuple(a.astype(dtype) for a in arrays)
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    assert got.dtype == dtype and got.shape == (2, 8, 6, 4)
    ref = torch_a(*(a.astype(np.float64) for a in arrays), **opts)
    assert rel_err(got, ref) < {np.float16: 2e-3, np.float32: 1e-6, np.float64: TOL}[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_are_contiguous_arrays_of_their_own(rng, dtype):
    # A transposed convolution with padding crops a larger buffer: the result is a C-contiguous
    # array of its own in every dtype (as PyTorch's and the GPU path's), not a view into it.
    x = rng.standard_normal((2, 4, 5, 5)).astype(dtype)
    w = rng.standard_normal((4, 3, 3, 3)).astype(dtype)
    # The second crop (one sample, one output channel, rows only) is contiguous in memory.
    for xi, wi, padding in ((x, w, 1), (x[:1, :2], w[:2, :1], (1, 0))):
        got = cufused.conv_transpose2d(xi, wi, padding=padding)
        assert got.flags.c_contiguous and got.base is None
        assert_close(got, F.conv_transpose2d(t(xi).double(), t(wi).double(),
                                             padding=padding).numpy(), 1e-6)
    got = cufused.max_pool2d(x, 1)
    assert got.base is None and not np.shares_memory(got, x) and np.array_equal(got, x)


def test_out_argument_is_filled_and_returned(rng):
    x = rng.standard_normal((2, 3, 6, 6))
    out = np.full((2, 3, 3, 3), np.nan)
    res = cufused.max_pool2d(x, 2, out=out)
    assert res is out and not np.isnan(out).any()
    assert_close(out, F.max_pool2d(t(x), 2).numpy(), 1e-12)


def test_empty_batch_returns_empty(rng):
    x = np.empty((0, 3, 8, 8))
    w = rng.standard_normal((4, 3, 3, 3))
    ones = np.ones(4)
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(x, w, None, ones, None, ones, num_groups=2,
                                                       pool_kernel=2, clamp_min=0, clamp_max=1)
    assert got.shape == (0, 4, 3, 3)
    assert cufused.softmax(np.empty((0, 3)), 1).shape == (0, 3)


def test_clamp_min_above_max_gives_max_like_torch(rng):
    arrays, opts = args_a(rng)
    opts.update(clamp_min=0.5, clamp_max=-0.5)
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    assert np.all(got == -0.5)
    assert rel_err(got, torch_a(*arrays, **opts)) < TOL


INF = float("inf")


@pytest.mark.parametrize("bounds", [(-INF, INF), (0.1, INF), (-INF, 0.25), (INF, 0.5),
                                    (0.2, -INF), (INF, INF), (-INF, -INF)])
def test_infinite_clamp_bounds_like_torch(rng, bounds):
    # torch.clamp takes infinite bounds (no bound; past each other the upper one wins): so do
    # pipelines A and C, NaN and infinities landing where PyTorch puts them.
    lo, hi = bounds
    arrays, opts = args_a(rng)
    opts.update(clamp_min=lo, clamp_max=hi)
    got = cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **opts)
    np.testing.assert_allclose(got, torch_a(*arrays, **opts), rtol=1e-12, atol=1e-12)
    x = rng.random((2, 3, 4, 6, 8))
    w, scale = rng.standard_normal((3, 4, 3, 3, 3)), mixed(rng, 4)
    opts = dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=lo,
                clamp_max=hi)
    got = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(x, w, scale, **opts)
    np.testing.assert_allclose(got, torch_c(x, w, scale, **opts), rtol=1e-12, atol=0)


def test_nan_clamp_bounds_are_refused(rng):
    # torch.clamp with a NaN bound makes every value NaN: refused here, naming the bound.
    arrays, opts = args_a(rng)
    x, w = rng.random((1, 2, 4, 4, 4)), rng.standard_normal((2, 2, 3, 3, 3))
    c_opts = dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0,
                  clamp_max=1.0)
    for name in ("clamp_min", "clamp_max"):
        with pytest.raises(ValueError, match=name):
            cufused.conv2d_groupnorm_scale_maxpool_clamp(*arrays, **{**opts, name: np.nan})
        with pytest.raises(ValueError, match=name):
            cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
                x, w, 1.0, **{**c_opts, name: np.nan})


@pytest.mark.gpu
def test_reference_on_cupy_matches_numpy(rng):
    # `python -m cufused check` computes the canonical references with CuPy arrays: the same
    # code must give the NumPy results (float64 on both sides).
    import cupy

    from cufused import reference
    from cufused.bench.cases import make_cases

    for case in make_cases(small=True):
        inputs = {k: v.astype(np.float64) for k, v in case.make_inputs(rng).items()}
        want = case.reference(inputs)
        got = case.reference({k: cupy.asarray(v) for k, v in inputs.items()})
        assert isinstance(got, cupy.ndarray) and got.dtype == cupy.float64
        assert rel_err(cupy.asnumpy(got), want) < 1e-12, case.name
    x = rng.standard_normal((2, 6, 7, 9))
    w = rng.standard_normal((6, 4, 3, 3))
    rm, rv = rng.random(4), rng.random(4) + 0.5
    gx, gw, grm, grv = (cupy.asarray(a) for a in (x, w, rm, rv))
    for fn, args in [
        (reference.conv, ((x, w[:, :3], None, (2, 1), (1, 0), (1, 2), 2))),
        (reference.conv_transpose, ((x, w, None, (2, 1), (1, 0), (1, 0), (1, 1), 2))),
        (reference.max_pool, ((x, (3, 2), (2, 2), (1, 1)))),
        (reference.avg_pool, ((x, (3, 2), (2, 1), (1, 0)))),
        (reference.softmax, ((x, (2, 3)))),
        (reference.group_norm, ((x, 3, None, None, 1e-5))),
    ]:
        gargs = tuple(cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
        assert rel_err(cupy.asnumpy(fn(*gargs)), fn(*args)) < 1e-12, fn.__name__
    y = reference.batch_norm(gx[:, :4], None, None, grm, grv, True, 0.1, 1e-5, "tanh")
    want = reference.batch_norm(x[:, :4], None, None, rm, rv, True, 0.1, 1e-5, "tanh")
    assert rel_err(cupy.asnumpy(y), want) < 1e-12
    assert rel_err(cupy.asnumpy(grm), rm) < 1e-12 and rel_err(cupy.asnumpy(grv), rv) < 1e-12


def test_reference_pipelines_take_no_scale_as_no_scaling(rng):
    # The float64 reference called directly: scale None is a scale of ones, as in the public
    # calls (which pass ones for it).
    from cufused import reference

    x, w = rng.random((2, 3, 9, 9)), rng.standard_normal((4, 3, 3, 3))
    a = dict(num_groups=2, pool_kernel=(2, 2), clamp_min=-0.5, clamp_max=0.7, stride=(1, 1),
             padding=(0, 0), eps=1e-5)
    gw, gb = mixed(rng, 4), rng.standard_normal(4)
    got = reference.conv2d_groupnorm_scale_maxpool_clamp(x, w, None, gw, gb, None, **a)
    want = reference.conv2d_groupnorm_scale_maxpool_clamp(x, w, None, gw, gb, np.ones(4), **a)
    assert got.shape == (2, 4, 3, 3) and np.array_equal(got, want)
    x, w = rng.random((2, 3, 4, 6, 4)), rng.standard_normal((3, 5, 3, 3, 3))
    c = dict(stride=(2, 2, 2), padding=(1, 1, 1), output_padding=(1, 1, 1),
             pool_kernel=(2, 2, 2), clamp_min=0.0, clamp_max=1.0, conv_bias=None, groups=1)
    got = reference.conv_transpose3d_avgpool_clamp_softmax_multiply(x, w, None, **c)
    want = reference.conv_transpose3d_avgpool_clamp_softmax_multiply(x, w, np.ones(5), **c)
    assert got.shape == (2, 5, 4, 6, 4) and np.array_equal(got, want)


@pytest.mark.parametrize("bounds", [(np.nan, 1.0), (0.0, np.nan), (np.nan, np.nan)])
def test_reference_clamp_of_a_nan_bound_like_torch(bounds):
    # The pipelines refuse a NaN bound; the reference's clamp, as torch.clamp, gives NaN.
    y = np.array([-1.0, -0.0, 0.5, 2.0, np.inf, np.nan])
    got = cufused.reference.clamp(y, *bounds)
    assert np.isnan(got).all()
    np.testing.assert_array_equal(got, torch.clamp(torch.from_numpy(y), *bounds).numpy())


def test_reference_batch_statistics_of_a_constant_channel():
    # Deviations from the channel's first value: a constant channel of large magnitude has a
    # variance of exactly 0 (not the square of its mean's rounding error), as in GroupNorm.
    x = np.full((999, 2, 1, 1), 1e14 / 3)
    x[:, 1, 0, 0] = values = np.linspace(-1.0, 1.0, 999)
    rm, rv = np.zeros(2), np.ones(2)
    cufused.reference.batch_norm(x, None, None, rm, rv, True, 0.1, 1e-5)
    assert rv[0] == 0.9 and rm[0] == 0.1 * (1e14 / 3)
    assert abs(rv[1] - (0.9 + 0.1 * values.var() * 999 / 998)) < 1e-15
