#!/bin/bash
# A/B timing of two source trees on one device: builds the GPU benchmarks of tree A (a folder holding an exported
# commit, e.g. `git archive REV | tar -x -C .dev-base`) and of the current tree B, then runs each benchmark as
# A, B, A, B so that drift of the machine between runs shows next to the difference. Then bench_thd_helpers of B.
# Usage (repository root of B, $OUT set, CPGOLD_PREFIX naming header-only deps): ab_device_run.sh A_DIR
A_DIR=${1:?usage: ab_device_run.sh A_DIR}
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
build() {  # build SRC DIR NAME TARGETS...
  local src=$1 dir=$2 name=$3; shift 3
  local t0=$(date +%s)
  cmake -S $src -B $dir -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} \
    > $OUT/configure_$name.log 2>&1 || { tail -20 $OUT/configure_$name.log; exit 1; }
  cmake --build $dir -j16 --target "$@" > $OUT/build_$name.log 2>&1 || { grep -E "error" $OUT/build_$name.log | head -20; exit 1; }
  echo "== build $name ok ($(( $(date +%s) - t0 )) s)"
}
build $A_DIR /tmp/bA A bench_gpu_attention bench_cp_local
build . /tmp/bB B bench_gpu_attention bench_cp_local bench_thd_helpers
CP="--tokens 32768 --heads 16 --dim 128"
for round in 1 2; do
  for side in A B; do
    b=/tmp/b$side
    echo "== round $round $side: bench_gpu_attention --dims 128/128 --reps 20"
    timeout 120 $b/bin/bench_gpu_attention --dims 128/128 --reps 20 2>&1 | grep -E "^\|" | tee $OUT/attn_${side}_$round.log
    echo "== round $round $side: bench_cp_local --comm p2p --cp-size 4 $CP --reps 10 --phases 1"
    timeout 120 $b/bin/bench_cp_local --comm p2p --cp-size 4 $CP --reps 10 --phases 1 2>&1 | tee $OUT/cp_${side}_$round.log | grep -E "^\|"
  done
done
for side in A B; do
  echo "== $side: bench_cp_local --comm a2a --cp-size 4 $CP --reps 5"
  timeout 120 /tmp/b$side/bin/bench_cp_local --comm a2a --cp-size 4 $CP --reps 5 2>&1 | grep -E "^\|"
done
for round in 1 2; do
  echo "== round $round B: bench_thd_helpers --reps 20"
  timeout 120 /tmp/bB/bin/bench_thd_helpers --reps 20 2>&1 | grep -E "^\||GB/s" | tee $OUT/thd_$round.log
done
cd $OUT && tar -czf logs.tar.gz *.log && rm -f *.log
