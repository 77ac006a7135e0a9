#!/bin/bash
# The GPU record of lab/records/capture.md: te_gpt_step.py (a small GPT of TransformerEngine TransformerLayers) runs three
# training steps per backend (FusedAttention, FlashAttention-3, FlashAttention-4) at W = 1, W = 2 over NCCL (torchrun,
# two GPUs) and W = 4 thread ranks on one GPU, clean and with NaN on the pad rows of q, k, v; step 1 is captured
# (step 2 is not: the step times give the capture's overhead). Every capture folder is packed into $OUT, one tar per
# backend, for `python3 -m cpgold.capture check` on any machine (no GPU needed).
# Needs TransformerEngine, FlashAttention-3 and -4 installed by lab/outsiders/device_run.sh (receive per
# part, then outsiders): /tmp/outsiders/prefix/env.sh.
# Usage (repository root, $OUT set): lab/capture/device_run.sh [BACKENDS]   (default: fused fa3 fa4)
set -u
E=/tmp/outsiders/prefix/env.sh; C=/tmp/capture
[ -f $E ] || { echo "capture: $E missing: install the outsiders first (outsiders/device_run.sh outsiders)"; exit 2; }
rm -rf $C && mkdir -p $C/logs
export CPGOLD_PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
ARGS="--layers 2 --hidden 256 --heads 4 --gqa-groups 2 --ffn 512 --seqlens 60,23,150,9 --steps 3 --capture-steps 1 --no-check"
one() {  # one TAG ENV BACKEND GPUS MODE [ARGS...]: one run, its log in $C/logs
  local tag=$1 env=$2 backend=$3 gpus=$4 mode=$5; shift 5
  ( source $E $env
    export CUDA_VISIBLE_DEVICES=$gpus NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2
    local t0=$(date +%s)
    case $mode in
      w1) timeout 400 python3 python/examples/capture/te_gpt_step.py --backend $backend --out $C/$tag $ARGS "$@" ;;
      w2) timeout 400 torchrun --nproc-per-node 2 --master-port $((29500 + RANDOM % 1000)) \
            python/examples/capture/te_gpt_step.py --backend $backend --out $C/$tag $ARGS "$@" ;;
      t4) timeout 400 python3 python/examples/capture/te_gpt_step.py --thread-ranks 4 --backend $backend \
            --out $C/$tag $ARGS "$@" ;;
    esac > $C/logs/$tag.log 2>&1
    local rc=$?
    echo "$tag rc=$rc $(( $(date +%s) - t0 )) s" >> $C/done.txt )
}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
for b in ${1:-fused fa3 fa4}; do
  backend=flash env=$b; [ $b = fused ] && { backend=fused; env=none; }
  one ${b}_w1 $env $backend 0 w1 & one ${b}_t4 $env $backend 1 t4 & wait
  one ${b}_w1_nanpads $env $backend 0 w1 --poison-pads & one ${b}_t4_nanpads $env $backend 1 t4 --poison-pads & wait
  one ${b}_w2 $env $backend 0,1 w2
  one ${b}_w2_nanpads $env $backend 0,1 w2 --poison-pads
  tar -czf $OUT/capture_$b.tgz -C $C $(cd $C && ls -d ${b}_* 2>/dev/null) logs
done
cat $C/done.txt
( source $E fa3; python3 -c "import torch, transformer_engine as te; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'te', te.__version__)" ) 2>&1 | tail -1
for f in $C/logs/*.log; do echo "== $(basename $f)"; grep -E "te_gpt_step|Selected backend|Error|error" $f | head -8; done
ls -la $OUT
