"""`cpgold shrink` with fake implementations as COMMAND: a planted bug (tests/fixtures/planted_candidate), a per-rank
Python runner, and every way COMMAND can fail (non-zero exit, no candidate, a timeout), which must count as "no
candidate", never as a pass."""
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

import cpgold

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("CPGOLD_BIN")
PLANTED = os.environ.get("CPGOLD_PLANTED_CANDIDATE")
pytestmark = pytest.mark.skipif(not BIN or not PLANTED,
                                reason="CPGOLD_BIN and CPGOLD_PLANTED_CANDIDATE are not set (run through CTest)")

START = {"seqlens_q": [150, 3, 61], "padded_q": [160, 16, 64], "heads_q": 4, "heads_kv": 2, "dim_qk": 16,
         "mask": "causal", "cp_size": 4, "comm": "p2p", "pad_fill": "nan", "seed": 11}


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("shrink") / "start.h5")
    subprocess.run([BIN, "gen", "--case", json.dumps(START), "-o", path], check=True, capture_output=True)
    return path


def shrink(golden, command, *args):
    p = subprocess.run([BIN, "shrink", golden, "--run", command, "--format", "json", *args], capture_output=True,
                       text=True, timeout=600)
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None, p.stderr


def planted(kind, form, rank=0):
    return f"{shlex.quote(PLANTED)} {{fixture}} {{candidate}} {kind} {form} {rank}"


def test_planted_chunk_order_shrinks_and_is_deterministic(golden):
    code, a, err = shrink(golden, planted("chunk_order", 0))
    assert code == 0, err
    assert a["kinds"] == ["chunk_order"] and a["smallest"]["diagnosis"] == ["chunk_order"]
    assert a["original"]["rows_q"] == 240 and a["smallest"]["rows_q"] <= 4
    assert a["smaller"] and a["stopped"] == "minimal"
    assert a["confirmed"] and not a["flaky"] and a["confirmation_runs"] == 2  # confirmed by default (--confirm 2)
    assert "shrink: run 1 " in err and "the original: fails (chunk_order)" in err  # progress lines
    assert a["reproduce"][0].startswith("cpgold gen --case '") and a["reproduce"][2].startswith("cpgold check case.h5")
    assert a["smallest"]["report"]["diagnosis"][0]["kind"] == "chunk_order"
    code, b, _ = shrink(golden, planted("chunk_order", 0))
    assert code == 0
    for key in ("smallest", "steps", "runs", "passed", "no_candidate"):
        assert (a[key] if key != "smallest" else a[key]["case_json"]) == \
               (b[key] if key != "smallest" else b[key]["case_json"])


def test_text_output_and_already_minimal(tmp_path):
    tiny = str(tmp_path / "tiny.h5")
    subprocess.run([BIN, "gen", "--case", '{"seqlens_q":[2],"heads_q":1,"dim_qk":1,"pad_fill":"zero"}', "-o", tiny],
                   check=True, capture_output=True)
    p = subprocess.run([BIN, "shrink", tiny, "--run", planted("chunk_order", 0)], capture_output=True, text=True)
    assert p.returncode == 1, p.stderr  # nothing smaller fails the same way
    assert "the original is already minimal" in p.stdout
    assert '{"seqlens_q":[2],"heads_q":1,"dim_qk":1' in p.stdout
    assert "reproduce:" in p.stdout and "runs: " in p.stdout


@pytest.mark.parametrize("command,message", [
    ("false", "COMMAND exited with status 1"),
    ("true {fixture} {candidate}", "wrote no candidate"),
    ("sleep 5 # {fixture} {candidate}", "ran past --run-timeout"),
    ("kill -9 $$ # {fixture} {candidate}", "killed by signal 9"),
    ("echo garbage > {candidate} # {fixture}", "the candidate is unusable"),
])
def test_original_without_a_candidate_is_bad_input(golden, command, message):
    if "{fixture}" not in command:
        command += " {fixture} {candidate}"
    code, j, err = shrink(golden, command, "--run-timeout", "0.5")
    assert code == 2
    assert message in err and message in j["error"]["message"]


def test_bad_arguments(golden, tmp_path):
    assert shrink(golden, "cat {fixture}")[0] == 2  # no {candidate}
    code, j, _ = shrink(golden, planted("chunk_order", 0), "--kind", "merge")
    assert code == 2 and "not diagnosed \"merge\"" in j["error"]["message"]
    code, j, _ = shrink(golden, planted("chunk_order", 0), "--kind", "nonsense")
    assert code == 2 and j["error"]["field"] == "--kind"
    code, j, _ = shrink(str(tmp_path / "missing.h5"), planted("chunk_order", 0))
    assert code == 2


def test_original_that_passes_is_bad_input(golden):
    # merge needs a traced candidate: the planted runner gives none on an untraced fixture (exit 3).
    code, j, err = shrink(golden, planted("merge", 0))
    assert code == 2 and "exited with status 3" in err
    # A runner that writes the fixture's own oracle outputs (a pass).
    runner = f"{shlex.quote(sys.executable)} {shlex.quote(os.path.join(HERE, 'fake_rank_runner.py'))}"
    code, j, err = shrink(golden, f"cp {{fixture}} {{candidate}}")
    assert code == 2  # a fixture as candidate: checked as its /peer outputs, which pass
    assert "passes its check" in j["error"]["message"]


