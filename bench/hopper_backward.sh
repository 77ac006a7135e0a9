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
program=hopper_backward
sm90_kernels="backward.*sm90_kernel"
source "$(dirname "$0")/hopper_common.sh"
# A short table last: checks per stage and outcome, then the timing rows, of the last run.
log="$OUT/run$attempt.log"
if [ -f "$log" ]; then
  echo "== short table (checks per stage; timing: median ms, TFLOP/s at 2.5 x forward FLOPs)"
  grep '^RESULT|' "$log" | awk -F'|' '{n[$2 " " $4]++} END {for (k in n) printf "%-22s %d\n", k, n[k]}' | sort
  grep '^TIMING|' "$log" | cut -d'|' -f2- | cut -c1-110
  echo "exit $rc"
fi
exit "$rc"
