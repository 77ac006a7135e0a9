#!/bin/bash
# The GPU engine at scale on a 2-GPU device machine (docs/scale.md), in phases of under 10 minutes each:
#   tests    test_gpu_engine's suites te and random and its rerun test (golden, quick and edge: device_run.sh)
#   shards   the 128k-token x 32-head case as two shards, one per GPU at once (16 cores each), then `merge`
#   check    bench_check of the merged fixture on 16 cores: a candidate of every global and per-rank output, the
#            check's phases (open, read, compare) and GB/s of candidate data
#   million  the 1M-token x 8-head case: shards 1/8 and 2/8 at once, one per GPU (16 cores each)
#   whole    the 128k case unsharded on one GPU (16 cores), then compared with the merged fixture bit for bit
# Usage (repository root, $OUT set): bench/gpu_engine/scale_run.sh DEV PHASE...
#   DEV: a folder with cpgold-engine, test_gpu_engine, bench_check and lib/ (bench/gpu_engine/device_run.sh says how).
# Environment: WORK (large files, default /tmp/gpu-scale), TEST_LIMIT (seconds, default 330).
set -u
DEV=$1
shift
OUT=${OUT:-bench-out/gpu_scale}
WORK=${WORK:-/tmp/gpu-scale}
mkdir -p "$OUT" "$WORK"
cublas=$(python3 -c "import os, nvidia.cublas as m; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$PWD/$DEV/lib:/usr/local/cuda/lib64${cublas:+:$cublas}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
CASE128='--seqlens-q 131072 --heads-q 32 --heads-kv 8 --dim-qk 128 --dtype bf16 --mask causal --cp-size 8 --comm p2p'
CASE1M='--seqlens-q 1048576 --heads-q 8 --heads-kv 8 --dim-qk 128 --dtype bf16 --mask causal --cp-size 8 --comm p2p'
TIME=""; [ -x /usr/bin/time ] && TIME="/usr/bin/time -v"

# gen on GPU $1 with cores $2, the rest its arguments; /usr/bin/time's report in $OUT/$3.time
gen_on() {
  local gpu=$1 cores=$2 name=$3
  shift 3
  CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=16 taskset -c "$cores" ${TIME:+$TIME -o $OUT/$name.time} \
    "$DEV/cpgold-engine" gen "$@" --engine gpu --yes --force > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
}
summary() {  # the lines of a gen log and its time report that the record keeps
  grep -vE "computed after|written after" "$OUT/$1.log" | head -12
  [ -f "$OUT/$1.time" ] && grep -E "Maximum resident|Elapsed|Percent of CPU" "$OUT/$1.time"
}

for phase in "$@"; do
  t0=$(date +%s)
  echo "== $phase ($(date -u +%H:%M:%S))"
  case $phase in
    info)
      nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
      echo "cores $(nproc); $(free -g | awk '/Mem:/ {print $2 " GiB memory"}'); $(df -h "$WORK" | awk 'NR==2 {print $4 " free in WORK"}')"
      lscpu | grep -E "Model name|^CPU\(s\)|NUMA node[0-9]" ;;
    tests)
      OMP_NUM_THREADS=$(nproc) timeout "${TEST_LIMIT:-330}" "$DEV/test_gpu_engine" \
        -tc="*suite te*,*random sweep*,*same bits*" > "$OUT/test_gpu_engine.log" 2>&1
      echo "test_gpu_engine rc=$?"
      grep -E "^agreement|^engine versions|test cases|assertions|ERROR|SKIPPED|CHECK" "$OUT/test_gpu_engine.log" | head -40 ;;
    shards)
      rm -f "$WORK"/p128_*.h5 "$WORK"/merged128.h5
      gen_on 0 0-15 shard128_1 $CASE128 --shard 1/2 -o "$WORK/p128_1.h5" &
      gen_on 1 16-31 shard128_2 $CASE128 --shard 2/2 -o "$WORK/p128_2.h5" &
      wait
      echo "both shards: $(( $(date +%s) - t0 )) s"
      for s in shard128_1 shard128_2; do summary $s; done
      t1=$(date +%s)
      OMP_NUM_THREADS=32 ${TIME:+$TIME -o $OUT/merge128.time} "$DEV/cpgold-engine" merge "$WORK/p128_1.h5" \
        "$WORK/p128_2.h5" -o "$WORK/merged128.h5" > "$OUT/merge128.log" 2>&1
      echo "merge rc=$? ($(( $(date +%s) - t1 )) s)"
      tail -5 "$OUT/merge128.log"
      grep -E "Maximum resident|Elapsed" "$OUT/merge128.time" 2>/dev/null
      ls -la "$WORK"/p128_*.h5 "$WORK/merged128.h5" ;;
    check)
      OMP_NUM_THREADS=16 taskset -c 0-15 "$DEV/bench_check" "$WORK/merged128.h5" "$WORK/cand128.h5" --reps 2 \
        > "$OUT/check128.log" 2>&1
      echo "bench_check rc=$?"
      cat "$OUT/check128.log"
      rm -f "$WORK/cand128.h5" ;;
    million)
      rm -f "$WORK"/p1m_*.h5
      gen_on 0 0-15 shard1m_1 $CASE1M --shard 1/8 -o "$WORK/p1m_1.h5" &
      gen_on 1 16-31 shard1m_2 $CASE1M --shard 2/8 -o "$WORK/p1m_2.h5" &
      wait
      echo "both shards: $(( $(date +%s) - t0 )) s"
      for s in shard1m_1 shard1m_2; do summary $s; done
      ls -la "$WORK"/p1m_*.h5 ;;
    whole)
      gen_on 0 0-15 whole128 $CASE128 -o "$WORK/whole128.h5"
      summary whole128
      "$DEV/cpgold-engine" check --identical "$WORK/whole128.h5" "$WORK/merged128.h5" > "$OUT/identical.log" 2>&1
      echo "check --identical whole vs merged rc=$?"
      tail -3 "$OUT/identical.log"
      cmp "$WORK/whole128.h5" "$WORK/merged128.h5" && echo "cmp: the files are identical byte for byte" ;;
    dd)
      dd if=/dev/zero of="$WORK/dd.bin" bs=16M count=128 conv=fdatasync 2>&1 | tail -1
      rm -f "$WORK/dd.bin" ;;
    *) echo "unknown phase $phase" ;;
  esac
  echo "== $phase done in $(( $(date +%s) - t0 )) s"
done