@pytest.mark.parametrize("failure", ["exit 1", "true", "sleep 3"])
def test_command_failures_during_the_search_are_never_kept(golden, failure):
    # Below 40 kB of fixture COMMAND fails in one way; the search must never keep such a case.
    command = (f'if [ $(stat -c %s {{fixture}}) -lt 40000 ]; then {failure}; else {planted("chunk_order", 0)}; fi')
    code, j, err = shrink(golden, command, "--run-timeout", "1", "--max-runs", "40")
    assert code == 0, err
    assert j["no_candidate"] > 0
    assert j["smallest"]["diagnosis"] == ["chunk_order"]
    small = os.path.join(os.path.dirname(golden), f"small-{failure.split()[0]}.h5")
    subprocess.run([BIN, "gen", "--case", j["smallest"]["case_json"], "-o", small, "--force"], check=True,
                   capture_output=True)
    assert os.path.getsize(small) >= 40000


def test_bounds(golden):
    code, j, _ = shrink(golden, planted("chunk_order", 0), "--max-runs", "3")
    assert j["runs"] == 3 and j["stopped"] == "max_runs"
    code, j, _ = shrink(golden, planted("chunk_order", 0), "--budget", "0.01")
    assert j["stopped"] == "budget" and j["runs"] <= 2


def test_one_process_per_rank(golden):
    runner = f"{shlex.quote(sys.executable)} {shlex.quote(os.path.join(HERE, 'fake_rank_runner.py'))}"
    env = dict(os.environ)
    code, j, err = shrink(golden, f"{runner} {{fixture}} {{candidate}} {{rank}}", "--tensors", "o,lse",
                          "--max-runs", "12", "--confirm", "0")
    assert code == 0, err
    assert j["kinds"] == ["head_mapping"]
    assert j["smallest"]["case"]["heads_q"] == 2 and j["smallest"]["case"].get("heads_kv") == 1
    assert "for rank in " in j["reproduce"][1] and "candidate.rank$rank.h5" in j["reproduce"][1]
    assert env is not None


def test_pad_rows_convention_reaches_the_check(golden):
    """Outputs right on every valid row, NaN on pad rows: a failure under the contract, a pass under --pad-rows
    unwritten (then the original does not fail: exit 2 saying so); a bad value is named."""
    runner = f"{shlex.quote(sys.executable)} {shlex.quote(os.path.join(HERE, 'pads_nan_runner.py'))} {{fixture}} {{candidate}}"
    code, j, _ = shrink(golden, runner, "--max-runs", "2")
    assert code in (0, 1), j
    code, j, _ = shrink(golden, runner, "--pad-rows", "unwritten", "--max-runs", "2")
    assert code == 2 and "pass" in j["error"]["message"]
    code, j, _ = shrink(golden, runner, "--pad-rows", "skip")
    assert code == 2 and j["error"]["field"] == "--pad-rows"


TWO_DEFECTS = '''import sys
import numpy as np
import cpgold
with cpgold.Fixture(sys.argv[1]) as fx:
    out = {n: fx.golden(n) for n in ("o", "lse")}
    if fx.heads_q // fx.heads_kv > 1:  # the original's defect: O wrong under GQA
        out["o"] = out["o"] * np.float32(1.5)
    if fx.cp_size == 1:  # another defect: LSE wrong without CP
        out["lse"] = np.where(np.isfinite(out["lse"]), out["lse"] + np.float32(np.log(2.0)), out["lse"])
    cpgold.write_global(sys.argv[2], out, lse_layout="ht")
'''


def test_same_tensors_keeps_the_failing_tensors(golden, tmp_path):
    script = tmp_path / "two_defects.py"
    script.write_text(TWO_DEFECTS)
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {{fixture}} {{candidate}}"
    code, loose, err = shrink(golden, command, "--tensors", "o,lse", "--any-failure", "--confirm", "0")
    assert code == 0, err
    assert loose["same_tensors"] is False
    assert loose["smallest"]["case"].get("cp_size", 1) == 1 and loose["smallest"]["failing_tensors"] == ["lse"]
    code, strict, err = shrink(golden, command, "--tensors", "o,lse", "--any-failure", "--same-tensors", "--confirm",
                               "0")
    assert code == 0, err
    assert strict["same_tensors"] is True and strict["original"]["failing_tensors"] == ["o"]
    assert strict["smallest"]["failing_tensors"] == ["o"]
    case = strict["smallest"]["case"]
    assert case["cp_size"] >= 2 and (case["heads_q"], case.get("heads_kv")) == (2, 1)
    assert " in o)" in err  # progress lines name the failing tensors
    # The same search through Python's door, with the same start and the same two defects in process.
    pytest.importorskip("cpgold._core", reason="cpgold's extension is not built: cpgold.shrink runs in process")

    def fn(fx):
        out = {n: fx.golden(n) for n in ("o", "lse")}
        if fx.heads_q // fx.heads_kv > 1:
            out["o"] = out["o"] * np.float32(1.5)
        if fx.cp_size == 1:
            out["lse"] = np.where(np.isfinite(out["lse"]), out["lse"] + np.float32(np.log(2.0)), out["lse"])
        return out
    py = cpgold.shrink(START, fn, tensors=("o", "lse"), lse_layout="ht", any_failure=True, same_tensors=True,
                       confirm=0)
    assert py["smallest"] == strict["smallest"]["case_json"] and py["runs"] == strict["runs"]
    assert py["smallest_verdict"]["tensors"] == strict["smallest"]["failing_tensors"] == ["o"]
