"""The in-process and isolated runs of the harness (harness.py): an adapter over fixtures, every result checked
with cpgold's engine, the verdicts tabulated.

For each fixture: the adapter's `unsupported` (not expressible in its API) or its run; the outputs go into one
candidate file (global outputs at the root, their shards by the partition or the ranks' own outputs under
/ranks/<r>/), and harness.judge reaches the verdict of both levels with the adapter's pad-row convention. Results are
appended to a JSON-lines file as they come, so a crash of the implementation (a device-side assert) loses only the
fixture it was running: with isolation the fixtures run in a child process that is restarted after the fixture that
killed it (harness.py, "faults").
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

from ..candidate import lse_to_ht, write_ranks
from ..check import failures, ratios
from ..fixture import Fixture
from .adapter import Refused
from .environment import digest, process_versions
from .harness import (CONTEXT_LOST, context_lost, crash_entry, describe_entry, exit_text, judge, lse_convention,
                      read_results)


def _numpy(x):
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def run_and_write(adapter, path, suite, candidate):
    """Runs the adapter on one fixture and writes its candidate file (global outputs at the root, the ranks' outputs
    or the global outputs' shards under /ranks/<r>/). Returns the summary entry so far; its "status" is set only
    when nothing was written (unsupported, error)."""
    entry = {"fixture": os.path.basename(path), "suite": suite}
    with Fixture(path) as fx:
        describe_entry(entry, fx)
        reason = adapter.unsupported(fx)
        if reason:
            entry.update(status="unsupported", reason=reason)
            return entry
        try:
            outcome = adapter.run(fx)
        except Refused as e:
            entry.update(status="unsupported", reason=str(e)[:2000])
            return entry
        except Exception as e:  # noqa: BLE001 - a crash on an expressible case is a result of its own
            entry.update(status="error", reason=f"{type(e).__name__}: {e}"[:2000],
                         trace=traceback.format_exc()[-4000:])
            return entry
        entry.update(backend=outcome.backend, log=outcome.log, notes=outcome.notes)
        outputs = {k: _numpy(v) for k, v in (outcome.outputs or {}).items()}
        convention = "neg-inf"
        if "lse" in outputs:
            outputs["lse"] = lse_to_ht(outputs["lse"], fx.heads_q, "ht" if outputs["lse"].shape[0] == fx.heads_q
                                       else None)
            convention = lse_convention(fx, outputs["lse"])
        ranks = [{k: _numpy(v) for k, v in r.items()} for r in outcome.rank_outputs] if outcome.rank_outputs \
            else fx.shard_outputs(outputs)
        tensors = adapter.tensors or tuple(n for n in ("o", "lse", "dq", "dk", "dv") if n in outputs)
        entry.update(tensors=list(tensors), empty_row_lse=convention, pad_rows=adapter.pad_rows)
        write_ranks(candidate, ranks, outputs or None, scope=outcome.scope, fixture=fx, lse_layout="ht")
    return entry


def run_fixture(adapter, path, suite, workdir, cpgold_bin=None):
    """One fixture: run, write the candidate, check. Returns the summary entry."""
    t0 = time.time()
    candidate = os.path.join(workdir, f"{adapter.name}_{os.getpid()}_candidate.h5")
    if os.path.exists(candidate):  # the runner's own scratch file, left by a process of the same pid that died
        os.remove(candidate)
    entry = run_and_write(adapter, path, suite, candidate)
    if "status" in entry:
        return entry
    tensors, convention = entry["tensors"], entry["empty_row_lse"]
    try:
        verdict = judge(path, {"candidate": [candidate]}, tensors, convention, adapter.pad_rows, cpgold_bin)
        report = verdict.reports["candidate"]
        entry.update(failures=failures(report), ratios=[list(r) for r in ratios(report)],
                     diagnosis=[d.get("kind") for d in report.get("diagnosis", [])],
                     unwritten_nonzero=sum(r.get("unwritten_nonzero", 0) for r in report["results"]),
                     unwritten_nonfinite=sum(r.get("unwritten_nonfinite", 0) for r in report["results"]))
        if verdict.valid_rows_pass is not None:
            entry["valid_rows_pass"] = verdict.valid_rows_pass
        entry["status"] = verdict.status
    finally:
        if os.path.exists(candidate):
            os.remove(candidate)
    entry["seconds"] = round(time.time() - t0, 2)
    return entry


def report_line(adapter_name, e):
    line = f"{adapter_name:8} {e['suite']:10} {e['fixture']:48} {e.get('comm', '?'):10} W={e.get('cp_size', '?')} " \
           f"{e['status']}"
    if e["status"] in ("pass", "fail"):
        worst = max((max(r[2], r[3]) for r in e.get("ratios", [])), default=float("nan"))
        line += f" worst {worst:.3f}"
        if e["status"] == "fail" and "valid_rows_pass" in e:
            line += " (valid rows pass: pad rows only)" if e["valid_rows_pass"] else " (valid rows fail)"
    elif e.get("reason"):
        line += ": " + e["reason"].splitlines()[0][:200]
    return line


def worker(adapter, items, results, workdir, cpgold_bin, skip=0, echo=True, child=False, versions=None,
           expected=None):
    """Runs items[skip:], one JSON line each, flushed. child: a worker process of isolated(), which exits with
    CONTEXT_LOST after a fixture that left the CUDA context unusable. Every line names the versions of the process
    that ran it by their digest (`versions`, else this process's own: environment.process_versions); when that
    digest is not `expected` (the one the run recorded) the line holds the versions in full as well."""
    own = versions if versions is not None else process_versions(adapter)
    tag = {"versions_digest": digest(own)}
    if expected is not None and tag["versions_digest"] != expected:
        tag["versions"] = own
    with open(results, "a") as out:
        for suite, path in items[skip:]:
            e = run_fixture(adapter, path, suite, workdir, cpgold_bin)
            e.update(tag)
            out.write(json.dumps(e, default=str) + "\n")
            out.flush()
            if echo:
                print(report_line(adapter.name, e), flush=True)
                for f in e.get("failures", [])[:6]:
                    print(f"    {f}", flush=True)
            if child and e["status"] == "error" and context_lost(e.get("reason", "") + e.get("trace", "")):
                sys.stdout.flush()
                os._exit(CONTEXT_LOST)


def run_child(argv):
    """(exit code, stderr) of a child whose stdout lines are passed on as they come: a fixture's verdict shows while
    the child goes on with the next, and a run stopped from outside has printed what it finished."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
        code = proc.wait()
        err.seek(0)
        return code, err.read()


def isolated(child_argv, items, results, versions_digest=None):
    """Runs the fixtures in child processes (child_argv + --worker --skip N), restarting after a crash, which is
    recorded as an error of the fixture that was running (with `versions_digest`, the run's: the child that died
    was started with its command and environment). RESULTS may hold entries of an earlier run (--resume): the
    children's entries follow them."""
    before, done = len(read_results(results)), 0
    while done < len(items):
        code, stderr = run_child(child_argv + ["--worker", "--skip", str(done), "--results", results])
        done = len(read_results(results)) - before
        if code == CONTEXT_LOST:  # the fixture that broke the CUDA context is recorded already
            continue
        if code != 0 and done < len(items):
            suite, path = items[done]
            # faulthandler's stack of the crash is the part worth keeping; its list of extension modules is not
            tail = "\n".join(ln for ln in stderr.splitlines() if "Warning" not in ln and "warnings.warn" not in ln
                             and not ln.startswith("Extension modules:"))
            e = crash_entry(suite, os.path.basename(path),
                            f"the process died ({exit_text(code)}) running this fixture: {tail[-1500:]}")
            if versions_digest:
                e["versions_digest"] = versions_digest
            with Fixture(path) as fx:
                describe_entry(e, fx)
            with open(results, "a") as f:
                f.write(json.dumps(e, default=str) + "\n")
            print(report_line("child", e), flush=True)
            done += 1
