"""The command line: ``python -m cufused check`` and ``python -m cufused bench``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy

from .. import __version__
from .._arrays import gpu_unavailable_reason, no_gpu_installation
from .cases import TOLERANCE, make_cases, rel_err, torch_pipeline
from .report import format_table, plot, plot_format
from .timing import (RESULT_CALLS, Timer, add_floors, bench_case, measure_ceilings,
                     torch_on_cuda)


def _progress(i: int, n: int, label: str) -> None:
    width = 30
    done = int(width * i / n)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label:<30}")
    sys.stderr.flush()
    if i == n:
        sys.stderr.write("\n")


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


def _case_rng(seed: int, case) -> numpy.random.Generator:
    """The generator of a case's inputs: the seed and the case's own letter, so that
    ``--cases`` draws the same inputs for a case as a run over all of them."""
    return numpy.random.default_rng([seed, ord(case.name)])


def _row(path: str, precision: str, err: float, tol: float, seconds: float) -> bool:
    ok = err < tol
    print(f"   {path:<14} {precision:<6} {err:>10.3e}  < {tol:<8.0e} {'ok' if ok else 'FAIL':<5}"
          f"({seconds:.1f} s)", flush=True)
    return ok


def _check_gpu(cases, seed: int) -> int:
    import cupy

    from .._settings import plan_options

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
    print(f"metric: {METRIC}; tolerance: "
          + ", ".join(f"{t:.0e} ({p})" for p, t in TOLERANCE.items())
          + f"; inputs: seed {seed}; cuDNN's heuristic "
          "convolution plans (no autotuning: bench checks the routes that autotuning picks, "
          "cufused's own convolution engines among them)", flush=True)
    failed = 0
    for case in cases:
        print(describe(case), flush=True)
        start = time.perf_counter()
        inputs = case.make_inputs(_case_rng(seed, case))
        gpu = {k: cupy.asarray(v) for k, v in inputs.items()}
        inputs["_gpu"] = gpu
        ref = case.reference(gpu)
        cupy.cuda.get_current_stream().synchronize()
        print(f"   float64 reference on the GPU ({time.perf_counter() - start:.1f} s)", flush=True)
        for precision in TOLERANCE:
            for method in ("fused", "unfused"):
                start = time.perf_counter()
                # NaN-poisoned: an element the call leaves unwritten fails the check.
                out = cupy.full(case.output_shape, cupy.nan, dtype=cupy.float32)
                case.run_cufused(inputs, precision=precision, method=method, out=out)
                err = rel_err(out, ref)
                failed += not _row(f"gpu {method}", precision, err, TOLERANCE[precision],
                                   time.perf_counter() - start)
                del out
        del ref, gpu, inputs
        cupy.get_default_memory_pool().free_all_blocks()
    print("all checks passed" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


def _check_cpu(cases, seed: int, no_gpu: str) -> int:
    try:
        import torch
    except ImportError:
        torch = None
    import cufused

    if torch is None:
        print(f"{no_gpu}, and PyTorch is not installed: there is no independent oracle to "
              "compare cufused's CPU path (the float64 NumPy reference) with. It runs below at "
              f"small sizes, unchecked. To compare it with PyTorch CPU: {INSTALL_TORCH_CPU}")
    else:
        print(f"{no_gpu}: checking cufused's CPU path (the float64 NumPy reference) against "
              f"PyTorch {torch.__version__} on the CPU, both in float64, at small sizes")
        print(f"metric: {METRIC}; tolerance: {CPU_TOLERANCE:.0e}; inputs: seed {seed}")
    failed = 0
    for case in cases:
        print(describe(case), flush=True)
        start = time.perf_counter()
        inputs = case.make_inputs(_case_rng(seed, case))
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
    no_gpu = gpu_unavailable_reason()
    cases = make_cases(small=args.small or no_gpu is not None)
    if args.cases:
        cases = [c for c in cases if c.name in args.cases]
    if no_gpu is None:
        return _check_gpu(cases, args.seed)
    code = _check_cpu(cases, args.seed, no_gpu)
    if no_gpu_installation(no_gpu):
        return code
    # A GPU installation that does not work: the check of it has not passed.
    print(f"GPU path NOT checked: {no_gpu}")
    return 1


def _header() -> dict:
    import cupy

    from .._cudnn import import_cudnn

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


def _unwritable(path: str) -> str | None:
    """Why a file cannot be written at ``path``, or None: checked before the benchmark runs,
    so that its figures are not lost at the end."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a directory"
    if not os.path.isdir(folder):
        return f"no directory {folder}"
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        return f"{path} is not writable"
    return None


