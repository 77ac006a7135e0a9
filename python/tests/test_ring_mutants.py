"""The diagnosis never points the wrong way (docs/diagnosis.md): every mistake of the replay's catalogue, planted in
python/tests/ring_mutants.py (a ring CP attention in torch written apart from cpgold's simulator), is named with its
kind and the replayed mistake's name, or honestly `unexplained`; never another kind, never `inputs_mismatch`
without a digest. The correct ring agrees with the golden (and its backward with torch's autograd) and passes with
no diagnosis. The bugs a user's ring showed are here by name: a causal diagonal block without its mask, dK/dV
left unreduced across the ring, K's starts from the unpadded cu_seqlens, the count shortcut on NaN pads
(TransformerEngine issue 3331). Shrinking keeps the name. The long random sweep behind the confusion table is
test_replay_table.py (slow).
"""
import math

import numpy as np
import pytest

import cpgold

pytest.importorskip("torch", reason="the ring of ring_mutants.py is written in torch")
pytest.importorskip("cpgold._core", reason="needs cpgold's extension (check_outputs in process)")
from ring_mutants import MUTANTS, Ring, autograd_outputs, gather, ring_attention  # noqa: E402

SYMPTOMS = ("pad_rows_not_zero", "nonfinite_leak")

# A user's layout: W = 4, GQA 8/2, causal, padding between sequences.
USER = {"seqlens_q": [57, 13, 30, 9], "padded_q": [64, 24, 40, 16], "cp_size": 4, "mask": "causal", "heads_q": 8,
        "heads_kv": 2, "dim_qk": 16, "dtype": "bf16", "seed": 11}
SMALL = {"seqlens_q": [57, 13, 30], "cp_size": 2, "mask": "causal", "heads_q": 4, "heads_kv": 2, "dim_qk": 16,
         "dtype": "bf16", "seed": 5}
# No mask, sequences shorter than 2W chunks: steps that hold none of a row's keys (the keyless merge rules).
KEYLESS = {"seqlens_q": [1, 2, 37, 5, 3], "cp_size": 3, "mask": "none", "heads_q": 4, "heads_kv": 2, "dim_qk": 16,
           "dtype": "fp32", "seed": 3}
# A two-sided window without the causal mask (the left edge).
WINDOW = {"seqlens_q": [40, 7, 25], "cp_size": 3, "mask": "none", "window": [3, 2], "heads_q": 4, "heads_kv": 2,
          "dim_qk": 16, "dtype": "fp32", "seed": 2}
CASE_OF = {"keyless_step_lse_0": KEYLESS, "keyless_step_lse_inf": KEYLESS, "left_edge+1:every": WINDOW,
           "left_edge-1:every": WINDOW, "merge_lse_in_dtype": SMALL, "scale_sqrt_d_plus_1": SMALL, "lse_base2": SMALL}
# The count shortcut and the unpadded offsets on NaN pads: the cause named, the NaN it lets in listed after it.
NAN_PADS = ["counts_cu_div_w", "counts_cu_div_2w", "kv_offsets_unpadded", "q_offsets_unpadded"]

_cache = {}


def fixture(case):
    key = repr(sorted(case.items()))
    if key not in _cache:
        _cache[key] = cpgold.generate(case)
    return _cache[key]


def stated(report):
    """(kind, replayed mistake and those matching as well) of every finding."""
    out = []
    for d in report["diagnosis"]:
        replay = (d.get("where") or {}).get("replay") or {}
        names = {replay["mistake"]} | set(replay.get("also_matching", [])) if replay else set()
        out.append((d["kind"], names))
    return out


def assert_named(report, mutant, label):
    """The first finding is the mutant's kind (its replayed mistake among the names), every other finding a symptom;
    or the report is unexplained. Never another cause."""
    kind, replay_name = MUTANTS[mutant]
    assert not report["pass"], f"{label}: the check passed"
    found = stated(report)
    kinds = [k for k, _ in found]
    assert "inputs_mismatch" not in kinds, f"{label}: {report['diagnosis']}"
    causes = [k for k in kinds if k not in SYMPTOMS]
    assert causes == [kind], f"{label}: {mutant} diagnosed {kinds}: {[d['evidence'] for d in report['diagnosis']]}"
    if replay_name:
        assert replay_name in found[0][1], f"{label}: {mutant} replayed as {found[0][1]}"
        assert report["diagnosis"][0]["evidence"].startswith("matches the simulation of"), label


def case_of(mutant):
    return CASE_OF.get(mutant, USER)


PLANTED = [m for m in MUTANTS if m != "none"]


@pytest.mark.parametrize("case", [USER, SMALL, KEYLESS, WINDOW, dict(SMALL, pad_fill="nan")],
                         ids=["user", "small", "keyless", "window", "nan-pads"])
