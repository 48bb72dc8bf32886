"""Launcher of ``conv_gemm.cu``: the implicit-GEMM convolution on tensor cores."""

from __future__ import annotations

import functools
import itertools
import math

import numpy

from .._cuda import (TensorMap, arch_target, fits_grid_yz, float32_tensor_map,
                     get_kernel, optional, resident_blocks, shared_per_block, sm_count)
from .._layout import stored_in
from ._common import (channel_sample_grid, clamp_middle, cpp_bool, definition_args,
                      element_strides_3d, skips_max)

_FILE = "conv_gemm.cu"
_TILE_M, _TILE_K, _THREADS = 128, 64, 256  # CONV_BM, CONV_BN, CONV_THREADS
# conv2d_halo's output tile (HALO_TH x HALO_TW), staged reduction values and halo floats.
_HALO_TH, _HALO_TW, _HALO_RC, _HALO_MAX = 4, 32, 72, 4800
_HALO_BLOCKS_PER_SM = 2  # HALO_BLOCKS_PER_SM: the grid's blocks per multiprocessor
# The pooling epilogue's scratch (conv_gemm.cu): per channel 4 floats, per warp column and
# channel 2.
_POOL_SCRATCH_FLOATS = 4 * _TILE_K + 2 * 4 * _TILE_K
_FIXED_KSIZE, _FIXED_CC = 3, 8  # FixedHalo's instantiation and its channels per chunk
_BAND_TW, _BAND_TK = 64, 32  # BandTile: conv2d_halo_bands' tile columns and channels
_HALO_NHWC_STRIDE = _TILE_K + 8  # HALO_NHWC_STRIDE: floats a staged pixel
# conv2d_halo_nhwc's tensor stores: a box of 32 channels (128 bytes) x the tile's pixels, and
# their scratch (NHWC_TENSOR_SCRATCH: two tiles of two boxes, and a 1024-byte alignment's slack).
_NHWC_BOX = (32, _HALO_TW, _HALO_TH, 1)
_NHWC_TENSOR_SCRATCH = 4 * 32 * _HALO_TH * _HALO_TW + 255
_NO_TENSOR_MAP = TensorMap()  # the argument of a kernel that copies by other means
# The held-weights kernels: HELD_THREADS, HELD_BLOCKS_PER_SM, and their shared memory: six
# halo planes of HELD_PLANE floats, then conv2d_nhwc_held_weights' two output boxes and the
# 1024-byte alignment's slack (HELD_SHARED_FLOATS), conv2d_held_weights_pool_stats' (bias,
# sign) and flag per channel (HELD_POOL_SHARED_FLOATS).
_HELD_THREADS, _HELD_BLOCKS_PER_SM = 128, 3
_HELD_PLANE = (_HALO_TH + 2) * 2 * (_HALO_TW + 2) * 4
_HELD_SHARED = 4 * (6 * _HELD_PLANE + 2 * 32 * _HALO_TH * _HALO_TW + 255)
_HELD_POOL_SHARED = 4 * (6 * _HELD_PLANE + 3 * _TILE_K)


def fixed_ksize(c: int, kernel: tuple[int, int], stride: tuple[int, int],
                dilation: tuple[int, int], passes: int, *, wgmma: bool) -> int:
    """The kernel size that the halo kernels compile in for this problem (``FixedHalo``: a
    3 x 3 kernel at stride and dilation 1), or 0: the geometry comes as arguments. With
    ``wgmma`` (the kernels built for sm_90a) 3xTF32 compiles it in for one chunk of 8 input
    channels at most: that build sums the products in one accumulator, residuals first, which
    over several chunks would lose float32's accuracy."""
    if kernel != (_FIXED_KSIZE, _FIXED_KSIZE) or stride != (1, 1) or dilation != (1, 1):
        return 0
    return _FIXED_KSIZE if passes == 1 or not wgmma or c <= _FIXED_CC else 0


def _wgmma_sum(c: int, passes: int) -> bool:
    """:func:`fixed_ksize`'s ``wgmma`` for a problem of ``c`` input channels, asked of the
    device only where it decides (3xTF32 past one chunk)."""
    return passes == 3 and c > _FIXED_CC and arch_target(_FILE) is not None


