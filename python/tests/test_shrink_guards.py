"""`cpgold shrink` and `cpgold.shrink` against hostile names, reused folders, failed writes, signals, escaping
processes, flaky implementations, endless output and tight budgets (docs/shrink.md): what COMMAND is handed is
safe however it quotes it, nothing shrink did not create is removed, what was found is reported whenever the search
stops, an answer is confirmed before it is presented, and the budgets bound generation, check and diagnosis too."""
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import threading
import time

import pytest

import cpgold

BIN = os.environ.get("CPGOLD_BIN")
PLANTED = os.environ.get("CPGOLD_PLANTED_CANDIDATE")
needs_cli = pytest.mark.skipif(not BIN or not PLANTED,
                               reason="CPGOLD_BIN and CPGOLD_PLANTED_CANDIDATE are not set (run through CTest)")


def needs_core():
    pytest.importorskip("cpgold._core", reason="cpgold's extension is not built: cpgold.shrink runs in process")


# The start of test_shrink_cli.py: 240 q rows in 3 sequences; its chunk_order candidate is 142 kB, the fixture of
# the first step ("sequence 0 alone") 587 kB.
START = {"seqlens_q": [150, 3, 61], "padded_q": [160, 16, 64], "heads_q": 4, "heads_kv": 2, "dim_qk": 16,
         "mask": "causal", "cp_size": 4, "comm": "p2p", "pad_fill": "nan", "seed": 11}
# One long sequence: its generation takes about a second, one replay of a modelled mistake a tenth of that.
LONG = {"seqlens_q": [3999], "heads_q": 1, "dim_qk": 8, "cp_size": 2, "comm": "p2p", "pad_fill": "nan"}


