"""NumPy emulation of conv_gemm.cu's conv2d_halo: its tiles, halo and weight staging,
offset table (for the compiled-in 3 x 3 geometry, FixedHalo, the offsets its fragment
addresses add up to) and m16n8k8 fragment layouts, with float64 MMAs, against the float64
reference (no GPU); and of conv2d_halo_pool_stats' epilogue (shuffles, shared scratch, windows) and
conv2d_first_values against their definitions. Run it after changing the kernels' index
math (and change it alongside).

Usage: python scripts/emulate_conv_halo.py
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from cufused import reference
from cufused._kernels.conv_gemm import (_HALO_MAX, _HALO_RC, fixed_ksize, halo_channel_stride,
                                        halo_chunk)
from cufused._kernels.conv_gemm import _HALO_TH as TH
from cufused._kernels.conv_gemm import _HALO_TW as TW

BN = 64  # CONV_BN
LANE = np.arange(32)
GID, TIG = LANE >> 2, LANE & 3

CASES = [  # x shape, w shape, stride, padding, dilation
    ((1, 3, 9, 37), (10, 3, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 8, 13, 40), (70, 8, 3, 3), (1, 1), (0, 0), (1, 1)),  # A-like, K past one tile
    ((1, 5, 11, 35), (6, 5, 3, 5), (2, 1), (1, 2), (1, 2)),   # strides, dilation, 2 chunks
    ((1, 11, 9, 9), (9, 11, 5, 5), (1, 1), (2, 2), (1, 1)),   # 5 x 5: 6 chunks
    ((2, 3, 7, 6), (4, 3, 1, 1), (1, 1), (0, 0), (1, 1)),     # 1 x 1
    ((1, 19, 7, 35), (9, 19, 3, 3), (1, 1), (1, 1), (1, 1)),  # FixedHalo: 3 chunks, last 3 wide
]


def stage_chunk(x, wflat, n, c0, ccn, k0, geometry, fixed):
    """The block's shared memory for input channels [c0, c0 + ccn): halo, weights [r][k]
    and the offset table (-1 for the rounding to 8). ``fixed``: FixedHalo's layout (channel
    stride of 8 mod 32, reduction in (u, v, c) order; ccn = 8, zeros past C)."""
    h0, w0, hr, hc, kh, kw, dh, dw = geometry
    _, c_total, height, width = x.shape
    cstride = halo_channel_stride(hr, hc, kh if fixed else 0)
    halo = np.full(max(_HALO_MAX, ccn * cstride), np.nan)
    for c in range(ccn):
        for hrow in range(hr):
            h = h0 + hrow
            for col in range(hc):
                ww = w0 + col
                inside = c0 + c < c_total and 0 <= h < height and 0 <= ww < width
                halo[c * cstride + hrow * hc + col] = x[n, c0 + c, h, ww] if inside else 0.0
    khw = kh * kw
    rn = ccn * khw
    rpad = (rn + 7) & ~7
    assert ccn * cstride <= _HALO_MAX and rpad <= _HALO_RC
    wt = np.zeros((rpad, BN))
    roff = np.full(rpad, -1)
    for r in range(rn):
        c, uv = (r % ccn, r // ccn) if fixed else divmod(r, khw)
        u, v = divmod(uv, kw)
        roff[r] = c * cstride + u * dh * hc + v * dw
        for kk in range(min(BN, wflat.shape[0] - k0)):
            if c0 + c < c_total:
                wt[r, kk] = wflat[k0 + kk, (c0 + c) * khw + uv]
    return halo, wt, roff


def warp_steps(acc, halo, wt, roff, warp, sh, sw, hc, extent):
    """One warp's MMA steps over a staged chunk, into acc[i, j, lane, element]."""
    warp_row, warp_k = warp & 3, (warp >> 2) * 32
    pofs = [[warp_row * sh * hc + (i * 16 + GID + half * 8) * sw for half in range(2)]
            for i in range(2)]

    def load(pof, off):
        idx = pof + off
        assert ((off < 0) | ((idx >= 0) & (idx < extent))).all()
        return np.where(off >= 0, halo[np.clip(idx, 0, _HALO_MAX - 1)], 0.0)

    for ks in range(0, len(roff), 8):
        o0, o1 = roff[ks + TIG], roff[ks + TIG + 4]
        for i in range(2):
            a = np.zeros((16, 8))
            a[GID, TIG], a[GID + 8, TIG] = load(pofs[i][0], o0), load(pofs[i][1], o0)
            a[GID, TIG + 4], a[GID + 8, TIG + 4] = load(pofs[i][0], o1), load(pofs[i][1], o1)
            for j in range(4):
                b = np.zeros((8, 8))
                b[TIG, GID] = wt[ks + TIG, warp_k + j * 8 + GID]
                b[TIG + 4, GID] = wt[ks + TIG + 4, warp_k + j * 8 + GID]
                d = a @ b
                acc[i, j, :, 0] += d[GID, 2 * TIG]
                acc[i, j, :, 1] += d[GID, 2 * TIG + 1]
                acc[i, j, :, 2] += d[GID + 8, 2 * TIG]
                acc[i, j, :, 3] += d[GID + 8, 2 * TIG + 1]


