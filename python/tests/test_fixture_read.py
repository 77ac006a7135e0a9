"""Reading fixtures: case, layout, inputs, per-rank shards, compact/expand, against what the files store."""
import h5py
import numpy as np
import pytest

import cpgold
from conftest import golden_names, golden_path


@pytest.mark.parametrize("name", golden_names())
def test_layout_matches_case(name):
    with cpgold.Fixture(golden_path(name)) as fx:
        assert list(fx.seqlens("q")) == fx.case["seqlens_q"]
        assert list(fx.seqlens("kv")) == fx.case["seqlens_kv"]
        assert list(np.diff(fx.cu_seqlens("q", padded=True))) == fx.case["padded_q"]
        assert fx.cu_seqlens("q").dtype == np.int32
        assert fx.valid_rows("q").sum() == sum(fx.case["seqlens_q"])
        assert fx.valid_rows("kv").shape == (fx.case["total_tokens_kv"],)
        x = fx.inputs()
        assert x["q"].shape == (fx.total_rows("q"), fx.heads_q, fx.dim_qk)
        assert x["v"].shape == (fx.total_rows("kv"), fx.heads_kv, fx.dim_v)
        for r in range(fx.cp_size):
            assert fx.rank_cu_seqlens(r, "q")[-1] == fx.rank_valid_rows(r, "q").sum()
            assert fx.rank_cu_seqlens(r, "kv")[-1] == fx.rank_valid_rows(r, "kv").sum()
            assert list(fx.rank_cu_seqlens(r, "q", padded=True) * fx.cp_size) == list(fx.cu_seqlens("q", padded=True))


@pytest.mark.parametrize("name", golden_names())
def test_input_dtypes_keep_values(name):
    with cpgold.Fixture(golden_path(name)) as fx:
        q = fx.inputs()["q"][fx.valid_rows("q")]
        expected = {"fp16": np.float16, "bf16": np.float32, "fp32": np.float32}[fx.dtype]
        assert q.dtype == expected
        if fx.dtype == "bf16":  # bf16 values held in float32: the low 16 bits are zero
            assert not np.any(q.view(np.uint32) & 0xFFFF)


@pytest.mark.parametrize("name", golden_names())
def test_shards_are_the_stored_rank_tensors(name):
    with cpgold.Fixture(golden_path(name)) as fx:
        x = fx.inputs()
        for r in range(fx.cp_size):
            local = fx.rank_inputs(r)
            for n in cpgold.INPUT_NAMES:
                side = "q" if n in ("q", "dout") else "kv"
                assert np.array_equal(fx.shard(x[n], r, side), local[n], equal_nan=True), (n, r)
            shards = fx.shard_outputs({n: fx.golden(n) for n in cpgold.OUTPUT_NAMES})[r]
            for n in cpgold.OUTPUT_NAMES:
                assert np.array_equal(shards[n], fx.golden(n, rank=r)), (n, r)


@pytest.mark.parametrize("name", golden_names())
def test_compact_expand_round_trip(name):
    with cpgold.Fixture(golden_path(name)) as fx:
        o, lse = fx.golden("o"), fx.golden("lse")
        compact = fx.compact(o, "q")
        assert compact.shape[0] == int(fx.seqlens("q").sum())
        assert np.array_equal(fx.expand(compact, "q"), o)  # golden pad rows are 0
        lse_back = fx.expand(fx.compact(lse, "q", axis=1), "q", axis=1, fill=-np.inf)
        assert np.array_equal(lse_back, lse)  # golden pad rows are -inf
        cu = fx.cu_seqlens("q")
        off = fx.cu_seqlens("q", padded=True)
        q = fx.inputs()["q"]
        for b in range(fx.num_sequences):  # sequence b of the compacted layout is its valid rows, in order
            assert np.array_equal(fx.compact(q, "q")[cu[b]:cu[b + 1]], q[off[b]:off[b] + cu[b + 1] - cu[b]])


def test_bad_input_names_the_field(tmp_path):
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        with pytest.raises(ValueError, match="rank: 2 is outside"):
            fx.partitioned_indices(2, "q")
        with pytest.raises(ValueError, match="side: expected 'q' or 'kv', got 'k'"):
            fx.seqlens("k")
        with pytest.raises(ValueError, match="golden: tensor 'out'"):
            fx.golden("out")
    with pytest.raises(cpgold.FixtureError, match="cannot open|no such file"):
        cpgold.Fixture(tmp_path / "missing.h5")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(cpgold.FixtureError, match="no /case group|expected a cpgold fixture"):
        cpgold.Fixture(tmp_path / "other.h5")


def test_torch_tensors_when_torch_is_installed():
    torch = pytest.importorskip("torch", reason="torch is optional (not installed here)")
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        t = fx.inputs("torch")
        assert t["q"].dtype == torch.bfloat16
        assert np.array_equal(t["q"].float().numpy(), fx.inputs()["q"], equal_nan=True)
        assert torch.equal(fx.compact(t["k"], "kv").float(), torch.from_numpy(fx.compact(fx.inputs()["k"], "kv")))
