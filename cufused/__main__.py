"""Command line: ``python -m cufused check`` and ``python -m cufused bench``."""

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


def cmd_check(args) -> int:
    gpu = gpu_available()
    small = args.small or not gpu
    if not gpu:
        print("no CUDA GPU available: checking the NumPy reference path at a small size")
    cases = make_cases(small=small)
    tol = {"ieee": 1e-4, "tf32": 1e-2}
    failed = 0
    print(f"{'case':<5} {'path':<12} {'precision':<9} {'rel. error':>11}  result")
    rng = numpy.random.default_rng()
    for case in cases:
        inputs = case.make_inputs(rng)
        arrays = {k: v for k, v in inputs.items() if not k.startswith("_")}
        fn = getattr(__import__("cufused"), case.pipeline)
        if gpu and not small:
            from .benchmark import torch_reference

            try:
                ref = torch_reference(case, inputs)
            except (ImportError, RuntimeError, AssertionError):
                ref = fn(*(a.astype(numpy.float64) for a in arrays.values()), **case.options)
        else:
            ref = fn(*(a.astype(numpy.float64) for a in arrays.values()), **case.options)
        runs = []
        if gpu:
            for precision in ("ieee", "tf32"):
                for method in ("fused", "unfused"):
                    out = case.run_cufused(inputs, precision=precision, method=method).get()
                    runs.append((f"gpu {method}", precision, out))
        else:
            runs.append(("numpy f32", "-", fn(*arrays.values(), **case.options)))
        for path, precision, out in runs:
            err = rel_err(out, ref)
            ok = err < tol.get(precision, 1e-5)
            failed += not ok
            verdict = "ok" if ok else "FAIL"
            print(f"{case.name:<5} {path:<12} {precision:<9} {err:>11.3e}  {verdict}")
    print("all checks passed" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cufused", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check",
                       help="run the three pipelines and compare with the float64 reference")
    p.add_argument("--small", action="store_true",
                   help="small shapes instead of the canonical ones")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("bench", help="time the pipelines against PyTorch eager and torch.compile")
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
