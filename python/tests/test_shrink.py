"""cpgold.shrink with callables whose smallest failing cases are known, the broken ring example of docs/shrink.md,
and the Hypothesis strategies (skipped, saying so, where Hypothesis is not installed)."""
import importlib.util
import json
import os

import numpy as np
import pytest

import cpgold

pytest.importorskip("cpgold._core", reason="cpgold's extension (cpgold._core) is not built: shrink runs in process")

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "broken_ring_attention.py")

START = {"seqlens_q": [90, 3, 0, 40], "padded_q": [96, 8, 8, 40], "heads_q": 4, "heads_kv": 2, "dim_qk": 16,
         "mask": "causal", "window": [20, 0], "cp_size": 2, "comm": "p2p", "pad_fill": "nan", "seed": 5}


def golden_outputs(fx):
    return {"o": fx.golden("o"), "lse": fx.golden("lse")}


def fails_when(condition, corrupt):
    """A global implementation that returns the oracle's outputs, corrupted when condition(fixture) holds."""
    def fn(fx):
        out = golden_outputs(fx)
        if condition(fx):
            corrupt(fx, out)
        return out
    return fn


def swap_heads(fx, out):  # query heads 0 and 1 exchanged on the way out
    out["o"][:, [0, 1]] = out["o"][:, [1, 0]]
    out["lse"][[0, 1]] = out["lse"][[1, 0]]


def lse_plus_ln2(fx, out):
    # np.float32: the LSE stays float32 under NumPy 2's promotion rules too
    out["lse"] = np.where(np.isfinite(out["lse"]), out["lse"] + np.float32(np.log(2.0)), out["lse"])


def garbage_on_pads(fx, out):
    pads = ~fx.valid_rows("q")
    out["o"][pads] = 0.5


def shrink(fn, start=START, **kw):
    return cpgold.shrink(start, fn, tensors=("o", "lse"), lse_layout="ht", **kw)


