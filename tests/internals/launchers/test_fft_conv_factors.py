"""The DFT convolution's columns passes: the prime-factor split that fft_conv.cu's ColumnPass
takes (its index maps checked against numpy.fft in float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cufused._kernels.fft_conv import column_factors


@pytest.mark.parametrize("length, rows_in, expected", [
    (35, 32, (5, 7)), (35, 35, (5, 7)), (35, 5, (1, 35)), (21, 20, (3, 7)),
    (18, 17, (2, 9)), (64, 64, (1, 64)), (7, 6, (1, 7)), (105, 100, (7, 15)),
    (15, 6, (1, 15)), (6, 7, (1, 6)), (10, 11, (1, 10))])
def test_column_factors(length, rows_in, expected):
    f1, f2, crt1, crt2 = column_factors(length, rows_in)
    assert (f1, f2) == expected
    if f1 > 1:
        assert f1 * f2 == length and math.gcd(f1, f2) == 1
        assert (crt1 % f1, crt1 % f2, crt2 % f1, crt2 % f2) == (1, 0, 0, 1)


@pytest.mark.parametrize("length", [35, 21, 18, 15, 12])
@pytest.mark.parametrize("sign", [-1, 1])
def test_prime_factor_maps(rng, length, sign):
    # ColumnPass's stages as written in fft_conv.cu: a DFT of f2 over the inputs
    # (f2 n1 + f1 n2) mod L for each n1, then one of f1, into the outputs
    # (crt1 k1 + crt2 k2) mod L.
    f1, f2, crt1, crt2 = column_factors(length, length)
    assert f1 > 1
    x = rng.standard_normal(length) + 1j * rng.standard_normal(length)
    w1 = np.exp(sign * 2j * np.pi * np.outer(range(f1), range(f1)) / f1)
    w2 = np.exp(sign * 2j * np.pi * np.outer(range(f2), range(f2)) / f2)
    stage = np.array([w2 @ x[[(f2 * n1 + f1 * n2) % length for n2 in range(f2)]]
                      for n1 in range(f1)])
    out = np.empty(length, complex)
    for k2 in range(f2):
        out[[(crt1 * k1 + crt2 * k2) % length for k1 in range(f1)]] = w1 @ stage[:, k2]
    want = np.fft.fft(x) if sign < 0 else np.fft.ifft(x) * length
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
