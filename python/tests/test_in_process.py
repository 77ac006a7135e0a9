"""The package on cpgold's C++ core: cases, explain, generation (file and memory), checks of files and of arrays,
global and per rank, and the messages a user gets. Each defect of the subprocess wrapper has its test here."""
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

import cpgold
import cpgold.testing
from conftest import REPO, golden_path
from numpy_varlen_attention import attention_on_fixture

SMALL = {"seqlens_q": [13, 0, 6], "heads_q": 2, "heads_kv": 1, "dim_qk": 16, "mask": "causal", "cp_size": 2,
         "comm": "p2p", "seed": 5}


def run_cli(cpgold_bin, *args):
    return subprocess.run([cpgold_bin, *map(str, args)], capture_output=True, text=True)


# -- cases, explain, generation --------------------------------------------------------------------------------------

def test_case_is_normalized_and_a_bad_key_is_named(core):
    case = cpgold.normalize_case(seqlens_q=[5, 8], cp_size=2)
    assert case["seqlens_kv"] == [5, 8] and case["padded_q"] == [8, 8] and case["dtype"] == "bf16"
    assert cpgold.normalize_case(json.dumps(case)) == case
    with pytest.raises(cpgold.InputError) as e:
        cpgold.normalize_case(seqlens_q=[5, 8], cp_size=0)
    assert e.value.field == "cp_size" and "cp_size" in str(e.value)
    with pytest.raises(cpgold.InputError, match="headsq|unknown"):
        cpgold.normalize_case(seqlens_q=[5], headsq=2)


def test_suites_are_the_commands(core):
    assert {"quick", "edge", "te", "golden"} <= set(cpgold.suite_names())
    quick = cpgold.suite("quick")
    assert len(quick) == 12 and all(isinstance(c.case, dict) for c in quick)
    assert [c.name for c in cpgold.random_suite(5, 3)] == [c.name for c in cpgold.random_suite(5, 3)]
    with pytest.raises(cpgold.InputError, match="suite"):
        cpgold.suite("nope")


def test_explain_is_the_commands_json(core, cpgold_bin):
    mine = cpgold.explain(seqlens_q=[5, 8, 30], cp_size=4, comm="p2p", mask="causal")
    cli = run_cli(cpgold_bin, "explain", "--seqlens-q", "5,8,30", "--cp-size", "4", "--comm", "p2p", "--mask",
                  "causal", "--format", "json")
    assert cli.returncode == 0 and mine == json.loads(cli.stdout)
    assert "rank" in cpgold.explain_text(seqlens_q=[5, 8], cp_size=2)


def test_generate_to_file_and_in_memory_give_the_bytes_of_gen(core, cpgold_bin, tmp_path):
    fx = cpgold.generate(SMALL, path=tmp_path / "py.h5")
    fx.close()
    assert run_cli(cpgold_bin, "gen", "--case", json.dumps(SMALL), "-o", tmp_path / "cli.h5").returncode == 0
    cli = (tmp_path / "cli.h5").read_bytes()
    assert (tmp_path / "py.h5").read_bytes() == cli
    with cpgold.generate(SMALL) as memory:
        assert memory.source == cli and memory.path == "<fixture in memory>"
        assert memory.inputs()["q"].shape == (24, 2, 16)
    with pytest.raises(cpgold.InputError, match="exists"):  # never over an existing file without force
        cpgold.generate(SMALL, path=tmp_path / "py.h5")
    cpgold.generate(dict(SMALL, seed=6), path=tmp_path / "py.h5", force=True).close()
    assert (tmp_path / "py.h5").read_bytes() != cli


# -- checks in process -----------------------------------------------------------------------------------------------

def test_numpy_outputs_pass_globally_per_rank_and_as_a_rank_list(core):
    with cpgold.Fixture(golden_path("a2ap2p_w4_window_gqa_bf16")) as fx:
        out = attention_on_fixture(fx)
        report = cpgold.check_outputs(fx, out, lse_layout="ht")
        assert report["pass"] and report["exit_code"] == 0 and "verdict: PASS" in report.text
        assert {r["rank"] for r in report["results"]} == {-1}
        shards = fx.shard_outputs(out)
        one = cpgold.testing.assert_close(fx, shards[2], rank=2, lse_layout="ht")
        assert {r["rank"] for r in one["results"]} == {2} and one["ranks"] == [2]
        every = cpgold.check_outputs(fx, shards, lse_layout="ht")
        assert every["pass"] and {r["rank"] for r in every["results"]} == {0, 1, 2, 3}
        gathered = cpgold.check_outputs(fx, out, scope="cp_gathered", lse_layout="ht")
        assert {r["budget"] for r in gathered["results"]} == {"cp"}


