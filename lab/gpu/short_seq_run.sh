#!/bin/bash
# Rate on short attention blocks, cpgold against the kernels TransformerEngine's CP steps call (device, $OUT set):
# the same 16384 and 65536 tokens of the benchmark batch (bench/gpu/varlen_batches.md) in sequences of 512..4096
# (divide 1, whole sequences), 64..512 (divide 8: the chunk lengths of p2p W = 4 on that batch) and 32..256
# (divide 16: W = 8), each through bench_gpu_attention, PyTorch's varlen_attn (FlashAttention-2) and cuDNN SDPA
# (bench_torch.py; equal lengths 2048 / divide) and cuDNN's THD graph on the same varlen batch (bench_cudnn_thd.py).
# Needs the nvidia-cudnn-frontend wheel in .whl/ (carried) for the THD graph.
# Usage: OUT=... [DIVIDES="1 8 16"] [DIMS=128,64] [CPGOLD_PREFIX=...] bash lab/gpu/short_seq_run.sh
set -u
DIVIDES=${DIVIDES:-1 8 16}
DIMS=${DIMS:-128,64}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site
fi
B=/tmp/b
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} > $OUT/configure.log 2>&1 ||
  { tail -30 $OUT/configure.log; exit 1; }
cmake --build $B -j16 --target bench_gpu_attention > $OUT/build.log 2>&1 || { grep -E "error" $OUT/build.log | head; exit 1; }
CPDIMS=$(echo $DIMS | sed 's/\([0-9]*\)/\1\/\1/g')
for D in $DIVIDES; do
  echo "== divide $D"
  timeout 200 $B/bin/bench_gpu_attention --divide $D --forward wgmma --dims $CPDIMS --totals 16384,65536 2>&1 |
    tee $OUT/cpgold_$D.log
  PYTHONUNBUFFERED=1 timeout 200 python3 bench/gpu/bench_torch.py --divide $D --dims $DIMS --tokens 16384,65536 2>&1 |
    tee $OUT/torch_$D.log
  PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:python/examples timeout 200 python3 bench/gpu/bench_cudnn_thd.py \
    --divide $D --dims $DIMS --totals 16384,65536 2>&1 | tee $OUT/cudnn_thd_$D.log
done
