"""The kernels under NVIDIA's compute-sanitizer (device): random cases of the two fuzzers
(``fuzz_pipelines.py``, ``fuzz_blocks.py``) and the halo kernels' store paths
(``halo_store_cases.py``: tile pairs, bands, tensor stores, many tiles a block) run under
each tool, in the device's builds and in the portable ones (``portable_builds``: the
``mma.sync`` path every other architecture takes), with cuDNN's heuristic plans
(``plan_options(autotune=False)``: timing every plan would take the tool's time).

Tools: ``racecheck`` (shared-memory hazards between threads), ``memcheck`` (out-of-bounds
and misaligned accesses), ``synccheck`` (barriers), ``initcheck`` (reads of global memory
never written). Each run prints its cases (the fuzzers still compare every result with the
float64 reference) and the reports per kernel; cuDNN's, CuPy's and PyTorch's own kernels are
listed apart. The exit status is 1 if any other function has a report, or a case fails or
does not finish. memcheck and initcheck see CuPy's memory pool as the driver gives it: an
access past an array that lands in a neighbouring pooled block, or a read of pooled memory
that an earlier array wrote, goes unreported.

Usage: python scripts/sanitize.py [--tools racecheck memcheck]
                                  [--fuzzers pipelines blocks halo_stores]
                                  [--builds device portable] [--seconds 40] [--seed 1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
FUZZERS = {"pipelines": "fuzz_pipelines", "blocks": "fuzz_blocks",
           "halo_stores": "halo_store_cases"}
# A function named in a report: "at <name>+0x..", "at void <name><..>(..)+0x.." (a return
# type before the name).
_REPORTED = re.compile(r"\bat (?:[\w:]+ )?([A-Za-z_]\w*)(?=[<(+])")


# Kernels of cuDNN, cuBLAS, CuPy's own and PyTorch's: reported apart. Any other name counts
# as cufused's (its kernels and the device functions they call, which a report may name).
_THIRD_PARTY = re.compile(r"cudnn|xmma|cutlass|cublas|^cupy_|^sm\d+_|fft|^cub|thrust|^at_|"
                          r"^void_at|^implicit_convolve|^gemm")
# Lines of a log that are not reports: the tool's banner and summaries, API errors.
_NOT_REPORTS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY",
                "Target application", "Program hit")


def is_third_party(kernel: str) -> bool:
    """Whether a reported function is another library's (cuDNN, cuBLAS, CuPy, PyTorch)."""
    return bool(_THIRD_PARTY.search(kernel))


def reported_kernels(log: str) -> collections.Counter:
    """Reports per function in a compute-sanitizer log. A report starts at an unindented
    line after the tool's prefix; it counts for the first device function that it names
    (``at <name>+0x..``), in that line or an indented one after it (host frames name
    none)."""
    counts: collections.Counter = collections.Counter()
    in_report = False
    for line in log.splitlines():
        if not line.startswith("========="):
            continue
        rest = line.removeprefix("=========")
        body = rest.strip()
        unindented = rest.startswith(" ") and not rest.startswith("  ")
        if unindented and body and not body.startswith(_NOT_REPORTS):
            in_report = True
        if in_report and "Host Frame" not in body:
            found = _REPORTED.search(body)
            if found:
                counts[found.group(1)] += 1
                in_report = False
    return counts


def _child(fuzzer: str, portable: bool, argv: list[str]) -> int:
    """One fuzzer's main() in this process, with heuristic plans (and portable builds)."""
    sys.path.insert(0, str(SCRIPTS))
    from cufused._cuda import portable_builds
    from cufused._settings import plan_options

    main = __import__(FUZZERS[fuzzer]).main
    with contextlib.ExitStack() as scope:
        scope.enter_context(plan_options(autotune=False))
        if portable:
            scope.enter_context(portable_builds())
        return main(argv)


def _run(sanitizer: str, tool: str, fuzzer: str, build: str, seconds: float,
         seed: int) -> bool:
    """One tool over one fuzzer and build; prints the summary, returns whether it is clean."""
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "sanitizer.log"
        command = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--print-limit",
                   "10000", "--log-file", str(log), sys.executable, __file__, "--child",
                   fuzzer, "--seconds", str(seconds), "--seed", str(seed)]
        command += ["--portable"] * (build == "portable")
        try:  # the fuzzer checks its time between cases: a slow case may run past it
            result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                                    timeout=seconds + 1800)
        except subprocess.TimeoutExpired:
            print(f"== {tool} over {fuzzer} ({build} builds): timed out")
            return False
        text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    out = result.stdout.strip().splitlines()
    failures = [line for line in out if line.startswith("FAIL")]
    counts = reported_kernels(text)
    mine = {k: v for k, v in counts.items() if not is_third_party(k)}
    others = {k: v for k, v in counts.items() if is_third_party(k)}
    finished = bool(out) and out[-1].startswith("cases run")
    print(f"== {tool} over {fuzzer} ({build} builds): {out[-1] if finished else 'unfinished'}")
    for line in failures:
        print("  " + line)
    print(f"  cufused kernels with reports: {mine or 'none'}")
    if others:
        print(f"  other kernels with reports (not counted): {others}")
    if not finished:
        print(f"  exit status {result.returncode}: {result.stderr.strip()[-3000:]}")
    return not mine and not failures and finished and result.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", nargs="+", default=["racecheck", "memcheck"],
                        choices=["racecheck", "memcheck", "synccheck", "initcheck"])
    parser.add_argument("--fuzzers", nargs="+", choices=sorted(FUZZERS),
                        default=sorted(FUZZERS))
    parser.add_argument("--builds", nargs="+", choices=["device", "portable"],
                        default=["device", "portable"])
    parser.add_argument("--seconds", type=float, default=40.0,
                        help="time of each fuzzer run (40)")
    parser.add_argument("--seed", type=int, default=1, help="random seed of the first run (1)")
    parser.add_argument("--child", choices=sorted(FUZZERS), help=argparse.SUPPRESS)
    parser.add_argument("--portable", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child, args.portable,
                      ["--seconds", str(args.seconds), "--seed", str(args.seed)])
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not pathlib.Path(sanitizer).exists():
        parser.error("compute-sanitizer is not on PATH nor in /usr/local/cuda/bin")
    clean = True
    seed = args.seed
    for tool in args.tools:
        for fuzzer in args.fuzzers:
            for build in args.builds:
                clean &= _run(sanitizer, tool, fuzzer, build, args.seconds, seed)
                seed += 1
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
