"""Time the implicit-GEMM tensor-core convolution (conv_gemm.cu, TF32 and 3xTF32) against
cuDNN (cufused.conv2d, autotuned plans, "tf32" and "ieee") on pipeline A's convolution and
a few other shapes, then pipeline A with its convolution on each engine (device). Median
of CUDA events, a 256 MiB L2 flush before each call; the accuracy of each against the
float64 reference (relative norm error) on the same input.

Usage: python scripts/conv_gemm_bench.py [--repeat 30]
"""

from __future__ import annotations

import argparse

import cupy
import numpy

import cufused
from cufused import reference
from cufused._settings import plan_options
from cufused._kernels.conv_gemm import conv2d_implicit_gemm
from cufused.bench.cases import make_cases, rel_err
from cufused.bench.timing import Timer

SHAPES = [
    # name, x shape, w shape (stride 1, no padding)
    ("A conv", (128, 8, 128, 128), (64, 8, 3, 3)),
    ("C_in 64", (32, 64, 64, 64), (64, 64, 3, 3)),
    ("C_in 32 5x5", (64, 32, 34, 34), (128, 32, 5, 5)),
    ("B-like 64->128 5x5", (512, 64, 32, 32), (128, 64, 5, 5)),
]


def time_ms(fn, repeat: int) -> float:
    """Median ms of one call after an L2 flush (:class:`cufused.bench.timing.Timer`)."""
    return Timer(repeat=repeat)(fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    rng = numpy.random.default_rng(0)
    print(f"{'shape':<12} {'engine':<14} {'ms':>8} {'rel err':>10}")
    for name, xs, ws in SHAPES:
        x = cupy.asarray(rng.random(xs), dtype=cupy.float32)
        w = cupy.asarray(rng.uniform(-0.3, 0.3, ws), dtype=cupy.float32)
        b = cupy.asarray(rng.uniform(-0.3, 0.3, ws[0]), dtype=cupy.float32)
        sample = slice(0, 2)  # the float64 reference on two samples
        ref = reference.conv(x[sample].get(), w.get(), b.get(), (1, 1), (0, 0), (1, 1), 1)
        y = cupy.empty((xs[0], ws[0], xs[2] - ws[2] + 1, xs[3] - ws[3] + 1), cupy.float32)
        runs = {
            "cudnn tf32": lambda: cudnn(cufused.conv2d, x, w, b, precision="tf32", out=y),
            "cudnn ieee": lambda: cudnn(cufused.conv2d, x, w, b, precision="ieee", out=y),
            "igemm tf32": lambda: conv2d_implicit_gemm(x, w, b, y, stride=(1, 1),
                                                       padding=(0, 0), dilation=(1, 1),
                                                       passes=1),
            "igemm 3xtf32": lambda: conv2d_implicit_gemm(x, w, b, y, stride=(1, 1),
                                                         padding=(0, 0), dilation=(1, 1),
                                                         passes=3),
        }
        for engine, run in runs.items():
            ms = time_ms(run, args.repeat)
            run()
            got = y[sample].get().astype(numpy.float64)
            err = numpy.linalg.norm(got - ref) / numpy.linalg.norm(ref)
            print(f"{name:<12} {engine:<14} {ms:8.3f} {err:10.2e}", flush=True)
    pipeline_a(args.repeat)


def cudnn(fn, *args, **kwargs):
    """``fn`` with its convolution on cuDNN (the autotuner may pick the implicit GEMM)."""
    with plan_options(engine="cudnn"):
        return fn(*args, **kwargs)


def pipeline_a(repeat: int) -> None:
    """Pipeline A (canonical case) with its convolution on cuDNN and on the implicit GEMM
    (tf32 and 3xtf32: the pass in the convolution's epilogue), against the float64
    reference on its first two samples (GroupNorm is per sample)."""
    case = next(c for c in make_cases() if c.name == "A")
    inputs = case.make_inputs(numpy.random.default_rng(0))
    two = {k: (v[:2] if k == "x" else v).astype(numpy.float64) for k, v in inputs.items()}
    ref = case.reference(two)
    out = cupy.empty(case.output_shape, dtype=cupy.float32)
    print(f"{'pipeline A':<12} {'engine':<14} {'ms':>8} {'rel err':>10}")
    for engine in ("cudnn", "igemm"):
        for precision in ("ieee", "tf32", "3xtf32"):
            if engine == "igemm" and precision == "ieee":
                continue
            with plan_options(engine=engine):
                def run(precision=precision):
                    return case.run_cufused(inputs, precision=precision, out=out)

                ms = time_ms(run, repeat)
                run()
            err = rel_err(out[:2].get().astype(numpy.float64), ref)
            print(f"{'':<12} {engine + ' ' + precision:<14} {ms:8.3f} {err:10.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
