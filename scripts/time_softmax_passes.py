"""Device time of pipeline C's softmax passes over a channels-last convolution output (device).

The canonical C tf32 shape (32 x 64 channels x 32 * 64 * 64 positions, channels-last), clamp
[0, 1], bias and scale: the statistics + finalize + normalize passes of ``softmax_rows``
with the scalar kernels or the 16-byte ones. Median ms, CUDA events, L2 flushed, the variants
in alternating rounds.
Usage: python scripts/time_softmax_passes.py
"""

import importlib

import cupy

from cufused._cudnn import empty_in_layout
from cufused.benchmark import Timer

softmax_module = importlib.import_module("cufused.softmax")  # cufused.softmax: the function


def main():
    n, c, s = 32, 64, 32 * 64 * 64
    rng = cupy.random.default_rng(0)
    y = empty_in_layout((n, c, s), "nhwc")
    y[...] = rng.uniform(-1.0, 2.0, y.shape, dtype=cupy.float32)
    bias = rng.uniform(-0.1, 0.1, c, dtype=cupy.float32)
    scale = rng.uniform(0.5, 1.5, c, dtype=cupy.float32)
    out = cupy.empty((n, c, s), dtype=cupy.float32)

    def variant(vec4):
        def run():
            softmax_module.softmax_rows(cupy, y, out, n * c, s, c, (s * c, 1, c),
                                        layout="nhwc", bias=bias, scale=scale,
                                        clamp=(0.0, 1.0), vec4=vec4)
        return run

    fns = {"scalar passes": variant(False), "16-byte passes": variant(True)}
    times = Timer(repeat=30).compare(fns)
    for name, ms in times.items():
        print(f"{name:28s} {ms:.3f} ms")


if __name__ == "__main__":
    main()
