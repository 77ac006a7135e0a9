"""cpgold.capture shrink with a COMMAND (docs/capture.md, "shrink"): a captured call of the planted chunk swap
(test_capture.py's model, W = 2) shrunk by rerunning the user's ring attention as a command
(capture_shrink_command.py), its saved case reproduced through `cpgold gen --inputs` and `cpgold check`; what
COMMAND is handed (hostile folder names), a hanging COMMAND, escaped descendants, a COMMAND writing nothing, a
per-rank COMMAND, the budget, signals, bad arguments; and the refusal by `cpgold shrink` and cpgold.shrink of a start
that is a fixture of given inputs."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the capture records torch calls")
pytest.importorskip("h5py")

import cpgold  # noqa: E402
from cpgold._core_loader import available as core_available  # noqa: E402

if not core_available():
    pytest.skip("cpgold's C++ core (cpgold._core) is not built: join, check and shrink need it",
                allow_module_level=True)

import cpgold.capture as capture  # noqa: E402

import capture_shrink_command  # noqa: E402
from test_capture import run_step  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "capture_shrink_command.py")
PYTHONPATH = os.pathsep.join(p for p in sys.path if p)
CALL = "step0.layers.1"
SAFE = re.compile(r"^/[A-Za-z0-9._/-]+$")
HOSTILE = "x $(touch MARK1) `touch MARK2` ' \" {candidate} ;touch MARK3"


KINDS = {}  # the diagnosis kinds `capture check` gives the failing call


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """The joined failing call of a W = 2 capture: layer 1's attention swaps rank 1's two chunks
    (test_capture.py checks that the diagnosis names the swap, chunk_order)."""
    folder = tmp_path_factory.mktemp("capture") / "cap"
    run_step(2, folder, bugs={1: "chunks_swapped@r1"}, n_layers=2)
    assert capture.join(folder).exit_code == 0
    report = capture.check(folder)
    assert [c["status"] for c in report["calls"]] == ["pass", "fail"]
    KINDS["call"] = sorted({d["kind"] for d in report["calls"][1]["diagnosis"]})
    assert KINDS["call"]
    return folder / "joined" / CALL


def copy_call(captured, where):
    """A copy of the joined call (its shrunk/ is then the test's own)."""
    shutil.copytree(captured, where)
    return where


def q(path):
    return shlex.quote(str(path))


def once(tmp_path, outputs):
    """A COMMAND that copies the captured candidate on its first run only and writes nothing afterwards."""
    mark = tmp_path / "first-run-done"
    return (f"test -f {{fixture}} || exit 9; if [ ! -e {q(mark)} ]; then touch {q(mark)}; cp {q(outputs)} "
            "{candidate}; fi")


def cli(call_dir, command, *options, env=None, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "cpgold.capture", "shrink", str(call_dir), "--run", command,
                           *options], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=dict(os.environ if env is None else env, PYTHONPATH=PYTHONPATH))


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pids(path):
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_command_shrinks_a_captured_failure_and_the_answer_reproduces(captured, tmp_path, cpgold_bin):
    """`python3 -m cpgold.capture shrink CALL --run COMMAND`, COMMAND the user's ring attention with the captured bug
    run on the fixture of each cut: a smaller case, failing with the diagnosis kind `capture check` gives the call;
    case.json + inputs.h5 give through `cpgold gen --inputs` the fixture of that case, on which the buggy attention
    fails `cpgold check` with that kind and the attention without the bug passes."""
    call = copy_call(captured, tmp_path / "call")
    command = f"{q(sys.executable)} {q(SCRIPT)} {{fixture}} {{candidate}} chunks_swapped@r1"
    proc = cli(call, command, "--max-runs", "2", "--confirm", "0", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    original, smallest = json.loads(r["original"]), json.loads(r["smallest"])
    kinds = KINDS["call"]
    assert r["kinds"] == kinds and r["steps"] == ["keep sequences 0..1 of 4"] and r["runs"] == 2
    assert r["stopped"] == "max_runs" and r["exit_code"] == 0
    assert sum(smallest["seqlens_q"]) < sum(original["seqlens_q"])
    assert smallest["total_tokens_q"] < original["total_tokens_q"]
    assert set(kinds) <= {d["kind"] for d in r["report"]["diagnosis"]}
    assert sorted(os.listdir(call / "shrunk")) == ["case.json", "inputs.h5", "shrink.json"]
    assert "shrink: run 2 (" in proc.stderr and "keep sequences 0..1 of 4: fails (" in proc.stderr
    assert "), kept; smallest 34 q rows" in proc.stderr
    assert r["reproduce"][1] == command.replace("{fixture}", "case.h5").replace("{candidate}", "candidate.h5")

    fixture = tmp_path / "small.h5"
    subprocess.run([cpgold_bin, "gen", "--case", (call / "shrunk" / "case.json").read_text(), "--inputs",
                    str(call / "shrunk" / "inputs.h5"), "-o", str(fixture)], check=True, capture_output=True)
    with cpgold.Fixture(fixture) as fx:
        assert fx.inputs_source == "given" and json.loads(fx.case_json)["seqlens_q"] == smallest["seqlens_q"]
        cpgold.write_ranks(tmp_path / "buggy.h5", capture_shrink_command.rerun(fx, "chunks_swapped@r1"), fixture=fx)
        cpgold.write_ranks(tmp_path / "fixed.h5", capture_shrink_command.rerun(fx, None), fixture=fx)
    check = subprocess.run([cpgold_bin, "check", str(fixture), str(tmp_path / "buggy.h5"), "--format", "json"],
                           capture_output=True, text=True)
    assert check.returncode == 1, check.stderr
    assert set(kinds) <= {d["kind"] for d in json.loads(check.stdout)["diagnosis"]}
    fixed = subprocess.run([cpgold_bin, "check", str(fixture), str(tmp_path / "fixed.h5")], capture_output=True,
                           text=True)
    assert fixed.returncode == 0, fixed.stdout


def test_a_command_that_writes_nothing_is_no_candidate_and_escaped_processes_end(captured, tmp_path):
    """Python door: COMMAND writes the captured candidate on its first run only; every later run is "no candidate",
    never a pass nor a kept failure, so the captured case is the answer (exit code 1). With confirmation its reruns
    give no candidate either: the failure does not reproduce (exit code 4). A process each run starts in a session of
    its own after a double fork is ended with the run."""
    call = copy_call(captured, tmp_path / "call")
    escaped = tmp_path / "escaped"
    command = f"(setsid sleep 300 & echo $! >> {q(escaped)}); " + once(tmp_path, call / "candidate.h5")
    seen = []
    r = capture.shrink(call, command=command, max_runs=4, confirm=0, progress=seen.append)
    assert (r["runs"], r["no_candidate"], r["passed"], r["steps"], r["stopped"]) == (4, 3, 0, [], "max_runs")
    assert r["exit_code"] == 1 and r["smallest"] == r["original"]
    assert [p["detail"] for p in seen] == ["COMMAND exited 0 but wrote no candidate candidate.h5"] * 3
    assert len(pids(escaped)) == 4 and not any(alive(p) for p in pids(escaped))

    (tmp_path / "first-run-done").unlink()
    again = capture.shrink(call, command=command, max_runs=2, out=tmp_path / "again")
    assert again["not_reproduced"] and again["exit_code"] == 4 and again["confirmation_runs"] == 2
    assert [(c["which"], c["failed_same_way"], c["reruns"]) for c in again["confirmations"]] == \
        [("the original", 0, 2)]
    assert not any(alive(p) for p in pids(escaped))


def test_hostile_folder_names_run_nothing_and_only_safe_paths_are_handed(captured, tmp_path):
    """The call folder and TMPDIR hold $(...), backticks, quotes, ';' and a placeholder: COMMAND, with its
    placeholders single-quoted, double-quoted and bare, is handed absolute paths of safe characters only (through a
    link folder in /tmp to the runs' folder in TMPDIR), no marker is made anywhere, and nothing of the search is
    left in TMPDIR or /tmp."""
    call = copy_call(captured, tmp_path / HOSTILE / "joined" / CALL)
    tmpdir = tmp_path / f"tmp {HOSTILE}"
    tmpdir.mkdir()
    outputs = tmp_path / "captured.h5"
    shutil.copy(call / "candidate.h5", outputs)
    handed, real = tmp_path / "handed", tmp_path / "real"
    command = (f"echo {{fixture}} '{{fixture}}' \"{{candidate}}\" >> {q(handed)}; readlink -f {{fixture}} >> "
               f"{q(real)}; test -f '{{fixture}}' && test -f \"{{fixture}}\" || exit 9; " + once(tmp_path, outputs))
    proc = cli(call, command, "--max-runs", "3", "--confirm", "0", env=dict(os.environ, TMPDIR=str(tmpdir)),
               cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "runs: 3 (0 passed, 0 failed otherwise, 2 without a candidate)" in proc.stdout
    paths = handed.read_text().split()
    assert len(paths) == 9 and all(SAFE.match(p) and p.startswith("/tmp/cpgold-capture-shrink-") for p in paths)
    assert all(line.startswith(str(tmpdir) + "/cpgold-capture-shrink-") for line in real.read_text().splitlines())
    assert not [n for _, _, files in os.walk(tmp_path) for n in files if n.startswith("MARK")]
    assert os.listdir(tmpdir) == []
    assert not any(os.path.lexists(p.split("/runs/")[0]) for p in paths)
    assert sorted(os.listdir(call / "shrunk")) == ["case.json", "inputs.h5", "shrink.json"]


@pytest.mark.parametrize("door", ["command line", "python"])
def test_a_hanging_command_is_killed_at_the_run_timeout(captured, tmp_path, door):
    """COMMAND never ends: its group is killed at the run timeout (1 s), with the process it left in its group and
    the one that escaped it (setsid after a double fork); the captured case then has no candidate (exit 2)."""
    call = copy_call(captured, tmp_path / "call")
    escaped, grouped = tmp_path / "escaped", tmp_path / "grouped"
    command = (f": {{fixture}} {{candidate}}; (setsid sleep 300 & echo $! > {q(escaped)}); "
               f"sleep 300 & echo $! > {q(grouped)}; sleep 300")
    began = time.monotonic()
    if door == "python":
        with pytest.raises(cpgold.InputError, match="ran past the run timeout of 1 s and was killed") as e:
            capture.shrink(call, command=command, run_timeout=1)
        assert e.value.field == "command"
    else:
        proc = cli(call, command, "--run-timeout", "1")
        assert proc.returncode == 2 and "ran past the run timeout of 1 s and was killed" in proc.stderr
    assert time.monotonic() - began < 10
    assert pids(escaped) and pids(grouped) and not any(alive(p) for p in pids(escaped) + pids(grouped))
    assert not os.path.exists(call / "shrunk")


def test_a_command_per_rank(captured, tmp_path):
    """With {rank} COMMAND runs once per rank, all at once, each writing its rank's candidate file: the captured
    outputs fail as the call does; a cut case gets no candidate; the confirmation reruns the original."""
    call = copy_call(captured, tmp_path / "call")
    command = (f"{q(sys.executable)} {q(SCRIPT)} --copy-rank {q(call / 'candidate.h5')} {{fixture}} {{candidate}} "
               "{rank}")
    proc = cli(call, command, "--max-runs", "2", "--confirm", "1", "--format", "json")
    assert proc.returncode == 1, proc.stderr
    r = json.loads(proc.stdout)
    assert r["kinds"] == KINDS["call"] and r["no_candidate"] == 1 and r["confirmed"]
    assert [(c["which"], c["failed_same_way"]) for c in r["confirmations"]] == [("the original", 1)]
    assert "COMMAND of rank 0 exited with status 1" in proc.stderr
    assert "for rank in 0 1; do " in r["reproduce"][1] and "candidate.rank$rank.h5 $rank & done; wait" in \
        r["reproduce"][1]
    assert r["reproduce"][2] == "cpgold check case.h5 candidate.rank0.h5 candidate.rank1.h5"


def test_the_budget_stops_a_running_command(captured, tmp_path):
    """The second run hangs (no run timeout): the budget ends it and the search, whose answer is the captured
    case (exit 1, stopped: budget); the run cut short is not counted."""
    call = copy_call(captured, tmp_path / "call")
    command = once(tmp_path, call / "candidate.h5") + "; test -e " + q(tmp_path / "first-run-done") + \
        " && [ ! -e {candidate} ] && exec sleep 300; true"
    began = time.monotonic()
    proc = cli(call, command, "--budget", "2", "--run-timeout", "0", "--confirm", "0", "--format", "json")
    assert time.monotonic() - began < 12
    assert proc.returncode == 1, proc.stderr
    r = json.loads(proc.stdout)
    assert r["stopped"] == "budget" and r["runs"] == 1 and "the budget ran out while COMMAND ran" in r["stop_detail"]


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_search_with_what_was_found(captured, tmp_path, signum, code):
    """SIGINT or SIGTERM while COMMAND runs: COMMAND is ended, the runs' folder removed, the answer so far (the
    captured case) saved and reported, exit 128 + N."""
    call = copy_call(captured, tmp_path / "call")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    hanging = tmp_path / "hanging"
    command = once(tmp_path, call / "candidate.h5") + f"; [ -e {{candidate}} ] || {{ echo $$ > {q(hanging)}; " \
                                                      "exec sleep 300; }"
    proc = subprocess.Popen([sys.executable, "-m", "cpgold.capture", "shrink", str(call), "--run", command],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=PYTHONPATH, TMPDIR=str(tmpdir)))
    deadline = time.monotonic() + 60
    while not hanging.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.1)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == code, stderr
    name = "SIGINT" if signum == signal.SIGINT else "SIGTERM"
    assert f"the search stopped before its first step (interrupted: {name} came while COMMAND ran for run 2)" in stdout
    assert "(0 steps kept; stopped: interrupted)" in stdout
    assert not alive(pids(hanging)[0]) and os.listdir(tmpdir) == []
    assert json.loads((call / "shrunk" / "case.json").read_text()) == json.loads((call / "case.json").read_text())


