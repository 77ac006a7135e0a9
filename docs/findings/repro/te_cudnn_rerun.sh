#!/bin/bash
# TE-2, TE-3 and TE-5 (docs/findings/) with TransformerEngine on the cuDNN that torch carries, beside the cuDNN TE
# loads by itself, and the cuDNN each run actually loaded. Run from the repository root on the GPU machine, with TE
# installed (lab/outsiders/device_run.sh outsiders puts it in /tmp/outsiders/prefix/te).
#
#   TE_DIR=/tmp/outsiders/prefix/te bash docs/findings/repro/te_cudnn_rerun.sh
#
# How TE 2.20.2 picks its cuDNN (transformer_engine/common/__init__.py, _load_cuda_library("cudnn"), run when TE is
# imported): first the system, in this order: $CUDNN_HOME, $CUDNN_PATH, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, each
# searched recursively for libcudnn.so* (stubs left out, the highest file name taken), then libcudnn.so through the
# dynamic loader (LD_LIBRARY_PATH, ldconfig); only then the Python packages (site-packages/nvidia/cu13/..., nvidia/
# cudnn/lib: where torch's cuDNN wheel lives). It loads that file with RTLD_GLOBAL before its own library. So
# CUDNN_HOME=<the folder of torch's libcudnn.so.9> makes TE load torch's cuDNN; LD_LIBRARY_PATH gets the same folder
# first, so that cuDNN's own sub-libraries (libcudnn_graph, libcudnn_engines_*) come from it too.
#
# Modes: te-default (as installed, the way the earlier runs ran: TE reported 9.14.0 there), torch (CUDNN_HOME = the
# folder of the libcudnn.so.9 torch maps itself), and one per folder in EXTRA_CUDNN_DIRS (another cuDNN, e.g. a newer
# nvidia-cudnn-cu13 wheel unpacked there). Runs per mode: te3 default and deterministic backward, te5 default and
# deterministic, te2 --stats (one GPU), te2 CP (when 2 GPUs are visible). Each run prints TE's cuDNN version
# (transformer_engine.pytorch.get_cudnn_version), torch's (torch.backends.cudnn.version(), which raises when TE
# loaded another cuDNN), the libcudnn files mapped in the process, and the cudnn_version of TE's own NVTE_DEBUG=1
# NVTE_DEBUG_LEVEL=2 configuration line. Whole outputs in LOGS (default $OUT/te_cudnn_rerun when OUT is set, else
# /tmp/te_cudnn_rerun). Environment: TE_DIR, EXTRA_CUDNN_DIRS, MODES (default "te-default torch" plus the extra
# folders), RUNS (default "te3 te3-det te5 te5-det te2-stats te2-cp"), RUN_TIMEOUT (seconds per run, default 600).
# Exit: 0 every run made (whatever it found), 2 unusable setup.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
TE_DIR=${TE_DIR:-/tmp/outsiders/prefix/te}
LOGS=${LOGS:-${OUT:+$OUT/te_cudnn_rerun}}
LOGS=${LOGS:-/tmp/te_cudnn_rerun}
RUNS=${RUNS:-te3 te3-det te5 te5-det te2-stats te2-cp}
[ -d "$TE_DIR/transformer_engine" ] \
  || { echo "te_cudnn_rerun: TE_DIR=$TE_DIR holds no transformer_engine" >&2; exit 2; }
mkdir -p "$LOGS" || exit 2
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>/dev/null \
  || echo "te_cudnn_rerun: nvidia-smi failed"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)

# torch's own cuDNN, in a process without TE
TORCH_CUDNN_DIR=$(python3 - <<'PY'
import os, torch
v = torch.backends.cudnn.version()   # loads torch's cuDNN
with open("/proc/self/maps") as f:
    libs = sorted({l.split()[-1] for l in f if "/libcudnn.so" in l})
print(os.path.dirname(libs[0]) if libs else "")
PY
)
torch_says=$(python3 -c 'import torch; print(torch.__version__, "cuDNN", torch.backends.cudnn.version())')
echo "te_cudnn_rerun: torch $torch_says from ${TORCH_CUDNN_DIR:-?}"
[ -n "$TORCH_CUDNN_DIR" ] || { echo "te_cudnn_rerun: torch maps no libcudnn.so file: no torch mode" >&2; }

