#!/bin/bash
# Installs the outsiders on a GPU machine without network from the parts download.sh made (in DIR), into PREFIX:
#   PREFIX/te   TransformerEngine 2.20.2 (../te/install_te.sh; its torch extension prebuilt when DIR/te holds it)
#   PREFIX/fa3  FlashAttention-3 (the wheel's dist-info kept: TE finds FA3 by importlib.metadata "flash-attn-3")
#   PREFIX/fa4  FlashAttention-4 and the CuTe DSL (one pip call: pip --target refuses to merge a second wheel of
#               nvidia_cutlass_dsl; --target does not process .pth files, so env.sh puts dsl_packages on the path)
# and writes PREFIX/env.sh, which sets PYTHONPATH for a backend: `source PREFIX/env.sh fa3` or `... fa4`.
# Usage: lab/outsiders/install.sh DIR PREFIX
set -euo pipefail
DIR=$(cd "${1:?usage: install.sh DIR PREFIX}" && pwd)
PREFIX=${2:?usage: install.sh DIR PREFIX}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$PREFIX"; PREFIX=$(cd "$PREFIX" && pwd)
files=$PREFIX/files
if ls "$DIR"/outsiders.tar.part-* > /dev/null 2>&1; then
  mkdir -p "$files"
  cat $(ls "$DIR"/outsiders.tar.part-* | sort) > "$PREFIX/outsiders.tar"
  [ "$(sha256sum "$PREFIX/outsiders.tar" | cut -d' ' -f1)" = "$(cat "$DIR/outsiders.tar.sha256")" ] \
    || { echo "install: outsiders.tar does not match outsiders.tar.sha256 (a part missing or broken)" >&2; exit 1; }
  tar -xf "$PREFIX/outsiders.tar" -C "$files" && rm "$PREFIX/outsiders.tar"
else
  files=$DIR   # the files themselves
fi
(cd "$files" && sha256sum -c --quiet "$HERE/SHA256SUMS_FA4")
python3 -m pip install -q --no-deps --no-index --no-compile --target "$PREFIX/fa4" "$files"/flash_attn_4-*.whl \
  "$files"/nvidia_cutlass_dsl*.whl "$files"/quack_kernels-*.whl "$files"/apache_tvm_ffi-*.whl \
  "$files"/torch_c_dlpack_ext-*.whl
if ls "$files"/flash_attn_3-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --no-compile --target "$PREFIX/fa3" "$files"/flash_attn_3-*.whl
else
  echo "install: no flash_attn_3 wheel in $files: build one with build_fa3.sh (device_run.sh fa3-build)"
fi
if [ -d "$files/te" ]; then
  bash "$HERE/../te/install_te.sh" "$files/te" "$PREFIX/te" | tail -2
else
  echo "install: no TransformerEngine files (download.sh with WITH_TE=0): FlashAttention only"
fi
cat > "$PREFIX/env.sh" <<ENV
# source $PREFIX/env.sh fa3|fa4|none|all: TE plus that FlashAttention on PYTHONPATH (TE prefers FA3 when both are\n# there); all: both FlashAttentions and PREFIX/extra (other wheels), no TE, for the benchmarks
case "\${1:-none}" in
  fa3) export PYTHONPATH=$PREFIX/te:$PREFIX/fa3:\${CPGOLD_PYTHONPATH:-} ;;
  fa4) export PYTHONPATH=$PREFIX/te:$PREFIX/fa4:$PREFIX/fa4/nvidia_cutlass_dsl/dsl_packages:\${CPGOLD_PYTHONPATH:-} ;;
  all) export PYTHONPATH=$PREFIX/fa3:$PREFIX/fa4:$PREFIX/fa4/nvidia_cutlass_dsl/dsl_packages:$PREFIX/extra:\${CPGOLD_PYTHONPATH:-} ;;
  *)   export PYTHONPATH=$PREFIX/te:\${CPGOLD_PYTHONPATH:-} ;;
esac
export NCCL_NVLS_ENABLE=0
ENV
for fa in fa3 fa4; do
  ( source "$PREFIX/env.sh" $fa; python3 - $fa <<'PY'
import sys, importlib.metadata as md
name = {"fa3": "flash_attn_interface", "fa4": "flash_attn.cute"}[sys.argv[1]]
dist = {"fa3": "flash-attn-3", "fa4": "flash-attn-4"}[sys.argv[1]]
try:
    m = __import__(name, fromlist=["flash_attn_varlen_func"])
    print(f"install: {name} imports ({dist} {md.version(dist)})")
except Exception as e:
    print(f"install: {name} does not import: {type(e).__name__}: {e}")
PY
  )
done
