"""Does a pipeline's device time depend on where its buffers land? (device)

Pipeline B and C timings moved between processes with the same code (B ieee post 0.17 or
0.26 ms, C ieee post 0.84-1.07 ms, H200), stable within a process. Here one process times
the fused pipeline several times, each with the output and the pool's temporaries moved to
new addresses (a held pad of random size shifts what CuPy's pool hands out). Median ms, L2
flushed. Usage: python scripts/address_sensitivity.py [CASE ...] (default: B C).
"""

import sys

import cupy
import numpy

from cufused.benchmark import CASES, Timer


def main(names, trials=6):
    timer = Timer(repeat=15)
    rng = numpy.random.default_rng(0)
    for case in CASES:
        if case.name not in names:
            continue
        inputs = case.make_inputs(numpy.random.default_rng(0))
        for precision in ("ieee", "tf32"):
            times = []
            for _ in range(trials):
                pad = cupy.empty(int(rng.integers(1, 2**28)) // 4, dtype=cupy.float32)
                out = cupy.empty(case.output_shape, dtype=cupy.float32)
                ms = timer(lambda: case.run_cufused(inputs, precision=precision, out=out))
                times.append(ms)
                print(f"{case.name} {precision}: {ms:.3f} ms (out at {out.data.ptr:#x}, pad "
                      f"{pad.nbytes / 2**20:.0f} MiB)", flush=True)
                del pad, out
            print(f"{case.name} {precision}: min {min(times):.3f} max {max(times):.3f} ms",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["B", "C"])
