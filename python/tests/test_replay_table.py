"""The replay's confusion tables over random cases (slow; CTest python_replay_slow, label python_slow). The numpy ring
of python/examples/planted_ring_attention.py, written apart from cpgold's simulator, with each planted mistake (and
none) on seeded random p2p cases, every rank's five tensors checked in process; and the torch ring of
python/tests/ring_mutants.py with every mistake of the catalogue, every rank's outputs, each rank alone and gathered
(test_ring_mutants_confusion_table: right, another kind, unexplained, symptoms only; no wrong name is allowed). Prints
the tables docs/diagnosis.md records:

    PYTHONPATH=python:build/python python3 -m pytest python/tests/test_replay_table.py -m slow -s

Held to: the correct ring passes every case with no diagnosis; of the planted runs that fail the check, at least 90%
of each mistake are named by the replay (the finding's where["replay"]["mistake"], or its also_matching list) with the
mistake's kind, and no failing run goes without a diagnosis.
"""
import random

import pytest

import cpgold
from planted_ring_attention import MISTAKES, REPLAY_NAME, ring_attention

KIND = {"contiguous_chunks": "chunk_order", "counts_cu_div_w": "per_rank_counts", "keyless_step_lse_0": "merge",
        "running_o_not_rescaled": "merge", "right_edge_plus1_diagonal": "mask_edge",
        "last_row_dropped": "tail_rows_missing"}
KINDS = ["chunk_order", "mask_edge", "merge", "per_rank_counts", "tail_rows_missing", "pad_rows_not_zero",
         "nonfinite_leak", "unexplained"]
SEED = 4702
CASES_PER_MISTAKE = 40


def random_case(rng):
    w = rng.choice([2, 2, 3, 4])
    heads = rng.choice([(4, 2), (2, 2), (4, 1)])
    mask = rng.choice(["causal", "causal", "none"])
    n = rng.randint(1, 4)
    case = {"seqlens_q": [rng.randint(1, 70) for _ in range(n)], "cp_size": w, "mask": mask,
            "heads_q": heads[0], "heads_kv": heads[1], "dim_qk": rng.choice([16, 32]),
            "dtype": rng.choice(["bf16", "fp16", "fp32"]), "pad_fill": rng.choice(["random", "nan", "zero"]),
            "seed": rng.randint(0, 1 << 30)}
    return case


def replay_names(report):
    names = set()
    for d in report["diagnosis"]:
        replay = (d.get("where") or {}).get("replay") or {}
        if replay:
            names.add((d["kind"], replay.get("mistake")))
            names.update((d["kind"], m) for m in replay.get("also_matching", []))
    return names


@pytest.mark.slow
def test_replay_confusion_table(core):
    rng = random.Random(SEED)
    rows = {}
    for mistake in MISTAKES:
        row = rows.setdefault(mistake, {"runs": 0, "passed": 0, "failed": 0, "named": 0, "kinds": {}})
        for _ in range(CASES_PER_MISTAKE):
            case = random_case(rng)
            if mistake == "keyless_step_lse_0":
                # p2p without a causal mask computes every row in every step; sequences shorter than 2W chunks
                # leave some steps without any key of theirs
                case["mask"] = "none"
                case["seqlens_q"] = [rng.randint(1, 2 * case["cp_size"]) for _ in case["seqlens_q"]]
            fx = cpgold.generate(case)
            outputs = ring_attention(fx, mistake)
            report = cpgold.check_outputs(fx, outputs, lse_layout="ht")
            row["runs"] += 1
            if report["pass"]:
                row["passed"] += 1
                assert report["diagnosis"] == [], (mistake, case)
                continue
            assert mistake != "none", f"the correct ring failed {case}: {cpgold.failures(report)}"
            row["failed"] += 1
            assert report["diagnosis"], (mistake, case)
            for kind in {d["kind"] for d in report["diagnosis"]}:
                row["kinds"][kind] = row["kinds"].get(kind, 0) + 1
            if (KIND[mistake], REPLAY_NAME[mistake]) in replay_names(report):
                row["named"] += 1
            else:
                print(f"not named: {mistake} on {case}: {[d['kind'] for d in report['diagnosis']]}")
    header = "| planted | runs | check passed | failed | replay names it | " + " | ".join(KINDS) + " |"
    print("\n" + header + "\n" + "|---" * (5 + len(KINDS)) + "|")
    for mistake, row in rows.items():
        cells = [mistake, row["runs"], row["passed"], row["failed"], row["named"] if mistake != "none" else "-"]
        cells += [row["kinds"].get(k, "") for k in KINDS]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    for mistake, row in rows.items():
        if mistake == "none":
            assert row["failed"] == 0
        else:
            assert row["failed"] > 0, mistake
            assert row["named"] * 100 >= 90 * row["failed"], (mistake, row)


# -- every modelled mistake, planted in the torch ring of ring_mutants.py -----------------------------------------

RING_SEED = 5309
RING_CASES = 16
SYMPTOM_KINDS = ("pad_rows_not_zero", "nonfinite_leak")


