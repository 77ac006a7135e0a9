"""Names survive shrinking (docs/diagnosis.md, "Names survive shrinking"; docs/shrink.md): every door keeps a smaller
case only while its diagnosis names every kind the original's names and no cause the original's does not (symptoms,
pad_rows_not_zero and nonfinite_leak, may come and go), and where the answer's diagnosis is not the original's a note
says why, in the same words: `cpgold shrink` (check/shrink.cpp: shrink_same_way, shrink_name_note), cpgold.shrink
(its search is the C++ one; its confirmation and note are python/cpgold/shrink.py's) and cpgold.capture's shrink
(python/cpgold/capture/shrinking.py).

The implementation under test is tests/fixtures/planted_candidate behind a small script that plants one bug on cases
of more than 8 tokens and another on smaller ones: the name changes on the way down, so a search that keeps any
failure ends on the other name (and says why), and one that keeps the original's name never reaches it.
"""
import json
import os
import subprocess
import sys

import pytest

import cpgold
from cpgold.capture import shrinking
from cpgold.shrink import _name_note, _same_way

BIN = os.environ.get("CPGOLD_BIN")
PLANTED = os.environ.get("CPGOLD_PLANTED_CANDIDATE")

START = {"seqlens_q": [30, 13], "cp_size": 2, "mask": "causal", "heads_q": 2, "heads_kv": 1, "dim_qk": 8,
         "dtype": "bf16"}

# planted_candidate FIXTURE CANDIDATE KIND FORM --per-rank-only: chunks r and 2W-1-r swapped on one rank above 8 tokens, the last
# valid row of each sequence on each rank unwritten at 8 tokens or fewer.
SCRIPT = r'''
import json, subprocess, sys
import h5py
fixture, candidate, planted = sys.argv[1], sys.argv[2], sys.argv[3]
with h5py.File(fixture, "r") as f:
    case = json.loads(f["case"].attrs["case_json"])
bug = ["chunk_order", "0"] if sum(case["seqlens_q"]) > 8 else ["tail_rows_missing", "1"]
sys.exit(subprocess.run([planted, fixture, candidate] + bug + ["--per-rank-only"]).returncode)
'''


def test_the_same_way_rule():
    """The rule of every door: the original's kinds named, no new cause, symptoms free to come and go."""
    original = ["per_rank_counts", "nonfinite_leak"]
    kinds = original
    assert _same_way(kinds, original, ["per_rank_counts", "nonfinite_leak"])
    assert not _same_way(kinds, original, ["per_rank_counts"])  # every kind asked for must be named
    assert _same_way(["per_rank_counts"], original, ["per_rank_counts", "pad_rows_not_zero"])  # a symptom comes
    assert not _same_way(["per_rank_counts"], original, ["per_rank_counts", "chunk_order"])  # a new cause
    assert not _same_way(["lse_convention"], ["lse_convention"], ["unexplained"])  # the name left open
    assert _same_way([], ["chunk_order"], ["tail_rows_missing"])  # any failure
    assert not _same_way(["chunk_order"], ["chunk_order"], ["chunk_order"], "passes")
    # cpgold.capture's search holds the same rule
    search = shrinking._Search.__new__(shrinking._Search)
    search.kinds = {"tail_rows_missing"}
    search.original_verdict = {"kinds": ["tail_rows_missing"]}
    assert search.same_way({"status": "fails", "kinds": ["tail_rows_missing"]})
    assert not search.same_way({"status": "fails", "kinds": ["chunk_order", "tail_rows_missing"]})
    assert search.same_way({"status": "fails", "kinds": ["tail_rows_missing", "nonfinite_leak"]})


