"""NumPy emulation of conv_gemm.cu's conv2d_halo: its tiles, halo and weight staging
(optionally times a sign per output channel), offset table (for the compiled-in 3 x 3
geometry, FixedHalo: each lane's halo column loaded once per kernel column, each tap's A
fragments taken from it), m16n8k8 fragment layouts and output tiles staged in groups of one
or two (TileGroups) and stored by rows, with float64 MMAs, against the float64 reference (no
GPU); and of conv2d_halo_pool_stats' epilogue (its schedule of segments, registers, shuffles and
scratch, on accumulators of weights staged times the window sign) against its definition;
and the weights as the wgmma build (sm_90a) stages them, read through its shared-memory
descriptor, against the mma.sync build's; and of conv2d_halo_bands' schedule (BandTiles),
staged bands and bulk copies on the float64 convolution, with its 32-channel weight operand.
Run it after changing the kernels' index math (and change it alongside).

Usage: python scripts/emulate_conv_halo.py
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from cufused import reference
from cufused._kernels import conv_gemm
from cufused._kernels.conv_gemm import (_BAND_TK, _BAND_TW, _HALO_MAX, _HALO_RC,
                                        _POOL_SCRATCH_FLOATS, _TILE_K, band_channel_stride,
                                        fixed_ksize, halo_bands_shared, halo_channel_stride,
                                        halo_chunk, halo_out_stride, halo_planes,
                                        halo_row_stride, halo_shared_bytes, sample_segments,
                                        weight_planes)
from cufused._kernels.conv_gemm import _HALO_TH as TH
from cufused._kernels.conv_gemm import _HALO_TW as TW

BN = 64  # CONV_BN
THREADS = 256  # CONV_THREADS
LANE = np.arange(32)
GID, TIG = LANE >> 2, LANE & 3

CASES = [  # x shape, w shape, stride, padding, dilation
    ((1, 3, 9, 37), (10, 3, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 8, 13, 40), (70, 8, 3, 3), (1, 1), (0, 0), (1, 1)),  # A-like, K past one tile
    ((1, 5, 11, 35), (6, 5, 3, 5), (2, 1), (1, 2), (1, 2)),   # strides, dilation, 2 chunks
    ((1, 11, 9, 9), (9, 11, 5, 5), (1, 1), (2, 2), (1, 1)),   # 5 x 5: 6 chunks
    ((2, 3, 7, 6), (4, 3, 1, 1), (1, 1), (0, 0), (1, 1)),     # 1 x 1
    ((1, 19, 7, 35), (9, 19, 3, 3), (1, 1), (1, 1), (1, 1)),  # FixedHalo: 3 chunks, last 3 wide
    ((2, 4, 6, 71), (5, 4, 3, 3), (1, 1), (0, 0), (1, 1)),    # 3 tiles a row: a pair, one alone
]


def stage_chunk(x, wflat, n, c0, ccn, k0, geometry, fixed):
    """The block's shared memory for input channels [c0, c0 + ccn): halo, weights [r][k]
    and the offset table (-1 for the rounding to 8). ``fixed``: FixedHalo's layout (channel
    stride of 8 mod 32, reduction in (u, v, c) order; ccn = 8, zeros past C)."""
    h0, w0, hr, hc, kh, kw, dh, dw = geometry
    _, c_total, height, width = x.shape
    cstride = halo_channel_stride(hr, hc, kh if fixed else 0)
    rstride = halo_row_stride(hc, kh if fixed else 0)  # the padding columns stay NaN
    halo = np.full(max(_HALO_MAX, ccn * cstride), np.nan)
    for c in range(ccn):
        for hrow in range(hr):
            h = h0 + hrow
            for col in range(hc):
                ww = w0 + col
                inside = c0 + c < c_total and 0 <= h < height and 0 <= ww < width
                halo[c * cstride + hrow * rstride + col] = x[n, c0 + c, h, ww] if inside else 0.0
    khw = kh * kw
    rn = ccn * khw
    rpad = (rn + 7) & ~7
    assert ccn * cstride <= _HALO_MAX and rpad <= _HALO_RC
    wt = np.zeros((rpad, BN))
    roff = np.full(rpad, -1)
    for r in range(rn):
        c, uv = (r % ccn, r // ccn) if fixed else divmod(r, khw)
        u, v = divmod(uv, kw)
        roff[r] = c * cstride + u * dh * rstride + v * dw
        for kk in range(min(BN, wflat.shape[0] - k0)):
            if c0 + c < c_total:
                wt[r, kk] = wflat[k0 + kk, (c0 + c) * khw + uv]
    if not fixed:
        return halo, wt, roff, None
    # FixedHalo's per-lane layout [tap][warp_k / 32][lane][j][half] of the same values.
    lanes = np.zeros(khw * BN * ccn)
    for i in range(lanes.size):
        half, j, lane, wk, tap = i & 1, (i >> 1) & 3, (i >> 3) & 31, (i >> 8) & 1, i >> 9
        k, c = k0 + wk * 32 + j * 8 + (lane >> 2), c0 + (lane & 3) + 4 * half
        if k < wflat.shape[0] and c < c_total:
            lanes[i] = wflat[k, c * khw + tap]
    return halo, wt, roff, lanes


def mma(acc, a, b):
    """acc[j, lane, element] += the m16n8k8 product of one A tile and four B tiles (float64):
    the accumulator fragment layout."""
    for j in range(4):
        d = a @ b[j]
        acc[j, :, 0] += d[GID, 2 * TIG]
        acc[j, :, 1] += d[GID, 2 * TIG + 1]
        acc[j, :, 2] += d[GID + 8, 2 * TIG]
        acc[j, :, 3] += d[GID + 8, 2 * TIG + 1]


def lane_b_tiles(lanes, tap, warp_k):
    """A tap's four B tiles from FixedHalo's per-lane weights [tap][warp_k / 32][lane][j][half]
    (two 16-byte loads per lane)."""
    b = np.zeros((4, 8, 8))
    for j in range(4):
        base = ((tap * 2 + warp_k // 32) * 32 + LANE) * 8 + j * 2
        b[j][TIG, GID], b[j][TIG + 4, GID] = lanes[base], lanes[base + 1]
    return b


def fixed_warp_steps(acc, halo, lanes, warp, rstride, cstride, hr, ksize, extent):
    """conv2d_halo's FixedHalo MMA loop for one warp: per kernel column v each lane loads its
    halo column (rows 0 .. hr - 1 at its pixel column + v, channels tig and tig + 4) once;
    kernel row u's A fragments are its rows 2 i + half + u."""
    warp_col, warp_k = (warp & 3) * 8, (warp >> 2) * 32
    for v in range(ksize):
        base = TIG * cstride + warp_col + GID + v
        column = np.zeros((hr, 2, 32))
        for h in range(hr):
            for ch in range(2):
                idx = base + h * rstride + ch * 4 * cstride
                assert ((idx >= 0) & (idx < extent)).all()
                column[h, ch] = halo[idx]
        for u in range(ksize):
            b = lane_b_tiles(lanes, u * ksize + v, warp_k)
            for i in range(2):
                a = np.zeros((16, 8))
                a[GID, TIG], a[GID + 8, TIG] = column[2 * i + u, 0], column[2 * i + 1 + u, 0]
                a[GID, TIG + 4] = column[2 * i + u, 1]
                a[GID + 8, TIG + 4] = column[2 * i + 1 + u, 1]
                mma(acc[i], a, b)


