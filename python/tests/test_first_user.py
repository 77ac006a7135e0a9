"""What a first user of cpgold with their own CP code met (issue: run_cp, readable failures, rough edges): empty
batches pass on their exact rules through both doors (the command and the package) while a check that compares
nothing by mistake still fails, forward-only checks point to tensors="o,lse", the assertion's first line sums the
failure up with cpgold's frames hidden, `explain` keeps TransformerEngine's warnings to --te, a user's partition is
compared chunk by chunk, and run_cp drives a CP function on thread ranks."""
import os
import subprocess
import sys

import numpy as np
import pytest

import cpgold
from conftest import REPO, golden_path

EMPTY = {"seqlens_q": [0], "cp_size": 2, "heads_q": 2, "dim_qk": 64}
ONE_TOKEN = {"seqlens_q": [1], "cp_size": 2, "heads_q": 2, "dim_qk": 16, "pad_fill": "nan"}


def golden_outputs(fx, rank=None):
    return {n: fx.golden(n, rank) for n in cpgold.OUTPUT_NAMES}


def both_doors(golden, candidate, cpgold_bin, **options):
    """The same check in process and through the command: (in-process report, command report)."""
    return cpgold.check(golden, candidate, **options), cpgold.check(golden, candidate, cpgold=cpgold_bin, **options)


