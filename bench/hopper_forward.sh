#!/usr/bin/env bash
# Builds bench/hopper_forward.cu for sm_90a with nvcc directly (no CMake: nothing here can break the project's
# build) and runs it: unit tests of the wgmma building blocks, the sm_90a forward variants against a float64 CPU
# reference, and timing against the mma.sync forward kernel. Needs nvcc >= 12.3 (tested with 13.0) and a compute
# capability 9.0 GPU. docs/hopper-kernels.md describes the kernels and what each check proves.
#
# Usage: bash bench/hopper_forward.sh [program options: --reps N, --skip-timing, --exclude a,b, --seed S]
# Writes under $OUT (default build/hopper_forward): the binary, ptxas.txt (resource report), resources.txt,
# sass.txt and sass_summary.txt (when cuobjdump is found), run<N>.log. If the program reports that a kernel
# faulted the CUDA context or hung ("FAULTED <name>"), it is run again without that unit test or variant, so that
# the others still report; at most 7 reruns, within a time budget of HOPPER_FORWARD_BUDGET seconds (default 540).
set -uo pipefail
program=hopper_forward
sm90_kernels="sm90_kernel"
source "$(dirname "$0")/hopper_common.sh"
exit "$rc"
