"""Device time of a canonical pipeline per convolution strategy (run on the device machine).

The autotuner picks a convolution plan by the convolution's own time; this shows what each
strategy costs the whole fused pipeline (its post-convolution kernels read the layout the
strategy writes). Usage: python scripts/time_pipeline_pins.py [CASE ...] (default: C).
Median ms, CUDA events, L2 flushed; also the same call replayed from one CUDA graph of the
whole pipeline (what is left without host overhead) and whether the conv plan replayed its
own graph (its graph count).
"""

import sys

import cupy
import numpy

from cufused._cudnn import _plans, plan_options
from cufused.benchmark import CASES, Timer

PINS = (None, "nchw", "nhwc", "nchw>nhwc", "subpixel nchw", "subpixel nhwc")


def pins_for(case):
    """The pins that apply: "subpixel" only for transposed convolutions."""
    return [p for p in PINS if case.conv["kind"] == "dgrad" or not (p or "").startswith("sub")]


def main(names):
    timer = Timer(repeat=20)
    for case in CASES:
        if case.name not in names:
            continue
        inputs = case.make_inputs(numpy.random.default_rng(0))
        out = cupy.empty(case.output_shape, dtype=cupy.float32)
        for precision in ("ieee", "tf32"):
            for pin in pins_for(case):
                options = {"autotune": True} if pin is None else {"autotune": True,
                                                                   "pins": (pin,)}
                with plan_options(**options):
                    call = lambda: case.run_cufused(inputs, precision=precision, out=out)  # noqa: E731
                    ms = timer(call)
                    stream = cupy.cuda.Stream(non_blocking=True)
                    with stream:
                        call()
                        stream.begin_capture()
                        call()
                        graph = stream.end_capture()
                    graphed = timer(lambda: graph.launch(stream=cupy.cuda.get_current_stream()))
                    plans = [p for k, p in _plans.items() if k[1].precision == precision
                             and k[6] == options.get("pins") and k[1].x_shape[0] ==
                             case.conv["x_shape"][0]]
                    graphs = [len(p._replays or {}) for p in plans]
                    costs = ", ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for p in plans
                                      for k, v in p.candidates.items())
                print(f"{case.name} {precision} {pin or 'autotuned'}: {ms:.3f} ms, whole-call "
                      f"graph {graphed:.3f} ms, conv plan graphs {graphs}; strategies (ms "
                      f"alone/with conversions) {costs}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["C"])
