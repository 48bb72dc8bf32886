"""The implicit-GEMM tensor-core convolution (conv_gemm.cu: the halo kernel where a chunk of
input channels fits its shared memory, else the gathering one) against the float64
reference: TF32 to TF32 accuracy, 3xTF32 to float32 accuracy, odd shapes, strides, padding,
dilation, bias, NaN-poisoned outputs."""

from __future__ import annotations

import numpy as np
import pytest

from cufused import reference

from conftest import GPU, assert_close

pytestmark = pytest.mark.gpu

if GPU:
    import cupy as cp

    from cufused._kernels.conv_gemm import conv2d_implicit_gemm

CASES = [
    # x shape, w shape, stride, padding, dilation
    ((2, 8, 20, 18), (64, 8, 3, 3), (1, 1), (0, 0), (1, 1)),
    ((3, 5, 17, 13), (7, 5, 3, 3), (1, 1), (0, 0), (1, 1)),  # K, C not multiples of 4
    ((2, 6, 19, 23), (9, 6, 3, 5), (2, 1), (1, 2), (1, 2)),
    ((1, 3, 11, 11), (130, 3, 1, 1), (3, 3), (0, 0), (1, 1)),  # K over two column tiles
    ((4, 16, 9, 9), (32, 16, 5, 5), (1, 1), (2, 2), (1, 1)),   # reduction 400: many steps
    ((1, 1, 130, 3), (1, 1, 2, 2), (1, 1), (0, 0), (1, 1)),    # one output channel
    ((2, 8, 13, 40), (70, 8, 3, 3), (1, 1), (0, 0), (1, 1)),   # halo: K past one tile
    ((2, 19, 11, 37), (12, 19, 3, 3), (1, 1), (1, 1), (1, 1)),  # 3 x 3 compiled in: 3 chunks
    ((1, 11, 9, 9), (9, 11, 5, 5), (1, 1), (2, 2), (1, 1)),    # halo: 6 channel chunks
    ((1, 3, 70, 70), (5, 3, 3, 3), (1, 1), (0, 0), (30, 30)),  # halo too large: gathering
    ((1, 2, 12, 12), (5, 2, 9, 9), (1, 1), (0, 0), (1, 1)),    # 81 > 72 values: gathering
]


