"""Side-by-side timing of the fused canonical pipelines from two (or more) source trees (device).

For "no regression" checks across a refactor: each tree runs in its own process
(``PYTHONPATH=<tree>``), the trees taking turns for ``--rounds`` rounds, and only the public
API is called, so that any two versions of cufused compare. Per tree, case and precision:
the median device time of one call (CUDA events, a 256 MiB L2 flush before each, after
warm-up) and the median host time of a warm call (20 back-to-back calls without
synchronizing, over 20). The table gives each tree's median over the rounds, the spread
(max - min over the rounds) and the ratio to the first tree.

With ``--without-out`` the calls allocate their results (each dropped before the next call)
instead of writing into one ``out``.

Usage: python scripts/compare_trees.py TREE [TREE ...] [--rounds 3] [--repeat 30]
       [--cases A B C] [--precisions ieee tf32 3xtf32] [--without-out] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# The canonical cases of the design (KernelBench level 2 shapes): the pipeline, the arrays
# (name -> shape; weights drawn as PyTorch initializes them, the rest uniform in [0, 1)) and
# the options.
CASES = {
    "A": ("conv2d_groupnorm_scale_maxpool_clamp",
          {"x": (128, 8, 128, 128), "weight": (64, 8, 3, 3), "conv_bias": (64,),
           "gn_weight": (64,), "gn_bias": (64,), "scale": (64, 1, 1)},
          {"num_groups": 16, "pool_kernel": 4, "clamp_min": 0.0, "clamp_max": 1.0}),
    "B": ("conv_transpose2d_batchnorm_tanh_maxpool_groupnorm",
          {"x": (512, 64, 32, 32), "weight": (64, 128, 5, 5), "bn_weight": (128,),
           "bn_bias": (128,), "gn_weight": (128,), "gn_bias": (128,)},
          {"num_groups": 8, "stride": 1, "padding": 1}),
    "C": ("conv_transpose3d_avgpool_clamp_softmax_multiply",
          {"x": (32, 32, 32, 64, 64), "weight": (32, 64, 3, 3, 3), "scale": (1, 64, 1, 1, 1)},
          {"stride": 2, "padding": 1, "output_padding": 1, "pool_kernel": 2,
           "clamp_min": 0.0, "clamp_max": 1.0}),
}


def _inputs(cupy, numpy, shapes: dict) -> list:
    rng = numpy.random.default_rng(0)
    bound = 1.0 / numpy.sqrt(numpy.prod(shapes["weight"][1:]))
    return [cupy.asarray(rng.uniform(-bound, bound, s) if k in ("weight", "conv_bias")
                         else rng.random(s), dtype=cupy.float32) for k, s in shapes.items()]


def _time(cupy, numpy, fn, repeat: int) -> tuple[float, float]:
    """(median device ms of one call after an L2 flush, median host us of a warm call)."""
    flush = cupy.empty(64 * 1024 * 1024, dtype=cupy.float32)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(3):
        fn()
    device = []
    for _ in range(repeat):
        flush.fill(1.0)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        device.append(cupy.cuda.get_elapsed_time(start, stop))
    host = []
    for _ in range(5):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        host.append((time.perf_counter() - t0) / 20 * 1e6)
    cupy.cuda.Device().synchronize()
    return float(numpy.median(device)), float(numpy.median(host))


def child(cases: list[str], precisions: list[str], repeat: int, without_out: bool) -> None:
    """Time this process's cufused (the tree on PYTHONPATH); one JSON line per row."""
    import cupy
    import numpy

    import cufused

    for name in cases:
        pipeline, shapes, options = CASES[name]
        arrays = _inputs(cupy, numpy, shapes)
        fn = getattr(cufused, pipeline)
        out = None if without_out else fn(*arrays, **options)
        for precision in precisions:
            ms, us = _time(cupy, numpy, lambda p=precision: fn(
                *arrays, **options, precision=p, out=out), repeat)
            print(json.dumps({"case": name, "precision": precision, "ms": ms, "host_us": us,
                              "file": cufused.__file__}), flush=True)
        arrays = out = None  # free the case before the next one
        cupy.get_default_memory_pool().free_all_blocks()


def _run_tree(tree: str, args) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.abspath(tree), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, __file__, "--child", "--repeat", str(args.repeat),
               "--cases", *args.cases, "--precisions", *args.precisions,
               *(["--without-out"] if args.without_out else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:  # the child's own error, not only its exit status
        sys.exit(f"{tree}: the timing process failed (exit {done.returncode}):\n{done.stderr}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    # The child imports the first cufused on its path: the tree's, unless the tree lacks one
    # and another (an installed copy, the tree on the caller's PYTHONPATH) answers instead.
    home = os.path.join(os.path.abspath(tree), "cufused", "")
    for row in rows:
        if not os.path.abspath(row["file"]).startswith(home):
            sys.exit(f"{tree}: the timing process imported {row['file']}, not the tree's")
    return rows


def _table(trees: list[str], runs: dict) -> list[str]:
    rows = [f"{'case':<5}{'prec':<6}" + "".join(
        f"{os.path.basename(os.path.normpath(t))[:18]:>34}" for t in trees),
        f"{'':<11}" + "   ms (spread) ratio  host us" * len(trees)]
    keys = [(r["case"], r["precision"]) for r in runs[trees[0]][0]]
    for key in keys:
        cells, base = [], None
        for tree in trees:
            rows_of_key = [r for run in runs[tree] for r in run
                           if (r["case"], r["precision"]) == key]
            ms = [r["ms"] for r in rows_of_key]
            host = statistics.median(r["host_us"] for r in rows_of_key)
            med = statistics.median(ms)
            base = base or med
            cells.append(f"{med:9.3f} ({max(ms) - min(ms):.3f}) {med / base:5.3f} {host:8.1f}")
        rows.append(f"{key[0]:<5}{key[1]:<6}" + "".join(f"{c:>34}" for c in cells))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", help="source trees (each holding cufused/)")
    parser.add_argument("--rounds", type=int, default=3, help="turns per tree (3)")
    parser.add_argument("--repeat", type=int, default=30, help="timed calls per figure (30)")
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--precisions", nargs="*", choices=("ieee", "tf32", "3xtf32"),
                        default=["ieee", "tf32"])
    parser.add_argument("--without-out", action="store_true",
                        help="calls that allocate their results (no out)")
    parser.add_argument("--json", metavar="FILE", help="write every run's rows to FILE")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.cases, args.precisions, args.repeat, args.without_out)
        return 0
    if not args.trees:
        parser.error("give at least one tree")
    for tree in args.trees:
        if not os.path.isfile(os.path.join(tree, "cufused", "__init__.py")):
            parser.error(f"{tree} holds no cufused/ package (give the folder above it)")
    if args.rounds < 1 or args.repeat < 1:
        parser.error("--rounds and --repeat must be at least 1")
    runs = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            runs[tree].append(_run_tree(tree, args))
    print("\n".join(_table(args.trees, runs)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
