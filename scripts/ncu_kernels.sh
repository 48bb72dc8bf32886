#!/usr/bin/env bash
# Per-kernel device times (Nsight Compute) of one warm call (device machine, after
# gpu_check.sh's install). Usage:
#   bash scripts/ncu_kernels.sh CASE PRECISION                 one pipeline call
#   bash scripts/ncu_kernels.sh conv CASE PRECISION MODE       one public conv, MODE replay|direct
if [ "$1" = conv ]; then
  cmd=(python3 scripts/host_time.py once "$2" "$3" "$4"); select=(--profile-from-start off)
else
  cmd=(python3 scripts/profile_pipelines.py "$1" "$2"); select=(--nvtx --nvtx-include "measure/")
fi
ncu --clock-control none "${select[@]}" --csv --metrics gpu__time_duration.sum "${cmd[@]}" \
    2>/dev/null |
  python3 -c '
import csv, sys
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith("\""))]
head, body = rows[0], rows[1:]
name, unit, value = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
total = 0.0
for r in body:
    v = float(r[value].replace(",", "")) * {"n": 1e-6, "u": 1e-3, "m": 1.0}[r[unit][0]]
    total += v
    print(f"  {v:8.3f} ms  {r[name][:90]}")
print(f"  {total:8.3f} ms  total")
'