def warp_steps(acc, halo, wt, roff, warp, sh, sw, rstride, extent):
    """One warp's MMA steps over a staged chunk through the offset table (KSIZE = 0), into
    acc[i, j, lane, element]; B fragments from ``wt``."""
    warp_col, warp_k = (warp & 3) * 8, (warp >> 2) * 32
    pofs = [[(2 * i + half) * sh * rstride + (warp_col + GID) * sw for half in range(2)]
            for i in range(2)]

    def load(pof, off):
        idx = pof + off
        assert ((off < 0) | ((idx >= 0) & (idx < extent))).all()
        return np.where(off >= 0, halo[np.clip(idx, 0, _HALO_MAX - 1)], 0.0)

    for ks in range(0, len(roff), 8):
        o0, o1 = roff[ks + TIG], roff[ks + TIG + 4]
        b = np.zeros((4, 8, 8))
        for j in range(4):
            b[j][TIG, GID] = wt[ks + TIG, warp_k + j * 8 + GID]
            b[j][TIG + 4, GID] = wt[ks + TIG + 4, warp_k + j * 8 + GID]
        for i in range(2):
            a = np.zeros((16, 8))
            a[GID, TIG], a[GID + 8, TIG] = load(pofs[i][0], o0), load(pofs[i][1], o0)
            a[GID, TIG + 4], a[GID + 8, TIG + 4] = load(pofs[i][0], o1), load(pofs[i][1], o1)
            mma(acc[i], a, b)


