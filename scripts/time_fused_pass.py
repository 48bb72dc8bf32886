"""Device time of the fused window-extremum + statistics pass, per kernel variant (device).

For the canonical conv outputs of A (k = 4) and B (k = 2) in both layouts: the scalar kernel
and the 16-byte ones (NCHW: K-row bands per plane; channels-last: per channel quad and per
window row, with the extrema NCHW or, "...>nhwc", channels-last);
pipeline B's GroupNorm of the pooled extrema (NCHW or channels-last) per block size;
pipeline C's channels-last normalize pass, scalar vs 16-byte, and its softmax of class blocks
or NCDHW rows, two passes vs the one-read cluster kernel. Median ms, L2 flushed, with
the read-once floor at the measured copy bandwidth.
Usage: python scripts/time_fused_pass.py [passes] [groupnorm] [softmax] (default: all).
"""

import sys

import cupy
import numpy

from cufused import normalization, pipelines
from cufused.softmax import softmax_rows
from cufused._cudnn import empty_in_layout
from cufused.benchmark import Timer, measure_ceilings


def fused_passes(timer, copy):
    for name, shape, pool, group in (("A", (128, 64, 126, 126), 4, 4),
                                     ("B", (512, 128, 34, 34), 2, 1)):
        for layout in ("nchw", "nhwc"):
            y = empty_in_layout(shape, layout)
            y[...] = cupy.random.default_rng(0).random(shape, dtype=cupy.float32)
            n, c, h, w = shape
            ext = cupy.empty((n, c, h // pool, w // pool), dtype=cupy.float32)
            sign = cupy.ones(c, dtype=cupy.float32)
            variants = (("scalar", "vec4", "rows", "vec4>nhwc" if pool == 2 else "rows>nhwc")
                        if layout == "nhwc" else ("scalar", "bands"))
            for label in variants:
                dst = empty_in_layout(ext.shape, "nhwc") if label.endswith(">nhwc") else ext
                variant = pipelines._fused_pass_variant(y, pool, label.removesuffix(">nhwc"))
                ms = timer(lambda: pipelines._pool_extremum_stats(
                    cupy, y, dst, pool, bias=None, sign_a=sign, sign_b=None,
                    shift_group=group, per_sample=group > 1, variant=variant))
                floor = y.nbytes / copy * 1e3
                print(f"{name} {layout} {label}: {ms:.3f} ms (floor {floor:.3f})", flush=True)


def group_norm_b(timer, copy):
    shape = (512, 128, 17, 17)
    default_threads = normalization.group_norm_threads
    coef = cupy.random.default_rng(1).random((2, 128), dtype=cupy.float32)
    out = cupy.empty(shape, dtype=cupy.float32)
    for layout in ("nchw", "nhwc"):
        ext = empty_in_layout(shape, layout)
        ext[...] = cupy.random.default_rng(0).random(shape, dtype=cupy.float32)
        for threads in (64, 96, 128, 256):
            normalization.group_norm_threads = lambda shared_bytes, t=threads: t
            ms = timer(lambda: normalization.launch_group_norm_rows(
                ext, out, 8, None, None, 1e-5, pre=coef))
            print(f"B GroupNorm from {layout}, {threads} threads: {ms:.3f} ms (floor "
                  f"{2 * ext.nbytes / copy * 1e3:.3f})", flush=True)
    normalization.group_norm_threads = default_threads


def softmax_c(timer, copy):
    shape = (32, 64, 32, 64, 64)
    y = empty_in_layout(shape, "nhwc")
    y[...] = 0.5
    out = cupy.empty(shape, dtype=cupy.float32)
    strides = [s // 4 for s in y.strides]
    for vec4 in (False, True):
        ms = timer(lambda: softmax_rows(
            cupy, y, out, 32 * 64, 32 * 64 * 64, 64, (strides[0], strides[1], strides[-1]),
            layout="nhwc", clamp=(0.0, 1.0), vec4=vec4))
        print(f"C softmax nhwc vec4={vec4}: {ms:.3f} ms (stats + apply; floor "
              f"{3 * y.nbytes / copy * 1e3:.3f})", flush=True)
    # Class blocks of C ieee's sub-pixel convolution ((P, N, C, 16, 32, 32), P = 8) and the
    # plain NCDHW output: the two-pass path against the one-read cluster kernel.
    classes = cupy.random.default_rng(0).random((8, 32, 64, 16, 32, 32), dtype=cupy.float32)
    plain = cupy.random.default_rng(0).random(shape, dtype=cupy.float32)
    for layout, src, strides in (("classes", classes, None),
                                 ("nchw", plain, (64 * 131072, 131072, 1))):
        for one_read in (False, True):
            ms = timer(lambda: softmax_rows(
                cupy, src, out, 32 * 64, 32 * 64 * 64, 64, strides, layout=layout,
                clamp=(0.0, 1.0), one_read=one_read))
            print(f"C softmax {layout} one_read={one_read}: {ms:.3f} ms (floors: one read "
                  f"{2 * out.nbytes / copy * 1e3:.3f}, two {3 * out.nbytes / copy * 1e3:.3f})",
                  flush=True)


SECTIONS = {"passes": fused_passes, "groupnorm": group_norm_b, "softmax": softmax_c}


def main(names):
    timer = Timer(repeat=20)
    copy = measure_ceilings(timer)["copy_TBps"] * 1e12
    for name in names or SECTIONS:
        SECTIONS[name](timer, copy)


if __name__ == "__main__":
    numpy.random.seed(0)
    main(sys.argv[1:])
