import cupy as cp, numpy as np, cufused, time
from cufused._timing import time_ms
from cufused._cuda import get_kernel
import cufused._kernels.conv_gemm as conv
flush = cp.empty(256 * 2**20 // 4, dtype=cp.float32)
rng = np.random.default_rng(0)
N, C, D, H, W, K = 32, 32, 16, 32, 32, 64
x = cp.asarray(rng.standard_normal((N, C, D, H, W)), dtype=cp.float32)
w = cp.asarray(rng.standard_normal((C, K, 3, 3, 3)) * 0.1, dtype=cp.float32)
xl = cp.ascontiguousarray(x.transpose(0, 2, 3, 4, 1)).transpose(0, 4, 1, 2, 3)
out = cp.empty((N, K, 2 * D, 2 * H, 2 * W), dtype=cp.float32)
opts = dict(stride=2, padding=1, output_padding=1)
for prec in ("tf32", "3xtf32"):
    r = {}
    a = cufused.conv_transpose3d(x, w, **opts, precision=prec)
    b = cufused.conv_transpose3d(xl, w, **opts, precision=prec)
    print(prec, "bitwise equal ncdhw vs last:", bool((a.view(cp.uint32) == b.view(cp.uint32)).all()))
    for name, xx in (("ncdhw", x), ("last", xl)):
        from cufused._cudnn import plan_options
        for eng in ("igemm", "cudnn"):
            with plan_options(engine=eng):
                fn = lambda: cufused.conv_transpose3d(xx, w, **opts, precision=prec, out=out)
                r[name + " " + eng] = [time_ms(fn, repeat=15, flush=flush) for _ in range(3)]
    # kernels alone
    for name, xx, nc in (("kernel ncdhw", x, True), ("kernel last", xl, False)):
        fn = lambda: conv._transposed_s2k3("CT3_CONV", xx, w, None, out_shape=out.shape,
                     runs=conv.transposed_s2k3_runs(xx.shape, K, stores=True), clamp=(0.0, 0.0),
                     passes=1 if prec == "tf32" else 3, y=out, x_ncdhw=nc)
        r[name] = [time_ms(fn, repeat=15, flush=flush) for _ in range(3)]
    for k, v in r.items():
        print(prec, k, " ".join(f"{t:.4f}" for t in v))
