#!/bin/bash
# Fetches what the outsider runs need on a GPU machine without network, into DIR (on a machine with PyPI):
#   FlashAttention-4 4.0.0b36 and its CuTe DSL wheels (cp312, manylinux_2_28), hashes checked (SHA256SUMS_FA4);
#   TransformerEngine 2.20.2 (../te/download_te.sh);
#   FlashAttention-3, which has no wheel on PyPI: a wheel built by build_fa3.sh on a GPU machine, given as FA3_WHEEL
#   (else the device builds it from sources, see device_run.sh fa3-build);
#   WITH_TE=0: no TransformerEngine (FlashAttention alone, for bench_flash.py);
#   TE_TORCH_SO: a prebuilt transformer_engine_torch extension for the device's torch, if there is one.
# Then everything is packed into one tar, split into parts of PART_BYTES (default 52000000) for transfers with a
# size limit; install.sh joins them.
# Usage: lab/outsiders/download.sh DIR
set -euo pipefail
DIR=${1:?usage: download.sh DIR}
PART_BYTES=${PART_BYTES:-52000000}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$DIR/files"
cd "$DIR/files"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d . \
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
sha256sum -c "$HERE/SHA256SUMS_FA4"
if [ "${WITH_TE:-1}" = 1 ]; then   # WITH_TE=0: FlashAttention only (the benchmarks)
  PART_BYTES=999999999999 bash "$HERE/../te/download_te.sh" "$DIR/files/te" > /dev/null
fi
if [ -n "${FA3_WHEEL:-}" ]; then cp "$FA3_WHEEL" .; fi
# TE's torch extension built once for the device's torch (../te/install_te.sh says how): saves its 8-minute build.
if [ -n "${TE_TORCH_SO:-}" ] && [ -d te ]; then cp "$TE_TORCH_SO" te/; fi
cd "$DIR"
tar -cf outsiders.tar -C files .
rm -f outsiders.tar.part-*
split -b "$PART_BYTES" -d outsiders.tar outsiders.tar.part-
sha256sum outsiders.tar | cut -d' ' -f1 > outsiders.tar.sha256
rm outsiders.tar
ls -la "$DIR"
