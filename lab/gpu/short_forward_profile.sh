#!/bin/bash
# The wgmma forward on short sequences (device, $OUT set): bench_gpu_attention --divide 1 and 8 at d 128 and 64 under
# each forward schedule (CPGOLD_FORWARD_SCHEDULE), then Nsight Compute sections of the automatic schedule's forward
# kernel on the causal and the full batch of --divide 8 (d 128, 65536 tokens; the first forward launch of each mask).
# Usage: OUT=... [CPGOLD_PREFIX=...] bash lab/gpu/short_forward_profile.sh
set -u
B=/tmp/b
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} > $OUT/configure.log 2>&1 ||
  { tail -30 $OUT/configure.log; exit 1; }
cmake --build $B -j16 --target bench_gpu_attention > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head; exit 1; }
for D in 1 8; do
  for S in auto tile128 tile64 persistent128 persistent64; do
    echo "== divide $D, schedule $S"
    CPGOLD_FORWARD_SCHEDULE=$S timeout 120 $B/bin/bench_gpu_attention --forward wgmma --backward wgmma --divide $D \
      --dims 128/128,64/64 --totals 65536 --reps 10 > $OUT/sched_${D}_$S.log 2>&1
    grep -E "^wgmma|^forward kernel" $OUT/sched_${D}_$S.log | cut -c1-160
  done
done
# Forward launches per mask in bench_gpu_attention: 1 (O and LSE) + 3 warm-ups + reps + 200 host-time calls.
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis"
for mask in causal full; do
  skip=0; [ $mask = full ] && skip=$((1 + 3 + 10 + 200))
  echo "== ncu $mask (launch-skip $skip)"
  timeout 200 ncu --clock-control none -k regex:attention_forward_sm90 --launch-skip $skip --launch-count 1 $SECTIONS \
    $B/bin/bench_gpu_attention --forward wgmma --backward wgmma --divide 8 --dims 128/128 --totals 65536 --reps 10 \
    > $OUT/ncu_$mask.log 2>&1
  grep -E "Duration|Throughput|Achieved Occupancy|Theoretical Occupancy|Registers|Grid Size|Block Size|Waves|Warp Cycles|Issued Warp|Eligible|Active Warps|No Eligible|Hit Rate|Mem Busy|Max Bandwidth|Shared Memory Configuration|Dynamic Shared" $OUT/ncu_$mask.log
done
cd $OUT && tar -czf logs.tar.gz *.log && rm -f *.log
