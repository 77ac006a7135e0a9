#!/bin/bash
# Multi-GPU runs on the device: build, the NCCL test suite, coded-value exchanges and fault cases in every launch
# mode, then (when asked) `verify --backend nccl` on fixtures.
# Usage: nccl_device_run.sh [check] [verify] [w2] [random] [bench]
#   check, verify: W = 2 and W = 4 (a four-GPU machine); w2: the W = 2 part alone with deterministic reruns (a
#   two-GPU machine, lab/gpu/nccl_w2_run.sh); random: random fixtures at W = 2 and 4 plus the one-GPU verify
#   paths (lab/gpu/nccl_random_run.sh); bench: bench_cp_nccl over every visible GPU.
# Run from the repository root of a source snapshot; $OUT is where logs go; CPGOLD_PREFIX names header-only deps.
# NVLink multicast stays off in every process (README.md, "Several GPUs (NCCL)"): exported here and passed through
# mpirun with -x.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MODES="${*:-check}"
B=${B:-/tmp/b}
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
echo "== commit $(cat .commit 2>/dev/null)"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -8
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE=0 -x TORCH_SYMM_MEM_DISABLE_MULTICAST=1 -x NVSHMEM_DISABLE_NVLS=1"
which mpirun && mpirun --version | head -1
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} > $OUT/configure.log 2>&1 || { tail -30 $OUT/configure.log; exit 1; }
grep -E "CUDA  |NCCL  |MPI" $OUT/configure.log
TARGETS="cpgold test_nccl"
[[ " $MODES " == *" w2 "* ]] && TARGETS="$TARGETS test_gpu"
[[ " $MODES " == *" bench "* ]] && TARGETS="$TARGETS bench_cp_nccl"
cmake --build $B -j16 --target $TARGETS > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head -30; exit 1; }
echo "== build ok"
C=$B/bin/cpgold
# run NAME TIMEOUT CMD...: runs with a wall-clock guard, prints rc and seconds, keeps the log.
run() {
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s%N)
  timeout $limit "$@" > $OUT/$name.log 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf "== %-34s rc=%d %d.%03d s\n" "$name" $rc $((ms / 1000)) $((ms % 1000))
}
check_part() {
  # The test suite covers the threads launch: coded-value exchanges (W=2, W=4), a failing rank (exception, CUDA
  # error), a mismatched case, and the CP program over NCCL on small fixtures of every comm type.
  run test_nccl 150 $B/bin/test_nccl
  grep -E "SKIPPED|test cases|assertions|ERROR" $OUT/test_nccl.log | head -12
  run check_w2_mpi 45 env CUDA_VISIBLE_DEVICES=0,1 $MPIRUN -np 2 $C nccl-check
  run check_w4_mpi 45 $MPIRUN -np 4 $C nccl-check --a2a-size 2
  run check_w4_folder 45 lab/gpu/folder_ranks.sh 4 /tmp/rv4 $C nccl-check --a2a-size 2
  grep -h "VERDICT\|folder rank" $OUT/check_*.log
  # Faults in the process launches: every rank must exit non-zero naming the cause, well inside the 20 s timeout.
  run fault_cuda_mpi 45 $MPIRUN -np 4 $C nccl-check --inject-failure 2:cuda --timeout 20
  run mismatch_mpi 45 $MPIRUN -np 4 $C nccl-check --inject-mismatch 3 --timeout 20
  run fault_folder 45 env CUDA_VISIBLE_DEVICES=0,1 lab/gpu/folder_ranks.sh 2 /tmp/rvf $C nccl-check --inject-failure 0:exception --timeout 20
  for f in fault_cuda_mpi mismatch_mpi fault_folder; do
    echo "-- $f"; grep -E "^rank [0-9]+: error|^folder rank" $OUT/$f.log | cut -c1-200 | sort | head -6
  done
}
# Parts in the order asked (the first ones are kept when a guard stops the run).
for mode in $MODES; do
  case $mode in
    check) check_part ;;
    verify) source lab/gpu/nccl_verify_run.sh ;;
    w2) source lab/gpu/nccl_w2_run.sh ;;
    random) source lab/gpu/nccl_random_run.sh ;;
    bench)
      # The benchmarks' length cycle (512..4096 tokens), then long-context sequences (the cycle times 4).
      run bench_cp_nccl 240 $B/bin/bench_cp_nccl ${BENCH_ARGS:-}
      cat $OUT/bench_cp_nccl.log
      run bench_cp_nccl_long 240 $B/bin/bench_cp_nccl --seq-scale 4 ${BENCH_ARGS:-}
      cat $OUT/bench_cp_nccl_long.log ;;
  esac
  (cd $OUT && tar -czf logs.tar.gz *.log $(ls *.digests 2>/dev/null))
done
cd $OUT && rm -f *.log *.digests
