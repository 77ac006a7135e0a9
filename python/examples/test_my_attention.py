"""pytest example: validate your attention against a folder of cpgold fixtures, global and per rank, through candidate
files (the path for outputs that come from another process). docs/python/test_attention_example.py is the shorter
form with the pytest plugin and in-process checks.

    CPGOLD_FIXTURES=fixtures/data/golden python3 -m pytest python/examples/test_my_attention.py

Replace `my_attention` with a call of your kernel: it gets a cpgold.Fixture and returns global-layout outputs
o [Tq, hq, dv], lse [hq, Tq], dq, dk, dv as numpy arrays or torch tensors, zero on pad rows (an LSE of another
layout: change lse_layout, or give TransformerEngine's [Tq, hq, 1] with lse_layout=None).
CPGOLD_FIXTURES: a folder of *.h5 fixtures (`cpgold gen --suite quick -o DIR`) or one file; default the committed
golden set.
"""
import glob
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cpgold  # noqa: E402  (pip install ./python, or PYTHONPATH=python:build/python; else CPGOLD_BIN is run)
from numpy_varlen_attention import attention_on_fixture  # noqa: E402


def my_attention(fixture):
    return attention_on_fixture(fixture)


def fixture_paths():
    where = os.environ.get("CPGOLD_FIXTURES", os.path.join(HERE, "..", "..", "fixtures", "data", "golden"))
    return sorted(glob.glob(os.path.join(where, "*.h5"))) if os.path.isdir(where) else [where]


@pytest.fixture(params=fixture_paths(), ids=os.path.basename)
def fixture(request):
    with cpgold.Fixture(request.param) as fx:
        yield fx


def test_global(fixture, tmp_path):
    outputs = my_attention(fixture)
    cpgold.write_global(tmp_path / "candidate.h5", outputs, fixture=fixture, lse_layout="ht")
    report = cpgold.check(fixture.path, tmp_path / "candidate.h5")
    assert report["pass"], "\n".join(cpgold.failures(report))


def test_per_rank_files(fixture, tmp_path):
    # A CP implementation writes what each rank holds; here the shards of the global result stand for it.
    shards = fixture.shard_outputs(my_attention(fixture))
    files = []
    for rank, outputs in enumerate(shards):
        files.append(tmp_path / f"rank{rank}.h5")
        cpgold.write_rank(files[-1], rank, outputs, fixture=fixture, lse_layout="ht")
    report = cpgold.check(fixture.path, *files)
    assert report["pass"], "\n".join(cpgold.failures(report))
    assert {r["rank"] for r in report["results"]} == set(range(fixture.cp_size))