# TE's own search, as transformer_engine/common/__init__.py does it (what te-default loads)
python3 - <<'PY'
import glob, os
for var in ("CUDNN_HOME", "CUDNN_PATH", "CUDA_HOME", "CUDA_PATH", None):
    path = os.environ.get(var) if var else "/usr/local/cuda"
    if not path:
        print(f"te_cudnn_rerun: TE search {var}: not set")
        continue
    libs = sorted((l for l in glob.glob(f"{path}/**/libcudnn.so*", recursive=True) if "stub" not in l),
                  reverse=True, key=os.path.basename)
    print(f"te_cudnn_rerun: TE search {var or '/usr/local/cuda'} = {path}: "
          + (f"takes {libs[0]}" if libs else "nothing"))
    if libs:
        break
PY
ldconfig -p 2>/dev/null | grep 'libcudnn\.so' | sed 's/^/te_cudnn_rerun: ldconfig: /' | head -4

run_one() {  # run_one MODE RUN: one reproduction under one cuDNN mode; prints one summary line
  local mode=$1 run=$2 dir="" args
  case $mode in te-default) ;; torch) dir=$TORCH_CUDNN_DIR ;; *) dir=$mode ;; esac
  case $run in
    te3) args="$HERE/te3_gqa_query_less_dkdv.py" ;;
    te3-det) args="$HERE/te3_gqa_query_less_dkdv.py --deterministic" ;;
    te5) args="$HERE/te5_d256_backward.py" ;;
    te5-det) args="$HERE/te5_d256_backward.py --deterministic" ;;
    te2-stats) args="$HERE/te2_p2p_keyless_step.py --stats" ;;
    te2-cp) if [ "$gpus" -lt 2 ]; then echo "$mode $run: not run ($gpus GPU visible, 2 needed)"; return; fi
            args="$HERE/te2_p2p_keyless_step.py" ;;
    *) echo "$mode $run: unknown run"; return ;;
  esac
  local log
  log=$LOGS/$(echo "$mode" | tr '/' '_')-$run.log
  if [ -n "$dir" ]; then
    env PYTHONPATH=$TE_DIR CUDNN_HOME=$dir LD_LIBRARY_PATH=$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} NVTE_DEBUG=1 \
      NVTE_DEBUG_LEVEL=2 NCCL_NVLS_ENABLE=0 timeout ${RUN_TIMEOUT:-600} python3 $args > "$log" 2>&1
  else
    env PYTHONPATH=$TE_DIR NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 NCCL_NVLS_ENABLE=0 timeout ${RUN_TIMEOUT:-600} \
      python3 $args > "$log" 2>&1
  fi
  local rc=$? verdict
  case $rc in 0) verdict="not reproduced";; 1) verdict="REPRODUCED";; 2) verdict="could not run";;
    *) verdict="ended with exit $rc";; esac
  local loaded debug
  loaded=$(grep -m1 '^versions: ' "$log" | python3 -c 'import json, sys
line = sys.stdin.read().strip()
v = json.loads(line[10:]) if line else {}
print("cuDNN TE %s, torch %s, files %s" % (v.get("cudnn_te", "?"), v.get("cudnn_torch", "?"),
      ",".join(v.get("cudnn_files", [])) or "?"))')
  debug=$(grep -o "'cudnn_version': '[^']*'" "$log" | sort -u | sed "s/'cudnn_version': //" | tr -d "'" | tr '\n' ' ')
  echo "$mode $run: $verdict (exit $rc); $loaded; NVTE_DEBUG cudnn_version ${debug:-not logged}"
  grep -E '<--|^  |^(query-less|tensors over|statistics|cases wrong|cannot run)' "$log" | grep -v -i warn | head -24 \
    | sed 's/^/    /'
}

modes=${MODES:-te-default ${TORCH_CUDNN_DIR:+torch} ${EXTRA_CUDNN_DIRS:-}}
summary=()
for mode in $modes; do
  for run in $RUNS; do
    line=$(run_one "$mode" "$run")
    echo "$line"
    summary+=("$(echo "$line" | head -1)")
  done
done
echo "== te_cudnn_rerun summary (mode run: verdict; cuDNN each run loaded)"
printf '%s\n' "${summary[@]}"