def stage_tile(staged, acc, bias, k0, k_total, span, part):
    """conv2d_halo's staged tile (each_output), tile ``part`` of a group of ``span``: every
    warp's fragment elements (+ bias) at staged[(k - k0) * halo_out_stride(span) + row * span
    TW + part * TW + column]."""
    stride = halo_out_stride(span)
    for warp in range(8):
        warp_col, warp_k = (warp & 3) * 8, (warp >> 2) * 32
        for lane in range(32):
            for j in range(4):
                for e in range(2):
                    k = k0 + warp_k + j * 8 + 2 * TIG[lane] + e
                    if k >= k_total:
                        continue
                    for i in range(2):
                        for half in range(2):
                            r = i * 16 + GID[lane] + half * 8
                            v = acc[warp][i, j, lane, half * 2 + e]
                            at = (r >> 3) * span * TW + part * TW + warp_col + (r & 7)
                            assert at < stride
                            staged[(k - k0) * stride + at] = v + (0.0 if bias is None
                                                                  else bias[k])


def store_staged_rows(y, staged, n, k0, p0, q0, v, span):
    """store_staged_rows<V, span TW>: thread tid keeps one row and column of the staged
    group of tiles and steps over its channels, V values a store, into y[n, k0 + channel, p0
    + row, q0 + column] (rows and columns past the output's skipped)."""
    _, k_total, p_total, q_total = y.shape
    flat = y.reshape(-1)  # a view: y is contiguous
    yt = ((n * k_total + k0) * p_total + p0) * q_total + q0
    kn, p_left, q_left = min(BN, k_total - k0), p_total - p0, q_total - q0
    width, stride = span * TW, halo_out_stride(span)
    row_lanes = width // v
    kstep = THREADS // row_lanes // TH
    for tid in range(THREADS):
        slot = tid // row_lanes
        row, kl0, col = slot % TH, slot // TH, v * (tid % row_lanes)
        if row >= p_left or col >= q_left:
            continue
        for t in range(BN // kstep):
            kl = kl0 + t * kstep
            if kl < kn:
                src = kl * stride + row * width + col
                dst = yt + (kl * p_total + row) * q_total + col
                flat[dst:dst + v] = staged[src:src + v]


def tile_groups(block, grid_x, span, n_total, p_total, q_total):
    """TileGroups<span>'s first / next from block ``block`` of ``grid_x``, line for line: the
    block's tiles in order, as (n, tr, tc)."""
    def at(index):
        tiles_w = -(-q_total // TW)
        per_row = -(-tiles_w // span)
        groups = -(-p_total // TH) * per_row
        if index >= n_total * groups:
            return None
        n = index // groups
        group = index - n * groups
        tr = group // per_row
        return n, tr, span * (group - tr * per_row)

    pos = at(block)
    while pos is not None:
        yield pos
        n, tr, tc = pos
        if (tc + 1) % span != 0 and (tc + 1) * TW < q_total:
            pos = (n, tr, tc + 1)
            continue
        per_row = -(-(-(-q_total // TW)) // span)  # groups_w(): ceil(ceil(Q / TW) / span)
        pos = at((n * -(-p_total // TH) + tr) * per_row + tc // span + grid_x)


def emulate(x, w, bias, stride, padding, dilation, grid_x=7, sign=None, span=2):
    """conv2d_halo's result, every block, warp and lane emulated (blocks loop over groups of
    ``span`` tiles); with ``sign`` (+-1 per output channel) the weights staged times it, as
    conv2d_halo_pool_stats stages them (the result is then sign * conv + bias)."""
    n_total, c_total, height, width = x.shape
    k_total, _, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    p_total = (height + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    q_total = (width + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    cc, hr, hc = halo_chunk(c_total, (kh, kw), stride, dilation, 1, wgmma=True)
    fixed = fixed_ksize(c_total, (kh, kw), stride, dilation, 1, wgmma=True) > 0
    assert cc >= 1
    y = np.full((n_total, k_total, p_total, q_total), np.nan)
    wflat = w.reshape(k_total, -1) * (1.0 if sign is None else sign[:, None])
    tiles_w = -(-q_total // TW)
    schedule = [pos for block in range(grid_x)
                for pos in tile_groups(block, grid_x, span, n_total, p_total, q_total)]
    # Every tile once.
    assert sorted(schedule) == [(n, tr, tc) for n in range(n_total)
                                for tr in range(-(-p_total // TH)) for tc in range(tiles_w)]
    stride_out = halo_out_stride(span)
    for k0 in range(0, k_total, BN):
        for n, tr, tc in schedule:
            part = tc % span
            if part == 0:  # a group's first tile: NaN where nothing is staged
                staged = np.full(BN * stride_out, np.nan)
            p0, q0 = tr * TH, tc * TW
            geometry = (p0 * sh - ph, q0 * sw - pw, hr, hc, kh, kw, dh, dw)
            acc = np.zeros((8, 2, 4, 32, 4))
            for c0 in range(0, c_total, cc):
                ccn = cc if fixed else min(cc, c_total - c0)
                halo, wt, roff, lanes = stage_chunk(x, wflat, n, c0, ccn, k0, geometry,
                                                    fixed)
                cstride = halo_channel_stride(hr, hc, kh if fixed else 0)
                rstride = halo_row_stride(hc, kh if fixed else 0)
                for warp in range(8):
                    if fixed:
                        fixed_warp_steps(acc[warp], halo, lanes, warp, rstride, cstride,
                                         hr, kh, ccn * cstride)
                    else:
                        warp_steps(acc[warp], halo, wt, roff, warp, sh, sw, rstride,
                                   ccn * cstride)
            stage_tile(staged, acc, bias, k0, k_total, span, part)
            if part + 1 == span or tc + 1 == tiles_w:
                store_staged_rows(y, staged, n, k0, p0, q0 - part * TW,
                                  2 if q_total % 2 == 0 else 1, span)
    return y


def segments(n_total, tiles, splits, blocks):
    """SampleSegments: each block's tiles in its order, as (n, t, the segment's index)."""
    begin = [s * tiles // splits for s in range(splits + 1)]
    for block in range(blocks):
        for item in range(block, n_total * splits, blocks):
            n, s = divmod(item, splits)
            yield block, [(n, t, s) for t in range(begin[s], begin[s + 1])]


class PoolStatsBlock:
    """conv2d_halo_pool_stats' epilogue state of one block: the scratch's (bias, sign,
    offset) per channel and each warp's and lane's running sums of its 8 channels (j, e).
    The accumulators come times the channel's sign (its weights staged so)."""

    def __init__(self, bias, sign, k0, k_total):
        self.k0, self.k_total = k0, k_total
        kk = np.arange(k0, k0 + BN)
        k_in = kk < k_total
        kc = np.minimum(kk, k_total - 1)
        self.bias = np.where(k_in, bias[kc], 0.0)
        self.sign = np.where(k_in & (sign[kc] < 0), -1.0, 1.0)
        self.offset = np.zeros(BN)
        self.s1, self.s2 = np.zeros((8, 4, 2, 32)), np.zeros((8, 4, 2, 32))

    def begin_segment(self, acc):
        """The run's offsets: its first tile's acc at row 0, column 0 (lanes gid 0 of the
        first column warps 0 and 4, fragment row 0 of MMA tile 0)."""
        for warp in (0, 4):
            for j in range(4):
                for e in range(2):
                    for lane in np.flatnonzero(GID == 0):
                        kl = (warp >> 2) * 32 + j * 8 + 2 * TIG[lane] + e
                        self.offset[kl] = acc[warp, 0, j, lane, e]
        self.s1[:], self.s2[:] = 0.0, 0.0

    def tile(self, acc, n, p0, q0, shape, pool, ext):
        """One tile: the sums (pixels inside the output only) and the windows' extrema."""
        _, k_total, p_total, q_total = shape
        ho_total, wo_total = p_total // pool, q_total // pool
        for warp in range(8):
            warp_col, warp_k = (warp & 3) * 8, (warp >> 2) * 32
            q = q0 + warp_col + GID
            for j in range(4):
                for e in range(2):
                    kl = warp_k + j * 8 + 2 * TIG + e
                    m = np.zeros((TH // pool, 32))
                    for r in range(TH):
                        v = acc[warp, r >> 1, j, :, (r & 1) * 2 + e]
                        ok = (p0 + r < p_total) & (q < q_total)
                        d = v - self.offset[kl]
                        self.s1[warp, j, e] += np.where(ok, d, 0.0)
                        self.s2[warp, j, e] += np.where(ok, d * d, 0.0)
                        m[r // pool] = v if r % pool == 0 else np.fmax(m[r // pool], v)
                    for wr in range(TH // pool):
                        step = 4
                        while step < 4 * pool:
                            m[wr] = np.fmax(m[wr], m[wr][LANE ^ step])
                            step <<= 1
                        for lane in np.flatnonzero(GID % pool == 0):
                            k, ho, wo = self.k0 + kl[lane], p0 // pool + wr, q[lane] // pool
                            if k < k_total and ho < ho_total and wo < wo_total:
                                ext[n, k, ho, wo] = self.sign[kl[lane]] * m[wr, lane] + \
                                    self.bias[kl[lane]]

    def end_segment(self, n, s, pixels, partial):
        """The segment's sums over each warp's lanes, then over the four column warps; the
        first moment times the sign, the shift sign * offset + bias."""
        sums = np.zeros((4, BN, 2))
        for warp in range(8):
            for j in range(4):
                for e in range(2):
                    s1, s2 = self.s1[warp, j, e], self.s2[warp, j, e]
                    step = 4
                    while step < 32:
                        s1, s2 = s1 + s1[LANE ^ step], s2 + s2[LANE ^ step]
                        step <<= 1
                    for lane in np.flatnonzero(GID == 0):
                        kl = (warp >> 2) * 32 + j * 8 + 2 * TIG[lane] + e
                        sums[warp & 3, kl] = s1[lane], s2[lane]
        for kl in range(min(BN, self.k_total - self.k0)):
            s1, s2 = sums[:, kl].sum(axis=0)
            partial[n, self.k0 + kl, s] = (self.sign[kl] * s1, s2,
                                           self.sign[kl] * self.offset[kl] + self.bias[kl],
                                           pixels)


def emulate_pool_stats(x, w, bias, sign, stride, padding, dilation, pool, splits, blocks):
    """conv2d_halo_pool_stats (``splits`` segments per sample taken by ``blocks`` blocks):
    (ext, partial)."""
    # The tiles' acc (checked above) of weights staged times the window sign.
    y = emulate(x, w, None, stride, padding, dilation, sign=np.where(sign < 0, -1.0, 1.0))
    n_total, k_total, p_total, q_total = y.shape
    tiles_w = -(-q_total // TW)
    tiles = -(-p_total // TH) * tiles_w
    ext = np.full((n_total, k_total, p_total // pool, q_total // pool), np.nan)
    partial = np.full((n_total, k_total, splits, 4), np.nan)
    for k0 in range(0, k_total, BN):
        states = {}  # one per block, kept over its runs as the kernel keeps its scratch
        for block, items in segments(n_total, tiles, splits, blocks):
            state = states.setdefault(block, PoolStatsBlock(bias, sign, k0, k_total))
            pixels = 0
            for index, (n, t, s) in enumerate(items):
                p0, q0 = (t // tiles_w) * TH, (t % tiles_w) * TW
                pixels += min(TH, p_total - p0) * min(TW, q_total - q0)
                acc = np.zeros((8, 2, 4, 32, 4))
                for warp in range(8):  # the accumulators as conv2d_halo's store reads them
                    warp_col, warp_k = (warp & 3) * 8, (warp >> 2) * 32
                    q = np.minimum(q0 + warp_col + GID, q_total - 1)
                    for i in range(2):
                        for half in range(2):
                            p = min(p0 + 2 * i + half, p_total - 1)
                            for j in range(4):
                                for e in range(2):
                                    k = np.minimum(k0 + warp_k + j * 8 + 2 * TIG + e,
                                                   k_total - 1)
                                    acc[warp, i, j, :, half * 2 + e] = y[n, k, p, q]
                if index == 0:
                    state.begin_segment(acc)
                state.tile(acc, n, p0, q0, y.shape, pool, ext)
            state.end_segment(n, s, pixels, partial)
    return ext, partial


def check_pool_stats(rng) -> float:
    """The pool-stats epilogue against its definition on the float64 convolution: the
    windows' extrema, and per run (segment) its first pixel's value as the shift, its pixel
    count and the sums of the values minus that shift."""
    worst = 0.0
    # Segments of uneven lengths, blocks taking several (3 resident blocks), and of one tile.
    for xs, ws, pool, slots in [((2, 8, 13, 40), (70, 8, 3, 3), 4, 3),
                                ((1, 3, 9, 37), (12, 3, 3, 3), 2, 264)]:
        x, w = rng.standard_normal(xs), rng.standard_normal(ws)
        bias, sign = rng.standard_normal(ws[0]), rng.standard_normal(ws[0])
        tiles = -(-(xs[2] - 2) // TH) * -(-(xs[3] - 2) // TW)
        splits, blocks = sample_segments(xs[0], tiles, slots)
        ext, partial = emulate_pool_stats(x, w, bias, sign, (1, 1), (0, 0), (1, 1), pool,
                                          splits, blocks)
        y = reference.conv(x, w, bias, (1, 1), (0, 0), (1, 1), 1)
        n, k, p, q = y.shape
        ho, wo = p // pool, q // pool
        win = y[:, :, :ho * pool, :wo * pool].reshape(n, k, ho, pool, wo, pool)
        want = np.where(sign[None, :, None, None] < 0, win.min(axis=(3, 5)),
                        win.max(axis=(3, 5)))
        rows, cols = np.indices((p, q))
        tile = rows // TH * -(-q // TW) + cols // TW  # each pixel's tile, row-major
        run = np.searchsorted([s * tiles // splits for s in range(1, splits)], tile,
                              side="right")
        errs = [np.abs(ext - want).max(), 0.0, 0.0]
        for s in range(splits):
            inside = run == s
            first = np.unravel_index(np.flatnonzero(inside)[0], (p, q))
            d = y[:, :, inside] - y[:, :, first[0], first[1], None]
            expect = np.stack([d.sum(-1), (d * d).sum(-1)], -1)
            errs[1] = max(errs[1], np.abs(partial[:, :, s, :2] - expect).max() / inside.sum())
            errs[2] = max(errs[2], np.abs(partial[:, :, s, 2] - y[:, :, first[0], first[1]]).max())
            if not (partial[:, :, s, 3] == inside.sum()).all():
                errs[2] = float("inf")
        print(f"pool-stats x {xs} w {ws} pool {pool} splits {splits} blocks {blocks}: max "
              f"errors (ext, sums / pixels, shift and count) {errs[0]:.1e} {errs[1]:.1e} "
              f"{errs[2]:.1e}")
        worst = max([worst] + [e if not np.isnan(e) else float("inf") for e in errs])
    return worst


def check_shared_layout() -> bool:
    """The kernels' shared-memory layout as halo_shared and halo_scratch place it (the
    scratch rounded up to a 16-byte boundary for the pooling epilogue's float4 loads) inside
    the bytes the launcher gives (halo_shared_bytes; one to three planes),
    FixedHalo's 4-float copies inside their buffer and its per-lane weights inside the
    weights' space, for the emulated geometries and odd-sized halos."""
    geometries = [(xs[1], ws[2:], stride, dilation) for xs, ws, stride, _, dilation in CASES]
    geometries += [(3, (3, 3), (2, 2), (1, 1)), (1, (2, 2), (1, 1), (1, 1)),
                   (5, (1, 1), (2, 2), (1, 1)), (64, (3, 3), (1, 1), (1, 1))]
    ok = True
    for c, kernel, stride, dilation in geometries:
        for passes, wgmma in ((1, True), (3, True), (3, False)):
            cc, hr, hc = halo_chunk(c, kernel, stride, dilation, passes, wgmma=wgmma)
            ksize = fixed_ksize(c, kernel, stride, dilation, passes, wgmma=wgmma)
            hsize = cc * halo_channel_stride(hr, hc, ksize)
            planes, wplanes = halo_planes(passes, ksize), weight_planes(passes, ksize)
            # halo_scratch: after the weights' and both halo buffers' planes.
            start = (wplanes * _HALO_RC * (_TILE_K + 8) + _HALO_RC + 2 * planes * hsize + 3) & ~3
            for pool in (0, 2, 4):
                for span in (1, 2) if pool == 0 else (1,):
                    end = start + (_POOL_SCRATCH_FLOATS if pool
                                   else _TILE_K * halo_out_stride(span))
                    ok &= 4 * end <= halo_shared_bytes(cc, hr, hc, ksize, passes, pool, span)
            if ksize:
                rstride = halo_row_stride(hc, ksize)
                last = (cc - 1) * halo_channel_stride(hr, hc, ksize) + (hr - 1) * rstride + rstride
                ok &= rstride % 4 == 0 and last <= hsize
                ok &= ksize * ksize * _TILE_K * cc <= _HALO_RC * (_TILE_K + 8)
    # The 4-float copies need every 4 columns of a halo row inside the input or outside
    # together: so for W and the padding multiples of 4 (tiles start at multiples of 32).
    for width, pw in [(128, 0), (40, 4), (36, 0), (8, 4)]:
        for w0 in range(-pw, width, TW):
            for g in range(w0, w0 + 36, 4):
                inside = [0 <= col < width for col in range(g, g + 4)]
                ok &= all(inside) or not any(inside)
    print(f"shared-memory layout and 4-float halo copies: {'ok' if ok else 'FAILED'}")
    return ok


def check_wgmma_weights(rng) -> bool:
    """The weights as the wgmma build stages them ([tap][warp_k / 32][8-column tile][half]
    [column][c % 4], a tile's N channels: 64, or BandTile's 32 that both warpgroups read)
    read through wgmma_desc's descriptor (K-major, no swizzle: element (k, n) at (n // 8) *
    SBO + (k // 4) * LBO + (n % 8) * 16 + (k % 4) * 4 bytes, LBO 128, SBO 256) give every
    tap's and channel group's B operand that the mma.sync build's per-lane layout gives, on
    channel counts past one tile and short of a chunk."""
    lbo, sbo = 128, 256  # wgmma_desc's leading and stride byte offsets
    ok = True
    for tile_n in (BN, _BAND_TK):
        for k_total, c_total, k0 in [(64, 8, 0), (70, 5, 64), (40, 8, 0), (64, 8, 32)]:
            ksize, cc = 3, 8
            taps = ksize * ksize
            wflat = rng.standard_normal((k_total, c_total * taps))
            lanes = stage_chunk(np.zeros((1, c_total, 3, 34)), wflat, 0, 0, cc, k0,
                                (0, 0, 6, 34, ksize, ksize, 1, 1), True)[3]
            staged = np.zeros(taps * tile_n * cc)
            for i in range(staged.size):
                wk = (i >> 8) & (tile_n // 32 - 1)
                k = k0 + wk * 32 + ((i >> 6) & 3) * 8 + ((i >> 2) & 7)
                c = (i & 3) + 4 * ((i >> 5) & 1)
                if k < k_total and c < c_total:
                    staged[i] = wflat[k, c * taps + i // (tile_n * cc)]
            for tap in range(taps):
                for warp_k in range(0, tile_n, 32):
                    start = (tap * tile_n * cc + warp_k * cc) * 4  # the descriptor's address
                    b = np.zeros((8, 32))
                    for k in range(8):
                        for n in range(32):
                            at = (start + (n // 8) * sbo + (k // 4) * lbo + (n % 8) * 16
                                  + (k % 4) * 4)
                            b[k, n] = staged[at // 4]
                    tiles = lane_b_tiles(lanes, tap, warp_k)
                    ok &= all(np.array_equal(b[:, 8 * j:8 * j + 8], tiles[j])
                              for j in range(4))
    print(f"wgmma weight layouts and descriptor: {'ok' if ok else 'FAILED'}")
    return ok


def band_tiles(block, grid_x, n_total, p_total, q_total):
    """BandTiles' first / next from block ``block`` of ``grid_x``, line for line: the
    block's tiles in order, as (n, tr, tc), each band's last tile first."""
    rows = -(-p_total // TH)
    last = (q_total - 1) // _BAND_TW

    def at(index):
        if index >= n_total * rows:
            return None
        n = index // rows
        return n, index - n * rows, last

    pos = at(block)
    while pos is not None:
        yield pos
        n, tr, tc = pos
        pos = (n, tr, tc - 1) if tc > 0 else at(n * rows + tr + grid_x)


def check_bands(rng) -> bool:
    """conv2d_halo_bands' epilogue on the float64 convolution, every block, warp, lane and
    store emulated: the bands in BandTiles' order (2 blocks a channel tile, each taking
    several bands), each tile's accumulators (BandTile: 8 warps of 8 columns, 32 channels)
    staged without a predicate (a column past Q BandTile::W columns to the left, in the
    last tile staged first; positions outside the output carry a marker that must not reach
    y), every staged store's 32 lanes on distinct banks, each channel's band copied as one
    run whose address and size are multiples of 16 bytes, inside the launcher's shared
    memory; y then equals the convolution everywhere."""
    ok = True
    saved = conv_gemm.arch_target, conv_gemm.resident_blocks, conv_gemm.shared_per_block
    conv_gemm.arch_target = lambda filename: "sm_90a"
    conv_gemm.resident_blocks = lambda shared: 228 * 1024 // (shared + 1024)
    conv_gemm.shared_per_block = lambda: 227 * 1024
    try:
        for n_total, k_total, p_total, q_total in [(2, 64, 18, 70), (2, 70, 8, 101),
                                                   (3, 40, 7, 100), (2, 33, 13, 72),
                                                   (1, 64, 6, 66), (1, 64, 10, 126),
                                                   (1, 8, 5, 128)]:
            shared = halo_bands_shared(n_total, k_total, p_total, q_total, 0)
            ok &= shared > 0
            cs = band_channel_stride(q_total)
            front = (_HALO_RC * (_TILE_K + 8) + _HALO_RC
                     + 2 * 8 * halo_channel_stride(TH + 2, _BAND_TW + 2, 3) + 3) & ~3
            ok &= cs >= 4 * q_total and cs % 8 == 4 and 4 * (front + _BAND_TK * cs) <= shared
            conv = rng.standard_normal((n_total, k_total, p_total, q_total))
            y = np.full(conv.size, np.nan)
            marker = np.inf  # a value outside the output
            for k0 in range(0, k_total, _BAND_TK):
                kn = min(_BAND_TK, k_total - k0)
                schedule = [pos for block in range(2)
                            for pos in band_tiles(block, 2, n_total, p_total, q_total)]
                bands = [(n, tr) for n in range(n_total) for tr in range(-(-p_total // TH))]
                ok &= sorted(schedule) == sorted(
                    (n, tr, tc) for n, tr in bands for tc in range((q_total - 1) // _BAND_TW + 1))
                for n, tr, tc in schedule:
                    if tc == (q_total - 1) // _BAND_TW:  # a band's first tile: a new scratch
                        staged = np.full(_BAND_TK * cs, np.nan)
                    for warp in range(8):
                        col = tc * _BAND_TW + warp * 8 + GID
                        at = np.where(col < q_total, col, col - _BAND_TW)
                        for j in range(4):
                            for e in range(2):
                                k = k0 + j * 8 + 2 * TIG + e
                                for row in range(TH):
                                    p = tr * TH + row
                                    inside = (p < p_total) & (col < q_total) & (k < k_total)
                                    v = np.where(inside, conv[n, np.minimum(k, k_total - 1),
                                                              min(p, p_total - 1),
                                                              np.minimum(col, q_total - 1)],
                                                 marker)
                                    addr = (k - k0) * cs + row * q_total + at
                                    ok &= len(set((addr[k < k_total] % 32).tolist())) == int(
                                        (k < k_total).sum())
                                    ok &= bool((addr[k < k_total] < _BAND_TK * cs).all())
                                    staged[addr[k < k_total]] = v[k < k_total]
                    if tc == 0:  # the band's copies, one a channel
                        rows = min(TH, p_total - tr * TH)
                        for t in range(kn):
                            run = ((n * k_total + k0 + t) * p_total + tr * TH) * q_total
                            size = rows * q_total
                            ok &= run % 4 == 0 and size % 4 == 0 and (t * cs) % 4 == 0
                            y[run:run + size] = staged[t * cs:t * cs + size]
            ok &= np.array_equal(y, conv.reshape(-1))
    finally:
        conv_gemm.arch_target, conv_gemm.resident_blocks, conv_gemm.shared_per_block = saved
    print(f"bands of whole rows (schedule, staging, copies): {'ok' if ok else 'FAILED'}")
    return ok


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rng = np.random.default_rng(0)
    worst = 0.0
    for xs, ws, stride, padding, dilation in CASES:
        x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
        ref = reference.conv(x, w, b, stride, padding, dilation, 1)
        errs = []
        for span in (2, 1):  # tiles stored in pairs, or one at a time
            # Two blocks: each takes several groups, stepping from one to the next.
            got = emulate(x, w, b, stride, padding, dilation, grid_x=2, span=span)
            errs.append(float(np.abs(got - ref).max()) if not np.isnan(got).any()
                        else float("inf"))
        worst = max([worst] + errs)
        print(f"x {xs} w {ws} stride {stride} padding {padding} dilation {dilation} "
              f"(cc, hr, hc) {halo_chunk(xs[1], ws[2:], stride, dilation, 1, wgmma=True)}: "
              f"max error (tiles in pairs, alone) {errs[0]:.1e} {errs[1]:.1e}")
    worst = max(worst, check_pool_stats(rng))
    if not check_shared_layout() or not check_wgmma_weights(rng) or not check_bands(rng):
        return 1
    return 0 if worst < 1e-9 else 1  # an output never written (NaN) counts as inf


if __name__ == "__main__":
    sys.exit(main())