def test_bad_arguments_are_named_and_nothing_is_written(captured, tmp_path):
    call = copy_call(captured, tmp_path / "call")
    fn = capture_shrink_command.rerun
    for kwargs, field in [({}, "fn"), ({"fn": fn, "command": "x {fixture} {candidate}"}, "command"),
                          ({"command": "x {fixture}"}, "command"), ({"command": "x {candidate}"}, "command"),
                          ({"command": "x {fixture} {candidate}", "run_timeout": -1}, "run_timeout"),
                          ({"command": "x {fixture} {candidate}", "run_timeout": float("nan")}, "run_timeout"),
                          ({"fn": fn, "run_timeout": 5}, "run_timeout"),
                          ({"command": "x {fixture} {candidate}", "scope": "cp_gathered"}, "scope"),
                          ({"command": "x {fixture} {candidate}", "confirm": -1}, "confirm"),
                          ({"command": "x {fixture} {candidate}", "max_runs": 1.5}, "max_runs")]:
        with pytest.raises(cpgold.InputError) as e:
            capture.shrink(call, **kwargs)
        assert e.value.field == field, (kwargs, str(e.value))
    for options, said in [(["--run", "true {candidate}"], "COMMAND must contain {fixture}"),
                          (["--run", "true {fixture} {candidate}", "--run-timeout", "-1"], "run_timeout"),
                          (["--run", "true {fixture} {candidate}", "--confirm", "-2"], "confirm")]:
        proc = subprocess.run([sys.executable, "-m", "cpgold.capture", "shrink", str(call), *options],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=PYTHONPATH))
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("mine")
    proc = cli(call, "true {fixture} {candidate}", "-o", str(tmp_path / "taken"))
    assert proc.returncode == 2 and "out:" in proc.stderr and "never writes over files" in proc.stderr
    assert os.listdir(tmp_path / "taken") == ["mine.txt"] and not os.path.exists(call / "shrunk")


