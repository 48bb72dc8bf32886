#!/usr/bin/env bash
# Per-kernel device times (Nsight Compute) of one warm call (device machine, after
# gpu_check.sh's install). Usage:
#   bash scripts/ncu_kernels.sh CASE PRECISION                 one pipeline call
#   bash scripts/ncu_kernels.sh conv CASE PRECISION MODE       one public conv, MODE replay|direct
#   bash scripts/ncu_kernels.sh detail CASE PRECISION          the call's own kernels (not
#       cuDNN's, cuBLAS's or the DFT engine's): time, DRAM / SM / L2 use, tensor and shared
#       pipes, issue slots, occupancy and its limiter, the top warp stall reasons
if [ -z "$1" ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
if [ "$1" = detail ]; then
  metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
  metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct
  metrics+=,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread
  metrics+=,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers
  metrics+=,launch__occupancy_limit_warps,sm__warps_active.avg.pct_of_peak_sustained_active
  metrics+=,launch__grid_size,launch__block_size,smsp__inst_executed.sum
  metrics+=,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
  metrics+=,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active
  metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active
  for r in long_scoreboard barrier lg_throttle mio_throttle short_scoreboard wait math_pipe_throttle \
           membar drain; do
    metrics+=,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
  done
  ncu --clock-control none --nvtx --nvtx-include "measure/" --kernel-name-base function \
      --kernel-name "regex:^(?!cudnn|sm[0-9]|xmma|cutlass|fft|vector_fft|regular_fft|nhwc|nchw)" \
      --metrics "$metrics" python3 scripts/profile_pipelines.py "$2" "$3" \
      2>/dev/null | python3 -c '
import re, sys
short = {"gpu__time_duration.sum": "us", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
         "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%", "lts__t_sector_hit_rate.pct": "L2hit%",
         "dram__bytes_read.sum": "read", "dram__bytes_write.sum": "write",
         "launch__registers_per_thread": "regs", "launch__occupancy_limit_shared_mem": "lim_smem",
         "launch__occupancy_limit_registers": "lim_regs", "launch__occupancy_limit_warps": "lim_warps",
         "sm__warps_active.avg.pct_of_peak_sustained_active": "warps%", "launch__grid_size": "grid",
         "launch__block_size": "block", "smsp__inst_executed.sum": "inst",
         "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor%",
         "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active": "shared_pipe%",
         "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue%"}
def flush(name, vals):
    if name:
        stalls = sorted(((float(v), k) for k, v in vals.items() if k.startswith("stall_")), reverse=True)[:3]
        print(name[:100])
        print("   ", ", ".join(f"{k} {v}" for k, v in vals.items() if not k.startswith("stall_")))
        print("    stalls (cycles per issue):", ", ".join(f"{k[6:]} {v:.2f}" for v, k in stalls))
name, vals = None, {}
for line in sys.stdin:
    m = re.match(r"^    (\S+)\s+(\S+)?\s+([0-9.,]+)$", line.rstrip())
    if m:
        key = m.group(1)
        key = "stall_" + key[len("smsp__average_warps_issue_stalled_"):-len("_per_issue_active.ratio")] if "issue_stalled" in key else short.get(key, key)
        unit = m.group(2) or ""
        value = m.group(3).replace(",", "")
        if key == "us":  # ncu scales the unit of the duration to its size
            scale = {"n": 1e-3, "u": 1, "m": 1e3, "s": 1e6}[unit[0]]  # nsecond or ns
            value = "%.1f" % (float(value) * scale)
        vals[key] = value + ("" if key == "us" or unit in ("%", "inst", "block") or unit.startswith("reg") else unit)
    elif re.match(r"^  \S", line) and "(" in line:
        flush(name, vals)
        name, vals = line.strip(), {}
flush(name, vals)
'
  exit 0
fi
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
