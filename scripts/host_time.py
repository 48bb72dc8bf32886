"""Host time of warm public convolution calls (device): the canonical convolutions of cases
A, B and C in both precisions, with CUDA-graph replay of the plan on and off.

Host time = wall time of issuing 20 back-to-back calls / 20, without synchronizing in between
(the device work queues up behind them), median of 5 repeats, microseconds.
``host_time.py profile CASE PRECISION`` prints where a warm call's host time goes (cProfile,
the heuristic plan of the autotuner's usual strategy, so that no tuning runs first).
"""

import cProfile
import pstats
import sys
import time

import cupy
import numpy

import cufused
from cufused import _cudnn

CONVS = {  # name: (function, x shape, w shape, kwargs)
    "A": (cufused.conv2d, (128, 8, 128, 128), (64, 8, 3, 3), {}),
    "B": (cufused.conv_transpose2d, (512, 64, 32, 32), (64, 128, 5, 5), {"padding": 1}),
    "C": (cufused.conv_transpose3d, (32, 32, 16, 32, 32), (32, 64, 3, 3, 3),
          {"stride": 2, "padding": 1, "output_padding": 1}),
}


def host_us(fn, calls=20, repeat=5):
    samples = []
    for _ in range(repeat):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    cupy.cuda.Device().synchronize()
    return float(numpy.median(samples))


def main():
    rng = cupy.random.default_rng(0)
    for name, (fn, xs, ws, kw) in CONVS.items():
        x = rng.random(xs, dtype=cupy.float32)
        w = rng.random(ws, dtype=cupy.float32)
        out = None
        for precision in ("ieee", "tf32"):
            out = fn(x, w, precision=precision, **kw)
            times = {}
            for replay in (True, False):
                with _cudnn.plan_options(replay=replay):
                    call = lambda: fn(x, w, precision=precision, out=out, **kw)  # noqa: E731
                    call()
                    call()
                    times[replay] = host_us(call)
            plans = [p for k, p in _cudnn._plans.items()
                     if k[1].x_shape == xs and k[1].precision == precision]
            graphs = ", ".join(f"{p.strategy.label}: "
                               f"{'capture failed' if p._replays is None else len(p._replays)}"
                               for p in plans)
            print(f"host_us {name} {precision}: replay {times[True]:.0f}, "
                  f"direct {times[False]:.0f} (graphs per plan: {graphs})", flush=True)


def profile(name, precision, calls=300):
    fn, xs, ws, kw = CONVS[name]
    rng = cupy.random.default_rng(0)
    x, w = rng.random(xs, dtype=cupy.float32), rng.random(ws, dtype=cupy.float32)
    label = {"A": "nchw", "B": "subpixel nchw", "C": "subpixel nchw"}[name]
    with _cudnn.plan_options(autotune=False, pins=(label,)):
        out = fn(x, w, precision=precision, **kw)
        for _ in range(3):
            fn(x, w, precision=precision, out=out, **kw)
        cupy.cuda.Device().synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn(x, w, precision=precision, out=out, **kw)
        prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    if sys.argv[1:2] == ["profile"]:
        profile(sys.argv[2], sys.argv[3])
    else:
        main()
