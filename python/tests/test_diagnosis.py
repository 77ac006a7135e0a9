"""The diagnosis of a failed check (docs/diagnosis.md) through the package: the in-process engine's reports of arrays
(global, one rank, every rank) and of files carry it, as JSON, as the "diagnosis:" lines of report.text and of
cpgold.failures(), and in assert_close's message; the command's report (cpgold=BINARY) holds the same findings;
diagnosis=False skips it; a candidate that states another fixture's inputs is diagnosed inputs_mismatch by digest even
when its numbers pass. The wrong outputs are numpy_varlen_attention.py's deliberate mistakes, written apart from the
planted bugs of the C++ tests."""
import h5py
import pytest

import cpgold
import cpgold.testing
from conftest import golden_path
from numpy_varlen_attention import attention_on_fixture

# (committed golden fixture, deliberate mistake, the kind it is)
MISTAKES = [
    ("nocp_cross_window_fp32", "top_left", "mask_edge"),             # diagonal aligned top-left where L_q != L_kv
    ("a2a_w2_full_gqa_fp16_nan_pads", "gqa_modulo", "head_mapping"),  # query head h reads KV head h % h_kv
    ("p2p_w2_causal_gqa_bf16", "lse_log2", "lse_convention"),         # LSE in base 2
]
SMALL = {"seqlens_q": [13, 0, 6], "heads_q": 2, "heads_kv": 1, "dim_qk": 16, "mask": "causal", "cp_size": 2,
         "comm": "p2p", "seed": 5}


def kinds(report):
    return [d["kind"] for d in report["diagnosis"]]


def lines(report):
    return [f"diagnosis: {d['kind']}: {d['evidence']}" for d in report["diagnosis"]]


@pytest.mark.parametrize("name,mistake,kind", MISTAKES)
def test_arrays_in_process_carry_the_diagnosis(core, name, mistake, kind):
    with cpgold.Fixture(golden_path(name)) as fx:
        report = cpgold.check_outputs(fx, attention_on_fixture(fx, mistake), lse_layout="ht")
    assert not report["pass"] and kinds(report) == [kind]
    finding = report["diagnosis"][0]
    assert finding["evidence"] and finding["where"]["rows"] > 0
    failed = {r["tensor"] for r in report["results"] if not r["pass"]}
    assert set(finding["where"]["results"]) <= failed and finding["where"]["results"]
    assert lines(report)[0] in report.text.splitlines()
    assert cpgold.failures(report)[-len(lines(report)):] == lines(report)


def test_rank_local_arrays_name_the_rank(core):
    with cpgold.Fixture(golden_path("a2ap2p_w4_window_gqa_bf16")) as fx:
        shards = fx.shard_outputs(attention_on_fixture(fx, "gqa_modulo"))
        one = cpgold.check_outputs(fx, shards[2], rank=2, lse_layout="ht")
        every = cpgold.check_outputs(fx, shards, lse_layout="ht")
    assert kinds(one) == ["head_mapping"] and one["diagnosis"][0]["where"]["ranks"] == [2]
    assert all(name.endswith("@r2") for name in one["diagnosis"][0]["where"]["results"])
    assert kinds(every) == ["head_mapping"] and every["diagnosis"][0]["where"]["ranks"] == [0, 1, 2, 3]


def test_assert_close_message_carries_the_diagnosis(core):
    with cpgold.Fixture(golden_path("nocp_cross_window_fp32")) as fx:
        out = attention_on_fixture(fx)
        wrong = attention_on_fixture(fx, "top_left")
        with pytest.raises(AssertionError) as e:
            cpgold.testing.assert_close(fx, wrong, lse_layout="ht")
        message = str(e.value)
        assert "\ndiagnosis: mask_edge: " in message
        assert message.index("diagnosis: mask_edge: ") < message.index("reproduce: cpgold gen --case '")
        with pytest.raises(AssertionError) as e:
            cpgold.testing.assert_close(fx, wrong, lse_layout="ht", diagnosis=False)
        assert "diagnosis:" not in str(e.value) and "verdict: FAIL" in str(e.value)
        passed = cpgold.testing.assert_close(fx, out, lse_layout="ht")
        assert passed["pass"] and passed["diagnosis"] == [] and "diagnosis:" not in passed.text


@pytest.mark.parametrize("name,mistake,kind", MISTAKES)
def test_files_in_process_and_through_the_command_agree(core, cpgold_bin, tmp_path, name, mistake, kind):
    with cpgold.Fixture(golden_path(name)) as fx:
        cpgold.write_global(tmp_path / "c.h5", attention_on_fixture(fx, mistake), fixture=fx, lse_layout="ht")
    in_process = cpgold.check(golden_path(name), tmp_path / "c.h5")
    command = cpgold.check(golden_path(name), tmp_path / "c.h5", cpgold=cpgold_bin)
    assert kinds(in_process) == [kind] and in_process["diagnosis"] == command["diagnosis"]
    assert lines(in_process)[0] in in_process.text.splitlines()
    for binary in (None, cpgold_bin):
        skipped = cpgold.check(golden_path(name), tmp_path / "c.h5", cpgold=binary, diagnosis=False)
        assert not skipped["pass"] and skipped["diagnosis"] == []
        assert [r["pass"] for r in skipped["results"]] == [r["pass"] for r in in_process["results"]]


def test_other_inputs_stated_are_diagnosed_even_when_the_numbers_pass(core, cpgold_bin, tmp_path):
    five = cpgold.generate(SMALL, path=tmp_path / "seed5.h5")
    eight = cpgold.generate(dict(SMALL, seed=8), path=tmp_path / "seed8.h5")
    right = {n: five.golden(n) for n in cpgold.OUTPUT_NAMES}  # this fixture's own outputs ...
    cpgold.write_global(tmp_path / "c.h5", right, fixture=eight)  # ... stated as computed from seed 8's inputs
    with h5py.File(tmp_path / "c.h5", "r") as f:
        assert f.attrs["inputs_sha256"] == eight.inputs_sha256 != five.inputs_sha256
    for binary in (None, cpgold_bin):
        report = cpgold.check(tmp_path / "seed5.h5", tmp_path / "c.h5", cpgold=binary)
        assert not report["pass"] and all(r["pass"] for r in report["results"])
        assert kinds(report) == ["inputs_mismatch"]
        where = report["diagnosis"][0]["where"]
        assert where["method"] == "digest" and where["file"] == str(tmp_path / "c.h5")
        assert where["candidate_inputs_sha256"] == eight.inputs_sha256
        assert where["fixture_inputs_sha256"] == five.inputs_sha256
        assert lines(report)[0] in cpgold.failures(report)
    five.close()
    eight.close()
