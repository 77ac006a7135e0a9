#!/bin/bash
# FA-3 across flash-attn-4 releases (docs/findings/fa-3-causal-window-minus-one.md): installs the flash-attn-4 wheels
# 4.0.0b29, 4.0.0b30 and 4.0.0b36 into separate folders and runs fa3_causal_window_minus_one.py against each,
# directly (torch and flash-attn-4) and, where TransformerEngine is installed, under TE's DotProductAttention
# (NVTE_FLASH_ATTN=1, flash-attn-3 kept off the path). One line per (wheel, route): reproduced, not reproduced, or
# could not run. Run from the repository root on the GPU machine.
#
#   bash docs/findings/repro/fa3_bisect.sh
#
# Every beta's METADATA asks for nvidia-cutlass-dsl>=4.6.2, quack-kernels>=0.5.3, apache-tvm-ffi<0.2 (>=0.1.12 for
# b29 and b30, >=0.1.11 for b36) and torch-c-dlpack-ext: one CuTe DSL install (4.8.1, the version of the earlier
# runs) serves all three, and this script prints each wheel's requirement lines before it runs it.
#
# Environment:
#   WHEELS    folder of carried wheels (default .whl): flash_attn_4-4.0.0b{29,30,36}-py3-none-any.whl, and, unless
#             DSL_DIR names an installed CuTe DSL, nvidia_cutlass_dsl{,_libs_base,_libs_core,_libs_cu13}-4.8.1,
#             quack_kernels-0.6.5, apache_tvm_ffi-0.1.15.post2 and torch_c_dlpack_ext-0.1.5. A wheel above the carry
#             limit comes as NAME.whl.part-NN pieces (split -b 46000000 -d NAME.whl NAME.whl.part-), one call each.
#   STASH     where the wheels of several calls are gathered (default /tmp/fa3_bisect/wheels); a call that finds
#             the set incomplete says what is missing and exits 3, the next call goes on
#   DSL_DIR   an installed CuTe DSL to reuse instead of the DSL wheels (default /tmp/outsiders/prefix/fa4 when it
#             holds nvidia_cutlass_dsl: lab/outsiders/device_run.sh outsiders made it)
#   TE_DIR    an installed TransformerEngine for the route te (default /tmp/outsiders/prefix/te when it exists);
#             none: the route te is reported as not run
#   VERSIONS  the betas (default "4.0.0b29 4.0.0b30 4.0.0b36")
#   LOGS      where each run's whole output goes (default $OUT/fa3_bisect when OUT is set, else /tmp/fa3_bisect/logs)
# Exit: 0 every run made (whatever it found), 2 unusable setup, 3 wheels still missing (call again with the rest).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
WHEELS=${WHEELS:-.whl}
BASE=/tmp/fa3_bisect
STASH=${STASH:-$BASE/wheels}
VERSIONS=${VERSIONS:-4.0.0b29 4.0.0b30 4.0.0b36}
LOGS=${LOGS:-${OUT:+$OUT/fa3_bisect}}
LOGS=${LOGS:-$BASE/logs}
SUMS=$HERE/SHA256SUMS_FA4_BISECT
REPRO=$HERE/fa3_causal_window_minus_one.py
L228=manylinux_2_28_x86_64
DSL_WHEELS="nvidia_cutlass_dsl-4.8.1-py3-none-any.whl nvidia_cutlass_dsl_libs_base-4.8.1-cp312-cp312-$L228.whl
 nvidia_cutlass_dsl_libs_core-4.8.1-py3-none-any.whl nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-$L228.whl
 quack_kernels-0.6.5-py3-none-any.whl apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.$L228.whl
 torch_c_dlpack_ext-0.1.5-cp312-cp312-manylinux_2_24_x86_64.$L228.whl"
mkdir -p "$STASH" "$LOGS" || { echo "fa3_bisect: cannot create $STASH or $LOGS" >&2; exit 2; }
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>/dev/null \
  || echo "fa3_bisect: nvidia-smi failed"

