#!/usr/bin/env bash
# GPU check for the device machine: GPU tests, the benchmark, and the canonical check.
# Usage (repo root): bash scripts/gpu_check.sh [tests|bench|check|all] [extra pytest args...]
#                    bash scripts/gpu_check.sh compare OLD_TREE [compare_trees.py options...]
#                    bash scripts/gpu_check.sh dask [bench_dask.py options...]
# "all" = tests + bench; "check" (the canonical cases against float64 references computed on
# the GPU) runs on its own; "compare" times the fused pipelines of OLD_TREE (a copy of an
# older cufused/, e.g. from git archive, carried with the call) and of this tree side by side;
# "dask" runs the Dask benchmark (its options: --no-cluster for the threaded scheduler only,
# --gpus 1 2 for a LocalCUDACluster on one and two GPUs).
# Installs carried wheels from .whl/ (cuDNN Frontend, Dask) into /tmp/site when present.
# Full logs go to $OUT (or ./gpu_check_out); a short summary is printed last. The exit status
# is non-zero when a step failed; CUFUSED_REQUIRE_GPU=1 makes the tests fail, not skip, when
# CuPy sees no device or PyTorch (the GPU tests' oracle) is missing.
set -u -o pipefail
what=${1:-all}; shift || true
case "$what" in
  tests|bench|check|all|compare|dask) ;;
  *) echo "usage: bash scripts/gpu_check.sh [tests|bench|check|all|compare|dask] ..." >&2; exit 2 ;;
esac
if [ "$what" = compare ] && [ $# -lt 1 ]; then
  echo "usage: bash scripts/gpu_check.sh compare OLD_TREE [compare_trees.py options...]" >&2
  exit 2
fi
out=${OUT:-gpu_check_out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 CUFUSED_REQUIRE_GPU=1
summary=()
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
# Clocks, temperature, power and throttle reasons once a second, to tell run-to-run drift of
# the device from that of the code.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active \
  --format=csv,noheader -lms 1000 > "$out/clocks.csv" 2>&1 &
clocks_pid=$!
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest tests -m gpu -q -p no:cacheprovider -o addopts="" --durations=25 "$@" 2>&1 | tee "$out/pytest.log" || status=1
  summary+=("pytest: $(grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$out/pytest.log" | tail -1)")
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m cufused bench --json "$out/bench.json" --plot "$out/bench.png" 2>&1 | tee "$out/bench.log" || status=1
fi
if [ "$what" = compare ]; then
  python3 scripts/compare_trees.py "$1" "$PWD" "${@:2}" --json "$out/compare.json" 2>&1 | tee "$out/compare.log" || status=1
fi
if [ "$what" = dask ]; then
  python3 scripts/bench_dask.py --json "$out/bench_dask.json" "$@" 2>&1 | tee "$out/bench_dask.log" || status=1
fi
if [ "$what" = check ]; then
  python3 -m cufused check 2>&1 | tee "$out/check.log" || status=1
  summary+=("check: $(tail -2 "$out/check.log" | head -1)")
fi
kill "$clocks_pid" 2>/dev/null
summary+=("clocks (SM MHz, throttle reasons: seconds): $(awk -F', ' '{print $2, $6}' "$out/clocks.csv" | sort | uniq -c | sort -rn | head -4 | awk '{printf "%s %s %s: %s; ", $2, $3, $4, $1}')")
echo "================ summary ($(cat "$out/device.txt"))"
for line in "${summary[@]}"; do echo "$line"; done
[ -f "$out/bench.log" ] && grep -A20 '^median ms' "$out/bench.log"
exit $status  # non-zero when pytest, the benchmark or the check failed
