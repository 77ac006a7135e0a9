#!/bin/bash
# Schedules of the wgmma forward on short CP-step chunks (docs/gpu-kernels.md, "Forward schedules"), on the device:
# build, the schedule tests of test_gpu, then for W in 1 4 8 and every CPGOLD_FORWARD_SCHEDULE value
# `bench_cp_local --comm p2p --cp-size W --tokens 32768 --heads 16 --dim 128 --reps 10 --phases 1`, and
# `bench_gpu_attention --dims 128/128` per schedule (whole sequences). Logs under $OUT; the last lines are a compact
# table: forward TFLOP/s by step section (diagonal / lower / upper) per W and schedule.
# Run from the repository root with $OUT set (CPGOLD_PREFIX: header dependencies, as device_run.sh).
set -u
: "${OUT:?set OUT to the folder for the logs}"
B=/tmp/b-short  # its own build folder
SCHEDULES="auto tile128 tile64 persistent128 persistent64"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
git rev-parse HEAD 2>/dev/null || true
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} > $OUT/configure.log 2>&1 ||
  { tail -20 $OUT/configure.log; exit 1; }
cmake --build $B -j16 --target test_gpu bench_cp_local bench_gpu_attention > $OUT/build.log 2>&1 ||
  { grep -E "error" $OUT/build.log | head -30; exit 1; }
echo "== build ok"
grep -E "spill|setmaxnreg" $OUT/build.log | sort | uniq -c | head -5
(cd $B && timeout 300 ./bin/test_gpu -tc="*wgmma forward schedules*,*wgmma forward against*,*CP-step call*,Q tile work*,forward schedules*" \
  > $OUT/test_schedules.log 2>&1; echo "test_gpu (schedules) rc=$?")
grep -E "^\[doctest\] (test cases|assertions)|^SCHEDULES|FAIL" $OUT/test_schedules.log | head -40
for S in $SCHEDULES; do
  CPGOLD_FORWARD_SCHEDULE=$S timeout 120 $B/bin/bench_gpu_attention --forward wgmma --dims 128/128 \
    > $OUT/whole_$S.log 2>&1
  echo "== CPGOLD_FORWARD_SCHEDULE=$S bench_gpu_attention --forward wgmma --dims 128/128 (rc=$?)"
  cat $OUT/whole_$S.log
done
for W in 1 4 8; do
  for S in $SCHEDULES; do
    CPGOLD_FORWARD_SCHEDULE=$S timeout 120 $B/bin/bench_cp_local --comm p2p --cp-size $W --tokens 32768 --heads 16 \
      --dim 128 --reps 10 --phases 1 > $OUT/cp_W${W}_$S.log 2>&1
    echo "== CPGOLD_FORWARD_SCHEDULE=$S bench_cp_local --comm p2p --cp-size $W ... --phases 1 (rc=$?)"
    grep -E "^forward kernel:|^\| (CP|non-CP|local)|^\| forward \|" $OUT/cp_W${W}_$S.log
  done
done
echo
echo "forward TFLOP/s by step section (diagonal / lower / upper; W=1: all), bench_cp_local p2p 32768 tokens h16 d128"
echo "| W | schedule | diagonal | lower | upper | all |"
echo "|---|---|---|---|---|---|"
for W in 1 4 8; do
  for S in $SCHEDULES; do
    row=$(awk -F'|' '$2 ~ /forward/ {gsub(/ /, "", $3); gsub(/ /, "", $7); v[$3] = $7}
      END {printf "%s | %s | %s | %s", (v["diagonal"] ? v["diagonal"] : "-"), (v["lower"] ? v["lower"] : "-"),
                                     (v["upper"] ? v["upper"] : "-"), (v["all"] ? v["all"] : "-")}' $OUT/cp_W${W}_$S.log)
    echo "| $W | $S | $row |"
  done
done
