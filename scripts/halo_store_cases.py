"""The halo kernels' ways of writing their results, each with two blocks taking many tiles
(device): conv2d_halo's tile pairs, conv2d_halo_bands' bulk copies, conv2d_halo_nhwc's tensor
stores and thread stores (the geometry compiled in and as arguments),
conv2d_halo_nhwc_direct's stores from the accumulators, conv2d_nhwc_held_weights' halo planes
and tensor stores, and the pooling epilogues of conv2d_halo_pool_stats (TF32) and
conv2d_held_weights_pool_stats (3xTF32 on the wgmma build), in TF32 and 3xTF32, and
conv_transpose3d_s2k3_groups' stores spread over the next class's taps (3xTF32 on the wgmma
build, one block a group; skipped elsewhere) and its softmax sums' form (each block's pairs
of two samples, its flush after its last tile included), against
the float64 reference (relative norm error under 3e-3 in TF32, 1e-5 in 3xTF32) on fresh
random operands. The grids are sized for one multiprocessor, so that each block steps through
its scratch buffers, tile pairs and bands many times: the cases that ``scripts/sanitize.py
--fuzzers halo_stores`` runs under compute-sanitizer. Prints one line a case (``ok`` or
``FAIL``) and the count.

Usage: python scripts/halo_store_cases.py [--seed 1] [--seconds 0]
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

# x shape, w shape, output layout: which path each takes on the wgmma build (sm_90a; the
# portable build stores the pairs, and its threads the channels-last tiles).
CONV_CASES = [
    ((3, 8, 14, 260), (64, 8, 3, 3), "nchw"),  # tile pairs and a last tile alone
    ((2, 8, 10, 72), (64, 8, 3, 3), "nchw"),   # bands of 4 whole rows (TF32)
    ((3, 8, 14, 70), (68, 8, 3, 3), "nhwc"),   # tensor (3xTF32: held weights) stores, 2
                                               # channel tiles
    ((3, 5, 11, 40), (70, 5, 3, 3), "nhwc"),   # thread (3xTF32: direct) stores (K % 4 != 0)
    ((2, 6, 9, 37), (12, 6, 5, 5), "nhwc"),    # tensor stores, the geometry as arguments
]


def _conv_case(conv_gemm, rng, x_shape, w_shape, layout: str, passes: int) -> float:
    """The relative error of one convolution into a NaN-filled y of ``layout``."""
    import cupy

    from cufused import reference

    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) * 0.3).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    ref = reference.conv(x.astype(np.float64), w, b, (1, 1), (0, 0), (1, 1), 1)
    n, k, p, q = ref.shape
    y = (cupy.full((n, k, p, q), np.nan, cupy.float32) if layout == "nchw" else
         cupy.full((n, p, q, k), np.nan, cupy.float32).transpose(0, 3, 1, 2))
    conv_gemm.conv2d_implicit_gemm(cupy.asarray(x), cupy.asarray(w), cupy.asarray(b), y,
                                   stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                                   passes=passes)
    return float(np.linalg.norm(y.get() - ref) / np.linalg.norm(ref))


def _pool_case(conv_gemm, rng, passes: int) -> float:
    """The largest error of pipeline A's pooled extrema (4 x 4 windows) over the largest
    extremum."""
    import cupy

    from cufused import reference

    x = rng.standard_normal((3, 8, 26, 66)).astype(np.float32)
    w = (rng.standard_normal((64, 8, 3, 3)) * 0.3).astype(np.float32)
    ext = cupy.full((3, 64, 6, 16), np.nan, cupy.float32)
    conv_gemm.conv2d_pool_stats(cupy, cupy.asarray(x), cupy.asarray(w), None, ext,
                                sign_a=None, sign_b=None, stride=(1, 1), padding=(0, 0),
                                dilation=(1, 1), pool=4, passes=passes)
    ref = reference.conv(x.astype(np.float64), w, None, (1, 1), (0, 0), (1, 1), 1)
    want = ref[:, :, :24, :64].reshape(3, 64, 6, 4, 16, 4).max(axis=(3, 5))
    return float(np.abs(ext.get() - want).max() / np.abs(want).max())


def _groups_case(conv_gemm, rng, sums: bool) -> float | None:
    """The relative error of conv_transpose3d_s2k3_groups into a NaN-filled channels-last y:
    two channel tiles, the last row and column tiles partial, each group's block taking its
    24 tiles (12 a sample); with ``sums`` its softmax sums' form, the larger of y's error and
    the rows' sums' (each row's pairs against the float64 sum of exp(clamp(y) - ref)); None
    where the kernel does not run (not the wgmma build)."""
    import cupy

    from cufused import reference
    from cufused._layout import empty_in_layout

    x = rng.standard_normal((2, 12, 3, 6, 40)).astype(np.float32)
    w = (rng.standard_normal((12, 66, 3, 3, 3)) * 0.3).astype(np.float32)
    b = rng.standard_normal(66).astype(np.float32)
    ref = reference.conv_transpose(x.astype(np.float64), w, b, (2, 2, 2), (1, 1, 1),
                                   (1, 1, 1), (1, 1, 1), 1)
    x_last = empty_in_layout(x.shape, "nhwc")
    x_last[...] = cupy.asarray(x)
    y = empty_in_layout(ref.shape, "nhwc")
    y.fill(np.nan)
    if not conv_gemm.transposed_s2k3_groups_take(x.shape[1], y, 3):
        return None
    operands = (x_last, cupy.asarray(w), cupy.asarray(b), y)
    lo, hi = -0.5, 1.0
    partial = (conv_gemm.conv_transpose3d_groups_softmax_sums(cupy, *operands, clamp=(lo, hi))
               if sums else conv_gemm.conv_transpose3d_groups(*operands) or None)
    if partial is None:
        return None
    err = float(np.linalg.norm(y.get() - ref) / np.linalg.norm(ref))
    if not sums:
        return err
    pairs, middle = partial.get().astype(np.float64), lo + 0.5 * (hi - lo)
    got = np.where(pairs[..., 0] == -np.inf, 0.0,
                   pairs[..., 1] * np.exp(pairs[..., 0] - middle)).sum(axis=1)
    want = np.exp(np.clip(ref, lo, hi) - middle).reshape(ref.shape[0] * ref.shape[1], -1)
    want = want.sum(axis=1)
    return max(err, float(np.abs(got - want).max() / np.abs(want).max()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="random seed (1)")
    parser.add_argument("--seconds", type=float, default=0.0,
                        help="unused: the cases are fixed (scripts/sanitize.py passes it)")
    args = parser.parse_args(argv)
    from cufused._kernels import conv_gemm

    conv_gemm.sm_count = lambda: 1  # two blocks, each taking many tiles
    names, get_kernel = [], conv_gemm.get_kernel
    conv_gemm.get_kernel = lambda filename, name, **kw: (names.append(name)
                                                          or get_kernel(filename, name, **kw))
    rng = np.random.default_rng(args.seed)
    ran = failed = 0
    # (case, passes, its error: None where its kernel does not run on this build)
    cases = ([(case, passes, functools.partial(_conv_case, conv_gemm, rng, *case, passes))
              for case in CONV_CASES for passes in (1, 3)]
             + [("pool 4", passes, functools.partial(_pool_case, conv_gemm, rng, passes))
                for passes in (1, 3)]
             + [(case, 3, functools.partial(_groups_case, conv_gemm, rng, sums=sums))
                for case, sums in (("class groups", False), ("class groups, softmax sums", True))])
    for case, passes, error in cases:
        err = error()
        if err is None:
            print(f"skip {case}: not the wgmma build", flush=True)
            continue
        ok = err < (3e-3 if passes == 1 else 1e-5)
        ran, failed = ran + 1, failed + (not ok)
        # The convolution's kernel (not the rewrite of non-finite channels after it).
        kernel = next(name for name in reversed(names) if "nonfinite" not in name)
        print(f"{'ok' if ok else 'FAIL'} {kernel}: {case}, error {err:.1e}", flush=True)
    print(f"cases run: {ran}; failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
