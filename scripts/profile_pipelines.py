"""Where the time of each canonical pipeline goes (run on the device machine).

For each case and precision: the pipeline timed as in the benchmark (L2 flushed), the same
call replayed from a CUDA graph (no host overhead), the host time of one call, and the
per-kernel device times of one call from CuPy's profiler-free event timing of each stage.
Usage: python scripts/profile_pipelines.py [CASE PRECISION | trace CASE PRECISION [TOUCH_GIB]
| host CASE PRECISION].
"""

import cupy
import numpy

from cufused.bench.cases import make_cases
from cufused.bench.timing import Timer, conv_plan_for, host_us_per_call
from host_time import print_timeline  # scripts/, the script's own folder
from pipeline_calls import graph_replay_ms, pipeline_calls


def main():
    timer = Timer(repeat=15)
    for case, precision, call in pipeline_calls("ABC"):
        direct = timer(call)
        host = host_us_per_call(call, calls=20, repeat=1)
        graphed = graph_replay_ms(timer, call)
        plan = conv_plan_for(case, precision)
        costs = ", ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in plan.candidates.items())
        print(f"{case.name} {precision}: direct {direct:.3f} ms, graph replay {graphed:.3f} ms,"
              f" host {host:.0f} us/call; conv strategies (ms alone/with conversions): "
              f"{costs}; chosen {plan.strategy.label}")


def one_call(name: str, precision: str) -> None:
    """Warm one case, then run it once inside an NVTX range "measure" (for ncu --nvtx)."""
    case = next(c for c in make_cases() if c.name == name)
    inputs = case.make_inputs(numpy.random.default_rng(0))
    out = cupy.empty(case.output_shape, dtype=cupy.float32)
    case.run_cufused(inputs, precision=precision, out=out)
    cupy.cuda.Device().synchronize()
    cupy.cuda.nvtx.RangePush("measure")
    case.run_cufused(inputs, precision=precision, out=out)
    cupy.cuda.nvtx.RangePop()
    cupy.cuda.Device().synchronize()


def trace(name: str, precision: str, touch_gib: float = 0.0, calls: int = 3) -> None:
    """The device timeline (PyTorch's CUPTI profiler) of ``calls`` warm calls, each after an
    L2 flush as in the benchmark (and after ``touch_gib`` GiB of other memory written): every
    kernel with the idle gap before it."""
    import torch

    case = next(c for c in make_cases() if c.name == name)
    inputs = case.make_inputs(numpy.random.default_rng(0))
    out = cupy.empty(case.output_shape, dtype=cupy.float32)
    flush = Timer(repeat=1)._flush
    other = cupy.empty(int(touch_gib * 2**30) // 4, dtype=cupy.float32)
    for _ in range(3):
        case.run_cufused(inputs, precision=precision, out=out)
    cupy.cuda.Device().synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            other.fill(1.0)
            flush.fill(1.0)
            case.run_cufused(inputs, precision=precision, out=out)
        cupy.cuda.Device().synchronize()
    print_timeline(prof, f"{name} {precision}")


def host(name: str, precision: str, calls: int = 200) -> None:
    """Is the flushed timing host-bound? The benchmark's timing (one 256 MB flush, ~0.3 ms of
    device time for the host to run ahead) against a four-times longer head start, the host
    time of back-to-back calls, and where that host time goes (cProfile)."""
    import cProfile
    import pstats
    import sys

    case = next(c for c in make_cases() if c.name == name)
    inputs = case.make_inputs(numpy.random.default_rng(0))
    out = cupy.empty(case.output_shape, dtype=cupy.float32)
    call = lambda: case.run_cufused(inputs, precision=precision, out=out)  # noqa: E731
    timer = Timer(repeat=30)
    flushed = timer(call)
    flush = timer._flush

    def head_start():
        for _ in range(3):
            flush.fill(2.0)
        call()
    longer = timer(head_start) - 3 * timer(lambda: flush.fill(2.0))  # approximate
    print(f"{name} {precision}: flushed {flushed:.3f} ms, with a longer head start "
          f"~{longer:.3f} ms, host {host_us_per_call(call, calls=calls, repeat=1):.0f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
        cupy.cuda.Device().synchronize()
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    import sys

    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit()
    if sys.argv[1:2] == ["trace"]:
        trace(sys.argv[2], sys.argv[3], *map(float, sys.argv[4:5]))
    elif sys.argv[1:2] == ["host"]:
        host(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3:
        one_call(sys.argv[1], sys.argv[2])
    else:
        main()
