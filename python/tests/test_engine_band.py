"""A fixture computed by another engine than the CPU reference (the GPU engine: `/case` attribute `engine`) holds
limits within a stated bound of the CPU reference's (25% where the check precision is bf16/fp16, 50% where it is
float32: docs/scale.md). Its verdict is stated only where every limit within that bound gives the same one; between,
the check is undecided (exit 5), through the command and the Python door alike, and runs no diagnosis. A CPU fixture
decides as before.

The GPU fixture here is the CPU fixture with its engine attribute set to "gpu" (the same limits), so the band is the
only difference: an LSE error at ratio t of its limit passes on both below 1 / 1.5, is undecided on the GPU fixture
(and passes or fails on the CPU one) for t in (1 / 1.5, 1 / 0.5] = (0.667, 2], and fails on both above 2."""
import subprocess

import h5py
import numpy as np
import pytest

import cpgold

CASE = {"seqlens_q": [40, 17], "heads_q": 2, "heads_kv": 1, "dim_qk": 16, "dtype": "bf16", "mask": "causal",
        "cp_size": 2, "comm": "p2p"}
OUTPUTS = ("o", "lse", "dq", "dk", "dv")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    pytest.importorskip("cpgold._core", reason="needs cpgold's extension")
    folder = tmp_path_factory.mktemp("band")
    cpu = folder / "cpu.h5"
    cpgold.generate(CASE, str(cpu))
    gpu = folder / "gpu.h5"
    gpu.write_bytes(cpu.read_bytes())
    with h5py.File(gpu, "r+") as f:
        f["/case"].attrs["engine"] = "gpu"
    return folder, cpu, gpu


def _candidate(folder, cpu, ratio):
    """The fixture's own oracle, one LSE element moved by `ratio` times its global-only max limit."""
    path = folder / f"cand_{ratio}.h5"
    with h5py.File(cpu, "r") as f, h5py.File(path, "w") as c:
        for q in OUTPUTS:
            a = f["/golden/" + q][...].astype(np.float32)
            if q == "lse":
                attrs = f["/golden/lse"].attrs
                limit = max(attrs["cp_max_budget"], attrs["non_cp_max_budget"])
                a[0, 3] = np.float32(np.float64(a[0, 3]) + ratio * limit)
            c[q] = a
    return path


# ratio: (CPU fixture's exit, GPU fixture's exit); float32 rounding of the moved element moves the ratio by ~1%.
CASES = {0.5: (0, 0), 0.8: (0, 5), 1.5: (1, 5), 2.5: (1, 1)}


@pytest.mark.parametrize("ratio", sorted(CASES))
def test_the_command_states_a_verdict_only_outside_the_band(fixtures, cpgold_bin, ratio):
    folder, cpu, gpu = fixtures
    cand = _candidate(folder, cpu, ratio)
    want_cpu, want_gpu = CASES[ratio]
    a = subprocess.run([cpgold_bin, "check", str(cpu), str(cand)], capture_output=True, text=True)
    b = subprocess.run([cpgold_bin, "check", str(gpu), str(cand)], capture_output=True, text=True)
    assert a.returncode == want_cpu, a.stdout + a.stderr
    assert b.returncode == want_gpu, b.stdout + b.stderr
    assert "UNDECIDED" not in a.stdout
    if want_gpu == 5:
        assert "verdict: UNDECIDED (a fixture of the gpu engine" in b.stdout
        assert "undecided (within the gpu engine's bound)" in b.stdout
        assert "diagnosis" not in b.stdout.lower() or "no diagnosis" in b.stdout.lower()


@pytest.mark.parametrize("ratio", sorted(CASES))
def test_the_python_door_says_the_same(fixtures, ratio):
    folder, cpu, gpu = fixtures
    cand = _candidate(folder, cpu, ratio)
    want_cpu, want_gpu = CASES[ratio]
    a = cpgold.check(str(cpu), str(cand))
    b = cpgold.check(str(gpu), str(cand))
    assert (a["exit_code"], b["exit_code"]) == (want_cpu, want_gpu)
    assert b.undecided == (want_gpu == 5) and not a.undecided
    assert b.passed == (want_gpu == 0)
    assert b["engine"] == "gpu" and a["engine"] == "cpu"
    lse = [r for r in b["results"] if r["tensor"] == "lse" and r.get("rank", -1) in (-1, None)]
    assert lse and lse[0]["engine_bound"] == 0.5
    if want_gpu == 5:
        assert b["diagnosis"] in ([], None)
        # bf16 outputs (the oracle itself, error 0) pass whatever the bound: only the LSE is undecided
        assert all(r["pass"] for r in b["results"] if r["tensor"] != "lse")


def test_the_command_door_of_python_accepts_exit_5(fixtures, cpgold_bin):
    folder, cpu, gpu = fixtures
    cand = _candidate(folder, cpu, 1.5)
    report = cpgold.check(str(gpu), str(cand), cpgold=cpgold_bin)
    assert report["exit_code"] == 5 and report.undecided and not report.passed


def test_the_fixture_names_its_engine(fixtures):
    folder, cpu, gpu = fixtures
    with cpgold.Fixture(str(cpu)) as a, cpgold.Fixture(str(gpu)) as b:
        assert (a.engine, a.engine_versions) == ("cpu", None)
        assert b.engine == "gpu"


def test_generate_takes_the_engine_of_gen(tmp_path):
    """engine= is `gen --engine`: cpu by default, a bad value named, gpu refused (never a silent fallback) where this
    extension has no GPU engine or no device, auto falls back to the CPU saying nothing is lost (the fixture says
    which engine computed it)."""
    pytest.importorskip("cpgold._core", reason="needs cpgold's extension")
    from cpgold.errors import InputError

    with pytest.raises(InputError, match='engine: value "tpu" is not cpu, gpu or auto'):
        cpgold.generate(CASE, engine="tpu")
    fx = cpgold.generate(CASE, engine="auto")
    assert fx.engine in ("cpu", "gpu")
    if fx.engine == "cpu":  # no GPU engine here: gpu is refused, and nothing is written
        target = tmp_path / "gpu.h5"
        with pytest.raises(InputError, match="engine: gpu: "):
            cpgold.generate(CASE, str(target), engine="gpu")
        assert not target.exists()
    assert cpgold.generate(CASE).engine == "cpu"
