#!/usr/bin/env bash
# A new user's first steps, as docs/python.md gives them: a new virtualenv, `pip install ./python` alone (no CMake
# build of one's own, no cpgold binary, no CPGOLD_BIN), then a fixture generated and numpy outputs checked in process,
# the pytest plugin over the quick suite, and the package's tests against the installed package (those that need the
# cpgold binary skip). Needs the Debian packages of .ci/install-deps and PyPI. CI runs it after the CMake tests.
#   python/tests/fresh_venv.sh            (PYTHON=/path/to/python3 to choose the interpreter; default Debian's)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-/usr/bin/python3}
work=$(mktemp -d)
build="$work/build"  # a new build folder: nothing of an earlier `pip install` is reused (a compiler cache may be)
trap 'rm -rf "$work"' EXIT
unset CPGOLD_BIN PYTHONPATH

t0=$(date +%s)
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --config-settings=build-dir="$build" "$repo/python" pytest ml_dtypes
t1=$(date +%s)
echo "fresh-venv: pip install ./python took $((t1 - t0)) s"

cd "$work"
export REPO="$repo"
"$work/venv/bin/python" - <<'PY'
import os, sys
sys.path.insert(0, os.path.join(os.environ["REPO"], "python", "examples"))
import numpy as np
import cpgold, cpgold.testing
from numpy_varlen_attention import attention_on_fixture

assert cpgold._core_loader.core().__file__.startswith(sys.prefix), "the extension comes from the virtualenv"
fx = cpgold.generate({"seqlens_q": [57, 0, 9], "cp_size": 2, "mask": "causal", "heads_q": 4, "heads_kv": 2,
                      "dim_qk": 64})                                   # in memory, no file
out = attention_on_fixture(fx)                                         # numpy outputs
report = cpgold.testing.assert_close(fx, out, lse_layout="ht")
print("fresh-venv: numpy outputs checked in process:", report["verdict"])
for rank, local in enumerate(fx.shard_outputs(out)):
    cpgold.testing.assert_close(fx, local, rank=rank, lse_layout="ht")
try:
    cpgold.testing.assert_close(fx, attention_on_fixture(fx, "gqa_modulo"), lse_layout="ht")
    raise SystemExit("fresh-venv: a wrong attention passed")
except AssertionError as e:
    assert "first divergence" in str(e) and "reproduce: cpgold gen --case" in str(e)
print("fresh-venv: a wrong attention fails with the report")
PY
CPGOLD_CACHE="$work/cache" "$work/venv/bin/python" -m pytest -q -p no:cacheprovider \
  "$repo/docs/python/test_attention_example.py" --cpgold-suite quick
"$work/venv/bin/python" -m pytest -q -rs -p no:cacheprovider "$repo/python/tests" -m "not slow"
echo "fresh-venv: done in $(($(date +%s) - t0)) s"
