#!/usr/bin/env bash
# Golden data at production scale on one node: gen of a 64k-token case and check of a candidate of it, before (the
# commit before the x86-64-v3 level, parallel chunk filters and parallel check: 7983504) and after (this tree), with
# the physical limits measured in the same run. Writes a Markdown results file (lab/records/perf.md, "gen at scale").
#
# usage: bench/gen_scale.sh [PART...]      (no part: all of them, in this order)
#   build         configure and build `cpgold`, `bench_reference` and `bench_check` of this tree (build-scale/, CUDA and
#                 Python off) and `cpgold` of the before commit ($WORK/before-build)
#   limits        the machine: CPU, cores, Eigen's float64 GEMM rate on one thread and on every thread at once (this
#                 tree's build, x86-64-v3), and the disk write rate of $WORK (dd, 4 GiB, with and without fdatasync)
#   gen-after     gen of the case with this tree: wall time, maxrss, the memory estimate it printed, compute/write split
#   check-after   a candidate of that fixture (float32, contiguous, as h5py writes one) and `cpgold check` of it
#   gen-before    gen of the case with the before binary, under `timeout $BEFORE_LIMIT` (default 540 s): when it does
#                 not finish, its last progress line (share computed and time left) is recorded instead
#   check-before  `cpgold check` of the same candidate against the after fixture with the before binary
#   determinism   gen of a 16k-token case twice (all threads, then 5 threads): `check --identical` must say IDENTICAL
#   summary       the results table ($RESULTS/gen_scale.md) from the parts' logs
# Each part takes under 10 minutes on a 16-core machine (gen-before is cut at $BEFORE_LIMIT); run them one by one
# where a single command is limited, e.g.  bench/gen_scale.sh build limits  then  gen-after check-after  then
# gen-before  then  check-before determinism summary.
#
# Environment:
#   WORK      large files: builds of before, fixtures, candidate (default /tmp/cpgold-gen-scale; about 40 GB free needed)
#   RESULTS   small text results (default $OUT when set, else bench-out/gen_scale)
#   BEFORE_COMMIT  the before commit (default 7983504); its source comes from BEFORE_SRC (a source tree), or from this
#             repository's git history (git archive); BEFORE_BIN (a built cpgold of it) skips building it
#   CASE      the case flags (default: below); CASE_SMALL the determinism case
#   CMAKE_PREFIX_PATH  where CLI11, nlohmann-json and doctest are (default $PWD/.devdeps when that exists)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${WORK:-/tmp/cpgold-gen-scale}
RESULTS=${RESULTS:-${OUT:-$ROOT/bench-out/gen_scale}}
BEFORE_COMMIT=${BEFORE_COMMIT:-7983504}
BEFORE_LIMIT=${BEFORE_LIMIT:-540}
JOBS=${JOBS:-$(nproc)}
# 64k tokens: 7 sequences of 8192 and a mix of lengths (3001 ... 1, an empty one), each padded to a multiple of
# 2W = 16 (65568 rows); 32 query heads, 8 KV heads, d 128, bf16, causal, p2p over W = 8 ranks.
CASE=${CASE:---seqlens-q 8192,8192,8192,8192,8192,8192,8192,3001,2047,1500,1000,517,100,1,0 --heads-q 32 --heads-kv 8 --dim-qk 128 --dtype bf16 --mask causal --cp-size 8 --comm p2p}
CASE_SMALL=${CASE_SMALL:---seqlens-q 8192,4096,2048,1500,517,1 --heads-q 16 --heads-kv 4 --dim-qk 128 --dtype bf16 --mask causal --cp-size 8 --comm p2p}
if [[ -z "${CMAKE_PREFIX_PATH:-}" && -d "$ROOT/.devdeps" ]]; then export CMAKE_PREFIX_PATH=$ROOT/.devdeps; fi
mkdir -p "$WORK" "$RESULTS"
AFTER_BUILD=$ROOT/build-scale
AFTER=$AFTER_BUILD/bin/cpgold
BEFORE=${BEFORE_BIN:-$WORK/before-build/bin/cpgold}
TIME=/usr/bin/time

log() { echo "[gen_scale $(date +%H:%M:%S)] $*" | tee -a "$RESULTS/gen_scale.log"; }

# /usr/bin/time -v of a command, its output (stdout and stderr) in $1.out, the time report in $1.time.
timed() {
  local name=$1
  shift
  local rc=0
  "$TIME" -v -o "$RESULTS/$name.time" "$@" > "$RESULTS/$name.out" 2>&1 || rc=$?
  echo "$rc" > "$RESULTS/$name.rc"
  return 0
}

