"""From a case whose outputs fail their check to the smallest case that fails the same way (docs/shrink.md).

`cpgold.shrink(case, fn)` runs the search of `cpgold shrink` (the same C++ reducer, so the same steps in the same
order) with a Python callable instead of a command: every step generates the candidate case's fixture in memory,
calls `fn(fixture)` and checks what it returns with the engine of `cpgold check`. The answer is then confirmed as
`cpgold shrink` confirms it (`confirm` reruns; check/shrink.hpp, confirm_smallest).
"""
import json
import math
import numbers
import os
import threading
import time

from ._core_loader import core
from .cases import _case_text, generate, normalize_case
from .check import check_outputs
from .errors import CheckInputError, InputError
from .fixture import OUTPUT_NAMES, Fixture

_SEED_MAX = 2 ** 64 - 1
# Diagnosis kinds that say what the outputs show, not a cause: they may come and go with the padding and the pad fill.
_SYMPTOMS = ("pad_rows_not_zero", "nonfinite_leak")


def _same_way(kinds, original_kinds, found, status="fails"):
    """check/shrink.cpp's shrink_same_way (without the tensors): a failure naming every kind of `kinds` and, unless
    any failure is kept (`kinds` empty), no cause kind the original's diagnosis does not name."""
    if status != "fails" or not all(k in found for k in kinds):
        return False
    return not kinds or all(k in _SYMPTOMS or k in original_kinds for k in found)


def _name_note(kinds, before, after):
    """check/shrink.cpp's shrink_name_note: why the smallest case's diagnosis (after) is not the original's (before),
    or "" where it names the same kinds."""
    def text(items):
        return ", ".join(items) or "no diagnosis"

    symptoms, not_required, other = [], [], []
    for k in before:
        if k not in after:
            (symptoms if k in _SYMPTOMS else other if k in kinds else not_required).append(k)
    for k in after:
        if k not in before:
            (symptoms if k in _SYMPTOMS else other).append(k)
    if not (symptoms or not_required or other):
        return ""
    why = []
    if not kinds:
        why.append("any failure was kept, whatever its diagnosis (any failure)")
    else:
        if symptoms:
            many = len(symptoms) > 1
            why.append(text(symptoms) + (" are symptoms, which come and go" if many else
                                         " is a symptom, which comes and goes") + " with the padding and the pad fill")
        if not_required:
            why.append(text(not_required) + (" were" if len(not_required) > 1 else " was") +
                       f" not required (a kept failure names {text(kinds)})")
        if other:
            why.append(f"the kinds {text(other)} changed")
    return f"the smallest case's diagnosis ({text(after)}) is not the original's ({text(before)}): " + "; ".join(why)


def headline(result):
    """What a search's answer is, in words, from its result (a ShrinkResult, or the dict that capture.shrink and
    `cpgold shrink --format json` give): "smallest failing case (confirmed)", "the original is already minimal", ..."""
    stop = result["stopped"] + (f": {result['stop_detail']}" if result.get("stop_detail") else "")
    if result.get("not_reproduced"):
        return ("the failure does not reproduce: no case of the search, the original included, failed the same "
                "way in every confirmation run (flaky); the original")
    if result["steps"]:
        return ("smallest failing case" + (" (confirmed)" if result.get("confirmed") else
                                           " (not confirmed)" if result.get("confirm") else ""))
    if result.get("flaky"):
        return "no smaller case failed the same way in every confirmation run (flaky); the original"
    if result["stopped"] == "minimal":
        return "the original is already minimal"
    if result["runs"] <= 1:
        return f"no smaller case was tried: the search stopped before its first step ({stop}); the original"
    return f"no smaller case failed the same way before the search stopped ({stop}); the original"