def store(y, acc, bias, n, k0, p0, q0, warp):
    """The epilogue of one warp: fragment elements to y[n, k, p, q] (+ bias)."""
    _, k_total, p_total, q_total = y.shape
    warp_row, warp_k = warp & 3, (warp >> 2) * 32
    p = p0 + warp_row
    if p >= p_total:
        return
    for i in range(2):
        for half in range(2):
            for lane in range(32):
                q = q0 + i * 16 + GID[lane] + half * 8
                for j in range(4):
                    for e in range(2):
                        k = k0 + warp_k + j * 8 + 2 * TIG[lane] + e
                        if q < q_total and k < k_total:
                            v = acc[i, j, lane, half * 2 + e]
                            y[n, k, p, q] = v + (0.0 if bias is None else bias[k])


def emulate(x, w, bias, stride, padding, dilation, grid_x=7):
    """conv2d_halo's result, every block, warp and lane emulated (blocks loop over tiles)."""
    n_total, c_total, height, width = x.shape
    k_total, _, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    p_total = (height + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    q_total = (width + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    cc, hr, hc = halo_chunk(c_total, (kh, kw), stride, dilation)
    fixed = fixed_ksize((kh, kw), stride, dilation) > 0
    assert cc >= 1
    y = np.full((n_total, k_total, p_total, q_total), np.nan)
    tiles_w = -(-q_total // TW)
    tiles = -(-p_total // TH) * tiles_w
    wflat = w.reshape(k_total, -1)
    for k0 in range(0, k_total, BN):
        for block in range(min(grid_x, n_total * tiles)):
            for tile in range(block, n_total * tiles, grid_x):
                n, t = divmod(tile, tiles)
                p0, q0 = (t // tiles_w) * TH, (t % tiles_w) * TW
                geometry = (p0 * sh - ph, q0 * sw - pw, hr, hc, kh, kw, dh, dw)
                acc = np.zeros((8, 2, 4, 32, 4))
                for c0 in range(0, c_total, cc):
                    ccn = cc if fixed else min(cc, c_total - c0)
                    halo, wt, roff = stage_chunk(x, wflat, n, c0, ccn, k0, geometry, fixed)
                    extent = ccn * halo_channel_stride(hr, hc, kh if fixed else 0)
                    for warp in range(8):
                        warp_steps(acc[warp], halo, wt, roff, warp, sh, sw, hc, extent)
                for warp in range(8):
                    store(y, acc[warp], bias, n, k0, p0, q0, warp)
    return y


def pool_stats_epilogue(acc, bias, sign, shift, n, t, k0, p0, q0, shape, pool, ext, partial):
    """conv2d_halo_pool_stats' epilogue for one tile: its shuffles, shared scratch and
    window loop, as the kernel indexes them."""
    _, k_total, p_total, q_total = shape
    ho, wo = p_total // pool, q_total // pool
    wcs = TW // pool
    stats = np.zeros((TH, BN, 2))
    rows_ext = np.full((TH, wcs, BN), np.nan)
    for warp in range(8):
        warp_row, warp_k = warp & 3, (warp >> 2) * 32
        p = p0 + warp_row
        for j in range(4):
            for e in range(2):
                kl = warp_k + j * 8 + 2 * TIG + e  # per lane
                k = k0 + kl
                k_in = k < k_total
                b = np.where(k_in, bias[np.minimum(k, k_total - 1)], 0.0)
                sh = np.where(k_in, shift[np.minimum(k, k_total - 1)], 0.0)
                neg = k_in & (sign[np.minimum(k, k_total - 1)] < 0)
                s1, s2 = np.zeros(32), np.zeros(32)
                for i in range(2):
                    for half in range(2):
                        q = q0 + i * 16 + GID + half * 8
                        v = acc[warp, i, j, :, half * 2 + e] + b
                        ok = (p < p_total) & (q < q_total)
                        d = v - sh
                        s1 += np.where(ok, d, 0.0)
                        s2 += np.where(ok, d * d, 0.0)
                        m = np.where(neg, -v, v)
                        step = 4
                        while step < 4 * pool:
                            m = np.fmax(m, m[LANE ^ step])
                            step <<= 1
                        for lane in np.flatnonzero(GID % pool == 0):
                            wc = (i * 16 + half * 8 + GID[lane]) // pool
                            rows_ext[warp_row, wc, kl[lane]] = m[lane]
                step = 4
                while step < 32:
                    s1, s2 = s1 + s1[LANE ^ step], s2 + s2[LANE ^ step]
                    step <<= 1
                for lane in np.flatnonzero(GID == 0):
                    stats[warp_row, kl[lane]] = s1[lane], s2[lane]
    for kl in range(min(BN, k_total - k0)):
        partial[n, k0 + kl, t] = stats[:, kl].sum(axis=0)
    for idx in range((TH // pool) * wcs * BN):
        wc, rest = idx % wcs, idx // wcs
        wr, kl = rest % (TH // pool), rest // (TH // pool)
        k, ph, pw = k0 + kl, p0 // pool + wr, q0 // pool + wc
        if k >= k_total or ph >= ho or pw >= wo:
            continue
        m = rows_ext[wr * pool, wc, kl]
        for r in range(1, pool):
            m = np.fmax(m, rows_ext[wr * pool + r, wc, kl])
        ext[n, k, ph, pw] = -m if sign[k] < 0 else m


def first_values(x, w, bias, shift_group, padding, dilation):
    """conv2d_first_values: a warp per statistics row, its lanes striding the reduction."""
    _, c_total, height, width = x.shape
    k_total, _, kh, kw = w.shape
    groups = k_total // shift_group
    khw = kh * kw
    shift = np.empty(x.shape[0] * groups)
    for row in range(shift.size):
        n, c = row // groups, (row % groups) * shift_group
        lanes = np.zeros(32)
        for r in range(c_total * khw):
            ci, uv = divmod(r, khw)
            u, v = divmod(uv, kw)
            h, ww = u * dilation[0] - padding[0], v * dilation[1] - padding[1]
            if 0 <= h < height and 0 <= ww < width:
                lanes[r % 32] += x[n, ci, h, ww] * w.reshape(k_total, -1)[c, r]
        shift[row] = lanes.sum() + bias[c]
    return shift


def emulate_pool_stats(x, w, bias, sign, shift_group, stride, padding, dilation, pool,
                       grid_x=7):
    """conv2d_first_values and conv2d_halo_pool_stats: (ext, partial, shift)."""
    y = emulate(x, w, None, stride, padding, dilation, grid_x)  # tiles' acc, checked above
    n_total, k_total, p_total, q_total = y.shape
    groups = k_total // shift_group
    first = first_values(x, w, bias, shift_group, padding, dilation)
    shift = np.repeat(first, shift_group).reshape(n_total, k_total)
    tiles_w = -(-q_total // TW)
    tiles = -(-p_total // TH) * tiles_w
    ext = np.full((n_total, k_total, p_total // pool, q_total // pool), np.nan)
    partial = np.full((n_total, k_total, tiles, 2), np.nan)
    for k0 in range(0, k_total, BN):
        for n in range(n_total):
            for t in range(tiles):
                p0, q0 = (t // tiles_w) * TH, (t % tiles_w) * TW
                acc = np.zeros((8, 2, 4, 32, 4))
                for warp in range(8):  # the accumulators as conv2d_halo's store reads them
                    warp_row, warp_k = warp & 3, (warp >> 2) * 32
                    for i in range(2):
                        for half in range(2):
                            q = np.minimum(q0 + i * 16 + GID + half * 8, q_total - 1)
                            p = min(p0 + warp_row, p_total - 1)
                            for j in range(4):
                                for e in range(2):
                                    k = np.minimum(k0 + warp_k + j * 8 + 2 * TIG + e,
                                                   k_total - 1)
                                    acc[warp, i, j, :, half * 2 + e] = y[n, k, p, q]
                pool_stats_epilogue(acc, bias, sign, shift[n], n, t, k0, p0, q0, y.shape,
                                    pool, ext, partial)
    return ext, partial, shift.reshape(n_total, groups, shift_group)[:, :, 0].reshape(-1)


def check_pool_stats(rng) -> float:
    """The pool-stats epilogue against its definition on the float64 convolution."""
    worst = 0.0
    for xs, ws, pool, group in [((2, 8, 13, 40), (70, 8, 3, 3), 4, 5),
                                ((1, 3, 9, 37), (12, 3, 3, 3), 2, 4)]:
        x, w = rng.standard_normal(xs), rng.standard_normal(ws)
        bias, sign = rng.standard_normal(ws[0]), rng.standard_normal(ws[0])
        ext, partial, shift = emulate_pool_stats(x, w, bias, sign, group, (1, 1), (0, 0),
                                                 (1, 1), pool)
        y = reference.conv(x, w, bias, (1, 1), (0, 0), (1, 1), 1)
        n, k, p, q = y.shape
        ho, wo = p // pool, q // pool
        win = y[:, :, :ho * pool, :wo * pool].reshape(n, k, ho, pool, wo, pool)
        want = np.where(sign[None, :, None, None] < 0, win.min(axis=(3, 5)),
                        win.max(axis=(3, 5)))
        d = y - np.repeat(shift.reshape(n, k // group), group, axis=1)[:, :, None, None]
        sums = np.stack([d.sum(axis=(2, 3)), (d * d).sum(axis=(2, 3))], -1)
        errs = [np.abs(ext - want).max(), np.abs(partial.sum(axis=2) - sums).max() / p / q,
                np.abs(shift - y[:, ::group, 0, 0].reshape(-1)).max()]
        print(f"pool-stats x {xs} w {ws} pool {pool} group {group}: max errors (ext, "
              f"sums / pixels, shift) {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e}")
        worst = max([worst] + [e if not np.isnan(e) else float("inf") for e in errs])
    return worst


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rng = np.random.default_rng(0)
    worst = 0.0
    for xs, ws, stride, padding, dilation in CASES:
        x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
        ref = reference.conv(x, w, b, stride, padding, dilation, 1)
        got = emulate(x, w, b, stride, padding, dilation)
        err = float(np.abs(got - ref).max()) if not np.isnan(got).any() else float("inf")
        worst = max(worst, err)
        print(f"x {xs} w {ws} stride {stride} padding {padding} dilation {dilation} "
              f"(cc, hr, hc) {halo_chunk(xs[1], ws[2:], stride, dilation)}: max error {err:.1e}")
    worst = max(worst, check_pool_stats(rng))
    return 0 if worst < 1e-9 else 1  # an output never written (NaN) counts as inf


if __name__ == "__main__":
    sys.exit(main())
