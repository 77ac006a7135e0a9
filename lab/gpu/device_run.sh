#!/bin/bash
# Build + tests + sanitizers + benches on the device. Usage: device_run.sh [tests|bench|all|cp]
# cp: test_gpu, then `verify` (non-CP) and `verify --backend local` on every fixture of quick, edge and te (and on
# quick with CPGOLD_BACKWARD_KERNEL=mma),
# and (with CP_RERUNS=1) the deterministic local CP path on quick twice per fixture, bits compared; with SANITIZE=1
# also compute-sanitizer memcheck and racecheck over test_gpu's sanitizer case.
MODE=${1:-all}
# Run from the repository root of a source snapshot; $OUT is where logs go.
cd "${CPGOLD_SRC:-.}"
echo "== commit $(cat ${CPGOLD_COMMIT_FILE:-/dev/null} 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
nvcc --version | tail -1
B=${B:-/tmp/b}
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} > $OUT/configure.log 2>&1 || { tail -30 $OUT/configure.log; exit 1; }
grep -E "CUDA|NCCL|HDF5|Eigen" $OUT/configure.log
cmake --build $B -j16 --target test_gpu bench_gpu_attention bench_cp_local cpgold > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head -30; exit 1; }
echo "== build ok"
if [ $MODE = cp ]; then
  (cd $B && timeout 300 ./bin/test_gpu > $OUT/test_gpu.log 2>&1; echo "test_gpu rc=$?")
  grep -E "test cases|assertions" $OUT/test_gpu.log | head -4; grep -E "ERROR|FAILED" $OUT/test_gpu.log | head -20
  for S in quick edge te; do $B/bin/cpgold gen --force --suite $S -o /tmp/fx/$S > $OUT/gen_$S.log 2>&1 || tail -5 $OUT/gen_$S.log; done
  ALL="/tmp/fx/quick/*.h5 /tmp/fx/edge/*.h5 /tmp/fx/te/*.h5"
  timeout 200 $B/bin/cpgold verify $ALL > $OUT/verify.log 2>&1; echo "verify (non-CP) rc=$?"; grep -E "^verify:" $OUT/verify.log
  grep -E "^(forward|backward) kernel" $OUT/verify.log | sort | uniq -c
  # The CP executor on the mma.sync backward forced (the A side of the wgmma backward's d 64/128 steps).
  CPGOLD_BACKWARD_KERNEL=mma timeout 200 $B/bin/cpgold verify --backend local /tmp/fx/quick/*.h5 > $OUT/verify_local_mma_bwd.log 2>&1; echo "verify --backend local (CPGOLD_BACKWARD_KERNEL=mma, quick) rc=$?"; grep -E "^verify:" $OUT/verify_local_mma_bwd.log
  timeout 300 $B/bin/cpgold verify --backend local $ALL > $OUT/verify_local.log 2>&1; echo "verify --backend local rc=$?"
  grep -E "^verify:|FAIL|UNSUPPORTED|unsupported:" $OUT/verify_local.log | head -20
  timeout 120 $B/bin/cpgold verify --backend local --deterministic $ALL > $OUT/verify_local_det.log 2>&1; echo "verify --backend local --deterministic rc=$?"; grep -E "^verify:" $OUT/verify_local_det.log
  [ -n "$CP_RERUNS" ] && for F in /tmp/fx/quick/*.h5; do n=$(basename $F .h5)
    $B/bin/cpgold verify --backend local --deterministic --dump /tmp/d1_$n.h5 $F > /dev/null 2>&1
    $B/bin/cpgold verify --backend local --deterministic --dump /tmp/d2_$n.h5 $F > /dev/null 2>&1
    [ -f /tmp/d1_$n.h5 ] && { $B/bin/cpgold check --identical /tmp/d1_$n.h5 /tmp/d2_$n.h5 > /dev/null && echo "identical $n" || echo "DIFFERENT $n"; }
  done | awk '{print $1}' | sort | uniq -c | tr '\n' ' '; echo
  if [ -n "$SANITIZE" ]; then
    for tool in memcheck racecheck; do
      (cd $B && timeout 200 compute-sanitizer --tool $tool ./bin/test_gpu -tc="*sanitizers*" > $OUT/$tool.log 2>&1; echo "$tool rc=$?")
      grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test cases" $OUT/$tool.log
    done
  fi
  cd $OUT && tar -czf logs.tar.gz *.log && rm -f *.log; exit 0
fi
if [ $MODE != bench ]; then
  (cd $B && timeout 300 ./bin/test_gpu > $OUT/test_gpu.log 2>&1; echo "test_gpu rc=$?")
  grep -E "VERDICT.*FAIL" $OUT/test_gpu.log | head -20
  grep -c "VERDICT.*PASS" $OUT/test_gpu.log | sed 's/^/VERDICT lines PASS: /'
  grep -E "deterministic backward|ERROR|test cases|assertions|Status" $OUT/test_gpu.log | head -20
  for S in quick edge; do $B/bin/cpgold gen --force --suite $S -o /tmp/fx/$S > $OUT/gen_$S.log 2>&1 || tail -5 $OUT/gen_$S.log; done
  timeout 200 $B/bin/cpgold verify /tmp/fx/quick/*.h5 /tmp/fx/edge/*.h5 > $OUT/verify.log 2>&1; echo "verify rc=$?"
  grep -E "^verify:|UNSUPPORTED|FAIL" $OUT/verify.log | head -20
  timeout 100 $B/bin/cpgold verify --deterministic /tmp/fx/quick/*.h5 > $OUT/verify_det.log 2>&1; echo "verify --deterministic rc=$?"; grep -E "^verify:" $OUT/verify_det.log
  F=/tmp/fx/edge/gqa_w8.h5; $B/bin/cpgold verify --deterministic --dump /tmp/run1.h5 $F > /dev/null; $B/bin/cpgold verify --deterministic --dump /tmp/run2.h5 $F > /dev/null
  $B/bin/cpgold check --identical /tmp/run1.h5 /tmp/run2.h5 | tail -2; $B/bin/cpgold check $F /tmp/run1.h5 > $OUT/check_dump.log; echo "cpgold check of the dump rc=$?"
  (cd $B && timeout 200 compute-sanitizer --tool memcheck ./bin/test_gpu -tc="*sanitizers*" > $OUT/memcheck.log 2>&1; echo "memcheck rc=$?")
  grep -E "ERROR SUMMARY|test cases" $OUT/memcheck.log
  (cd $B && timeout 200 compute-sanitizer --tool racecheck ./bin/test_gpu -tc="*sanitizers*" > $OUT/racecheck.log 2>&1; echo "racecheck rc=$?")
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test cases" $OUT/racecheck.log
fi
if [ $MODE != tests ]; then
  timeout 450 $B/bin/bench_gpu_attention --forward both --backward both 2>&1 | tee $OUT/bench_cpgold.log
  PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu/bench_torch.py 2>&1 | tee $OUT/bench_torch.log
fi
cd $OUT && tar -czf logs.tar.gz *.log && rm -f *.log
