"""Device time of a canonical pipeline per convolution strategy (run on the device machine).

The autotuner picks a convolution plan by the convolution's own time; this shows what each
strategy costs the whole fused pipeline (its post-convolution kernels read the layout the
strategy writes). Usage: python scripts/time_pipeline_pins.py [CASE ...] (default: C).
Median ms, CUDA events, L2 flushed.
"""

import sys

import cupy
import numpy

from cufused._cudnn import plan_options
from cufused.benchmark import CASES, Timer

PINS = (None, "nchw", "nhwc", "nchw>nhwc", "subpixel nchw", "subpixel nhwc")


def main(names):
    timer = Timer(repeat=20)
    for case in CASES:
        if case.name not in names:
            continue
        inputs = case.make_inputs(numpy.random.default_rng(0))
        out = cupy.empty(case.output_shape, dtype=cupy.float32)
        for precision in ("ieee", "tf32"):
            for pin in PINS:
                options = {"autotune": True} if pin is None else {"autotune": True,
                                                                   "pins": (pin,)}
                with plan_options(**options):
                    ms = timer(lambda: case.run_cufused(inputs, precision=precision, out=out))
                print(f"{case.name} {precision} {pin or 'autotuned'}: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["C"])
