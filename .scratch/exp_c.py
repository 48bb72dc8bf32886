import cupy as cp, numpy as np, sys
import cufused._cuda as cu
import cufused._kernels.conv_gemm as conv
from cufused._timing import time_ms
orig = cu.source("conv_gemm.cu")
def variant(src):
    cu.source = lambda f, _o=cu.source.__wrapped__ if hasattr(cu.source, "__wrapped__") else None: src if f == "conv_gemm.cu" else _o(f)
    cu._kernels.clear(); cu._shared_default.clear(); cu._shared_granted.clear()
flush = cp.empty(256 * 2**20 // 4, dtype=cp.float32)
rng = np.random.default_rng(0)
N, C, D, H, W, K = 32, 32, 16, 32, 32, 64
x = cp.asarray(rng.standard_normal((N, C, D, H, W)), dtype=cp.float32)
w = cp.asarray(rng.standard_normal((C, K, 3, 3, 3)) * 0.1, dtype=cp.float32)
xl = cp.ascontiguousarray(x.transpose(0, 2, 3, 4, 1)).transpose(0, 4, 1, 2, 3)
out = cp.empty((N, K, 2 * D, 2 * H, 2 * W), dtype=cp.float32)
def run(xx, nc):
    conv._transposed_s2k3("CT3_CONV", xx, w, None, out_shape=out.shape,
        runs=conv.transposed_s2k3_runs(xx.shape, K, stores=True), clamp=(0.0, 0.0),
        passes=1, y=out, x_ncdhw=nc)
V = {
 "V0": orig,
 "V1 no mid barrier (racy)": orig.replace("""                    if (!tensor_copies) asm volatile("cp.async.wait_all;" ::: "memory");
                    __syncthreads();
                    if (more) copy_planes(next.n, next.t, tile + 1, 2, 3);""", """                    if (more) copy_planes(next.n, next.t, tile + 1, 2, 3);"""),
}
for name, src in V.items():
    assert src is orig or src != orig, name
    variant(src)
    r1 = [time_ms(lambda: run(x, True), repeat=15, flush=flush) for _ in range(3)]
    r2 = [time_ms(lambda: run(xl, False), repeat=15, flush=flush) for _ in range(3)]
    print(name, "ncdhw", " ".join(f"{t:.4f}" for t in r1), "| last", " ".join(f"{t:.4f}" for t in r2), flush=True)
