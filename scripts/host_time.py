"""Host and device time of warm public convolution calls (device): the canonical convolutions
of cases A, B and C in both precisions, with CUDA-graph replay of the plan on and off.

Host time = wall time of issuing 20 back-to-back calls / 20, without synchronizing in between
(the device work queues up behind them), median of 5 repeats, microseconds. Device time =
CUDA events around one call after an L2 flush, replayed and direct calls alternating,
median of 30 each, milliseconds.
``host_time.py once CASE PRECISION replay|direct`` runs one warm call between
``cudaProfilerStart`` and ``Stop`` (for ``ncu --profile-from-start off``: per-kernel times
of the replayed graph's nodes against the direct launches).
``host_time.py trace CASE PRECISION`` prints the device timeline (kernel starts, durations
and the gaps between them, from PyTorch's CUPTI-based profiler) of warm replayed and direct
calls.
``host_time.py profile CASE PRECISION [STRATEGY]`` prints where a warm call's host time goes
(cProfile, the heuristic plan of STRATEGY, by default the autotuner's usual one for the case,
so that no tuning runs first).
Usage: python scripts/host_time.py [once CASE PRECISION replay|direct | trace CASE PRECISION
| profile CASE PRECISION [STRATEGY]].
"""

import cProfile
import pstats
import sys

import cupy

from cufused import _cudnn, _settings
from cufused.bench.cases import make_cases
from cufused.bench.timing import Timer, host_us_per_call, public_conv


def canonical_convs():
    """name -> (public function, x, w, options) of each case's convolution, random inputs."""
    rng = cupy.random.default_rng(0)
    convs = {}
    for case in make_cases():
        fn, opts = public_conv(case)
        convs[case.name] = (fn, rng.random(case.conv["x_shape"], dtype=cupy.float32),
                            rng.random(case.conv["w_shape"], dtype=cupy.float32), opts)
    return convs


def device_ms(calls, rounds=30):
    """Median device time of each call in ``calls``, the calls alternating round by round."""
    times = Timer(repeat=rounds, warmup=0).compare(dict(enumerate(calls)))
    return [times[i] for i in range(len(calls))]


def main():
    for name, (fn, x, w, kw) in canonical_convs().items():
        for precision in ("ieee", "tf32"):
            out = fn(x, w, precision=precision, **kw)
            times, calls = {}, {}
            for replay in (True, False):
                with _settings.plan_options(replay=replay):
                    call = lambda: fn(x, w, precision=precision, out=out, **kw)  # noqa: E731
                    call()
                    call()
                    times[replay] = host_us_per_call(call)

                def timed(replay=replay):
                    with _settings.plan_options(replay=replay):
                        fn(x, w, precision=precision, out=out, **kw)
                calls[replay] = timed
            replayed, direct = device_ms([calls[True], calls[False]])
            plans = [p for k, p in _cudnn._plans.items()
                     if k[1].x_shape == x.shape and k[1].precision == precision]
            graphs = ", ".join(f"{p.strategy.label}: "
                               f"{'direct calls' if p._replays is None else len(p._replays)}"
                               for p in plans)
            print(f"{name} {precision}: host us replay {times[True]:.0f}, direct "
                  f"{times[False]:.0f}; device ms replay {replayed:.3f}, direct {direct:.3f} "
                  f"(graphs per plan: {graphs})", flush=True)


def profile(name, precision, label=None, calls=300):
    fn, x, w, kw = canonical_convs()[name]
    label = label or {"A": "nchw", "B": "subpixel nchw", "C": "subpixel nchw"}[name]
    with _settings.plan_options(autotune=False, pins=(label,)):
        out = fn(x, w, precision=precision, **kw)
        for _ in range(3):
            fn(x, w, precision=precision, out=out, **kw)
        cupy.cuda.Device().synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn(x, w, precision=precision, out=out, **kw)
        prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(16)


def once(name, precision, mode):
    fn, x, w, kw = canonical_convs()[name]
    with _settings.plan_options(replay=mode == "replay"):
        out = fn(x, w, precision=precision, **kw)
        for _ in range(3):
            fn(x, w, precision=precision, out=out, **kw)
        cupy.cuda.Device().synchronize()
        cupy.cuda.profiler.start()
        fn(x, w, precision=precision, out=out, **kw)
        cupy.cuda.profiler.stop()
    cupy.cuda.Device().synchronize()


def trace(name, precision, calls=3):
    import torch

    fn, x, w, kw = canonical_convs()[name]
    out = fn(x, w, precision=precision, **kw)
    for plan in _cudnn._plans.values():
        if plan._replays is None:  # replay on even where the autotuner chose direct calls
            plan._replays = {}
    for mode in ("replay", "direct"):
        with _settings.plan_options(replay=mode == "replay"):
            for _ in range(3):
                fn(x, w, precision=precision, out=out, **kw)
            cupy.cuda.Device().synchronize()
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn(x, w, precision=precision, out=out, **kw)
                cupy.cuda.Device().synchronize()
        kernels = print_timeline(prof, f"{name} {precision} {mode}")
        print(f"   span {kernels[-1][1] - kernels[0][0]:.1f} us for {calls} calls")


def device_activities(prof):
    """A PyTorch profile's device activities as (start, end, name), us, in start order."""
    return sorted((e.time_range.start, e.time_range.end, e.name)
                  for e in prof.events() if e.device_type.name == "CUDA")


def print_timeline(prof, title):
    """Print a PyTorch profile's device activities in order, each with the idle gap before
    it (negative: overlapping); return them as (start, end, name) in microseconds."""
    kernels = device_activities(prof)
    print(f"== {title}: {len(kernels)} device activities")
    previous = None
    for start, end, label in kernels:
        gap = "" if previous is None else f"{start - previous:8.1f}"
        print(f"{gap:>8} us gap {end - start:9.1f} us  {label[:70]}")
        previous = end
    return kernels


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        sys.exit()
    if sys.argv[1:2] == ["profile"]:
        profile(*sys.argv[2:5])
    elif sys.argv[1:2] == ["trace"]:
        trace(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["once"]:
        once(*sys.argv[2:5])
    else:
        main()
