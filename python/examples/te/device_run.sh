#!/bin/bash
# TransformerEngine checked against cpgold fixtures on a GPU machine (docs/outsiders.md): run from the repository
# root with $OUT set. Phases (each one call; the machine keeps /tmp between them):
#   install  TE from TE_FILES (install_te.sh: parts joined, hashes checked), cpgold's CLI built without CUDA (the
#            checks need only gen and check), the fixtures generated: quick, edge, te, random (RANDOM_COUNT, seed
#            RANDOM_SEED) and TE's CP-test shapes (te_test_cases.py)
#   dpa      check_te_dpa.py over every folder (non-CP, global and per rank)
#   cp       check_te_cp.py over every folder (CP with W thread ranks on one GPU)
#   helpers  check_te_helpers.py (TE's THD helper kernels vs cpgold's CPU twins through `cpgold helpers-check`)
# Environment: TE_FILES (default .te/files), TE_TARGET (/tmp/te), CPGOLD_PREFIX (header-only dependencies).
set -u
PHASE=${1:?usage: device_run.sh install|dpa|cp|helpers}
TE_FILES=${TE_FILES:-.te/files}; TE_TARGET=${TE_TARGET:-/tmp/te}; B=/tmp/cpgold-build; FX=/tmp/fx
export PYTHONPATH=$TE_TARGET:$PWD/python:$PWD/python/examples${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
HERE=python/examples/te
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
  mkdir -p $FX/te_shapes
  python3 $HERE/te_test_cases.py | while read -r name json; do
    $B/bin/cpgold gen --force --case "$json" -o $FX/te_shapes/$name.h5 > /tmp/gen_shape.log 2>&1 || tail -2 /tmp/gen_shape.log
  done
  for d in $(folders); do echo "$(basename $d): $(ls $d/*.h5 | wc -l) fixtures"; done
  stamp "install done" ;;
dpa)
  timeout ${TIMEOUT:-540} python3 $HERE/check_te_dpa.py --cpgold $B/bin/cpgold --summary $OUT/te_dpa.json $(folders) \
    > $OUT/te_dpa.log 2>&1; echo "check_te_dpa rc=$?"
  grep -vE " pass$" $OUT/te_dpa.log | head -150; stamp dpa ;;
cp)
  timeout ${TIMEOUT:-540} python3 $HERE/check_te_cp.py --cpgold $B/bin/cpgold --summary $OUT/te_cp.json ${CP_ARGS:-} $(folders) \
    > $OUT/te_cp.log 2>&1; echo "check_te_cp rc=$?"
  grep -vE " pass worst" $OUT/te_cp.log | head -150; grep -c " pass worst" $OUT/te_cp.log; stamp cp ;;
helpers)
  timeout ${TIMEOUT:-300} python3 $HERE/check_te_helpers.py --dump $OUT/te_helpers.h5 > $OUT/te_helpers_gen.log 2>&1
  echo "check_te_helpers rc=$?"; tail -5 $OUT/te_helpers_gen.log
  $B/bin/cpgold helpers-check $OUT/te_helpers.h5 > $OUT/te_helpers.log 2>&1; echo "helpers-check rc=$?"
  grep -v "^PASS" $OUT/te_helpers.log | head -60; stamp helpers ;;
*) echo "device_run: unknown phase $PHASE"; exit 2 ;;
esac
