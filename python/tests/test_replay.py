"""The replay of a failed check names the modelled CP mistake a candidate matches. The candidates come from
python/examples/planted_ring_attention.py, a ring (p2p) CP attention in numpy written apart from cpgold's simulator,
with mistakes planted by name; its correct ring must agree with the golden and pass with no diagnosis.

What the replay is held to, per mistake (REPLAY_NAME gives the name the report uses) and per form (every rank's
outputs as a list, each rank alone, the gathered global outputs; forward only "o,lse" and all five tensors): the check
fails and report["diagnosis"] holds a finding of the mistake's kind whose where["replay"]["mistake"] is the mistake's
name and whose evidence starts "matches the simulation of". counts_cu_div_w on NaN pads also gives nonfinite_leak,
after the per_rank_counts finding (the cause first).
"""
import numpy as np
import pytest

import cpgold
from planted_ring_attention import REPLAY_NAME, gather, ring_attention, shard

KIND = {"contiguous_chunks": "chunk_order", "counts_cu_div_w": "per_rank_counts", "keyless_step_lse_0": "merge",
        "running_o_not_rescaled": "merge", "right_edge_plus1_diagonal": "mask_edge",
        "last_row_dropped": "tail_rows_missing"}
EVIDENCE = "matches the simulation of"
BASE = {"heads_q": 4, "heads_kv": 2, "dim_qk": 32}

# Every sequence of the contiguous_chunks cases fills its 2W chunks (lengths multiples of 2W, no padding): which rows
# hold tokens is then the same whether the rank judges it by the rows it holds or by the positions it believes.
# counts_cu_div_w: lengths that are not multiples of 2W and NaN pads. keyless_step_lse_0: no mask (every step
# computes every row, as TE's p2p does without a causal mask) and sequences too short to reach every rank, so a row
# meets steps that hold none of its keys; no window (TE's p2p has none, and which rows of a step that a window
# leaves without any key still make a partial is a choice of the implementation).
CASES = {
    "none": [
        dict(BASE, seqlens_q=[57, 13, 30], cp_size=2, mask="causal", pad_fill="nan"),
        dict(BASE, seqlens_q=[57, 13, 30], cp_size=3, mask="causal", pad_fill="inf", total_tokens_q=138),
        dict(BASE, seqlens_q=[40, 7, 25], cp_size=3, mask="none", window=[3, 2], dtype="fp32", pad_fill="nan"),
        dict(BASE, seqlens_q=[1, 2, 37, 5, 0], cp_size=2, mask="none", pad_fill="nan"),
        dict(BASE, seqlens_q=[20, 9, 4], seqlens_kv=[5, 30, 0], cp_size=3, mask="none", pad_fill="nan"),
        dict(BASE, seqlens_q=[100, 1, 37], cp_size=4, mask="causal", window=[20, 0], heads_kv=1, dim_v=8,
             dtype="fp16", pad_fill="nan"),
    ],
    "contiguous_chunks": [
        dict(BASE, seqlens_q=[48, 16, 32], cp_size=2, mask="causal"),
        dict(BASE, seqlens_q=[36, 12, 24], cp_size=3, mask="causal"),
        dict(BASE, seqlens_q=[64, 16, 40], cp_size=4, mask="causal"),
    ],
    "counts_cu_div_w": [
        dict(BASE, seqlens_q=[57, 13, 30], cp_size=2, mask="causal", pad_fill="nan"),
        dict(BASE, seqlens_q=[57, 13, 30], cp_size=3, mask="causal", pad_fill="nan"),
        dict(BASE, seqlens_q=[57, 13, 30, 9], cp_size=4, mask="causal", pad_fill="nan"),
    ],
    "keyless_step_lse_0": [
        dict(BASE, seqlens_q=[1, 2, 37, 5], cp_size=2, mask="none", dtype="fp32"),
        dict(BASE, seqlens_q=[1, 2, 37, 5, 3], cp_size=3, mask="none", dtype="fp32"),
        dict(BASE, seqlens_q=[1, 9, 37, 2, 4, 6], cp_size=4, mask="none", dtype="fp32"),
    ],
    "running_o_not_rescaled": [
        dict(BASE, seqlens_q=[57, 13, 30], cp_size=2, mask="causal"),
        dict(BASE, seqlens_q=[57, 13, 30], cp_size=3, mask="causal"),
        dict(BASE, seqlens_q=[57, 13, 30, 9], cp_size=4, mask="none"),
    ],
    "last_row_dropped": [
        dict(BASE, seqlens_q=[57, 13, 30], cp_size=2, mask="causal"),
        dict(BASE, seqlens_q=[57, 13, 30], cp_size=3, mask="none", pad_fill="nan"),
        dict(BASE, seqlens_q=[57, 13, 30, 9], cp_size=4, mask="causal"),
    ],
    "right_edge_plus1_diagonal": [
        dict(BASE, seqlens_q=[57, 13, 30], cp_size=2, mask="causal"),
        dict(BASE, seqlens_q=[57, 13, 30], cp_size=3, mask="causal", pad_fill="nan"),
        dict(BASE, seqlens_q=[57, 13, 30, 9], cp_size=4, mask="causal"),
    ],
}
PLANTED = [(m, i) for m in KIND for i in range(len(CASES[m]))]
FORMS = {"o,lse": "o,lse", "all": "o,lse,dq,dk,dv"}  # the forward-only candidate and all five tensors