def halo_chunk(c: int, kernel: tuple[int, int], stride: tuple[int, int],
               dilation: tuple[int, int], passes: int, *,
               wgmma: bool) -> tuple[int, int, int]:
    """``(cc, hr, hc)`` of ``conv2d_halo``: the input channels staged per chunk (0 where not
    even one channel's halo fits its shared memory, or ``c`` is 0; 8 where the geometry is
    compiled in, zeros past ``c``) and the halo's rows and columns (:func:`fixed_ksize`'s
    arguments)."""
    kh, kw = kernel
    hr = (_HALO_TH - 1) * stride[0] + (kh - 1) * dilation[0] + 1
    hc = (_HALO_TW - 1) * stride[1] + (kw - 1) * dilation[1] + 1
    if fixed_ksize(c, kernel, stride, dilation, passes, wgmma=wgmma):
        # No input channel, no stage: the kernel's barriers between tiles come with stages.
        return (_FIXED_CC if c else 0), hr, hc
    return min(c, _HALO_RC // (kh * kw), _HALO_MAX // (hr * hc)), hr, hc


def halo_row_stride(hc: int, ksize: int) -> int:
    """Floats between two rows of a halo buffer: ``hc``, or for a compiled-in geometry
    ``hc`` rounded up to 4 (``FixedHalo::HCS``: 16-byte rows)."""
    return -(-hc // 4) * 4 if ksize else hc


def halo_channel_stride(hr: int, hc: int, ksize: int) -> int:
    """Floats between two channels of a halo buffer: ``hr * hc``, or for a compiled-in
    geometry the next stride of 8 mod 32 after ``hr`` rows (``FixedHalo::CSTRIDE``: the four
    ``tig`` lanes' channels on distinct banks)."""
    return (hr * halo_row_stride(hc, ksize) + 23) // 32 * 32 + 8 if ksize else hr * hc


def halo_planes(passes: int, ksize: int) -> int:
    """Planes that a halo kernel stages its halo in (``halo_planes`` in conv_gemm.cu): 2
    (TF32 high part and residual) for 3xTF32 with a compiled-in geometry, else 1."""
    return 2 if passes == 3 and ksize else 1


def weight_planes(passes: int, ksize: int) -> int:
    """Planes of a halo kernel's staged weights (``weight_planes``): 3 (the high part, the
    finite high part and the residual) where the halo has 2, else 1."""
    return 3 if halo_planes(passes, ksize) == 2 else 1


def halo_out_stride(span: int) -> int:
    """Floats per channel of ``conv2d_halo``'s staged group of ``span`` tiles
    (``halo_out_stride``)."""
    return _HALO_TH * _HALO_TW * span + 4


def _halo_scratch_offset(cc: int, hr: int, hc: int, ksize: int, passes: int) -> int:
    """Floats of a halo kernel's shared memory before its epilogue's scratch (``halo_scratch``
    in conv_gemm.cu): the staged weights' planes and their halo offsets, two halo buffers of
    ``cc`` channels in their planes, rounded up to 4 (16-byte aligned)."""
    floats = (weight_planes(passes, ksize) * _HALO_RC * (_TILE_K + 8) + _HALO_RC
              + 2 * halo_planes(passes, ksize) * cc * halo_channel_stride(hr, hc, ksize))
    return -(-floats // 4) * 4


def halo_shared_bytes(cc: int, hr: int, hc: int, ksize: int, passes: int,
                      pool: int = 0, span: int = 1, channels_last: bool = False) -> int:
    """Dynamic shared memory of a halo kernel (``halo_shared`` in conv_gemm.cu): what
    :func:`_halo_scratch_offset` counts and the epilogue's scratch: the pooling epilogue's
    (``pool`` > 0), the output tile ``conv2d_halo_nhwc`` stages pixel-major
    (``channels_last``) or the group of ``span`` output tiles ``conv2d_halo`` stages."""
    floats = _halo_scratch_offset(cc, hr, hc, ksize, passes)
    if pool:
        floats += _POOL_SCRATCH_FLOATS
    elif channels_last:
        floats += _HALO_TH * _HALO_TW * _HALO_NHWC_STRIDE
    else:
        floats += _TILE_K * halo_out_stride(span)
    return 4 * floats


def halo_span(tiles: int, passes: int, alone: int, paired: int) -> int:
    """The tiles ``conv2d_halo`` stages and stores together (its ``SPAN``): 2 (neighbours of
    a tile row: whole 256-byte row segments, written at about 1.6 times the rate of the
    halves) where there are more of the problem's ``tiles`` than the blocks of one wave
    (else each block would run two tiles one after the other), a block may have the pair's
    ``paired`` bytes of shared memory, and a multiprocessor holds as many such blocks, up to
    the kernel's launch bounds (two in TF32, one in 3xTF32), as of one tile's ``alone``
    bytes; else 1."""
    bound = _HALO_BLOCKS_PER_SM if passes == 1 else 1
    if tiles <= sm_count() * _HALO_BLOCKS_PER_SM or paired > shared_per_block():
        return 1
    return 2 if min(bound, resident_blocks(paired)) >= min(bound, resident_blocks(alone)) else 1


def band_channel_stride(q: int) -> int:
    """Floats from one channel's staged band to the next in ``conv2d_halo_bands``' scratch
    for output rows of ``q`` columns: the first of at least ``4 q`` that is 4 mod 8."""
    return 4 * q + 4 * (1 - q % 2)


def halo_bands_shared(n: int, k: int, p: int, q: int, y_address: int) -> int:
    """Dynamic shared memory of ``conv2d_halo_bands`` for the TF32 3 x 3 convolution (stride
    and dilation 1) into an NCHW output of ``n * k`` planes of ``p x q`` at ``y_address``,
    or 0 where it does not take the problem: the kernel needs the wgmma build (sm_90a), rows
    of 65 to 128 columns (a band of 4 rows in one tile pair), each band's run of rows a
    multiple of 16 bytes at a 16-byte aligned address (``p * q`` a multiple of 4, which
    makes the last band's ``(p % 4) * q`` one too), channel tiles of 32 that the grid holds,
    and two blocks a multiprocessor."""
    if (not 2 * _HALO_TW < q <= 2 * _BAND_TW or (p * q) % 4 or y_address % 16
            or not n * k * p or not fits_grid_yz(k, _BAND_TK)
            or arch_target(_FILE) != "sm_90a"):
        return 0
    hr, hc = _HALO_TH + _FIXED_KSIZE - 1, _BAND_TW + _FIXED_KSIZE - 1
    floats = (_halo_scratch_offset(_FIXED_CC, hr, hc, _FIXED_KSIZE, 1)
              + _BAND_TK * band_channel_stride(q))
    shared = 4 * floats
    fits = shared <= shared_per_block() and resident_blocks(shared) >= _HALO_BLOCKS_PER_SM
    return shared if fits else 0


def takes_channels_last(c: int, kernel: tuple[int, int], stride: tuple[int, int],
                        dilation: tuple[int, int], passes: int) -> bool:
    """Whether :func:`conv2d_implicit_gemm` writes this problem into a channels-last ``y``
    (``conv2d_halo_nhwc``: the halo kernel takes it, :func:`halo_geometry`)."""
    return halo_geometry(c, kernel, stride, dilation, passes, channels_last=True) is not None


def nhwc_direct_shared(y, cc: int, hr: int, hc: int, ksize: int, passes: int) -> int:
    """The shared memory of ``conv2d_halo_nhwc_direct`` (tiles stored from the accumulators,
    the block's bias in the scratch) into the packed channels-last ``y`` (N, K, P, Q) for
    the halo geometry ``(cc, hr, hc, ksize)``, or 0 where it does not pay or apply: it takes
    3xTF32 on the wgmma build (sm_90a) with the geometry compiled in (``ksize``), K even and
    ``y`` 8-byte aligned (float2 stores), where two blocks then share a multiprocessor (one
    holds a staged tile)."""
    shared = 4 * (_halo_scratch_offset(cc, hr, hc, ksize, passes) + _TILE_K)
    if (passes != 3 or not ksize or y.shape[1] % 2 or y.data.ptr % 8
            or shared > shared_per_block() or resident_blocks(shared) < _HALO_BLOCKS_PER_SM
            or arch_target(_FILE) != "sm_90a"):
        return 0
    return shared


def _nhwc_map(y) -> TensorMap | None:
    """The tensor map of the packed channels-last ``y`` (N, K, P, Q) that the halo kernels'
    tensor stores write through (dims K, Q, P, N; a box of 32 channels x a tile's pixels),
    or None where there is none: K not a multiple of 4 or ``y`` not 16-byte aligned (a map's
    strides and address), or the driver refuses it."""
    n, k, p, q = y.shape
    if k % 4 or y.data.ptr % 16:
        return None
    return float32_tensor_map(y.data.ptr, (k, q, p, n), (4 * k, 4 * k * q, 4 * k * q * p),
                              _NHWC_BOX)


def _held_weights_take(ksize: int, passes: int, shared: int) -> bool:
    """Whether a held-weights kernel of ``shared`` bytes of shared memory takes the problem:
    3xTF32 with the geometry compiled in (``ksize``: 3 x 3 at stride and dilation 1, up to 8
    input channels) on the wgmma build (sm_90a), where three blocks share a
    multiprocessor."""
    return (passes == 3 and bool(ksize) and shared <= shared_per_block()
            and resident_blocks(shared) >= _HELD_BLOCKS_PER_SM
            and arch_target(_FILE) == "sm_90a")


def held_weights_map(y, ksize: int, passes: int) -> TensorMap | None:
    """The map (:func:`_nhwc_map`) through which ``conv2d_nhwc_held_weights`` writes the
    packed channels-last ``y``, or None where that kernel does not take the problem
    (:func:`_held_weights_take`) or there is no map."""
    return _nhwc_map(y) if _held_weights_take(ksize, passes, _HELD_SHARED) else None


def _sm90a_kernel(name: str, shared: int):
    """``name`` of conv_gemm.cu fetched for a path of its wgmma build (sm_90a), or None where
    that build has just failed when first built (an NVRTC without the target): the kernel
    then came in the portable build, where such paths trap, and the caller takes another."""
    kernel = get_kernel(_FILE, name, shared_bytes=shared)
    return kernel if arch_target(_FILE) == "sm_90a" else None


def _nhwc_tensor(y, cc: int, hr: int, hc: int, ksize: int, passes: int,
                 thread_shared: int) -> tuple[TensorMap, int] | None:
    """``(map, shared bytes)`` of ``conv2d_halo_nhwc``'s tensor stores through the packed
    channels-last ``y``'s map (its threads store the tiles otherwise), or None where they do
    not apply: they need the wgmma build (sm_90a), a map (:func:`_nhwc_map`), and a scratch
    of two tiles that keeps the blocks a multiprocessor that the threads' scratch
    (``thread_shared`` bytes) has, up to the kernel's launch bounds."""
    shared = 4 * (_halo_scratch_offset(cc, hr, hc, ksize, passes) + _NHWC_TENSOR_SCRATCH)
    bound = _HALO_BLOCKS_PER_SM if passes == 1 else 1
    if (shared > shared_per_block()
            or min(bound, resident_blocks(shared)) < min(bound, resident_blocks(thread_shared))
            or arch_target(_FILE) != "sm_90a"):
        return None
    y_map = _nhwc_map(y)
    return (y_map, shared) if y_map else None


def channel_tiles_fit(out_channels: int) -> bool:
    """Whether the 2-D implicit GEMMs' grid holds the output channels' tiles (its y
    dimension)."""
    return fits_grid_yz(out_channels, _TILE_K)


def halo_geometry(c: int, kernel: tuple[int, int], stride: tuple[int, int],
                  dilation: tuple[int, int], passes: int, pool: int = 0,
                  channels_last: bool = False) -> tuple[int, int, int, int, int] | None:
    """``(cc, hr, hc, ksize, shared_bytes)`` of the halo kernel for the problem on the
    current device (:func:`halo_chunk`, :func:`fixed_ksize`, :func:`halo_shared_bytes` with
    ``pool`` and ``channels_last``), or None where it does not take it: no chunk of input
    channels whose halo fits, or more shared memory than a block may have there (3xTF32's
    3 x 3 kernel without pooling passes the 99 KB of compute capability 8.6, 8.9 and
    12.0)."""
    wgmma = _wgmma_sum(c, passes)
    cc, hr, hc = halo_chunk(c, kernel, stride, dilation, passes, wgmma=wgmma)
    if cc < 1:
        return None
    ksize = fixed_ksize(c, kernel, stride, dilation, passes, wgmma=wgmma)
    shared = halo_shared_bytes(cc, hr, hc, ksize, passes, pool, channels_last=channels_last)
    return (cc, hr, hc, ksize, shared) if shared <= shared_per_block() else None


@functools.lru_cache(maxsize=256)
def sample_segments(n: int, tiles: int, slots: int) -> tuple[int, int]:
    """``(splits, blocks)`` of ``conv2d_halo_pool_stats`` (``SampleSegments``): each of the
    ``n`` samples' ``tiles`` tiles cut into ``splits`` runs of consecutive tiles, ``blocks``
    blocks taking the ``n * splits`` runs in turn. The choice minimizes the tiles of the
    busiest block (rounds of runs times a run's tiles) for ``slots`` resident blocks, then
    the splits (each run ends in a reduction of its sums). No samples or no tiles: no
    blocks."""
    if n == 0 or tiles == 0:
        return 1, 0
    best = None
    # Past a few rounds of runs per block the rounding gains little: the search stops there.
    for splits in range(1, min(tiles, 8 * -(-slots // n)) + 1):
        blocks = min(n * splits, slots)
        busiest = -(-n * splits // blocks) * -(-tiles // splits)
        if best is None or busiest < best[0]:
            best = (busiest, splits, blocks)
    return best[1], best[2]


def conv2d_implicit_gemm(x, w, bias, y, *, stride: tuple[int, int], padding: tuple[int, int],
                         dilation: tuple[int, int], passes: int) -> None:
    """``y = conv2d(x, w) + bias`` for contiguous NCHW float32 ``x``, OIHW ``w`` (groups 1)
    and ``y`` of the convolution's output shape, contiguous NCHW or packed channels-last
    (NHWC memory); ``passes`` 1 (TF32) or 3 (3xTF32).

    The halo kernel runs where a chunk of input channels fits its shared memory (every
    kernel of up to 72 values at moderate stride and dilation) and the device grants what
    it then needs (:func:`halo_geometry`), in bands of whole rows where
    :func:`halo_bands_shared` takes the problem, else the gathering one. A channels-last
    ``y`` needs the halo kernel (:func:`takes_channels_last`)."""
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    p, q = y.shape[2:]
    rows = n * p * q
    if rows == 0 or k == 0:
        return
    i32 = numpy.int32
    geometry = (x, w, optional(bias), y, i32(n), i32(c), i32(h), i32(wd), i32(k), i32(kh),
                i32(kw), i32(p), i32(q), i32(stride[0]), i32(stride[1]), i32(padding[0]),
                i32(padding[1]), i32(dilation[0]), i32(dilation[1]))
    channels_last = not y.flags.c_contiguous  # packed channels-last
    halo = halo_geometry(c, (kh, kw), stride, dilation, passes, channels_last=channels_last)
    tiles = n * -(-p // _HALO_TH) * -(-q // _HALO_TW)
    if channels_last:  # conv2d_nhwc_held_weights, conv2d_halo_nhwc_direct, conv2d_halo_nhwc
        cc, hr, hc, ksize, shared = halo
        y_map = held_weights_map(y, ksize, passes)
        held = y_map and _sm90a_kernel("conv2d_nhwc_held_weights", _HELD_SHARED)
        if held:
            held((min(tiles, sm_count() * _HELD_BLOCKS_PER_SM), -(-k // _TILE_K)),
                 (_HELD_THREADS,),
                 (x, w, optional(bias), i32(n), i32(c), i32(h), i32(wd), i32(k), i32(p),
                  i32(q), i32(padding[0]), i32(padding[1]), y_map.as_argument()),
                 shared_mem=_HELD_SHARED)
            # Its high products take a non-finite weight as zero: such channels by the
            # definition.
            conv_nonfinite_weight_rows(x, w, bias, y, groups=1, stride=stride,
                                       padding=padding, dilation=dilation)
            return
        grid = (min(tiles, sm_count() * _HALO_BLOCKS_PER_SM), -(-k // _TILE_K))
        direct = nhwc_direct_shared(y, cc, hr, hc, ksize, passes)
        if direct:
            get_kernel(_FILE, f"conv2d_halo_nhwc_direct<{passes}, {ksize}>",
                       shared_bytes=direct)(
                grid, (_THREADS,), geometry + (i32(cc), i32(hr), i32(hc)), shared_mem=direct)
            return
        tensor = _nhwc_tensor(y, cc, hr, hc, ksize, passes, shared)
        kernel = tensor and _sm90a_kernel(
            f"conv2d_halo_nhwc<{passes}, {ksize}, NHWC_TENSOR>", tensor[1])
        if kernel:
            y_map, shared = tensor
        else:
            y_map = _NO_TENSOR_MAP
            kernel = get_kernel(_FILE, f"conv2d_halo_nhwc<{passes}, {ksize}, NHWC_THREADS>",
                                shared_bytes=shared)
        kernel(grid, (_THREADS,), geometry + (i32(cc), i32(hr), i32(hc), y_map.as_argument()),
               shared_mem=shared)
        return
    bands = halo_bands_shared(n, k, p, q, y.data.ptr) if halo and halo[3] and passes == 1 else 0
    kernel = bands and _sm90a_kernel("conv2d_halo_bands", bands)  # else conv2d_halo's pairs
    if kernel:
        # Every block resident: the channel halves of a band run side by side (the second
        # reads its halos from L2).
        channel_blocks = -(-k // _BAND_TK)
        slots = max(1, sm_count() * _HALO_BLOCKS_PER_SM // channel_blocks)
        kernel((min(n * -(-p // _HALO_TH), slots), channel_blocks), (_THREADS,),
               (x, w, optional(bias), y, i32(n), i32(c), i32(h), i32(wd), i32(k), i32(p),
                i32(q), i32(padding[0]), i32(padding[1]), i32(band_channel_stride(q))),
               shared_mem=bands)
        return
    if halo is not None:
        cc, hr, hc, ksize, shared = halo
        paired = halo_shared_bytes(cc, hr, hc, ksize, passes, span=2)
        span = halo_span(tiles, passes, shared, paired)
        shared = paired if span == 2 else shared
        groups = n * -(-p // _HALO_TH) * -(-q // (span * _HALO_TW))
        blocks = min(groups, sm_count() * _HALO_BLOCKS_PER_SM)
        get_kernel(_FILE, f"conv2d_halo<{passes}, {ksize}, {span}>", shared_bytes=shared)(
            (blocks, -(-k // _TILE_K)), (_THREADS,), geometry + (i32(cc), i32(hr), i32(hc)),
            shared_mem=shared)
        return
    get_kernel(_FILE, f"conv2d_igemm<{passes}>")(
        (-(-rows // _TILE_M), -(-k // _TILE_K)), (_THREADS,), geometry)


def conv2d_pool_stats(xp, x, w, bias, ext, *, sign_a, sign_b, stride: tuple[int, int],
                      padding: tuple[int, int], dilation: tuple[int, int], pool: int,
                      passes: int):
    """Pipeline A's convolution with the window-extremum + statistics pass as its epilogue
    (``conv2d_halo_pool_stats``): ``ext`` (N, K, P // pool, W // pool), contiguous NCHW,
    gets each window's extremum of ``conv2d(x, w) + bias`` (the min where ``sign_a *
    sign_b < 0``), without the convolution output ever being stored. Returns ``(partial,
    splits)``: ``partial`` (N, K, splits, 4) holds each channel's (sum, sum of squares,
    shift, pixel count as int32 bits) over run s of the sample's tiles, the sums of the
    values minus the shift (the value at the run's first pixel), as
    :func:`cufused._kernels.normalization.group_affine_rows` takes them.

    Needs ``pool`` 2 or 4 and a problem the halo kernel takes (:func:`halo_geometry`). 4 x
    4 windows run on the held-weights kernel where it takes the problem
    (``conv2d_held_weights_pool_stats``, :func:`_held_weights_take`), which takes a
    non-finite weight's high part as zero: there a channel with a non-finite weight gets
    NaN sums and extrema of those values, and the caller recomputes its planes by the
    definition (pipeline A: ``pool_affine_nonfinite_conv``, which the NaN statistics
    flag)."""
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    halo = halo_geometry(c, (kh, kw), stride, dilation, passes, pool) if pool in (2, 4) else None
    if halo is None:
        cc = halo_chunk(c, (kh, kw), stride, dilation, passes, wgmma=_wgmma_sum(c, passes))[0]
        raise ValueError(f"conv2d_pool_stats takes pool 2 or 4 and a halo that fits "
                         f"(pool {pool}, channels per chunk {cc})")
    cc, hr, hc, ksize, shared = halo
    p = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    q = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    held = (_sm90a_kernel("conv2d_held_weights_pool_stats", _HELD_POOL_SHARED)
            if pool == 4 and _held_weights_take(ksize, passes, _HELD_POOL_SHARED) else None)
    splits, blocks = sample_segments(n, -(-p // _HALO_TH) * -(-q // _HALO_TW),
                                     sm_count() * (_HELD_BLOCKS_PER_SM if held
                                                   else _HALO_BLOCKS_PER_SM))
    partial = xp.empty((n, k, splits, 4), dtype=xp.float32)
    if blocks == 0 or k == 0:
        return partial, splits
    i32 = numpy.int32
    if held:
        held(
            (blocks, -(-k // _TILE_K)), (_HELD_THREADS,),
            (x, w, optional(bias), optional(sign_a), optional(sign_b), ext, partial, i32(n),
             i32(c), i32(h), i32(wd), i32(k), i32(p), i32(q), i32(padding[0]),
             i32(padding[1]), i32(p // pool), i32(q // pool), i32(splits)),
            shared_mem=_HELD_POOL_SHARED)
        return partial, splits
    get_kernel(_FILE, f"conv2d_halo_pool_stats<{passes}, {ksize}, {pool}>",
               shared_bytes=shared)(
        (blocks, -(-k // _TILE_K)), (_THREADS,),
        (x, w, optional(bias), optional(sign_a), optional(sign_b), ext, partial, i32(n), i32(c),
         i32(h), i32(wd), i32(k), i32(kh), i32(kw), i32(p), i32(q), i32(stride[0]),
         i32(stride[1]), i32(padding[0]), i32(padding[1]), i32(dilation[0]), i32(dilation[1]),
         i32(cc), i32(hr), i32(hc), i32(p // pool), i32(q // pool), i32(splits)),
        shared_mem=shared)
    return partial, splits


# conv_transpose3d_s2k3: tiles of 4 x 4 x 16 base positions (CT3_TD, CT3_TH, CT3_TW), at most
# 32 input channels (CT3_CI), 32 output channels a block (CT3_BN), CT3_SHARED_FLOATS floats
# of shared memory (the weights, two halo buffers of 5 x 5 x 17 positions x 32 channels, each
# 1024-byte aligned: CT3_HSTRIDE, the scratch, two mbarriers). From an NCDHW x the halo goes
# by input planes of 32 channels x 5 rows x CT3_XW = 20 columns (the tensor copies' box) into
# a ring of CT3_RING = 9 slots (CT3_SHARED_FLOATS_NCDHW: the weights, the ring, the scratch,
# 9 mbarriers).
_CT3_TILE = (4, 4, 16)
_CT3_HALO = tuple(t + 1 for t in _CT3_TILE)
_CT3_CI, _CT3_BN = 32, 32
_CT3_XW, _CT3_RING = 20, 9
_CT3_PLANE_BOX = (_CT3_XW, _CT3_HALO[1], 1, _CT3_CI, 1)  # W, H, D, C, N
_CT3_WEIGHTS_SCRATCH = 27 * _CT3_CI * _CT3_BN + 8 * _CT3_BN  # floats
_CT3_SHARED = 4 * (_CT3_WEIGHTS_SCRATCH + 2 * (-(-(_CT3_CI * math.prod(_CT3_HALO)) // 256) * 256)
                   + 4)
_CT3_SHARED_NCDHW = 4 * (_CT3_WEIGHTS_SCRATCH + _CT3_RING * math.prod(_CT3_PLANE_BOX)
                         + 2 * _CT3_RING)


def transposed_s2k3_takes(c_in: int, kernel, stride, padding, output_padding, dilation,
                          groups: int, out_shape: tuple[int, ...], clamp=None) -> bool:
    """Whether ``conv_transpose3d_s2k3`` computes the transposed 3-D convolution (stride 2,
    3 x 3 x 3 kernel, padding 1, output padding 0 or 1, dilation 1, one group, 1 to 32 input
    channels, an output plane below 2**31, output channels whose tiles the grid holds), with
    the clamped softmax after it where ``clamp`` is given (narrow enough to skip the running
    maximum: :func:`skips_max`), on the current device (its 217 KiB of shared memory a block:
    compute capability 9.0)."""
    return (tuple(kernel) == (3, 3, 3) and tuple(stride) == (2, 2, 2)
            and tuple(padding) == (1, 1, 1) and tuple(dilation) == (1, 1, 1)
            and all(o in (0, 1) for o in output_padding) and groups == 1
            and 0 < c_in <= _CT3_CI and (clamp is None or skips_max(clamp))
            and math.prod(out_shape[2:]) < 2**31 and fits_grid_yz(out_shape[1], _CT3_BN)
            and max(_CT3_SHARED, _CT3_SHARED_NCDHW) <= shared_per_block())


def _planes_mappable(x) -> bool:
    """Whether the input planes of the contiguous NCDHW ``x`` meet a tensor map's strides and
    alignment (W a multiple of 4, x 16-byte aligned)."""
    return x.shape[4] % 4 == 0 and x.data.ptr % 16 == 0


def transposed_s2k3_reads_ncdhw(x, passes: int) -> bool:
    """Whether ``conv_transpose3d_s2k3`` reads the contiguous NCDHW ``x`` in place (its input
    planes through a ring in shared memory, by tensor copies) on the current device: in TF32
    on the warpgroup-MMA build (sm_90a), whose two halves of a tile read planes 0 to 2 and 2
    to 4, so that a tile's last plane has half a tile to arrive, and where the planes' tensor
    map can be made (W a multiple of 4, x 16-byte aligned). The ``mma.sync`` path reads all
    five planes from the tile's start, and copies by ``cp.async`` cost their issue; there a
    channels-last copy of the input is faster."""
    return passes == 1 and _planes_mappable(x) and arch_target(_FILE) == "sm_90a"


def _transposed_s2k3(mode: str, x, w, bias, *, out_shape, clamp, passes: int, y=None,
                     partial=None, factor=None, x_ncdhw: bool = False) -> None:
    """Launch ``conv_transpose3d_s2k3<passes, mode, x_ncdhw>`` for ``x`` (N, C_in, D, H, W)
    stored channels-last (packed NDHWC), or contiguous where ``x_ncdhw``, contiguous ``w``
    (C_in, C_out, 3, 3, 3) and the output ``out_shape``, over the runs of
    :func:`transposed_s2k3_runs` (``partial`` has room for their splits): a tile a run where
    the kernel stores its results (all modes but the sums, whose tile schedule takes a run
    a tile)."""
    n, c, d, h, wd = x.shape
    k = w.shape[1]
    splits, blocks = transposed_s2k3_runs(x.shape, k, stores=mode != "CT3_SOFTMAX_SUMS")
    if blocks == 0 or k == 0:
        return
    by_four = not x_ncdhw and c % 4 == 0 and x.data.ptr % 16 == 0
    # The tensor copies' map of x (16-byte strides: C % 4 == 0, or W % 4 == 0 for an NCDHW
    # x), where the driver makes one.
    if x_ncdhw:
        tensor_map = _planes_mappable(x) and float32_tensor_map(
            x.data.ptr, (wd, h, d, c, n), (4 * wd, 4 * wd * h, 4 * wd * h * d,
                                           4 * wd * h * d * c), _CT3_PLANE_BOX, swizzle=False)
    else:
        tensor_map = by_four and float32_tensor_map(
            x.data.ptr, (c, wd, h, d, n),
            (4 * c, 4 * c * wd, 4 * c * wd * h, 4 * c * wd * h * d),
            (_CT3_CI,) + _CT3_HALO[::-1] + (1,))
    shared = _CT3_SHARED_NCDHW if x_ncdhw else _CT3_SHARED
    i32, f32 = numpy.int32, numpy.float32
    get_kernel(_FILE, f"conv_transpose3d_s2k3<{passes}, {mode}, {cpp_bool(x_ncdhw)}>",
               shared_bytes=shared)(
        (blocks, -(-k // _CT3_BN)), (_THREADS,),
        (x, w, optional(bias), optional(y), optional(partial), optional(factor), i32(n),
         i32(c), i32(d), i32(h), i32(wd), i32(k), *(i32(s) for s in out_shape[2:]),
         f32(clamp[0]), f32(clamp[1]), f32(clamp_middle(clamp)), i32(splits), i32(by_four),
         i32(y is not None and out_shape[4] % 2 == 0 and y.data.ptr % 8 == 0),
         i32(bool(tensor_map)), (tensor_map or _NO_TENSOR_MAP).as_argument()),
        shared_mem=shared)


def transposed_s2k3_runs(x_shape: tuple[int, ...], k: int, *,
                         stores: bool = False) -> tuple[int, int]:
    """``(splits, blocks)``: :func:`sample_segments` of the input's tiles, the channel tiles
    of ``k`` output channels sharing the device's multiprocessors (one block each). Where
    the kernel ``stores`` its results (pass 2), every tile is a run of its own, so that the
    blocks take the tiles in a grid stride: the blocks running together write neighbouring
    tiles of y, and so fill its DRAM pages together."""
    n, _, d, h, wd = x_shape
    td, th, tw = _CT3_TILE
    tiles = -(-d // td) * -(-h // th) * -(-wd // tw)
    slots = max(1, sm_count() // max(1, -(-k // _CT3_BN)))
    if stores:
        return (tiles, min(n * tiles, slots)) if n and tiles else (1, 0)
    return sample_segments(n, tiles, slots)


def conv_transpose3d_softmax_sums(xp, x, w, bias, *, out_shape, clamp, passes: int):
    """Pass 1 of pipeline C on ``conv_transpose3d_s2k3``: returns ``(partial, splits)``,
    ``partial`` (N, C_out, splits, 2) each row's (ref, sum of exp(clamp(y) - ref)) over run s
    of its sample's tiles, y = conv_transpose3d(x, w) + bias (never stored), as
    :func:`cufused._kernels.softmax.softmax_finalize` takes them."""
    k = w.shape[1]
    runs = transposed_s2k3_runs(x.shape, k)
    partial = xp.empty((x.shape[0], k, runs[0], 2), dtype=xp.float32)
    _transposed_s2k3("CT3_SOFTMAX_SUMS", x, w, bias, out_shape=out_shape, clamp=clamp,
                     passes=passes, partial=partial)
    return partial, runs[0]


def conv_transpose3d_implicit_gemm(x, w, bias, y, *, passes: int) -> None:
    """``y`` (N, C_out, Do, Ho, Wo), contiguous, = conv_transpose3d(x, w) + bias for ``x``
    stored channels-last, or contiguous (NCDHW, read as it is) in TF32 (``passes`` 1),
    contiguous ``w`` and a problem that :func:`transposed_s2k3_takes` (stride 2, padding 1).
    The outputs of a channel whose weight holds a non-finite value are rewritten by the
    definition (the implicit GEMM multiplies the zeros past the input's far edge too): in
    TF32 in the same launch, a finite weight costing each block a check of the weights it
    stages; in 3xTF32 by ``conv_nonfinite_weight_rows`` after it, whose blocks
    check a channel's weight each (:func:`~cufused._kernels._common.channel_sample_grid`)."""
    x_ncdhw = not stored_in(x, "nhwc")
    if x_ncdhw and (passes != 1 or not x.flags.c_contiguous):
        raise ValueError("conv_transpose3d_s2k3 takes x stored channels-last, or contiguous "
                         "(NCDHW) in TF32")
    _transposed_s2k3("CT3_CONV", x, w, bias, out_shape=y.shape, clamp=(0.0, 0.0),
                     passes=passes, y=y, x_ncdhw=x_ncdhw)
    if passes == 3:
        _transposed_s2k3_nonfinite_rows(x, w, bias, y)


def _transposed_s2k3_nonfinite_rows(x, w, bias, y) -> None:
    """The channels of a 3xTF32 ``conv_transpose3d_s2k3`` or ``conv_transpose3d_s2k3_groups``
    result ``y`` whose weight holds a non-finite value, rewritten by the definition
    (:func:`conv_nonfinite_weight_rows`)."""
    conv_nonfinite_weight_rows(x, w, bias, y, groups=1, stride=(2, 2, 2), padding=(1, 1, 1),
                               dilation=(1, 1, 1), transposed=True)


# conv_transpose3d_s2k3_groups: tiles of 1 x 4 x 32 base positions (1, CTG_TH, CTG_TW), 64
# output channels a block (CTG_BN), CTG_SHARED_FLOATS floats of shared memory (two weight
# planes of 8 taps x 64 x 32, two halo buffers of 2 x 5 x 33 positions x 32 channels, each
# 1024-byte aligned, two mbarriers, the softmax sums' scratch); the classes in four groups
# (ctg_group_classes) of 8, 8, 8 and 3 taps and 1, 2, 3 and 2 classes. The groups' blocks
# take shares of the multiprocessors in proportion to each group's cost (its time alone),
# with and without the softmax sums in the epilogue (an exponential an output weighs more in
# the groups of more classes): docs/design.rst, "Pipeline C on the tensor-core convolution".
_CTG_TILE = (1, 4, 32)
_CTG_BN, _CTG_SLOTS = 64, 8
_CTG_HALO_BOX = (_CT3_CI, _CTG_TILE[2] + 1, _CTG_TILE[1] + 1, 2, 1)  # C, W, H, D, N
_CTG_SHARED = 4 * (2 * _CTG_SLOTS * _CTG_BN * _CT3_CI
                   + 2 * (-(-math.prod(_CTG_HALO_BOX) // 256) * 256) + 4 + 8 * _CTG_BN)
_CTG_GROUP_COSTS = (35, 37, 41, 19)
_CTG_GROUP_COSTS_SUMS = (33, 35, 42, 22)


def transposed_s2k3_groups_take(c_in: int, y, passes: int) -> bool:
    """Whether ``conv_transpose3d_s2k3_groups`` computes a problem that
    :func:`transposed_s2k3_takes` of ``c_in`` input channels into ``y``: ``y`` packed
    channels-last, 8-byte aligned (float2 stores), and the channels and precision that
    :func:`transposed_s2k3_groups_take_channels` admits."""
    return (y.data.ptr % 8 == 0 and stored_in(y, "nhwc")
            and transposed_s2k3_groups_take_channels(c_in, y.shape[1], passes))


def transposed_s2k3_groups_take_channels(c_in: int, c_out: int, passes: int) -> bool:
    """Whether ``conv_transpose3d_s2k3_groups`` computes a problem that
    :func:`transposed_s2k3_takes` of ``c_in`` input and ``c_out`` output channels into a
    packed channels-last y, 8-byte aligned: in 3xTF32 (``passes`` 3) on the wgmma build
    (sm_90a) with its shared memory granted, ``c_in`` a multiple of 4 (the tensor copies'
    strides of a channels-last x), ``c_out`` even. Fetching the kernel here builds it on a
    first call: where the wgmma build fails, the portable one comes, in which it traps, and
    the route is another."""
    return (passes == 3 and c_in % 4 == 0 and c_out % 2 == 0
            and _CTG_SHARED <= shared_per_block() and arch_target(_FILE) == "sm_90a"
            and _sm90a_kernel("conv_transpose3d_s2k3_groups", _CTG_SHARED) is not None)


def transposed_s2k3_group_blocks(k: int, costs=_CTG_GROUP_COSTS) -> tuple[int, ...]:
    """The first block of groups 1, 2 and 3 and the blocks of ``conv_transpose3d_s2k3_groups``
    for ``k`` output channels: a block a multiprocessor for each of the channel tiles, the
    groups' shares by their ``costs`` (one block each at least)."""
    blocks = max(len(costs), sm_count() // -(-k // _CTG_BN))
    shares = [max(1, round(blocks * t / sum(costs))) for t in costs[:-1]]
    starts = tuple(itertools.accumulate(shares))
    return starts + (max(blocks, starts[-1] + 1),)


def conv_transpose3d_groups(x, w, bias, y) -> bool:
    """``y`` (N, C_out, Do, Ho, Wo) = conv_transpose3d(x, w) + bias in 3xTF32 on
    ``conv_transpose3d_s2k3_groups`` for a problem that it takes
    (:func:`transposed_s2k3_groups_take`), ``x`` packed channels-last and 16-byte aligned,
    contiguous ``w`` (C_in, C_out, 3, 3, 3); the channels whose weight holds a non-finite
    value then rewritten by the definition. False, with nothing launched, where the driver
    makes no tensor map of ``x``."""
    return _class_groups(x, w, bias, y, "conv_transpose3d_s2k3_groups", (),
                         transposed_s2k3_group_blocks(w.shape[1]))


def transposed_s2k3_groups_sums_fit(y_shape) -> bool:
    """Whether the softmax partials of :func:`conv_transpose3d_groups_softmax_sums` for a y of
    ``y_shape`` (N, C_out, Do, Ho, Wo), a pair for each row and block, take no more memory
    than y: more blocks than half a row's outputs (small outputs, many rows) would make them
    the larger buffer."""
    return 2 * transposed_s2k3_group_blocks(y_shape[1], _CTG_GROUP_COSTS_SUMS)[-1] <= math.prod(
        y_shape[2:])


def conv_transpose3d_groups_softmax_sums(xp, x, w, bias, y, *, clamp):
    """:func:`conv_transpose3d_groups`, and pipeline C's softmax partials of each row of
    ``y``: (N * C_out, splits, 2), as :func:`~cufused._kernels.softmax.softmax_finalize`
    reads them, a block's (ref, the sum of exp(clamp(y) - ref) over its outputs of the row),
    ref the middle of ``clamp = (lo, hi)``: the kernel's values, so that the rows of a
    channel with a non-finite weight (rewritten in ``y`` by the definition) are left to the
    caller. None, with nothing launched, where the driver makes no tensor map of ``x``."""
    blocks = transposed_s2k3_group_blocks(y.shape[1], _CTG_GROUP_COSTS_SUMS)
    partial = xp.empty((y.shape[0] * y.shape[1], blocks[-1], 2), dtype=xp.float32)
    lo, hi = clamp
    name = "conv_transpose3d_s2k3_groups_softmax_sums"
    if not _class_groups(x, w, bias, y, name, (partial, numpy.float32(lo), numpy.float32(hi)),
                         blocks):
        return None
    return partial


def _class_groups(x, w, bias, y, name: str, extra: tuple, blocks: tuple[int, ...]) -> bool:
    """Launch ``name`` (conv_transpose3d_s2k3_groups or its softmax sums' form, whose
    arguments after the groups' ``blocks`` are ``extra``), then the rewrite of channels with
    a non-finite weight; False, with nothing launched, where the driver makes no tensor map
    of ``x``."""
    n, c, d, h, wd = x.shape
    k = w.shape[1]
    tensor_map = float32_tensor_map(x.data.ptr, (c, wd, h, d, n),
                                    (4 * c, 4 * c * wd, 4 * c * wd * h, 4 * c * wd * h * d),
                                    _CTG_HALO_BOX)
    if tensor_map is None:
        return False
    if n and k and d and h and wd:
        b1, b2, b3, grid = blocks
        i32 = numpy.int32
        get_kernel(_FILE, name, shared_bytes=_CTG_SHARED)(
            (grid, -(-k // _CTG_BN)), (_THREADS,),
            (x, w, optional(bias), y, i32(n), i32(c), i32(d), i32(h), i32(wd), i32(k),
             *(i32(s) for s in y.shape[2:]), i32(b1), i32(b2), i32(b3), *extra,
             tensor_map.as_argument()),
            shared_mem=_CTG_SHARED)
    _transposed_s2k3_nonfinite_rows(x, w, bias, y)
    return True


def conv_nonfinite_weight_rows(x, w, bias, y, *, groups: int, stride, padding, dilation,
                               transposed: bool = False) -> None:
    """Recompute by the definition the output channels of the convolution ``y = conv(x, w) +
    bias`` (forward, or ``transposed``; 2-D or 3-D; ``y`` in any strides) whose weight holds a
    non-finite value (see the kernel): a forward convolution's padding zeros meet every tap,
    a transposed one's weight meets only real inputs, as the definition (and the float64
    reference) has them. A call with a finite weight costs a few checks of each channel's
    weight on the device (:func:`~cufused._kernels._common.channel_sample_grid`), no host
    sync."""
    n, k = y.shape[:2]
    if y.size == 0:
        return
    _by_definition("conv_nonfinite_weight_rows", channel_sample_grid(k, n), 128, x, w, bias, y,
                   (numpy.int64(n),), transposed=transposed, groups=groups, stride=stride,
                   padding=padding, dilation=dilation)


def _by_definition(kernel: str, grid: tuple[int, ...], threads: int, x, w, bias, y,
                   head: tuple, *, transposed: bool, groups: int, stride, padding,
                   dilation) -> None:
    """Launch ``kernel``, a template over the convolution's definition (common.cuh), with
    its arguments ``(x, w, bias, y, *head, definition, y's strides)``."""
    w = w if w.flags.c_contiguous else w.copy()
    name = "TransposedConvDefinition" if transposed else "ForwardConvDefinition"
    get_kernel(_FILE, f"{kernel}<{name}>")(
        grid, (threads,),
        (x, w, optional(bias), y, *head,
         *definition_args(x, w, y.shape, groups=groups, c_out_group=y.shape[1] // groups,
                          stride=stride, padding=padding, dilation=dilation),
         *element_strides_3d(y)))


def conv_nonfinite_input_flags(xp, x):
    """``flags`` (uint32, N): 1 for each sample of ``x`` (N, C, *spatial; any strides) that
    holds a non-finite value, computed on the device (no host sync)."""
    n, c = x.shape[:2]
    flags = xp.zeros(n, dtype=xp.uint32)
    if x.size:
        i32 = numpy.int32
        lift = (1,) * (5 - x.ndim)
        get_kernel(_FILE, "conv_nonfinite_input_scan")(
            (min(-(-(x.size // c) // 256), sm_count() * 8),), (256,),
            (x, flags, numpy.int64(n), i32(c), *(i32(v) for v in lift + tuple(x.shape[2:])),
             *element_strides_3d(x)))
    return flags


def conv_nonfinite_input_samples(x, w, bias, y, flags, *, transposed: bool, groups: int,
                                 stride, padding, dilation) -> None:
    """After a convolution algorithm that spreads a non-finite input over its sample's
    outputs (cuDNN's FFT and Winograd plans): every output of each sample that ``flags``
    marks (:func:`conv_nonfinite_input_flags`) of ``y = conv(x, w) + bias`` (forward, or
    ``transposed``; ``y`` in any strides), rewritten by the definition. A call without a
    non-finite input costs a flag check a sample."""
    n, k = y.shape[:2]
    if y.size == 0:
        return
    grid = (min(-(-n // 256), 16), min(k, sm_count() * 2))
    _by_definition("conv_nonfinite_input_samples", grid, 256, x, w, bias, y,
                   (flags, numpy.int64(n), numpy.int32(k)), transposed=transposed,
                   groups=groups, stride=stride, padding=padding, dilation=dilation)


def conv_transpose3d_softmax(x, w, bias, out, factor, *, clamp, passes: int) -> None:
    """Pass 2: ``out`` (N, C_out, Do, Ho, Wo), contiguous, = exp(clamp(y) - ref) * factor[n,
    c], ref the clamp's middle (:func:`clamp_middle`), the convolution computed again."""
    _transposed_s2k3("CT3_SOFTMAX", x, w, bias, out_shape=out.shape, clamp=clamp,
                     passes=passes, y=out, factor=factor)
