"""The command line: ``python -m cufused check`` and ``python -m cufused bench``."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import numpy

from . import __version__
from ._arrays import gpu_available
from .benchmark import make_cases, rel_err


def _progress(i: int, n: int, label: str) -> None:
    width = 30
    done = int(width * i / n)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label:<30}")
    sys.stderr.flush()
    if i == n:
        sys.stderr.write("\n")


TOLERANCE = {"ieee": 1e-4, "tf32": 1e-2}
# Float64 against float64 (cufused's CPU path against PyTorch CPU): rounding only.
CPU_TOLERANCE = 1e-10
METRIC = "relative error ||out - ref|| / ||ref|| over the whole output, in float64"
INSTALL_TORCH_CPU = ("python -m pip install torch --index-url "
                     "https://download.pytorch.org/whl/cpu")


def describe(case) -> str:
    """One line: the pipeline, its array shapes, its options and the output shape."""
    shapes = ", ".join(f"{k} {tuple(v)}" for k, v in case.shapes.items())
    options = ", ".join(f"{k}={v}" for k, v in case.options.items())
    return f"{case.name}: {case.pipeline}({shapes}; {options}) -> {case.output_shape}"


def _row(path: str, precision: str, err: float, tol: float, seconds: float) -> bool:
    ok = err < tol
    print(f"   {path:<14} {precision:<6} {err:>10.3e}  < {tol:<8.0e} {'ok' if ok else 'FAIL':<5}"
          f"({seconds:.1f} s)", flush=True)
    return ok


def _check_gpu(cases, seed: int) -> int:
    import cupy

    from ._cudnn import plan_options

    # cuDNN's heuristic plans: the check is about results, and autotuning each new
    # convolution (every plan timed, tens of seconds for B) would dominate its run time.
    with plan_options(autotune=False):
        return _check_gpu_cases(cupy, cases, seed)


def _check_gpu_cases(cupy, cases, seed: int) -> int:
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
    device = device.decode() if isinstance(device, bytes) else device
    print(f"cufused {__version__} check on {device}: each pipeline against the float64 "
          "reference computed on the GPU (cufused.reference on CuPy arrays: the same code as "
          "the NumPy reference)")
    print(f"metric: {METRIC}; tolerance: {TOLERANCE['ieee']:.0e} (ieee), "
          f"{TOLERANCE['tf32']:.0e} (tf32); inputs: seed {seed}; cuDNN's heuristic "
          "convolution plans (no autotuning)", flush=True)
    failed = 0
    for i, case in enumerate(cases):
        print(describe(case), flush=True)
        start = time.perf_counter()
        inputs = case.make_inputs(numpy.random.default_rng([seed, i]))
        gpu = {k: cupy.asarray(v) for k, v in inputs.items()}
        inputs["_gpu"] = gpu
        ref = case.reference(gpu)
        cupy.cuda.get_current_stream().synchronize()
        print(f"   float64 reference on the GPU ({time.perf_counter() - start:.1f} s)", flush=True)
        for precision in ("ieee", "tf32"):
            for method in ("fused", "unfused"):
                start = time.perf_counter()
                out = case.run_cufused(inputs, precision=precision, method=method)
                err = rel_err(out, ref)
                failed += not _row(f"gpu {method}", precision, err, TOLERANCE[precision],
                                   time.perf_counter() - start)
                del out
        del ref, gpu, inputs
        cupy.get_default_memory_pool().free_all_blocks()
    print("all checks passed" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


def _check_cpu(cases, seed: int) -> int:
    try:
        import torch
    except ImportError:
        torch = None
    import cufused

    from .benchmark import torch_pipeline

    if torch is None:
        print("no CUDA GPU, and PyTorch is not installed: there is no independent oracle to "
              "compare cufused's CPU path (the float64 NumPy reference) with. It runs below at "
              f"small sizes, unchecked. To compare it with PyTorch CPU: {INSTALL_TORCH_CPU}")
    else:
        print(f"no CUDA GPU: checking cufused's CPU path (the float64 NumPy reference) against "
              f"PyTorch {torch.__version__} on the CPU, both in float64, at small sizes")
        print(f"metric: {METRIC}; tolerance: {CPU_TOLERANCE:.0e}; inputs: seed {seed}")
    failed = 0
    for i, case in enumerate(cases):
        print(describe(case), flush=True)
        start = time.perf_counter()
        inputs = case.make_inputs(numpy.random.default_rng([seed, i]))
        arrays = [a.astype(numpy.float64) for a in inputs.values()]
        out = getattr(cufused, case.pipeline)(*arrays, **case.options)
        if torch is None:
            finite = bool(numpy.isfinite(out).all())
            print(f"   numpy float64  -> shape {out.shape}, finite: {finite} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
            continue
        with torch.no_grad():
            ref = torch_pipeline(case)(*(torch.from_numpy(a) for a in arrays)).numpy()
        failed += not _row("numpy float64", "-", rel_err(out, ref), CPU_TOLERANCE,
                           time.perf_counter() - start)
    if torch is None:
        print("the reference ran; nothing was compared (PyTorch is not installed)")
        return 0
    print("all checks passed" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


def cmd_check(args) -> int:
    gpu = gpu_available()
    cases = make_cases(small=args.small or not gpu)
    if args.cases:
        cases = [c for c in cases if c.name in args.cases]
    return _check_gpu(cases, args.seed) if gpu else _check_cpu(cases, args.seed)


def _header() -> dict:
    import cupy

    from ._cudnn import import_cudnn

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    info = {
        "device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cufused": __version__, "cupy": cupy.__version__, "python": platform.python_version(),
    }
    cudnn = import_cudnn()
    info["cudnn"] = str(cudnn.backend_version())
    info["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def format_table(result: dict) -> str:
    """The side-by-side table of a ``bench`` result."""
    ceil = result["ceilings"]
    lines = [" ".join(f"{k}={v}" for k, v in result["header"].items()),
             f"ceilings: copy {ceil['copy_TBps']:.2f} TB/s, fp32 {ceil['fp32_TFLOPs']:.1f} "
             f"TFLOP/s" + (f", tf32 {ceil['tf32_TFLOPs']:.0f} TFLOP/s" if 'tf32_TFLOPs' in ceil
                           else ""),
             "median ms, L2 flushed; speedup = PyTorch time / cufused fused time",
             f"{'case':<4} {'prec':<5} {'fused':>7} {'unfused':>8} {'eager':>7} {'compile':>8} "
             f"{'xeager':>7} {'xcompile':>8} {'conv':>6} {'post':>6} "
             f"{'postfloor':>9} {'post/pf':>7} {'floor':>6} {'/floor':>6}  conv strategy"]
    for r in result["rows"]:
        def f(key, fmt="7.3f"):
            return format(r[key], fmt) if key in r else "-".rjust(int(fmt.split(".")[0]))
        xe = r["torch_eager"] / r["fused"] if "torch_eager" in r else float("nan")
        xc = r["torch_compile"] / r["fused"] if "torch_compile" in r else float("nan")
        post = r["fused"] - r["conv"]
        # How the plan's warm calls ran (older results do not say).
        calls = f" ({r['conv_calls']})" if "conv_calls" in r else ""
        lines.append(
            f"{r['case']:<4} {r['precision']:<5} {f('fused')} {f('unfused', '8.3f')} "
            f"{f('torch_eager')} {f('torch_compile', '8.3f')} {xe:7.2f} {xc:8.2f} "
            f"{r['conv']:6.3f} {post:6.3f} {r['post_floor']:9.3f} "
            f"{post / r['post_floor']:7.2f} {r['floor']:6.3f} {r['fused'] / r['floor']:6.2f}  "
            f"{r['conv_layout']}{calls}")
    lines += ["", "convolutions alone (ms): cufused plan as the pipeline runs it (NCHW input "
              "where the pipeline gets one) and for an input in any layout (free), cufused public "
              "call (NCHW in/out) and PyTorch's, without / with a bias",
              f"{'case':<4} {'prec':<5} {'plan':>7} {'free':>7} {'public':>7} {'torch':>7} "
              f"{'torch/public':>12} {'+bias':>7} {'torch':>7} {'torch/public':>12}  "
              "plan / free strategy"]
    for r in result["rows"]:
        tc, tb, pb, fr = (r.get(k, float("nan")) for k in (
            "torch_conv", "torch_conv_bias", "conv_public_bias", "conv_free"))
        lines.append(f"{r['case']:<4} {r['precision']:<5} {r['conv']:7.3f} {fr:7.3f} "
                     f"{r['conv_public']:7.3f} {tc:7.3f} {tc / r['conv_public']:12.2f} "
                     f"{pb:7.3f} {tb:7.3f} {tb / pb:12.2f}  {r['conv_layout']} / "
                     f"{r.get('conv_free_layout', '-')}")
    return "\n".join(lines)


def cmd_bench(args) -> int:
    if not gpu_available():
        print("no CUDA GPU available: bench needs one")
        return 1
    from .benchmark import Timer, bench_case, measure_ceilings

    timer = Timer(repeat=args.repeat)
    cases = make_cases(small=args.quick)
    if args.cases:
        cases = [c for c in cases if c.name in args.cases]
    result = {"header": _header(), "ceilings": measure_ceilings(timer), "rows": []}
    ceil = result["ceilings"]
    for i, case in enumerate(cases):
        _progress(i, len(cases), f"case {case.name}")
        rows = bench_case(case, timer, torch_compile=not args.no_compile)
        for r in rows:
            rate = ceil.get("tf32_TFLOPs" if r["precision"] == "tf32" else "fp32_TFLOPs")
            byte_ms = case.io_bytes() / (ceil["copy_TBps"] * 1e12) * 1e3
            r["floor"] = max(case.conv_flops() / (rate * 1e12) * 1e3, byte_ms)
            r["post_floor"] = case.post_conv_bytes() / (ceil["copy_TBps"] * 1e12) * 1e3
        result["rows"].extend(rows)
    _progress(len(cases), len(cases), "done")
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0


def plot(result: dict, path: str) -> None:
    """Bar chart of the bench result (needs matplotlib: the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("fused", "unfused", "torch_eager", "torch_compile")
            if any(k in r for r in result["rows"])]
    labels = [f"{r['case']} {r['precision']}" for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(keys)
    for j, key in enumerate(keys):
        ax.bar([i + j * width for i in range(len(labels))],
               [r.get(key, 0.0) for r in result["rows"]], width, label=key)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels)
    ax.set_ylabel("ms (median, L2 flushed)")
    ax.set_title(result["header"]["device"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


DESCRIPTION = """\
cufused: fused GPU operator pipelines for convolutional networks.

  check   run the three pipelines (KernelBench level 2 cases A, B, C) and compare them with
          the float64 reference: on a GPU at the canonical sizes, the reference computed on
          the GPU; without one, cufused's CPU path against PyTorch CPU at small sizes
  bench   time the pipelines against PyTorch eager and torch.compile (needs a GPU)

Run "python -m cufused COMMAND --help" for a command's options."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cufused", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"cufused {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("check", help="compare the three pipelines with the float64 reference",
                       description="Compare the three pipelines with the float64 reference "
                                   "(GPU: canonical sizes, reference on the GPU; CPU: small "
                                   "sizes, against PyTorch CPU when installed).")
    p.add_argument("--small", action="store_true",
                   help="small shapes instead of the canonical ones (always without a GPU)")
    p.add_argument("--cases", nargs="*", choices=["A", "B", "C"], help="only these cases")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("bench", help="time the pipelines against PyTorch eager and torch.compile",
                       description="Time the pipelines (fused and unfused) against PyTorch eager "
                                   "and torch.compile, in both precisions (needs a GPU).")
    p.add_argument("--quick", action="store_true", help="small shapes")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="draw a bar chart (needs matplotlib)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--repeat", type=int, default=20, help="timed runs per figure (median)")
    p.add_argument("--cases", nargs="*", choices=["A", "B", "C"], help="only these cases")
    p.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    code = args.func(args)
    print(f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
