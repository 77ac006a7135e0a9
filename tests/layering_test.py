"""The layering rule of docs/layout.md as a test: a C++/CUDA file includes only files of its own concern or of those
below it. Lists every include that points up the order (tests aside) and fails when there is one; first it shows that
it finds one: an upward include planted in a tree of its own must be reported.

    python3 tests/layering_test.py [REPO]        (CTest: layering)
"""
import os
import re
import subprocess
import sys
import tempfile

# The order of docs/layout.md, lowest first; a folder inside a layer is a concern of its own. gpu/comm stands level
# with gpu/kernels, and python with gpu/verify.
ORDER = ("reference sim/case sim/plan sim/thd_helpers sim/program sim/te sim/explain fixtures/storage fixtures/schema "
         "fixtures/golden check gpu/kernels gpu/comm gpu/cp gpu/verify python apps bench").split()
RANK = {layer: i for i, layer in enumerate(ORDER)}
RANK["gpu/comm"] = RANK["gpu/kernels"]
RANK["python"] = RANK["gpu/verify"]
SOURCE = re.compile(r"\.(hpp|cpp|cu|cuh)$")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer(path):
    """The layer or concern a path lies in (the longest of ORDER it starts with), or None."""
    best = None
    for name in RANK:
        if path.startswith(name + "/") and (best is None or len(name) > len(best)):
            best = name
    return best


def sources(root):
    """The C++/CUDA files of the repository, as git lists them (tracked and untracked but not ignored), or, outside a
    git checkout, every such file below the layer folders (build folders left out); tests/ aside."""
    try:
        listed = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        listed = []
        for top in {p.split("/")[0] for p in ORDER}:
            for folder, dirs, names in os.walk(os.path.join(root, top)):
                dirs[:] = [d for d in dirs if not d.startswith(("build", "."))]
                listed += [os.path.relpath(os.path.join(folder, n), root) for n in names]
    return sorted(p for p in listed if SOURCE.search(p) and not p.startswith("tests/")
                  and os.path.isfile(os.path.join(root, p)))


def upward_includes(root, files=None):
    """Every include (file, line, included path) from a layer to one above it."""
    found = []
    for path in files if files is not None else sources(root):
        own = layer(path)
        if own is None:
            continue
        with open(os.path.join(root, path), errors="replace") as f:
            text = f.read()
        for m in INCLUDE.finditer(text):
            other = layer(m.group(1))
            if other is not None and RANK[other] > RANK[own]:
                found.append((path, text.count("\n", 0, m.start()) + 1, m.group(1)))
    return found


def planted_is_found():
    """A tree with sim/plan including check/ (up) and check/ including sim/plan (down): only the first is reported."""
    with tempfile.TemporaryDirectory() as tmp:
        for path, text in (("sim/plan/a.hpp", '#include "check/engine.hpp"\n#include "reference/mask.hpp"\n'),
                           ("check/engine.hpp", '#include "sim/plan/a.hpp"\n'),
                           ("reference/mask.hpp", "")):
            os.makedirs(os.path.dirname(os.path.join(tmp, path)), exist_ok=True)
            with open(os.path.join(tmp, path), "w") as f:
                f.write(text)
        return upward_includes(tmp, ["sim/plan/a.hpp", "check/engine.hpp", "reference/mask.hpp"]) == \
            [("sim/plan/a.hpp", 1, "check/engine.hpp")]


def main(argv):
    root = os.path.abspath(argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    if not planted_is_found():
        print("layering: the planted upward include was not reported as the only one: the check itself is broken")
        return 1
    files = sources(root)
    if not files:
        print(f"layering: no C++ source found under {root}")
        return 1
    found = upward_includes(root, files)
    for path, line, included in found:
        print(f"{path}:{line} includes {included}, a layer above its own (docs/layout.md)")
    print(f"layering: {len(files)} files read, {len(found)} include(s) pointing up the order")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
