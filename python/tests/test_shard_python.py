"""The Python door of `gen --shard I/N` and `cpgold merge`: cpgold.generate(case, path, shard=(I, N)) writes the part
file gen writes, cpgold.merge(parts, path) the fixture; the merged fixture is the unsharded one byte for byte, parts
of either door merge with either door, and bad shards and part lists are refused naming the field."""
import json
import os
import shutil
import subprocess

import pytest

import cpgold
from cpgold import InputError

pytest.importorskip("cpgold._core", reason="needs cpgold's extension (generate and merge in process)")

CASE = {"seqlens_q": [37, 0, 21], "cp_size": 2, "mask": "causal", "heads_q": 6, "heads_kv": 3, "dim_qk": 16,
        "dtype": "bf16", "comm": "p2p", "seed": 11}


def read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("count", [1, 2, 3])
def test_merged_python_parts_are_the_unsharded_fixture(tmp_path, count):
    whole = tmp_path / "whole.h5"
    cpgold.generate(CASE, whole).close()
    parts = []
    for index in range(count, 0, -1):  # any order
        part = tmp_path / f"part{index}.h5"
        written = cpgold.generate(CASE, part, shard=f"{index}/{count}" if index % 2 else (index, count))
        assert written["path"] == str(part) and written["shard"] == (index, count)
        assert written["bytes"] == os.path.getsize(part)
        kv0, kv1 = written["kv_heads"]
        assert 0 <= kv0 < kv1 <= CASE["heads_kv"]
        parts.append(part)
    with cpgold.merge(parts, tmp_path / "merged.h5") as fx:
        assert fx.case["heads_q"] == 6
    assert read(tmp_path / "merged.h5") == read(whole)


def test_parts_of_both_doors_merge_with_both_doors(tmp_path):
    binary = os.environ.get("CPGOLD_BIN") or shutil.which("cpgold")
    if not binary:
        pytest.skip("CPGOLD_BIN is not set and no cpgold on PATH (run through CTest)")
    whole = tmp_path / "whole.h5"
    cpgold.generate(CASE, whole).close()
    cpgold.generate(CASE, tmp_path / "p1.h5", shard=(1, 2))
    subprocess.run([binary, "gen", "--case", json.dumps(CASE), "--shard", "2/2", "-o", str(tmp_path / "p2.h5")],
                   check=True, capture_output=True)
    cpgold.merge([tmp_path / "p1.h5", tmp_path / "p2.h5"], tmp_path / "py.h5").close()
    subprocess.run([binary, "merge", str(tmp_path / "p2.h5"), str(tmp_path / "p1.h5"), "-o", str(tmp_path / "cli.h5")],
                   check=True, capture_output=True)
    assert read(tmp_path / "py.h5") == read(whole) == read(tmp_path / "cli.h5")


@pytest.mark.parametrize("shard, message", [
    ((0, 2), "shards count from 1"), ((3, 2), "shards count from 1"), ("2", r"is not \(I, N\)"), ("a/b", r"is not \(I, N\)"),
    ((1.5, 2), r"is not \(I, N\)"), ((True, 2), r"is not \(I, N\)"), ((1, 4), "4"),
])
def test_a_bad_shard_is_refused_naming_it(tmp_path, shard, message):
    with pytest.raises(InputError, match=message) as e:
        cpgold.generate(CASE, tmp_path / "p.h5", shard=shard)   # (1, 4): more shards than the case's 3 KV heads
    assert "shard" in str(e.value)
    assert not os.path.exists(tmp_path / "p.h5")


def test_a_shard_needs_a_path():
    with pytest.raises(InputError, match="shard: a part is written to a file"):
        cpgold.generate(CASE, shard=(1, 2))


def test_merge_refuses_incomplete_or_foreign_parts_and_keeps_what_exists(tmp_path):
    cpgold.generate(CASE, tmp_path / "p1.h5", shard=(1, 2))
    with pytest.raises(InputError, match="give a list of part files"):
        cpgold.merge(str(tmp_path / "p1.h5"), tmp_path / "out.h5")
    with pytest.raises(InputError):
        cpgold.merge([tmp_path / "p1.h5"], tmp_path / "out.h5")          # part 2 of 2 missing
    other = dict(CASE, seed=12)
    cpgold.generate(other, tmp_path / "q2.h5", shard=(2, 2))
    with pytest.raises(InputError):
        cpgold.merge([tmp_path / "p1.h5", tmp_path / "q2.h5"], tmp_path / "out.h5")  # another case's part
    assert not os.path.exists(tmp_path / "out.h5")
    cpgold.generate(CASE, tmp_path / "p2.h5", shard=(2, 2))
    (tmp_path / "out.h5").write_bytes(b"keep me")
    with pytest.raises(InputError, match="--force|force"):
        cpgold.merge([tmp_path / "p1.h5", tmp_path / "p2.h5"], tmp_path / "out.h5")
    assert (tmp_path / "out.h5").read_bytes() == b"keep me"
    cpgold.merge([tmp_path / "p1.h5", tmp_path / "p2.h5"], tmp_path / "out.h5", force=True).close()