def assert_run_moments(partial, y, tol: float) -> None:
    """conv2d_pool_stats' partials against the float64 convolution output y: run s of a
    sample covers its 4 x 32 tiles (row-major) s * T // S to (s + 1) * T // S; each run's
    shift is y at its first pixel, its count its pixels (exact), its sums those of y minus
    the shift it reports."""
    partial = partial.get()
    n, k, p, q = y.shape
    splits = partial.shape[2]
    tiles_w = -(-q // 32)
    tiles = -(-p // 4) * tiles_w
    assert partial.shape == (n, k, splits, 4)
    for s in range(splits):
        first, end = s * tiles // splits, (s + 1) * tiles // splits
        inside = np.zeros((p, q), dtype=bool)
        for t in range(first, end):
            tr, tc = divmod(t, tiles_w)
            inside[4 * tr:4 * tr + 4, 32 * tc:32 * tc + 32] = True
        tr, tc = divmod(first, tiles_w)
        run = partial[:, :, s]
        assert (run[..., 3].view(np.int32) == inside.sum()).all()
        assert_close(run[..., 2], y[:, :, 4 * tr, 32 * tc], tol)
        d = y[:, :, inside] - run[..., 2, None].astype(np.float64)
        assert_close(run[..., 0], d.sum(-1), 10 * tol)
        assert_close(run[..., 1], (d * d).sum(-1), 10 * tol)


@pytest.mark.parametrize("passes, tol", [(1, 2e-3), (3, 2e-6)])
@pytest.mark.parametrize("x_shape, w_shape, stride, padding, dilation", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_against_float64_reference(rng, x_shape, w_shape, stride, padding, dilation,
                                   with_bias, passes, tol):
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal(w_shape)
    b = rng.standard_normal(w_shape[0]) if with_bias else None
    ref = reference.conv(x, w, b, stride, padding, dilation, 1)
    y = cp.full(ref.shape, cp.nan, dtype=cp.float32)
    conv2d_implicit_gemm(cp.asarray(x, cp.float32), cp.asarray(w, cp.float32),
                         None if b is None else cp.asarray(b, cp.float32), y,
                         stride=stride, padding=padding, dilation=dilation, passes=passes)
    assert_close(y.get(), ref, tol)


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("q_extra", [0, 1])
def test_output_rows_of_any_alignment(rng, offset, q_extra):
    # The halo kernel writes pairs of floats where every output row starts 8-byte aligned
    # (even Q, aligned y), else single floats: an output view one float into its buffer and
    # an odd row length take the second way, against the same float64 reference.
    x = rng.standard_normal((2, 8, 10, 36 + q_extra))
    w = rng.standard_normal((20, 8, 3, 3))
    ref = reference.conv(x, w, None, (1, 1), (0, 0), (1, 1), 1)
    buf = cp.full(ref.size + 1, cp.nan, dtype=cp.float32)
    y = buf[offset:offset + ref.size].reshape(ref.shape)
    conv2d_implicit_gemm(cp.asarray(x, cp.float32), cp.asarray(w, cp.float32), None, y,
                         stride=(1, 1), padding=(0, 0), dilation=(1, 1), passes=3)
    assert_close(y.get(), ref, 2e-6)
    outside = buf[-1] if offset == 0 else buf[0]  # the buffer's float that y leaves out
    assert bool(cp.isnan(outside))


def assert_written_inside(buf, y, ref, nonfinite: bool, tol: float) -> None:
    """``y``, a view 4 floats into the NaN-filled ``buf`` (4 more after it), against the
    float64 reference ``ref``: NaN and infinities where ``ref`` has them (``nonfinite``),
    else its values to ``tol``; nothing written outside ``y``."""
    assert bool(cp.isnan(buf[:4]).all()) and bool(cp.isnan(buf[-4:]).all())
    got = y.get()
    if nonfinite:
        for mask in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(mask(got), mask(ref))
    else:
        assert_close(got, ref, tol)


def launched_names(monkeypatch, conv_gemm, sms: int) -> list[str]:
    """The names of the kernels that ``conv_gemm`` launches from now on (a list that grows),
    its grids sized for ``sms`` multiprocessors."""
    monkeypatch.setattr(conv_gemm, "sm_count", lambda: sms)
    names = []
    launch = conv_gemm.get_kernel
    monkeypatch.setattr(conv_gemm, "get_kernel",
                        lambda filename, name, **kw: names.append(name) or launch(filename,
                                                                                  name, **kw))
    return names


@pytest.mark.parametrize("sms", [1, 8])
@pytest.mark.parametrize("x_shape, w_shape, padding", [
    ((5, 8, 21, 70), (24, 8, 3, 3), (0, 0)),   # 3 tiles a row: a pair, the last alone
    ((2, 8, 13, 131), (70, 8, 3, 3), (1, 1)),  # 5 tiles a row, K past one tile
    ((3, 6, 9, 33), (9, 6, 5, 5), (2, 2)),     # the geometry as arguments
])
def test_tiles_stored_alone_or_in_pairs(rng, monkeypatch, x_shape, w_shape, padding, sms):
    # The plain kernel stages two neighbouring tiles and stores them together (SPAN 2) or
    # one tile at a time (SPAN 1): both give the float64 reference's values and each other's
    # bits, with blocks taking several groups (one multiprocessor: 2 blocks) or a few.
    from cufused._kernels import conv_gemm

    names = launched_names(monkeypatch, conv_gemm, sms)
    monkeypatch.setattr(conv_gemm, "halo_bands_shared", lambda *args: 0)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    ref = reference.conv(x, w, None, (1, 1), padding, (1, 1), 1)
    xg, wg = cp.asarray(x, cp.float32), cp.asarray(w, cp.float32)
    for passes, tol in ((1, 2e-3), (3, 2e-6)):
        halo = conv_gemm.halo_geometry(x_shape[1], w_shape[2:], (1, 1), (1, 1), passes)
        if halo is None or conv_gemm.halo_shared_bytes(*halo[:4], passes, span=2) > (
                conv_gemm.shared_per_block()):
            pytest.skip("this device's blocks do not hold the pair's scratch")
        outs = []
        for span in (2, 1):
            monkeypatch.setattr(conv_gemm, "halo_span", lambda *args, span=span: span)
            y = cp.full(ref.shape, cp.nan, dtype=cp.float32)
            conv_gemm.conv2d_implicit_gemm(xg, wg, None, y, stride=(1, 1), padding=padding,
                                           dilation=(1, 1), passes=passes)
            assert names[-1] == f"conv2d_halo<{passes}, {halo[3]}, {span}>"
            assert_close(y.get(), ref, tol)
            outs.append(y)
        assert bool(cp.array_equal(outs[0], outs[1]))


@pytest.mark.parametrize("sms", [1, 8])
@pytest.mark.parametrize("x_shape, c_out, padding, with_bias", [
    ((3, 8, 13, 128), 64, (1, 1), True),  # rows of 128 columns, a last band of 1 row
    ((2, 19, 10, 103), 70, (0, 0), True),  # 3 chunks of input channels, Q odd, 3 blocks
    ((3, 8, 9, 102), 40, (0, 0), True),  # a last band of 3 rows, 8 channels in block 2
    ((2, 3, 11, 70), 33, (2, 2), False),  # the halo a float at a time, 1 channel past 32
    ((1, 8, 6, 68), 64, (1, 0), True),  # rows of 66 columns: 2 of the second tile's 64
    ((2, 8, 4, 68), 64, (0, 0), False),  # one band of 2 rows
    ((1, 8, 6, 67), 64, (0, 0), True),  # rows of 65 columns: 63 staged to the left
])
def test_bands_of_whole_rows(rng, monkeypatch, x_shape, c_out, padding, with_bias, sms):
    # TF32 on the wgmma build stores bands of 4 whole output rows by bulk copies
    # (conv2d_halo_bands): the float64 reference's values and conv2d_halo's bits, with
    # blocks taking many bands (one multiprocessor) or a few, NaN and infinities where the
    # reference has them, and nothing written outside y (a view 16 bytes into a NaN buffer);
    # y 4 bytes into its buffer takes conv2d_halo.
    from cufused._kernels import conv_gemm

    if conv_gemm.arch_target(conv_gemm._FILE) != "sm_90a":
        pytest.skip("conv2d_halo_bands runs on the wgmma build (compute capability 9.0)")
    names = launched_names(monkeypatch, conv_gemm, sms)
    bands = conv_gemm.halo_bands_shared
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal((c_out, x_shape[1], 3, 3))
    bias = rng.standard_normal(c_out) if with_bias else None
    for nonfinite in (False, True):
        if nonfinite:
            x[0, 0, 2, 3], x[-1, -1, -1, -1], w[c_out // 2, 0, 1, 1] = np.nan, np.inf, -np.inf
        ref = reference.conv(x, w, bias, (1, 1), padding, (1, 1), 1)
        to_gpu = [None if a is None else cp.asarray(a, cp.float32) for a in (x, w, bias)]
        outs = []
        for use_bands, name in ((True, "conv2d_halo_bands"), (False, "conv2d_halo<1, 3, ")):
            monkeypatch.setattr(conv_gemm, "halo_bands_shared",
                                bands if use_bands else lambda *args: 0)
            buf = cp.full(ref.size + 8, cp.nan, dtype=cp.float32)
            y = buf[4:4 + ref.size].reshape(ref.shape)
            conv_gemm.conv2d_implicit_gemm(*to_gpu, y, stride=(1, 1), padding=padding,
                                           dilation=(1, 1), passes=1)
            assert names[-1].startswith(name)
            assert_written_inside(buf, y, ref, nonfinite, 2e-3)
            outs.append(y)
        assert bool(cp.array_equal(outs[0], outs[1], equal_nan=True))
    monkeypatch.setattr(conv_gemm, "halo_bands_shared", bands)
    y = cp.full(ref.size + 1, cp.nan, dtype=cp.float32)[1:].reshape(ref.shape)
    conv_gemm.conv2d_implicit_gemm(*to_gpu, y, stride=(1, 1), padding=padding,
                                   dilation=(1, 1), passes=1)
    assert names[-1].startswith("conv2d_halo<1, 3, ")
    assert bool(cp.array_equal(y, outs[1], equal_nan=True))


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("sms", [1, 8])
@pytest.mark.parametrize("x_shape, w_shape, padding", [
    ((2, 8, 30, 36), (64, 8, 3, 3), (1, 1)),    # a channel tile of two boxes
    ((3, 5, 17, 61), (68, 5, 3, 3), (0, 0)),    # K past a tile, rows and columns clipped
    ((2, 19, 11, 37), (36, 19, 3, 3), (1, 1)),  # 3 chunks; the second box of 4 channels
    ((3, 6, 9, 33), (12, 6, 5, 5), (2, 2)),     # the geometry as arguments
])
def test_channels_last_stores(rng, monkeypatch, x_shape, w_shape, padding, sms, passes):
    # On the wgmma build conv2d_halo_nhwc writes a packed channels-last y by tensor stores (K
    # % 4 == 0, y 16-byte aligned), and 3xTF32 with the geometry compiled in (one chunk of
    # input channels) from the accumulators (conv2d_halo_nhwc_direct) or, first, with the
    # weights held in registers (conv2d_nhwc_held_weights, then the channels of non-finite
    # weights by the definition): the float64 reference's values, the thread stores' bits
    # (the held weights sum in another order), NaN and infinities where the reference has
    # them, nothing written outside y (a view 16 bytes into a NaN buffer), with blocks taking
    # many tiles (one multiprocessor: the tiles take the tensor stores' two buffers in turn)
    # or a few.
    from cufused._kernels import conv_gemm

    if conv_gemm.arch_target(conv_gemm._FILE) != "sm_90a":
        pytest.skip("these stores run on the wgmma build (compute capability 9.0)")
    names = launched_names(monkeypatch, conv_gemm, sms)
    held, direct, tensor = (conv_gemm.held_weights_map, conv_gemm.nhwc_direct_shared,
                            conv_gemm._nhwc_tensor)
    paths = ["NHWC_TENSOR", "NHWC_THREADS"]
    if passes == 3 and x_shape[1] <= 8 and w_shape[2] == 3:
        paths[:0] = ["held", "direct"]
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal(w_shape) * 0.3
    bias = rng.standard_normal(w_shape[0])
    for nonfinite in (False, True):
        if nonfinite:
            x[0, 0, 2, 3], x[-1, -1, -1, -1], w[w_shape[0] // 2, 0, 0, 0] = np.nan, np.inf, np.inf
        ref = reference.conv(x, w, bias, (1, 1), padding, (1, 1), 1)
        n, k, p, q = ref.shape
        to_gpu = [cp.asarray(a, cp.float32) for a in (x, w, bias)]
        outs = []
        for path in paths:
            monkeypatch.setattr(conv_gemm, "held_weights_map",
                                held if path == "held" else lambda *args: None)
            monkeypatch.setattr(conv_gemm, "nhwc_direct_shared",
                                direct if path == "direct" else lambda *args: 0)
            monkeypatch.setattr(conv_gemm, "_nhwc_tensor",
                                tensor if path == "NHWC_TENSOR" else lambda *args: None)
            buf = cp.full(ref.size + 8, cp.nan, dtype=cp.float32)
            y = buf[4:4 + ref.size].reshape(n, p, q, k).transpose(0, 3, 1, 2)
            conv_gemm.conv2d_implicit_gemm(*to_gpu, y, stride=(1, 1), padding=padding,
                                           dilation=(1, 1), passes=passes)
            if path == "held":
                assert names[-2:] == ["conv2d_nhwc_held_weights",
                                      "conv_nonfinite_weight_rows<ForwardConvDefinition>"]
            elif path == "direct":
                assert names[-1] == "conv2d_halo_nhwc_direct<3, 3>"
            else:
                assert names[-1].startswith(f"conv2d_halo_nhwc<{passes}, ")
                assert names[-1].endswith(f"{path}>")
            assert_written_inside(buf, y, ref, nonfinite, 2e-3 if passes == 1 else 1e-5)
            if path != "held":
                outs.append(y)
        for other in outs[1:]:
            assert bool(cp.array_equal(outs[0], other, equal_nan=True))


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("k", [3, 5, 9])  # halo: 3 x 3 compiled in, 5 x 5; gathering
def test_non_finite_inputs_propagate(rng, passes, k):
    x = rng.standard_normal((1, 4, 6, 6))
    w = rng.standard_normal((8, 4, k, k))
    x[0, 1, 2, 3], x[0, 2, 0, 0], w[5, 0, 1, 1] = np.nan, np.inf, -np.inf
    w[6, 1, 0, 0] = np.inf  # a corner tap: the padding's zeros meet it (0 * inf: NaN)
    pad = (k // 2, k // 2)
    ref = reference.conv(x, w, None, (1, 1), pad, (1, 1), 1)
    y = cp.empty(ref.shape, dtype=cp.float32)
    conv2d_implicit_gemm(cp.asarray(x, cp.float32), cp.asarray(w, cp.float32), None, y,
                         stride=(1, 1), padding=pad, dilation=(1, 1), passes=passes)
    got = y.get()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))


@pytest.mark.parametrize("x_offset", [0, 1, 2])
@pytest.mark.parametrize("width, padding", [(40, 0), (40, 4), (40, 1), (38, 0)])
def test_halo_copies_of_any_alignment(rng, x_offset, width, padding):
    # The compiled-in 3 x 3 halo is copied 4 floats at a time where every 4 columns of its
    # rows are inside the input or outside together (W and the padding multiples of 4, x
    # 16-byte aligned), else one float at a time: x as a view 1 or 2 floats into its
    # buffer, a padding of 1 and an odd W / 2 take the second way; the pooling epilogue's
    # windows and sums check the same halo.
    from cufused._kernels.conv_gemm import conv2d_pool_stats

    x = rng.standard_normal((3, 8, 13, width))
    w = rng.standard_normal((16, 8, 3, 3))
    bias = rng.standard_normal(16)
    pad = (padding, padding)
    ref = reference.conv(x, w, bias, (1, 1), pad, (1, 1), 1)
    buf = cp.empty(x.size + x_offset, dtype=cp.float32)
    xg = buf[x_offset:].reshape(x.shape)
    xg[...] = cp.asarray(x, cp.float32)
    y = cp.full(ref.shape, cp.nan, dtype=cp.float32)
    conv2d_implicit_gemm(xg, cp.asarray(w, cp.float32), cp.asarray(bias, cp.float32), y,
                         stride=(1, 1), padding=pad, dilation=(1, 1), passes=1)
    assert_close(y.get(), ref, 2e-3)
    n, k, p, q = ref.shape
    ext = cp.full((n, k, p // 4, q // 4), cp.nan, dtype=cp.float32)
    partial, _ = conv2d_pool_stats(
        cp, xg, cp.asarray(w, cp.float32), cp.asarray(bias, cp.float32), ext, sign_a=None,
        sign_b=None, stride=(1, 1), padding=pad, dilation=(1, 1), pool=4, passes=1)
    win = ref[:, :, :p // 4 * 4, :q // 4 * 4].reshape(n, k, p // 4, 4, q // 4, 4)
    assert_close(ext.get(), win.max(axis=(3, 5)), 2e-3)
    assert_run_moments(partial, ref, 2e-3)


@pytest.mark.parametrize("passes, tol", [(1, 2e-3), (3, 2e-6)])
@pytest.mark.parametrize("x_shape, w_shape, pool, stride, padding", [
    ((2, 8, 20, 18), (64, 8, 3, 3), 4, (1, 1), (0, 0)),     # pipeline A's form
    ((3, 5, 13, 40), (70, 5, 3, 3), 4, (1, 1), (0, 0)),     # K past one tile, edge tiles
    ((1, 3, 9, 37), (12, 3, 3, 3), 2, (1, 1), (0, 0)),
    ((2, 11, 21, 37), (16, 11, 3, 3), 2, (1, 1), (1, 1)),  # 2 chunks, padding
    ((2, 6, 21, 40), (8, 6, 3, 3), 2, (2, 1), (1, 1)),     # the geometry as arguments
    ((1, 3, 17, 70), (8, 3, 3, 3), 4, (2, 2), (0, 0)),     # an odd halo: 3 x 9 x 65
])
def test_pool_stats_epilogue(rng, x_shape, w_shape, pool, stride, padding, passes, tol):
    # The window extrema (max, or min where the sign is negative) and each run's shift,
    # count and shifted sums against their definitions on the float64 convolution.
    from cufused._kernels.conv_gemm import conv2d_pool_stats

    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    bias, sign = rng.standard_normal(w_shape[0]), rng.standard_normal(w_shape[0])
    y = reference.conv(x, w, bias, stride, padding, (1, 1), 1)
    n, k, p, q = y.shape
    ho, wo = p // pool, q // pool
    ext = cp.full((n, k, ho, wo), cp.nan, dtype=cp.float32)
    partial, _ = conv2d_pool_stats(
        cp, cp.asarray(x, cp.float32), cp.asarray(w, cp.float32), cp.asarray(bias, cp.float32),
        ext, sign_a=cp.asarray(sign, cp.float32), sign_b=None, stride=stride, padding=padding,
        dilation=(1, 1), pool=pool, passes=passes)
    win = y[:, :, :ho * pool, :wo * pool].reshape(n, k, ho, pool, wo, pool)
    want = np.where(sign[None, :, None, None] < 0, win.min(axis=(3, 5)), win.max(axis=(3, 5)))
    assert_close(ext.get(), want, tol)
    assert_run_moments(partial, y, tol)


@pytest.mark.parametrize("pool, passes", [(2, 1), (4, 1), (4, 3)])
def test_blocks_that_take_many_tiles(rng, monkeypatch, pool, passes):
    # With two resident blocks (one multiprocessor) every block takes many tiles: the plain
    # kernel strides over them, the pooling one takes runs of several consecutive tiles of
    # one sample after another (5 runs per sample here: blocks change sample between runs),
    # its sums carried over each run's tiles. 3xTF32's 4 x 4 windows on the wgmma build: the
    # held weights' three blocks, each taking runs of many tiles too.
    from cufused._kernels import conv_gemm

    names = launched_names(monkeypatch, conv_gemm, 1)
    x = rng.standard_normal((5, 8, 21, 70))
    w = rng.standard_normal((24, 8, 3, 3))
    bias, sign = rng.standard_normal(24), rng.standard_normal(24)
    ref = reference.conv(x, w, bias, (1, 1), (0, 0), (1, 1), 1)
    xg, wg, bg = (cp.asarray(a, cp.float32) for a in (x, w, bias))
    y = cp.full(ref.shape, cp.nan, dtype=cp.float32)
    conv_gemm.conv2d_implicit_gemm(xg, wg, bg, y, stride=(1, 1), padding=(0, 0),
                                   dilation=(1, 1), passes=1)
    assert_close(y.get(), ref, 2e-3)
    n, k, p, q = ref.shape
    ext = cp.full((n, k, p // pool, q // pool), cp.nan, dtype=cp.float32)
    partial, splits = conv_gemm.conv2d_pool_stats(
        cp, xg, wg, bg, ext, sign_a=cp.asarray(sign, cp.float32), sign_b=None, stride=(1, 1),
        padding=(0, 0), dilation=(1, 1), pool=pool, passes=passes)
    held = passes == 3 and conv_gemm.arch_target(conv_gemm._FILE) == "sm_90a"
    assert (names[-1] == "conv2d_held_weights_pool_stats") == held, names[-1]
    assert splits == (3 if held else 5)  # runs of a sample for 3 (held) or 2 blocks
    win = ref[:, :, :p // pool * pool, :q // pool * pool].reshape(
        n, k, p // pool, pool, q // pool, pool)
    want = np.where(sign[None, :, None, None] < 0, win.min(axis=(3, 5)), win.max(axis=(3, 5)))
    tol = 2e-3 if passes == 1 else 2e-6
    assert_close(ext.get(), want, tol)
    assert_run_moments(partial, ref, tol)
