"""The multi-process CP harness (cpgold.outsiders.ranks, docs/outsiders-nccl.md) on CPU: torchrun starts W processes
over gloo running the plain torch all-gather CP (cpgold.outsiders.torch_cp) on small generated fixtures. The correct
reference passes every rank and the gathered outputs; the planted off-by-one causal edge fails, per rank; a fixture of
another cp_size is skipped with its reason; a rank that raises stops every rank within the timeout, naming it; NCCL
without NCCL_NVLS_ENABLE=0 is refused. TransformerEngine over NCCL runs on a GPU machine
(lab/outsiders/device_run.sh, phase te_ranks)."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

import cpgold

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no torch.distributed with gloo", allow_module_level=True)

from cpgold.outsiders import ranks as harness  # noqa: E402

PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(cpgold.__file__)))

CASES = {  # small cases, one per comm type; the last one needs 4 ranks
    "p2p_w2_causal_nan": dict(seqlens_q=[13, 0, 7], heads_q=4, heads_kv=2, dim_qk=16, mask="causal", cp_size=2,
                              comm="p2p", seed=3, pad_fill="nan"),
    "a2a_w2_window": dict(seqlens_q=[9, 12], heads_q=2, dim_qk=16, mask="none", window=[3, 2], cp_size=2, comm="a2a",
                          seed=4),
    "all_gather_w2_cross": dict(seqlens_q=[10, 5], seqlens_kv=[14, 9], heads_q=4, heads_kv=1, dim_qk=16, mask="none",
                                cp_size=2, comm="all_gather", seed=5),
    "a2a_p2p_w4_causal_window": dict(seqlens_q=[17, 9], heads_q=4, heads_kv=2, dim_qk=16, mask="causal",
                                     window=[5, 0], cp_size=4, comm="a2a+p2p", a2a_size=2, seed=6),
}

# torch 1.13's launcher on Python 3.11 cannot read its own --redirects default (Std.from_str compares enum members
# with ints and gives None): the launcher below repairs that one function where it is broken, then runs torchrun.
LAUNCH = """
import re, sys
from torch.distributed.elastic.multiprocessing import api
if api.Std.from_str("0") is None:
    def from_str(cls, vm):
        if re.match(api._VALUE_REGEX, vm):
            return api.Std(int(vm))
        return {int(k): api.Std(int(v)) for k, v in (x.split(":") for x in vm.split(","))}
    api.Std.from_str = classmethod(from_str)
