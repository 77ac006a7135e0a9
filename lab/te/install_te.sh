#!/bin/bash
# Installs TransformerEngine 2.20.2 (PyTorch) into TARGET from the files download_te.sh fetched into DIR, with no
# network: the core wheel (whole, or parts joined here), the Python wheel, pydantic's wheels, and the torch
# extension, built from its sdist against this machine's torch (about 8 minutes on 16 cores), or, when DIR holds a
# prebuilt transformer_engine_torch.cpython-*.so (or TE_TORCH_SO names one), that build, checked by importing it.
# Usage: lab/te/install_te.sh DIR TARGET      then: export PYTHONPATH=TARGET
set -euo pipefail
DIR=$(cd "${1:?usage: install_te.sh DIR TARGET}" && pwd)
TARGET=${2:?usage: install_te.sh DIR TARGET}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$TARGET"; TARGET=$(cd "$TARGET" && pwd)
core=transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -f "$DIR/$core" ]; then
  ln -s "$DIR/$core" "$work/$core"
elif ls "$DIR/$core".part-* > /dev/null 2>&1; then
  cat $(ls "$DIR/$core".part-* | sort) > "$work/$core"
else
  echo "install_te: neither $core nor its parts ($core.part-*) are in $DIR" >&2; exit 1
fi
cp "$DIR"/transformer_engine-2.20.2-py3-none-any.whl "$DIR"/transformer_engine_torch-2.20.2.tar.gz "$work/"
(cd "$work" && sha256sum -c "$HERE/SHA256SUMS") || { echo "install_te: checksum mismatch (see above)" >&2; exit 1; }
python3 -m pip install -q --no-deps --no-index --no-compile --target "$TARGET" "$work/$core" \
  "$work/transformer_engine-2.20.2-py3-none-any.whl" $(ls "$DIR"/pydantic*.whl "$DIR"/annotated_types*.whl \
  "$DIR"/typing_inspection*.whl)
lib="$TARGET/transformer_engine/wheel_lib"
mkdir -p "$lib"
so=${TE_TORCH_SO:-$(ls "$DIR"/transformer_engine_torch.cpython-*.so 2>/dev/null | head -1 || true)}
built=0
if [ -n "$so" ]; then
  cp "$so" "$lib/"
  echo "install_te: torch extension: prebuilt $(basename "$so") ($(sha256sum "$so" | cut -c1-16)...)"
else
  echo "install_te: building the torch extension from the sdist (about 8 minutes on 16 cores)"
  tar -xzf "$work/transformer_engine_torch-2.20.2.tar.gz" -C "$work"
  ( cd "$work/transformer_engine_torch-2.20.2" &&
    NVTE_FRAMEWORK=pytorch MAX_JOBS=$(nproc) NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} PYTHONPATH="$TARGET" \
      python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$TARGET" . )
  # pip leaves the built library in the sdist's build folder when TARGET already holds transformer_engine/.
  built_so=$(find "$work/transformer_engine_torch-2.20.2" "$TARGET" -name 'transformer_engine_torch.cpython-*.so' | head -1)
  [ -n "$built_so" ] || { echo "install_te: the extension build left no transformer_engine_torch*.so" >&2; exit 1; }
  [ "$built_so" -ef "$lib/$(basename "$built_so")" ] || cp "$built_so" "$lib/"
  built=1
fi
PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'PY'
import torch, transformer_engine, transformer_engine.pytorch, transformer_engine_torch
print(f"install_te: transformer_engine {transformer_engine.__version__} imports (torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, extension {transformer_engine_torch.__file__})")
PY
[ $built = 1 ] && echo "install_te: keep $lib/$(basename "$built_so") to skip the build next time (same torch and TE)"
exit 0
