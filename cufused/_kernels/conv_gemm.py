"""Launcher of ``conv_gemm.cu``: the implicit-GEMM convolution on tensor cores."""

from __future__ import annotations

import numpy

from .._cuda import get_kernel, optional

_FILE = "conv_gemm.cu"
_TILE_M, _TILE_K, _THREADS = 128, 64, 256  # CONV_BM, CONV_BN, CONV_THREADS


def conv2d_implicit_gemm(x, w, bias, y, *, stride: tuple[int, int], padding: tuple[int, int],
                         dilation: tuple[int, int], passes: int) -> None:
    """``y = conv2d(x, w) + bias`` for contiguous NCHW float32 ``x``, OIHW ``w`` (groups 1)
    and NCHW ``y`` of the convolution's output shape; ``passes`` 1 (TF32) or 3 (3xTF32)."""
    n, c, h, wd = x.shape
    k, _, kh, kw = w.shape
    p, q = y.shape[2:]
    rows = n * p * q
    if rows == 0 or k == 0:
        return
    i32 = numpy.int32
    get_kernel(_FILE, f"conv2d_igemm<{passes}>")(
        (-(-rows // _TILE_M), -(-k // _TILE_K)), (_THREADS,),
        (x, w, optional(bias), y, i32(n), i32(c), i32(h), i32(wd), i32(k), i32(kh), i32(kw),
         i32(p), i32(q), i32(stride[0]), i32(stride[1]), i32(padding[0]), i32(padding[1]),
         i32(dilation[0]), i32(dilation[1])))
