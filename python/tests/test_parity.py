"""One engine: the verdicts of the in-process check equal the command's, on every fixture of a suite, for the
FlashAttention-2 emulation's candidates (correct) and a wrong twin's (tests/python/emulation_candidates.cpp).

For each fixture and candidate file (global outputs at the root, every rank under /ranks/<r>/):
  - `cpgold check GOLDEN CANDIDATE --format json` (the command, a subprocess),
  - cpgold.check(GOLDEN, CANDIDATE) (the extension on the file),
  - cpgold.check_outputs on the same tensors read into numpy, globally and as the list of ranks,
and every result (pass, errors, limits, ratios, exact violations, worst element, first divergence) must be equal.
quick runs with the package's tests; edge and te (minutes) are the slow test python_parity_slow."""
import os
import subprocess

import h5py
import numpy as np
import pytest

import cpgold

FIELDS = ("tensor", "rank", "step", "pass", "missing", "compared", "max_err", "mean_err", "max_limit", "mean_limit",
          "max_ratio", "mean_ratio", "other_max_ratio", "other_mean_ratio", "exact_violations", "worst",
          "first_divergence", "exact_violations_listed", "budget")


def emulation_candidates(suite, folder):
    tool = os.environ.get("CPGOLD_EMULATION_CANDIDATES")
    if not tool or not os.path.isfile(tool):
        pytest.skip("CPGOLD_EMULATION_CANDIDATES is not set to the emulation_candidates tool (CTest sets it)")
    out = subprocess.run([tool, suite, str(folder)], capture_output=True, text=True, check=True).stdout
    return [line.split(" ", 1)[0] for line in out.splitlines()]


def comparable(result):
    return {k: result[k] for k in FIELDS}


def read_level(path, group):
    with h5py.File(path, "r") as f:
        g = f if group is None else f[group]
        return {n: np.asarray(g[n][()], dtype=np.float32) for n in cpgold.OUTPUT_NAMES}


def check_parity(suite, tmp_path, cpgold_bin):
    names = emulation_candidates(suite, tmp_path)
    assert names
    verdicts = {"ok": [], "bug": []}
    for name in names:
        golden = tmp_path / f"{name}.h5"
        with cpgold.Fixture(golden) as fx:
            for kind in ("ok", "bug"):
                candidate = tmp_path / f"{name}.{kind}.h5"
                cli = cpgold.check(golden, candidate, cpgold=cpgold_bin)
                files = cpgold.check(golden, candidate)
                assert files["pass"] == cli["pass"], (name, kind)
                assert [comparable(r) for r in files["results"]] == [comparable(r) for r in cli["results"]], (name, kind)
                glob = cpgold.check_outputs(fx, read_level(candidate, None), lse_layout="ht")
                ranks = cpgold.check_outputs(
                    fx, [read_level(candidate, f"ranks/{r}") for r in range(fx.cp_size)], lse_layout="ht")
                cli_global = [comparable(r) for r in cli["results"] if r["rank"] < 0]
                cli_ranks = [comparable(r) for r in cli["results"] if r["rank"] >= 0]
                assert [comparable(r) for r in glob["results"]] == cli_global, (name, kind)
                assert [comparable(r) for r in ranks["results"]] == cli_ranks, (name, kind)
                assert (glob["pass"] and ranks["pass"]) == cli["pass"], (name, kind)
                verdicts[kind].append(cli["pass"])
            os.remove(tmp_path / f"{name}.ok.h5")
            os.remove(tmp_path / f"{name}.bug.h5")
    assert all(verdicts["ok"]), "the correct emulation fails somewhere"
    assert not all(verdicts["bug"]), "no wrong twin was caught: the comparison would prove little"
    return verdicts


def test_in_process_verdicts_equal_the_commands(tmp_path, cpgold_bin, core):
    check_parity("quick", tmp_path, cpgold_bin)


@pytest.mark.slow
@pytest.mark.parametrize("suite", ["edge", "te"])
def test_in_process_verdicts_equal_the_commands_on_edge_and_te(suite, tmp_path, cpgold_bin, core):
    check_parity(suite, tmp_path, cpgold_bin)
