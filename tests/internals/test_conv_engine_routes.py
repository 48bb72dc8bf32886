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
