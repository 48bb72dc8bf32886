"""Host (CPU) time of warm calls, and where it goes (run on the device machine)."""

import cProfile
import pstats
import time

import cupy
import numpy

import cufused
from cufused.benchmark import make_cases


def host_us(fn, n=50):
    fn()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    cupy.cuda.Device().synchronize()
    return t


def main():
    case = make_cases(small=True)[1]
    inputs = case.make_inputs(numpy.random.default_rng(0))
    g = {k: cupy.asarray(v) for k, v in inputs.items()}
    conv = lambda: cufused.conv_transpose2d(g["x"], g["weight"], padding=1)  # noqa: E731
    pipe = lambda: case.run_cufused(inputs, precision="ieee")  # noqa: E731
    print(f"conv_transpose2d host: {host_us(conv):.0f} us/call")
    from cufused import _cudnn

    print("direct cuDNN backend call in use:", [bool(p._direct) for p in _cudnn._plans.values()])
    print(f"pipeline B host: {host_us(pipe):.0f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        pipe()
    prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
