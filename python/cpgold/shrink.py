"""From a case whose outputs fail their check to the smallest case that fails the same way (docs/shrink.md).

`cpgold.shrink(case, fn)` runs the search of `cpgold shrink` (the same C++ reducer, so the same steps in the same
order) with a Python callable instead of a command: every step generates the candidate case's fixture in memory,
calls `fn(fixture)` and checks what it returns with the engine of `cpgold check`.
"""
import json
import os

from ._core_loader import core
from .cases import _case_text, generate
from .check import check_outputs
from .errors import CheckInputError, InputError
from .fixture import OUTPUT_NAMES, Fixture


class ShrinkResult(dict):
    """What the search found (a dict, as `cpgold shrink --format json` gives it, plus the report of the smallest):
    original / smallest (case JSON text, as `cpgold gen --case` takes it), kinds, steps, runs, passed,
    failed_otherwise, no_candidate, seconds, stopped ("minimal", "budget", "max_runs"), report (the check report of the
    smallest case's outputs), reproduce."""

    @property
    def smaller(self):
        return bool(self["steps"])

    @property
    def case(self):
        """The smallest failing case as a dict."""
        return json.loads(self["smallest"])

    def __str__(self):
        lines = [f"smallest failing case ({self['rows_q']} q rows, {self['tokens_q']} tokens; "
                 f"{len(self['steps'])} steps kept, {self['runs']} runs in {self['seconds']:.1f} s, "
                 f"stopped: {self['stopped']}):", self["smallest"]]
        lines += ["steps kept:"] + [f"  {s}" for s in self["steps"]] if self["steps"] else []
        if self.get("report") is not None:
            lines.append(self["report"].text)
        lines.append(f"reproduce: {self['reproduce']}")
        return "\n".join(lines)


def _start_case(start):
    if isinstance(start, Fixture):
        return start.case_json
    if isinstance(start, (str, os.PathLike)) and not str(start).lstrip().startswith("{") and os.path.exists(start):
        with Fixture(start) as fx:
            return fx.case_json
    return _case_text(start)


def shrink(start, fn, *, kind=None, any_failure=False, same_tensors=False, budget=None, max_runs=None, reseed=0, seed=0,
           dims=None, trace=False, scope="global", tensors=None, empty_row_lse=None, lse_layout=None, progress=None,
           pad_rows=None):
    """Searches for the smallest case whose outputs fail the same way as those of `start`.

    start: a case (dict or JSON text), a Fixture or the path of a fixture (its case).
    fn(fixture) -> outputs: a dict of o, lse, dq, dk, dv in the global layout (checked with `scope`), or a list of
    every rank's dicts in the rank-local layout. An exception, None or outputs the check cannot use count as
    "no candidate", never as a pass.
    kind: a diagnosis kind (or a list) every kept failure must name; default: the kinds of the original's failure.
    any_failure: keep any failure. same_tensors: keep a failure only when it fails exactly the tensors the
    original fails (for a wide diagnosis such as "unexplained", under which a smaller case can fail another way).
    budget (seconds) and max_runs bound the search (the original's run included).
    reseed: a smaller case that passes is tried again with that many other input seeds (drawn from `seed`).
    dims: the head dims fn supports (default any). trace: generate traced fixtures. pad_rows: "unwritten" for an
    implementation that leaves pad rows unwritten (FlashAttention-3/4), as for check().
    progress: called with a dict after every run (run, seconds, change, case, verdict, kept, smallest).
    Raises InputError when the original does not fail (or gives no candidate)."""
    reports = {}

    def runner(case_json, run):
        fixture = generate(json.loads(case_json), trace=trace)
        try:
            try:
                outputs = fn(fixture)
            except Exception as e:  # the implementation under test failed: no candidate
                return ("no_candidate", [], f"fn raised {type(e).__name__}: {e}")
            if outputs is None:
                return ("no_candidate", [], "fn returned None")
            try:
                report = check_outputs(fixture, outputs, scope=scope, tensors=tensors, empty_row_lse=empty_row_lse,
                                       lse_layout=lse_layout, pad_rows=pad_rows)
            except (InputError, CheckInputError) as e:
                return ("no_candidate", [], f"the outputs are unusable: {e}")
            if report.passed:
                return ("passes", [], "check passed")
            kinds = [d["kind"] for d in report.get("diagnosis", [])]
            reports[case_json] = report
            failing = {r["tensor"] for r in report["results"] if not r.get("pass")}
            return ("fails", kinds, "check failed: " + (", ".join(kinds) or "no diagnosis"),
                    [t for t in OUTPUT_NAMES if t in failing])
        finally:
            fixture.close()

    kinds = [kind] if isinstance(kind, str) else list(kind or [])
    if any_failure and kinds:
        raise InputError("kind: cannot be combined with any_failure: give one of them", "kind")
    for name, value in (("budget", budget), ("max_runs", max_runs)):
        if value is not None and not value >= 0:
            raise InputError(f"{name}: expected a value >= 0 (None: no bound), got {value!r}", name)
    result = core().shrink(_start_case(start), runner, kinds, bool(any_failure), float(budget or 0),
                           int(max_runs or 0), int(reseed), int(seed), [int(d) for d in (dims or [])], progress,
                           bool(same_tensors))
    out = ShrinkResult(result)
    if not out["original_fails"]:
        verdict = out["original_verdict"]
        if verdict["status"] == "passes":
            raise InputError("start: the outputs of the original case pass their check: there is no failure to "
                             "shrink", "start")
        raise InputError(f"fn: no candidate for the original case ({verdict['detail']})", "fn")
    out["report"] = reports.get(out["smallest"])
    out["reproduce"] = f"cpgold gen --case '{out['smallest']}' -o case.h5"
    return out