def test_the_note_says_why_a_name_changed():
    assert _name_note(["chunk_order"], ["chunk_order"], ["chunk_order"]) == ""
    assert _name_note(["per_rank_counts", "nonfinite_leak"], ["per_rank_counts", "nonfinite_leak"],
                      ["nonfinite_leak", "per_rank_counts"]) == ""
    assert _name_note(["per_rank_counts"], ["per_rank_counts", "nonfinite_leak"], ["per_rank_counts"]) == (
        "the smallest case's diagnosis (per_rank_counts) is not the original's (per_rank_counts, nonfinite_leak): "
        "nonfinite_leak is a symptom, which comes and goes with the padding and the pad fill")
    assert _name_note(["merge"], ["merge", "tail_rows_missing"], ["merge"]) == (
        "the smallest case's diagnosis (merge) is not the original's (merge, tail_rows_missing): tail_rows_missing "
        "was not required (a kept failure names merge)")
    assert _name_note([], ["chunk_order"], ["tail_rows_missing"]) == (
        "the smallest case's diagnosis (tail_rows_missing) is not the original's (chunk_order): any failure was "
        "kept, whatever its diagnosis (any failure)")


def _doors(tmp_path, any_failure):
    """The same search through `cpgold shrink` and cpgold.shrink: (the command's JSON, cpgold.shrink's result)."""
    if not (BIN and PLANTED and os.path.isfile(BIN) and os.path.isfile(PLANTED)):
        pytest.skip("CPGOLD_BIN and CPGOLD_PLANTED_CANDIDATE name the built cpgold and planted_candidate")
    script = tmp_path / "impl.py"
    script.write_text(SCRIPT)
    golden = str(tmp_path / "g.h5")
    cpgold.generate(START, path=golden).close()
    command = f"{sys.executable} {script} {{fixture}} {{candidate}} {PLANTED}"
    args = [BIN, "shrink", golden, "--run", command, "--format", "json", "--confirm", "1", "--max-runs", "80"]
    p = subprocess.run(args + (["--any-failure"] if any_failure else []), capture_output=True, text=True,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    cli = json.loads(p.stdout)

    def fn(fx):
        case = json.loads(fx.case_json)
        bug = ["chunk_order", "0"] if sum(case["seqlens_q"]) > 8 else ["tail_rows_missing", "1"]
        path = str(tmp_path / "fx.h5")
        out = str(tmp_path / "cand.h5")
        for f in (path, out):
            if os.path.exists(f):
                os.remove(f)
        with open(path, "wb") as f:
            f.write(fx.source)
        subprocess.run([PLANTED, path, out] + bug + ["--per-rank-only"], check=True, capture_output=True)
        return [cpgold.read_candidate(out, rank=r) for r in range(case["cp_size"])]

    py = cpgold.shrink(START, fn, any_failure=any_failure, confirm=1, max_runs=80, lse_layout="ht")
    return cli, py


@pytest.mark.parametrize("any_failure", [False, True], ids=["the-original-name", "any-failure"])
def test_both_doors_keep_the_name_or_say_why_it_changed(core, tmp_path, any_failure):
    cli, py = _doors(tmp_path, any_failure)
    assert cli["original"]["diagnosis"] == py["original_verdict"]["kinds"] == ["chunk_order"]
    assert json.loads(cli["smallest"]["case_json"]) == json.loads(py["smallest"])
    assert cli["smallest"]["diagnosis"] == py["smallest_verdict"]["kinds"]
    name_notes = [n for n in cli["notes"] if n.startswith("the smallest case's diagnosis")]
    assert name_notes == [n for n in py["notes"] if n.startswith("the smallest case's diagnosis")]
    tokens = sum(json.loads(cli["smallest"]["case_json"])["seqlens_q"])
    if any_failure:
        # below 9 tokens the bug is another: the name changed, and both doors say why
        # (tail_rows_missing, or unexplained where the last row of one token leaves nothing to tell it by)
        smallest = cli["smallest"]["diagnosis"]
        assert tokens <= 8 and "chunk_order" not in smallest
        assert name_notes == [f"the smallest case's diagnosis ({', '.join(smallest)}) is not the original's "
                              "(chunk_order): any failure was kept, whatever its diagnosis (any failure)"]
    else:
        # the search stops where the name would change: the smallest case still carries chunk_order
        assert tokens > 8 and cli["smallest"]["diagnosis"] == ["chunk_order"]
        assert name_notes == []