def test_an_empty_batch_passes_on_its_exact_rules_through_both_doors(tmp_path, cpgold_bin, core):
    path = tmp_path / "empty.h5"
    fx = cpgold.generate(EMPTY, path=path)
    run = subprocess.run([cpgold_bin, "check", "--self", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "verdict: PASS (no valid element" in run.stdout
    report = cpgold.self_check(path)
    assert report["pass"] and report["no_valid_element"] and report["compared"] == 0

    # The golden's own outputs, per rank and gathered: the same verdict both ways.
    cpgold.write_ranks(tmp_path / "ranks.h5", [golden_outputs(fx, r) for r in range(2)], golden_outputs(fx), fixture=fx)
    for ours, command in [both_doors(path, tmp_path / "ranks.h5", cpgold_bin)]:
        assert ours["pass"] and command["pass"] and ours["no_valid_element"] and command["no_valid_element"]
        assert "no valid element" in ours["verdict"] and ours["verdict"] == command["verdict"]
    cpgold.testing.assert_close(fx, golden_outputs(fx))
    cpgold.testing.assert_close(fx, [golden_outputs(fx, r) for r in range(2)])

    # The exact rules still apply: with pad rows (an empty sequence padded to 8 rows), a non-zero pad row fails.
    path = tmp_path / "empty_padded.h5"
    fx = cpgold.generate(dict(EMPTY, padded_q=[8]), path=path)
    assert fx.total_rows("kv") == 8     # K/V laid out as Q (self-attention)
    cpgold.testing.assert_close(fx, golden_outputs(fx))
    bad = golden_outputs(fx)
    bad["o"] = bad["o"].copy()
    bad["o"][0, 0, 0] = 0.5
    cpgold.write_global(tmp_path / "bad.h5", bad, fixture=fx)
    ours, command = both_doors(path, tmp_path / "bad.h5", cpgold_bin)
    assert not ours["pass"] and not command["pass"]
    with pytest.raises(AssertionError, match="pad"):
        cpgold.testing.assert_close(fx, bad)


def test_a_check_of_padding_only_ranks_still_fails_through_both_doors(tmp_path, cpgold_bin, core):
    """One token, W = 2: rank 1 holds only padding. Checking rank 1 alone compares nothing although the fixture holds a
    token (on rank 0): a mistake the guard keeps failing, with the ranks that hold tokens named."""
    path = tmp_path / "one.h5"
    fx = cpgold.generate(ONE_TOKEN, path=path)
    cpgold.write_rank(tmp_path / "r1.h5", 1, golden_outputs(fx, 1), fixture=fx, lse_layout="ht")
    ours, command = both_doors(path, tmp_path / "r1.h5", cpgold_bin, ranks=[1])
    for report in (ours, command):
        assert not report["pass"] and report["compared"] == 0 and not report["no_valid_element"]
        assert "nothing was compared" in " ".join(cpgold.failures(report))
    assert "(on rank 0)" in ours.text
    with pytest.raises(AssertionError, match="nothing was compared"):
        cpgold.testing.assert_close(fx, golden_outputs(fx, 1), rank=1, lse_layout="ht")
    # Every rank at once compares the token and passes.
    cpgold.testing.assert_close(fx, [golden_outputs(fx, r) for r in range(2)], lse_layout="ht")


def test_assert_rank_close_reads_the_rank_and_lets_a_padding_only_rank_pass():
    torch = pytest.importorskip("torch")
    from cpgold.thread_ranks import ThreadRanks

    fx = cpgold.generate(ONE_TOKEN)

    def rank_main(rank, ranks):
        report = cpgold.testing.assert_rank_close(fx, golden_outputs(fx, rank), lse_layout="ht")
        wrong = golden_outputs(fx, rank)
        wrong["o"] = wrong["o"] + 1.0          # every row wrong, pad rows too
        with pytest.raises(AssertionError, match=rf"rank {rank} of 2"):
            cpgold.testing.assert_rank_close(fx, wrong, lse_layout="ht")
        return report

    reports = ThreadRanks(2, device="cpu", timeout=30).run(rank_main)
    assert reports[0]["compared"] > 0 and not reports[0].get("rank_holds_only_padding")
    assert reports[1]["compared"] == 0 and reports[1]["rank_holds_only_padding"]
    del torch


def test_forward_only_candidates_point_to_tensors_o_lse(tmp_path, cpgold_bin, core):
    name = "p2p_w2_causal_gqa_bf16"
    with cpgold.Fixture(golden_path(name)) as fx:
        forward = {n: fx.golden(n) for n in ("o", "lse")}
        cpgold.write_global(tmp_path / "fwd.h5", forward, fixture=fx)
        ours, command = both_doors(golden_path(name), tmp_path / "fwd.h5", cpgold_bin)
        for report in (ours, command):
            assert not report["pass"] and report["diagnosis"] == []
            assert '--tensors o,lse (Python: tensors="o,lse")' in report["hint"]
        assert "--tensors o,lse" in ours.text and "unexplained" not in ours.text
        with pytest.raises(AssertionError) as e:
            cpgold.testing.assert_close(fx, forward)
        first = str(e.value).splitlines()[0]
        assert first.startswith("cpgold: dq (missing), dk (missing), dv (missing) failed") and 'tensors="o,lse"' in first
        cpgold.testing.assert_close(fx, forward, tensors="o,lse")


def swap_chunks(fx, x, rank, side, axis=0):
    """Rank-local rows with each sequence's two chunks exchanged (chunk r where 2W-1-r belongs and back)."""
    x = np.array(x)
    offsets = fx.rank_cu_seqlens(rank, side, padded=True)
    out = x.copy()
    for b in range(len(offsets) - 1):
        a, e = int(offsets[b]), int(offsets[b + 1])
        half = (e - a) // 2
        sel = [slice(None)] * x.ndim
        src = [slice(None)] * x.ndim
        sel[axis], src[axis] = slice(a, a + half), slice(a + half, e)
        out[tuple(sel)] = x[tuple(src)]
        sel[axis], src[axis] = slice(a + half, e), slice(a, a + half)
        out[tuple(sel)] = x[tuple(src)]
    return out


def test_the_first_line_names_tensors_ranks_and_the_diagnosis_with_numbers():
    name = "a2ap2p_w4_window_gqa_bf16"
    with cpgold.Fixture(golden_path(name)) as fx:
        outs = [golden_outputs(fx, r) for r in range(fx.cp_size)]
        for n in cpgold.OUTPUT_NAMES:
            side = "kv" if n in ("dk", "dv") else "q"
            outs[1][n] = swap_chunks(fx, outs[1][n], 1, side, axis=1 if n == "lse" else 0)
        with pytest.raises(AssertionError) as e:
            cpgold.testing.assert_close(fx, outs, lse_layout="ht")
    lines = str(e.value).splitlines()
    assert lines[0].startswith("cpgold: o@r1, lse@r1, dq@r1, dk@r1, dv@r1 failed; diagnosis chunk_order: "), lines[0]
    assert "rank 1 chunks 1 and 6 swapped" in lines[0] and "2W-1-r" not in str(e.value)
    assert "verdict: FAIL" in lines[-1]


def test_pytest_hides_cpgold_frames_and_shows_the_summary_first(pytester, core):
    pytester.makepyfile(test_inner=f"""
import cpgold, cpgold.testing
def test_wrong():
    with cpgold.Fixture({golden_path("p2p_w2_causal_gqa_bf16")!r}) as fx:
        out = {{n: fx.golden(n) * 1.5 for n in cpgold.OUTPUT_NAMES}}
        cpgold.testing.assert_close(fx, out)
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "def assert_close" not in text and "report = check_outputs" not in text
    result.stdout.fnmatch_lines(["E   *AssertionError: cpgold: o, lse, dq, dk, dv failed; diagnosis *"])


def test_explain_lists_transformer_engine_warnings_only_with_te(cpgold_bin, core):
    case = dict(seqlens_q=[5, 8, 300], cp_size=4, comm="p2p", mask="causal")
    plain, te = cpgold.explain_text(**case), cpgold.explain_text(te=True, **case)
    assert "warning:" not in plain and "TransformerEngine only: " in plain and "explain --te" in plain
    assert te.count("warning:") == len(cpgold.explain(**case)["warnings"]) > 0
    args = [cpgold_bin, "explain", "--seqlens-q", "5,8,300", "--cp-size", "4", "--mask", "causal"]
    assert subprocess.run(args, capture_output=True, text=True, check=True).stdout == plain
    assert subprocess.run(args + ["--te"], capture_output=True, text=True, check=True).stdout == te


def test_compare_partition_names_the_chunks_that_differ():
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        mine = [fx.partitioned_indices(r, "q") for r in range(2)]
        assert cpgold.compare_partition(fx, mine) == []
        # A contiguous split (rank r takes chunks 2r and 2r+1): both ranks differ, chunks named.
        offsets = fx.cu_seqlens("q", padded=True)
        contiguous = []
        for r in range(2):
            rows = []
            for b in range(len(offsets) - 1):
                a, e = int(offsets[b]), int(offsets[b + 1])
                c = (e - a) // 4
                rows += list(range(a + 2 * r * c, a + (2 * r + 2) * c))
            tail = np.arange(int(offsets[-1]), fx.total_rows("q"))
            rows += list(np.array_split(tail, 2)[r])
            contiguous.append(np.array(rows))
        diffs = cpgold.compare_partition(fx, contiguous)
    assert len(diffs) == 2
    assert diffs[0].startswith("q rank 0: holds s0/c0 (global rows 0..7), s0/c1 (global rows 8..15)")
    assert "missing s0/c3" in diffs[0] and "not its own s0/c1" in diffs[0]
    assert "missing s0/c1" in diffs[1] and "not its own s0/c3" in diffs[1]


def test_compare_partition_finds_rows_misplaced_inside_the_right_chunks():
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        mine = [fx.partitioned_indices(r, "kv").copy() for r in range(2)]
        mine[1][[0, 1]] = mine[1][[1, 0]]
        diffs = cpgold.compare_partition(fx, mine, side="kv")
    assert len(diffs) == 1 and diffs[0].startswith("kv rank 1: the chunks are right")
    assert "local row 0 holds global row" in diffs[0]


sys.path.insert(0, os.path.join(REPO, "docs", "python"))


@pytest.mark.parametrize("name", ["p2p_w2_causal_gqa_bf16", "a2ap2p_w4_window_gqa_bf16", "a2a_w2_full_gqa_fp16_nan_pads"])
def test_run_cp_checks_every_rank_and_the_gathered_outputs(name):
    pytest.importorskip("torch")
    from test_own_cp_attention import cp_attention

    result = cpgold.run_cp(cp_attention, golden_path(name), device="cpu", lse_layout="ht")
    assert result.passed and set(result.reports) == {"ranks", "gathered"}
    ranks = {r["rank"] for r in result.reports["ranks"]["results"]}
    assert ranks == set(range(len(result.outputs))) and len(result.reports["ranks"]["results"]) == 5 * len(ranks)
    assert {r["tensor"] for r in result.reports["gathered"]["results"]} == set(cpgold.OUTPUT_NAMES)
    forward = cpgold.run_cp(cp_attention, golden_path(name), backward=False, device="cpu", lse_layout="ht")
    assert forward.passed and {r["tensor"] for r in forward.reports["gathered"]["results"]} == {"o", "lse"}


def test_run_cp_catches_pad_rows_leaking_into_gradients_and_names_them_first():
    """The bug a first user's ring had: O's pad rows not masked for the backward, so dout's NaN pad rows reach dV."""
    pytest.importorskip("torch")
    from test_own_cp_attention import attention_of_rank

    with pytest.raises(AssertionError) as e:
        cpgold.run_cp(attention_of_rank, golden_path("a2a_w2_full_gqa_fp16_nan_pads"), device="cpu", lse_layout="ht")
    first = str(e.value).splitlines()[0]
    assert first.startswith("cpgold: ranks: ") and "dv@r0" in first and "diagnosis nonfinite_leak" in first
    assert cpgold.run_cp(attention_of_rank, golden_path("a2a_w2_full_gqa_fp16_nan_pads"), backward=False,
                         device="cpu", lse_layout="ht").passed


def test_run_cp_reports_the_ranks_own_exception():
    pytest.importorskip("torch")

    def broken(q, k, v, ctx):
        if ctx.rank == 1:
            raise KeyError("planted")
        return q, q

    with pytest.raises(KeyError, match="planted") as e:
        cpgold.run_cp(broken, golden_path("p2p_w2_causal_gqa_bf16"), device="cpu")
    assert any("rank 1 of 2" in note for note in getattr(e.value, "__notes__", ["rank 1 of 2"]))
