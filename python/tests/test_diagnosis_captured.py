"""Calls captured from a real training step on GPUs, kept as regression cases of the diagnosis (docs/diagnosis.md,
"Captured calls"): TransformerEngine 2.20.2 under CP (p2p, causal, GQA 4/2, head dim 64, bf16, padding between
sequences), layer 0 of step 1, cut to two of its four sequences (23 and 9 tokens; attention never crosses sequences,
so every rank's rows of those sequences are what the GPU computed for them). Each folder holds the case, the global
inputs and every rank's O, dQ, dK, dV (python/tests/data/captured/*).

- te_fa4_w2, te_fa4_w4: FlashAttention-4 4.0.0b36 as the backend at W = 2 and 4. TE passes the causal window
  (-1, 0), which FA4 reads as the empty band [i + 1, i] (docs/findings/fa-3-causal-window-minus-one.md): the diagonal
  tiles see no key. Named mask_edge by the replay of diagonal_keyless, which reproduces every element; never
  softmax_scale (what one gradient alone fitted before every result had to agree with a variant).
- te_fused_w2: cuDNN FusedAttention (cuDNN 9.14) at W = 2, which writes non-zero dK/dV for a sequence that a step
  holds without queries (docs/findings/te-3-gqa-query-less-dkdv.md). The values are whatever the kernel wrote: no
  mistake reproduces them, and the report says unexplained, with that pattern among its symptoms.
"""
import json
import os

import h5py
import numpy as np
import pytest

import cpgold

DATA = os.path.join(os.path.dirname(__file__), "data", "captured")


def load(name):
    folder = os.path.join(DATA, name)
    with open(os.path.join(folder, "case.json")) as f:
        case = json.load(f)
    with h5py.File(os.path.join(folder, "inputs.h5"), "r") as f:
        inputs = {n: np.asarray(f[n][()]) for n in ("q", "k", "v", "dout")}
    return case, inputs, os.path.join(folder, "candidate.h5")


def check(name, candidate=None):
    case, inputs, path = load(name)
    fx = cpgold.generate(case, inputs=inputs)
    try:
        if candidate is None:
            return cpgold.check(fx, path, tensors="o,dq,dk,dv", pad_rows="unwritten"), fx
        return cpgold.check_outputs(fx, candidate, tensors="o,dq,dk,dv", pad_rows="unwritten"), fx
    finally:
        fx.close()


def ranks(name):
    _, _, path = load(name)
    with h5py.File(path, "r") as f:
        return [{n: np.asarray(f[f"ranks/{r}/{n}"][()]) for n in ("o", "dq", "dk", "dv")} for r in range(len(f["ranks"]))]


@pytest.mark.parametrize("name", ["te_fa4_w2", "te_fa4_w4"])
def test_flash_attention_4_under_te_is_the_diagonal_without_keys(core, name):
    report, _ = check(name)
    assert not report["pass"]
    kinds = [d["kind"] for d in report["diagnosis"]]
    assert kinds == ["mask_edge"], [d["evidence"] for d in report["diagnosis"]]
    replay = report["diagnosis"][0]["where"]["replay"]
    assert replay["mistake"] == "diagonal_keyless" and replay["worst_ratio"] < 1
    assert "softmax_scale" not in json.dumps(report["diagnosis"])
    # Each rank alone: named the same, or unexplained; never another kind.
    for r, out in enumerate(ranks(name)):
        case, inputs, _ = load(name)
        fx = cpgold.generate(case, inputs=inputs)
        try:
            one = cpgold.check_outputs(fx, out, rank=r, tensors="o,dq,dk,dv", pad_rows="unwritten")
        finally:
            fx.close()
        assert not one["pass"]
        assert [d["kind"] for d in one["diagnosis"]] in (["mask_edge"], ["unexplained"]), (r, one["diagnosis"])


def test_fused_attention_query_less_dkdv_is_unexplained_with_its_pattern(core):
    report, _ = check("te_fused_w2")
    assert not report["pass"]
    failed = sorted(f"{r['tensor']}@r{r['rank']}" for r in report["results"] if not r["pass"])
    assert failed == ["dv@r1"]
    assert [d["kind"] for d in report["diagnosis"]] == ["unexplained"]
    where = report["diagnosis"][0]["where"]
    patterns = [s for s in where["symptoms"] if s["kind"] == "queryless_keys"]
    assert patterns and "te-3-gqa-query-less-dkdv.md" in patterns[0]["evidence"]
    assert patterns[0]["queryless_key_rows"] == 3 and patterns[0]["queryless_tiles"] == ["rank 0 step 0 sequence 1"]
    evidence = report["diagnosis"][0]["evidence"]
    assert "replayed mistakes reproduces a failing row or moves one towards the candidate" in evidence or \
        "the closest:" in evidence
