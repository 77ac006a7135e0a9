"""CTest entry point of the Python package tests: runs pytest on the given paths, or reports the test as skipped
(exit 77, CTest's SKIP_RETURN_CODE) with the missing module and its Debian package named.
--require-core: also skipped, naming why, when the package's C++ core (cpgold._core) was not built."""
import importlib
import os
import sys

SKIP = 77
NEEDED = (("numpy", "python3-numpy"), ("h5py", "python3-h5py"), ("pytest", "python3-pytest"))


def main(argv):
    missing = []
    for module, package in NEEDED:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(f"{module} (Debian: {package})")
    if missing:
        print(f"SKIPPED: {sys.executable} lacks " + ", ".join(missing) + "; the Python package tests did not run")
        return SKIP
    if argv and argv[0] == "--require-core":
        argv = argv[1:]
        try:
            importlib.import_module("cpgold._core")
        except ImportError as e:
            print(f"SKIPPED: cpgold's extension (cpgold._core) is not built ({e}): configure with pybind11 and "
                  "Python's headers (Debian: pybind11-dev, python3-dev), or pip install ./python")
            return SKIP
    import tempfile

    import pytest

    # Fixtures the plugin generates go to a new folder each run, so that a build whose generator changed never meets
    # fixtures cached by an earlier one (users keep theirs, keyed by case, schema and generator version).
    with tempfile.TemporaryDirectory(prefix="cpgold-fixture-cache-") as cache:
        os.environ["CPGOLD_CACHE"] = cache
        return pytest.main(["-q", "-rs", "-p", "no:cacheprovider", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
