"""Device time of the fused canonical pipelines and of their convolution plans (device).

A quicker, PyTorch-free slice of ``python -m cufused bench`` for comparing two trees on one
machine: run it once per tree (``PYTHONPATH=<tree>``), alternately. Median ms, CUDA events,
L2 flushed, the pipeline and its convolution timed in alternating rounds.
Usage: python scripts/time_pipelines.py [CASE ...] (default: A B C).
"""

import sys

import cupy
import numpy

import cufused
from cufused.benchmark import CASES, Timer, conv_plan_for


def main(names):
    timer = Timer(repeat=30)
    print(f"cufused from {cufused.__file__}")
    for case in CASES:
        if case.name not in names:
            continue
        inputs = case.make_inputs(numpy.random.default_rng(0))
        out = cupy.empty(case.output_shape, dtype=cupy.float32)
        for precision in ("ieee", "tf32"):
            plan = conv_plan_for(case, precision)
            operands = plan.example_operands()
            ms = timer.compare({
                "fused": lambda: case.run_cufused(inputs, precision=precision, out=out),
                "conv": lambda: plan.run(*operands)})
            print(f"{case.name} {precision}: fused {ms['fused']:.3f} conv {ms['conv']:.3f} "
                  f"post {ms['fused'] - ms['conv']:.3f} ms ({plan.strategy.label})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["A", "B", "C"])
