"""``quotient`` (cufused/_cuda/common.cuh), the kernels' division by a float reciprocal,
emulated with its float32 rounding and its unsigned 32-bit products against integer division:
for indices up to 2**31 - 1 (where the estimate exceeds the quotient and signed products
wrapped), divisors up to 2**31 - 1 and reciprocals a unit in the last place off (the launchers
round 1 / d in double, the kernels in float)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from cufused._cuda import source

# The statements emulated below, as the source states them.
STATEMENTS = [
    "unsigned q = (unsigned)__float2int_rz((float)i * inv_d);",
    "const unsigned ui = (unsigned)i, ud = (unsigned)d;",
    "while (q * ud > ui) --q;",
    "while ((q + 1) * ud <= ui) ++q;",
    "return (int)q;",
]


def quotient(i: np.ndarray, d: int, inv_d: np.float32) -> np.ndarray:
    """The device function on int64 ``i`` (values of int), step by step in NumPy."""
    estimate = np.trunc((i.astype(np.float32) * inv_d).astype(np.float64))  # rz
    q = np.clip(estimate, -2**31, 2**31 - 1).astype(np.int64).astype(np.uint32)  # saturates
    ui, ud = i.astype(np.uint32), np.uint32(d)
    # Adding 2**32 - 1 subtracts one, modulo 2**32.
    for step, test in ((np.uint32(2**32 - 1), lambda q: q * ud > ui),
                       (np.uint32(1), lambda q: (q + np.uint32(1)) * ud <= ui)):
        for _ in range(2**10):  # products wrap modulo 2**32, as on the device
            move = test(q)
            if not move.any():
                break
            q = np.where(move, q + step, q)
        else:
            raise AssertionError(f"no fixed point for d = {d}")
    return q.astype(np.int64)


def test_the_emulated_statements_are_the_source():
    body = re.search(r"int quotient\(int i, int d, float inv_d\) \{(.*?)\n\}",
                     source("common.cuh"), re.S).group(1)
    assert [line.strip() for line in body.strip().splitlines()] == STATEMENTS


DIVISORS = [1, 2, 3, 7, 8, 33, 126, 4095, 65536, 2**20 + 1, 2**24 - 1, 2**24 + 1, 2**30 + 3,
            2**31 - 1]


@pytest.mark.parametrize("d", DIVISORS)
def test_quotient_is_exact(d):
    rng = np.random.default_rng(d)
    i = np.concatenate([np.arange(2**16), np.arange(2**31 - 2**16, 2**31),
                        rng.integers(0, 2**31, 2**16)])
    reciprocals = {np.float32(1) / np.float32(d), np.float32(1 / d)}
    for inv_d in reciprocals | {np.nextafter(r, np.float32(s)) for r in reciprocals
                                for s in (0, np.inf)}:
        got = quotient(i, d, inv_d)
        assert np.array_equal(got, i // d), f"d = {d}, inv_d = {inv_d!r}"
