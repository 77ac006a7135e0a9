"""Shared pytest fixtures: the package and the examples on sys.path, the committed golden set, the cpgold binary."""
import glob
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, os.path.join(REPO, "python", "examples"))
GOLDEN = os.path.join(REPO, "fixtures", "golden")


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
