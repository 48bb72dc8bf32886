"""Device time of the fused canonical pipelines and of their convolution plans (device).

A quicker, PyTorch-free slice of ``python -m cufused bench`` for comparing two trees on one
machine: run it once per tree (``PYTHONPATH=<tree>``), alternately. Median ms, CUDA events,
L2 flushed, the pipeline and its convolution timed in alternating rounds; also the median
host time of a pipeline call (issue only, the device finishes later).
With ``--touch GIB`` a call that writes a GIB-sized buffer of its own follows each timed
call in the rounds, as the other calls of the benchmark (PyTorch's, the unfused path) move
other memory between two fused calls: both the pipeline and its convolution are then timed
after it. With ``--trace`` five more pipeline calls, issued as in the rounds, are recorded
by PyTorch's CUPTI profiler: where each call's device time goes (idle before its first
kernel, idle between its kernels, busy), medians in microseconds.
Usage: python scripts/time_pipelines.py [--touch GIB] [--trace] [CASE ...] (default: A B C).
"""

import sys
import time

import cupy
import numpy

import cufused
from cufused.bench.timing import Timer, conv_plan_for
from host_time import device_activities  # scripts/, the script's own folder
from pipeline_calls import pipeline_calls


def with_host_time(fn, samples):
    """``fn`` that appends its host time (us) to ``samples`` on each call."""
    def timed():
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return timed


def call_timeline(call, flush, other, calls=5):
    """Median (idle before the first kernel, idle between kernels, busy) in us of ``calls``
    calls of ``call`` issued as in the rounds: after ``other``'s fill (if any) and a wait for
    it, the L2 flush, then the call."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if other.size:
                other.fill(1.0)
                cupy.cuda.Device().synchronize()
            flush.fill(1.0)
            call()
            cupy.cuda.Device().synchronize()
    events = device_activities(prof)
    fill = events[0][2]  # the touch's or the flush's kernel
    rows, body, ready = [], [], None
    for start, end, name in events + [(0.0, 0.0, fill)]:
        if name == fill:  # a touch or a flush: the call before it (if any) ended
            if body:
                idle, busy, reach = 0.0, 0.0, body[0][0]
                for s, e in body:
                    idle += max(0.0, s - reach)
                    busy += max(0.0, e - max(s, reach))
                    reach = max(reach, e)
                rows.append((body[0][0] - ready, idle, busy))
                body = []
            ready = end  # after the flush, the call comes next
        else:
            body.append((start, end))
    return numpy.median(numpy.array(rows), axis=0)


def main(names, touch_gib=0.0, trace=False):
    timer = Timer(repeat=30)
    print(f"cufused from {cufused.__file__}, touching {touch_gib} GiB between calls")
    other = cupy.empty(int(touch_gib * 2**30) // 4, dtype=cupy.float32)
    for case, precision, call in pipeline_calls(names):
        plan = conv_plan_for(case, precision)
        operands = plan.example_operands()
        host = []
        calls = {"fused": with_host_time(call, host),
                 "touch after fused": lambda: other.fill(1.0),
                 "conv": lambda: plan.run(*operands),
                 "touch after conv": lambda: other.fill(1.0)}
        if not other.size:  # both timed calls right after the other's
            calls = {k: v for k, v in calls.items() if not k.startswith("touch")}
        ms = timer.compare(calls)
        print(f"{case.name} {precision}: fused {ms['fused']:.3f} conv {ms['conv']:.3f} "
              f"post {ms['fused'] - ms['conv']:.3f} ms ({plan.strategy.label}, "
              f"{'replayed' if plan.replays else 'direct calls'}); host "
              f"{numpy.median(host):.0f} us/call", flush=True)
        if trace:
            first, between, busy = call_timeline(call, timer._flush, other)
            print(f"  timeline us: idle before the first kernel {first:.0f}, idle between "
                  f"kernels {between:.0f}, busy {busy:.0f}", flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit()
    argv = sys.argv[1:]
    gib, trace = 0.0, "--trace" in argv
    argv = [a for a in argv if a != "--trace"]
    if argv[:1] == ["--touch"]:
        gib, argv = float(argv[1]), argv[2:]
    main(argv or ["A", "B", "C"], gib, trace)