def test_the_correct_ring_agrees_with_the_golden_and_autograd_and_passes(core, case):
    fx = fixture(case)
    outputs = ring_attention(fx)
    for r, out in enumerate(outputs):
        assert np.array_equal(fx.partitioned_indices(r, "q"), Ring(fx).q.global_rows(r))
        for name, a in out.items():
            golden = fx.golden(name, r)
            assert np.array_equal(np.isfinite(a), np.isfinite(golden)), (name, r)
            assert np.allclose(a, golden, rtol=1e-5, atol=1e-6, equal_nan=True), (name, r)
    reference = autograd_outputs(fx)
    glob = gather(fx, outputs)
    for name, side in (("o", "q"), ("dq", "q"), ("dk", "kv"), ("dv", "kv")):
        valid = fx.valid_rows(side)
        assert np.allclose(glob[name][valid], reference[name][valid], rtol=1e-5, atol=1e-6), name
    for report in (cpgold.check_outputs(fx, outputs, lse_layout="ht"),
                   cpgold.check_outputs(fx, glob, scope="cp_gathered", lse_layout="ht")):
        assert report["pass"] and report["diagnosis"] == [], cpgold.failures(report)


@pytest.mark.parametrize("mutant", PLANTED)
def test_every_mutant_is_named_with_its_kind(core, mutant):
    fx = fixture(case_of(mutant))
    wrong = ring_attention(fx, mutant)
    every = cpgold.check_outputs(fx, wrong, lse_layout="ht")
    assert_named(every, mutant, "every rank")
    glob = cpgold.check_outputs(fx, gather(fx, wrong, mutant), scope="cp_gathered", lse_layout="ht")
    assert_named(glob, mutant, "gathered")


@pytest.mark.parametrize("fill", ["nan", "inf"])
@pytest.mark.parametrize("mutant", NAN_PADS)
def test_count_and_offset_mistakes_on_nan_pads_name_the_cause_before_the_leak(core, mutant, fill):
    """TransformerEngine issue 3331's cu // W shortcut on NaN pads is per_rank_counts, the NaN it reads nonfinite_leak
    after it (a cause does not hide its symptom). The replay runs the mistake with the pad values 0 and with other
    finite values: the elements the two runs give differently are those the mistake reads a pad value into, non-finite
    in the candidate; the others are compared as they are (docs/diagnosis.md, "Replay")."""
    fx = fixture(dict(SMALL, pad_fill=fill))
    wrong = ring_attention(fx, mutant)
    for label, report in (("every rank", cpgold.check_outputs(fx, wrong, lse_layout="ht")),
                          ("gathered", cpgold.check_outputs(fx, gather(fx, wrong, mutant), scope="cp_gathered",
                                                            lse_layout="ht"))):
        assert_named(report, mutant, label)
        kinds = [d["kind"] for d in report["diagnosis"]]
        assert kinds == ["per_rank_counts", "nonfinite_leak"], (label, kinds)


def test_the_reported_bugs_rank_by_rank(core):
    """Each rank alone: a rank the mistake leaves right passes; a failing one is named right or unexplained, never
    named otherwise (the diagonal without its mask was inputs_mismatch per rank; dK/dV unreduced was inputs_mismatch
    'dout differs'; K's starts from the unpadded cu_seqlens pad_rows_not_zero alone)."""
    fx = fixture(USER)
    for mutant in ("diagonal_unmasked", "dkv_own_only", "kv_offsets_unpadded"):
        wrong = ring_attention(fx, mutant)
        named = 0
        for r in range(fx.cp_size):
            report = cpgold.check_outputs(fx, wrong[r], rank=r, lse_layout="ht")
            if report["pass"]:
                assert report["diagnosis"] == []
                continue
            kinds = [d["kind"] for d in report["diagnosis"]]
            if kinds == ["unexplained"]:
                continue
            assert_named(report, mutant, f"{mutant} rank {r}")
            named += 1
        assert named >= 1, mutant


def test_an_unexplained_report_lists_symptoms_and_the_closest_mistakes(core):
    """Two mistakes on the same rows match no single replay: the report says unexplained, with the partial fits and
    the closest modelled mistakes, and states no kind."""
    fx = fixture(SMALL)
    a = ring_attention(fx, "diagonal_unmasked")
    b = ring_attention(fx, "dkv_own_only")
    right = ring_attention(fx)
    both = [dict(x, dk=y["dk"] + (z["dk"] - w["dk"]), dv=y["dv"] + (z["dv"] - w["dv"]))
            for x, y, z, w in zip(a, a, b, right)]
    report = cpgold.check_outputs(fx, both, lse_layout="ht")
    assert not report["pass"]
    kinds = [d["kind"] for d in report["diagnosis"]]
    assert kinds == ["unexplained"], [d["evidence"] for d in report["diagnosis"]]
    where = report["diagnosis"][0]["where"]
    assert where["closest"] and all(c["failing_rows"] > 0 for c in where["closest"])
    assert where["closest"][0]["failing_rows_reproduced"] > 0
    assert "the first divergence above is where to start" in report["diagnosis"][0]["evidence"]


@pytest.mark.parametrize("mutant", ["last_row_dropped", "lse_base2", "scale_sqrt_d_plus_1", "dkv_own_only"])
def test_shrinking_keeps_the_name(core, mutant):
    """The smallest case carries the original's diagnosis: a dropped last token is not chunk_order at one token, a
    base-2 LSE or a wrong scale is not 'a constant offset'."""
    start = dict(SMALL, seed=7)
    result = cpgold.shrink(start, lambda fx: ring_attention(fx, mutant), confirm=0, max_runs=40)
    kind = MUTANTS[mutant][0]
    assert result["kinds"] == [kind]
    smallest = [d["kind"] for d in result["report"]["diagnosis"] if d["kind"] not in SYMPTOMS]
    assert smallest == [kind], (result["smallest"], result["report"]["diagnosis"])
    assert result.smaller