part_build() {
  log "build: this tree -> $AFTER_BUILD (jobs $JOBS)"
  cmake -S "$ROOT" -B "$AFTER_BUILD" -DCMAKE_BUILD_TYPE=Release -DCPGOLD_ENABLE_CUDA=OFF -DCPGOLD_ENABLE_PYTHON=OFF \
    > "$RESULTS/build-after.log" 2>&1
  cmake --build "$AFTER_BUILD" --target cpgold bench_reference bench_check -j "$JOBS" >> "$RESULTS/build-after.log" 2>&1
  grep -E "instruction set|Eigen|HDF5|OpenMP" "$RESULTS/build-after.log" | tee -a "$RESULTS/gen_scale.log" || true
  if [[ -n "${BEFORE_BIN:-}" ]]; then
    log "build: before binary given: $BEFORE_BIN"
    return
  fi
  local src=${BEFORE_SRC:-$WORK/before-src}
  if [[ -z "${BEFORE_SRC:-}" ]]; then
    rm -rf "$src" && mkdir -p "$src"
    git -C "$ROOT" archive "$BEFORE_COMMIT" | tar -x -C "$src"
  fi
  log "build: before ($BEFORE_COMMIT) from $src -> $WORK/before-build"
  cmake -S "$src" -B "$WORK/before-build" -DCMAKE_BUILD_TYPE=Release -DCPGOLD_ENABLE_CUDA=OFF \
    -DCPGOLD_ENABLE_PYTHON=OFF > "$RESULTS/build-before.log" 2>&1
  cmake --build "$WORK/before-build" --target cpgold -j "$JOBS" >> "$RESULTS/build-before.log" 2>&1
  log "build: done ($("$AFTER" --version), before: $("$BEFORE" --version))"
}

part_limits() {
  log "limits: CPU and GEMM"
  {
    echo "## machine"
    echo
    echo '```'
    lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|L3"
    echo "instruction sets: $(grep -m1 -o -w -E "avx2|fma|avx512f|avx512_bf16|amx_tile" /proc/cpuinfo | sort -u | tr "\n" " ")"
    free -g | head -2
    uname -r
    echo '```'
    echo
    "$AFTER_BUILD/bin/bench_reference" --gemm-only "$(nproc)"
  } > "$RESULTS/limits.md" 2>&1
  log "limits: disk write rate of $WORK (4 GiB)"
  {
    echo
    echo "disk write rate of $WORK (dd, 16 MiB blocks, 4 GiB):"
    echo '```'
    dd if=/dev/zero of="$WORK/dd.bin" bs=16M count=256 conv=fdatasync 2>&1 | tail -1 | sed 's/^/with fdatasync: /'
    rm -f "$WORK/dd.bin"
    dd if=/dev/zero of="$WORK/dd.bin" bs=16M count=256 2>&1 | tail -1 | sed 's/^/page cache: /'
    rm -f "$WORK/dd.bin"
    df -h "$WORK" | tail -1
    echo '```'
  } >> "$RESULTS/limits.md" 2>&1
  cat "$RESULTS/limits.md" >> "$RESULTS/gen_scale.log"
}

part_gen_after() {
  log "gen-after: $AFTER gen $CASE"
  rm -f "$WORK/after.h5"
  # shellcheck disable=SC2086
  timed gen-after "$AFTER" gen $CASE -o "$WORK/after.h5" --force
  ls -l "$WORK/after.h5" >> "$RESULTS/gen-after.out" 2>&1 || true
  log "gen-after: rc $(cat "$RESULTS/gen-after.rc"), $(grep -E "Elapsed|Maximum resident" "$RESULTS/gen-after.time" | tr -s ' \t' ' ' | tr '\n' ';')"
}

part_check_after() {
  log "check-after: candidate and check"
  timed bench-check "$AFTER_BUILD/bin/bench_check" "$WORK/after.h5" "$WORK/candidate.h5" --keep
  timed check-after "$AFTER" check "$WORK/after.h5" "$WORK/candidate.h5"
  log "check-after: rc $(cat "$RESULTS/check-after.rc"), $(grep -E "Elapsed|Maximum resident" "$RESULTS/check-after.time" | tr -s ' \t' ' ' | tr '\n' ';')"
}

