"""conv_on_gpu's handling of the DFT engine without a GPU: the cuDNN plan that a caller's
capture falls back to is built beforehand where cuDNN has one, and its absence does not stop
the engine's call."""

from __future__ import annotations

import numpy as np
import pytest

from cufused._ops import convolution
from cufused._ops._conv_args import cached_conv_args


@pytest.mark.parametrize("cudnn_has_plan", [True, False])
def test_dft_engine_builds_the_capture_fallback_plan(monkeypatch, cudnn_has_plan):
    from cufused._cudnn import UnsupportedConvolution

    args = cached_conv_args((2, 3, 6, 6), (3, 4, 3, 3), 2, transposed=True, stride=1,
                            padding=1, output_padding=0, groups=1)
    x, w = np.ones((2, 3, 6, 6), np.float32), np.ones((3, 4, 3, 3), np.float32)
    ran, plans = [], []

    def plan(x_shape, w_shape, conv_args, precision, *rest):
        plans.append((x_shape, w_shape, conv_args, precision))
        if not cudnn_has_plan:
            raise UnsupportedConvolution("no plan")

    monkeypatch.setattr(convolution, "own_engine", lambda *a, **k: (
        "fft", lambda x, w, bias, y: ran.append(y.shape)))
    monkeypatch.setattr(convolution, "_plan", plan)
    monkeypatch.setattr(convolution, "_empty_nchw", lambda shape: np.empty(shape, np.float32))
    y, layout = convolution.conv_on_gpu(x, w, args, "ieee", convert_output=False,
                                        batch_statistics=True)
    assert layout == "nchw" and y.shape == args.out_shape == (2, 4, 6, 6)
    assert ran == [args.out_shape]
    assert plans == [((2, 3, 6, 6), (3, 4, 3, 3), args, "ieee")]


def test_other_engines_build_no_extra_plan(monkeypatch):
    args = cached_conv_args((2, 3, 6, 6), (3, 4, 3, 3), 2, transposed=True, stride=1,
                            padding=1, output_padding=0, groups=1)
    x, w = np.ones((2, 3, 6, 6), np.float32), np.ones((3, 4, 3, 3), np.float32)
    plans = []
    monkeypatch.setattr(convolution, "own_engine", lambda *a, **k: (
        "igemm", lambda x, w, bias, y: None))
    monkeypatch.setattr(convolution, "_plan", lambda *a: plans.append(a))
    monkeypatch.setattr(convolution, "_empty_nchw", lambda shape: np.empty(shape, np.float32))
    convolution.conv_on_gpu(x, w, args, "3xtf32")
    assert plans == []


@pytest.mark.parametrize("batch_statistics", [False, True])
@pytest.mark.parametrize("settled, capturing", [("fft", False), ("fft", True),
                                                ("igemm", True), ("cudnn", False)])
def test_own_engine_routes(monkeypatch, batch_statistics, settled, capturing):
    # The DFT engine is a candidate only for a convolution feeding batch statistics; the
    # settled engine's key names the candidates; inside a caller's capture the DFT engine
    # gives way to cuDNN (cufused's cuBLAS handle joins only its own captures), the implicit
    # GEMM does not.
    args = cached_conv_args((2, 3, 6, 6), (3, 4, 3, 3), 2, transposed=True, stride=1,
                            padding=1, output_padding=0, groups=1)
    x, w = np.ones((2, 3, 6, 6), np.float32), np.ones((3, 4, 3, 3), np.float32)
    runs = {"igemm": lambda *a: None, "fft": lambda *a: None}
    asked, keys = [], []
    monkeypatch.setattr(convolution, "_igemm_route", lambda *a: runs["igemm"])
    monkeypatch.setattr(convolution, "_fft_route",
                        lambda *a: asked.append(a[3]) or runs["fft"])
    monkeypatch.setattr(convolution, "_settled_conv_engine",
                        lambda x, w_shape, a, bias, precision, routes, out:
                        keys.append(tuple(routes)) or settled)
    monkeypatch.setattr(convolution, "_caller_capturing", lambda: capturing)
    engine = convolution.own_engine(x, w, args, "ieee", batch_statistics=batch_statistics)
    assert asked == (["ieee"] if batch_statistics else [])
    assert keys == [("igemm", "fft") if batch_statistics else ("igemm",)]
    if settled == "cudnn" or (settled == "fft" and (capturing or not batch_statistics)):
        assert engine is None
    else:
        assert engine == (settled, runs[settled])


def test_fft_route_refuses_tf32_bias_and_forward():
    class Dense:
        class flags:
            c_contiguous = True

    transposed = cached_conv_args((2, 3, 6, 6), (3, 4, 3, 3), 2, transposed=True, stride=1,
                                  padding=1, output_padding=0, groups=1)
    forward = cached_conv_args((2, 3, 6, 6), (4, 3, 3, 3), 2, transposed=False, stride=1,
                               padding=1, dilation=1, groups=1)
    x, w = Dense(), Dense()
    assert convolution._fft_route(x, w, transposed, "tf32", None, None) is None
    assert convolution._fft_route(x, w, transposed, "ieee", np.ones(4), None) is None
    assert convolution._fft_route(x, w, forward, "3xtf32", None, None) is None
