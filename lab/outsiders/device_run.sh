#!/bin/bash
# FlashAttention-3, FlashAttention-4 and TransformerEngine (FusedAttention, FA3, FA4 backends) checked against
# cpgold fixtures on a GPU machine (docs/outsiders.md): run from the repository root with $OUT set. Long phases run
# in the background (`bg PHASE...`) and `poll` reports them, so one call stays inside a call's time limit.
#   receive N  copy the transfer part(s) in $PARTS (a carried folder) to /tmp/outsiders/parts (call once per part)
#   install    prep and outsiders (below): cpgold's CLI built without CUDA (gen and check are all the checks
#              need), the fixtures generated: quick, edge, te, golden (the committed set), random (RANDOM_COUNT, seed
#              RANDOM_SEED), te_shapes (TE's CP-test shapes), fills (quick's cases with pad fill zero, nan and inf);
#              the outsiders installed from the parts (install.sh)
#   direct     FA3 and FA4 on every folder, default and deterministic backward (`python3 -m cpgold.outsiders`)
#   te         TE non-CP: backend fused, flash with FA3, flash with FA4 (deterministic with NVTE_ALLOW_...=0 too)
#   te_cp      TE CP on W thread ranks with the flash backend, FA3 and FA4 (fused: TE_CP_FUSED=1)
#   te_ranks   TE CP one process per GPU over NCCL (torchrun, `python3 -m cpgold.outsiders.ranks`, NCCL_NVLS_ENABLE=0):
#              W = 2 and 4 (RANKS_W) over the folders (fixtures of another cp_size are recorded as skipped),
#              first the harness's torch all-gather reference, then TE backend fused and flash (FA3; RANKS_FLASH="fa3
#              fa4" for both); summaries in $OUT/te_ranks/<tag>/ (docs/outsiders-nccl.md)
#   bench      FA3, FA4 and varlen_attn (bench_flash.py) and cuDNN's THD graph (bench_cudnn_thd.py) on the same
#              padded batches, d 64, 128, 192/128, 256
#   fa3-build  FlashAttention-3's wheel built from sources (fa3_sources.sh's tar in $PARTS): build_fa3.sh
#   waitfor    wait until the run named WAIT_TAG has finished
#   prep       the CLI (built, or CPGOLD_CLI: a CPU build carried), the fixtures, cpgold's CUDA targets CUDA_TARGETS
#              (background) and FA3 from FA3_SOURCES (background; default .p0/fa3-src.tar.gz): no parts needed, so it
#              runs while they arrive
#   outsiders  the outsiders installed from the parts (install.sh); install = prep + outsiders
#   ranks      one harness run (RANKS_TAG, RANKS_ENV, RANKS_WORLD, RANKS_GPUS; the adapter's arguments follow),
#              restarted with --resume after a failing rank stopped it; RANKS_RESUME=1 goes on from earlier results
#              (on a fresh machine from RANKS_SEED/<tag>/results.jsonl, default .ranks-seed, a carried folder)
#   te_bench   TE's CP speed (bench_te_cp.py) per W, backend and --seq-scale, then cpgold's bench_cp_nccl
#   shrink     cpgold shrink with TE's CP on thread ranks as COMMAND from failing fixtures (SHRINK_START)
#   fa3-check  the FA3 wheel built by prep installed apart and run over quick, edge and golden
#   fa4-repro  FA-3 (TE's causal window (-1, 0) in FlashAttention-4) with torch and flash-attn-4 alone
#   d256       TE finding 5 (FusedAttention at head dim 256) with torch and TE alone (te_repro_d256.py)
#   sweeps     the one-GPU sweeps earlier machines left (FA4 on thread ranks beyond quick and edge, the deterministic
#              backward of TE CP, TE non-CP and FA3/FA4 directly where it had not run, FA4 at W = 3 over NCCL), a dozen
#              runs side by side on every GPU until SWEEPS_DEADLINE seconds
#   det_threads TE CP on thread ranks with FA4's deterministic backward over te_shapes, random and fills, in parts
#              side by side, and the fixtures N5's harness lost
#   multi      a 4-GPU machine's run: every harness run (W = 2 on GPU pairs, W = 4), TE CP on thread ranks, shrink,
#              fa3-check and the deterministic FA3/FA4 sweeps side by side until MULTI_DEADLINE seconds, then
#              te_bench alone
#   bg PHASE.. the phases one after another in the background, run from a copy of the tree; poll: their progress,
#              results copied to $OUT
# Environment: RANDOM_COUNT (120), RANDOM_SEED (26), FOLDERS (which fixture folders a phase runs; default all),
# RUN_RESUME=1 (a run goes on from the fixtures its stopped predecessor recorded: --resume),
# SPLIT=I/N (a run takes every N-th fixture of its folders from the I-th), DIRECT_IMPLS (fa3 fa4), TE_BACKENDS
# (fused fa3 fa4), NONDETERMINISTIC=0 / DETERMINISTIC=0 (skip that backward).
set -u
PHASE=${1:?usage: device_run.sh receive|install|direct|te|te_cp|te_ranks|bench|fa3-build|bg PHASE...|poll}
W=/tmp/outsiders; B=$W/build; FX=$W/fx; R=$W/results; L=$W/logs
mkdir -p $W/parts $R $L
export CPGOLD_PYTHONPATH=$PWD/python:$PWD/python/examples PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
  LD_LIBRARY_PATH=$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}   # the libraries of a carried CLI (prep, CPGOLD_CLI)
