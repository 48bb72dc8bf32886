"""Device time of a canonical pipeline per convolution strategy (run on the device machine).

The autotuner picks a convolution plan by the convolution's own time; this shows what each
strategy costs the whole fused pipeline (its post-convolution kernels read the layout the
strategy writes). Usage: python scripts/time_pipeline_pins.py [CASE ...] (default: C).
Median ms, CUDA events, L2 flushed; also the same call replayed from one CUDA graph of the
whole pipeline (what is left without host overhead) and whether the conv plan replayed its
own graph (its graph count).
"""

import sys

from cufused._cudnn import _plans, plan_options
from cufused.benchmark import Timer
from pipeline_calls import graph_replay_ms, pipeline_calls  # scripts/, the script's folder

PINS = (None, "nchw", "nhwc", "nchw>nhwc", "subpixel nchw", "subpixel nhwc")


def pins_for(case):
    """The pins that apply: "subpixel" only for transposed convolutions."""
    return [p for p in PINS if case.conv["kind"] == "dgrad" or not (p or "").startswith("sub")]


def main(names):
    timer = Timer(repeat=20)
    for case, precision, call in pipeline_calls(names):
        for pin in pins_for(case):
            options = {"autotune": True} if pin is None else {"autotune": True, "pins": (pin,)}
            with plan_options(**options):
                ms = timer(call)
                graphed = graph_replay_ms(timer, call)
                plans = [p for k, p in _plans.items() if k[1].precision == precision
                         and k[6] == options.get("pins")
                         and k[1].x_shape[0] == case.conv["x_shape"][0]]
                graphs = [len(p._replays or {}) for p in plans]
                costs = ", ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for p in plans
                                  for k, v in p.candidates.items())
            print(f"{case.name} {precision} {pin or 'autotuned'}: {ms:.3f} ms, whole-call "
                  f"graph {graphed:.3f} ms, conv plan graphs {graphs}; strategies (ms "
                  f"alone/with conversions) {costs}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["C"])