class ShrinkResult(dict):
    """What the search found (a dict, as `cpgold shrink --format json` gives it, plus the report of the smallest):
    original / smallest (case JSON text, as `cpgold gen --case` takes it), kinds, steps, runs, passed,
    failed_otherwise, no_candidate, seconds, stopped ("minimal", "budget", "max_runs", "run_timeout"), stop_detail,
    confirm, confirmed, flaky, not_reproduced, search_smallest, confirmations, confirmation_runs,
    confirmation_stopped, notes, report (the check report of the smallest case's outputs), reproduce."""

    @property
    def smaller(self):
        return bool(self["steps"])

    @property
    def case(self):
        """The smallest failing case as a dict."""
        return json.loads(self["smallest"])

    def headline(self):
        return headline(self)

    def __str__(self):
        lines = [f"{self.headline()} ({self['rows_q']} q rows, {self['tokens_q']} tokens; "
                 f"{len(self['steps'])} steps kept, {self['runs']} runs in {self['seconds']:.1f} s, "
                 f"stopped: {self['stopped']}):", self["smallest"]]
        lines += [f"note: {n}" for n in self.get("notes", [])]
        lines += ["steps kept:"] + [f"  {s}" for s in self["steps"]] if self["steps"] else []
        if self.get("confirmations"):
            lines.append(f"confirmation ({self['confirm']} reruns of each case):")
            for c in self["confirmations"]:
                lines.append(f"  {c['which']} ({c['rows_q']} q rows) failed the same way in {c['failed_same_way']} of "
                             f"{c['reruns']} reruns")
        if self.get("report") is not None:
            lines.append(self["report"].text)
        lines.append(f"reproduce: {self['reproduce']}")
        return "\n".join(lines)


def _given_inputs_refused(fx, name):
    """A fixture of given inputs holds a run's tensors (a captured call's, say); the search makes every case with
    seeded inputs, so it would shrink the case without those values: such a start is refused, as `cpgold shrink`
    refuses it."""
    if fx.inputs_source == "given":
        raise InputError(f"start: the fixture {name} was made from given inputs (inputs_source \"given\": its inputs "
                         "are a run's tensors, such as a captured call's), and shrink searches over cases with seeded "
                         "inputs, which would drop those values; to shrink a captured call keeping its values use "
                         "cpgold.capture.shrink(call_dir, fn) or `python3 -m cpgold.capture shrink CALL_DIR --run "
                         "\"COMMAND {fixture} {candidate}\"` (docs/capture.md, shrink)", "start")


def _start_case(start):
    if isinstance(start, Fixture):
        _given_inputs_refused(start, repr(start.source) if isinstance(start.source, str) else "in memory")
        return start.case_json
    if isinstance(start, (str, os.PathLike)) and not str(start).lstrip().startswith("{") and os.path.exists(start):
        with Fixture(start) as fx:
            _given_inputs_refused(fx, repr(os.fspath(start)))
            return fx.case_json
    return _case_text(start)


