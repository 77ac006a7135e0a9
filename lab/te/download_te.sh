#!/bin/bash
# Fetches TransformerEngine 2.20.2 for Python 3.12 / CUDA 13 from PyPI into DIR (a machine with PyPI access), checks
# the pinned hashes, and splits the 276 MB core wheel into parts of at most PART_BYTES (default 48000000) for
# transfers with a size limit. install_te.sh joins them again.
# Usage: lab/te/download_te.sh DIR
set -euo pipefail
DIR=${1:?usage: download_te.sh DIR}
PART_BYTES=${PART_BYTES:-48000000}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$DIR"
cd "$DIR"
platform="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps $platform -d . transformer-engine==2.20.2 transformer-engine-cu13==2.20.2 \
  pydantic pydantic-core annotated-types typing-inspection
# transformer-engine-torch is an sdist only: fetch the file itself (pip would try to build its metadata here).
url=$(python3 -m pip download --no-deps --no-binary=:all: --no-build-isolation -d /tmp/te-sdist-probe \
        transformer-engine-torch==2.20.2 -vv 2>&1 | grep -o "https://files[^ ]*transformer_engine_torch-2.20.2.tar.gz" \
        | head -1 || true)
[ -n "$url" ] || { echo "download_te: no URL found for transformer_engine_torch-2.20.2.tar.gz" >&2; exit 1; }
curl -sSfLo transformer_engine_torch-2.20.2.tar.gz "$url"
sha256sum -c "$HERE/SHA256SUMS"
core=transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
split -b "$PART_BYTES" -d "$core" "$core.part-"
rm "$core"
ls -la