def test_in_process_arrays_equal_the_command_on_the_written_candidate(core, cpgold_bin, tmp_path):
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        out = attention_on_fixture(fx, "lse_log2")
        arrays = cpgold.check_outputs(fx, out, lse_layout="ht")
        cpgold.write_global(tmp_path / "c.h5", out, fixture=fx, lse_layout="ht")
    cli = cpgold.check(golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "c.h5", cpgold=cpgold_bin)
    files = cpgold.check(golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "c.h5")
    keys = ("tensor", "pass", "max_err", "mean_err", "max_limit", "mean_limit", "exact_violations", "first_divergence")
    for a, b, c in zip(arrays["results"], cli["results"], files["results"]):
        assert [a[k] for k in keys] == [b[k] for k in keys] == [c[k] for k in keys]
    assert not arrays["pass"] and not cli["pass"]


def test_torch_tensors_bf16_and_cuda_when_available(core):
    torch = pytest.importorskip("torch", reason="torch is optional (not installed here)")
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        out = attention_on_fixture(fx)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        t = {n: torch.from_numpy(x).to(device) for n, x in out.items()}
        t = {n: (x if n == "lse" else x.to(torch.bfloat16)) for n, x in t.items()}
        cpgold.testing.assert_close(fx, t, lse_layout="ht")


def test_ml_dtypes_bfloat16_arrays(core):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is optional (not installed here)")
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        out = attention_on_fixture(fx)
        bf16 = {n: (x if n == "lse" else x.astype(ml_dtypes.bfloat16)) for n, x in out.items()}
        cpgold.testing.assert_close(fx, bf16, lse_layout="ht")


def test_assert_close_message_carries_the_report(core):
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        out = attention_on_fixture(fx)
        o = out["o"].copy()
        o[5, 1, 3] = np.nan  # sequence 0, row 5
        with pytest.raises(AssertionError) as e:
            cpgold.testing.assert_close(fx, dict(out, o=o), lse_layout="ht")
        text = str(e.value)
        for needed in ("tensor ", "deciding", "exact rule violated", "not finite", "first divergence:",
                       "sequence 0, row 5 of the sequence", "head 1, dim 3", "candidate nan", "oracle ", "peer ",
                       "reproduce: cpgold gen --case '", "verdict: FAIL"):
            assert needed in text, needed
        shards = fx.shard_outputs(out)
        lse = shards[1]["lse"].copy()
        lse[0, 2] += 0.5
        with pytest.raises(AssertionError, match=r"rank 1, .*head 0"):
            cpgold.testing.assert_close(fx, dict(shards[1], lse=lse), rank=1, lse_layout="ht")
        with pytest.raises(cpgold.InputError, match=r"expected shape \[60, 2, 64\]"):  # bad input is not a failure
            cpgold.testing.assert_close(fx, dict(out, o=out["o"][:, :, :64].repeat(1, axis=0)[:, :1]), lse_layout="ht")


# -- the defects of the subprocess wrapper, each mended -------------------------------------------------------------

def test_tensors_given_as_a_string(core, cpgold_bin, tmp_path):
    name = "allgather_w2_window_bf16"
    with cpgold.Fixture(golden_path(name)) as fx:
        out = attention_on_fixture(fx)
        cpgold.write_global(tmp_path / "fwd.h5", {"o": out["o"], "lse": out["lse"]}, fixture=fx, lse_layout="ht")
        assert cpgold.check_outputs(fx, {"o": out["o"], "lse": out["lse"]}, tensors="o,lse", lse_layout="ht")["pass"]
    for binary in (None, cpgold_bin):  # was: --tensors o,,,l,s,e and `unknown tensor ""`
        report = cpgold.check(golden_path(name), tmp_path / "fwd.h5", tensors="o,lse", cpgold=binary)
        assert report["pass"] and {r["tensor"] for r in report["results"]} == {"o", "lse"}
    with pytest.raises(cpgold.InputError, match='unknown tensor "l"'):
        cpgold.check(golden_path(name), tmp_path / "fwd.h5", tensors=["o", "l"])


def test_a_bad_o_is_not_blamed_on_lse(tmp_path):
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        out = {n: fx.golden(n) for n in cpgold.OUTPUT_NAMES}
    bad = dict(out, o=out["o"][:, :1])  # o with 1 head of 2
    with pytest.raises(ValueError) as e:
        cpgold.write_global(tmp_path / "m.h5", bad)
    message = str(e.value)
    assert "heads of o (shape (60, 1, 64))" in message and "disagree" in message and "fixture=" in message
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        with pytest.raises(ValueError, match=r"o has shape \(60, 1, 64\), the fixture's global layout needs"):
            cpgold.write_global(tmp_path / "m.h5", bad, fixture=fx)
    assert not (tmp_path / "m.h5").exists()