def _count(name, value, low=0, high=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or \
            (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise InputError(f"{name}: expected an integer {bound}, got {value!r}", name)
    return value


def _rows_q(case_json):
    return normalize_case(json.loads(case_json))["total_tokens_q"]


def _tokens_q(case_json):
    return sum(json.loads(case_json)["seqlens_q"])


def shrink(start, fn, *, kind=None, any_failure=False, same_tensors=False, budget=None, max_runs=None, reseed=0, seed=0,
           dims=None, trace=False, scope="global", tensors=None, empty_row_lse=None, lse_layout=None, progress=None,
           pad_rows=None, confirm=2, run_timeout=None):
    """Searches for the smallest case whose outputs fail the same way as those of `start`.

    start: a case (dict or JSON text), a Fixture or the path of a fixture (its case). A fixture of given inputs
    (inputs_source "given": a run's tensors) is refused (InputError naming start): the search makes seeded inputs;
    cpgold.capture.shrink cuts a captured call's tensors instead.
    fn(fixture) -> outputs: a dict of o, lse, dq, dk, dv in the global layout (checked with `scope`), or a list of
    every rank's dicts in the rank-local layout. An exception, None or outputs the check cannot use count as
    "no candidate", never as a pass.
    kind: a diagnosis kind (or a list) every kept failure must name; default: the kinds of the original's failure.
    any_failure: keep any failure. same_tensors: keep a failure only when it fails exactly the tensors the
    original fails (for a wide diagnosis such as "unexplained", under which a smaller case can fail another way).
    budget (seconds: generation, fn and check included; a step whose estimated time does not fit what is left is not
    started) and max_runs bound the search (the original's run included).
    reseed: a smaller case that passes is tried again with that many other input seeds (drawn from `seed`, an integer
    from 0 to 2**64 - 1).
    confirm: the answer is run again this many times (default 2; 0: none); a case that does not fail the same way
    every time gives way to the case before it, back to the original (result: confirmed, flaky, not_reproduced,
    confirmations). The confirmation runs are not bounded by budget or max_runs.
    run_timeout (seconds, None: no limit): fn runs in a worker thread; one still running after run_timeout counts as
    no candidate, and since a Python callable cannot be stopped it is left running (a daemon thread) and the search
    stops there (stopped "run_timeout"): the smallest case so far is the answer.
    dims: the head dims fn supports (default any). trace: generate traced fixtures. pad_rows: "unwritten" for an
    implementation that leaves pad rows unwritten (FlashAttention-3/4), as for check().
    progress: called with a dict after every run (run, seconds, change, case, verdict, kept, smallest).
    Raises InputError when the original does not fail (or gives no candidate)."""
    began = time.monotonic()
    reports = {}
    kinds = [kind] if isinstance(kind, str) else list(kind or [])
    if any_failure and kinds:
        raise InputError("kind: cannot be combined with any_failure: give one of them", "kind")
    for name, value in (("budget", budget), ("max_runs", max_runs)):
        if value is not None and not value >= 0:
            raise InputError(f"{name}: expected a value >= 0 (None: no bound), got {value!r}", name)
    _count("seed", seed, 0, _SEED_MAX)
    _count("reseed", reseed)
    _count("confirm", confirm)
    if run_timeout is not None and (isinstance(run_timeout, bool) or not isinstance(run_timeout, (int, float))
                                    or not math.isfinite(run_timeout) or run_timeout <= 0):
        raise InputError(f"run_timeout: expected seconds > 0 (None: no limit), got {run_timeout!r}", "run_timeout")

    # A run past run_timeout stops the search: the reducer is then answered "no candidate" at once, without running
    # anything, until it ends; those answers are taken out of the counts below.
    state = {"stopped": None, "detail": "", "not_run": 0, "confirming": False}

    def call(fixture):
        if run_timeout is None:
            return fn(fixture), True
        box = {}

        def work():
            try:
                box["outputs"] = fn(fixture)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e

        worker = threading.Thread(target=work, name="cpgold.shrink fn", daemon=True)
        worker.start()
        worker.join(run_timeout)
        if worker.is_alive():
            return None, False
        if "error" in box:
            raise box["error"]
        return box["outputs"], True

    def runner(case_json, run):
        if state["stopped"]:
            state["not_run"] += 1
            return ("no_candidate", [], "not run: the search stopped")
        fixture = generate(json.loads(case_json), trace=trace)
        finished = True
        try:
            try:
                outputs, finished = call(fixture)
            except Exception as e:  # the implementation under test failed: no candidate
                return ("no_candidate", [], f"fn raised {type(e).__name__}: {e}")
            if not finished:
                state["stopped"] = "run_timeout"
                state["detail"] = (f"fn was still running after run_timeout {run_timeout:g} s (run {run}); a Python "
                                   "callable cannot be stopped, so it was left running in a daemon thread")
                return ("no_candidate", [], state["detail"])
            if outputs is None:
                return ("no_candidate", [], "fn returned None")
            try:
                report = check_outputs(fixture, outputs, scope=scope, tensors=tensors, empty_row_lse=empty_row_lse,
                                       lse_layout=lse_layout, pad_rows=pad_rows)
            except (InputError, CheckInputError) as e:
                return ("no_candidate", [], f"the outputs are unusable: {e}")
            if report.passed:
                return ("passes", [], "check passed")
            kinds_found = [d["kind"] for d in report.get("diagnosis", [])]
            reports[case_json] = report
            failing = {r["tensor"] for r in report["results"] if not r.get("pass")}
            return ("fails", kinds_found, "check failed: " + (", ".join(kinds_found) or "no diagnosis"),
                    [t for t in OUTPUT_NAMES if t in failing])
        finally:
            if finished:  # a fn still running keeps its fixture
                fixture.close()

    kept = []  # (case JSON, verdict) of every step kept, in order: what the confirmation walks back through

    def on_progress(p):
        if state["stopped"] and p["verdict"]["detail"] == "not run: the search stopped":
            return
        if p["kept"]:
            kept.append((p["case"], p["verdict"]))
        if progress is not None:
            progress(p)

    result = core().shrink(_start_case(start), runner, kinds, bool(any_failure), float(budget or 0),
                           int(max_runs or 0), int(reseed), int(seed), [int(d) for d in (dims or [])], on_progress,
                           bool(same_tensors))
    out = ShrinkResult(result)
    out["runs"] -= state["not_run"]
    out["no_candidate"] -= state["not_run"]
    if not out["original_fails"]:
        verdict = out["original_verdict"]
        if verdict["status"] == "passes":
            raise InputError("start: the outputs of the original case pass their check: there is no failure to "
                             "shrink", "start")
        raise InputError(f"fn: no candidate for the original case ({verdict['detail']})", "fn")
    if state["stopped"]:
        out["stopped"], out["stop_detail"] = state["stopped"], state["detail"]
    elif out["stopped"] == "budget":
        out["stop_detail"] = (f"the budget of {budget:.1f} s was spent, or the next run's estimated time did not fit "
                              "what was left")
    elif out["stopped"] == "max_runs":
        out["stop_detail"] = f"the {max_runs} runs of max_runs were made"
    else:
        out["stop_detail"] = ""
    _confirm(out, runner, confirm, kept if len(kept) == len(out["steps"]) else None, progress, state,
             lambda: time.monotonic() - began)
    out["seconds"] = time.monotonic() - began
    if out["stopped"] != "minimal" and (out.smaller or out["not_reproduced"]):
        out["notes"].insert(0, f"the search stopped early ({out['stopped']}: {out['stop_detail']}): this is the "
                               "smallest failing case found so far")
    if out["smallest_verdict"]["status"] == "fails":
        note = _name_note(out["kinds"], out["original_verdict"]["kinds"], out["smallest_verdict"]["kinds"])
        if note:
            out["notes"].append(note)
    out["rows_q"], out["tokens_q"] = _rows_q(out["smallest"]), _tokens_q(out["smallest"])
    out["report"] = reports.get(out["smallest"])
    out["reproduce"] = f"cpgold gen --case '{out['smallest']}' -o case.h5"
    return out


def _confirm(out, runner, confirm, kept, progress, state, seconds):
    """The confirmation of `cpgold shrink` (check/shrink.cpp, confirm_smallest) over the runner: the search's answer
    rerun `confirm` times, and while a case does not fail the same way every time, the case before it."""
    out.update(confirm=confirm, confirmed=False, flaky=False, not_reproduced=False, search_smallest=out["smallest"],
               confirmations=[], confirmation_runs=0, confirmation_stopped="", notes=[])
    if confirm == 0 or state["stopped"]:
        if state["stopped"] and confirm:
            out["notes"].append(f"not confirmed: {state['stopped']}")
        return
    if kept is None:  # the steps could not be followed back: the answer alone, then the original
        kept = [(out["smallest"], out["smallest_verdict"])] if out["steps"] else []
        out["steps"] = out["steps"][:len(kept)]

    def same_way(v):
        if not _same_way(out["kinds"], out["original_verdict"]["kinds"], v[1], v[0]):
            return False
        tensors = list(v[3]) if len(v) > 3 else []
        return not out["same_tensors"] or tensors == list(out["original_verdict"]["tensors"])

    for i in range(len(kept) - 1, -2, -1):
        original = i < 0
        case = out["original"] if original else kept[i][0]
        which = "the original" if original else "the search's smallest" if i == len(kept) - 1 else f"step {i + 1}"
        c = {"case_json": case, "rows_q": _rows_q(case), "original": original, "reruns": 0, "failed_same_way": 0,
             "which": which}
        for k in range(1, confirm + 1):
            number = out["runs"] + out["confirmation_runs"] + 1
            v = runner(case, number)
            if state["stopped"]:  # fn ran past run_timeout: the answer stays the search's, unconfirmed
                out["confirmation_stopped"] = state["stopped"]
                out["stop_detail"] = state["detail"]
                out["notes"].append(f"the confirmation runs stopped early ({state['stopped']}: {state['detail']}): "
                                    "the answer is not confirmed")
                if c["reruns"]:
                    out["confirmations"].append(c)
                return
            out["confirmation_runs"] += 1
            c["reruns"] += 1
            same = same_way(v)
            c["failed_same_way"] += same
            if progress is not None:
                progress({"run": number, "seconds": seconds(),
                          "change": f"confirmation {k} of {confirm} of {which}", "case": case,
                          "verdict": {"status": v[0], "kinds": list(v[1]), "detail": v[2],
                                      "tensors": list(v[3]) if len(v) > 3 else []},
                          "kept": same, "smallest": out["smallest"]})
        out["confirmations"].append(c)
        if c["failed_same_way"] == c["reruns"]:
            out["confirmed"] = True
            out["smallest"] = case
            out["smallest_verdict"] = out["original_verdict"] if original else kept[i][1]
            out["steps"] = out["steps"][:i + 1]
            return
        out["flaky"] = True
    out["not_reproduced"] = True
    out["smallest"], out["smallest_verdict"], out["steps"] = out["original"], out["original_verdict"], []