# 1. gather this call's wheels (and pieces) with those of earlier calls; join complete pieces
if [ -d "$WHEELS" ]; then
  for f in "$WHEELS"/*.whl "$WHEELS"/*.whl.part-*; do [ -f "$f" ] && cp "$f" "$STASH/"; done
fi
for first in "$STASH"/*.whl.part-00; do
  [ -f "$first" ] || continue
  whl=${first%.part-00}; name=$(basename "$whl")
  ls "$whl".part-* | sort | xargs cat > "$whl.joined"
  want=$(awk -v n="$name" '$2 == n {print $1}' "$SUMS")
  if [ -n "$want" ] && [ "$(sha256sum "$whl.joined" | cut -d' ' -f1)" = "$want" ]; then
    mv "$whl.joined" "$whl" && rm -f "$whl".part-*
    echo "fa3_bisect: $name joined from its pieces"
  else
    rm -f "$whl.joined"
    echo "fa3_bisect: $name: pieces $(ls "$whl".part-* | sed 's/.*part-//' | tr '\n' ' ')do not make the wheel"
  fi
done

# 2. which wheels are needed, and are they here and intact
needed=""
for v in $VERSIONS; do needed="$needed flash_attn_4-$v-py3-none-any.whl"; done
DSL_DIR=${DSL_DIR:-}
if [ -z "$DSL_DIR" ] && [ -d /tmp/outsiders/prefix/fa4/nvidia_cutlass_dsl ]; then DSL_DIR=/tmp/outsiders/prefix/fa4; fi
if [ -z "$DSL_DIR" ] || [ ! -d "$DSL_DIR/nvidia_cutlass_dsl" ]; then
  [ -n "$DSL_DIR" ] && echo "fa3_bisect: DSL_DIR=$DSL_DIR holds no nvidia_cutlass_dsl: installing the DSL wheels"
  DSL_DIR=$BASE/dsl
  [ -f "$DSL_DIR/.installed" ] || needed="$needed $DSL_WHEELS"
fi
missing=""
for w in $needed; do
  if [ ! -f "$STASH/$w" ]; then missing="$missing $w"; continue; fi
  want=$(awk -v n="$w" '$2 == n {print $1}' "$SUMS")
  [ "$(sha256sum "$STASH/$w" | cut -d' ' -f1)" = "$want" ] \
    || { echo "fa3_bisect: $w does not match $SUMS: removed, carry it again"; rm -f "$STASH/$w"
         missing="$missing $w"; }
done
if [ -n "$missing" ]; then
  echo "fa3_bisect: waiting for:$missing"; echo "fa3_bisect: have: $(ls "$STASH" | tr '\n' ' ')"; exit 3
fi

# 3. install: the DSL once (one pip call: pip --target does not merge a second nvidia_cutlass_dsl wheel), each beta
#    into its own folder
if [ "$DSL_DIR" = "$BASE/dsl" ] && [ ! -f "$DSL_DIR/.installed" ]; then
  files=(); for w in $DSL_WHEELS; do files+=("$STASH/$w"); done
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$DSL_DIR" "${files[@]}" \
    && touch "$DSL_DIR/.installed" || { echo "fa3_bisect: the DSL install failed"; exit 2; }
fi
echo "fa3_bisect: CuTe DSL from $DSL_DIR:" "$DSL_DIR"/nvidia_cutlass_dsl-*.dist-info
for v in $VERSIONS; do
  w=$STASH/flash_attn_4-$v-py3-none-any.whl
  python3 - "$w" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = [l for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:") and "extra ==" not in l]
print(f"fa3_bisect: {sys.argv[1].rsplit('/', 1)[-1]} asks for: " + "; ".join(l[15:] for l in lines))
PY
  [ -f "$BASE/fa4-$v/.installed" ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
      --target "$BASE/fa4-$v" "$w" && touch "$BASE/fa4-$v/.installed"; } \
    || { echo "fa3_bisect: installing $w failed"; exit 2; }
done
TE_DIR=${TE_DIR:-}
if [ -z "$TE_DIR" ] && [ -d /tmp/outsiders/prefix/te/transformer_engine ]; then TE_DIR=/tmp/outsiders/prefix/te; fi

# 4. run: one line per (wheel, route)
verdict() { case $1 in 0) echo "not reproduced";; 1) echo "REPRODUCED";; 2) echo "could not run";;
  *) echo "ended with exit $1";; esac; }
summary=()
for v in $VERSIONS; do
  path=$BASE/fa4-$v:$DSL_DIR:$DSL_DIR/nvidia_cutlass_dsl/dsl_packages
  for route in direct te; do
    log=$LOGS/$v-$route.log
    if [ "$route" = te ]; then
      if [ -z "$TE_DIR" ]; then summary+=("$v $route: not run (no TransformerEngine: set TE_DIR)"); continue; fi
      env PYTHONPATH=$TE_DIR:$path NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 NCCL_NVLS_ENABLE=0 \
        timeout ${RUN_TIMEOUT:-600} python3 "$REPRO" --route te > "$log" 2>&1
    else
      env PYTHONPATH=$path timeout ${RUN_TIMEOUT:-600} python3 "$REPRO" --route direct > "$log" 2>&1
    fi
    rc=$?
    loaded=$(grep -m1 '^versions: ' "$log" | python3 -c 'import json,sys
line = sys.stdin.read().strip()
print(json.loads(line[10:]).get("flash-attn-4", "?") if line else "?")')
    note=""
    [ "$loaded" = "$v" ] || [ "$loaded" = "?" ] || note=" (but the run loaded flash-attn-4 $loaded: not this wheel)"
    te_line=$(grep -m1 -o 'TE ran [^;]*' "$log")
    summary+=("$v $route: $(verdict $rc) (exit $rc)$note${te_line:+; $te_line}")
    echo "== $v $route (exit $rc): $log"
    grep -v -i 'warn' "$log" | grep -E '^(versions|  |batches|cannot|smallest|n2_repro)' | head -14
  done
done
echo "== fa3_bisect summary (flash-attn-4 wheel, route: verdict)"
printf '%s\n' "${summary[@]}"
