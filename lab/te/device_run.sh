#!/bin/bash
# TransformerEngine checked against cpgold fixtures on a GPU machine (docs/outsiders.md): run from the repository
# root with $OUT set. Phases (each one call; the machine keeps /tmp between them):
#   install  TE from TE_FILES (install_te.sh: parts joined, hashes checked), cpgold's CLI built without CUDA (the
#            checks need only gen and check), the fixtures generated: quick, edge, te, random (RANDOM_COUNT, seed
#            RANDOM_SEED) and TE's CP-test shapes (te_test_cases.py)
#   dpa      `python3 -m cpgold.outsiders te` over every folder (non-CP, global and per rank)
#   shapes   the fixtures at TE's CP-test shapes alone (te_test_cases.py; install makes them unless SHAPES=0)
#   cp       `python3 -m cpgold.outsiders te_cp` over every folder, or the folders named in CP_FOLDERS (CP with W thread ranks on one
#            GPU); results also kept in /tmp/results for attrib
#   attrib   every CP fixture that failed or errored in an earlier cp phase, again with CUDA_LAUNCH_BLOCKING=1 (no
#            overlap between kernels, copies and ranks), twice (bits compared), every fused-attention call traced
#   minimal  the smallest case of every finding (te_minimal_cases.py), non-CP and CP
#   repro    te_repro_zero_q.py (the standalone reproduction of the dK/dV finding, no cpgold)
#   helpers  check_te_helpers.py (TE's THD helper kernels vs cpgold's CPU twins through `cpgold helpers-check`)
# Environment: TE_FILES (default .te/files), TE_TARGET (/tmp/te), CPGOLD_PREFIX (header-only dependencies).
set -u
PHASE=${1:?usage: device_run.sh install|shapes|dpa|cp|attrib|minimal|repro|helpers}
TE_FILES=${TE_FILES:-.te/files}; TE_TARGET=${TE_TARGET:-/tmp/te}; B=/tmp/cpgold-build; FX=/tmp/fx
export PYTHONPATH=$TE_TARGET:$PWD/python:$PWD/python/examples${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
HERE=lab/te
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
folders() { ls -d $FX/*/ 2>/dev/null | sed 's:/$::'; }
case $PHASE in
install)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  ( cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DCPGOLD_ENABLE_CUDA=OFF ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} \
      > /tmp/configure.log 2>&1 && cmake --build $B -j12 --target cpgold > /tmp/build.log 2>&1; echo $? > /tmp/build.rc ) &
  bash $HERE/install_te.sh "$TE_FILES" "$TE_TARGET" 2>&1 | tail -5
  wait; [ "$(cat /tmp/build.rc)" = 0 ] || { tail -30 /tmp/configure.log /tmp/build.log; exit 1; }
  stamp "cpgold built"
  mkdir -p $FX
  for S in quick edge te; do $B/bin/cpgold gen --force --suite $S -o $FX/$S > /tmp/gen_$S.log 2>&1 || tail -3 /tmp/gen_$S.log; done
  $B/bin/cpgold gen --force --suite random --count ${RANDOM_COUNT:-100} --seed ${RANDOM_SEED:-26} -o $FX/random \
    > /tmp/gen_random.log 2>&1 || tail -3 /tmp/gen_random.log
  stamp "suites generated"
  [ "${SHAPES:-1}" = 0 ] || bash $0 shapes
  for d in $(folders); do echo "$(basename $d): $(ls $d/*.h5 | wc -l) fixtures"; done
  stamp "install done" ;;
shapes)
  mkdir -p $FX/te_shapes
  python3 $HERE/te_test_cases.py | while read -r name json; do
    [ -f $FX/te_shapes/$name.h5 ] && continue   # gen writes a temporary file and renames it when complete
    $B/bin/cpgold gen --force --case "$json" -o $FX/te_shapes/$name.h5 > /tmp/gen_shape.log 2>&1 || tail -2 /tmp/gen_shape.log
  done
  echo "te_shapes: $(ls $FX/te_shapes/*.h5 | wc -l) fixtures"; stamp shapes ;;
dpa)
  timeout ${TIMEOUT:-540} python3 -m cpgold.outsiders te --backend fused --cpgold $B/bin/cpgold \
    --summary $OUT/te_dpa.json $(folders) > $OUT/te_dpa.log 2>&1; echo "te rc=$?"
  grep -vE " pass worst" $OUT/te_dpa.log | head -150; stamp dpa ;;
cp)
  sel=$(for d in $(folders); do [ -z "${CP_FOLDERS:-}" ] || [[ " $CP_FOLDERS " == *" $(basename $d) "* ]] && echo $d; done)
  tag=${CP_TAG:-all}
  timeout ${TIMEOUT:-540} python3 -m cpgold.outsiders te_cp --backend fused --cpgold $B/bin/cpgold \
    --summary $OUT/te_cp_$tag.json ${CP_ARGS:-} $sel > $OUT/te_cp_$tag.log 2>&1; echo "te_cp rc=$?"
  mkdir -p /tmp/results; cp $OUT/te_cp_$tag.json* $OUT/te_cp_$tag.log /tmp/results/ 2>/dev/null
  grep -vE " pass worst" $OUT/te_cp_$tag.log | head -150; grep -c " pass worst" $OUT/te_cp_$tag.log; stamp cp ;;
attrib)
  only=$(python3 -c '
import glob, json
names = set()
for f in glob.glob("/tmp/results/te_cp_*.json.jsonl"):  # the runner's JSON lines
    for line in open(f):
        e = json.loads(line)
        if e["status"] in ("fail", "error"):
            names.add(e["suite"] + "/" + e["fixture"])
print(",".join(sorted(names)))')
  only=${ATTRIB_ONLY:-$only}; echo "rerunning: $only"
  CUDA_LAUNCH_BLOCKING=1 timeout ${TIMEOUT:-540} python3 -m cpgold.outsiders te_cp --backend fused \
    --cpgold $B/bin/cpgold --summary $OUT/te_cp_attrib.json --set trace=1 --set repeat=2 --only "$only" ${CP_ARGS:-} \
    $(folders) > $OUT/te_cp_attrib.log 2>&1
  echo "te_cp rc=$?"; grep -vE "^    " $OUT/te_cp_attrib.log | head -80; stamp attrib ;;
minimal)
  mkdir -p $FX/minimal
  python3 $HERE/te_minimal_cases.py | while read -r name json; do
    $B/bin/cpgold gen --force --case "$json" -o $FX/minimal/$name.h5 > /tmp/gen_min.log 2>&1 || tail -2 /tmp/gen_min.log
  done
  timeout 120 python3 -m cpgold.outsiders te --backend fused --cpgold $B/bin/cpgold --summary $OUT/te_min_dpa.json \
    $FX/minimal > $OUT/te_min_dpa.log 2>&1; echo "te rc=$?"; grep -E "fail|pass" $OUT/te_min_dpa.log | head -20
  timeout 240 python3 -m cpgold.outsiders te_cp --backend fused --cpgold $B/bin/cpgold --summary $OUT/te_min_cp.json \
    --set repeat=2 $FX/minimal > $OUT/te_min_cp.log 2>&1; echo "te_cp rc=$?"; cut -c1-220 $OUT/te_min_cp.log | head -60
  stamp minimal ;;
repro)
  for mode in "" --deterministic; do
    timeout ${TIMEOUT:-300} python3 $HERE/te_repro_zero_q.py $mode 2>&1 | grep -v -i warn | tee -a $OUT/te_repro_zero_q.log | tail -40
  done
  stamp repro ;;
helpers)
  timeout ${TIMEOUT:-300} python3 python/examples/te/check_te_helpers.py --dump $OUT/te_helpers.h5 > $OUT/te_helpers_gen.log 2>&1
  echo "check_te_helpers rc=$?"; tail -5 $OUT/te_helpers_gen.log
  $B/bin/cpgold helpers-check $OUT/te_helpers.h5 > $OUT/te_helpers.log 2>&1; echo "helpers-check rc=$?"
  grep -v "^PASS" $OUT/te_helpers.log | head -60; stamp helpers ;;
*) echo "device_run: unknown phase $PHASE"; exit 2 ;;
esac