def test_a_fixture_of_given_inputs_is_refused_as_a_start(captured, tmp_path, cpgold_bin):
    """`cpgold shrink GOLDEN` and cpgold.shrink(GOLDEN, fn) with GOLDEN a fixture of given inputs (the captured
    call's): refused before anything runs (exit 2 / InputError naming the start), pointing to cpgold.capture shrink;
    a seeded fixture of the same case is still a start (its COMMAND or fn runs)."""
    _, case, inputs = capture.load_joined(captured)
    given, seeded = tmp_path / "given.h5", tmp_path / "seeded.h5"
    cpgold.generate(case, inputs=inputs, path=given, allow_nonfinite=True).close()
    cpgold.generate(case, path=seeded).close()
    ran = tmp_path / "ran"
    command = f"touch {q(ran)}; : {{fixture}} {{candidate}}"
    proc = subprocess.run([cpgold_bin, "shrink", str(given), "--run", command], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert str(given) in proc.stderr and "given inputs" in proc.stderr and "a run's tensors" in proc.stderr
    assert "python3 -m cpgold.capture shrink CALL_DIR" in proc.stderr and not ran.exists()
    called = []
    for start in (str(given), cpgold.Fixture(given)):
        with pytest.raises(cpgold.InputError) as e:
            cpgold.shrink(start, lambda fx: called.append(fx))
        assert e.value.field == "start" and "given inputs" in str(e.value) and str(given) in str(e.value)
        assert "cpgold.capture.shrink(call_dir, fn)" in str(e.value)
    assert not called
    proc = subprocess.run([cpgold_bin, "shrink", str(seeded), "--run", command], capture_output=True, text=True)
    assert proc.returncode == 2 and "gave no candidate" in proc.stderr and ran.exists()
    with pytest.raises(cpgold.InputError) as e:
        cpgold.shrink(str(seeded), lambda fx: called.append(fx), confirm=0)
    assert e.value.field == "fn" and len(called) == 1
