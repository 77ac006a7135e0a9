"""`cpgold check` through the package: a correct numpy attention passes (global and per rank), each deliberate
mistake fails on the tensors it breaks, missing tensors and unusable files are reported."""
import numpy as np
import pytest

import cpgold
from conftest import golden_names, golden_path
from numpy_varlen_attention import attention_on_fixture


def failed_tensors(report):
    return {(r["tensor"], r["rank"]) for r in report["results"] if not r["pass"]}


@pytest.mark.parametrize("name", golden_names())
def test_correct_attention_passes_global_and_per_rank(name, tmp_path, cpgold_bin):
    with cpgold.Fixture(golden_path(name)) as fx:
        out = attention_on_fixture(fx)
        cpgold.write_ranks(tmp_path / "c.h5", fx.shard_outputs(out), out, fixture=fx, lse_layout="ht")
    report = cpgold.check(golden_path(name), tmp_path / "c.h5", cpgold=cpgold_bin)
    assert report["exit_code"] == 0 and report["pass"], cpgold.failures(report)
    assert {r["rank"] for r in report["results"]} == {-1, *range(fx.cp_size)}
    assert all(x[2] < 1 and x[3] < 1 for x in cpgold.ratios(report))


# (fixture, mistake, a tensor that must fail): each fixture is one where the mistake changes the result.
MISTAKES = [
    ("nocp_cross_window_fp32", "top_left", "o"),
    ("nocp_keyless_rows_gqa_bf16", "top_left", "lse"),
    ("a2a_w2_full_gqa_fp16_nan_pads", "gqa_modulo", "o"),
    ("a2ap2p_w4_window_gqa_bf16", "gqa_modulo", "dk"),
    ("p2p_w2_causal_gqa_bf16", "lse_log2", "lse"),
]


@pytest.mark.parametrize("name,mistake,tensor", MISTAKES)
def test_wrong_attention_fails(name, mistake, tensor, tmp_path, cpgold_bin):
    with cpgold.Fixture(golden_path(name)) as fx:
        out = attention_on_fixture(fx, mistake)
        cpgold.write_global(tmp_path / "g.h5", out, fixture=fx)
        files = []
        for r, shard in enumerate(fx.shard_outputs(out)):
            files.append(tmp_path / f"r{r}.h5")
            cpgold.write_rank(files[-1], r, shard, fixture=fx, lse_layout="ht")
    report = cpgold.check(golden_path(name), tmp_path / "g.h5", cpgold=cpgold_bin)
    assert report["exit_code"] == 1 and not report["pass"]
    assert (tensor, -1) in failed_tensors(report)
    assert any(line.startswith(tensor) for line in cpgold.failures(report))
    per_rank = cpgold.check(golden_path(name), *files, cpgold=cpgold_bin)
    assert per_rank["exit_code"] == 1
    assert any(t == tensor for t, _ in failed_tensors(per_rank))


def test_lse_log2_leaves_o_passing(tmp_path, cpgold_bin):
    name = "p2p_w2_causal_gqa_bf16"
    with cpgold.Fixture(golden_path(name)) as fx:
        cpgold.write_global(tmp_path / "c.h5", attention_on_fixture(fx, "lse_log2"), fixture=fx)
    report = cpgold.check(golden_path(name), tmp_path / "c.h5", cpgold=cpgold_bin)
    assert failed_tensors(report) == {("lse", -1)}


def test_missing_tensor_fails_unless_narrowed(tmp_path, cpgold_bin):
    name = "allgather_w2_window_bf16"
    with cpgold.Fixture(golden_path(name)) as fx:
        out = attention_on_fixture(fx)
        cpgold.write_global(tmp_path / "fwd.h5", {"o": out["o"], "lse": out["lse"]}, fixture=fx)
    report = cpgold.check(golden_path(name), tmp_path / "fwd.h5", cpgold=cpgold_bin)
    assert report["exit_code"] == 1
    assert {r["tensor"] for r in report["results"] if r["missing"]} == {"dq", "dk", "dv"}
    narrowed = cpgold.check(golden_path(name), tmp_path / "fwd.h5", tensors=("o", "lse"), cpgold=cpgold_bin)
    assert narrowed["exit_code"] == 0


