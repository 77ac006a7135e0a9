"""Fixtures from given inputs (cpgold.generate(inputs=...) and `cpgold gen --inputs`): checked by the independent
numpy oracle of docs/python/check_golden.py, the same fixture through both doors, numpy and torch, and the refusals
naming the tensor and the element."""
import importlib.util
import json
import os
import subprocess

import h5py
import numpy as np
import pytest

import cpgold
from conftest import REPO

pytest.importorskip("cpgold._core", reason="needs cpgold's extension")

CASE = {"seqlens_q": [11, 0, 7], "total_tokens_q": 40, "heads_q": 4, "heads_kv": 2, "dim_qk": 16, "mask": "causal",
        "cp_size": 2, "comm": "p2p", "dtype": "fp32", "pad_fill": "zero"}


def _check_golden():
    spec = importlib.util.spec_from_file_location("check_golden", os.path.join(REPO, "docs", "python", "check_golden.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shapes(case):
    total_q = case["total_tokens_q"]
    hq, hkv, d = case["heads_q"], case["heads_kv"], case["dim_qk"]
    return {"q": (total_q, hq, d), "k": (total_q, hkv, d), "v": (total_q, hkv, d), "dout": (total_q, hq, d)}


def _run_inputs(case, rng, scale=3.0):
    """Values a training run could hold: heavy-tailed activations, one large outlier row."""
    out = {}
    for name, shape in _shapes(case).items():
        x = rng.standard_t(3, size=shape).astype(np.float32) * np.float32(scale)
        x[2] *= np.float32(40.0)  # an outlier row
        out[name] = x
    return out


def _datasets(path):
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()].tobytes()) if isinstance(obj, h5py.Dataset)
                     else None)
    return found


def test_given_inputs_pass_the_independent_oracle_and_both_doors_agree(tmp_path, cpgold_bin):
    inputs = _run_inputs(CASE, np.random.default_rng(3))
    path = tmp_path / "python.h5"
    fx = cpgold.generate(CASE, path=path, inputs=inputs)
    assert fx.inputs_source == "given" and fx.inputs_nonfinite_valid == 0
    np.testing.assert_array_equal(fx.inputs()["q"][:11], inputs["q"][:11])
    fx.close()
    problems = []
    _check_golden().check_fixture(str(path), problems)
    assert problems == []

    with h5py.File(tmp_path / "in.h5", "w") as f:
        for name, x in inputs.items():
            f.create_dataset(name, data=x.astype(np.float64))  # float64 holding float32 values: accepted exactly
    cli = tmp_path / "cli.h5"
    r = subprocess.run([cpgold_bin, "gen", "--case", json.dumps(CASE), "--inputs", str(tmp_path / "in.h5"), "-o",
                        str(cli)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _datasets(cli) == _datasets(path)
    r = subprocess.run([cpgold_bin, "inspect", str(cli)], capture_output=True, text=True)
    assert "given (the tensors of a run" in r.stdout
    assert cpgold.Fixture(cli).validate()["inputs_source"] == "given"


def test_torch_bf16_tensors_give_the_fixture_of_their_values(tmp_path):
    torch = pytest.importorskip("torch")
    case = dict(CASE, dtype="bf16")
    rng = np.random.default_rng(5)
    tensors = {name: torch.from_numpy(x).to(torch.bfloat16) for name, x in _run_inputs(case, rng).items()}
    from_torch = cpgold.generate(case, path=tmp_path / "torch.h5", inputs=tensors)
    as_numpy = {name: t.float().numpy() for name, t in tensors.items()}
    cpgold.generate(case, path=tmp_path / "numpy.h5", inputs=as_numpy).close()
    assert from_torch.inputs_sha256 == cpgold.Fixture(tmp_path / "numpy.h5").inputs_sha256
    from_torch.close()
    assert _datasets(tmp_path / "torch.h5") == _datasets(tmp_path / "numpy.h5")
    problems = []
    _check_golden().check_fixture(str(tmp_path / "torch.h5"), problems)
    assert problems == []


def test_refusals_name_the_tensor_and_element(tmp_path):
    case = dict(CASE, dtype="bf16")
    good = {name: np.zeros(shape, np.float32) for name, shape in _shapes(case).items()}
    bad = dict(good, q=good["q"].copy())
    bad["q"][3, 1, 2] = 0.1
    with pytest.raises(cpgold.InputError, match=r"q row 3 \(sequence 0, token 3\), head 1, column 2: value 0.1\d* is "
                                                r"not representable in bf16"):
        cpgold.generate(case, inputs=bad)
    with pytest.raises(cpgold.InputError, match=r"inputs.k: shape \[40, 4, 16\] does not match"):
        cpgold.generate(case, inputs=dict(good, k=np.zeros((40, 4, 16), np.float32)))
    with pytest.raises(cpgold.InputError, match="missing tensor 'dout'"):
        cpgold.generate(case, inputs={n: good[n] for n in ("q", "k", "v")})
    with pytest.raises(cpgold.InputError, match="expected a C-ordered float32 or float64 array, got int64"):
        cpgold.generate(case, inputs=dict(good, v=np.zeros(_shapes(case)["v"], np.int64)))
    nan = dict(good, v=good["v"].copy())
    nan["v"][12 + 4, 0, 0] = np.nan  # lengths 11, 0, 7 padded to 12, 0, 8 for W = 2: sequence 2 starts at row 12
    path = tmp_path / "nan.h5"
    with pytest.raises(cpgold.InputError, match=r"inputs.v: v row 16 \(sequence 2, token 4\), head 0, column 0: nan"):
        cpgold.generate(case, path=path, inputs=nan)
    assert not path.exists()
    fx = cpgold.generate(case, path=path, inputs=nan, allow_nonfinite=True)
    assert fx.inputs_nonfinite_valid == 1
    fx.close()
    pads = dict(good, q=good["q"].copy())
    pads["q"][39] = np.nan  # a tail row: accepted, and the case records what the pads hold
    assert json.loads(cpgold.generate(case, inputs=pads).case_json)["pad_fill"] == "nan"
    with pytest.raises(cpgold.InputError, match="allow_nonfinite: only with inputs="):
        cpgold.generate(case, allow_nonfinite=True)