def test_failures_name_the_exact_rule_and_the_first_divergence(core, cpgold_bin, tmp_path):
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        out = {n: fx.golden(n) for n in cpgold.OUTPUT_NAMES}
        o = out["o"].copy()
        o[5:10] = np.nan
        cpgold.write_global(tmp_path / "nan.h5", dict(out, o=o), fixture=fx)
        o = out["o"].copy()
        o[29] = 1.0  # the first pad row of sequence 0 (29 tokens, 32 padded rows)
        cpgold.write_global(tmp_path / "pad.h5", dict(out, o=o), fixture=fx)
    for binary in (None, cpgold_bin):
        lines = cpgold.failures(cpgold.check(golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "nan.h5", cpgold=binary))
        text = "\n".join(lines)
        assert "exact rule: not finite (640 element(s))" in text
        assert "first divergence: sequence 0, row 5 of the sequence" in text and "candidate nan" in text
        pad = "\n".join(cpgold.failures(cpgold.check(golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "pad.h5",
                                                     cpgold=binary)))
        assert "exact rule: pad row not zero" in pad and "sequence 0, pad row (row 29 of its padded range)" in pad
        assert "worst element" not in pad  # the budget held: no "worst element" where candidate equals oracle


def test_the_golden_given_as_its_own_candidate_is_refused(core, cpgold_bin, tmp_path):
    path = golden_path("p2p_w2_causal_gqa_bf16")
    with pytest.raises(cpgold.CheckInputError, match="is the golden fixture itself.*--allow-same-file"):
        cpgold.check(path, path)
    cli = run_cli(cpgold_bin, "check", path, path)
    assert cli.returncode == 2 and "is the golden fixture itself" in cli.stderr and "swapped" in cli.stderr
    os.symlink(path, tmp_path / "link.h5")  # the same file under another name
    assert run_cli(cpgold_bin, "check", path, tmp_path / "link.h5").returncode == 2
    on_purpose = cpgold.check(path, path, allow_same_file=True)
    assert on_purpose["pass"] and on_purpose["fixture_candidate"] == path
    assert "stored simulator outputs (/peer)" in on_purpose["verdict"]
    assert {r["budget"] for r in on_purpose["results"]} == {"cp"} and {r["rank"] for r in on_purpose["results"]} == {-1}
    cli = run_cli(cpgold_bin, "check", path, path, "--allow-same-file")
    assert cli.returncode == 0 and "verdict: PASS (checked the stored simulator outputs (/peer)" in cli.stdout


def test_a_fixture_as_candidate_is_said_so_and_other_inputs_fail(core, cpgold_bin, tmp_path):
    golden = cpgold.generate(SMALL, path=tmp_path / "a.h5")
    golden.close()
    cpgold.generate(SMALL, path=tmp_path / "same.h5").close()            # same case and seed: same inputs
    cpgold.generate(dict(SMALL, seed=6), path=tmp_path / "other.h5").close()  # same shapes, other inputs
    same = cpgold.check(tmp_path / "a.h5", tmp_path / "same.h5")
    assert same["pass"] and same["fixture_candidate"] == str(tmp_path / "same.h5")
    assert "not an implementation" in same["verdict"] and same["inputs"]["candidates"][0]["matches"]
    other = run_cli(cpgold_bin, "check", tmp_path / "a.h5", tmp_path / "other.h5")
    assert other.returncode == 1
    assert "was computed from the inputs of another fixture" in other.stdout and '"seed":6' in other.stdout
    assert "verdict: FAIL (the candidate was computed from the inputs of another fixture" in other.stdout


def test_a_candidate_from_another_fixtures_inputs_says_so(core, cpgold_bin, tmp_path):
    seven = cpgold.generate(SMALL, path=tmp_path / "seed5.h5")
    eight = cpgold.generate(dict(SMALL, seed=8), path=tmp_path / "seed8.h5")
    cpgold.write_global(tmp_path / "from8.h5", attention_on_fixture(eight), fixture=eight, lse_layout="ht")
    cpgold.write_global(tmp_path / "from5.h5", attention_on_fixture(seven), fixture=seven, lse_layout="ht")
    with h5py.File(tmp_path / "from8.h5", "r") as f:
        assert f.attrs["inputs_sha256"] == eight.inputs_sha256 != seven.inputs_sha256
    for binary in (None, cpgold_bin):
        wrong = cpgold.check(tmp_path / "seed5.h5", tmp_path / "from8.h5", cpgold=binary)
        assert not wrong["pass"] and wrong["inputs"]["candidates"][0]["matches"] is False
        assert "computed from the inputs of another fixture" in wrong["verdict"]
        assert any("computed from the inputs of another fixture" in line for line in cpgold.failures(wrong))
        right = cpgold.check(tmp_path / "seed5.h5", tmp_path / "from5.h5", cpgold=binary)
        assert right["pass"] and right["inputs"]["candidates"][0]["matches"] is True
    text = run_cli(cpgold_bin, "check", tmp_path / "seed5.h5", tmp_path / "from8.h5").stdout
    assert "from8.h5 was computed from the inputs of another fixture (case {" in text
    seven.close()
    eight.close()


