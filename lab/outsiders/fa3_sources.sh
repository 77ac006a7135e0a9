#!/bin/bash
# Packs the sources FlashAttention-3's wheel is built from, for a GPU machine without network (build_fa3.sh):
# FlashAttention's hopper/ and README.md at FA_COMMIT (setup.py reads ../README.md), and CUTLASS's include/ at the
# commit FlashAttention pins as its csrc/cutlass submodule, into OUT (a .tar.gz of about 2.5 MB).
# FLASH_ATTENTION_GIT and CUTLASS_GIT: git directories of Dao-AILab/flash-attention and NVIDIA/cutlass (clones or
# mirrors; the submodule's commit must be in CUTLASS_GIT).
# Usage: FLASH_ATTENTION_GIT=... CUTLASS_GIT=... lab/outsiders/fa3_sources.sh OUT.tar.gz [FA_COMMIT]
set -euo pipefail
OUT=${1:?usage: fa3_sources.sh OUT.tar.gz [FA_COMMIT]}
FA=${FLASH_ATTENTION_GIT:?set FLASH_ATTENTION_GIT to a git directory of Dao-AILab/flash-attention}
CUT=${CUTLASS_GIT:?set CUTLASS_GIT to a git directory of NVIDIA/cutlass}
COMMIT=${2:-0251105a}
pin=$(git --git-dir="$FA" ls-tree "$COMMIT" csrc/cutlass | awk '{print $3}')
[ -n "$pin" ] || { echo "fa3_sources: $COMMIT has no csrc/cutlass submodule entry" >&2; exit 1; }
git --git-dir="$CUT" cat-file -e "$pin^{commit}" 2>/dev/null \
  || { echo "fa3_sources: CUTLASS commit $pin (FlashAttention's pin) is not in $CUT" >&2; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/fa/csrc/cutlass"
git --git-dir="$FA" archive "$COMMIT" hopper README.md | tar -x -C "$work/fa"
git --git-dir="$CUT" archive "$pin" include | tar -x -C "$work/fa/csrc/cutlass"
printf 'flash-attention %s\ncutlass %s\n' "$(git --git-dir="$FA" rev-parse "$COMMIT")" "$pin" > "$work/fa/SOURCES"
tar -czf "$OUT" -C "$work" fa
echo "fa3_sources: $OUT ($(du -h "$OUT" | cut -f1)): $(tr '\n' ' ' < "$work/fa/SOURCES")"
