"""Transposed convolutions that no cuDNN plan computes run as forward convolutions of the
spread-out input, and forward convolutions that none computes by their definition (and the
pipelines take those routes too)."""

from __future__ import annotations

import numpy as np
import pytest

import cufused

from conftest import GPU, assert_close, assert_nonfinite_placement

pytestmark = pytest.mark.gpu

if GPU:
    import cupy as cp


@pytest.mark.parametrize("case", [
    ((1, 2, 5, 5), (2, 3, 3, 3), dict(stride=(1, 3), dilation=3, output_padding=1)),
    ((2, 4, 6, 5), (4, 3, 3, 2), dict(stride=(2, 1), padding=(2, 1), output_padding=(1, 0),
                                      dilation=(1, 2), groups=2)),
    ((1, 2, 4, 4, 3), (2, 2, 3, 2, 2), dict(stride=(2, 1, 2), padding=(1, 0, 2),
                                            output_padding=(1, 0, 1), dilation=(2, 1, 1))),
], ids=["issue-case", "groups", "3d"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_transposed_conv_without_a_cudnn_plan(rng, case, precision):
    xs, ws, opts = case
    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(
        ws[1] * opts.get("groups", 1))
    fn = cufused.conv_transpose2d if len(xs) == 4 else cufused.conv_transpose3d
    ref = fn(x, w, b, **opts)
    out = cp.full(ref.shape, cp.nan, dtype=cp.float32)
    got = fn(*(cp.asarray(a, dtype=cp.float32) for a in (x, w, b)), precision=precision,
             out=out, **opts)
    assert got is out
    assert_close(got.get(), ref, {"ieee": 1e-5, "tf32": 5e-3}[precision])


def _no_cudnn_plan(monkeypatch, forward: bool = False):
    """Make every transposed-convolution plan (with ``forward``, every plan) unsupported, as
    for options cuDNN rejects."""
    from cufused import _cudnn
    from cufused._ops import convolution

    real = convolution._plan

    def plan(x_shape, w_shape, args, *rest):
        if args.transposed or forward:
            raise _cudnn.UnsupportedConvolution("forced by the test")
        return real(x_shape, w_shape, args, *rest)

    cufused.clear_caches()  # no whole-call graph of an earlier test replays a plan
    monkeypatch.setattr(convolution, "_plan", plan)


@pytest.mark.parametrize("name, xs, ws, opts", [
    ("conv2d", (2, 3, 9, 8), (4, 3, 3, 2), dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2))),
    ("conv2d", (1, 4, 7, 6), (6, 2, 3, 3), dict(padding="same", groups=2)),
    ("conv3d", (2, 2, 5, 4, 6), (3, 2, 2, 3, 3), dict(stride=(1, 2, 1), padding=1)),
    # through the forward route
    ("conv_transpose2d", (2, 3, 6, 7), (3, 2, 2, 2), dict(stride=2, output_padding=1)),
], ids=["2d", "2d-groups-same", "3d", "transposed"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_convolution_without_any_cudnn_plan(rng, monkeypatch, name, xs, ws, opts, layout):
    # Every output by the definition, with its NaN and infinities: a planted infinite input
    # and a NaN weight tap.
    _no_cudnn_plan(monkeypatch, forward=True)
    fn = getattr(cufused, name)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    x[0, 0, 1, 1] = np.inf
    w[1, 0, 0, 0] = np.nan
    b = rng.standard_normal(ws[1] * opts.get("groups", 1) if "transpose" in name else ws[0])
    ref = fn(x, w, b, **opts)
    out = cp.full(ref.shape, cp.nan, dtype=cp.float32)
    if layout == "channels_last":
        out = cp.moveaxis(cp.full(ref.shape[:1] + ref.shape[2:] + ref.shape[1:2], cp.nan,
                                  dtype=cp.float32), -1, 1)
    for _ in range(2):  # the second call captured into a whole-call graph
        got = fn(*(cp.asarray(a, dtype=cp.float32) for a in (x, w, b)), out=out, **opts)
        assert got is out
        assert_nonfinite_placement(got.get(), ref, 1e-5)


def test_pipeline_a_without_any_cudnn_plan(rng, monkeypatch):
    _no_cudnn_plan(monkeypatch, forward=True)
    x = rng.random((3, 4, 10, 9))
    w = rng.standard_normal((8, 4, 3, 3)) * 0.3
    cb, gw, gb = (rng.standard_normal(8) for _ in range(3))
    s = rng.standard_normal((8, 1, 1))
    opts = dict(num_groups=4, pool_kernel=2, clamp_min=-0.5, clamp_max=0.5, padding=1)
    ref = cufused.conv2d_groupnorm_scale_maxpool_clamp(x, w, cb, gw, gb, s, **opts)
    for method in ("fused", "unfused"):
        got = cufused.conv2d_groupnorm_scale_maxpool_clamp(
            *(cp.asarray(a, dtype=cp.float32) for a in (x, w, cb, gw, gb, s)), **opts,
            precision="ieee", method=method)
        assert_close(got.get(), ref, 1e-4)


def test_pipelines_take_the_forward_route(rng, monkeypatch):
    _no_cudnn_plan(monkeypatch)
    x = rng.random((3, 4, 6, 6))
    w = rng.standard_normal((4, 8, 3, 3)) * 0.3
    bw, bb, gw, gb = (rng.standard_normal(8) for _ in range(4))
    opts = dict(num_groups=4, stride=1, padding=1)
    ref = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(x, w, bw, bb, gw, gb,
                                                                     **opts)
    got = cufused.conv_transpose2d_batchnorm_tanh_maxpool_groupnorm(
        *(cp.asarray(a, dtype=cp.float32) for a in (x, w, bw, bb, gw, gb)), **opts)
    assert_close(got.get(), ref, 1e-4)
    x = rng.random((2, 3, 4, 6, 6))
    w = rng.standard_normal((3, 4, 3, 3, 3)) * 0.3
    s = rng.standard_normal(4)
    opts = dict(stride=2, padding=1, output_padding=1, pool_kernel=2, clamp_min=0.0,
                clamp_max=1.0)
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(x, w, s, **opts)
    got = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
        *(cp.asarray(a, dtype=cp.float32) for a in (x, w, s)), **opts)
    assert_close(got.get(), ref, 1e-5)


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_pipeline_c_forward_route_non_finite_weight(rng, monkeypatch, precision):
    # The forward route (padding 0: not a problem of conv_transpose3d_s2k3) leaves such
    # channels to the pipeline's rewrite of their softmax rows.
    _no_cudnn_plan(monkeypatch)
    x = rng.random((2, 3, 4, 6, 6))
    w = rng.standard_normal((3, 5, 3, 3, 3)) * 0.3
    w[0, 1, 0, 0, 0], w[2, 3, 1, 2, 1] = np.inf, np.nan
    s = rng.standard_normal(5)
    opts = dict(stride=2, padding=0, output_padding=1, pool_kernel=2, clamp_min=-0.5,
                clamp_max=1.0)
    ref = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(x, w, s, **opts)
    assert np.isnan(ref[:, 3]).all() and np.isfinite(ref[:, [0, 1, 2, 4]]).all()
    out = cp.full(ref.shape, cp.nan, dtype=cp.float32)
    got = cufused.conv_transpose3d_avgpool_clamp_softmax_multiply(
        *(cp.asarray(a, dtype=cp.float32) for a in (x, w, s)), precision=precision, out=out,
        **opts)
    assert_nonfinite_placement(got.get(), ref, {"ieee": 1e-5, "tf32": 5e-3}[precision])
