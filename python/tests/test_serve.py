"""The resident adapter (cpgold.outsiders.serve) with a fake implementation (serve_fake.py): candidates written as
`--write-candidate` writes them, a process that dies, runs past --timeout or raises is replaced and its run answers
"error" (never a candidate), refusals exit 3, no server exits 1 with the socket named, and `cpgold shrink` with the
client as COMMAND finds the same smallest case as with a fresh process per run."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import cpgold

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("CPGOLD_BIN")
pytestmark = pytest.mark.skipif(not BIN, reason="CPGOLD_BIN is not set (run through CTest)")

GQA = {"seqlens_q": [40, 7, 19], "padded_q": [48, 8, 24], "heads_q": 4, "heads_kv": 2, "dim_qk": 16,
       "mask": "causal", "cp_size": 2, "comm": "p2p", "seed": 5}
MHA = dict(GQA, heads_kv=4)


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    return e


def gen(case, path):
    subprocess.run([BIN, "gen", "--case", json.dumps(case), "-o", str(path)], check=True, capture_output=True)
    return str(path)


def client(*args):
    return subprocess.run([sys.executable, "-m", "cpgold.outsiders.serve", *args], capture_output=True, text=True,
                          env=env(), timeout=120)


@pytest.fixture
def server(tmp_path):
    sock = str(tmp_path / "s.sock")
    log = open(tmp_path / "serve.log", "w+")
    p = subprocess.Popen([sys.executable, "-m", "cpgold.outsiders.serve", "start", sock, "serve_fake:Planted",
                          "--timeout", "5"], stderr=log, env=env())
    for _ in range(300):
        if os.path.exists(sock) or p.poll() is not None:
            break
        time.sleep(0.1)
    assert os.path.exists(sock), open(tmp_path / "serve.log").read()
    yield sock, p, tmp_path / "serve.log"
    if p.poll() is None:
        client("stop", sock)
        p.wait(30)
    log.close()


def test_written_candidates_check_like_write_candidate(server, tmp_path):
    sock, _, log = server
    mha, gqa = gen(MHA, tmp_path / "mha.h5"), gen(GQA, tmp_path / "gqa.h5")
    r = client("run", sock, mha, str(tmp_path / "c1.h5"))
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "pad rows zero" in r.stdout
    assert cpgold.check(mha, str(tmp_path / "c1.h5"))["pass"]
    r = client("run", sock, gqa, str(tmp_path / "c2.h5"))
    assert r.returncode == 0, r.stderr
    assert not cpgold.check(gqa, str(tmp_path / "c2.h5"))["pass"]  # the planted GQA bug reaches the file
    r = client("run", sock, mha, str(tmp_path / "c1.h5"))
    assert r.returncode == 2 and "exists; nothing was written" in r.stderr
    assert open(log).read().count("loaded in") == 1  # one process served every run


@pytest.mark.parametrize("name,message", [
    ("die", "process died in this run"),
    ("slow", "ran past --timeout 5 s"),
    ("raise", "RuntimeError: planted error"),
])
def test_a_broken_run_answers_error_and_the_next_gets_a_fresh_process(server, tmp_path, name, message):
    sock, p, log = server
    bad = gen(MHA, tmp_path / f"{name}.h5")
    good = gen(MHA, tmp_path / "ok.h5")
    r = client("run", sock, bad, str(tmp_path / "bad_c.h5"))
    assert r.returncode == 1 and message in r.stderr
    assert not os.path.exists(tmp_path / "bad_c.h5")
    r = client("run", sock, good, str(tmp_path / "ok_c.h5"))
    assert r.returncode == 0, r.stderr
    assert p.poll() is None
    assert open(log).read().count("loaded in") == 2


def test_refusal_exits_3(server, tmp_path):
    sock, _, _ = server
    r = client("run", sock, gen(MHA, tmp_path / "refuse.h5"), str(tmp_path / "c.h5"))
    assert r.returncode == 3 and "unsupported: planted refusal" in r.stderr


def test_no_server_names_the_socket(tmp_path):
    r = client("run", str(tmp_path / "none.sock"), gen(MHA, tmp_path / "a.h5"), str(tmp_path / "c.h5"))
    assert r.returncode == 1 and "no server answers at" in r.stderr and "none.sock" in r.stderr


def test_an_adapter_that_cannot_load_stops_the_server(tmp_path):
    p = subprocess.run([sys.executable, "-m", "cpgold.outsiders.serve", "start", str(tmp_path / "s.sock"),
                        "serve_fake:Missing"], capture_output=True, text=True, env=env(), timeout=120)
    assert p.returncode == 1 and "Missing" in p.stderr
    assert not os.path.exists(tmp_path / "s.sock")


def test_shrink_through_the_server_matches_a_process_per_run(server, tmp_path):
    sock, _, log = server
    start = gen(GQA, tmp_path / "start.h5")
    common = ["--tensors", "o,dq,dk,dv", "--format", "json", "--max-runs", "25"]
    via = subprocess.run([BIN, "shrink", start, "--run",
                          f"{sys.executable} -m cpgold.outsiders.serve run {sock} {{fixture}} {{candidate}}", *common],
                         capture_output=True, text=True, env=env(), timeout=600)
    fresh = subprocess.run([BIN, "shrink", start, "--run",
                            f"{sys.executable} -c 'import sys; from cpgold.outsiders.runner import run_and_write; "
                            f"from serve_fake import Planted; sys.exit(1 if run_and_write(Planted(), sys.argv[1], "
                            f"\"s\", sys.argv[2]).get(\"status\") else 0)' {{fixture}} {{candidate}}", *common],
                           capture_output=True, text=True, env=env(), timeout=600)
    assert via.returncode == 0, via.stderr[-2000:]
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    a, b = json.loads(via.stdout), json.loads(fresh.stdout)
    assert a["smallest"]["case_json"] == b["smallest"]["case_json"] and a["runs"] == b["runs"]
    assert a["smallest"]["rows_q"] < a["original"]["rows_q"]
    smallest = json.loads(a["smallest"]["case_json"])
    assert smallest["heads_q"] != smallest.get("heads_kv", smallest["heads_q"])  # the planted bug needs GQA
    assert open(log).read().count("loaded in") == 1