def ring_case(rng, mutant):
    """A random p2p case the mutant can show itself on: causal or no mask (a two-sided window for the left edge, the
    right edge and the keyless rules' no-mask short sequences as test_ring_mutants.py has them), padding between
    sequences, GQA, every pad fill."""
    w = rng.choice([2, 2, 3, 4])
    hq, hkv = rng.choice([(4, 2), (8, 2), (2, 2), (4, 1)])
    n = rng.randint(1, 4)
    lens = [rng.randint(1, 70) for _ in range(n)]
    mask, window = rng.choice(["causal", "causal", "none"]), [-1, -1]
    if mutant.startswith("left_edge"):
        mask, window = "none", [rng.randint(1, 6), rng.randint(0, 6)]
    if mutant in ("keyless_step_lse_0", "keyless_step_lse_inf"):
        mask, lens = "none", [rng.randint(1, 2 * w) for _ in lens]
    dtype = rng.choice(["bf16", "fp16"]) if mutant == "merge_lse_in_dtype" else rng.choice(["bf16", "fp16", "fp32"])
    step = 2 * w
    padded = [((x + step - 1) // step + rng.choice([0, 0, 1])) * step for x in lens]
    padded = [max(p, step) for p in padded]
    return {"seqlens_q": lens, "padded_q": padded, "cp_size": w, "mask": mask, "window": window, "heads_q": hq,
            "heads_kv": hkv, "dim_qk": rng.choice([16, 32]), "dtype": dtype,
            "pad_fill": rng.choice(["random", "zero", "nan"]), "seed": rng.randint(0, 1 << 30)}


def classify(report, kind):
    """passed / right (the mutant's kind, no other cause) / other (another cause stated) / unexplained / symptoms
    (only pad_rows_not_zero or nonfinite_leak stated)."""
    if report["pass"]:
        return "passed"
    kinds = [d["kind"] for d in report["diagnosis"]]
    causes = [k for k in kinds if k not in SYMPTOM_KINDS]
    if kinds == ["unexplained"]:
        return "unexplained"
    if not causes:
        return "symptoms"
    return "right" if causes == [kind] else "other"


@pytest.mark.slow
def test_ring_mutants_confusion_table(core):
    import time

    pytest.importorskip("torch", reason="the ring of ring_mutants.py is written in torch")
    from ring_mutants import MUTANTS, Ring

    rng = random.Random(RING_SEED)
    forms = ("every rank", "each rank alone", "gathered")
    classes = ("passed", "right", "other", "unexplained", "symptoms")
    table, wrong = {}, []
    began = time.monotonic()
    for mutant, (kind, _) in MUTANTS.items():
        row = table.setdefault(mutant, {f: dict.fromkeys(classes, 0) for f in forms})
        row["runs"] = 0
        for _ in range(RING_CASES):
            case = ring_case(rng, mutant)
            fx = cpgold.generate(case)
            ring = Ring(fx, mutant)
            outputs = ring.run()
            reports = {"every rank": [cpgold.check_outputs(fx, outputs, lse_layout="ht")],
                       "each rank alone": [cpgold.check_outputs(fx, outputs[r], rank=r, lse_layout="ht")
                                           for r in range(fx.cp_size)],
                       "gathered": [cpgold.check_outputs(fx, ring.gather(outputs), scope="cp_gathered",
                                                         lse_layout="ht")]}
            row["runs"] += 1
            for form, rs in reports.items():
                for report in rs:
                    c = classify(report, kind)
                    if mutant == "none":
                        c = "passed" if report["pass"] and not report["diagnosis"] else "other"
                    row[form][c] += 1
                    if c == "other":
                        wrong.append((mutant, form, case, [(d["kind"], d["evidence"][:300]) for d in report["diagnosis"]]))
            fx.close()
    seconds = time.monotonic() - began
    head = "| planted | expected | runs | " + " | ".join(
        f"{f}: failed | right | other | unexplained | symptoms" for f in forms) + " |"
    print(f"\n{len(MUTANTS)} mutants x {RING_CASES} cases (seed {RING_SEED}) in {seconds:.0f} s\n{head}\n" +
          "|---" * (3 + 5 * len(forms)) + "|")
    for mutant, row in table.items():
        cells = [mutant, MUTANTS[mutant][0] or "-", row["runs"]]
        for f in forms:
            failed = sum(row[f][c] for c in classes if c != "passed")
            cells += [failed, row[f]["right"], row[f]["other"], row[f]["unexplained"], row[f]["symptoms"]]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    for w in wrong:
        print("named otherwise:", w)
    # The correct ring: every check passes with no diagnosis.
    assert all(table["none"][f]["other"] == 0 for f in forms), table["none"]
    # No wrong name anywhere; every mutant named right in most of its failing runs of every rank's outputs (the rest
    # unexplained, or only the NaN symptom where every output the mistake changes is NaN).
    assert not wrong, wrong[:3]
    for mutant, row in table.items():
        if mutant == "none":
            continue
        failed = sum(row["every rank"][c] for c in classes if c != "passed")
        assert failed > 0, mutant
        assert row["every rank"]["right"] * 100 >= 60 * failed, (mutant, row["every rank"])
