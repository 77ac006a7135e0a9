#!/bin/bash
# `verify --backend nccl` on the GPU-capable fixtures of the quick, edge and te suites: W = 2 on two GPUs
# (p2p, a2a, all_gather fixtures with cp_size 2) and W = 4 (every comm type, cp_size 4), threads and mpirun; then a
# mismatched fixture on one rank and a failing rank in both launch modes. Called by nccl_device_run.sh (which builds,
# exports NCCL_NVLS_ENABLE=0 and sets B, C, OUT, MPIRUN and run()).
for s in quick edge te; do $C gen --suite $s -o /tmp/fx/$s > $OUT/gen_$s.log 2>&1 || tail -3 $OUT/gen_$s.log; done
# select W COMMS...: the bf16/fp16 fixtures with cp_size W and one of the comm types.
select_fixtures() {
  local w=$1; shift
  for f in /tmp/fx/*/*.h5; do
    local c=$($C inspect --no-verify $f | grep -m1 '^case')
    [[ "$c" == *"\"cp_size\":$w,"* ]] || continue
    [[ "$c" == *'"dtype":"bf16"'* || "$c" == *'"dtype":"fp16"'* ]] || continue
    for comm in "$@"; do [[ "$c" == *"\"comm\":\"$comm\""* ]] && { echo $f; break; }; done
  done
}
W2=$(select_fixtures 2 p2p a2a all_gather)
W4=$(select_fixtures 4 p2p a2a all_gather a2a+p2p)
echo "== W=2 fixtures: $(echo $W2 | wc -w); W=4 fixtures: $(echo $W4 | wc -w)"
run verify_w2_threads 75 env CUDA_VISIBLE_DEVICES=0,1 $C verify --backend nccl --timeout 30 $W2
run verify_w2_mpi 75 env CUDA_VISIBLE_DEVICES=0,1 $MPIRUN -np 2 $C verify --backend nccl --timeout 30 $W2
run verify_w4_threads 60 $C verify --backend nccl --timeout 30 $W4
run verify_w4_mpi 60 $MPIRUN -np 4 $C verify --backend nccl --timeout 30 $W4
# Deterministic backward at W = 4, three runs (threads twice, mpirun once): every fixture's output digests must agree.
run det_w4_threads_1 60 $C verify --backend nccl --deterministic --timeout 30 $W4
run det_w4_threads_2 60 $C verify --backend nccl --deterministic --timeout 30 $W4
run det_w4_mpi 60 $MPIRUN -np 4 $C verify --backend nccl --deterministic --timeout 30 $W4
for f in verify_w2_threads verify_w2_mpi verify_w4_threads verify_w4_mpi det_w4_threads_1 det_w4_threads_2 det_w4_mpi; do
  echo "-- $f"; grep -E "^verify:|^verdict: FAIL|UNSUPPORTED|error" $OUT/$f.log | head -8
  echo "   per-fixture verdicts: $(grep -c '^verdict: PASS' $OUT/$f.log) PASS, $(grep -c '^verdict: FAIL' $OUT/$f.log) FAIL"
done
for f in det_w4_threads_1 det_w4_threads_2 det_w4_mpi; do grep -E "^golden|^outputs digest" $OUT/$f.log > $OUT/$f.digests; done
echo "== W=4 deterministic digests: $(grep -c '^outputs digest' $OUT/det_w4_threads_1.digests) fixtures;" \
  "threads run 2 $(cmp -s $OUT/det_w4_threads_1.digests $OUT/det_w4_threads_2.digests && echo identical || echo DIFFERENT)," \
  "mpirun $(cmp -s $OUT/det_w4_threads_1.digests $OUT/det_w4_mpi.digests && echo identical || echo DIFFERENT)"
echo "== W=4 fixtures by comm type: $(for f in $W4; do $C inspect --no-verify $f | grep -m1 '^case' | grep -o '"comm":"[^"]*"'; done | sort | uniq -c | tr '\n' ' ')"
A=$(echo $W2 | cut -d' ' -f1); Bf=$(echo $W2 | cut -d' ' -f2)
run verify_mismatch_threads 60 env CUDA_VISIBLE_DEVICES=0,1 $C verify --backend nccl $A --inject-mismatch 1 --timeout 20
run verify_mismatch_mpi 60 env CUDA_VISIBLE_DEVICES=0,1 $MPIRUN -np 2 bash -c "if [ \$OMPI_COMM_WORLD_RANK = 1 ]; then exec $C verify --backend nccl $Bf --timeout 20; else exec $C verify --backend nccl $A --timeout 20; fi"
run verify_fail_threads 60 $C verify --backend nccl $W4 --inject-failure 2:exception --timeout 20
run verify_fail_mpi 60 $MPIRUN -np 4 $C verify --backend nccl $W4 --inject-failure 1:cuda --timeout 20
for f in verify_mismatch_threads verify_mismatch_mpi verify_fail_threads verify_fail_mpi; do
  echo "-- $f"; grep -E "^rank [0-9]+: error" $OUT/$f.log | cut -c1-200 | sort | head -4
done