def _id(param):
    return f"{param[0]}-w{CASES[param[0]][param[1]]['cp_size']}"


_cache = {}


def planted(mistake, index):
    """(fixture, every rank's outputs with the mistake, the correct ring's outputs), computed once per case."""
    key = (mistake, index)
    if key not in _cache:
        fx = cpgold.generate(CASES[mistake][index])
        _cache[key] = (fx, ring_attention(fx, mistake), ring_attention(fx))
    return _cache[key]


def pick(outputs, form):
    return {n: outputs[n] for n in FORMS[form].split(",")}


def nonfinite(outputs):
    """The outputs hold NaN/Inf that a check counts as non-finite (LSE's -inf of a keyless or pad row does not)."""
    return any(not np.isfinite(a).all() if n != "lse" else (np.isnan(a).any() or np.isposinf(a).any())
               for n, a in outputs.items())


def replay_findings(report, mistake):
    name = REPLAY_NAME[mistake]
    found = []
    for d in report["diagnosis"]:
        replay = (d.get("where") or {}).get("replay")
        if isinstance(replay, dict) and replay.get("mistake") == name:
            found.append(d)
    return found


def assert_named(report, mistake, outputs, label):
    kinds = [d["kind"] for d in report["diagnosis"]]
    assert not report["pass"], f"{label}: the check passed"
    found = replay_findings(report, mistake)
    assert found, f"{label}: no replay finding names {REPLAY_NAME[mistake]!r}: {report['diagnosis']}"
    assert any(d["kind"] == KIND[mistake] for d in found), f"{label}: {REPLAY_NAME[mistake]} found as {found}"
    assert all(d["evidence"].startswith(EVIDENCE) for d in found), f"{label}: {found}"
    if mistake == "counts_cu_div_w" and nonfinite(outputs):
        assert "nonfinite_leak" in kinds, f"{label}: {kinds}"
        cause = min(i for i, d in enumerate(report["diagnosis"]) if d in found and d["kind"] == KIND[mistake])
        assert cause < kinds.index("nonfinite_leak"), f"{label}: the cause after its effect: {kinds}"


# -- the ring itself, against the fixture ------------------------------------------------------------------------

@pytest.mark.parametrize("index", range(len(CASES["none"])), ids=lambda i: f"w{CASES['none'][i]['cp_size']}-{i}")
def test_correct_ring_agrees_with_the_golden_and_passes(core, index):
    fx, outputs, _ = planted("none", index)
    for side in ("q", "kv"):
        assert cpgold.compare_partition(fx, [shard(fx, r, side).rows for r in range(fx.cp_size)], side) == []
    for r, out in enumerate(outputs):
        for name, a in out.items():
            golden = fx.golden(name, r)
            assert np.array_equal(np.isfinite(a), np.isfinite(golden)), (name, r)
            assert np.allclose(a, golden, rtol=1e-5, atol=1e-6, equal_nan=True), (name, r)
    glob = gather(fx, outputs)
    for form in FORMS:
        tensors = FORMS[form]
        reports = [cpgold.check_outputs(fx, [pick(o, form) for o in outputs], tensors=tensors, lse_layout="ht"),
                   cpgold.check_outputs(fx, pick(glob, form), scope="cp_gathered", tensors=tensors, lse_layout="ht")]
        reports += [cpgold.check_outputs(fx, pick(o, form), rank=r, tensors=tensors, lse_layout="ht")
                    for r, o in enumerate(outputs)]
        for report in reports:
            assert report["pass"] and report["diagnosis"] == [], cpgold.failures(report)


