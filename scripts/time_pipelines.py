"""Device time of the fused canonical pipelines and of their convolution plans (device).

A quicker, PyTorch-free slice of ``python -m cufused bench`` for comparing two trees on one
machine: run it once per tree (``PYTHONPATH=<tree>``), alternately. Median ms, CUDA events,
L2 flushed, the pipeline and its convolution timed in alternating rounds.
With ``--touch GIB`` a call that writes a GIB-sized buffer of its own follows each timed
call in the rounds, as the other calls of the benchmark (PyTorch's, the unfused path) move
other memory between two fused calls: both the pipeline and its convolution are then timed
after it. Usage: python scripts/time_pipelines.py [--touch GIB] [CASE ...] (default: A B C).
"""

import sys

import cupy

import cufused
from cufused.benchmark import Timer, conv_plan_for
from pipeline_calls import pipeline_calls  # scripts/, the script's own folder


def main(names, touch_gib=0.0):
    timer = Timer(repeat=30)
    print(f"cufused from {cufused.__file__}, touching {touch_gib} GiB between calls")
    other = cupy.empty(int(touch_gib * 2**30) // 4, dtype=cupy.float32)
    for case, precision, call in pipeline_calls(names):
        plan = conv_plan_for(case, precision)
        operands = plan.example_operands()
        calls = {"fused": call,
                 "touch after fused": lambda: other.fill(1.0),
                 "conv": lambda: plan.run(*operands),
                 "touch after conv": lambda: other.fill(1.0)}
        if not other.size:  # both timed calls right after the other's
            calls = {k: v for k, v in calls.items() if not k.startswith("touch")}
        ms = timer.compare(calls)
        print(f"{case.name} {precision}: fused {ms['fused']:.3f} conv {ms['conv']:.3f} "
              f"post {ms['fused'] - ms['conv']:.3f} ms ({plan.strategy.label}, "
              f"{'direct calls' if plan._replays is None else 'replayed'})", flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    gib = 0.0
    if argv[:1] == ["--touch"]:
        gib, argv = float(argv[1]), argv[2:]
    main(argv or ["A", "B", "C"], gib)
