#!/bin/bash
# Kernel-by-kernel device time of one local CP forward + backward against one non-CP forward + backward on the same
# tokens (Nsight Compute; every kernel replayed alone, clocks left as they are). Run from a source snapshot's root
# with $OUT set and CPGOLD_PREFIX naming the header dependencies. Usage: profile_cp_local.sh [W...] (default 1 4 8);
# $CP_ARGS adds bench_cp_local options to the CP runs (e.g. "--sum 0" for the schedule without the summing backward).
B=${PROFILE_BUILD:-/tmp/b-profile}  # an existing build folder is configured and built again (incremental)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} > $OUT/configure.log 2>&1 ||
  { tail -20 $OUT/configure.log; exit 1; }
cmake --build $B -j16 --target bench_cp_local > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head -30; exit 1; }
echo "== build ok"
METRICS=gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__waves_per_multiprocessor
CASE="--tokens 32768 --heads 16 --dim 128"
prof() {  # label, bench arguments
  local label=$1; shift
  timeout 240 ncu --clock-control none --csv --metrics $METRICS $B/bin/bench_cp_local $CASE "$@" > $OUT/ncu_$label.csv 2> $OUT/ncu_$label.err
  echo "== ncu $label (rc=$?): bench_cp_local $CASE $*"
  python3 lab/gpu/ncu_kernel_totals.py $OUT/ncu_$label.csv "$label"
}
prof noncp --once noncp
for W in ${@:-1 4 8}; do prof p2p_w$W --comm p2p --cp-size $W --once cp $CP_ARGS; done
cd $OUT && tar -czf ncu.tar.gz ncu_*.csv ncu_*.err *.log && rm -f ncu_*.csv ncu_*.err *.log