def test_gqa_runner_reaches_two_query_heads_on_one_kv_head():
    r = shrink(fails_when(lambda fx: fx.heads_q // fx.heads_kv > 1, swap_heads))
    assert r.smaller and r["stopped"] == "minimal"
    assert r["kinds"] == ["head_mapping"]
    case = r.case
    assert (case["heads_q"], case["heads_kv"]) == (2, 1)
    assert case["dim_qk"] == 1 and case["cp_size"] == 1
    assert r["report"] is not None and not r["report"].passed
    assert "diagnosis: head_mapping" in r["report"].text


def test_same_tensors_keeps_the_original_way_of_failing():
    # O wrong under GQA (the original's failure), LSE wrong without CP (another defect): with any failure kept the
    # search slides to the second; with same_tensors the smallest still fails O alone, so keeps GQA and CP.
    def fn(fx):
        out = golden_outputs(fx)
        if fx.heads_q // fx.heads_kv > 1:
            out["o"] = out["o"] * np.float32(1.5)
        if fx.cp_size == 1:
            lse_plus_ln2(fx, out)
        return out
    loose = shrink(fn, any_failure=True)
    assert loose.case["cp_size"] == 1 and loose.case["heads_q"] == 1
    assert loose["smallest_verdict"]["tensors"] == ["lse"]
    strict = shrink(fn, any_failure=True, same_tensors=True)
    assert strict["same_tensors"] and strict["original_verdict"]["tensors"] == ["o"]
    assert strict["smallest_verdict"]["tensors"] == ["o"]
    assert strict.case["cp_size"] == 2 and (strict.case["heads_q"], strict.case["heads_kv"]) == (2, 1)
    assert strict["failed_otherwise"] > 0


def test_chunk_count_runner_reaches_one_short_sequence():
    # Fails (garbage on pad rows) when some sequence is shorter than its 2W chunks and not empty.
    short = lambda fx: any(0 < n < 2 * fx.cp_size for n in fx.seqlens("q"))
    r = shrink(fails_when(short, garbage_on_pads))
    assert r["kinds"] == ["pad_rows_not_zero"]
    assert r.case["seqlens_q"] == [1] and r.case["cp_size"] == 1
    assert r["rows_q"] == 2


def test_window_runner_keeps_a_window():
    r = shrink(fails_when(lambda fx: fx.window[0] >= 0, lse_plus_ln2))
    assert r["kinds"] == ["lse_convention"]
    assert r.case["window"] == [0, -1] and "mask" not in r.case
    assert r.case["seqlens_q"] == [1]  # LSE needs a row with keys


def test_exceptions_and_unusable_outputs_are_no_candidate_never_kept():
    def fn(fx):
        if sum(fx.seqlens("q")) < 30:
            raise RuntimeError("kernel does not support short batches")
        if fx.heads_q == 1:
            return {"o": np.zeros((1, 1, 1), np.float32)}  # the wrong shape: unusable
        if fx.dim_qk < 4:
            return None
        out = golden_outputs(fx)
        swap_heads(fx, out)
        return out
    r = shrink(fn)
    assert sum(r.case["seqlens_q"]) == 30
    assert r.case["heads_q"] == 2 and r.case["dim_qk"] == 4
    assert r["no_candidate"] > 0
    assert r["smallest_verdict"]["status"] == "fails"


def test_same_answer_twice_and_bounds():
    fn = fails_when(lambda fx: fx.heads_q // fx.heads_kv > 1, swap_heads)
    a, b = shrink(fn), shrink(fn)
    assert (a["smallest"], a["steps"], a["runs"]) == (b["smallest"], b["steps"], b["runs"])
    bounded = shrink(fn, max_runs=4)
    assert bounded["runs"] == 4 and bounded["stopped"] == "max_runs"
    seen = []
    r = shrink(fn, max_runs=3, progress=seen.append)
    assert [p["run"] for p in seen] == [1, 2, 3, 4, 5] and seen[0]["change"] == "the original"
    # after the search, the confirmation runs of its answer (confirm=2 by default), outside max_runs
    assert [p["change"] for p in seen[3:]] == ["confirmation 1 of 2 of the search's smallest",
                                               "confirmation 2 of 2 of the search's smallest"]
    assert r["runs"] == 3 and r["confirmation_runs"] == 2 and r["confirmed"]


def test_original_must_fail():
    with pytest.raises(cpgold.InputError, match="pass their check"):
        shrink(golden_outputs)
    with pytest.raises(cpgold.InputError, match="no candidate for the original"):
        shrink(lambda fx: 1 / 0)
    with pytest.raises(cpgold.InputError, match="any_failure"):
        shrink(golden_outputs, kind="merge", any_failure=True)


def test_per_rank_outputs_and_the_broken_ring_example():
    spec = importlib.util.spec_from_file_location("broken_ring_attention", EXAMPLE)
    ring = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ring)
    start = {"seqlens_q": [70, 3, 0, 41], "heads_q": 4, "heads_kv": 2, "dim_qk": 16, "mask": "causal",
             "window": [30, 0], "cp_size": 4, "comm": "p2p", "pad_fill": "nan", "seed": 3}
    # The fixed ring passes, the broken one fails as tail_rows_missing per rank.
    fx = cpgold.generate(start)
    assert cpgold.check_outputs(fx, ring.ring_attention(fx, bug=False), tensors=("o", "lse"), lse_layout="ht").passed
    r = cpgold.shrink(start, ring.ring_attention, tensors=("o", "lse"), lse_layout="ht")
    assert r["kinds"] == ["tail_rows_missing"]
    assert r["original_rows_q"] == 128 and r["rows_q"] <= 8
    assert len(r.case["seqlens_q"]) == 1 and r.case["cp_size"] >= 2
    fixed = cpgold.generate(r.case)
    assert cpgold.check_outputs(fixed, ring.ring_attention(fixed, bug=False), tensors=("o", "lse"),
                                lse_layout="ht").passed


# -- Hypothesis -----------------------------------------------------------------------------------------------------

def _hypothesis():
    return pytest.importorskip("hypothesis", reason="Hypothesis is not installed (pip install hypothesis; Debian: "
                                                    "python3-hypothesis): the strategies tests did not run")


def test_strategies_draw_valid_cases_within_bounds():
    hypothesis = _hypothesis()
    from hypothesis import given, settings, HealthCheck

    seen = {"zero": 0, "one": 0, "gqa": 0, "mqa": 0, "window": 0, "tail": 0, "padding": 0, "nan": 0}

    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cpgold.strategies.cases(cp_size=4, comm="p2p", max_seqlen=40))
    def check(case):
        normal = cpgold.normalize_case(case)  # valid: InputError otherwise
        assert normal["cp_size"] == 4 and normal["comm"] == "p2p"
        assert all(n <= 40 for n in normal["seqlens_q"])
        seen["zero"] += 0 in normal["seqlens_q"]
        seen["one"] += 1 in normal["seqlens_q"]
        seen["gqa"] += normal["heads_kv"] < normal["heads_q"]
        seen["mqa"] += normal["heads_kv"] == 1 < normal["heads_q"]
        seen["window"] += normal["window"][0] >= 0
        seen["tail"] += normal["total_tokens_q"] > sum(normal["padded_q"])
        seen["padding"] += "padded_q" in case
        seen["nan"] += normal["pad_fill"] == "nan"

    check()
    assert hypothesis is not None
    assert all(count > 0 for count in seen.values()), seen


def test_strategies_every_comm_type_valid():
    _hypothesis()
    from hypothesis import given, settings, HealthCheck

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cpgold.strategies.cases(max_cp_size=8))
    def check(case):
        cpgold.normalize_case(case)

    check()


def test_strategies_bounds_are_checked():
    _hypothesis()
    with pytest.raises(cpgold.InputError, match="comm: 'ring' is not one of"):
        cpgold.strategies.cases(comm="ring")
    with pytest.raises(cpgold.InputError, match="max_sequences"):
        cpgold.strategies.cases(min_sequences=3, max_sequences=2)
    with pytest.raises(cpgold.InputError, match="cp_size"):
        cpgold.strategies.cases(cp_size=0)


def test_hypothesis_finds_and_shrinks_the_broken_ring():
    _hypothesis()
    from hypothesis import given, settings, HealthCheck, Phase

    spec = importlib.util.spec_from_file_location("broken_ring_attention", EXAMPLE)
    ring = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ring)
    failing = []

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
    @given(case=cpgold.strategies.cases(cp_size=4, comm="p2p", max_seqlen=24, dims=(8,), max_heads_q=2))
    def test_ring(case):
        fx = cpgold.generate(case)
        try:
            cpgold.testing.assert_close(fx, ring.ring_attention(fx), tensors=("o", "lse"), lse_layout="ht")
        except AssertionError:
            failing.append(case)
            raise

    with pytest.raises(AssertionError, match="tail_rows_missing"):
        test_ring()
    smallest = failing[-1]  # Hypothesis replays its shrunk example last
    assert sum(cpgold.normalize_case(smallest)["seqlens_q"]) <= 8, json.dumps(smallest)
