#!/bin/bash
# The GPU engine on a device machine (docs/scale.md): its agreement tests against the CPU reference, then
# `gen --engine gpu` of the 128k-token x 32-head case with its time split, memory and file size.
# Usage (repository root, $OUT set): bench/gpu_engine/device_run.sh [DEV]
#   DEV: a folder with cpgold-engine and test_gpu_engine (built from bench/gpu_engine/ and tests/gpu_engine/ where the
#   CUDA toolkit is) and lib/ with the shared libraries the device image lacks (HDF5 and its dependencies, libgomp).
# Environment: TEST_LIMIT, GEN_LIMIT (seconds, defaults 90 and 230), WORK (large files, default /tmp/gpu-engine),
# CASE (the case flags).
set -u
DEV=${1:-.dev}
OUT=${OUT:-bench-out/gpu_engine}
WORK=${WORK:-/tmp/gpu-engine}
mkdir -p "$OUT" "$WORK"
cublas=$(python3 -c "import os, nvidia.cublas as m; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=$PWD/$DEV/lib:/usr/local/cuda/lib64${cublas:+:$cublas}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
echo "cores $(nproc); $(free -g | awk '/Mem:/ {print $2 " GiB memory"}'); disk $(df -h "$WORK" | awk 'NR==2 {print $4 " free"}')"
ldd "$DEV/cpgold-engine" | grep -E "not found|cublas|cudart" | sed 's/^\s*/  /'
t0=$(date +%s)
timeout "${TEST_LIMIT:-90}" "$DEV/test_gpu_engine" > "$OUT/test_gpu_engine.log" 2>&1
echo "test_gpu_engine rc=$? ($(( $(date +%s) - t0 )) s)"
grep -E "^agreement|^engine versions|test cases|assertions|ERROR|SKIPPED" "$OUT/test_gpu_engine.log" | head -40
CASE=${CASE:---seqlens-q 131072 --heads-q 32 --heads-kv 8 --dim-qk 128 --dtype bf16 --mask causal --cp-size 8 --comm p2p}
t1=$(date +%s)
TIME=""; [ -x /usr/bin/time ] && TIME="/usr/bin/time -v -o $OUT/gen.time"
$TIME timeout "${GEN_LIMIT:-230}" "$DEV/cpgold-engine" gen $CASE --engine gpu --yes --force -o "$WORK/case128k.h5" \
  > "$OUT/gen.log" 2>&1
echo "gen rc=$? ($(( $(date +%s) - t1 )) s): $CASE --engine gpu"
grep -vE "computed after|written after" "$OUT/gen.log" | head -20
grep -E "computed after|written after" "$OUT/gen.log" | tail -3
[ -f "$OUT/gen.time" ] && grep -E "Maximum resident|Elapsed|Percent of CPU" "$OUT/gen.time"
ls -la "$WORK"/case128k.h5 2>/dev/null
# The disk's write rate beside the write phase.
dd if=/dev/zero of="$WORK/dd.bin" bs=16M count=128 conv=fdatasync 2>&1 | tail -1
rm -f "$WORK/dd.bin"