def test_unusable_input_raises(tmp_path, cpgold_bin):
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    with pytest.raises(cpgold.CheckInputError, match="exit 2"):
        cpgold.check(golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "junk.h5", cpgold=cpgold_bin)
    with pytest.raises(ValueError, match="empty_row_lse: expected neg-inf or pos-inf, got \"inf\""):
        cpgold.check(golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "junk.h5", empty_row_lse="inf",
                     cpgold=cpgold_bin)
    with pytest.raises(FileNotFoundError, match="cpgold binary not found"):
        cpgold.check(golden_path("p2p_w2_causal_gqa_bf16"), tmp_path / "junk.h5", cpgold=str(tmp_path / "none"))


def test_flash_attention_2_lse_convention_is_accepted_only_knowingly(tmp_path, cpgold_bin):
    name = "nocp_keyless_rows_gqa_bf16"  # causal with L_q > L_kv and a sequence without keys: rows see no key
    with cpgold.Fixture(golden_path(name)) as fx:
        out = attention_on_fixture(fx)
        keyless = np.isneginf(out["lse"]) & fx.valid_rows("q")[None, :]
        assert keyless.any()
        fa2 = dict(out, lse=np.where(keyless, np.inf, out["lse"]))  # FlashAttention-2 writes +inf there
        cpgold.write_global(tmp_path / "fa2.h5", fa2, fixture=fx, lse_layout="ht")
        cpgold.write_global(tmp_path / "contract.h5", out, fixture=fx, lse_layout="ht")
    default = cpgold.check(golden_path(name), tmp_path / "fa2.h5", cpgold=cpgold_bin)
    assert default["exit_code"] == 1 and failed_tensors(default) == {("lse", -1)}
    accepted = cpgold.check(golden_path(name), tmp_path / "fa2.h5", empty_row_lse="pos-inf", cpgold=cpgold_bin)
    assert accepted["exit_code"] == 0 and accepted["empty_row_lse"] == "pos-inf"
    contract = cpgold.check(golden_path(name), tmp_path / "contract.h5", empty_row_lse="pos-inf", cpgold=cpgold_bin)
    assert contract["exit_code"] == 1  # the option states the convention, it does not accept both


def test_unwritten_pad_rows_are_left_out_only_knowingly(tmp_path, cpgold_bin):
    """FlashAttention-3/4 with seqused_q/k leave pad rows of their outputs unwritten: the default contract fails them,
    pad_rows="unwritten" leaves them out and counts them, in the binary and in process alike."""
    name = "p2p_w2_causal_gqa_bf16"
    with cpgold.Fixture(golden_path(name)) as fx:
        out = attention_on_fixture(fx)
        pads = ~fx.valid_rows("q")
        assert pads.any()
        garbage = dict(out, o=np.where(pads[:, None, None], np.float32(np.nan), out["o"]))
        cpgold.write_global(tmp_path / "fa3.h5", garbage, fixture=fx, lse_layout="ht")
        expected = int(pads.sum()) * out["o"].shape[1] * out["o"].shape[2]
        in_process = cpgold.check_outputs(fx, garbage, pad_rows="unwritten") if _has_core() else None
        if in_process is not None:
            assert in_process["pass"] and in_process["pad_rows"] == "unwritten"
            assert not cpgold.check_outputs(fx, garbage)["pass"]
            with pytest.raises(ValueError, match="pad_rows: expected zero or unwritten, got \"skip\""):
                cpgold.check_outputs(fx, garbage, pad_rows="skip")
    default = cpgold.check(golden_path(name), tmp_path / "fa3.h5", cpgold=cpgold_bin)
    assert default["exit_code"] == 1 and failed_tensors(default) == {("o", -1)}
    accepted = cpgold.check(golden_path(name), tmp_path / "fa3.h5", pad_rows="unwritten", cpgold=cpgold_bin)
    assert accepted["exit_code"] == 0 and accepted["pad_rows"] == "unwritten"
    o = next(r for r in accepted["results"] if r["tensor"] == "o")
    assert o["unwritten_nonzero"] == expected and o["unwritten_nonfinite"] == expected
    assert "pad and tail rows of o/dq/dk/dv: not compared" in subprocess_text(cpgold_bin, golden_path(name),
                                                                              tmp_path / "fa3.h5")


def _has_core():
    try:
        import cpgold._core  # noqa: F401
        return True
    except ImportError:
        return False


def subprocess_text(cpgold_bin, golden, candidate):
    import subprocess
    return subprocess.run([cpgold_bin, "check", str(golden), str(candidate), "--pad-rows", "unwritten"],
                          capture_output=True, text=True).stdout
