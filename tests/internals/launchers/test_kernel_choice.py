"""Which GPU kernel variant and launch shape a call gets: host-side rules, checked on the CPU
with stand-ins that carry only what the rules read (shape, strides, item size, pointer)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from cufused._kernels import normalization, pooling
from cufused._kernels._common import clamp_middle, skips_max
from cufused._kernels.softmax import cluster_row_split, stats_quads
from cufused._layout import layout_strides


def device_array(shape, layout="nchw", ptr=256):
    """A float32 stand-in for a CuPy array of logical ``shape`` stored in ``layout``."""
    strides = tuple(4 * s for s in layout_strides(shape, layout))
    return types.SimpleNamespace(shape=shape, ndim=len(shape), size=int(np.prod(shape)),
                                 strides=strides, itemsize=4, data=types.SimpleNamespace(ptr=ptr))


@pytest.mark.parametrize("shape,layout,pool,expected", [
    ((512, 128, 34, 34), "nchw", 2, "bands"),    # B ieee's conv output
    ((512, 128, 34, 34), "nhwc", 2, "vec4"),     # B tf32's
    ((128, 64, 126, 126), "nhwc", 4, "rows"),    # A tf32's
    ((128, 64, 126, 126), "nchw", 4, "bands"),   # A ieee's
    ((2, 12, 9, 9), "nhwc", 3, "scalar"),        # a run-time window
    ((2, 6, 9, 9), "nhwc", 2, "scalar"),         # channels not a multiple of 4
    ((2, 12, 9, 9), "nchw", 2, "scalar"),        # odd rows: no 16-byte bands
])
def test_fused_pass_variant_default(shape, layout, pool, expected):
    assert pooling.fused_pass_variant(device_array(shape, layout), pool) == expected


def test_fused_pass_variant_misaligned_and_forced():
    y = device_array((512, 128, 34, 34), "nhwc", ptr=260)  # not 16-byte aligned
    assert pooling.fused_pass_variant(y, 2) == "scalar"
    with pytest.raises(ValueError, match="'vec4' does not apply"):
        pooling.fused_pass_variant(y, 2, "vec4")
    with pytest.raises(ValueError, match="'bands' does not apply"):
        pooling.fused_pass_variant(device_array((2, 8, 8, 8), "nhwc"), 2, "bands")


@pytest.mark.parametrize("shape,layout,groups,expected", [
    ((512, 128, 17, 17), "nhwc", 8, True),     # B tf32's pooled extrema: 16 channels a group
    ((512, 128, 17, 17), "nchw", 8, False),    # stored NCHW
    ((512, 128, 17, 17), "nhwc", 128, False),  # one channel per group: no channel quads
    ((2, 96, 5, 5), "nhwc", 2, False),         # 48 channels per group: 12 quads do not divide 32
    ((2, 64, 1, 1), "nhwc", 4, False),         # one position: plain contiguous
    ((2, 16, 64, 64), "nhwc", 1, False),       # a row of 256 KB does not stay cached
])
def test_group_norm_reads_channels_last(shape, layout, groups, expected):
    x = device_array(shape, layout)
    assert normalization.reads_channels_last(x, groups) is expected


def test_group_norm_threads():
    assert normalization.group_norm_threads(16 * 289 * 4) == 128  # B: 8 blocks fit per SM
    assert normalization.group_norm_threads(0) == 128             # rows read twice, no cache
    assert normalization.group_norm_threads(48 * 1024) == 256


@pytest.mark.parametrize("classes,dims,expected", [
    ((2, 2, 2), (16, 32, 32), 65536),   # C ieee's class blocks: 8 x 8 KB per cluster block
    ((1, 1, 1), (8, 1, 16384), 65536),  # a contiguous row of 131072 values
    ((2, 2, 2), (8, 6, 2), 384),        # the GPU test's class blocks
    ((1, 1, 1), (8, 1, 32768), None),   # 128 KB per block: past the shared memory
    ((2, 2, 2), (12, 32, 32), None),    # Md not a multiple of 8: no whole planes
    ((3, 3, 3), (8, 4, 4), None),       # 3 classes per axis (stride 3)
    ((2, 2, 2), (8, 3, 3), None),       # Mh * Mw not a multiple of 4: no 16-byte loads
    ((1, 2, 1), (8, 2, 2), None),       # output rows of SW * Mw = 2: no 16-byte stores
])
def test_cluster_row_split(classes, dims, expected):
    split = cluster_row_split(classes, dims)
    if expected is None:
        assert split is None
    else:
        assert split == (classes, dims, expected)


@pytest.mark.parametrize("channels,quads", [(64, 16), (256, 32), (128, 32), (96, 8), (12, 1),
                                             (8, 2), (4, 1), (6, 0), (3, 0)])
def test_softmax_stats_quads(channels, quads):
    # Threads per position of the 16-byte channels-last statistics kernel: each covers 4
    # channels, they divide a warp, and a channel tile (4 * quads) divides the channels.
    assert stats_quads(channels) == quads
    if quads:
        assert 32 % quads == 0 and channels % (4 * quads) == 0


@pytest.mark.parametrize("clamp,skips,middle", [
    (None, False, None),
    ((0.0, 1.0), True, 0.5),
    ((0.0, 60.0), True, 30.0),
    ((0.0, 60.5), False, None),
    ((5.0, -3.0), True, -3.0),                      # lo > hi: every value is hi
    ((2.0**31 + 100, 2.0**31 + 150), False, None),  # 2**31 and 2**31 + 256 in float32
    ((np.inf, np.inf), False, None),                # inf - inf: the online pass
    ((-np.inf, 0.0), False, None),
    ((np.inf, 7.0), True, 7.0),
])
def test_softmax_skips_the_max_pass_for_a_narrow_float32_clamp(clamp, skips, middle):
    assert skips_max(clamp) is skips
    if middle is not None:
        assert clamp_middle(clamp) == middle


def test_strategy_score_handicaps_input_conversions():
    # The autotuner's A tf32 tie (H200): "nhwc" converts the NCHW input, "nchw>nhwc" does
    # not; within the margin the one without the conversion wins, past it the faster one.
    from cufused._cudnn import _INPUT_CONVERSION_MARGIN, Strategy, strategy_score

    nhwc, mixed = Strategy("direct", "nhwc", "nhwc"), Strategy("direct", "nchw", "nhwc")
    assert strategy_score(0.412, nhwc, convert_input=False) == 0.412  # input already NHWC
    assert strategy_score(0.408, mixed, convert_input=True) == 0.408
    assert strategy_score(0.400, nhwc, True) > strategy_score(0.408, mixed, True)
    faster = 0.408 / (1 + 2 * _INPUT_CONVERSION_MARGIN)
    assert strategy_score(faster, nhwc, True) < strategy_score(0.408, mixed, True)


@pytest.mark.parametrize("shape,groups,expected", [
    ((128, 64, 126, 126), 8, "fused"),      # A's canonical convolution output
    ((1, 64, 5798, 5798), 16, "unfused"),   # a sample past 2**31 values
    ((1, 1, 1, 2**31 - 1), 1, "unfused"),   # a plane whose 32-bit loops would wrap
    ((1, 1, 1, 2**31 - 2**16), 1, "fused"),
    ((2**28, 8, 4, 4), 8, "unfused"),       # 2**31 (sample, group) rows: past a grid
    ((2**28 - 1, 8, 4, 4), 8, "fused"),
])
def test_pipelines_take_the_unfused_blocks_past_the_fused_limits(shape, groups, expected):
    from cufused.pipelines._common import gpu_method

    assert gpu_method("fused", shape, groups=groups) == expected
    assert gpu_method("unfused", shape, groups=groups) == "unfused"


def _operand(shape, layout="nchw"):
    """A stand-in operand that also says whether it is C-contiguous; "strided" is NCHW memory
    with every other element of the last axis (neither layout packed)."""
    a = device_array(shape, "nchw" if layout == "strided" else layout)
    if layout == "strided":
        a.strides = tuple(2 * s for s in a.strides)
    a.flags = types.SimpleNamespace(c_contiguous=layout == "nchw")
    return a


_S2 = dict(stride=2, padding=1)


@pytest.mark.parametrize("transposed, x_shape, w_shape, opts, precision, x_layout, expected", [
    # 2-D forward of one group, and a stride-1 transposed one as its forward convolution.
    (False, (2, 8, 20, 20), (16, 8, 3, 3), dict(padding=1), "tf32", "nchw", "_igemm_2d"),
    (True, (2, 8, 20, 20), (8, 16, 5, 5), dict(padding=1), "3xtf32", "nchw", "_igemm_2d"),
    (False, (2, 8, 20, 20), (16, 8, 3, 3), dict(padding=1), "ieee", "nchw", None),
    # A channels-last input through an NCHW copy; other strides stay on cuDNN.
    (False, (2, 8, 20, 20), (16, 8, 3, 3), dict(padding=1), "tf32", "nhwc", "_igemm_2d"),
    (False, (2, 8, 20, 20), (16, 8, 3, 3), dict(padding=1), "tf32", "strided", None),
    (False, (2, 8, 20, 20), (16, 4, 3, 3), dict(groups=2), "tf32", "nchw", None),
    (True, (2, 8, 20, 20), (8, 16, 4, 4), _S2, "tf32", "nchw", None),
    # Pipeline C's transposed 3-D convolution; other 3-D ones stay on cuDNN.
    (True, (2, 32, 4, 6, 17), (32, 64, 3, 3, 3), dict(_S2, output_padding=1), "tf32", "nchw",
     "_igemm_transposed_3d"),
    (True, (1, 3, 5, 3, 9), (3, 5, 3, 3, 3), dict(_S2, output_padding=(0, 1, 0)), "3xtf32",
     "nchw", "_igemm_transposed_3d"),
    (True, (2, 32, 4, 6, 17), (32, 64, 3, 3, 3), _S2, "ieee", "nchw", None),
    (True, (2, 32, 4, 6, 17), (32, 64, 3, 3, 3), _S2, "3xtf32", "nhwc", "_igemm_transposed_3d"),
    (True, (2, 32, 4, 6, 17), (32, 64, 3, 3, 3), _S2, "tf32", "strided", None),
    (True, (2, 33, 4, 6, 17), (33, 64, 3, 3, 3), _S2, "tf32", "nchw", None),
    (True, (2, 8, 4, 6, 6), (8, 8, 3, 3, 3), dict(stride=2, padding=0), "tf32", "nchw", None),
    (True, (2, 8, 4, 6, 6), (8, 8, 3, 3, 3), dict(padding=1), "tf32", "nchw", None),
    (True, (2, 8, 4, 6, 6), (8, 4, 3, 3, 3), dict(_S2, groups=2), "tf32", "nchw", None),
    (True, (2, 8, 4, 6, 6), (8, 8, 2, 2, 2), _S2, "tf32", "nchw", None),
    (False, (2, 8, 4, 6, 6), (8, 8, 3, 3, 3), _S2, "tf32", "nchw", None),
])
def test_implicit_gemm_routes(monkeypatch, transposed, x_shape, w_shape, opts, precision,
                              x_layout, expected):
    # Which convolutions the implicit GEMM takes (on a device with conv_transpose3d_s2k3's
    # 217 KiB of shared memory a block), and how: None leaves the problem to cuDNN.
    from cufused._kernels import conv_gemm
    from cufused._ops import convolution
    from cufused._ops._conv_args import check_conv_args

    monkeypatch.setattr(conv_gemm, "shared_per_block", lambda: 227 * 1024)
    args = check_conv_args(x_shape, w_shape, len(x_shape) - 2, transposed=transposed,
                           **{"stride": 1, "padding": 0, **opts})
    run = convolution._igemm_route(_operand(x_shape, x_layout), _operand(w_shape), args,
                                   precision, None, None)
    assert (run and run.func.__name__) == expected
    if expected:
        assert run.keywords["passes"] == (3 if precision == "3xtf32" else 1)
    if expected == "_igemm_transposed_3d":  # 99 KiB a block (compute capability 8.6, 8.9)
        monkeypatch.setattr(conv_gemm, "shared_per_block", lambda: 99 * 1024)
        assert convolution._igemm_route(_operand(x_shape, x_layout), _operand(w_shape), args,
                                        precision, None, None) is None


@pytest.mark.parametrize("case, precision, bias, winner", [
    ("A", "tf32", True, "igemm"), ("A", "3xtf32", False, "cudnn"),
    ("C", "tf32", False, "igemm"), ("C", "3xtf32", True, "cudnn"),
])
def test_pipelines_time_their_fused_path_on_each_engine(monkeypatch, case, precision, bias,
                                                         winner):
    # Pipelines A and C measure the whole fused call on random operands of the problem's
    # shapes, the implicit GEMM's path (the pass in the convolution's epilogue, or the
    # convolution run twice) against the other engine's, and take the implicit GEMM where
    # it wins. Every measured call gets the same operands and per-channel constants, formed
    # before anything is timed; the key holds everything the choice depends on.
    from cufused._kernels import conv_gemm
    from cufused._ops._conv_args import check_conv_args
    from cufused.pipelines import _common, pipeline_a, pipeline_c

    monkeypatch.setattr(conv_gemm, "shared_per_block", lambda: 227 * 1024)
    settled, timed, calls = [], [], []
    monkeypatch.setattr(_common, "settled_engine",
                        lambda key, measure: settled.append(key) or measure())

    def fastest(candidates):
        assert not calls, "a path ran before the timing"
        for name, run in candidates.items():
            timed.append(name)
            run()
        return winner

    monkeypatch.setattr(_common, "fastest", fastest)
    module = pipeline_a if case == "A" else pipeline_c
    monkeypatch.setattr(module, "_fused", lambda *args, **kw: calls.append((args, kw)))
    if case == "A":
        x_shape, w_shape, k = (2, 8, 18, 18), (16, 8, 3, 3), 4
        args = check_conv_args(x_shape, w_shape, 2, transposed=False, stride=1, padding=0)
        out_shape = (2, 16, 4, 4)
        on_igemm = pipeline_a._epilogue_applies(np, np.empty(x_shape), np.empty(w_shape),
                                                args, precision, k, 4, bias)
        flag, key = "epilogue", ("conv2d_pool_stats", x_shape, w_shape, args, precision, k,
                                 4, bias)
    else:
        x_shape, w_shape, k = (2, 8, 8, 12, 16), (8, 16, 3, 3, 3), 2
        pooled = (2, 8, 4, 6, 8)
        args = check_conv_args(pooled, w_shape, 3, transposed=True, stride=2, padding=1,
                               output_padding=1)
        out_shape = args.out_shape
        on_igemm = pipeline_c._recompute_applies(np, np.empty(x_shape), np.empty(w_shape),
                                                 args, precision, k, pooled, bias, 0.0, 1.0)
        flag, key = "recompute", ("conv_transpose3d_s2k3", x_shape, w_shape, args, precision,
                                  k, bias)
    assert on_igemm == (winner == "igemm")
    assert settled == [key] and timed == ["cudnn", "igemm"]
    assert [kw[flag] for _, kw in calls] == [False, True]
    (first, first_kw), (second, second_kw) = calls
    x, weight, out = first[1], first[2], first[5]
    assert (x.shape, weight.shape, out.shape) == (x_shape, w_shape, out_shape)
    assert x.dtype == weight.dtype == out.dtype == np.float32
    assert 0 <= x.min() and x.max() < 1 and weight.min() < 0 < weight.max()
    assert first[0] is np and first[3] == args and first[4] == precision
    assert all(a is b for a, b in zip(first, second))
    assert all(first_kw[name] is second_kw[name] for name in first_kw if name != flag)
    assert (first_kw["conv_bias"] is None) != bias
    if bias:
        assert not first_kw["conv_bias"].any()
    assert (first_kw["scale"] == 1).all()
