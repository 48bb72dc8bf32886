"""Launchers of ``fft_conv.cu``: a stride-1 transposed 2-D convolution through discrete
Fourier transforms (pipeline B's), the per-frequency products on cuBLAS."""

from __future__ import annotations

import math

import numpy

from .._blas import complex_gemm_strided_batched
from .._cuda import MAX_GRID_X, get_kernel, shared_per_block
from ._common import definition_args

_FILE = "fft_conv.cu"
_PLANES, _THREADS = 8, 256  # FFT_PLANES: planes of one sample per block
_MMA_WN_COLUMNS, _MMA_WN_ROWS = 6, 5  # FFT_MMA_WN_*: block_mma's column tiles per warp


def transform_size(in_size: int, kernel: int, padding: int) -> int:
    """The circular transform's length along one axis: the full convolution's
    ``in_size + kernel - 1`` less ``padding``, the smallest with no wrapped-around value in
    the cropped output."""
    return in_size + kernel - 1 - padding


def _plane_stride(count: int) -> int:
    """fft_conv.cu's ``plane_stride``: float2 elements between the planes of a buffer."""
    return -(-count // 16) * 16 + 2


def column_factors(length: int, rows_in: int) -> tuple[int, int, int, int]:
    """fft_conv.cu's ``ColumnPass`` factors of a columns pass of ``length`` over ``rows_in``
    nonzero input rows: ``(f1, f2, crt1, crt2)`` of the prime-factor algorithm, the coprime
    pair with the fewest products (``length * (f1 + f2)`` a column), where those are fewer than
    the direct product's ``rows_in`` an output with a quarter to spare (its tiles' waste);
    else ``(1, length, 0, 0)``, the direct DFT matrix, which also takes more input rows than
    ``length`` (a weight taller than the transform: its rows wrap around)."""
    pairs = [(a, length // a) for a in range(2, length) if length % a == 0
             and math.gcd(a, length // a) == 1 and a < length // a]
    if pairs and rows_in <= length:
        f1, f2 = min(pairs, key=sum)
        if 1.25 * (f1 + f2) < rows_in:
            return f1, f2, f2 * pow(f2, -1, f1), f1 * pow(f1, -1, f2)
    return 1, length, 0, 0


def _table_size(factors: tuple[int, int, int, int], k_count: int, rows_in: int) -> int:
    """``ColumnPass::table_size``."""
    f1, f2 = factors[:2]
    return f1 * f1 + f2 * f2 if f1 > 1 else k_count * rows_in


def _plane_bins_bytes(hw: tuple[int, int], sizes: tuple[int, int]) -> int:
    """Dynamic shared memory of ``fft_conv_plane_bins`` for planes of ``hw``."""
    (h, w), (l1, l2) = hw, sizes
    f2 = l2 // 2 + 1
    factors = column_factors(l1, h)
    scratch = 8 * _PLANES * _plane_stride(l1 * f2) if factors[0] > 1 else 0
    return (8 * (l1 + l2 + w * f2 + _table_size(factors, l1, h)
                 + _PLANES * _plane_stride(h * f2)) + max(4 * _PLANES * h * w, scratch))


def _output_planes_bytes(out_hw: tuple[int, int], sizes: tuple[int, int]) -> int:
    """Dynamic shared memory of ``fft_conv_output_planes`` for outputs of ``out_hw``."""
    (ho, wo), (l1, l2) = out_hw, sizes
    f2 = l2 // 2 + 1
    factors = column_factors(l1, l1)
    rows = l1 if factors[0] > 1 else ho
    return 8 * (l1 + l2 + f2 * wo + _table_size(factors, ho, l1)
                + _PLANES * (_plane_stride(l1 * f2) + _plane_stride(rows * f2)))


def _output_mma_layout(out_hw: tuple[int, int], sizes: tuple[int, int]) -> tuple[int, int]:
    """fft_conv.cu's ``OutputMmaLayout`` for outputs of ``out_hw``: the floats of
    ``fft_conv_output_tables``' tables (T and R) and of the kernel's shared memory."""
    (ho, wo), (l1, l2) = out_hw, sizes
    f2 = l2 // 2 + 1

    def round_up(v: int, m: int) -> int:
        return -(-v // m) * m

    k1, k2 = round_up(2 * l1, 8), round_up(2 * f2, 8)
    s_t, s_o = (k1 + 3) // 8 * 8 + 4, (2 * f2 + 3) // 8 * 8 + 4
    s_s = (round_up(_PLANES * f2, 8 * _MMA_WN_COLUMNS) + 7) // 16 * 16 + 8
    s_r = (round_up(wo, 8 * _MMA_WN_ROWS) + 7) // 16 * 16 + 8
    o = 2 * ho * s_t + k1 * s_s
    r = o + _PLANES * ho * s_o + max(k2 - s_o, 0)
    end = max(r + k2 * s_r, round_up(2 * ho, 16) * s_t,
              o + (round_up(_PLANES * ho, 16) - 1) * s_o + k2)
    return 2 * ho * s_t + k2 * s_r, end


def fft_conv_takes(x_shape: tuple[int, ...], w_shape: tuple[int, ...], *, stride, padding,
                   output_padding, dilation, groups: int) -> bool:
    """Whether :func:`conv_transpose2d_fft` computes this transposed convolution: 2-D, stride
    1, one group, no dilation or output padding, ``0 <= padding < kernel``, a sample's
    transforms of 8 planes within the device's shared memory per block, the grid's blocks and
    the GEMM's int32 sizes (its reduction over 3 x C_in in "3xtf32") in range."""
    if (len(x_shape) != 4 or groups != 1 or any(s != 1 for s in stride)
            or any(d != 1 for d in dilation) or any(output_padding)
            or not all(0 <= p < k for p, k in zip(padding, w_shape[2:]))):
        return False
    n, c_in, h, w = x_shape
    c_out = w_shape[1]
    sizes = tuple(transform_size(s, k, p) for s, k, p in zip((h, w), w_shape[2:], padding))
    out_hw = tuple(s + k - 1 - 2 * p for s, k, p in zip((h, w), w_shape[2:], padding))
    bins = sizes[0] * (sizes[1] // 2 + 1)
    return (min(n, c_in, c_out, h, w) > 0
            and max(_plane_bins_bytes((h, w), sizes), _plane_bins_bytes(w_shape[2:], sizes),
                    _output_planes_bytes(out_hw, sizes)) <= shared_per_block()
            and max(n, c_in) * -(-max(c_in, c_out) // _PLANES) <= MAX_GRID_X
            and max(n, 3 * c_in, c_out, bins) < 2**31)


def conv_transpose2d_fft(x, w, y, *, padding: tuple[int, int], passes: int) -> None:
    """``y`` (N, C_out, Ho, Wo), contiguous, = conv_transpose2d(x, w, padding=padding) for
    contiguous ``x`` (N, C_in, H, W) and ``w`` (C_in, C_out, KH, KW) of a problem that
    :func:`fft_conv_takes`: a scan of both operands' finite ranges and non-finite values, the
    transforms of the input's and the weight's planes, their products per frequency (cuBLAS:
    in float32 for ``passes`` 1, as 3xTF32 on tensor cores for 3), and the inverse transform
    of each output plane (for 3 on tensor cores too, where its operands fit a block's shared
    memory), with the outputs that meet a non-finite value computed by the definition."""
    import cupy

    n, c_in, h, wd = x.shape
    c_out, kh, kw = w.shape[1:]
    sizes = tuple(transform_size(s, k, p) for s, k, p in zip((h, wd), (kh, kw), padding))
    l1, l2 = sizes
    bins = l1 * (l2 // 2 + 1)
    i32 = numpy.int32
    # fft_conv_scan's: the two largest magnitudes, the weights' and the samples' flags.
    stats = cupy.zeros(2 + c_out + n, dtype=cupy.uint32)
    mask = cupy.empty(n * h * wd, dtype=cupy.uint8)
    x_blocks = -(-(n * h * wd) // _THREADS)
    get_kernel(_FILE, "fft_conv_scan")(
        (x_blocks + min(-(-w.size // _THREADS), 64),), (_THREADS,),
        (x, w, mask, stats, numpy.int64(n * h * wd), i32(c_in), numpy.int64(h * wd),
         numpy.int64(w.size), i32(c_out), i32(kh * kw), i32(x_blocks)))
    # 3xTF32: x's bins (bins, N, (hi, lo, hi) x C_in) and w's (bins, (hi, hi, lo) x C_in,
    # C_out), one TF32 GEMM over the concatenated reduction.
    x_bins = cupy.empty((bins, n, passes * c_in), dtype=cupy.complex64)
    _plane_bins(x, stats, 0, 1.0, x_bins, sizes, passes=passes, lo_part=1,
                strides=(n * passes * c_in, passes * c_in, c_in))
    # The inverse transform's 1 / (L1 * L2) rides on the weight's bins.
    w_bins = cupy.empty((bins, passes * c_in, c_out), dtype=cupy.complex64)
    _plane_bins(w, stats, 1, 1.0 / (l1 * l2), w_bins, sizes, passes=passes, lo_part=2,
                strides=(passes * c_in * c_out, c_out, c_in * c_out))
    y_bins = cupy.empty((bins, n, c_out), dtype=cupy.complex64)
    _bin_products(x_bins, w_bins, y_bins, tf32=passes == 3)
    args = (x, w, y_bins, stats, mask, y, i32(n), i32(c_out), i32(l1), i32(l2),
            *definition_args(x, w, y.shape, groups=1, c_out_group=c_out, stride=(1, 1),
                             padding=padding, dilation=(1, 1)))
    grid = (n * -(-c_out // _PLANES),)
    # "3xtf32": the inverse transforms' products on tensor cores too, where their operands
    # fit a block's shared memory.
    table_floats, shared_floats = _output_mma_layout(y.shape[2:], sizes)
    if passes == 3 and 4 * shared_floats <= shared_per_block():
        tables = cupy.empty(table_floats, dtype=cupy.float32)
        get_kernel(_FILE, "fft_conv_output_tables")(
            (-(-table_floats // _THREADS),), (_THREADS,),
            (tables, i32(l1), i32(l2), *(i32(v) for v in y.shape[2:]),
             *(i32(v) for v in padding)))
        get_kernel(_FILE, "fft_conv_output_planes_mma", shared_bytes=4 * shared_floats)(
            grid, (_THREADS,), (*args[:3], tables, *args[3:]), shared_mem=4 * shared_floats)
        return
    shared = _output_planes_bytes(y.shape[2:], sizes)
    get_kernel(_FILE, "fft_conv_output_planes", shared_bytes=shared)(
        grid, (_THREADS,), (*args, *(i32(v) for v in column_factors(l1, l1))),
        shared_mem=shared)


def _plane_bins(src, stats, slot: int, factor: float, bins, sizes: tuple[int, int], *,
                passes: int, lo_part: int, strides: tuple[int, int, int]) -> None:
    """``bins`` = ``factor`` times the transforms of the planes of ``src`` (S, C, H, W),
    scaled by the exponent in ``stats[slot]``, bin b of plane (s, c) at ``b * strides[0] +
    s * strides[1] + c`` (``passes`` 1), or split into TF32 parts ``strides[2]`` apart, the
    residual at ``lo_part`` (``passes`` 3)."""
    s, c, h, w = src.shape
    shared = _plane_bins_bytes((h, w), sizes)
    i32, i64 = numpy.int32, numpy.int64
    get_kernel(_FILE, "fft_conv_plane_bins", shared_bytes=shared)(
        (s * -(-c // _PLANES),), (_THREADS,),
        (src, stats, i32(slot), numpy.float32(factor), bins, i32(c), i32(h), i32(w),
         *(i32(v) for v in sizes), i32(passes), i32(lo_part), *(i64(v) for v in strides),
         *(i32(v) for v in column_factors(sizes[0], h))),
        shared_mem=shared)


def _bin_products(x_bins, w_bins, y_bins, *, tf32: bool) -> None:
    """``y_bins[b] = x_bins[b] @ w_bins[b]`` for every bin b (complex64, C-contiguous
    (bins, N, K), (bins, K, C_out), (bins, N, C_out)): cuBLAS's batched complex GEMM on the
    current stream (recorded by cufused's captures: :mod:`cufused._blas`), column-major as
    ``y_bins[b].T = w_bins[b].T @ x_bins[b].T``, in float32, or with ``tf32`` on TF32 tensor
    cores (float32 accumulation)."""
    bins, n, k = x_bins.shape
    c_out = w_bins.shape[2]
    complex_gemm_strided_batched(c_out, n, k, w_bins.data.ptr, c_out, k * c_out,
                                 x_bins.data.ptr, k, n * k, y_bins.data.ptr, c_out, n * c_out,
                                 bins, tf32=tf32)