@pytest.mark.parametrize("planted_case", PLANTED, ids=_id)
def test_the_mistake_changes_the_outputs(core, planted_case):
    """A precondition of the replay tests: the planted mistake moves the outputs (and counts_cu_div_w's count differs
    from some rank's real valid rows), and the check fails."""
    mistake, index = planted_case
    fx, wrong, right = planted(mistake, index)
    differs = [r for r in range(fx.cp_size)
               if any(not np.array_equal(wrong[r][n], right[r][n], equal_nan=True) for n in right[r])]
    assert differs
    if mistake == "counts_cu_div_w":
        assert any((shard(fx, r, "q", mistake).token != shard(fx, r, "q").token).any() for r in range(fx.cp_size))
        assert fx.case["pad_fill"] == "nan" and any(nonfinite(o) for o in wrong)
    assert not cpgold.check_outputs(fx, wrong, lse_layout="ht")["pass"]


# -- the replay names the mistake ----------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("planted_case", PLANTED, ids=_id)
def test_every_rank_names_the_mistake(core, planted_case, form):
    mistake, index = planted_case
    fx, wrong, _ = planted(mistake, index)
    outputs = [pick(o, form) for o in wrong]
    report = cpgold.check_outputs(fx, outputs, tensors=FORMS[form], lse_layout="ht")
    merged = {f"{n}@r{r}": a for r, o in enumerate(outputs) for n, a in o.items()}
    assert_named(report, mistake, merged, f"every rank, {form}")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("planted_case", PLANTED, ids=_id)
def test_each_rank_alone_names_the_mistake(core, planted_case, form):
    """A rank whose outputs the mistake leaves exactly as the correct ring's passes; every rank that fails is named."""
    mistake, index = planted_case
    fx, wrong, right = planted(mistake, index)
    failed = 0
    for r in range(fx.cp_size):
        outputs = pick(wrong[r], form)
        report = cpgold.check_outputs(fx, outputs, rank=r, tensors=FORMS[form], lse_layout="ht")
        if all(np.array_equal(outputs[n], right[r][n], equal_nan=True) for n in outputs):
            assert report["pass"] and report["diagnosis"] == [], f"rank {r}: {cpgold.failures(report)}"
            continue
        if report["pass"]:
            continue  # moved, but inside the budgets
        failed += 1
        assert_named(report, mistake, outputs, f"rank {r}, {form}")
    assert failed, "no rank failed alone"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("planted_case", PLANTED, ids=_id)
def test_gathered_outputs_name_the_mistake(core, planted_case, form):
    mistake, index = planted_case
    fx, wrong, _ = planted(mistake, index)
    outputs = pick(gather(fx, wrong, mistake), form)
    report = cpgold.check_outputs(fx, outputs, scope="cp_gathered", tensors=FORMS[form], lse_layout="ht")
    assert_named(report, mistake, outputs, f"gathered, {form}")


def test_the_example_runs(core, capsys):
    import planted_ring_attention

    assert planted_ring_attention.main() == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 4 and out.count("FAIL") == 4 * (len(KIND))


# -- the replay's budget: diagnosis=SECONDS in process, --diagnosis-budget on the command line ---------------------

def test_diagnosis_budget_bounds_the_replay(core, tmp_path):
    fx, outputs, _ = planted("running_o_not_rescaled", 0)
    named = cpgold.check_outputs(fx, outputs, lse_layout="ht")
    assert replay_findings(named, "running_o_not_rescaled")
    assert replay_findings(cpgold.check_outputs(fx, outputs, lse_layout="ht", diagnosis=5), "running_o_not_rescaled")
    off = cpgold.check_outputs(fx, outputs, lse_layout="ht", diagnosis=0)  # the diagnosis without its replay
    assert not off["pass"] and off["diagnosis"]
    assert all("replay" not in (d.get("where") or {}) for d in off["diagnosis"])
    for bad in (-1, float("nan"), "soon", 1e9):
        with pytest.raises(cpgold.InputError) as e:
            cpgold.check_outputs(fx, outputs, lse_layout="ht", diagnosis=bad)
        assert e.value.field == "diagnosis"


