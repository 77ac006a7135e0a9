#!/bin/bash
# `verify --backend nccl` on random fixtures (`gen --suite random`, every comm type, dtype, mask, window, GQA, head
# dims and pad fill the generator draws): those with cp_size 2 on two GPUs and cp_size 4 on four, threads and mpirun,
# then `verify` (non-CP) and `verify --backend local` (W ranks on GPU 0) on the quick, edge and te suites (RANDOM_ONE_GPU=0
# leaves those two out). Called by
# nccl_device_run.sh (which builds, exports NCCL_NVLS_ENABLE=0 and sets B, C, OUT, MPIRUN and run()).
COUNT=${RANDOM_COUNT:-300}
$C gen --suite random --count $COUNT --seed 11 -o /tmp/fxr > $OUT/gen_random.log 2>&1 || tail -3 $OUT/gen_random.log
for s in quick edge te; do [ -d /tmp/fx/$s ] || $C gen --suite $s -o /tmp/fx/$s > $OUT/gen_$s.log 2>&1 || tail -3 $OUT/gen_$s.log; done
# pick W: the random fixtures with that cp_size
pick() {
  for f in /tmp/fxr/*.h5; do
    $C inspect --no-verify $f | grep -m1 '^case' | grep -q "\"cp_size\":$1," && echo $f
  done
}
R2=$(pick 2); R4=$(pick 4)
count_comms() { for f in "$@"; do $C inspect --no-verify $f | grep -m1 '^case' | grep -o '"comm":"[^"]*"'; done | sort | uniq -c | tr '\n' ' '; }
echo "== random fixtures: $COUNT; cp_size 2: $(echo $R2 | wc -w) ($(count_comms $R2)); cp_size 4: $(echo $R4 | wc -w) ($(count_comms $R4))"
run random_w2_threads 120 env CUDA_VISIBLE_DEVICES=0,1 $C verify --backend nccl --timeout 30 $R2
GPUS=$(nvidia-smi -L | wc -l)
W4_RUNS=""
if [ $GPUS -ge 4 ]; then
  run random_w4_threads 120 $C verify --backend nccl --timeout 30 $R4
  run random_w4_mpi 120 $MPIRUN -np 4 $C verify --backend nccl --timeout 30 $R4
  W4_RUNS="random_w4_threads random_w4_mpi"
else
  echo "== W=4 random runs not made: $GPUS GPUs visible"
fi
run random_w2_mpi 120 env CUDA_VISIBLE_DEVICES=0,1 $MPIRUN -np 2 $C verify --backend nccl --timeout 30 $R2
ONE_GPU_RUNS=""
if [ "${RANDOM_ONE_GPU:-1}" = 1 ]; then
  ALL="/tmp/fx/quick/*.h5 /tmp/fx/edge/*.h5 /tmp/fx/te/*.h5"
  run verify_noncp 150 env CUDA_VISIBLE_DEVICES=0 $C verify $ALL
  run verify_local 200 env CUDA_VISIBLE_DEVICES=0 $C verify --backend local $ALL
  ONE_GPU_RUNS="verify_noncp verify_local"
else
  echo "== one-GPU verify runs not made: RANDOM_ONE_GPU=${RANDOM_ONE_GPU}"
fi
for f in random_w2_threads random_w2_mpi $W4_RUNS $ONE_GPU_RUNS; do
  echo "-- $f"; grep -E "^verify:|^verdict: FAIL" $OUT/$f.log | head -6
  echo "   per-fixture verdicts: $(grep -c '^verdict: PASS' $OUT/$f.log) PASS, $(grep -c '^verdict: FAIL' $OUT/$f.log) FAIL;" \
    "unsupported reasons: $(grep -o 'unsupported: [a-z ]*[a-z_]*=\?[0-9a-z]*' $OUT/$f.log | sort | uniq -c | tr '\n' ' ')"
done
