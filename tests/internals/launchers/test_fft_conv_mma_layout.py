"""fft_conv.cu's inverse transforms on tensor cores (``fft_conv_output_planes_mma``): its
shared-memory layout, tables, bin loads, block_mma's tiles and stores, emulated in float64
with every unwritten value NaN, against numpy.fft; and the launcher's layout sizes."""

from __future__ import annotations

import numpy as np
import pytest

from cufused._kernels.fft_conv import _MMA_WN_COLUMNS, _MMA_WN_ROWS, _output_mma_layout

P, THREADS, LOADS = 8, 256, 16  # FFT_PLANES, the launch's threads, FFT_LOADS


def _round_up(v, m):
    return -(-v // m) * m


def _block_mma(m_count, n_count, k_count, load_a, load_b, row_at, store, wn):
    # Every tile as block_mma reads it: rows, columns and reductions past M, N and K read
    # as they are (no clamp), the products summed in float64.
    k = np.arange(_round_up(k_count, 8))
    for m0 in range(0, m_count, 16):
        for n0 in range(0, n_count, 8 * wn):
            rows, cols = np.arange(m0, m0 + 16), np.arange(n0, n0 + 8 * wn)
            c = load_a(rows[:, None], k[None, :]) @ load_b(k[:, None], cols[None, :])
            for i, m in enumerate(rows):
                if m < m_count:
                    row = row_at(m)
                    for j, col in enumerate(cols):
                        if col < n_count:
                            store(row, col, c[i, j])


def _emulate(ho, wo, l1, l2, ph, pw, planes_valid, spectrum):
    f2 = l2 // 2 + 1
    k1, k2 = _round_up(2 * l1, 8), _round_up(2 * f2, 8)
    s_t, s_o = (k1 + 3) // 8 * 8 + 4, (2 * f2 + 3) // 8 * 8 + 4
    s_s = (_round_up(P * f2, 8 * _MMA_WN_COLUMNS) + 7) // 16 * 16 + 8
    s_r = (_round_up(wo, 8 * _MMA_WN_ROWS) + 7) // 16 * 16 + 8
    for stride, mod in ((s_t, 8), (s_o, 8), (s_s, 16), (s_r, 16)):
        assert stride % mod == mod // 2  # fragment loads over 32 banks
    base_s = 2 * ho * s_t
    base_o = base_s + k1 * s_s
    base_r = base_o + P * ho * s_o + max(k2 - s_o, 0)
    end = max(base_r + k2 * s_r, _round_up(2 * ho, 16) * s_t,
              base_o + (_round_up(P * ho, 16) - 1) * s_o + k2)
    assert _output_mma_layout((ho, wo), (l1, l2)) == (base_s + k2 * s_r, end)
    assert base_s % 4 == base_r % 4 == (k2 * s_r) % 4 == 0  # the 16-byte table copies
    # fft_conv_output_tables
    tables = np.zeros(base_s + k2 * s_r)
    for i in range(tables.size):
        if i < base_s:
            row, col = divmod(i, s_t)
            if col < 2 * l1:
                angle = 2 * np.pi * (((col >> 1) * ((row >> 1) + ph)) % l1) / l1
                tables[i] = (np.cos(angle) if (row & 1) == (col & 1)
                             else np.sin(angle) if row & 1 else -np.sin(angle))
        else:
            row, j = divmod(i - base_s, s_r)
            kx = row >> 1
            if kx < f2 and j < wo:
                angle = 2 * np.pi * ((kx * (j + pw)) % l2) / l2
                twice = 1 if kx == 0 or 2 * kx == l2 else 2
                tables[i] = twice * (-np.sin(angle) if row & 1 else np.cos(angle))
    shared = np.full(end, np.nan)
    shared[:base_s] = tables[:base_s]
    shared[base_r:base_r + k2 * s_r] = tables[base_s:]
    shared[base_s + 2 * l1 * s_s:base_s + k1 * s_s] = 0
    o_pad = s_o - 2 * f2
    for row in range(P * ho):
        shared[base_o + row * s_o + 2 * f2:base_o + row * s_o + s_o] = 0
    shared[base_o + P * ho * s_o:base_r] = 0
    # The bin loads: (ky, kx) kept by steps of THREADS / P bins.
    step = THREADS // P
    step_ky, step_kx = divmod(step, f2)
    count = l1 * f2
    for thread in range(THREADS):
        p = thread % P
        ky, kx = divmod(thread // P, f2)
        for b0 in range(thread // P, count, LOADS * step):
            for u in range(LOADS):
                b = b0 + u * step
                if b < count:
                    assert (ky, kx) == divmod(b, f2)
                    v = spectrum[p, ky, kx] if p < planes_valid else 0
                    shared[base_s + 2 * ky * s_s + kx * P + p] = v.real
                    shared[base_s + (2 * ky + 1) * s_s + kx * P + p] = v.imag
                ky, kx = ky + step_ky, kx + step_kx
                if kx >= f2:
                    ky, kx = ky + 1, kx - f2
    assert o_pad >= 0

    def store_o(row, c, v):
        shared[base_o + row + (c % P) * ho * s_o + 2 * (c // P)] = v

    _block_mma(2 * ho, P * f2, 2 * l1, lambda m, k: shared[m * s_t + k],
               lambda k, c: shared[base_s + k * s_s + c],
               lambda m: (m >> 1) * s_o + (m & 1), store_o, _MMA_WN_COLUMNS)
    y = np.full((P, ho, wo), np.nan)

    def store_y(row, j, v):
        if row is not None:
            y[row[0], row[1], j] = v

    _block_mma(P * ho, wo, 2 * f2, lambda m, k: shared[base_o + m * s_o + k],
               lambda k, j: shared[base_r + k * s_r + j],
               lambda m: divmod(m, ho) if m // ho < planes_valid else None, store_y,
               _MMA_WN_ROWS)
    return y


@pytest.mark.parametrize("ho, wo, l1, l2, ph, pw", [
    (34, 34, 35, 35, 1, 1), (1, 1, 1, 1, 0, 0), (5, 7, 6, 8, 1, 0), (20, 9, 21, 12, 1, 3),
    (3, 30, 4, 32, 0, 2), (13, 2, 15, 3, 2, 1), (9, 33, 11, 34, 2, 0)])
@pytest.mark.parametrize("planes_valid", [8, 5])
def test_output_planes_mma_emulated(rng, ho, wo, l1, l2, ph, pw, planes_valid):
    # The kernel's result is the inverse DFT without its 1 / (L1 L2) (the weight's bins
    # carry it), cropped at (ph, pw): for the bins of real planes, the planes times L1 L2.
    planes = rng.standard_normal((P, l1, l2))
    spectrum = np.fft.fft2(planes)[:, :, :l2 // 2 + 1]
    y = _emulate(ho, wo, l1, l2, ph, pw, planes_valid, spectrum)
    want = planes[:planes_valid, ph:ph + ho, pw:pw + wo] * (l1 * l2)
    np.testing.assert_allclose(y[:planes_valid], want, rtol=0,
                               atol=1e-12 * np.abs(want).max())
    assert np.isnan(y[planes_valid:]).all()
