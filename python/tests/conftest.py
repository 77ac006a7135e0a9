"""Shared pytest fixtures: the package and the examples on sys.path, the committed golden set, the cpgold binary,
the package's C++ core."""
import glob
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
try:  # the installed package (pip install ./python), else the source tree's
    import cpgold  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, os.path.join(REPO, "python", "examples"))
GOLDEN = os.path.join(REPO, "fixtures", "data", "golden")

pytest_plugins = ["pytester"]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes; CTest runs it as python_parity_slow (label python_slow)")


def golden_path(name):
    return os.path.join(GOLDEN, name + ".h5")


def golden_names():
    return sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(GOLDEN, "*.h5")))


@pytest.fixture
def cpgold_bin():
    path = os.environ.get("CPGOLD_BIN")
    if not path or not os.path.isfile(path):
        pytest.skip("CPGOLD_BIN is not set to the cpgold binary (CTest sets it)")
    return path


@pytest.fixture
def core():
    """cpgold's C++ core; the test is skipped, naming why, when the extension was not built."""
    import cpgold._core_loader as loader

    try:
        return loader.core()
    except ImportError as e:
        pytest.skip(str(e))