HERE=lab/outsiders
stamp() { echo "== $1 ($(date +%H:%M:%S))"; }
gpu_count() { nvidia-smi --query-gpu=name --format=csv,noheader | wc -l; }
folders() { for d in $(ls -d $FX/*/ 2>/dev/null | sed 's:/$::'); do
  [ -z "${FOLDERS:-}" ] || [[ " $FOLDERS " == *" $(basename $d) "* ]] && echo $d; done; }
fixture_args() {  # the folders; with SPLIT=I/N only every N-th of their fixtures from the I-th (0-based), so N runs
                 # side by side share a folder
  if [ -z "${SPLIT:-}" ]; then folders; return; fi
  for d in $(folders); do ls $d/*.h5; done | awk -v i=${SPLIT%/*} -v n=${SPLIT#*/} '(NR - 1) % n == i'
}
job() { local name=$1; shift; ( "$@" > $L/job_$name.log 2>&1; echo "job $name rc=$?" >> $R/done.txt ) & }
seq2() {  # TAG|COMMAND items one after another; stops at the deadline; MULTI_SKIP: tags left out
  for x in "$@"; do [ -f $W/stop_multi ] || [[ " ${MULTI_SKIP:-} " == *" ${x%%|*} "* ]] || eval "${x#*|}" || true; done; }
jobs_until() {  # jobs_until DEADLINE: wait for the jobs; at the deadline (epoch seconds) stop what still runs
  while [ $(date +%s) -lt $1 ] && [ -n "$(jobs -rp)" ]; do sleep 5; done
  if [ -n "$(jobs -rp)" ]; then
    echo "deadline reached; stopping: $(jobs -r | tr '\n' ' ')"
    touch $W/stop_multi
    pkill -TERM -f "cpgold.outsiders" ; pkill -TERM -f "cpgold shrink"; sleep 5
    pkill -KILL -f "cpgold.outsiders" ; pkill -KILL -f "cpgold shrink"; wait
  fi
}
threads() {  # threads ENV [ARGS...]: TE CP on thread ranks, flash backend with ENV's FlashAttention, tag
             # te_cp_ENV_threads (FOLDERS, SPLIT and RUN_SUFFIX as set; the timeout leaves room for FA4's compiles)
  local env=$1; shift; run te_cp_${env}_threads $env te_cp --backend flash --set timeout=120 "$@"; }
