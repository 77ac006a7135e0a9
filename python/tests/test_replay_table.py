"""The replay's confusion table over random cases (slow; CTest python_replay_slow, label python_slow): the numpy ring of
python/examples/planted_ring_attention.py, written apart from cpgold's simulator, with each planted mistake (and none)
on seeded random p2p cases, every rank's five tensors checked in process. Prints the table docs/diagnosis.md records:

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
