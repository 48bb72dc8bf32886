#!/usr/bin/env bash
# Per-kernel device times of one warm pipeline call (device machine, after gpu_check.sh's install).
# Usage: bash scripts/ncu_kernels.sh CASE PRECISION
ncu --clock-control none --nvtx --nvtx-include "measure/" --csv --metrics gpu__time_duration.sum \
    python3 scripts/profile_pipelines.py "$1" "$2" 2>/dev/null |
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
