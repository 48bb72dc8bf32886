"""Transposed convolutions that no cuDNN plan computes run as forward convolutions of the
spread-out input (and the pipelines take that route too)."""

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


def _no_cudnn_plan(monkeypatch):
    """Make every transposed-convolution plan unsupported, as for options cuDNN rejects."""
    from cufused import _cudnn
    from cufused._ops import convolution

    real = convolution._plan

    def plan(x_shape, w_shape, args, *rest):
        if args.transposed:
            raise _cudnn.UnsupportedConvolution("forced by the test")
        return real(x_shape, w_shape, args, *rest)

    monkeypatch.setattr(convolution, "_plan", plan)


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