run() {  # run TAG ENV ADAPTER ARGS...: one adapter over the folders, summary and table kept in $R
  local tag=$1${RUN_SUFFIX:-} env=$2; shift 2
  [ -n "${RUN_RESUME:-}" ] || : > $R/$tag.log   # a resumed run's log goes on after the stopped one's
  ( source $W/prefix/env.sh $env
    timeout ${RUN_TIMEOUT:-3000} python3 -m cpgold.outsiders "$@" --cpgold $B/bin/cpgold --summary $R/$tag.json \
      --table $R/$tag.md --title "$tag" ${RUN_RESUME:+--resume} $(fixture_args) >> $R/$tag.log 2>&1
    echo "$tag rc=$?" >> $R/done.txt )
  tail -1 $R/$tag.log
}
make_fixtures() {  # quick, edge, te, golden, random, fills, te_shapes (see the header)
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
  python3 lab/te/te_test_cases.py | while read -r name json; do
    $B/bin/cpgold gen --force --case "$json" -o $FX/te_shapes/$name.h5 > $L/gen_shape.log 2>&1 || tail -2 $L/gen_shape.log
  done
  for d in $(folders); do echo "$(basename $d): $(ls $d/*.h5 | wc -l) fixtures"; done
}
ranks() {  # ranks TAG ENV W ADAPTER ARGS...: the harness under torchrun on W GPUs (RANKS_GPUS) over the folders,
           # restarted with --resume after a run a failing rank stopped or an abort ended (a device-side assert), so
           # every fixture runs (RANKS_ATTEMPTS runs at most)
  local tag=$1 env=$2 w=$3; shift 3
  local gpus=$(gpu_count)
  if [ "$w" -gt "$gpus" ]; then echo "$tag: W=$w needs $w GPUs, this machine has $gpus: not run"; return; fi
  local resume= attempt
  if [ -n "${RANKS_RESUME:-}" ]; then resume=--resume; else rm -rf $R/ranks/$tag; fi   # RANKS_RESUME: go on
  mkdir -p $R/ranks/$tag $OUT/te_ranks/$tag
  # RANKS_RESUME on a fresh machine: the results of earlier machines (a carried folder RANKS_SEED, default
  # .ranks-seed/<tag>/results.jsonl) are what it goes on from
  local seed=${RANKS_SEED:-.ranks-seed}/$tag/results.jsonl
  if [ -n "$resume" ] && [ ! -s $R/ranks/$tag/results.jsonl ] && [ -f $seed ]; then
    cp $seed $R/ranks/$tag/results.jsonl; echo "$tag: going on from $seed ($(wc -l < $seed) fixtures recorded)"
  fi
  for attempt in $(seq 1 ${RANKS_ATTEMPTS:-20}); do
    ( source $W/prefix/env.sh $env
      export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${RANKS_GPUS:-$(seq -s, 0 $((w - 1)))}
      timeout ${RUN_TIMEOUT:-3000} python3 -m torch.distributed.run --standalone --nproc-per-node $w \
        -m cpgold.outsiders.ranks "$@" $(folders) --out $R/ranks/$tag --cpgold $B/bin/cpgold $resume \
        --timeout ${RANKS_TIMEOUT:-300} --diagnosis-budget ${RANKS_DIAGNOSIS:-5} --title "$tag" \
        >> $R/ranks/$tag/run.log 2>&1
      echo "$tag rc=$? (attempt $attempt)" >> $R/done.txt )
    # again after a run a failing rank stopped, or one that died inside a fixture (DIR/current left behind)
    [ -f $R/ranks/$tag/.ranks/stopped ] || [ -f $R/ranks/$tag/current ] || break
    [ ! -f $W/stop_multi ] || break
    resume=--resume
  done
  cp $R/ranks/$tag/summary.* $R/ranks/$tag/results.jsonl $R/ranks/$tag/run.log $OUT/te_ranks/$tag/ 2>/dev/null
  grep "^== \|stopped at" $R/ranks/$tag/run.log | tail -3
}
case $PHASE in
receive)
  cp ${PARTS:-.parts}/* $W/parts/ && ls -la $W/parts | tail -n +2 | awk '{print $5, $9}' ;;
prep)      # no parts needed: the CLI, cpgold's CUDA benchmark (CUDA_TARGETS), the fixtures, FA3 from sources
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -6
  rm -rf $W/src && mkdir -p $W/src && cp -r . $W/src/   # a copy: the call's own tree may change under a build
  if [ -n "${CUDA_TARGETS:-}" ]; then   # cpgold's own CP over NCCL for te_bench (a CUDA build, in the background)
    ( for try in 1 2; do rm -rf $W/cbuild; cmake -S $W/src -B $W/cbuild -DCMAKE_BUILD_TYPE=Release \
        ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$W/src/$CPGOLD_PREFIX} > $L/cconfigure.log 2>&1 && break; sleep 20; done \
        && nice -n 5 cmake --build $W/cbuild -j$(( $(nproc) / 2 )) --target $CUDA_TARGETS > $L/cbuild.log 2>&1
      echo $? > $L/cbuild.rc ) &
  fi
  if [ -f ${FA3_SOURCES:-.p0/fa3-src.tar.gz} ]; then   # FlashAttention-3 built from sources (build_fa3.sh), niced
    cp ${FA3_SOURCES:-.p0/fa3-src.tar.gz} $W/fa3-src.tar.gz
    ( nice -n 19 bash $HERE/build_fa3.sh $W/fa3-src.tar.gz $W/fa3-wheel > $L/fa3-build.log 2>&1
      echo $? > $L/fa3-build.rc ) &
  fi
  if [ -n "${CPGOLD_CLI:-}" ]; then   # a CLI built elsewhere (CPU only), with the libraries of a lib/ beside it
    mkdir -p $B/bin $B/lib && cp $CPGOLD_CLI $B/bin/cpgold && cp -r $(dirname $CPGOLD_CLI)/lib/. $B/lib/ 2>/dev/null
    $B/bin/cpgold --version || { echo "prep: CPGOLD_CLI=$CPGOLD_CLI does not run here"; exit 1; }
  else
    ( cmake -S $W/src -B $B -DCMAKE_BUILD_TYPE=Release -DCPGOLD_ENABLE_CUDA=OFF \
        ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$W/src/$CPGOLD_PREFIX} > $L/configure.log 2>&1 \
        && cmake --build $B -j$(nproc) --target cpgold > $L/build.log 2>&1; echo $? > $L/build.rc )
    [ "$(cat $L/build.rc)" = 0 ] || { tail -30 $L/configure.log $L/build.log; exit 1; }
  fi
  stamp "cpgold built"
  make_fixtures
  touch $W/prep.done
  stamp "prep done (the CUDA build and FA3's build go on in the background)" ;;
outsiders) # the outsiders from the parts (install.sh)
  bash $HERE/install.sh $W/parts $W/prefix 2>&1 | tail -8
  if ls ${WHL:-.whl}/*.whl > /dev/null 2>&1; then   # other wheels carried (the cuDNN frontend for the benchmark)
    python3 -m pip install -q --no-deps --no-index --no-compile --target $W/prefix/extra ${WHL:-.whl}/*.whl
  fi
  stamp "outsiders installed" ;;
install)   # prep and outsiders in one
  bash $0 prep && bash $0 outsiders ;;
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
te_ranks)   # one process per GPU: the rank files, results.jsonl and summaries (JSON, markdown) of each run
  for w in ${RANKS_W:-2 4}; do
    ranks torch_allgather_w$w none $w torch_allgather
    ranks te_ranks_fused_w$w none $w te_cp --backend fused
    for fa in ${RANKS_FLASH:-fa3}; do ranks te_ranks_${fa}_w$w $fa $w te_cp --backend flash; done
  done; stamp te_ranks ;;
ranks)      # one run of the harness: RANKS_TAG RANKS_ENV RANKS_WORLD, then the adapter's arguments (multi uses it)
  shift; ranks $RANKS_TAG $RANKS_ENV $RANKS_WORLD "$@" ;;
te_bench)   # TE's CP speed (bench/gpu/bench_te_cp.py) per W and backend, then cpgold's bench_cp_nccl, alone
  gpus=$(gpu_count)
  mkdir -p $R/bench $OUT/bench
  for w in ${BENCH_W:-2 4}; do
    [ "$w" -gt "$gpus" ] && { echo "te_bench: W=$w needs $w GPUs"; continue; }
    comms=p2p,a2a,all_gather; [ "$w" -ge 4 ] && comms=$comms,a2a+p2p
    for be in ${BENCH_BACKENDS:-fused fa3}; do
      tag=te_${be}_w${w}
      ( source $W/prefix/env.sh $([ $be = fused ] && echo none || echo $be)
        export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((w - 1)))
        timeout ${BENCH_TIMEOUT:-300} python3 -m torch.distributed.run --standalone --nproc-per-node $w \
          bench/gpu/bench_te_cp.py --backend $([ $be = fused ] && echo fused || echo flash) --comms $comms \
          --seq-scale ${BENCH_SCALES:-1,4} --reps ${BENCH_REPS:-10} --json $R/bench/$tag.json > $R/bench/$tag.log 2>&1
        echo "$tag rc=$?" >> $R/done.txt )
      grep "^scale\|^bench_te_cp: [0-9]\|Error" $R/bench/$tag.log | cut -c1-300 | tail -30
    done
  done
  if [ -x $W/cbuild/bin/bench_cp_nccl ]; then
    for scale in $(echo ${BENCH_SCALES:-1,4} | tr , ' '); do
      timeout 400 $W/cbuild/bin/bench_cp_nccl --seq-scale $scale --reps ${BENCH_REPS:-10} \
        --comms p2p,a2a,all_gather,a2a+p2p > $R/bench/cpgold_s$scale.log 2>&1
      echo "cpgold_s$scale rc=$?" >> $R/done.txt; grep "^|\|physical\|device" $R/bench/cpgold_s$scale.log | head -60
    done
  else
    echo "te_bench: no $W/cbuild/bin/bench_cp_nccl ($(cat $L/cbuild.rc 2>/dev/null || echo 'not built'))"
  fi
  cp $R/bench/* $OUT/bench/ 2>/dev/null; stamp te_bench ;;
shrink)     # cpgold shrink with TE as COMMAND, from failing fixtures (SHRINK_START items
            # NAME=FOLDER/FIXTURE[@ENV[@DIMS[@ADAPTER]]]: ENV none = FusedAttention (default), fa3 / fa4 = TE's flash
            # backend with that FlashAttention; DIMS the head dims shrink may try; ADAPTER te_cp (TE's CP on thread
            # ranks, default) or te (TE non-CP: FA4 cannot run under thread ranks)), all side by side, item i on GPU
            # i mod the GPU count (SHRINK_GPU: all on one); SHRINK_ARGS: more options of cpgold shrink (--same-tensors),
            # SHRINK_SET: more adapter options (--set poison=1)
  mkdir -p $R/shrink && chmod 700 $R/shrink   # serve refuses a socket folder others can write
  gpus=$(gpu_count); i=0
  for item in ${SHRINK_START:-A_all_gather=edge/window_two_sided_w2 B_a2ap2p=random/random_s26_00016_a2ap2p_w4_bf16 \
      C_p2p_gqa=random/random_s26_00069_p2p_w4_bf16 D256_gqa=edge/d256_p2p_w2_gqa@none@64,128,256 \
      FA3_fa4_causal=fills/p2p_w2_causal_bf16_zero@fa4@32,64,128@te}; do
    name=${item%%=*}; IFS=@ read -r fixture env dims adapter <<< "${item#*=}"
    env=${env:-none}; backend=fused; [ $env = none ] || backend=flash
    ( [ -f $W/stop_multi ] && exit 0
      source $W/prefix/env.sh $env
      export CUDA_VISIBLE_DEVICES=${SHRINK_GPU:-$(( i % gpus ))}
      t0=$(date +%s); sock=$R/shrink/$name.sock
      # the adapter stays loaded between runs (cpgold.outsiders.serve): a run costs the kernels, not TE's import
      python3 -m cpgold.outsiders.serve start $sock ${adapter:-te_cp} $([[ ${adapter:-te_cp} == te* ]] && echo --backend $backend) --timeout 100 $( \
          [ "${adapter:-te_cp}" = te_cp ] && echo '--set timeout=30') ${SHRINK_SET:-} 2> $R/shrink/$name.serve.log &
      while [ ! -S $sock ] && kill -0 $! 2>/dev/null; do sleep 1; done
      # TE's FlashAttention path leaves pad rows unwritten (the convention of docs/outsiders.md)
      timeout ${SHRINK_TIMEOUT:-420} $B/bin/cpgold shrink $FX/$fixture.h5 --tensors o,dq,dk,dv --run-timeout 120 \
        --pad-rows $([ $backend = flash ] && echo unwritten || echo zero) \
        --dims ${dims:-32,64,128} --max-runs ${SHRINK_RUNS:-40} --budget ${SHRINK_BUDGET:-360} --format json \
        --work-dir $R/shrink/$name.work ${SHRINK_ARGS:-} \
        --run "python3 -m cpgold.outsiders.serve run $sock {fixture} {candidate}" \
        > $R/shrink/$name.json 2> $R/shrink/$name.log
      echo "shrink_$name rc=$? $(( $(date +%s) - t0 )) s" >> $R/done.txt
      python3 -m cpgold.outsiders.serve stop $sock >> $R/shrink/$name.serve.log 2>&1; wait ) &
    i=$((i + 1))
  done; wait
  for f in $R/shrink/*.log; do echo "-- $f"; tail -2 $f | cut -c1-300; done
  stamp shrink ;;
gpu-tests)  # cpgold's own GPU tests on this tree, on the CUDA build prep made (CUDA_TARGETS="cpgold test_gpu test_nccl
            # bench_gpu_attention bench_cp_local"): test_gpu and verify (lab/gpu/device_run.sh cp), then the NCCL
            # suite and verify --backend nccl at W = 2 and 4 (lab/gpu/nccl_device_run.sh check verify)
  while [ ! -f $L/cbuild.rc ]; do sleep 5; done
  [ "$(cat $L/cbuild.rc)" = 0 ] || { tail -20 $L/cbuild.log; echo "gpu_tests: the CUDA build failed" >> $R/done.txt; exit 1; }
  mkdir -p $R/gpu $R/nccl
  ( cd $W/src
    B=$W/cbuild OUT=$R/gpu CPGOLD_PREFIX=$W/src/${CPGOLD_PREFIX:-.devdeps} bash lab/gpu/device_run.sh cp \
      > $R/gpu/summary.txt 2>&1; echo "gpu_tests rc=$?" >> $R/done.txt
    B=$W/cbuild OUT=$R/nccl CPGOLD_PREFIX=$W/src/${CPGOLD_PREFIX:-.devdeps} bash lab/gpu/nccl_device_run.sh check verify \
      > $R/nccl/summary.txt 2>&1; echo "nccl_tests rc=$?" >> $R/done.txt )
  cat $R/gpu/summary.txt $R/nccl/summary.txt | cut -c1-240; stamp gpu-tests ;;
multi)      # this machine's whole run, GPUs shared: the harness under NCCL (torch reference, TE fused, FA3, FA4),
            # W = 2 on two pairs of GPUs and W = 4 on all four; TE CP on thread ranks for the one-GPU agreement; shrink;
            # until MULTI_DEADLINE seconds, then te_bench alone on the machine
  t0=$(date +%s)
  export FOLDERS=${FOLDERS:-quick edge te te_shapes random fills}
  while [ ! -f $W/prefix/env.sh ] || [ ! -f $W/prep.done ]; do sleep 5; done
  rm -f $W/stop_multi
  job pair01 seq2 "ranks_fused_w2|RANKS_GPUS=0,1 RANKS_TAG=te_ranks_fused_w2 RANKS_ENV=none RANKS_WORLD=2 bash $0 ranks te_cp --backend fused" \
    "ref_w2|RANKS_GPUS=0,1 RANKS_TAG=torch_allgather_w2 RANKS_ENV=none RANKS_WORLD=2 bash $0 ranks torch_allgather" \
    "ranks_fused_w4|RANKS_GPUS=0,1,2,3 RANKS_TAG=te_ranks_fused_w4 RANKS_ENV=none RANKS_WORLD=4 bash $0 ranks te_cp --backend fused" \
    "ref_w4|RANKS_GPUS=0,1,2,3 RANKS_TAG=torch_allgather_w4 RANKS_ENV=none RANKS_WORLD=4 bash $0 ranks torch_allgather"
  job pair23 seq2 "ranks_fused_w2_det|RANKS_GPUS=2,3 RANKS_TAG=te_ranks_fused_w2_det RANKS_ENV=none RANKS_WORLD=2 bash $0 ranks te_cp --backend fused --deterministic" \
    "ranks_fa3_w2|RANKS_GPUS=2,3 RANKS_TAG=te_ranks_fa3_w2 RANKS_ENV=fa3 RANKS_WORLD=2 bash $0 ranks te_cp --backend flash" \
    "ranks_fa3_w4|RANKS_GPUS=0,1,2,3 RANKS_TAG=te_ranks_fa3_w4 RANKS_ENV=fa3 RANKS_WORLD=4 bash $0 ranks te_cp --backend flash"
  job fa4 seq2 "ranks_fa4_w2|RANKS_GPUS=1,0 RANKS_TAG=te_ranks_fa4_w2 RANKS_ENV=fa4 RANKS_WORLD=2 bash $0 ranks te_cp --backend flash" \
    "ranks_fa4_w4|RANKS_GPUS=3,2,1,0 RANKS_TAG=te_ranks_fa4_w4 RANKS_ENV=fa4 RANKS_WORLD=4 bash $0 ranks te_cp --backend flash"
  job thread seq2 "threads_fused|CUDA_VISIBLE_DEVICES=3 bash -c 'source $0 __lib; run te_cp_fused_threads none te_cp --backend fused --set timeout=30'" \
    "threads_fa3|CUDA_VISIBLE_DEVICES=2 bash -c 'source $0 __lib; run te_cp_fa3_threads fa3 te_cp --backend flash --set timeout=30'" \
    "threads_fa4|CUDA_VISIBLE_DEVICES=1 FOLDERS='quick edge' bash -c 'source $0 __lib; threads fa4'"
  job shrink seq2 "shrink|bash $0 shrink"
  # TE non-CP with FA4 (three parts side by side), deterministic backward with FA3 and FA4, FusedAttention on edge
  job te_fa4a seq2 "te_fa4_a|CUDA_VISIBLE_DEVICES=2 FOLDERS='quick edge te golden' RUN_SUFFIX=_a TE_BACKENDS=fa4 DETERMINISTIC=0 bash $0 te"
  job te_fa4b seq2 "te_fa4_b|CUDA_VISIBLE_DEVICES=3 FOLDERS=random RUN_SUFFIX=_b TE_BACKENDS=fa4 DETERMINISTIC=0 bash $0 te"
  job te_fa4c seq2 "te_fa4_c|CUDA_VISIBLE_DEVICES=1 FOLDERS='te_shapes fills' RUN_SUFFIX=_c TE_BACKENDS=fa4 DETERMINISTIC=0 bash $0 te"
  job te_det seq2 "te_fused_edge|CUDA_VISIBLE_DEVICES=0 FOLDERS=edge RUN_SUFFIX=_edge TE_BACKENDS=fused bash $0 te" \
    "te_det|CUDA_VISIBLE_DEVICES=0 FOLDERS='quick edge te golden' TE_BACKENDS='fa3 fa4' NONDETERMINISTIC=0 bash $0 te"
  job fa3src seq2 "fa4repro|CUDA_VISIBLE_DEVICES=0 bash $0 fa4-repro" "fa3src|CUDA_VISIBLE_DEVICES=0 bash $0 fa3-check"
  job det seq2 "fa_crash|CUDA_VISIBLE_DEVICES=2 bash $0 fa-crash" \
    "det_fa3|CUDA_VISIBLE_DEVICES=2 bash -c 'source $0 __lib; run fa3_direct_det fa3 fa3 --deterministic --isolate'" \
    "det_fa4|CUDA_VISIBLE_DEVICES=3 FOLDERS='quick edge te golden' bash -c 'source $0 __lib; run fa4_direct_det fa4 fa4 --deterministic --isolate'" \
    "det_fa4_random|CUDA_VISIBLE_DEVICES=3 FOLDERS='random fills' RUN_SUFFIX=_b bash -c 'source $0 __lib; run fa4_direct_det fa4 fa4 --deterministic --isolate'"
  jobs_until $(( t0 + ${MULTI_DEADLINE:-540} ))
  stamp "multi: correctness part done"
  while [ -f $W/src/CMakeLists.txt ] && [ -n "${CUDA_TARGETS:-}" ] && [ ! -f $L/cbuild.rc ]; do sleep 5; done
  [[ " ${MULTI_SKIP:-} " == *" te_bench "* ]] || bash $0 te_bench; stamp multi ;;
sweeps)     # the one-GPU sweeps earlier machines left, side by side on every GPU until SWEEPS_DEADLINE seconds:
            # TE CP on thread ranks with FA4 (te, te_shapes and golden, fills, random in three parts) and with FA4's and
            # FA3's deterministic backward; TE non-CP deterministic with FA3 and FA4 over random, te_shapes and fills;
            # FA4 and FA3 directly, deterministic, over te_shapes (FA3: and golden); FA4 one process per GPU at W = 3
  t0=$(date +%s); export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}   # a dozen processes share the cores
  while [ ! -f $W/prefix/env.sh ] || [ ! -f $W/prep.done ]; do sleep 5; done
  gpus=$(gpu_count); rm -f $W/stop_multi
  on() {  # on GPU FOLDERS SUFFIX ENV [ARGS...]: threads ENV ARGS on that GPU over those folders
    ( export CUDA_VISIBLE_DEVICES=$(( $1 % gpus )) FOLDERS="$2" RUN_SUFFIX=$3; shift 3; threads "$@" ) }
  job thr_te     seq2 "thr_te|on 0 te _te fa4"
  job thr_sg     seq2 "thr_sg|on 1 'te_shapes golden' _shapes_golden fa4"
  job thr_fills  seq2 "thr_fills|on 2 fills _fills fa4"
  for i in 0 1 2; do job thr_r$i seq2 "thr_r$i|SPLIT=$i/3 on $((3 + i)) random _random$i fa4"; done
  job thr_det_qe seq2 "thr_det_qe|on 2 'quick edge' _det_quick_edge fa4 --deterministic"
  job thr_det_tg seq2 "thr_det_tg|on 3 'te golden' _det_te_golden fa4 --deterministic"
  job thr_fa3det seq2 "thr_fa3det|on 0 '${SWEEPS_FOLDERS:-quick edge te golden te_shapes random fills}' _det fa3 --deterministic"
  job te_det_r   seq2 "te_det_r|CUDA_VISIBLE_DEVICES=$((1 % gpus)) FOLDERS=random RUN_SUFFIX=_random TE_BACKENDS=fa4 NONDETERMINISTIC=0 bash $0 te"
  job te_det_sf  seq2 "te_det_sf|CUDA_VISIBLE_DEVICES=$((2 % gpus)) FOLDERS='te_shapes fills' RUN_SUFFIX=_shapes_fills TE_BACKENDS=fa4 NONDETERMINISTIC=0 bash $0 te"
  job te_det_fa3 seq2 "te_det_fa3|CUDA_VISIBLE_DEVICES=$((3 % gpus)) FOLDERS='random te_shapes fills' RUN_SUFFIX=_random_shapes_fills TE_BACKENDS=fa3 NONDETERMINISTIC=0 bash $0 te"
  job direct_det seq2 "det_fa4|CUDA_VISIBLE_DEVICES=0 FOLDERS=te_shapes RUN_SUFFIX=_shapes bash -c 'source $0 __lib; run fa4_direct_det fa4 fa4 --deterministic --isolate'" \
    "det_fa3|CUDA_VISIBLE_DEVICES=0 FOLDERS='te_shapes golden' RUN_SUFFIX=_shapes_golden bash -c 'source $0 __lib; run fa3_direct_det fa3 fa3 --deterministic --isolate'"
  job ranks_fa4_w3 seq2 "ranks_fa4_w3|FOLDERS='quick edge te te_shapes random fills' RANKS_GPUS=0,1,2 RANKS_TAG=te_ranks_fa4_w3 RANKS_ENV=fa4 RANKS_WORLD=3 bash $0 ranks te_cp --backend flash"
  jobs_until $(( t0 + ${SWEEPS_DEADLINE:-600} ))
  stamp sweeps ;;
det_threads) # TE CP on thread ranks with FA4's deterministic backward over FOLDERS (te_shapes random fills) in
            # DET_PARTS runs side by side (4) spread over the GPUs, and the 6 fixtures N5's harness lost
            # (lab/records/outsiders-flash.md, "Run N5"; DET_LOST=0 leaves them out)
  while [ ! -f $W/prefix/env.sh ] || [ ! -f $W/prep.done ]; do sleep 5; done
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} FOLDERS=${FOLDERS:-te_shapes random fills}; n=${DET_PARTS:-4}
  gpus=$(gpu_count)
  for i in $(seq 0 $((n - 1))); do   # part i on GPU i mod the GPU count
    ( export SPLIT=$i/$n RUN_SUFFIX=_det_part$i CUDA_VISIBLE_DEVICES=$(( i % gpus )); threads fa4 --deterministic ) &
  done
  [ "${DET_LOST:-1}" = 1 ] && ( export FOLDERS="random golden" RUN_SUFFIX=_lost_det
    threads fa4 --deterministic --only golden/p2p_w2_mla_bf16.h5
    RUN_SUFFIX=_lost threads fa4 --only random/random_s26_00098_a2ap2p_w6_fp16.h5
    RUN_SUFFIX=_lost_det threads fa3 --deterministic --only \
      random_s26_00075_a2ap2p_w6_fp16.h5,random_s26_00076_a2a_w3_fp16.h5,random_s26_00077_all_gather_w3_bf16.h5,random_s26_00078_all_gather_w2_bf16.h5 ) &
  wait; stamp det_threads ;;
fa3-check) # the FA3 wheel prep built from sources: installed apart and run directly over FA3_CHECK_FOLDERS
  while [ ! -f $L/fa3-build.rc ]; do sleep 10; done
  tail -3 $L/fa3-build.log
  [ "$(cat $L/fa3-build.rc)" = 0 ] || { echo "fa3-check: the build failed"; exit 1; }
  python3 -m pip install -q --no-deps --no-index --no-compile --target $W/prefix/fa3src $W/fa3-wheel/flash_attn_3-*.whl
  ( export PYTHONPATH=$W/prefix/fa3src:$CPGOLD_PYTHONPATH FOLDERS="${FA3_CHECK_FOLDERS:-quick edge golden}"
    timeout 900 python3 -m cpgold.outsiders fa3 $(folders) --isolate --cpgold $B/bin/cpgold \
      --summary $R/fa3_source_build.json --table $R/fa3_source_build.md --title "fa3 built here from sources" \
      > $R/fa3_source_build.log 2>&1; echo "fa3_source_build rc=$?" >> $R/done.txt )
  tail -1 $R/fa3_source_build.log ;;
fa4-repro) # FA-3 with torch and flash-attn-4 alone (fa4_window_repro.py)
  ( source $W/prefix/env.sh fa4; python3 $HERE/fa4_window_repro.py 2>&1 | grep -v -i warn | tee $R/fa4_window_repro.log
    echo "fa4_repro rc=${PIPESTATUS[0]}" >> $R/done.txt ) ;;
fa-crash)  # the deterministic backward's process death at d 256 with GQA, FA3 and FA4 alone (fa_crash_repro.py)
  ( source $W/prefix/env.sh all; for fa in fa3 fa4; do python3 $HERE/fa_crash_repro.py --impl $fa 2>&1 \
      | grep -v -i warn | tee -a $R/fa_crash_repro.log; done; echo "fa_crash rc=${PIPESTATUS[0]}" >> $R/done.txt ) ;;
d256)      # the head-dim-256 gradient defect with torch and TE alone (te_repro_d256.py), both backward modes
  ( source $W/prefix/env.sh none; for m in "" --deterministic; do python3 lab/te/te_repro_d256.py $m 2>&1 \
      | grep -v -i warn | tee -a $R/te_repro_d256.log; done; echo "te_repro_d256 rc=${PIPESTATUS[0]}" >> $R/done.txt ) ;;
__lib) ;;   # sourced for its functions
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
bg)        # from a copy of the tree: the next call's copy of the tree replaces files under a run of this one (N5 lost 4
           # fixtures to "No module named cpgold.thread_ranks" that way)
  shift; snap=$W/tree.$(date +%s%N); mkdir -p $snap && cp -a . $snap/
  setsid nohup bash -c "cd $snap && for p in $*; do bash $0 \$p >> $L/bg.log 2>&1; done; echo 'bg done' >> $L/bg.log" \
    > /dev/null 2>&1 < /dev/null &
  echo "started in the background from $snap: $*" ;;
poll)
  tail -5 $L/bg.log 2>/dev/null; cat $R/done.txt 2>/dev/null
  for f in $(ls -t $R/*.log $L/job_*.log 2>/dev/null | head -3); do echo "-- $f: $(grep -c . $f) lines"; tail -2 $f | cut -c1-240; done
  for d in $R/ranks/*/; do [ -f $d/run.log ] && echo "-- $(basename $d): $(grep -c '^\[' $d/run.log) fixtures; $(tail -1 $d/run.log | cut -c1-200)"; done 2>/dev/null
  (cd $R && tar -czf $OUT/results.tar.gz --exclude='*.h5' --exclude='*.work' --exclude='.ranks' *.json *.md *.log \
     done.txt ranks bench shrink gpu nccl 2>/dev/null); ls -la $OUT/results.tar.gz ;;
*) echo "device_run: unknown phase $PHASE"; exit 2 ;;
esac