def test_inputs_digest_agrees_between_cpp_and_python(core):
    for name in ("p2p_w2_causal_gqa_bf16", "a2a_w2_full_gqa_fp16_nan_pads", "allgather_w3_full_mqa_fp32"):
        with cpgold.Fixture(golden_path(name)) as fx:
            stored = fx.inputs_sha256
            fx._inputs_sha256 = None  # recomputed here from /inputs, as for a fixture written before the attribute
            assert fx.inputs_sha256 == stored == core.open_fixture(golden_path(name), True)["inputs_sha256"]


def test_json_numbers_are_numbers_and_pass_kind_is_explained(cpgold_bin, tmp_path):
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        out = {n: fx.golden(n) for n in cpgold.OUTPUT_NAMES}
        o = out["o"].copy()
        o[5] = np.nan
        cpgold.write_global(tmp_path / "nan.h5", dict(out, o=o), fixture=fx)
    cli = run_cli(cpgold_bin, "check", golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "nan.h5", "--format", "json")
    report = json.loads(cli.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))

    def walk(node, path=""):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "nonfinite":  # the map that names the non-finite values: text by design
                    continue
                if k in ("candidate", "oracle", "peer", "max_err", "mean_err", "max_ratio", "mean_ratio"):
                    assert v is None or isinstance(v, (int, float)), f"{path}/{k} = {v!r}"
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(report)
    o_result = report["results"][0]
    assert o_result["max_err"] is None and o_result["nonfinite"]["max_err"] == "inf"
    assert o_result["first_divergence"]["candidate"] is None
    assert o_result["first_divergence"]["nonfinite"] == {"candidate": "nan"}
    assert o_result["first_divergence"]["exact_rule_id"] == "not_finite"
    assert all(r["pass_kind"] is None for r in report["results"])  # null: not a step partial
    assert report["margins"]["deciding_max_ratio"] is None
    text = run_cli(cpgold_bin, "check", golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "nan.h5").stdout
    assert "-inf%" not in text and "no margin: a compared value is not finite" in text
    back = cpgold.check(golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "nan.h5", cpgold=cpgold_bin)
    assert back["results"][0]["max_err"] == float("inf")  # the package gives the floats back


def test_torch_missing_is_said_plainly(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as in a Python without torch: `import torch` fails
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        with pytest.raises(ModuleNotFoundError, match="needs PyTorch, which is not installed.*pip install torch"):
            fx.inputs("torch")


def test_docs_build_with_the_readmes_commands():
    readme = open(os.path.join(REPO, "README.md")).read()
    python_md = open(os.path.join(REPO, "docs", "python.md")).read()
    commands = [m.strip() for m in re.findall(r"(cmake --[^`\n#]*)", python_md)]
    assert commands, "docs/python.md shows how to build the command"
    for command in commands:
        assert command in readme, f"docs/python.md builds with {command!r}, the README does not"
    assert "pip install ./python" in python_md
    assert python_md.index("numpy only") < python_md.index("## With PyTorch"), "the numpy path comes first"


def test_fixture_read_by_the_cpp_reader(core, tmp_path):
    import shutil

    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        summary = fx.validate()
        assert summary["schema_version"] == 2 and summary["inputs_sha256"] == fx.inputs_sha256
        assert summary["case_json"] == fx.case_json
    shutil.copy(golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "tampered.h5")
    with h5py.File(tmp_path / "tampered.h5", "r+") as f:
        f["case"].attrs["inputs_sha256"] = "0" * 64
    with cpgold.Fixture(tmp_path / "tampered.h5") as fx:
        with pytest.raises(cpgold.InputError, match="does not match the stored inputs"):
            fx.validate()
    shutil.copy(golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "missing.h5")
    with h5py.File(tmp_path / "missing.h5", "r+") as f:
        del f["golden/dq"]
    with pytest.raises(cpgold.FixtureError) as e:  # refused when opened, by the reader of `cpgold inspect`
        cpgold.Fixture(tmp_path / "missing.h5")
    assert e.value.field.endswith(":/golden/dq") and "dataset missing" in str(e.value)
