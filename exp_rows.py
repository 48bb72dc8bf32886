import cupy
from cufused import pipelines
from cufused._cuda import get_kernel as real
from cufused._cudnn import empty_in_layout, transpose_channels
from cufused.normalization import _affine_apply
from cufused.benchmark import Timer
timer = Timer(repeat=30)
shape = (128, 64, 126, 126)
y = empty_in_layout(shape, "nhwc")
y[...] = cupy.random.default_rng(0).random(shape, dtype=cupy.float32)
ext_nchw = cupy.empty((128, 64, 31, 31), dtype=cupy.float32)
ext = empty_in_layout((128, 64, 31, 31), "nhwc")
sign = cupy.ones(64, dtype=cupy.float32)
for u in ("", "NCHW", "", "NCHW"):
    dst = ext_nchw if u == "NCHW" else ext
    pipelines.get_kernel = lambda f, n, u=u: real(f, n.replace("nhwc_rows<4, 2, true>", f"nhwc_rows<4, 2, true{u}>"))
    ms = timer(lambda: pipelines._pool_extremum_stats(cupy, y, dst, 4, bias=None, sign_a=sign,
                                                      sign_b=None, shift_group=16, per_sample=True))
    print(f"rows U{u or ' 2'}: {ms:.4f} ms", flush=True)
coef = cupy.random.default_rng(1).random((2, 128 * 64), dtype=cupy.float32)
out = cupy.empty((128, 64, 31, 31), dtype=cupy.float32)
for _ in range(2):
    print("affine nchw", timer(lambda: _affine_apply(cupy, ext_nchw, out, coef[0], coef[1], 961, 128 * 64, 2, 0.0, 1.0)))
    print("transpose affine", timer(lambda: transpose_channels(ext, out, to_channels_last=False, affine=(coef[0], coef[1], 0.0, 1.0))))
