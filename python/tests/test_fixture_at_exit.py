"""A fixture held in memory (cpgold.generate without a path) that is still open when the program ends: the process
exits with its own status. HDF5 closes the files still open from its exit handler, after Python is gone; a fixture
read through a Python file object had it call back into Python there and crash the process (exit 139) after the
program's work was done (a daemon thread holding the fixture is the simplest way to keep it open that long)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("cpgold._core", reason="needs cpgold's extension (cpgold.generate in process)")

PROGRAM = textwrap.dedent("""
    import threading, time
    import cpgold
    fx = cpgold.generate({"seqlens_q": [9, 5], "cp_size": 2, "heads_q": 2, "heads_kv": 1, "dim_qk": 16})
    assert fx.path == "<fixture in memory>"
    assert fx.golden("o").shape[1:] == (2, 16)
    threading.Thread(target=lambda held=fx: time.sleep(60), daemon=True).start()
    print("work done", flush=True)
    raise SystemExit(EXIT)
""")


@pytest.mark.parametrize("status", [0, 3])
def test_an_open_in_memory_fixture_does_not_crash_the_exit(status):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    p = subprocess.run([sys.executable, "-c", PROGRAM.replace("EXIT", str(status))], capture_output=True, text=True,
                       env=env, timeout=120)
    assert "work done" in p.stdout, p.stderr
    assert p.returncode == status, f"exit {p.returncode} (expected {status}): {p.stderr[-2000:]}"