part_gen_before() {
  log "gen-before: $BEFORE gen $CASE (limit $BEFORE_LIMIT s)"
  rm -f "$WORK/before.h5"
  # shellcheck disable=SC2086
  timed gen-before timeout "$BEFORE_LIMIT" "$BEFORE" gen $CASE -o "$WORK/before.h5" --force
  log "gen-before: rc $(cat "$RESULTS/gen-before.rc") (124: cut at the limit), last line: $(grep -E "computed|wrote" "$RESULTS/gen-before.out" | tail -1)"
}

part_check_before() {
  log "check-before: $BEFORE check of the same candidate against the after fixture"
  timed check-before "$BEFORE" check "$WORK/after.h5" "$WORK/candidate.h5"
  log "check-before: rc $(cat "$RESULTS/check-before.rc"), $(grep -E "Elapsed|Maximum resident" "$RESULTS/check-before.time" | tr -s ' \t' ' ' | tr '\n' ';')"
}

part_determinism() {
  log "determinism: $CASE_SMALL with $(nproc) threads, then 5 threads"
  # shellcheck disable=SC2086
  timed det-all "$AFTER" gen $CASE_SMALL -o "$WORK/det-all.h5" --force
  # shellcheck disable=SC2086
  timed det-5 env OMP_NUM_THREADS=5 "$AFTER" gen $CASE_SMALL -o "$WORK/det-5.h5" --force
  timed det-identical "$AFTER" check --identical "$WORK/det-all.h5" "$WORK/det-5.h5"
  log "determinism: $(tail -1 "$RESULTS/det-identical.out")"
}

# Fields of /usr/bin/time -v: wall seconds and maxrss (GB).
wall_of() { awk -F': ' '/Elapsed \(wall clock\)/{n=split($2,t,":"); s=0; for(i=1;i<=n;i++) s=s*60+t[i]; printf "%.1f", s}' "$1"; }
rss_of() { awk -F': ' '/Maximum resident/{printf "%.2f", $2*1024/1e9}' "$1"; }

part_summary() {
  local f=$RESULTS/gen_scale.md
  {
    echo "# gen at scale: $(date -u +%Y-%m-%d), $(nproc) CPUs, commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
    echo
    echo "Case: \`cpgold gen $CASE\`"
    echo
    [[ -f $RESULTS/limits.md ]] && cat "$RESULTS/limits.md"
    echo
    echo "| run | wall s | maxrss GB | stated memory | result |"
    echo "|---|---|---|---|---|"
    for run in gen-before gen-after check-before check-after det-all det-5; do
      [[ -f $RESULTS/$run.time ]] || continue
      local stated result
      stated=$(grep -oE "about [0-9.]+ [kMG]B of memory[^,]*" "$RESULTS/$run.out" | head -1 | sed 's/about //' || true)
      result=$(grep -E "wrote|verdict|computed after|PASS|FAIL" "$RESULTS/$run.out" | tail -1 | cut -c1-160 || true)
      echo "| $run (rc $(cat "$RESULTS/$run.rc")) | $(wall_of "$RESULTS/$run.time") | $(rss_of "$RESULTS/$run.time") | ${stated:--} | ${result:--} |"
    done
    echo
    if [[ -f $RESULTS/gen-after.out ]]; then
      echo "gen-after progress and phases:"
      echo '```'
      grep -E "at most|computed in|written after|wrote" "$RESULTS/gen-after.out" | tail -12
      echo '```'
    fi
    if [[ -f $RESULTS/gen-before.out ]]; then
      echo "gen-before (last lines):"
      echo '```'
      grep -E "at most|computed|wrote" "$RESULTS/gen-before.out" | tail -4
      echo '```'
    fi
    [[ -f $RESULTS/bench-check.out ]] && { echo "bench_check:"; echo '```'; cat "$RESULTS/bench-check.out"; echo '```'; }
    [[ -f $RESULTS/det-identical.out ]] && { echo "determinism:"; echo '```'; tail -2 "$RESULTS/det-identical.out"; echo '```'; }
  } > "$f"
  log "summary: $f"
  cat "$f"
}

parts=("$@")
if [[ ${#parts[@]} -eq 0 ]]; then
  parts=(build limits gen-after check-after gen-before check-before determinism summary)
fi
for part in "${parts[@]}"; do
  case $part in
    build) part_build ;;
    limits) part_limits ;;
    gen-after) part_gen_after ;;
    check-after) part_check_after ;;
    gen-before) part_gen_before ;;
    check-before) part_check_before ;;
    determinism) part_determinism ;;
    summary) part_summary ;;
    *) echo "unknown part: $part (build limits gen-after check-after gen-before check-before determinism summary)" >&2; exit 2 ;;
  esac
done
