#!/bin/bash
# The backward's accumulation schedules of local CP on the device, in one build: first what must not change
# (test_gpu's attention and local CP cases, among them the bit-for-bit comparisons of the schedules, and
# `verify --backend local` over quick/edge/te in both backward modes), then bench_cp_local's wall times for each
# schedule of $SCHEDULES ("aside,sum" pairs: CpGpuOptions::accumulate_aside and sum_in_backward; default all four),
# alternating, p2p W=4 twice each and once each for the other comm types and W = 2 and 8. The first p2p W=4 round also
# writes a timeline of each schedule (bench_cp_local --timeline: Chrome traces beside the logs in $OUT, busy and
# overlap times printed). $OTHER_SCHEDULES, if set, replaces $SCHEDULES for the other comm types and sizes. Run from a source snapshot's root with $OUT set and CPGOLD_PREFIX naming the header dependencies.
B=/tmp/b-aside
SCHEDULES=${SCHEDULES:-"0,0 1,0 0,1 1,1"}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
rm -rf $B
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} > $OUT/configure.log 2>&1 ||
  { tail -20 $OUT/configure.log; exit 1; }
cmake --build $B -j16 --target test_gpu cpgold bench_cp_local > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head -30; exit 1; }
echo "== build ok"
(cd $B && timeout 400 ./bin/test_gpu -tc="gpu attention*,local CP*,local communicator*" > $OUT/test_gpu.log 2>&1; echo "test_gpu rc=$?")
grep -E "^\[doctest\] (test cases|assertions)|ERROR|VERDICT summing" $OUT/test_gpu.log | head -30
for S in quick edge te; do
  $B/bin/cpgold gen --force --suite $S -o /tmp/fx/$S > $OUT/gen_$S.log 2>&1 || tail -3 $OUT/gen_$S.log
done
for det in "" --deterministic; do
  timeout 300 $B/bin/cpgold verify --backend local $det /tmp/fx/quick/*.h5 /tmp/fx/edge/*.h5 /tmp/fx/te/*.h5 > $OUT/verify$det.log 2>&1
  echo "verify --backend local $det rc=$?"; grep -E "^verify:" $OUT/verify$det.log
done
CP="--tokens 32768 --heads 16 --dim 128"
run() {  # name, bench arguments
  local name=$1; shift
  echo "== bench_cp_local $CP $*"
  timeout 120 $B/bin/bench_cp_local $CP "$@" > $OUT/bench_$name.log 2>&1
  grep -E "^\| (non|local)" $OUT/bench_$name.log
}
for round in 1 2; do
  for sc in $SCHEDULES; do
    a=${sc%,*}; s=${sc#*,}
    extra=""; [ $round = 1 ] && extra="--timeline $OUT/timeline_p2p4_aside${a}_sum$s.json"
    run p2p4_${a}${s}_$round --comm p2p --cp-size 4 --reps 20 --aside $a --sum $s $extra
    [ $round = 1 ] && sed -n '/^timeline of one run/,$p' $OUT/bench_p2p4_${a}${s}_$round.log
  done
done
for c in "a2a 4" "all_gather 4" "a2a+p2p 4" "p2p 2" "p2p 8"; do
  set -- $c
  for sc in ${OTHER_SCHEDULES:-$SCHEDULES}; do
    a=${sc%,*}; s=${sc#*,}
    run ${1}_${2}_$a$s --comm $1 --cp-size $2 --reps 10 --aside $a --sum $s
  done
done
