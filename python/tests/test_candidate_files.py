"""Candidate files written by the package: round trips, LSE layouts, per-rank files, bad input leaving files alone."""
import h5py
import numpy as np
import pytest

import cpgold
from conftest import golden_path


def golden_outputs(fx):
    return {n: fx.golden(n) for n in cpgold.OUTPUT_NAMES}


def test_global_round_trip(tmp_path):
    with cpgold.Fixture(golden_path("a2ap2p_w4_window_gqa_bf16")) as fx:
        out = golden_outputs(fx)
        cpgold.write_global(tmp_path / "c.h5", out, scope="cp_gathered", fixture=fx)
        back = cpgold.read_candidate(tmp_path / "c.h5")
        for n in cpgold.OUTPUT_NAMES:
            assert back[n].dtype == np.float32 and np.array_equal(back[n], out[n]), n
        with h5py.File(tmp_path / "c.h5", "r") as f:
            assert f.attrs["scope"] == "cp_gathered" and "ranks" not in f


def test_half_precision_converts_exactly(tmp_path):
    x = (np.arange(-512, 512, dtype=np.float32) / 7).astype(np.float16).reshape(64, 4, 4)
    cpgold.write_global(tmp_path / "c.h5", {"o": x})
    back = cpgold.read_candidate(tmp_path / "c.h5")["o"]
    assert back.dtype == np.float32 and np.array_equal(back, x.astype(np.float32))


def test_lse_layouts_are_stored_as_heads_by_tokens(tmp_path):
    lse_ht = np.arange(3 * 10, dtype=np.float32).reshape(3, 10)
    lse_ht[1, 4] = -np.inf
    for given, layout in ((lse_ht, None), (lse_ht.T.copy(), None), (lse_ht.T[:, :, None].copy(), None),
                          (lse_ht.T.copy(), "th")):
        cpgold.write_global(tmp_path / "c.h5", {"o": np.zeros((10, 3, 8), np.float32), "lse": given},
                            lse_layout=layout, force=True)
        assert np.array_equal(cpgold.read_candidate(tmp_path / "c.h5")["lse"], lse_ht)
    # A square LSE (t = h) with no stated layout is [h, t], the rule of candidate files in both doors.
    square = np.arange(16, dtype=np.float32).reshape(4, 4)
    assert np.array_equal(cpgold.lse_to_ht(square, heads=4), square)
    assert np.array_equal(cpgold.lse_to_ht(square, heads=4, layout="th"), square.T)
    with pytest.raises(ValueError, match="must be \\[t, h, 1\\]"):
        cpgold.lse_to_ht(np.zeros((4, 3, 2), np.float32), heads=3)


def test_rank_files_and_merged_file(tmp_path):
    with cpgold.Fixture(golden_path("p2p_w3_window_two_sided_fp32_inf_pads")) as fx:
        shards = fx.shard_outputs(golden_outputs(fx))
        for r, s in enumerate(shards):
            # TransformerEngine's [t, h, 1] LSE for a rank file
            s_te = dict(s, lse=s["lse"].T[:, :, None])
            cpgold.write_rank(tmp_path / f"r{r}.h5", r, s_te, fixture=fx)
            with h5py.File(tmp_path / f"r{r}.h5", "r") as f:
                assert int(f.attrs["rank"]) == r
            back = cpgold.read_candidate(tmp_path / f"r{r}.h5")
            assert all(np.array_equal(back[n], fx.golden(n, rank=r)) for n in cpgold.OUTPUT_NAMES)
        cpgold.write_ranks(tmp_path / "m.h5", shards, fixture=fx, lse_layout="ht")
        with h5py.File(tmp_path / "m.h5", "r") as f:
            assert sorted(f["ranks"]) == [str(r) for r in range(fx.cp_size)]
            assert not any(n in f for n in cpgold.OUTPUT_NAMES)
        for r in range(fx.cp_size):
            back = cpgold.read_candidate(tmp_path / "m.h5", rank=r)
            assert all(np.array_equal(back[n], fx.golden(n, rank=r)) for n in cpgold.OUTPUT_NAMES)


def test_bad_input_names_the_tensor_and_leaves_the_file(tmp_path):
    path = tmp_path / "c.h5"
    with cpgold.Fixture(golden_path("p2p_w2_causal_gqa_bf16")) as fx:
        cpgold.write_global(path, golden_outputs(fx), fixture=fx)
        before = path.read_bytes()
        bad = dict(golden_outputs(fx), dq=fx.golden("dq")[:-1])
        with pytest.raises(ValueError, match=r"dq has shape \(59, 2, 64\), the fixture's global layout needs \(60, 2, 64\)"):
            cpgold.write_global(path, bad, fixture=fx)
        with pytest.raises(ValueError, match="tensor 'out' is not one of"):
            cpgold.write_global(path, {"out": fx.golden("o")})
        with pytest.raises(ValueError, match="rank: 5 is outside"):
            cpgold.write_rank(path, 5, {"o": fx.golden("o", rank=0)}, fixture=fx)
        with pytest.raises(ValueError, match="scope: expected one of"):
            cpgold.write_global(path, golden_outputs(fx), scope="gathered")
        with pytest.raises(ValueError, match="o: expected a floating-point array"):
            cpgold.write_global(path, {"o": np.zeros((40, 2, 64), np.int32)})
        assert path.read_bytes() == before


def test_torch_bf16_converts_exactly(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is optional (not installed here)")
    x = torch.linspace(-3, 3, 96).reshape(8, 3, 4).to(torch.bfloat16)
    cpgold.write_global(tmp_path / "c.h5", {"o": x, "lse": torch.zeros(8, 3, 1)})
    back = cpgold.read_candidate(tmp_path / "c.h5")
    assert np.array_equal(back["o"], x.float().numpy()) and back["lse"].shape == (3, 8)
