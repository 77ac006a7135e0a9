# Build, resource report and run-with-reruns of a bench/hopper_*.cu program, sourced by bench/hopper_forward.sh and
# bench/hopper_backward.sh with: program (hopper_forward or hopper_backward) and sm90_kernels (grep pattern of the
# kernels whose registers and SASS are listed); the program options are the caller's "$@". Works from the repository
# root; OUT defaults to build/$program, and the time budget for all runs is HOPPER_FORWARD_BUDGET or
# HOPPER_BACKWARD_BUDGET seconds (default 540). Leaves rc (the last run's exit status, 1 when something was excluded)
# and attempt (the number of the last run, whose log is $OUT/run$attempt.log).
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/build/$program}
budget_variable="${program^^}_BUDGET"
budget=${!budget_variable:-540}
mkdir -p "$OUT"
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" > /dev/null; then NVCC=/usr/local/cuda/bin/nvcc; fi
bin="$OUT/$program"

echo "== build ($("$NVCC" --version | tail -1))"
if ! "$NVCC" -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v -I. \
    "bench/$program.cu" -o "$bin" 2> "$OUT/ptxas.txt"; then
  cat "$OUT/ptxas.txt"
  echo "$program.sh: build failed"
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
grep "$sm90_kernels" "$OUT/resources.txt" | sed -e 's/cpgold::gpu:://g' -e 's/__nv_bfloat16/bf16/g' |
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
  grep "$sm90_kernels" "$OUT/sass_summary.txt" | sed -e 's/cpgold::gpu:://g' -e 's/__nv_bfloat16/bf16/g' | cut -c1-200
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2> /dev/null || true

excludes=""
rc=0
for attempt in 1 2 3 4 5 6 7 8; do
  left=$((budget - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "$program.sh: time budget spent before attempt $attempt"
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
      echo "$program.sh: attempt $attempt timed out while running $name"
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
  echo "$program.sh: excluded after a fault or hang: $excludes (a failure)"
  [ "$rc" -eq 0 ] && rc=1
fi