def cmd_bench(args) -> int:
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        reason = path and _unwritable(path)
        if reason:
            print(f"{_prog()} bench: error: {option}: {reason}", file=sys.stderr)
            return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - plot's dependency, checked before the run
        except ImportError:
            print(f"{_prog()} bench: error: --plot needs matplotlib "
                  "(the bench extra)", file=sys.stderr)
            return 2
        if plot_format(args.plot) is None:
            print(f"{_prog()} bench: error: --plot: {args.plot} does not end in an "
                  "image format that matplotlib writes (.png, .svg, .pdf, ...)",
                  file=sys.stderr)
            return 2
    no_gpu = gpu_unavailable_reason()
    if no_gpu is not None:
        print(f"{no_gpu}: bench needs a CUDA GPU", file=sys.stderr)
        return 1
    timer = Timer(repeat=args.repeat)
    cases = make_cases(small=args.quick, batch=args.batch)
    if args.cases:
        cases = [c for c in cases if c.name in args.cases]
    header = {**_header(), "options": {
        "precisions": list(args.precisions),
        "repeat": args.repeat, "quick": args.quick, "batch": args.batch,
        "torch_compile": not args.no_compile and torch_on_cuda() is not None}, "cases": {
            c.name: {"pipeline": c.pipeline, "shapes": c.shapes, "options": c.options}
            for c in cases}}
    result = {"header": header, "ceilings": measure_ceilings(timer), "rows": []}
    for i, case in enumerate(cases):
        _progress(i, len(cases), f"case {case.name}")
        rows = bench_case(case, timer, precisions=tuple(args.precisions),
                          torch_compile=not args.no_compile)
        add_floors(case, rows, result["ceilings"])
        result["rows"].extend(rows)
    _progress(len(cases), len(cases), "done")
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.plot:
        plot(result, args.plot)
    return _report_errors(result["rows"])


def _report_errors(rows: list[dict]) -> int:
    """Print the largest error of the timed cufused results against the float64 reference
    per precision, and each result past its tolerance; 1 where there is one, else 0."""
    worst: dict[str, float] = {}
    failed = []
    for row in rows:
        precision = row["precision"]
        for name in RESULT_CALLS:
            err = row[f"err_{name}"]
            worst[precision] = max(worst.get(precision, 0.0), err)
            if not err < TOLERANCE[precision]:
                failed.append(f"{row['case']} {precision} {name}: {err:.3e} >= "
                              f"{TOLERANCE[precision]:.0e}")
    print(f"results checked ({METRIC}), the largest per precision: "
          + ", ".join(f"{p} {e:.1e} (< {TOLERANCE[p]:.0e})" for p, e in worst.items()))
    for line in failed:
        print(f"FAIL {line}")
    return 1 if failed else 0


DESCRIPTION = """\
cufused: fused GPU operator pipelines for convolutional networks.

  check   run the three pipelines (KernelBench level 2 cases A, B, C) and compare them with
          the float64 reference: on a GPU at the canonical sizes, the reference computed on
          the GPU; without one, cufused's CPU path against PyTorch CPU at small sizes
  bench   time the pipelines against PyTorch eager and torch.compile (needs a GPU)

Run "%(prog)s COMMAND --help" for a command's options."""


def _prog() -> str:
    """How the command line was started: the ``cufused`` console script, or ``python -m
    cufused``."""
    script = os.path.splitext(os.path.basename(sys.argv[0]))[0]  # cufused.exe on Windows
    return "cufused" if script == "cufused" else "python -m cufused"


def _int_at_least(minimum: int):
    """An argparse type: an integer of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    """The parser of ``python -m cufused``: ``--version`` and the commands with their options."""
    parser = argparse.ArgumentParser(prog=_prog(), description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"cufused {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("check", help="compare the three pipelines with the float64 reference",
                       description="Compare the three pipelines with the float64 reference "
                                   "(GPU: canonical sizes, reference on the GPU; CPU: small "
                                   "sizes, against PyTorch CPU when installed).")
    p.add_argument("--small", action="store_true",
                   help="small shapes instead of the canonical ones (always without a GPU)")
    p.add_argument("--cases", nargs="+", choices=["A", "B", "C"], help="only these cases")
    p.add_argument("--seed", type=_int_at_least(0), default=0,
                   help="seed of the random inputs (default 0)")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("bench", help="time the pipelines against PyTorch eager and torch.compile",
                       description="Time the pipelines (fused and unfused) against PyTorch eager "
                                   "and torch.compile, in both precisions (needs a GPU).")
    p.add_argument("--quick", action="store_true", help="small shapes")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="draw a bar chart (needs matplotlib)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--precisions", nargs="+", choices=["ieee", "tf32", "3xtf32"],
                   default=["ieee", "tf32"],
                   help="precisions to time (default ieee tf32); PyTorch runs 3xtf32's rows "
                        "in float32 (TF32 off)")
    p.add_argument("--repeat", type=_int_at_least(1), default=20,
                   help="timed runs per figure (median)")
    p.add_argument("--cases", nargs="+", choices=["A", "B", "C"], help="only these cases")
    p.add_argument("--batch", type=_int_at_least(1), metavar="N",
                   help="batch size N instead of each case's (small batches: host-bound)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    """Run ``python -m cufused`` with ``argv`` (default: the process's); the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        code = args.func(args)
    except BrokenPipeError:  # the reader of stdout left (``| head``): no traceback
        # Python flushes stdout at exit; pointing it at devnull keeps that flush quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ImportError as exc:  # a missing dependency (its message says what to install)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    print(f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return code