def test_diagnosis_budget_on_the_command_line(core, cpgold_bin, tmp_path):
    import json
    import subprocess

    fx, outputs, _ = planted("running_o_not_rescaled", 0)
    golden = str(tmp_path / "g.h5")
    cpgold.generate(CASES["running_o_not_rescaled"][0], path=golden).close()
    cand = str(tmp_path / "c.h5")
    with cpgold.Fixture(golden) as opened:
        cpgold.write_ranks(cand, outputs, fixture=opened, lse_layout="ht")

    def run(*extra):
        return subprocess.run([cpgold_bin, "check", golden, cand, "--format", "json", *extra], capture_output=True,
                              text=True)

    full = json.loads(run().stdout)
    assert any((d["where"].get("replay") or {}).get("mistake") == "running_o_not_rescaled" for d in full["diagnosis"])
    off = json.loads(run("--diagnosis-budget", "0").stdout)
    assert off["diagnosis"] and all("replay" not in d["where"] for d in off["diagnosis"])
    for bad in ("-1", "abc", "nan", "1e9", ""):
        r = run("--diagnosis-budget", bad)
        assert r.returncode == 2, (bad, r.stdout, r.stderr)
        assert "--diagnosis-budget" in r.stdout + r.stderr


# One sequence of 1200 tokens on 4 ranks, 8 query heads of 64 dims on one KV head: one run of a mistake takes about
# 0.3 s on the 2-core development machine, in 4 x 4 tiles, and the sub-case is under the size past which the replay
# estimates a run's time before starting it: the first mistake starts, and only the budget checked between tiles can
# end it.
LONG = {"seqlens_q": [1200], "cp_size": 4, "mask": "causal", "heads_q": 8, "heads_kv": 1, "dim_qk": 64,
        "dtype": "fp32", "seed": 3}


def _stopped_at(not_tested):
    """The seconds a mistake ran before the budget stopped it, from where["not_tested"]."""
    import re

    found = [re.search(r"\(stopped at the budget after ([0-9.e+-]+) s\)", t) for t in not_tested]
    found = [float(m.group(1)) for m in found if m]
    assert found, not_tested
    return found[0]


def test_the_replay_stops_at_its_budget_between_tiles(core, cpgold_bin, tmp_path):
    """A mistake whose run is longer than the budget is stopped at the first tile past it and named among those not
    replayed, with the time it ran; in process (diagnosis=SECONDS) and on the command line (--diagnosis-budget)."""
    import json
    import subprocess

    golden = str(tmp_path / "long.h5")
    fx = cpgold.generate(LONG, path=golden)
    outputs = [{n: np.array(fx.golden(n, r)) for n in ("o", "lse", "dq", "dk", "dv")} for r in range(4)]
    outputs[1]["o"][5] += 1.0  # one wrong row: no modelled mistake explains it, every one is replayed
    budget = 0.05
    report = cpgold.check_outputs(fx, outputs, diagnosis=budget)
    assert [d["kind"] for d in report["diagnosis"]] == ["unexplained"]
    not_tested = report["diagnosis"][-1]["where"]["not_tested"]
    assert not_tested[0].startswith("replay of ") and "past the diagnosis budget" in not_tested[0]
    # a tile is about 0.02 s here: the run ends well before the 0.3 s it takes whole
    assert _stopped_at(not_tested) < budget + 0.2
    cand = str(tmp_path / "c.h5")
    cpgold.write_ranks(cand, outputs, fixture=fx)
    fx.close()
    p = subprocess.run([cpgold_bin, "check", golden, cand, "--diagnosis-budget", str(budget), "--format", "json"],
                       capture_output=True, text=True)
    assert p.returncode == 1, p.stderr
    cli = json.loads(p.stdout)["diagnosis"][-1]["where"]["not_tested"]
    assert _stopped_at(cli) < budget + 0.2


def test_nothing_matches_names_the_closest_mistakes(core):
    fx, _, right = planted("running_o_not_rescaled", 0)
    scaled = [dict(o, o=o["o"] * 1.25) for o in right]  # no modelled mistake scales the output
    report = cpgold.check_outputs(fx, scaled, lse_layout="ht")
    assert not report["pass"]
    assert [d["kind"] for d in report["diagnosis"]] == ["unexplained"]
    evidence = report["diagnosis"][0]["evidence"]
    where = report["diagnosis"][0]["where"]
    assert "no modelled mistake and no tested kind accounts for every failing row" in evidence
    # The closest mistakes, each with how much of the failure it reproduces; none of them moves a row of a scaled O
    # towards the candidate, and the report says so instead of listing mistakes that change nothing there.
    assert isinstance(where["closest"], list) and isinstance(where["symptoms"], list)
    if where["closest"]:
        assert "the closest:" in evidence and "failing rows reproduced" in evidence
        assert all({"mistake", "failing_rows", "failing_rows_reproduced", "worst_ratio"} <= set(c) for c in where["closest"])
    else:
        assert "replayed mistakes reproduces a failing row or moves one towards the candidate" in evidence
