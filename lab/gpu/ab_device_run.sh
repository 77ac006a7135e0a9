#!/bin/bash
# A/B timing of two source trees on one device: builds the GPU benchmarks of tree A (a folder holding an exported
# commit, e.g. `git archive REV | tar -x -C .dev-base`) and of the current tree B, then runs each benchmark as
# A, B, A, B so that drift of the machine between runs shows next to the difference. Then bench_thd_helpers of B.
# Usage (repository root of B, $OUT set, CPGOLD_PREFIX naming header-only deps): ab_device_run.sh A_DIR [cp|thd|short]
# thd: only bench_thd_helpers, A, B, A, B (and test_gpu's helper cases of B first: a faster kernel must stay exact).
# short: the forward on short sequences: test_gpu's wgmma forward cases of B first, then bench_gpu_attention
# --divide 1, 8, 16 (whole sequences, then sequences of CP-chunk length) A, B, A, B, then bench_cp_local p2p W = 4
# --phases 1 A, B.
A_DIR=${1:?usage: ab_device_run.sh A_DIR [cp|thd|short]}
SUITE=${2:-cp}
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
build() {  # build SRC DIR NAME TARGETS...
  local src=$1 dir=$2 name=$3; shift 3
  local t0=$(date +%s)
  rm -rf $dir  # a warm machine keeps the last call's build, and a re-sent tree need not look newer to make
  cmake -S $src -B $dir -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} \
    > $OUT/configure_$name.log 2>&1 || { tail -20 $OUT/configure_$name.log; exit 1; }
  cmake --build $dir -j16 --target "$@" > $OUT/build_$name.log 2>&1 || { grep -E "error" $OUT/build_$name.log | head -20; exit 1; }
  echo "== build $name ok ($(( $(date +%s) - t0 )) s)"
}
if [ "$SUITE" = thd ]; then
  build $A_DIR /tmp/bA A bench_thd_helpers
  build . /tmp/bB B bench_thd_helpers test_gpu
  (cd /tmp/bB && timeout 300 ./bin/test_gpu -tc="thd helpers*" > $OUT/test_helpers_B.log 2>&1; echo "B: test_gpu -tc='thd helpers*' rc=$?")
  grep -E "test cases|assertions|ERROR" $OUT/test_helpers_B.log | head -20
  for round in ${AB_ROUNDS:-1 2}; do
    for side in A B; do
      echo "== round $round $side: bench_thd_helpers --reps 20"
      timeout 90 /tmp/b$side/bin/bench_thd_helpers --reps 20 > $OUT/thd_${side}_$round.log 2>&1
      grep -E "^\|" $OUT/thd_${side}_$round.log
    done
  done
  cd $OUT && tar -czf logs.tar.gz *.log && rm -f *.log
  exit 0
fi
if [ "$SUITE" = short ]; then
  build $A_DIR /tmp/bA A bench_gpu_attention bench_cp_local
  build . /tmp/bB B bench_gpu_attention bench_cp_local test_gpu
  (cd /tmp/bB && timeout 300 ./bin/test_gpu -tc="*wgmma forward*" > $OUT/test_forward_B.log 2>&1
   echo "B: test_gpu -tc='*wgmma forward*' rc=$?")
  grep -E "test cases|assertions|ERROR|DIFFER" $OUT/test_forward_B.log | head -20
  for round in ${AB_ROUNDS:-1 2}; do
    for D in 1 8 16; do
      for side in A B; do
        echo "== round $round $side: bench_gpu_attention --forward wgmma --divide $D --dims 128/128,64/64 --totals 65536"
        timeout 120 /tmp/b$side/bin/bench_gpu_attention --forward wgmma --divide $D --dims 128/128,64/64 \
          --totals 65536 --reps 20 > $OUT/attn_${side}_${D}_$round.log 2>&1
        grep -E "^(wgmma)" $OUT/attn_${side}_${D}_$round.log
      done
    done
  done
  for side in A B; do
    echo "== $side: bench_cp_local --comm p2p --cp-size 4 --tokens 32768 --heads 16 --dim 128 --reps 10 --phases 1"
    timeout 200 /tmp/b$side/bin/bench_cp_local --comm p2p --cp-size 4 --tokens 32768 --heads 16 --dim 128 --reps 10 \
      --phases 1 > $OUT/cp_${side}.log 2>&1
    grep -E "^\|" $OUT/cp_${side}.log
  done
  cd $OUT && tar -czf logs.tar.gz *.log && rm -f *.log
  exit 0
fi
build $A_DIR /tmp/bA A bench_gpu_attention bench_cp_local
build . /tmp/bB B bench_gpu_attention bench_cp_local bench_thd_helpers
CP="--tokens 32768 --heads 16 --dim 128"
for round in ${AB_ROUNDS:-1 2}; do
  for side in A B; do
    b=/tmp/b$side
    echo "== round $round $side: bench_gpu_attention --dims 128/128 --totals 32768 --reps 20"
    timeout 60 $b/bin/bench_gpu_attention --dims 128/128 --totals 32768 --reps 20 > $OUT/attn_${side}_$round.log 2>&1
    grep -E "^(impl|cpgold|mma.sync|wgmma)" $OUT/attn_${side}_$round.log
    echo "== round $round $side: bench_cp_local --comm p2p --cp-size 4 $CP --reps 10 --phases 1"
    timeout 240 $b/bin/bench_cp_local --comm p2p --cp-size 4 $CP --reps 10 --phases 1 > $OUT/cp_${side}_$round.log 2>&1
    grep -E "^\|" $OUT/cp_${side}_$round.log
  done
done
echo "== B: bench_thd_helpers --reps 20"
timeout 90 /tmp/bB/bin/bench_thd_helpers --reps 20 > $OUT/thd.log 2>&1
grep -E "^\|" $OUT/thd.log
cd $OUT && tar -czf logs.tar.gz *.log && rm -f *.log
