"""Where a warm pipeline call's host time goes, in call order (run on the device machine).

Each canonical pipeline is called back to back (each call waits for the device first, as in
the benchmark's rounds) with timestamps taken on entry to and exit from the library
functions it passes through; printed: the median microseconds from one timestamp to the
next. "launch" marks are the cuDNN plan's CUDA-graph launch, the first device work of
pipelines A and B. Usage: python scripts/host_breakdown.py [CASE ...] (default: A B C).
"""

import functools
import sys
import time

import cupy
import numpy

import cufused
from cufused import _cudnn
from cufused.pipelines import pipeline_a, pipeline_b, pipeline_c
from pipeline_calls import pipeline_calls  # scripts/, the script's own folder

marks = []


def traced(module, name):
    """Replace ``module.name`` by a wrapper that marks its entry and exit."""
    fn = getattr(module, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        marks.append((f"> {name}", time.perf_counter()))
        try:
            return fn(*args, **kwargs)
        finally:
            marks.append((f"< {name}", time.perf_counter()))
    setattr(module, name, wrapper)


def main(names, calls=50):
    for name in ("conv2d_groupnorm_scale_maxpool_clamp",
                 "conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
                 "conv_transpose3d_avgpool_clamp_softmax_multiply"):
        traced(cufused, name)
    # The names each pipeline module calls (traced where the pipeline looks them up).
    for module in (pipeline_a, pipeline_b, pipeline_c):
        for name in ("conv_on_gpu", "gpu_conv_plan", "pool_into", "fused_pass_variant",
                     "pool_extremum_stats", "group_norm_coefficients", "bn_coefficients",
                     "channel_affine", "transpose_channels", "pool_affine_nonfinite",
                     "pool_bn_tanh_nonfinite", "group_norm_rows", "softmax_rows",
                     "softmax_rows_nonfinite_weight"):
            if hasattr(module, name):
                traced(module, name)
    traced(_cudnn, "conv_plan")
    traced(_cudnn._plan, "_launch_graph")
    traced(_cudnn.ConvPlan, "apply")
    for case, precision, call in pipeline_calls(names):
        for _ in range(5):
            call()
        cupy.cuda.Device().synchronize()
        rows = []
        for _ in range(calls):
            marks.clear()
            call()
            cupy.cuda.Device().synchronize()
            rows.append(list(marks))
        labels = [label for label, _ in rows[-1]]
        steps = numpy.array([[(b[1] - a[1]) * 1e6 for a, b in zip(r, r[1:])] for r in rows
                             if [label for label, _ in r] == labels])
        median = numpy.median(steps, axis=0)
        print(f"{case.name} {precision}: {median.sum():.0f} us from entry to exit, "
              f"{len(steps)} of {calls} calls with this path")
        for label, us in zip(labels[1:], median):
            print(f"  {us:7.1f}  {label}")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit()
    main(sys.argv[1:] or ["A", "B", "C"])
