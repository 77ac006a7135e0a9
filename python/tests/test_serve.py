"""The resident adapter (cpgold.outsiders.serve) with a fake implementation (serve_fake.py): candidates written as
`--write-candidate` writes them, a process that dies, runs past --timeout or raises is replaced and its run answers
"error" (never a candidate), refusals exit 3, no server exits 1 with the socket named, and `cpgold shrink` with the
client as COMMAND finds the same smallest case as with a fresh process per run. Then what a peer or a path cannot do:
a rogue listener's pickle is never unpickled, a folder others can write, a socket of another user and a listener or
client running as another user are refused, start removes nothing but its own stale socket, malformed and silent
requests are answered while the server goes on, a hung run meets a default timeout, and the adapter's process dies
with the server."""
import json
import os
import pathlib
import pickle
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import cpgold
from cpgold.outsiders import serve
from cpgold.outsiders.environment import digest

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


def client(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "cpgold.outsiders.serve", *args], capture_output=True, text=True,
                          env=env(), timeout=timeout)


STARTED = []


@pytest.fixture(autouse=True)
def no_server_left():
    yield
    while STARTED:
        p = STARTED.pop()
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start(tmp_path, *options, adapter="serve_fake:Planted", name="s.sock"):
    """A server at tmp_path/name, started and listening: (socket, process, log path)."""
    sock, log = str(tmp_path / name), tmp_path / f"{name}.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "cpgold.outsiders.serve", "start", sock, adapter, *options],
                             stderr=f, env=env())
    STARTED.append(p)
    for _ in range(600):
        if "serve: listening at" in log.read_text() or p.poll() is not None:
            break
        time.sleep(0.05)
    assert "serve: listening at" in log.read_text() and os.path.exists(sock), log.read_text()
    return sock, p, log


def stop(sock, p):
    if p.poll() is None:
        client("stop", sock)
        p.wait(30)


@pytest.fixture
def server(tmp_path):
    sock, p, log = start(tmp_path, "--timeout", "5")
    yield sock, p, log
    stop(sock, p)


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
    ("slow", "ran past --timeout 5 s; its process was killed"),
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


COMMON = ("python", "torch", "cuda", "cudnn_torch", "nccl", "device", "compute_capability", "driver",
          "libcudnn_mapped", "variables")


def test_answers_carry_the_versions_of_the_process_that_ran_them(server, tmp_path):
    sock, _, log = server
    good = gen(MHA, tmp_path / "ok.h5")
    first = raw(sock, frame({"op": "run", "fixture": good, "candidate": str(tmp_path / "c1.h5")}), wait=120)
    assert "status" not in first and first["pad_rows"] == "zero"
    v = first["versions"]
    assert set(COMMON) <= set(v) and v["planted"] == "1"   # the environment under the adapter's own fields
    assert v["pid"] == adapter_pids(log)[0] and first["versions_digest"].startswith("sha256:")
    died = raw(sock, frame({"op": "run", "fixture": gen(MHA, tmp_path / "die.h5"),
                            "candidate": str(tmp_path / "c2.h5")}), wait=120)
    assert died["status"] == "error" and died["versions"]["pid"] == v["pid"]   # the process that died in it
    r = client("run", sock, good, str(tmp_path / "c3.h5"))
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("serve run: versions "))
    fresh = json.loads(line[len("serve run: versions "):])
    assert fresh["pid"] == adapter_pids(log)[1] != v["pid"] and fresh["planted"] == "1"
    assert digest(fresh) == first["versions_digest"]   # the same versions: only the process (pid) differs
    r = client("run", sock, gen(MHA, tmp_path / "refuse.h5"), str(tmp_path / "c4.h5"))
    assert r.returncode == 3 and '"planted": "1"' in r.stdout   # a refusal names its versions too


def test_shrink_keeps_the_versions_in_its_records(server, tmp_path):
    sock, _, _ = server
    start = gen(GQA, tmp_path / "start.h5")
    work = tmp_path / "work"
    via = subprocess.run([BIN, "shrink", start, "--run",
                          f"{sys.executable} -m cpgold.outsiders.serve run {sock} {{fixture}} {{candidate}}",
                          "--tensors", "o,dq,dk,dv", "--format", "json", "--max-runs", "2", "--keep",
                          "--work-dir", str(work)], capture_output=True, text=True, env=env(), timeout=600)
    assert via.returncode == 0, via.stderr[-2000:]
    logs = sorted(work.glob("shrink-*/run-*/command.log"))
    assert logs, sorted(str(p) for p in work.rglob("*"))
    for path in logs:
        line = next(x for x in path.read_text().splitlines() if x.startswith("serve run: versions "))
        kept = json.loads(line[len("serve run: versions "):])
        assert set(COMMON) <= set(kept) and kept["planted"] == "1", path


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


