#!/bin/bash
# The backward's device run: the schedules of the wgmma dK/dV pass in bench/hopper_backward.sh (checks and timing,
# d 128 and 64), then the project build, test_gpu's backward cases, the backward through attention_backward
# (bench_gpu_attention) and PyTorch's varlen_attn / cuDNN in the same run (bench/gpu/bench_torch.py).
# Usage (repository root, $OUT a folder): bash lab/gpu/backward_run.sh [prefix path of header-only deps]
# Logs: $OUT/hopper.log, build.log, test_gpu.log, bench.log, torch.log (at most 6 files).
set -u
PREFIX=${1:-}
B=/tmp/b
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# The project build runs beside the hopper program (CPU only); the program's timings are device events.
(cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${PREFIX:+-DCMAKE_PREFIX_PATH=$PREFIX} > $OUT/build.log 2>&1 &&
   cmake --build $B -j12 --target test_gpu bench_gpu_attention >> $OUT/build.log 2>&1; echo "build rc=$?" >> $OUT/build.log) &
build=$!
OUT=/tmp/hopper_out HOPPER_BACKWARD_BUDGET=240 bash bench/hopper_backward.sh ${HOPPER_ARGS:-} > $OUT/hopper.log 2>&1
echo "hopper_backward rc=$?"; grep -E "passed|failed|FAIL" $OUT/hopper.log | tail -5
cat /tmp/hopper_out/resources.txt 2>/dev/null | grep dkdv | sed -e 's/cpgold::gpu:://g' -e 's/__nv_bfloat16/bf16/g' | cut -c1-160 >> $OUT/hopper.log
wait $build; tail -1 $OUT/build.log
[ -x $B/bin/test_gpu ] || { grep -E "error" $OUT/build.log | head -20; exit 1; }
(cd $B && timeout 300 ./bin/test_gpu -tc="*backward*,*workspace*" > $OUT/test_gpu.log 2>&1; echo "test_gpu rc=$?")
grep -E "test cases|assertions|VERDICT workspace" $OUT/test_gpu.log
timeout 300 $B/bin/bench_gpu_attention --backward ${BENCH_BACKWARD:-wgmma} --dims ${BENCH_DIMS:-128/128,64/64} > $OUT/bench.log 2>&1
echo "bench rc=$?"
timeout 300 python3 bench/gpu/bench_torch.py --dims ${TORCH_DIMS:-128,64} --tokens 16384,65536 > $OUT/torch.log 2>&1
echo "torch rc=$?"
