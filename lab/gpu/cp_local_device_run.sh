#!/bin/bash
# Local CP on the device: build, the local CP GPU tests, `verify --backend local` over quick/edge/te, and
# bench_cp_local (with its phase breakdown) for every comm type. Run from a source snapshot's root with $OUT set
# (logs go there) and CPGOLD_PREFIX naming the header dependencies. Usage: cp_local_device_run.sh [tests|bench|all]
MODE=${1:-all}
B=/tmp/b-cplocal  # its own folder: a warm machine may hold another tree's /tmp/b
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} > $OUT/configure.log 2>&1 ||
  { tail -20 $OUT/configure.log; exit 1; }
cmake --build $B -j16 --target test_gpu cpgold bench_cp_local > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head -30; exit 1; }
echo "== build ok"
if [ "$MODE" != bench ]; then
  (cd $B && timeout 300 ./bin/test_gpu -tc="local CP*,local communicator*" > $OUT/test_gpu.log 2>&1; echo "test_gpu rc=$?")
  grep -E "^\[doctest\] (test cases|assertions)" $OUT/test_gpu.log
  for S in quick edge te; do
    $B/bin/cpgold gen --force --suite $S -o /tmp/fx/$S > $OUT/gen_$S.log 2>&1 || tail -3 $OUT/gen_$S.log
  done
  timeout 300 $B/bin/cpgold verify --backend local /tmp/fx/quick/*.h5 /tmp/fx/edge/*.h5 /tmp/fx/te/*.h5 > $OUT/verify.log 2>&1
  echo "verify --backend local rc=$?"; grep -E "^verify:" $OUT/verify.log
  timeout 200 $B/bin/cpgold verify --backend local --deterministic /tmp/fx/quick/*.h5 /tmp/fx/edge/*.h5 > $OUT/verify_det.log 2>&1
  echo "verify --backend local --deterministic rc=$?"; grep -E "^verify:" $OUT/verify_det.log
fi
if [ "$MODE" != tests ]; then
  for c in "p2p 4 10" "a2a 4 5" "all_gather 4 5" "a2a+p2p 4 5" "p2p 1 5"; do
    set -- $c
    timeout 120 $B/bin/bench_cp_local --comm $1 --cp-size $2 --tokens 32768 --heads 16 --dim 128 --reps $3 --phases 1 \
      > $OUT/bench_$1_$2.log 2>&1
    echo "== bench_cp_local --comm $1 --cp-size $2 --tokens 32768 --heads 16 --dim 128 --reps $3 --phases 1 (rc=$?)"
    cat $OUT/bench_$1_$2.log
  done
fi