# --- trust, cleanup and liveness --------------------------------------------------------------------------------

def raw(sock, payload, wait=5):
    """Sends payload as is and returns the server's answer, read as the wire format: a 4-byte big-endian length, then
    a JSON object."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(wait)
        s.connect(sock)
        s.sendall(payload)
        head = b""
        while len(head) < 4:
            head += s.recv(4 - len(head)) or pytest.fail("the server closed without an answer")
        body = b""
        while len(body) < struct.unpack(">I", head)[0]:
            body += s.recv(65536) or pytest.fail("the server closed in the middle of its answer")
    return json.loads(body)


def frame(message):
    data = json.dumps(message).encode()
    return struct.pack(">I", len(data)) + data


class Marker:
    """Unpickling this creates the file at path: what a rogue listener's code could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def rogue(path, marker):
    """A listener at path that answers any connection with a pickle (framed as multiprocessing frames it) that
    creates marker when unpickled."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen(1)
    s.settimeout(10)
    payload = pickle.dumps(Marker(marker))

    def answer():
        try:
            conn, _ = s.accept()
            conn.recv(65536)
            conn.sendall(struct.pack("!i", len(payload)) + payload)
            conn.close()
        except OSError:
            pass
    threading.Thread(target=answer, daemon=True).start()
    return s


def gone(pid, wait=5):
    """Whether process pid has ended (a zombie counts: nothing of it runs) within wait seconds."""
    end = time.time() + wait
    while time.time() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def adapter_pids(log):
    return [int(m) for m in re.findall(r"loaded in [0-9.]+ s \(process (\d+)", open(log).read())]


@pytest.mark.parametrize("where", ["shared folder", "own folder"])
def test_a_rogue_listener_is_never_unpickled(tmp_path, where):
    folder = tmp_path / "f"
    folder.mkdir()
    if where == "shared folder":
        os.chmod(folder, 0o1777)  # as /tmp: another user's listener can be there first
    marker = tmp_path / "marker"
    fixture = tmp_path / "a.h5"
    fixture.write_bytes(b"x")
    s = rogue(str(folder / "s.sock"), str(marker))
    try:
        r = client("run", str(folder / "s.sock"), str(fixture), str(tmp_path / "c.h5"), timeout=20)
    finally:
        s.close()
    assert not marker.exists()
    if where == "shared folder":
        assert r.returncode == 2 and f"folder {folder} is writable by others (mode 1777)" in r.stderr, r.stderr
    else:
        assert r.returncode == 1 and "answered with something unusable: not a JSON message" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user (nobody, uid 65534)")
def test_a_listener_of_another_user_is_refused(tmp_path):
    # The socket file is root's, in root's folder, but the process listening runs as nobody: SO_PEERCRED tells.
    sock, marker = str(tmp_path / "s.sock"), str(tmp_path / "marker")
    payload = pickle.dumps(Marker(marker))
    script = ("import os, socket, struct, sys\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\n"
              "os.setgid(65534)\nos.setuid(65534)\ns.listen(1)\nprint('ready', flush=True)\ns.settimeout(10)\n"
              "c, _ = s.accept()\nc.recv(65536)\np = bytes.fromhex(sys.argv[2])\n"
              "c.sendall(struct.pack('!i', len(p)) + p)\n")
    p = subprocess.Popen([sys.executable, "-c", script, sock, payload.hex()], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert os.stat(sock).st_uid == 0
        fixture = tmp_path / "a.h5"
        fixture.write_bytes(b"x")
        r = client("run", sock, str(fixture), str(tmp_path / "c.h5"), timeout=20)
    finally:
        p.kill()
        p.wait()
    assert not os.path.exists(marker)
    assert r.returncode == 2 and f"the process listening at {sock} runs as uid 65534" in r.stderr, r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user (nobody, uid 65534)")
def test_the_server_refuses_a_client_of_another_user():
    folder = tempfile.mkdtemp(prefix="cpgold-serve-")  # nobody must reach it: not under root's pytest folder
    try:
        sock, p, log = start(pathlib.Path(folder))
        os.chmod(folder, 0o755)
        os.chmod(sock, 0o777)  # let nobody connect: only SO_PEERCRED stands in the way now
        script = ("import json, socket, struct, sys\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(5)\n"
                  "s.connect(sys.argv[1])\nd = json.dumps({'op': 'stop'}).encode()\ntry:\n"
                  "    s.sendall(struct.pack('>I', len(d)) + d)\nexcept BrokenPipeError:\n    pass  # answered unread\n"
                  "print(s.recv(65536)[4:].decode())\n")
        r = subprocess.run([sys.executable, "-c", script, sock], capture_output=True, text=True, user=65534,
                           group=65534, cwd="/", timeout=30)
        assert r.returncode == 0, r.stderr
        answer = json.loads(r.stdout)
        assert answer["status"] == "unusable" and "a client of uid 65534" in answer["reason"]
        assert p.poll() is None  # not stopped
        stop(sock, p)
        assert p.returncode == 0
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("mode,why", [(0o777, "is writable by others (mode 777)"),
                                      (0o770, "is writable by others (mode 770)"),
                                      ("link", "is a symbolic link")])
def test_a_socket_folder_others_can_change_is_refused(tmp_path, mode, why):
    folder = tmp_path / "f"
    if mode == "link":
        (tmp_path / "real").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "real")
    else:
        folder.mkdir()
        os.chmod(folder, mode)
    sock = str(folder / "s.sock")
    fixture = tmp_path / "a.h5"
    fixture.write_bytes(b"x")
    for args in (["start", sock, "serve_fake:Planted"], ["run", sock, str(fixture), str(tmp_path / "c.h5")],
                 ["stop", sock]):
        r = client(*args, timeout=20)
        assert r.returncode == 2 and f"folder {folder} {why}" in r.stderr, (args, r.stderr)
        assert "loaded in" not in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(folder) == []


@pytest.mark.parametrize("what", ["file", "folder", "link"])
@pytest.mark.parametrize("adapter", ["serve_fake:Planted", "no_such_adapter"])
def test_start_never_removes_what_is_not_its_stale_socket(tmp_path, what, adapter):
    path = tmp_path / "s.sock"
    if what == "file":
        path.write_text("results of a week")
    elif what == "folder":
        path.mkdir()
        (path / "inside").write_text("kept")
    else:
        (tmp_path / "target").write_text("kept")
        path.symlink_to(tmp_path / "target")
    before = os.lstat(path)
    r = client("start", str(path), adapter, timeout=20)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and "loaded in" not in r.stderr, r.stderr
    if adapter == "no_such_adapter":  # the adapter's name is checked first
        assert "ADAPTER: 'no_such_adapter' is not one of" in r.stderr
    else:
        kind = {"file": "a regular file", "folder": "a folder", "link": "a symbolic link"}[what]
        assert f"SOCKET: {path} is {kind}, not a socket; nothing was changed" in r.stderr
    assert os.path.samestat(os.lstat(path), before)
    if what == "file":
        assert path.read_text() == "results of a week"
    else:
        assert (path / "inside" if what == "folder" else tmp_path / "target").read_text() == "kept"


def test_a_stale_socket_is_replaced_and_a_live_one_is_kept(tmp_path):
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "s.sock"))  # bound, never listening, closed: what a killed server leaves
    stale.close()
    sock, p, log = start(tmp_path)
    r = client("start", sock, "serve_fake:Planted", timeout=20)
    assert r.returncode == 2 and f"a server is already listening at {sock}" in r.stderr, r.stderr
    assert "loaded in" not in r.stderr
    stop(sock, p)
    assert p.returncode == 0 and not os.path.exists(sock)


def test_a_socket_path_too_long_is_refused_before_loading(tmp_path):
    folder = tmp_path / ("d" * max(1, 120 - len(str(tmp_path))))
    folder.mkdir()
    sock = str(folder / "s.sock")
    r = client("start", sock, "serve_fake:Planted", timeout=20)
    assert r.returncode == 2 and f"SOCKET: {sock} is {len(sock)} bytes long" in r.stderr and "at most 107" in r.stderr
    assert r.stderr.count("\n") == 1 and "loaded in" not in r.stderr


@pytest.mark.parametrize("payload,reason", [
    (b"GET / HTTP/1.0\r\n\r\n", "bytes announced (at most 65536)"),
    (struct.pack(">I", 0x7FFFFFFF), "a message of 2147483647 bytes announced"),
    (struct.pack(">I", 5) + b"\xff\xfe{}x", "not a JSON message"),
    (struct.pack(">I", 9) + b"not json!", "not a JSON message"),
    (frame(["run", "a.h5", "c.h5"]), "expected a JSON object, got list"),
    (frame({"op": "explode"}), "op: expected \"run\" or \"stop\", got 'explode'"),
    (frame({"op": "run", "fixture": "/a.h5"}), "candidate: expected an absolute path, got None"),
    (frame({"op": "run", "fixture": "a.h5", "candidate": "/c.h5"}), "fixture: expected an absolute path, got 'a.h5'"),
])
def test_a_malformed_request_is_answered_and_the_server_goes_on(server, tmp_path, payload, reason):
    sock, p, log = server
    answer = raw(sock, payload)
    assert answer["status"] == "unusable" and reason in answer["reason"], answer
    assert p.poll() is None
    r = client("run", sock, gen(MHA, tmp_path / "a.h5"), str(tmp_path / "c.h5"))
    assert r.returncode == 0, r.stderr


def test_a_silent_client_does_not_block_the_server(tmp_path):
    sock, p, log = start(tmp_path, "--read-timeout", "1")
    try:
        with socket.socket(socket.AF_UNIX) as silent:
            silent.connect(sock)  # and sends nothing
            t0 = time.time()
            r = client("run", sock, gen(MHA, tmp_path / "a.h5"), str(tmp_path / "c.h5"))
            assert r.returncode == 0, r.stderr
            assert time.time() - t0 < 10
            silent.settimeout(5)
            head = silent.recv(4)
            answer = json.loads(silent.recv(65536))
        assert len(head) == 4 and answer["status"] == "unusable" and "no request within 1 s" in answer["reason"]
    finally:
        stop(sock, p)
    sock, p, log = start(tmp_path, name="default.sock")  # a default there is
    stop(sock, p)
    assert f"a request {serve.READ_TIMEOUT:g} s" in open(log).read() and 0 < serve.READ_TIMEOUT <= 60


def test_a_hung_run_is_killed_at_the_timeout_and_there_is_a_default(tmp_path):
    sock, p, log = start(tmp_path)  # no --timeout
    stop(sock, p)
    assert f"a run may take {serve.DEFAULT_TIMEOUT:g} s" in open(log).read() and 0 < serve.DEFAULT_TIMEOUT < 300
    assert f"(default {serve.DEFAULT_TIMEOUT:g};" in client("start", "--help").stdout.replace("\n", " ")
    for bad in ("0", "inf", "nan"):  # no way back to an unbounded run
        r = client("start", str(tmp_path / "x.sock"), "serve_fake:Planted", "--timeout", bad, timeout=20)
        assert r.returncode == 2 and f"--timeout: expected seconds > 0, got {float(bad)}" in r.stderr, r.stderr
    sock, p, log = start(tmp_path, "--timeout", "1", name="t.sock")
    try:
        t0 = time.time()
        r = client("run", sock, gen(MHA, tmp_path / "slow.h5"), str(tmp_path / "c1.h5"))
        assert r.returncode == 1 and "ran past --timeout 1 s; its process was killed" in r.stderr
        assert time.time() - t0 < 10
        first = adapter_pids(log)[0]
        assert gone(first)
        r = client("run", sock, gen(MHA, tmp_path / "ok.h5"), str(tmp_path / "c2.h5"))
        assert r.returncode == 0, r.stderr
        assert len(adapter_pids(log)) == 2
    finally:
        stop(sock, p)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_the_adapter_dies_with_the_server(tmp_path, sig):
    sock, p, log = start(tmp_path)
    slow = gen(MHA, tmp_path / "slow.h5")
    c = subprocess.Popen([sys.executable, "-m", "cpgold.outsiders.serve", "run", sock, slow, str(tmp_path / "c.h5")],
                         stderr=subprocess.PIPE, text=True, env=env())
    pid = adapter_pids(log)[0]
    try:
        for _ in range(200):  # the adapter is inside the run
            if os.path.exists(slow + ".running"):
                break
            time.sleep(0.05)
        assert os.path.exists(slow + ".running")
        p.send_signal(sig)
        p.wait(10)
        assert gone(pid, 5), f"the adapter's process {pid} outlived the server"
        assert c.wait(10) == 1 and "closed the connection without an answer" in c.stderr.read()
        if sig != signal.SIGKILL:
            assert p.returncode == 128 + sig and not os.path.exists(sock)
            assert f"stopped by signal {int(sig)}" in open(log).read()
    finally:
        c.kill()
        c.wait()
        if not gone(pid, 0.1):
            os.kill(pid, signal.SIGKILL)


def test_an_unusable_fixture_or_an_existing_candidate_is_named(server, tmp_path):
    sock, p, log = server
    bad = tmp_path / "text.h5"
    bad.write_text("not hdf5")
    r = client("run", sock, str(bad), str(tmp_path / "c.h5"))
    assert r.returncode == 2 and "serve run: unusable: " in r.stderr and str(bad) in r.stderr, r.stderr
    assert "HDF5" in r.stderr and "died" not in r.stderr  # the reader's own words (with or without cpgold._core)
    existing = tmp_path / "exists.h5"
    existing.write_text("kept")
    good = gen(MHA, tmp_path / "a.h5")
    answer = raw(sock, frame({"op": "run", "fixture": good, "candidate": str(existing)}))
    assert answer["status"] == "unusable" and answer["reason"] == f"candidate exists: {existing}; nothing was written"
    assert answer["versions"]["planted"] == "1"   # which process answered, even when it wrote nothing
    assert existing.read_text() == "kept"
    assert open(log).read().count("loaded in") == 1  # neither needed a fresh adapter
