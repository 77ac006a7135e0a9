#!/bin/bash
# Builds FlashAttention-3's wheel on a GPU machine (sm_90a) from the sources fa3_sources.sh packed, with the
# interpreter that holds torch, into OUTDIR. What the build keeps: bf16 and fp16, head dims 64, 96, 128, 192 (and
# 192/128), 256, varlen, local windows, PackGQA, forward and backward; left out: FP8, paged KV, split KV, softcap,
# sm80 kernels, dim_qk != dim_v for 64, append-KV. Takes about 4 minutes on 64 cores, about 3 times that on 16; run
# it in the background there (setsid nohup) and poll OUTDIR/build.log.
# Usage: lab/outsiders/build_fa3.sh SOURCES.tar.gz OUTDIR
set -euo pipefail
SRC=$(cd "$(dirname "${1:?usage: build_fa3.sh SOURCES.tar.gz OUTDIR}")" && pwd)/$(basename "$1")
OUTDIR=${2:?usage: build_fa3.sh SOURCES.tar.gz OUTDIR}
mkdir -p "$OUTDIR"; OUTDIR=$(cd "$OUTDIR" && pwd)
work=${FA3_WORK:-/tmp/fa3-build}
rm -rf "$work"; mkdir -p "$work"
tar -xzf "$SRC" -C "$work"
cat "$work/fa/SOURCES"
cd "$work/fa/hopper"
# setup.py imports wheel.bdist_wheel at the top; newer `wheel` releases moved it to setuptools.
python3 -c "from wheel.bdist_wheel import bdist_wheel" 2>/dev/null \
  || sed -i 's/^from wheel.bdist_wheel import bdist_wheel as _bdist_wheel/from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel/' setup.py
export FLASH_ATTENTION_FORCE_BUILD=TRUE
for f in FP8 PAGEDKV SPLIT SOFTCAP SM80 HDIMDIFF64 APPENDKV; do export FLASH_ATTENTION_DISABLE_$f=TRUE; done
export MAX_JOBS=${MAX_JOBS:-$(nproc)} NVCC_THREADS=1
t0=$(date +%s)
python3 -m pip wheel --no-build-isolation --no-deps --no-index -w "$OUTDIR" . > "$OUTDIR/build.log" 2>&1 \
  || { tail -40 "$OUTDIR/build.log"; exit 1; }
echo "build_fa3: $(ls "$OUTDIR"/flash_attn_3-*.whl) in $(( $(date +%s) - t0 )) s"
