"""Where the time of each canonical pipeline goes (run on the device machine).

For each case and precision: the pipeline timed as in the benchmark (L2 flushed), the same
call replayed from a CUDA graph (no host overhead), the host time of one call, and the
per-kernel device times of one call from CuPy's profiler-free event timing of each stage.
"""

import time

import cupy
import numpy

from cufused.benchmark import Timer, conv_plan_for, make_cases


def main():
    timer = Timer(repeat=15)
    for case in make_cases():
        inputs = case.make_inputs(numpy.random.default_rng(0))
        out = cupy.empty(case.output_shape, dtype=cupy.float32)
        for precision in ("ieee", "tf32"):
            call = lambda: case.run_cufused(inputs, precision=precision, out=out)  # noqa: E731
            direct = timer(call)
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                call()
            host_us = (time.perf_counter() - t0) / 20 * 1e6
            cupy.cuda.Device().synchronize()
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                call()
                stream.begin_capture()
                call()
                graph = stream.end_capture()
            graphed = timer(lambda: graph.launch(stream=cupy.cuda.get_current_stream()))
            plan = conv_plan_for(case, precision)
            costs = ", ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in plan.candidates.items())
            print(f"{case.name} {precision}: direct {direct:.3f} ms, graph replay {graphed:.3f} ms,"
                  f" host {host_us:.0f} us/call; conv strategies (ms alone/with conversions): "
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


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3:
        one_call(sys.argv[1], sys.argv[2])
    else:
        main()
