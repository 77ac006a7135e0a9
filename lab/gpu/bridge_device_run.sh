#!/bin/bash
# The device run of lab/records/gpu-results.md "Python bridge": build cpgold, generate the fixtures, check PyTorch's
# varlen_attn and cuDNN's THD attention on them, benchmark cuDNN against cpgold's kernels.
# Usage (repository root, $OUT set): lab/gpu/bridge_device_run.sh [check|bench|all] [SUITES...]
# Needs the nvidia-cudnn-frontend wheel in .whl/ (or cudnn importable) and, for the random suite, RANDOM_COUNT.
set -u
MODE=${1:-all}; shift || true
SUITES=${*:-quick edge te random}
B=/tmp/b
L=/tmp/logs; mkdir -p $L   # build and generation logs, packed into $OUT/logs.tar.gz at the end
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
WHL=${WHL:-.whl}
if ls $WHL/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/python:$PWD/python/examples${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, cudnn; print('torch', torch.__version__, 'cudnn', cudnn.backend_version_string(), 'frontend', cudnn.__version__)"
t0=$(date +%s)
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CPGOLD_PREFIX:+-DCMAKE_PREFIX_PATH=$CPGOLD_PREFIX} > $L/configure.log 2>&1 \
  || { tail -30 $L/configure.log; exit 1; }
cmake --build $B -j16 --target cpgold bench_gpu_attention > $L/build.log 2>&1 || { grep -E "error" $L/build.log | head -30; exit 1; }
echo "== build ok ($(( $(date +%s) - t0 )) s)"
if [ $MODE != bench ]; then
  CPGOLD_BIN=$B/bin/cpgold timeout 120 python3 -m pytest -q -rs -p no:cacheprovider python/tests > $L/pytest.log 2>&1
  echo "pytest python/tests rc=$?: $(tail -1 $L/pytest.log)"; grep -E "^SKIPPED|FAILED" $L/pytest.log | head
  dirs=()
  for S in $SUITES; do
    if [ $S = random ]; then
      $B/bin/cpgold gen --force --suite random --count ${RANDOM_COUNT:-300} --seed ${RANDOM_SEED:-12} -o /tmp/fx/random > $L/gen_random.log 2>&1 || { tail -5 $L/gen_random.log; continue; }
    else
      $B/bin/cpgold gen --force --suite $S -o /tmp/fx/$S > $L/gen_$S.log 2>&1 || { tail -5 $L/gen_$S.log; continue; }
    fi
    dirs+=(/tmp/fx/$S)
  done
  echo "== fixtures: $(for d in ${dirs[@]}; do echo -n "$(basename $d) $(ls $d/*.h5 | wc -l)  "; done)($(( $(date +%s) - t0 )) s)"
  timeout ${VARLEN_TIMEOUT:-200} python3 -m cpgold.outsiders varlen --cpgold $B/bin/cpgold --summary $OUT/varlen.json ${dirs[@]} > $OUT/varlen.log 2>&1
  echo "varlen rc=$? ($(( $(date +%s) - t0 )) s)"; grep -vE " (pass worst|unsupported)" $OUT/varlen.log | tail -40
  # cuDNN builds a graph per configuration (about 1 s each) and random cases rarely share one: a prefix of the sweep.
  timeout ${CUDNN_TIMEOUT:-250} python3 -m cpgold.outsiders cudnn --cpgold $B/bin/cpgold --summary $OUT/cudnn.json \
    --first random=${CUDNN_RANDOM_COUNT:-40} ${dirs[@]} > $OUT/cudnn.log 2>&1
  echo "cudnn rc=$? ($(( $(date +%s) - t0 )) s)"; grep -vE " pass worst" $OUT/cudnn.log | tail -60
fi
if [ $MODE != check ]; then
  BENCH_DIMS=${BENCH_DIMS:-128,64,192/128}
  [ -n "${BENCH_CPGOLD-1}" ] && timeout ${BENCH_TIMEOUT:-150} $B/bin/bench_gpu_attention --pad-rows 63 --dims $BENCH_DIMS ${BENCH_TOTALS:+--totals $BENCH_TOTALS} 2>&1 | tee $OUT/bench_cpgold.log
  timeout ${BENCH_TIMEOUT:-150} python3 bench/gpu/bench_cudnn_thd.py --pad-rows 63 --dims $BENCH_DIMS ${BENCH_TOTALS:+--totals $BENCH_TOTALS} 2>&1 | tee $OUT/bench_cudnn.log
fi
tar -czf $OUT/logs.tar.gz -C $L .
