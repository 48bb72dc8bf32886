"""Private launchers (cufused._kernels) called directly on the GPU: blocked channels-last
GroupNorm rows, pooling into channels-last, the channels-last softmax rows, the channels
transposes and the fused pass's 16-byte variants against the scalar one."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import cufused

from conftest import GPU, assert_close, mixed, poisoned, to_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("quick_plans")]

if GPU:
    import cupy as cp


# Pipeline B's in-place GroupNorm: rows stored channels-last in blocks of one group's
# channels (16-byte output vectors for 9 x 10, scalar ones for 3 x 3 and 1 x 3), with and
# without the BatchNorm affine + tanh map first; and from a separate blocked buffer with two
# groups per block.
@pytest.mark.parametrize("shape,groups", [((3, 24, 9, 10), 6), ((2, 32, 3, 3), 2),
                                          ((2, 16, 1, 3), 4)])
@pytest.mark.parametrize("pre", [False, True])
def test_group_norm_rows_from_blocked_channels_last(rng, shape, groups, pre):
    from cufused._kernels.normalization import group_norm_rows

    n, c = shape[:2]
    x = (3.0 + rng.standard_normal(shape)).astype(np.float32).astype(np.float64)
    w, b = mixed(rng, c), rng.standard_normal(c)
    # The pre-map's coefficients (a, center, c): tanh(a * (x - center) + c).
    coef = np.stack([mixed(rng, c), 3.0 + rng.standard_normal(c), rng.standard_normal(c)])
    a, center, shift = (v[:, None, None] for v in coef)
    mapped = np.tanh(a * (x - center) + shift) if pre else x
    ref = cufused.group_norm(mapped, groups, w, b)
    pre_gpu = cp.asarray(coef, dtype=cp.float32) if pre else None
    for block, in_place in [(c // groups, True), (2 * c // groups, False)]:
        blocked = x.reshape(n, c // block, block, -1).transpose(0, 1, 3, 2)
        x_gpu = cp.asarray(np.ascontiguousarray(blocked).reshape(shape), dtype=cp.float32)
        out = x_gpu if in_place else poisoned(shape)
        group_norm_rows(x_gpu, out, *to_gpu(w, b), num_groups=groups, eps=1e-5, pre=pre_gpu,
                        x_block=block)
        assert_close(out.get(), ref, 1e-4 if pre else 1e-5)


@pytest.mark.parametrize("nd", [2, 3])
@pytest.mark.parametrize("is_max", [True, False])
def test_pooling_into_channels_last(rng, nd, is_max):
    # The internal pool into a channels-last destination (pipeline C's conv input): 37
    # channels and 5 * 7 (* 3) positions leave partial 32 x 32 tiles; the 2-window kernel
    # writes it directly, the 3-window path pools into a temporary and transposes.
    from cufused._kernels.pooling import pool_into
    from cufused._layout import empty_in_layout
    from cufused._ops.pooling import check_pool_args

    shape = (2, 37, 10, 14) if nd == 2 else (2, 37, 6, 10, 14)
    x = rng.standard_normal(shape)
    x[1, 36, 1, 1] = np.nan
    fn = getattr(cufused, f"{'max' if is_max else 'avg'}_pool{nd}d")
    for opts in (dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1)):
        ref = fn(x, **opts)
        out = empty_in_layout(ref.shape, "nhwc")
        out[...] = cp.nan
        kernel, stride, padding, _ = check_pool_args(
            shape[2:], nd, opts["kernel_size"], opts.get("stride"), opts.get("padding", 0))
        pool_into(*to_gpu(x), out, kernel, stride, padding, is_max=is_max)
        got = out.get()
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        mask = ~np.isnan(ref)
        assert_close(got[mask], ref[mask], 1e-6)


@pytest.mark.parametrize("vec4", [True, False])
@pytest.mark.parametrize("clamp", [(-0.5, 1.5), (-80.0, 80.0)])  # no running max / online
@pytest.mark.parametrize("channels,length", [(4, 1000), (12, 999), (64, 1536), (256, 260)])
def test_softmax_rows_channels_last(rng, monkeypatch, channels, length, clamp, vec4):
    # Pipeline C's softmax over a channels-last (N, S, C) tensor: bias, clamp and scale fused,
    # the 16-byte statistics kernel (with 1 to 32 threads per position) or the scalar one,
    # and the 16-byte or the scalar transposing normalize pass.
    softmax_module = importlib.import_module("cufused._kernels.softmax")
    launched = []
    get_kernel = softmax_module.get_kernel
    monkeypatch.setattr(softmax_module, "get_kernel",
                        lambda f, name, **kw: launched.append(name) or get_kernel(f, name, **kw))
    n = 3
    y = 20 * rng.standard_normal((n, length, channels))
    y[1, 7, channels - 1] = np.nan
    bias, scale = rng.standard_normal(channels), rng.standard_normal(channels)
    v = np.clip(y + bias, *clamp)
    e = np.exp(v - v.max(axis=1, keepdims=True))
    ref = (e / e.sum(axis=1, keepdims=True) * scale).transpose(0, 2, 1)
    y_gpu, bias_gpu, scale_gpu = to_gpu(y, bias, scale)
    out = poisoned(ref.shape)
    softmax_module.softmax_rows(cp, y_gpu, out, rows=n * channels, length=length,
                                channels=channels, strides=(length * channels, 1, channels),
                                layout="nhwc", bias=bias_gpu, scale=scale_gpu, clamp=clamp,
                                vec4=vec4)
    uses_vec4 = vec4 and channels % 4 == 0
    assert any(k.startswith("softmax_stats_nhwc4") for k in launched) == uses_vec4
    assert ("softmax_apply_transpose<true, 4>" in launched) == (uses_vec4 and length % 4 == 0)
    got = out.get()
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(got[1, -1]).all()
    mask = ~np.isnan(ref)
    assert_close(got[mask], ref[mask], 1e-5)


def test_transpose_channels_affine(rng):
    # Channels-last -> NCHW with clamp(scale[n, c] * (v - center[n, c]) + shift[n, c]): 37
    # channels (partial tiles), NaN kept, bounds applied.
    from cufused._kernels.layout import transpose_channels
    from cufused._layout import empty_in_layout

    n, c, h, w = 3, 37, 5, 7
    x = rng.standard_normal((n, c, h, w))
    x[1, 4, 2, 3] = np.nan
    scale, center, shift = rng.standard_normal((3, n, c))
    src = empty_in_layout(x.shape, "nhwc")
    src[...] = cp.asarray(x, dtype=cp.float32)
    out = poisoned(x.shape)
    transpose_channels(src, out, to_channels_last=False,
                       affine=(cp.asarray(np.stack([scale, center, shift]).reshape(3, -1),
                                          dtype=cp.float32), -0.5, 0.75))
    ref = np.clip(scale[:, :, None, None] * (x - center[:, :, None, None])
                  + shift[:, :, None, None], -0.5, 0.75)
    got = out.get()
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert_close(np.nan_to_num(got), np.nan_to_num(ref), 1e-6)


@pytest.mark.parametrize("shape", [(3, 20, 9, 12), (2, 37, 5, 7), (1, 4, 2_200_000),
                                   (3, 8, 9, 13), (2, 16, 3, 5, 7)])
def test_transpose_channels_both_ways(rng, shape, monkeypatch):
    # NCHW -> channels-last and back (+ bias, and without it: 8 and 16 channels take the
    # kernel of 8 channels a thread both ways), partial tiles; the third shape has more than
    # 65535 tiles of positions per sample (once past the grid's y limit).
    from cufused._kernels import layout
    from cufused._kernels.layout import transpose_channels
    from cufused._layout import empty_in_layout

    launched, get_kernel = [], layout.get_kernel
    monkeypatch.setattr(layout, "get_kernel",
                        lambda f, name, **kw: launched.append(name) or get_kernel(f, name, **kw))
    x = cp.asarray(rng.standard_normal(shape), dtype=cp.float32)
    bias = cp.asarray(rng.standard_normal(shape[1]), dtype=cp.float32)
    nhwc = empty_in_layout(shape, "nhwc")
    nhwc.fill(cp.nan)
    transpose_channels(x, nhwc, to_channels_last=True)
    assert bool((nhwc == x).all())
    back = poisoned(shape)
    transpose_channels(nhwc, back, to_channels_last=False, bias=bias)
    assert bool((back == x + bias.reshape(1, -1, *[1] * (len(shape) - 2))).all())
    back = poisoned(shape)
    transpose_channels(nhwc, back, to_channels_last=False)
    assert bool((back == x).all())
    by_eight = ["transpose_channels8<true>", "transpose_channels8<false>"]
    assert [name for name in launched if name.startswith("transpose_channels8")] == (
        by_eight if shape[1] in (8, 16) else [])


@pytest.mark.parametrize("layout,pool,c,h,w,variants", [
    ("nchw", 2, 12, 22, 18, ["bands"]),
    ("nchw", 4, 12, 22, 18, ["bands"]),
    ("nchw", 2, 8, 70, 42, ["bands"]),  # three chunks of 15 bands, 21 windows per band
    ("nchw", 2, 4, 11, 80, ["bands"]),  # 40 windows per band: more than a warp
    # Channels-last: 1 to 32 channel quads per warp; ">nhwc" writes ext channels-last,
    # ">blocked" channels-last in blocks of 4 channels and of a statistics group's channels.
    ("nhwc", 2, 128, 9, 41, ["vec4", "vec4>nhwc", "vec4>blocked", "rows"]),
    ("nhwc", 4, 64, 13, 30, ["vec4", "rows", "rows>nhwc", "rows>blocked"]),
    ("nhwc", 4, 32, 9, 10, ["rows", "rows>nhwc"]),
    ("nhwc", 4, 16, 22, 18, ["vec4"]),
    ("nhwc", 2, 4, 6, 7, ["vec4", "vec4>nhwc"]),
])
def test_fused_pass_variants_match_scalar(rng, layout, pool, c, h, w, variants):
    # The 16-byte kernels against the scalar one and float64 sums: mixed extremum signs, a
    # bias, statistics rows of c / 4 channels per sample (partial channel tiles for c = 12),
    # rows and columns the pool drops.
    from cufused._kernels import pooling
    from cufused._layout import empty_in_layout

    n, group = 3, max(c // 4, 1)
    y_host = 5.0 + rng.standard_normal((n, c, h, w))
    y = empty_in_layout(y_host.shape, layout)
    y[...] = cp.asarray(y_host, dtype=cp.float32)
    bias, sign = to_gpu(rng.standard_normal(c), mixed(rng, c))
    results = {}
    ext_shape = (n, c, h // pool, w // pool)
    for variant in ["scalar", *variants]:
        kernel, _, ext_layout = variant.partition(">")
        for block in ([4, group] if ext_layout == "blocked"
                      else [c if ext_layout == "nhwc" else 0]):
            if ext_layout == "nhwc":
                ext = empty_in_layout(ext_shape, "nhwc")
                ext[...] = cp.nan
            else:
                ext = poisoned(ext_shape)
            partial, shift, _ = pooling.pool_extremum_stats(
                cp, y, ext, pool, bias=bias, sign_a=sign, sign_b=None, shift_group=group,
                per_sample=True, variant=pooling.fused_pass_variant(y, pool, kernel),
                ext_block=block)
            ext = ext.get()
            if ext_layout == "blocked":  # (N, C / block, P, block) memory -> NCHW
                ext = (ext.reshape(n, c // block, -1, block).transpose(0, 1, 3, 2)
                       .reshape(ext_shape))
            results[variant if ext_layout != "blocked" or block == 4
                    else f"{variant} {block}"] = (
                ext, partial.get().sum(axis=2), shift.get())
    ext_s, sums_s, shift_s = results["scalar"]
    assert not np.isnan(ext_s).any()
    d = (y.get().astype(np.float64) + bias.get()[:, None, None]
         - np.repeat(shift_s.reshape(n, -1), group, axis=1)[:, :, None, None])
    assert_close(sums_s[..., 0], d.sum(axis=(2, 3)), 1e-5)
    assert_close(sums_s[..., 1], (d * d).sum(axis=(2, 3)), 1e-5)
    assert len(results) == 1 + len(variants) + sum(v.endswith(">blocked") for v in variants)
    for variant in set(results) - {"scalar"}:
        ext_v, sums_v, shift_v = results[variant]
        assert np.array_equal(ext_v, ext_s), variant
        assert np.array_equal(shift_v, shift_s), variant
        assert_close(sums_v, sums_s, 1e-5)


@pytest.mark.parametrize("layout,pool,c,h,w,variant", [
    ("nchw", 2, 12, 22, 18, "scalar"), ("nchw", 2, 12, 22, 18, "bands"),
    ("nhwc", 2, 128, 9, 41, "vec4"), ("nhwc", 2, 128, 9, 41, "rows"),
    ("nhwc", 4, 32, 9, 10, "rows"),
])
def test_fused_pass_constant_rows_normalize_to_the_bias(rng, layout, pool, c, h, w, variant):
    # Pipeline A's route on statistics rows (4 per sample) constant at y + bias, where the
    # bias rounds y away (y = 1e-8 * (row + 1) against biases 1, 1234.5, -3, 0.75): the pass sums
    # y + (bias - shift), which keeps y, and the affine centers on the float32 mean
    # (centered_sums=False), which rounds it away, so every pooled value normalizes to
    # exactly gn_bias * scale.
    from cufused._kernels import pooling
    from cufused._kernels.normalization import (channel_affine, coef_array,
                                                group_norm_coefficients)
    from cufused._layout import empty_in_layout

    n, group = 3, c // 4
    level = np.repeat(np.float32(1e-8) * np.arange(1, 5, dtype=np.float32), group)
    y = empty_in_layout((n, c, h, w), layout)
    y[...] = cp.asarray(level)[None, :, None, None]
    bias = cp.asarray(np.repeat(np.float32([1.0, 1234.5, -3.0, 0.75]), group))
    gn_weight, gn_bias, scale = to_gpu(mixed(rng, c), rng.standard_normal(c), mixed(rng, c))
    ext = poisoned((n, c, h // pool, w // pool))
    partial, shift, splits = pooling.pool_extremum_stats(
        cp, y, ext, pool, bias=bias, sign_a=gn_weight, sign_b=scale, shift_group=group,
        per_sample=True, variant=pooling.fused_pass_variant(y, pool, variant), ext_block=0)
    coef = coef_array(cp, n * c)
    group_norm_coefficients(partial, shift, coef, rows=n * 4, row_len=group * splits,
                            count=group * h * w, channels=c, num_groups=4, eps=1e-5,
                            centered_sums=False, gamma=gn_weight, beta=gn_bias, scale=scale)
    channel_affine(ext, ext, coef, inner=(h // pool) * (w // pool))
    assert bool((ext == (gn_bias * scale)[None, :, None, None]).all())
