#!/bin/bash
# FlashAttention-3, FlashAttention-4 and TransformerEngine (FusedAttention, FA3, FA4 backends) checked against
# cpgold fixtures on a GPU machine (docs/outsiders.md): run from the repository root with $OUT set. Long phases run
# in the background (`bg PHASE...`) and `poll` reports them, so one call stays inside a call's time limit.
#   receive N  copy the transfer part(s) in $PARTS (a carried folder) to /tmp/outsiders/parts (call once per part)
#   install    cpgold's CLI built without CUDA (gen and check are all the checks need), the outsiders installed
#              from the parts (install.sh), the fixtures generated: quick, edge, te, golden (the committed set),
#              random (RANDOM_COUNT, seed RANDOM_SEED), te_shapes (TE's CP-test shapes), fills (quick's cases with pad
#              fill zero, nan and inf)
#   direct     FA3 and FA4 on every folder, default and deterministic backward (`python3 -m cpgold.outsiders`)
#   te         TE non-CP: backend fused, flash with FA3, flash with FA4 (deterministic with NVTE_ALLOW_...=0 too)
#   te_cp      TE CP on W thread ranks with the flash backend, FA3 and FA4 (fused: TE_CP_FUSED=1)
#   te_ranks   TE CP one process per GPU over NCCL (torchrun, `python3 -m cpgold.outsiders.ranks`, NCCL_NVLS_ENABLE=0):
#              W = 2 and 4 (RANKS_W) over quick, edge and te (fixtures of another cp_size are recorded as skipped),
#              first the harness's torch all-gather reference, then TE backend fused and flash (FA3; RANKS_FLASH="fa3
#              fa4" for both); summaries in $OUT/te_ranks/<tag>/ (docs/outsiders-nccl.md)
#   bench      FA3, FA4 and varlen_attn (bench_flash.py) and cuDNN's THD graph (bench_cudnn_thd.py) on the same
#              padded batches, d 64, 128, 192/128, 256
#   fa3-build  FlashAttention-3's wheel built from sources (fa3_sources.sh's tar in $PARTS): build_fa3.sh
#   waitfor    wait until the run named WAIT_TAG has finished
#   bg PHASE.. the phases one after another in the background; poll: their progress, results copied to $OUT
# Environment: RANDOM_COUNT (120), RANDOM_SEED (26), FOLDERS (which fixture folders a phase runs; default all),
# DIRECT_IMPLS (fa3 fa4), TE_BACKENDS (fused fa3 fa4), NONDETERMINISTIC=0 / DETERMINISTIC=0 (skip that backward).
set -u
PHASE=${1:?usage: device_run.sh receive|install|direct|te|te_cp|te_ranks|bench|fa3-build|bg PHASE...|poll}
W=/tmp/outsiders; B=$W/build; FX=$W/fx; R=$W/results; L=$W/logs
mkdir -p $W/parts $R $L
export CPGOLD_PYTHONPATH=$PWD/python:$PWD/python/examples PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
HERE=python/examples/outsiders
stamp() { echo "== $1 ($(date +%H:%M:%S))"; }
folders() { for d in $(ls -d $FX/*/ 2>/dev/null | sed 's:/$::'); do
  [ -z "${FOLDERS:-}" ] || [[ " $FOLDERS " == *" $(basename $d) "* ]] && echo $d; done; }
run() {  # run TAG ENV ADAPTER ARGS...: one adapter over the folders, summary and table kept in $R
  local tag=$1 env=$2; shift 2
  ( source $W/prefix/env.sh $env
    timeout ${RUN_TIMEOUT:-3000} python3 -m cpgold.outsiders "$@" --cpgold $B/bin/cpgold --summary $R/$tag.json \
      --table $R/$tag.md --title "$tag" $(folders) > $R/$tag.log 2>&1; echo "$tag rc=$?" >> $R/done.txt )
  tail -1 $R/$tag.log
}
case $PHASE in
receive)
  cp ${PARTS:-.parts}/* $W/parts/ && ls -la $W/parts | tail -n +2 | awk '{print $5, $9}' ;;
install)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  rm -rf $W/src && mkdir -p $W/src && cp -r . $W/src/   # a copy: the call's own tree may change under a build
  ( cmake -S $W/src -B $B -DCMAKE_BUILD_TYPE=Release -DCPGOLD_ENABLE_CUDA=OFF \
      ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$PWD/$CPGOLD_PREFIX} > $L/configure.log 2>&1 \
      && cmake --build $B -j$(nproc) --target cpgold > $L/build.log 2>&1; echo $? > $L/build.rc ) &
  bash $HERE/install.sh $W/parts $W/prefix 2>&1 | tail -8
  if ls ${WHL:-.whl}/*.whl > /dev/null 2>&1; then   # other wheels carried (the cuDNN frontend for the benchmark)
    python3 -m pip install -q --no-deps --no-index --no-compile --target $W/prefix/extra ${WHL:-.whl}/*.whl
  fi
  wait; [ "$(cat $L/build.rc)" = 0 ] || { tail -30 $L/configure.log $L/build.log; exit 1; }
  stamp "cpgold built"
  mkdir -p $FX/golden && cp fixtures/data/golden/*.h5 $FX/golden/
  for S in quick edge te; do $B/bin/cpgold gen --force --suite $S -o $FX/$S > $L/gen_$S.log 2>&1 || tail -3 $L/gen_$S.log; done
  $B/bin/cpgold gen --force --suite random --count ${RANDOM_COUNT:-120} --seed ${RANDOM_SEED:-26} -o $FX/random \
    > $L/gen_random.log 2>&1 || tail -3 $L/gen_random.log
  mkdir -p $FX/fills
  PYTHONPATH=$CPGOLD_PYTHONPATH python3 - $FX/quick > $W/fills.txt <<'PY'
import glob, json, os, sys, h5py
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.h5"))):
    with h5py.File(path, "r") as f:
        case = json.loads(f["case"].attrs["case_json"])
    for fill in ("zero", "nan", "inf"):
        if case.get("pad_fill") != fill:
            print(f"{os.path.basename(path)[:-3]}_{fill}", json.dumps(dict(case, pad_fill=fill)))
PY
  while read -r name json; do $B/bin/cpgold gen --force --case "$json" -o $FX/fills/$name.h5 > $L/gen_fill.log 2>&1 \
    || tail -2 $L/gen_fill.log; done < $W/fills.txt
  mkdir -p $FX/te_shapes
  python3 python/examples/te/te_test_cases.py | while read -r name json; do
    $B/bin/cpgold gen --force --case "$json" -o $FX/te_shapes/$name.h5 > $L/gen_shape.log 2>&1 || tail -2 $L/gen_shape.log
  done
  for d in $(folders); do echo "$(basename $d): $(ls $d/*.h5 | wc -l) fixtures"; done
  stamp "install done" ;;
direct)   # each fixture batch in a child process: a crash of the library loses only the fixture it was running
  for fa in ${DIRECT_IMPLS:-fa3 fa4}; do
    [ "${NONDETERMINISTIC:-1}" = 1 ] && run ${fa}_direct $fa $fa --isolate
    [ "${DETERMINISTIC:-1}" = 1 ] && run ${fa}_direct_det $fa $fa --deterministic --isolate
  done; stamp direct ;;
te)
  for be in ${TE_BACKENDS:-fused fa3 fa4}; do
    if [ $be = fused ]; then run te_fused none te --backend fused; continue; fi
    [ "${NONDETERMINISTIC:-1}" = 1 ] && run te_${be} $be te --backend flash
    [ "${DETERMINISTIC:-1}" = 1 ] && run te_${be}_det $be te --backend flash --deterministic
  done; stamp te ;;
te_cp)
  [ -n "${TE_CP_FUSED:-}" ] && run te_cp_fused none te_cp --backend fused --set timeout=30
  for fa in fa3 fa4; do run te_cp_${fa} $fa te_cp --backend flash --set timeout=30; done; stamp te_cp ;;
te_ranks)   # one process per GPU: the rank files, results.jsonl, summary.json and summary.md of each run
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  ranks() {  # ranks TAG ENV W ADAPTER ARGS...: the harness under torchrun on W GPUs over quick, edge and te
    local tag=$1 env=$2 w=$3; shift 3
    if [ "$w" -gt "$gpus" ]; then echo "$tag: W=$w needs $w GPUs, this machine has $gpus: not run"; return; fi
    rm -rf $R/ranks/$tag && mkdir -p $R/ranks/$tag $OUT/te_ranks/$tag
    ( source $W/prefix/env.sh $env
      export NCCL_NVLS_ENABLE=0
      timeout ${RUN_TIMEOUT:-3000} python3 -m torch.distributed.run --standalone --nproc-per-node $w \
        -m cpgold.outsiders.ranks "$@" $FX/quick $FX/edge $FX/te --out $R/ranks/$tag --cpgold $B/bin/cpgold \
        --timeout ${RANKS_TIMEOUT:-300} --title "$tag" > $R/ranks/$tag/run.log 2>&1
      echo "$tag rc=$?" >> $R/done.txt )
    cp $R/ranks/$tag/summary.* $R/ranks/$tag/results.jsonl $R/ranks/$tag/run.log $OUT/te_ranks/$tag/ 2>/dev/null
    grep "^== \|stopped at" $R/ranks/$tag/run.log | tail -2
  }
  for w in ${RANKS_W:-2 4}; do
    ranks torch_allgather_w$w none $w torch_allgather
    ranks te_ranks_fused_w$w none $w te_cp --backend fused
    for fa in ${RANKS_FLASH:-fa3}; do ranks te_ranks_${fa}_w$w $fa $w te_cp --backend flash; done
  done; stamp te_ranks ;;
bench)
  ( source $W/prefix/env.sh all
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
    timeout 900 python3 bench/gpu/bench_flash.py --pad-rows 63 --dims ${BENCH_DIMS:-64,128,192/128,256} 2>&1 \
      | grep -v -i warn > $R/bench_flash.log
    timeout 600 python3 bench/gpu/bench_cudnn_thd.py --pad-rows 63 --dims ${BENCH_DIMS:-64,128,192/128,256} 2>&1 \
      | grep -v -i warn > $R/bench_cudnn.log
    echo "bench rc=$?" >> $R/done.txt ); stamp bench ;;
fa3-build)
  nice -n 19 bash $HERE/build_fa3.sh $W/parts/fa3-src.tar.gz $W/fa3-wheel 2>&1 | tail -5; stamp fa3-build ;;
waitfor)  # until done.txt names WAIT_TAG (a run started earlier in the background)
  while ! grep -q "^${WAIT_TAG:?} rc=" $R/done.txt 2>/dev/null; do sleep 5; done ;;
bg)
  shift
  setsid nohup bash -c "for p in $*; do bash $0 \$p >> $L/bg.log 2>&1; done; echo 'bg done' >> $L/bg.log" \
    > /dev/null 2>&1 < /dev/null &
  echo "started in the background: $*" ;;
poll)
  tail -5 $L/bg.log 2>/dev/null; cat $R/done.txt 2>/dev/null
  for f in $(ls -t $R/*.log 2>/dev/null | head -1); do echo "-- $f: $(grep -c . $f) lines"; tail -3 $f | cut -c1-240; done
  (cd $R && tar -czf $OUT/results.tar.gz *.json *.md *.log 2>/dev/null); ls -la $OUT/results.tar.gz ;;
*) echo "device_run: unknown phase $PHASE"; exit 2 ;;
esac