def generated(tmp_path_factory, case, folder, name):
    """The fixture of `case`, made by `cpgold gen` in a fresh folder."""
    if not BIN:
        pytest.skip("CPGOLD_BIN is not set")
    path = str(tmp_path_factory.mktemp(folder) / name)
    subprocess.run([BIN, "gen", "--case", json.dumps(case), "-o", path], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return generated(tmp_path_factory, START, "guards", "start.h5")


@pytest.fixture(scope="module")
def long_golden(tmp_path_factory):
    return generated(tmp_path_factory, LONG, "guards_long", "long.h5")


def planted(kind="chunk_order", form=0, quote=""):
    return f"{shlex.quote(PLANTED)} {quote}{{fixture}}{quote} {quote}{{candidate}}{quote} {kind} {form} 0"


def run_shrink(golden, command, *args, env=None, cwd=None, preexec_fn=None, fmt="json"):
    p = subprocess.run([BIN, "shrink", golden, "--run", command, "--format", fmt, *args], capture_output=True,
                       text=True, timeout=300, env=env, cwd=cwd, preexec_fn=preexec_fn)
    if fmt != "json":
        return p.returncode, p.stdout, p.stderr
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None, p.stderr


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def end_leftovers(pids):
    """Ends the processes a test's COMMAND started that are still there (a failing run), by their recorded ids."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def pids_in(path):
    return [int(x) for x in open(path).read().split()] if os.path.exists(path) else []


# -- 2: what COMMAND is handed -------------------------------------------------------------------------------------

NASTY = "n$(touch MARKER1)`touch MARKER2`'q\"{candidate}{rank}"
SUBSTITUTIONS = "n$(touch MARKER1)`touch MARKER2`"  # no quote: inside double quotes a shell expands both


@needs_cli
@pytest.mark.parametrize("quote,name", [("'", NASTY), ('"', NASTY), ("", NASTY), ('"', SUBSTITUTIONS)],
                         ids=["single", "double", "unquoted", "double-no-quote-in-name"])
def test_hostile_golden_name_and_tmpdir_run_nothing(golden, tmp_path, quote, name):
    """A golden and a TMPDIR whose names hold $(...), backticks, both quotes and placeholders: COMMAND runs as if they
    were plain, whatever quotes it puts around the placeholders, and no marker file appears."""
    cwd = tmp_path / "cwd"
    folder = cwd / name
    folder.mkdir(parents=True)
    nasty_golden = folder / (name + ".h5")
    shutil.copy(golden, nasty_golden)
    tmpdir = cwd / ("tmp" + name)
    tmpdir.mkdir()
    env = dict(os.environ, TMPDIR=str(tmpdir))
    code, j, err = run_shrink(str(nasty_golden), planted(quote=quote), "--max-runs", "2", "--confirm", "1", env=env,
                              cwd=str(cwd))
    made = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f.startswith("MARKER")]
    assert made == []
    assert code == 0, err
    assert j["runs"] == 2 and j["smaller"] and j["smallest"]["diagnosis"] == ["chunk_order"] and j["confirmed"]
    assert os.listdir(tmpdir) == []  # the runs' folder was removed


# -- 4, 6, 12: the work folder ------------------------------------------------------------------------------------

@needs_cli
def test_work_dir_never_loses_what_was_there(golden, tmp_path):
    wd = tmp_path / "wd"
    (wd / "run-1").mkdir(parents=True)
    (wd / "run-1" / "precious.txt").write_text("mine")
    (wd / "run-2").mkdir()
    (wd / "run-2" / "candidate.h5").write_text("an old candidate")
    (wd / "shrink-1").mkdir()
    (wd / "shrink-1" / "notes.txt").write_text("mine too")
    code, j, err = run_shrink(golden, planted(), "--work-dir", str(wd), "--max-runs", "3", "--confirm", "0")
    assert code == 0, err
    assert sorted(os.listdir(wd)) == ["run-1", "run-2", "shrink-1"]  # nothing added is left, nothing there removed
    assert (wd / "run-1" / "precious.txt").read_text() == "mine"
    assert (wd / "run-2" / "candidate.h5").read_text() == "an old candidate"
    assert (wd / "shrink-1" / "notes.txt").read_text() == "mine too"
    # A folder this search created (with parents) is removed with it.
    fresh = tmp_path / "new" / "deeper"
    code, j, err = run_shrink(golden, planted(), "--work-dir", str(fresh), "--max-runs", "2", "--confirm", "0")
    assert code == 0, err
    assert not (tmp_path / "new").exists()


@needs_cli
def test_reused_keep_folder_never_checks_an_old_candidate(golden, tmp_path):
    wd = tmp_path / "kept"
    code, j, first_err = run_shrink(golden, planted(), "--work-dir", str(wd), "--keep", "--max-runs", "3",
                                    "--confirm", "0")
    assert code == 0, first_err
    # The same folder again, with a COMMAND that writes nothing: no candidate, whatever the folder holds.
    code, j, err = run_shrink(golden, "true {fixture} {candidate}", "--work-dir", str(wd), "--keep")
    assert code == 2 and "wrote no candidate" in j["error"]["message"], (code, j)
    # And with the planted bug: a search of its own (no "pass --force", an option shrink does not have).
    code, j, err = run_shrink(golden, planted(), "--work-dir", str(wd), "--keep", "--max-runs", "3", "--confirm", "0")
    assert code == 0, err
    assert "--force" not in err
    first = wd / "shrink-1"
    assert "kept in " + str(first) in first_err
    assert (first / "run-1" / "candidate.h5").exists() and (first / "run-2" / "fixture.h5").exists()
    assert (wd / "shrink-3" / "run-2" / "fixture.h5").exists()


# -- 5: a write that fails mid-search ------------------------------------------------------------------------------

def _file_size_limit(limit):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@needs_cli
def test_a_fixture_that_cannot_be_written_ends_the_search_with_its_answer(golden, tmp_path):
    """A file size limit of 400 kB: the original's candidate (142 kB) is written, the first step's fixture (587 kB)
    is not. The search stops there, says why, reports the original as the smallest so far and leaves nothing."""
    wd = tmp_path / "wd"
    wd.mkdir()
    code, j, err = run_shrink(golden, planted(), "--work-dir", str(wd), "--confirm", "0",
                              preexec_fn=_file_size_limit(400_000))
    assert code == 1, err
    assert j["stopped"] == "error"
    assert "cannot write the fixture of run 2" in j["stop_detail"] and "File too large" in j["stop_detail"]
    assert j["runs"] == 1 and not j["smaller"]
    assert j["smallest"]["case_json"] == j["original"]["case_json"]
    assert os.listdir(wd) == []
    code, text, err = run_shrink(golden, planted(), "--work-dir", str(wd), "--confirm", "0", fmt="text",
                                 preexec_fn=_file_size_limit(400_000))
    assert "no smaller case was tried: the search stopped before its first step (error: cannot write the fixture" \
           in text


@needs_cli
def test_a_run_folder_that_cannot_be_made_mid_search_keeps_the_steps_found(golden, tmp_path):
    """COMMAND's third run puts a file where the fourth run's folder goes: the search stops there with the two steps
    it kept, and removes what it created."""
    wd = tmp_path / "wd"
    wd.mkdir()
    count = tmp_path / "count"
    command = (f'echo x >> {count}; if [ "$(wc -l < {count})" -eq 3 ]; then touch "$(dirname {{candidate}})/../run-4"; '
               f"fi; {planted()}")
    code, j, err = run_shrink(golden, command, "--work-dir", str(wd), "--confirm", "1")
    assert code == 0, err
    assert j["stopped"] == "error" and "cannot create the folder of run 4" in j["stop_detail"]
    assert j["runs"] == 3 and len(j["steps"]) == 2 and j["smaller"]
    assert j["confirmed"]  # the confirmation run got a folder of its own
    assert any("stopped early" in n for n in j["notes"])
    assert os.listdir(wd) == []


# -- 7: signals and processes that leave their group ---------------------------------------------------------------

@needs_cli
def test_setsid_processes_end_with_the_run(golden, tmp_path):
    pids = tmp_path / "pids"
    escape = f"setsid sleep 1000 > /dev/null 2>&1 & echo $! >> {pids}; "
    try:
        code, j, err = run_shrink(golden, escape + planted(), "--max-runs", "2", "--confirm", "0")
        assert code == 0, err
        recorded = pids_in(pids)
        assert len(recorded) == 2 and not any(alive(p) for p in recorded)
        # A COMMAND killed at --run-timeout.
        code, j, err = run_shrink(golden, escape + "sleep 30 # {fixture} {candidate}", "--run-timeout", "0.3")
        assert code == 2 and "ran past --run-timeout" in j["error"]["message"]
        recorded = pids_in(pids)
        assert len(recorded) == 3 and not any(alive(p) for p in recorded)
    finally:
        end_leftovers(pids_in(pids))


@needs_cli
@pytest.mark.parametrize("which,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_command_and_reports_what_was_found(golden, tmp_path, which, code):
    """COMMAND's fourth run starts a process in a session of its own and then hangs: the signal to shrink ends both,
    removes the runs' folder and prints the smallest case found so far."""
    pids, count, tmpdir = tmp_path / "pids", tmp_path / "count", tmp_path / "tmp"
    tmpdir.mkdir()
    command = (f'echo x >> {count}; if [ "$(wc -l < {count})" -eq 4 ]; then '
               f"setsid sleep 1000 > /dev/null 2>&1 & echo $! >> {pids}; "
               f"sh -c 'echo $$ >> {pids}; exec sleep 1000'; fi; {planted()}")
    p = subprocess.Popen([BIN, "shrink", golden, "--run", command, "--format", "json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, TMPDIR=str(tmpdir)))
    try:
        deadline = time.monotonic() + 60
        while len(pids_in(pids)) < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert len(pids_in(pids)) == 2, p.stderr.read() if p.poll() is not None else "COMMAND did not hang"
        p.send_signal(which)
        out, err = p.communicate(timeout=30)
        assert p.returncode == code, err
        j = json.loads(out)
        assert j["stopped"] == "interrupted" and j["exit_code"] == code
        assert signal.Signals(which).name in j["stop_detail"]
        assert j["runs"] == 3 and j["smaller"] and j["smallest"]["diagnosis"] == ["chunk_order"]
        assert not any(alive(pid) for pid in pids_in(pids))
        assert os.listdir(tmpdir) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        end_leftovers(pids_in(pids))


# -- 10: flaky implementations -------------------------------------------------------------------------------------

@needs_cli
def test_a_failure_that_fades_is_not_presented_as_minimal(golden, tmp_path):
    """COMMAND fails the same way in its first 4 runs only, then passes: nothing reproduces, not even the original:
    exit 4, saying so, and no smaller case presented."""
    count = tmp_path / "count"
    command = (f'echo x >> {count}; if [ "$(wc -l < {count})" -le 4 ]; then {planted()}; '
               "else cp {fixture} {candidate}; fi")
    code, j, err = run_shrink(golden, command, "--max-runs", "5", "--confirm", "1")
    assert code == 4, err
    assert j["not_reproduced"] and j["flaky"] and not j["confirmed"]
    assert not j["smaller"] and j["smallest"]["case_json"] == j["original"]["case_json"]
    assert j["search_smallest"] != j["original"]["case_json"]
    # every case kept, from the search's smallest back to the original, rerun once: none failed
    assert len(j["confirmations"]) >= 2
    assert all((c["reruns"], c["failed_same_way"]) == (1, 0) for c in j["confirmations"])
    assert j["confirmations"][-1]["original"] and j["confirmations"][-1]["which"] == "the original"
    assert j["confirmations"][0]["which"] == "the search's smallest"
    # Python's door, the same rule on a callable that fades the same way.
    needs_core()
    calls = []

    def fn(fx):
        calls.append(1)
        out = {"o": fx.golden("o"), "lse": fx.golden("lse")}
        if len(calls) <= 4:
            out["o"][:, [0, 1]] = out["o"][:, [1, 0]]
            out["lse"][[0, 1]] = out["lse"][[1, 0]]
        return out
    py = cpgold.shrink(START, fn, tensors=("o", "lse"), lse_layout="ht", max_runs=5, confirm=1)
    assert py["not_reproduced"] and py["flaky"] and not py["confirmed"] and not py.smaller
    assert py["smallest"] == py["original"]
    assert len(py["confirmations"]) >= 2
    assert all((c["reruns"], c["failed_same_way"]) == (1, 0) for c in py["confirmations"])
    assert py["confirmations"][0]["which"] == "the search's smallest"
    assert py["confirmations"][-1]["which"] == "the original" and py["confirmations"][-1]["original"]
    assert sorted(py) == sorted(set(py) | {"confirm", "confirmed", "flaky", "not_reproduced", "search_smallest",
                                          "confirmations", "confirmation_runs", "confirmation_stopped", "notes",
                                          "stop_detail"})
    assert "the failure does not reproduce" in str(py)


@needs_cli
def test_a_flaky_small_case_gives_way_to_one_that_reproduces(golden, tmp_path):
    """Fixtures from 200 kB up fail every time; smaller ones on every other run only. The search keeps a small case
    once; its confirmation fails, and the answer falls back to the last case that reproduces, from 200 kB up."""
    count = tmp_path / "count"
    command = (f'echo x >> {count}; if [ $(stat -c %s {{fixture}}) -ge 200000 ] || [ $(( $(wc -l < {count}) % 2 )) '
               f"-eq 1 ]; then {planted()}; else cp {{fixture}} {{candidate}}; fi")
    code, j, err = run_shrink(golden, command, "--max-runs", "7")
    assert code == 0, err
    small = str(tmp_path / "answer.h5")
    subprocess.run([BIN, "gen", "--case", j["smallest"]["case_json"], "-o", small], check=True, capture_output=True)
    assert os.path.getsize(small) >= 200000
    assert j["confirmed"] and j["flaky"] and not j["not_reproduced"]
    assert j["search_smallest"] != j["smallest"]["case_json"]
    assert j["confirmations"][0]["failed_same_way"] < j["confirmations"][0]["reruns"] == 2
    assert j["confirmations"][-1]["failed_same_way"] == 2


# -- 11: output, budget, diagnosis ---------------------------------------------------------------------------------

@needs_cli
def test_command_output_is_capped(golden, tmp_path):
    wd = tmp_path / "wd"
    command = f"head -c 20000000 /dev/zero | tr '\\000' x; {planted()}"
    code, j, err = run_shrink(golden, command, "--work-dir", str(wd), "--keep", "--max-runs", "1", "--confirm", "0")
    assert code == 1, err
    logs = [os.path.join(d, "command.log") for d, _, files in os.walk(wd) if "command.log" in files]
    assert len(logs) == 1
    log = open(logs[0]).read()
    assert len(log) < 2 * 64 * 1024 + 200
    assert log.startswith("x" * 1000) and log.endswith("x" * 1000)
    assert f"[cpgold shrink: {20000000 - 2 * 64 * 1024} bytes of output left out here" in log


@needs_cli
def test_budget_covers_generation_and_check(long_golden):
    """A step of LONG takes a second or two to generate and check: with 0.5 s of the budget left after the original,
    it is not started (a budget looked at only before each run would start it and end a second or more past it)."""
    code, j, err = run_shrink(long_golden, planted(), "--max-runs", "1", "--confirm", "0")
    assert code == 1, err
    budget = j["seconds"] + 0.5
    start = time.monotonic()
    code, j, err = run_shrink(long_golden, planted(), "--budget", f"{budget:.2f}", "--confirm", "0")
    took = time.monotonic() - start
    assert j["stopped"] == "budget", err
    # No step started, or the one started was cut at the budget (the original's run is never cut).
    assert j["runs"] == 1 or j["seconds"] < budget + 0.3, (j["runs"], j["seconds"], budget, took)


@needs_cli
def test_diagnosis_replay_respects_its_budget(long_golden, tmp_path):
    """One replay of a mistake on LONG's one sequence takes about 0.1 s: under a 0.03 s budget none is started, the
    first one included, and the report names them with the estimate."""
    candidate = str(tmp_path / "c.h5")
    subprocess.run([PLANTED, long_golden, candidate, "chunk_order", "0", "0"], check=True, capture_output=True)
    p = subprocess.run([BIN, "check", long_golden, candidate, "--diagnosis-budget", "0.03", "--format", "json"],
                       capture_output=True, text=True)
    assert p.returncode == 1, p.stderr
    report = json.loads(p.stdout)
    not_tested = report["diagnosis"][-1]["where"]["not_tested"]
    replay = [t for t in not_tested if t.startswith("replay of")]
    # even the first mistake of the catalogue was not started, its estimated time named
    assert replay and re.match(r"replay of \d+ mistakes past the diagnosis budget, or expected to take longer than "
                               r"was left of it \([a-z_]+ \(about [0-9.e-]+ s\)", replay[0]), not_tested


# -- 12: wording and seeds -----------------------------------------------------------------------------------------

@needs_cli
def test_a_search_stopped_before_its_first_step_says_so(golden):
    code, text, err = run_shrink(golden, planted(), "--max-runs", "1", "--confirm", "0", fmt="text")
    assert code == 1, err
    assert "already minimal" not in text
    assert "no smaller case was tried: the search stopped before its first step (max_runs: the 1 runs of " \
           "--max-runs were made)" in text


@needs_cli
@pytest.mark.parametrize("seed", ["-1", "18446744073709551616", "1.5", "x"])
def test_out_of_range_seeds_are_refused(golden, seed):
    code, j, err = run_shrink(golden, planted(), f"--seed={seed}", "--max-runs", "1")
    assert code == 2
    assert j["error"]["field"] == "--seed" and f'"{seed}"' in j["error"]["message"]
    code, j, err = run_shrink(golden, planted(), "--confirm=-1", "--max-runs", "1")
    assert code == 2 and j["error"]["field"] == "--confirm"


def test_python_seeds_confirm_and_run_timeout_are_checked():
    needs_core()
    for seed in (-1, 2 ** 64, True, 1.5):
        with pytest.raises(cpgold.InputError, match="seed") as e:
            cpgold.shrink(START, lambda fx: None, seed=seed)
        assert e.value.field == "seed"
    for name, value in (("confirm", -1), ("run_timeout", 0), ("run_timeout", float("nan"))):
        with pytest.raises(cpgold.InputError, match=name):
            cpgold.shrink(START, lambda fx: None, **{name: value})


def swapped(fx):
    out = {"o": fx.golden("o"), "lse": fx.golden("lse")}
    out["o"][:, [0, 1]] = out["o"][:, [1, 0]]
    out["lse"][[0, 1]] = out["lse"][[1, 0]]
    return out


def test_python_run_timeout_stops_the_search_and_keeps_its_answer():
    """fn hangs (20 s) once the case has a single KV head: the run past run_timeout counts as no candidate, the search
    stops there saying fn was left running, and the answer is the smallest case found before."""
    needs_core()
    calls = []
    release = threading.Event()

    def fn(fx):
        calls.append(fx.heads_kv)
        if fx.heads_kv == 1:
            release.wait(20)
        return swapped(fx)
    start = time.monotonic()
    try:
        r = cpgold.shrink(START, fn, tensors=("o", "lse"), lse_layout="ht", run_timeout=0.5)
        took = time.monotonic() - start
    finally:
        # the hanging fn is released once the search gave up on it, so that no thread of this test outlives it (one
        # waking inside a finalized interpreter would crash the process after the tests reported)
        release.set()
        for t in threading.enumerate():
            if t.name == "cpgold.shrink fn":
                t.join(5)
    assert took < 15  # not waiting for fn
    assert r["stopped"] == "run_timeout" and "still running" in r["stop_detail"]
    assert r["runs"] == len(calls) and r["no_candidate"] == 1
    assert r.smaller and r.case["heads_kv"] == 2 and r["smallest_verdict"]["status"] == "fails"
    assert any("stopped early (run_timeout" in n for n in r["notes"])
    assert not r["confirmed"] and r["confirmation_runs"] == 0


def test_python_budget_covers_a_whole_run():
    """Every run takes 0.6 s: after the original, with 0.4 s of a 1 s budget left, no step is started (where the
    budget looked at only before each run would start it, and end 0.2 s past the budget)."""
    needs_core()

    def fn(fx):
        time.sleep(0.6)
        return swapped(fx)
    r = cpgold.shrink(START, fn, tensors=("o", "lse"), lse_layout="ht", budget=1.0)
    assert r["runs"] == 1 and r["stopped"] == "budget"  # the confirmation runs come after the search
    assert "no smaller case was tried: the search stopped before its first step (budget" in str(r)


def test_python_confirmation_falls_back_like_the_command():
    """The rule of the command's confirmation on a callable: fails every time with CP (cp_size > 1), without it on
    every other call only. The search keeps cp_size 1 once; its confirmation fails (1 of 2) and the answer falls back
    to the case before, with CP, which fails in both reruns."""
    needs_core()
    calls = []

    def fn(fx):
        calls.append(1)
        if fx.cp_size > 1 or len(calls) % 2 == 0:
            return swapped(fx)
        return {"o": fx.golden("o"), "lse": fx.golden("lse")}
    seen = []
    r = cpgold.shrink(START, fn, tensors=("o", "lse"), lse_layout="ht", progress=seen.append)
    assert r.case["cp_size"] == 2
    assert r["confirmed"] and r["flaky"] and not r["not_reproduced"]
    assert json.loads(r["search_smallest"])["cp_size"] == 1
    assert [(c["which"], c["reruns"], c["failed_same_way"]) for c in r["confirmations"]] == \
           [("the search's smallest", 2, 1), (f"step {len(r['steps'])}", 2, 2)]
    assert r["steps"][-1] != "cp_size 2 -> 1"
    confirmation_events = [p for p in seen if p["change"].startswith("confirmation ")]
    assert len(confirmation_events) == r["confirmation_runs"] == 4
    assert r["report"] is not None and not r["report"].passed
    assert "smallest failing case (confirmed)" in str(r)
