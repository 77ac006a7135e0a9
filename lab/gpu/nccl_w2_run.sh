#!/bin/bash
# W = 2 on a two-GPU machine: the NCCL test suite, the local CP tests (one GPU), `verify --backend nccl` on the
# GPU-capable W = 2 fixtures of the quick, edge and te suites (p2p, a2a, all_gather) in both launch modes, the
# deterministic backward run three times (threads twice, mpirun once: every fixture's output digests must agree),
# and a failing rank and a mismatched case in both launch modes. Called by nccl_device_run.sh (which builds,
# exports NCCL_NVLS_ENABLE=0 and sets B, C, OUT, MPIRUN and run()).
run test_nccl 150 $B/bin/test_nccl
grep -E "SKIPPED|test cases|assertions|ERROR|overlap" $OUT/test_nccl.log | sort | uniq -c | head -12
# The single-GPU transport behind the same backend (W ranks on GPU 0): gpu/comm/local_communicator's tests.
run test_cp_local 150 $B/bin/test_gpu -tc="local*"
grep -E "SKIPPED|test cases|assertions|ERROR" $OUT/test_cp_local.log | sort | uniq -c | head -6
for s in quick edge te; do $C gen --suite $s -o /tmp/fx/$s > $OUT/gen_$s.log 2>&1 || tail -3 $OUT/gen_$s.log; done
W2=""
for f in /tmp/fx/*/*.h5; do
  c=$($C inspect --no-verify $f | grep -m1 '^case')
  [[ "$c" == *'"cp_size":2,'* ]] || continue
  [[ "$c" == *'"dtype":"bf16"'* || "$c" == *'"dtype":"fp16"'* ]] || continue
  [[ "$c" == *'"comm":"p2p"'* || "$c" == *'"comm":"a2a"'* || "$c" == *'"comm":"all_gather"'* ]] && W2="$W2 $f"
done
echo "== W=2 fixtures: $(echo $W2 | wc -w)"
run verify_w2_threads 75 $C verify --backend nccl --timeout 30 $W2
run verify_w2_mpi 75 $MPIRUN -np 2 $C verify --backend nccl --timeout 30 $W2
run det_w2_threads_1 75 $C verify --backend nccl --deterministic --timeout 30 $W2
run det_w2_threads_2 75 $C verify --backend nccl --deterministic --timeout 30 $W2
run det_w2_mpi 75 $MPIRUN -np 2 $C verify --backend nccl --deterministic --timeout 30 $W2
for f in verify_w2_threads verify_w2_mpi det_w2_threads_1 det_w2_threads_2 det_w2_mpi; do
  echo "-- $f"; grep -E "^verify:|^verdict: FAIL|UNSUPPORTED|error" $OUT/$f.log | head -6
  echo "   per-fixture verdicts: $(grep -c '^verdict: PASS' $OUT/$f.log) PASS, $(grep -c '^verdict: FAIL' $OUT/$f.log) FAIL"
done
# Rerun check: the digest lines (one per fixture, every rank's O, LSE, dQ, dK, dV bits) of the three deterministic runs.
for f in det_w2_threads_1 det_w2_threads_2 det_w2_mpi verify_w2_threads verify_w2_mpi; do
  grep -E "^golden|^outputs digest" $OUT/$f.log > $OUT/$f.digests
done
echo "== deterministic digests: $(grep -c '^outputs digest' $OUT/det_w2_threads_1.digests) fixtures;" \
  "threads run 2 $(cmp -s $OUT/det_w2_threads_1.digests $OUT/det_w2_threads_2.digests && echo identical || echo DIFFERENT)," \
  "mpirun $(cmp -s $OUT/det_w2_threads_1.digests $OUT/det_w2_mpi.digests && echo identical || echo DIFFERENT)"
echo "== atomic digests (no bitwise promise): threads vs mpirun differ in" \
  "$(diff $OUT/verify_w2_threads.digests $OUT/verify_w2_mpi.digests | grep -c '^<') lines"
A=$(echo $W2 | cut -d' ' -f1); Bf=$(echo $W2 | cut -d' ' -f2)
run verify_mismatch_threads 60 $C verify --backend nccl $A --inject-mismatch 1 --timeout 20
run verify_mismatch_mpi 60 $MPIRUN -np 2 bash -c "if [ \$OMPI_COMM_WORLD_RANK = 1 ]; then exec $C verify --backend nccl $Bf --timeout 20; else exec $C verify --backend nccl $A --timeout 20; fi"
run verify_fail_threads 60 $C verify --backend nccl $W2 --inject-failure 1:exception --timeout 20
run verify_fail_mpi 60 $MPIRUN -np 2 $C verify --backend nccl $W2 --inject-failure 0:cuda --timeout 20
for f in verify_mismatch_threads verify_mismatch_mpi verify_fail_threads verify_fail_mpi; do
  echo "-- $f"; grep -E "^rank [0-9]+: error" $OUT/$f.log | cut -c1-200 | sort | head -4
done