from torch.distributed.run import main
sys.argv[0] = "torchrun"
main()
"""


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    import cpgold._core_loader as loader

    try:
        loader.core()
    except ImportError as e:
        pytest.skip(str(e))
    folder = tmp_path_factory.mktemp("outsiders_nccl") / "small"
    folder.mkdir()
    for name, case in CASES.items():
        cpgold.generate(case, path=str(folder / f"{name}.h5"))
    return folder


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc, args, env=None, timeout=90):
    """torchrun --nproc_per_node N -m cpgold.outsiders.ranks ARGS (gloo); (returncode, output, seconds)."""
    cmd = [sys.executable, "-c", LAUNCH, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "cpgold.outsiders.ranks", *map(str, args),
           "--dist-backend", "gloo"]
    full = dict(os.environ, **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                         if p])
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.time() - t0


def entries(out):
    with open(out / "summary.json") as f:
        return {e["fixture"][:-3]: e for e in json.load(f)["fixtures"]}


def test_groups_in_creation_order_and_per_rank():
    class Fx:
        comm, case = "a2a+p2p", {"a2a_size": 2}

    g = harness.Groups(None, 4, None)
    assert g.lists_for(Fx) == [[0, 1], [2, 3], [0, 2], [1, 3]]
    Fx.comm = "p2p"
    assert g.lists_for(Fx) == [[0, 1, 2, 3]]


def test_reference_passes_every_rank_and_the_gathered_outputs(core, cpgold_bin, fixture_dir, tmp_path):
    out = tmp_path / "w2"
    rc, text, seconds = launch(2, ["torch_allgather", fixture_dir, "--out", out, "--timeout", 30, "--grace", 2])
    assert rc == 0, text
    e = entries(out)
    for name in ("p2p_w2_causal_nan", "a2a_w2_window", "all_gather_w2_cross"):
        assert e[name]["status"] == "pass", e[name]
        assert e[name]["ranks_pass"] and e[name]["gathered_pass"]
        assert set(e[name]["worst"]) == {"o", "lse", "dq", "dk", "dv"}
        assert max(e[name]["worst"].values()) < 0.1
        assert sorted(e[name]["rank_worst"]) == ["0", "1"]   # every rank was checked on its own
        files = [out / "small" / f"{name}.r{r}.h5" for r in range(2)]
        assert all(f.is_file() for f in files)
        # the command line's check of the same rank files: one file per rank
        cli = subprocess.run([cpgold_bin, "check", str(fixture_dir / f"{name}.h5"), *map(str, files)],
                             capture_output=True, text=True)
        assert cli.returncode == 0, cli.stdout + cli.stderr
    skipped = e["a2a_p2p_w4_causal_window"]
    assert skipped["status"] == "skipped" and "cp_size 4 is not the world size 2" in skipped["reason"]
    assert "[3/4] small/all_gather_w2_cross.h5 all_gather W=2 pass" in text
    table = (out / "summary.md").read_text()
    assert "| small | a2a_p2p_w4_causal_window.h5 | a2a+p2p | 4 | skipped |" in table
    assert len((out / "results.jsonl").read_text().splitlines()) == 4
    # every rank's versions and device, recorded at the start; each result names them by their digest
    run = json.loads((out / "run.json").read_text())
    ranks = run["rank_versions"]
    assert [v["rank"] for v in ranks] == [0, 1] and [v["tensors_on"] for v in ranks] == ["cpu", "cpu"]
    for v in ranks:
        assert {"python", "torch", "cuda", "nccl", "device", "driver", "variables", "gloo_available"} <= set(v)
        assert "NCCL_NVLS_ENABLE" in v["variables"] and v["device"]
    assert ranks[0]["pid"] != ranks[1]["pid"]                 # each rank's own process, not rank 0's twice
    assert run["versions_digest"].startswith("sha256:") and run["resumes"] == []
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["rank_versions"] == ranks and summary["versions"] == ranks[0]
    assert {e["versions_digest"] for e in summary["fixtures"]} == {run["versions_digest"]}


def run_at_four_ranks(folder, tmp_path):
    """The entries of a run over the fixtures of `folder` at W = 4 (exit 0)."""
    out = tmp_path / "w4"
    rc, text, _ = launch(4, ["torch_allgather", folder, "--out", out, "--timeout", 30, "--grace", 2])
    assert rc == 0, text
    return entries(out)


def test_a2a_p2p_groups_at_four_ranks(core, fixture_dir, tmp_path):
    e = run_at_four_ranks(fixture_dir, tmp_path)
    w4 = e["a2a_p2p_w4_causal_window"]
    assert w4["status"] == "pass" and w4["ranks_pass"] and w4["gathered_pass"], w4
    assert sorted(w4["rank_worst"]) == ["0", "1", "2", "3"]
    assert [e[n]["status"] for n in ("p2p_w2_causal_nan", "a2a_w2_window", "all_gather_w2_cross")] == ["skipped"] * 3


def test_ranks_without_valid_rows_at_four_ranks(core, tmp_path):
    """A rank whose rows are all padding (2 tokens in 8 rows at W = 4; a batch of no token) computes nothing, yet
    joins the dK/dV reduction and writes zeros: the reference passes, every rank and gathered."""
    folder = tmp_path / "sparse"
    folder.mkdir()
    cases = {"p2p_w4_two_tokens": dict(seqlens_q=[2], padded_q=[8], heads_q=1, dim_qk=16, mask="causal",
                                       window=[3, 0], cp_size=4, comm="p2p", seed=7, pad_fill="random"),
             "all_gather_w4_no_token": dict(seqlens_q=[0], padded_q=[8], heads_q=2, dim_qk=16, mask="none",
                                            window=[1, 0], cp_size=4, comm="all_gather", seed=8, pad_fill="nan")}
    for name, case in cases.items():
        cpgold.generate(case, path=str(folder / f"{name}.h5"))
    e = run_at_four_ranks(folder, tmp_path)
    two = e["p2p_w4_two_tokens"]
    assert two["status"] == "pass" and two["ranks_pass"] and two["gathered_pass"], two
    assert e["all_gather_w4_no_token"]["status"] in ("pass", "empty"), e["all_gather_w4_no_token"]
    assert "error" not in {x["status"] for x in e.values()}, e


def test_planted_causal_edge_fails_per_rank(core, fixture_dir, tmp_path):
    out = tmp_path / "bug"
    rc, text, _ = launch(2, ["torch_allgather", fixture_dir, "--out", out, "--set", "mistake=causal_edge_plus1",
                             "--timeout", 30, "--grace", 2])
    assert rc == 1, text
    e = entries(out)
    bad = e["p2p_w2_causal_nan"]
    assert bad["status"] == "fail" and not bad["ranks_pass"] and not bad["gathered_pass"]
    assert bad["failed_ranks"] == [0, 1]
    assert any(line.startswith("ranks: o@r0:") for line in bad["failures"])
    assert any(line.startswith("ranks: o@r1:") for line in bad["failures"])
    assert bad["diagnosis"], bad
    assert min(bad["rank_worst"]["0"]["o"], bad["rank_worst"]["1"]["o"]) > 1
    # no causal edge in the other cases: they pass
    assert e["a2a_w2_window"]["status"] == "pass" and e["all_gather_w2_cross"]["status"] == "pass"
    assert "p2p W=2 fail" in text and "failed ranks 0,1" in text


@pytest.mark.parametrize("rank,when", [(1, "before"), (0, "after")])
def test_a_rank_that_raises_stops_every_rank(core, fixture_dir, tmp_path, rank, when):
    out = tmp_path / "raise"
    rc, text, seconds = launch(2, ["torch_allgather", fixture_dir, "--out", out, "--set", f"fail_rank={rank}",
                                   "--set", f"fail_when={when}", "--timeout", 30, "--grace", 2], timeout=60)
    assert rc != 0
    assert seconds < 30, text
    planted = f"planted failure on rank {rank} ({when} its collectives)"
    assert f"rank {rank} raised on small/a2a_w2_window.h5" in text
    assert f"stopped at small/a2a_w2_window.h5: rank {rank} error: RuntimeError: {planted}" in text
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert f"rank {rank} error" in summary["stopped"]
    # the fixtures done so far are recorded (the W=4 one, skipped), then the one that stopped the run; no more
    skipped, e = summary["fixtures"]
    assert skipped["fixture"] == "a2a_p2p_w4_causal_window.h5" and skipped["status"] == "skipped"
    assert e["status"] == "error" and e["failing_ranks"] == [rank] and planted in e["reason"]
    assert "The run was stopped" in (out / "summary.md").read_text()
    run = json.loads((out / "run.json").read_text())   # written before the first fixture: a stopped run keeps it
    assert [v["rank"] for v in run["rank_versions"]] == [0, 1]
    assert e["versions_digest"] == skipped["versions_digest"] == run["versions_digest"]


def test_resume_after_a_stopped_run_runs_the_rest_once(core, fixture_dir, tmp_path):
    out = tmp_path / "resume"
    rc, text, _ = launch(2, ["torch_allgather", fixture_dir, "--out", out, "--set", "fail_rank=1",
                             "--timeout", 30, "--grace", 2], timeout=60)
    assert rc != 0 and "stopped at small/a2a_w2_window.h5" in text
    run_file = out / "run.json"
    recorded = run_file.read_text()
    run = json.loads(recorded)
    run["rank_versions"][1]["torch"] = "0.0.1"                # rank 1 of the stopped run had another torch
    run_file.write_text(json.dumps(run))
    kept = (out / "results.jsonl").read_text(), run_file.read_text()
    rc, text, _ = launch(2, ["torch_allgather", fixture_dir, "--out", out, "--resume", "--timeout", 30], timeout=90)
    assert rc != 0 and re.search(r"exitcode\s*:\s*2\b", text), text     # each process exits 2; torchrun says so
    assert "--resume: the versions are not those the stopped run started with: rank 1: torch" in text
    assert '(recorded "0.0.1")' in text and "nothing was run" in text and "[1/4]" not in text
    assert ((out / "results.jsonl").read_text(), run_file.read_text()) == kept
    run_file.write_text(recorded)
    rc, text, _ = launch(2, ["torch_allgather", fixture_dir, "--out", out, "--resume", "--timeout", 30], timeout=90)
    assert "resuming: 2 fixture(s) already recorded" in text, text
    assert "a2a_w2_window" not in text.split("resuming")[1], text   # the stopped fixture is not run again
    with open(out / "summary.json") as f:
        summary = json.load(f)
    statuses = {e["fixture"][:-3]: e["status"] for e in summary["fixtures"]}
    assert statuses == {"a2a_p2p_w4_causal_window": "skipped", "a2a_w2_window": "error",
                        "all_gather_w2_cross": "pass", "p2p_w2_causal_nan": "pass"}
    assert len(summary["fixtures"]) == 4 and summary["stopped"] is None
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [x["fixture"][:-3] for x in lines] == ["a2a_p2p_w4_causal_window", "a2a_w2_window", "all_gather_w2_cross",
                                                  "p2p_w2_causal_nan"]
    assert rc == 1   # the recorded error still counts
    after = json.loads(run_file.read_text())
    (resumed,) = after["resumes"]
    assert resumed["differences"] == [] and resumed["resumed_with"] == 2
    assert [v["rank"] for v in resumed["rank_versions"]] == [0, 1]
    assert summary["resumes"] == after["resumes"] and summary["rank_versions"] == after["rank_versions"]


def test_resume_records_the_fixture_the_processes_died_in(core, fixture_dir, tmp_path):
    """A run killed outright (an abort leaves no status) leaves DIR/current: --resume records that fixture as an error,
    with its case, and runs the others."""
    out = tmp_path / "died"
    out.mkdir()
    (out / "results.jsonl").write_text("")
    (out / "current").write_text(json.dumps({"suite": "small", "fixture": "all_gather_w2_cross.h5"}))
    # no DIR/run.json: the stopped run's versions cannot be told, which only --resume-any-versions accepts
    rc, text, _ = launch(2, ["torch_allgather", fixture_dir, "--out", out, "--resume", "--timeout", 30], timeout=90)
    assert rc != 0 and re.search(r"exitcode\s*:\s*2\b", text), text
    assert "does not say which versions the stopped run had" in text
    assert (out / "results.jsonl").read_text() == "" and (out / "current").exists() and not (out / "run.json").exists()
    rc, text, _ = launch(2, ["torch_allgather", fixture_dir, "--out", out, "--resume", "--resume-any-versions",
                             "--timeout", 30], timeout=90)
    e = entries(out)
    assert e["all_gather_w2_cross"]["status"] == "error", text
    assert "ended while running this fixture" in e["all_gather_w2_cross"]["reason"]
    assert e["all_gather_w2_cross"]["comm"] == "all_gather" and e["all_gather_w2_cross"]["cp_size"] == 2
    assert e["p2p_w2_causal_nan"]["status"] == "pass" and e["a2a_w2_window"]["status"] == "pass"
    assert not (out / "current").exists()   # a run that ends normally leaves none
    assert rc == 1
    run = json.loads((out / "run.json").read_text())
    assert run["rank_versions"] is None and len(run["resumes"]) == 1   # unknown before, this run's as a resume's
    assert "versions_digest" not in e["all_gather_w2_cross"]            # the processes that died in it: unknown


def test_nccl_without_nvls_off_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NCCL_NVLS_ENABLE"}
    env["PYTHONPATH"] = os.pathsep.join([PYTHON_DIR, os.environ.get("PYTHONPATH", "")])
    for value in (None, "1"):
        if value is not None:
            env["NCCL_NVLS_ENABLE"] = value
        proc = subprocess.run([sys.executable, "-m", "cpgold.outsiders.ranks", "torch_allgather", str(tmp_path),
                               "--out", str(tmp_path / "out"), "--dist-backend", "nccl"],
                              capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 2
        assert "NCCL_NVLS_ENABLE=0 must be in the environment" in proc.stderr
        assert ("unset" if value is None else "'1'") in proc.stderr
        assert not (tmp_path / "out").exists()


def test_every_rank_raising_is_recorded_and_the_run_goes_on(core, fixture_dir, tmp_path):
    out = tmp_path / "all"
    rc, text, seconds = launch(2, ["torch_allgather", fixture_dir, "--out", out, "--set", "fail_rank=all",
                                   "--timeout", 30, "--grace", 2], timeout=60)
    assert rc == 1, text
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["stopped"] is None
    statuses = {e["fixture"][:-3]: e["status"] for e in summary["fixtures"]}
    assert statuses == {"a2a_p2p_w4_causal_window": "skipped", "a2a_w2_window": "error",
                        "all_gather_w2_cross": "error", "p2p_w2_causal_nan": "error"}
    e = entries(out)["p2p_w2_causal_nan"]
    assert e["reason"].startswith("every rank raised: rank 0: RuntimeError: planted failure on rank 0")
    assert "rank 1: RuntimeError: planted failure on rank 1" in e["reason"] and e["rank_status"] == ["error"] * 2
