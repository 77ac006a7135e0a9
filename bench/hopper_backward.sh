#!/usr/bin/env bash
# Builds bench/hopper_backward.cu for sm_90a with nvcc directly (no CMake: nothing here can break the project's
# build) and runs it: unit tests of the operand forms the wgmma backward adds, the sm_90a backward (atomic and
# deterministic dQ, summing form) against a float64 CPU reference, and timing against the mma.sync backward. Needs
# nvcc >= 12.3 (tested with 13.0) and a compute capability 9.0 GPU. docs/hopper-kernels.md ("Backward") describes
# the kernels and what each check proves.
#
# Usage: OUT=<folder> bash bench/hopper_backward.sh [program options: --reps N, --skip-timing, --exclude a,b, --seed S]
# Writes under $OUT (default build/hopper_backward): the binary, ptxas.txt (resource report), resources.txt,
# sass.txt and sass_summary.txt (when cuobjdump is found), run<N>.log. If the program reports that a kernel
# faulted the CUDA context or hung ("FAULTED <name>"), it is run again without that unit test or variant, so that
# the others still report; at most 7 reruns, within a time budget of HOPPER_BACKWARD_BUDGET seconds (default 540).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build/hopper_backward}
mkdir -p "$OUT"
budget=${HOPPER_BACKWARD_BUDGET:-540}
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" > /dev/null; then NVCC=/usr/local/cuda/bin/nvcc; fi
bin="$OUT/hopper_backward"

echo "== build ($("$NVCC" --version | tail -1))"
if ! "$NVCC" -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v -I. \
    bench/hopper_backward.cu -o "$bin" 2> "$OUT/ptxas.txt"; then
  cat "$OUT/ptxas.txt"
  echo "hopper_backward.sh: build failed"
  exit 3
fi
grep -iE "warning|error" "$OUT/ptxas.txt" | grep -v "^ptxas info" || true
# Registers, stack and spills of every kernel, demangled.
awk '/Compiling entry function/ {name=$0; sub(/.*function .?/, "", name); sub(/.? for .sm_90a.*/, "", name)}
     /bytes stack frame/ {frame=$0}
     /Used [0-9]+ registers/ {regs=$0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs);
       gsub(/^ +/, "", frame); print regs " regs | " frame " | " name}' "$OUT/ptxas.txt" |
  { command -v c++filt > /dev/null && c++filt || cat; } > "$OUT/resources.txt"
echo "== resources of the sm90 kernels (registers | stack/spills | kernel)"
grep "backward.*sm90_kernel" "$OUT/resources.txt" | sed -e 's/cpgold::gpu:://g' -e 's/__nv_bfloat16/bf16/g' |
  cut -c1-200 || true
CUOBJDUMP=$(command -v cuobjdump || true)
if [ -z "$CUOBJDUMP" ] && [ -x "$(dirname "$(command -v "$NVCC")")/cuobjdump" ]; then
  CUOBJDUMP="$(dirname "$(command -v "$NVCC")")/cuobjdump"
fi
if [ -n "$CUOBJDUMP" ]; then
  "$CUOBJDUMP" -sass "$bin" > "$OUT/sass.txt" 2>&1
  awk '/Function :/ {if (name != "") print hg " HGMMA, " ls " LDL/STL | " name; name=$3; hg=0; ls=0}
       /HGMMA/ {hg++} /[^A-Z](LDL|STL)[. ]/ {ls++}
       END {if (name != "") print hg " HGMMA, " ls " LDL/STL | " name}' "$OUT/sass.txt" |
    { command -v c++filt > /dev/null && c++filt || cat; } > "$OUT/sass_summary.txt"
  echo "== SASS of the sm90 kernels"
  grep "backward.*sm90_kernel" "$OUT/sass_summary.txt" | sed -e 's/cpgold::gpu:://g' -e 's/__nv_bfloat16/bf16/g' | cut -c1-200
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2> /dev/null || true

excludes=""
rc=0
for attempt in 1 2 3 4 5 6 7 8; do
  left=$((budget - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "hopper_backward.sh: time budget spent before attempt $attempt"
    break
  fi
  args=("$@")
  if [ -n "$excludes" ]; then args+=(--exclude "$excludes"); fi
  echo "== run $attempt: $bin ${args[*]} (limit ${left} s)"
  timeout "$left" "$bin" "${args[@]}" > "$OUT/run$attempt.log" 2>&1
  rc=$?
  # The log in full except the per-check lines already in the summary (the summary comes last).
  grep -v -e "^RESULT|" -e "^TIMING|" -e "^running " "$OUT/run$attempt.log" || true
  if [ "$rc" -eq 4 ] || [ "$rc" -eq 5 ] || [ "$rc" -eq 124 ]; then
    name=$(grep '^FAULTED ' "$OUT/run$attempt.log" | tail -1 | cut -d' ' -f2)
    if [ "$rc" -eq 124 ]; then
      name=$(grep '^running ' "$OUT/run$attempt.log" | tail -1 | cut -d' ' -f2)
      echo "hopper_backward.sh: attempt $attempt timed out while running $name"
    fi
    if [ -z "$name" ] || [ "$name" = "setup" ] || [ "$name" = "reference" ] || [ "$name" = "timing-setup" ]; then
      break
    fi
    excludes="${excludes:+$excludes,}$name"
    echo "== $name faulted or hung (exit $rc): running again without it"
    continue
  fi
  break
done
if [ -n "$excludes" ]; then
  echo "hopper_backward.sh: excluded after a fault or hang: $excludes (a failure)"
  [ "$rc" -eq 0 ] && rc=1
fi
# A short table last: checks per stage and outcome, then the timing rows, of the last run.
log="$OUT/run$attempt.log"
if [ -f "$log" ]; then
  echo "== short table (checks per stage; timing: median ms, TFLOP/s at 2.5 x forward FLOPs)"
  grep '^RESULT|' "$log" | awk -F'|' '{n[$2 " " $4]++} END {for (k in n) printf "%-22s %d\n", k, n[k]}' | sort
  grep '^TIMING|' "$log" | cut -d'|' -f2- | cut -c1-110
  echo "exit $rc"
fi
exit "$rc"
