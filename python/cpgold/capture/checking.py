"""check: every captured call checked against a golden made from its own captured inputs (docs/capture.md, "check").

Per joined call: the golden is cpgold.generate(case, inputs=the captured global inputs) (in memory, or golden.h5 in
the call's folder with keep_golden), the candidate the ranks' captured outputs (candidate.h5), checked by the engine
of `cpgold check` with the call's conventions (the tensors recorded, pad rows "unwritten" for FlashAttention-3/4 with
seqused, LSE +inf on rows without keys for varlen_attn). One line per call and rank: step, layer, verdict, the worst
error/limit (max over the rank's tensors, and which), and the 99th percentile of error/limit (the report's
p99_ratio, the worst of the rank's tensors); then the first failing call in run order with its failed tensors, its
diagnosis and how to reproduce it. Exit code: 1 when a call fails, else 2 when a call could not be checked (or there
is none), else 0.
"""
import json
import os
import sys

from ..errors import InputError
from . import _folder
from .joining import join, load_joined


class CaptureReport(dict):
    """The check of a capture folder: calls (one dict per joined call: call, dir, step, layer, source, cp_size,
    status "pass" / "fail" / "unusable", ranks [{rank, pass, worst, worst_tensor, p99}], failed, diagnosis, reason,
    reproduce), not_captured (index records), first_failure (a call name or None), exit_code; `text` the printed
    report."""

    @property
    def text(self):
        return "\n".join(self["lines"]) + "\n"

    @property
    def exit_code(self):
        return self["exit_code"]

    @property
    def passed(self):
        return self["exit_code"] == 0


def _fmt(x):
    if x is None:
        return "n/a"
    x = float(x)
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    return f"{x:.3g}"


def _rank_lines(report, cp_size):
    """[{rank, pass, worst, worst_tensor, p99}] from a check report's results (rank -1, the global level of a call
    without CP, is rank 0)."""
    ranks = {}
    for r in report.get("results", []):
        rank = r.get("rank", -1)
        rank = 0 if rank < 0 else rank
        e = ranks.setdefault(rank, {"rank": rank, "pass": True, "worst": None, "worst_tensor": None, "p99": None,
                                    "p99_known": True, "failed": []})
        if not r.get("pass"):
            e["pass"] = False
            e["failed"].append(r["tensor"] + (" (missing)" if r.get("missing") else ""))
        if r.get("missing"):
            continue
        for key in ("max_ratio", "mean_ratio"):
            v = r.get(key)
            if v is not None and (e["worst"] is None or float(v) > e["worst"] or v != v):
                e["worst"], e["worst_tensor"] = float(v), f"{r['tensor']} {key.split('_')[0]}"
        if "p99_ratio" in r:
            v = r.get("p99_ratio")
            if v is not None and (e["p99"] is None or float(v) > e["p99"]):
                e["p99"] = float(v)
        else:
            e["p99_known"] = False
    out = []
    for rank in range(cp_size):
        e = ranks.get(rank, {"rank": rank, "pass": True, "worst": None, "worst_tensor": None, "p99": None,
                             "p99_known": True, "failed": []})
        if not e.pop("p99_known"):
            e["p99"] = None
        out.append(e)
    return out


def _golden(call_dir, case, inputs, keep_golden):
    from ..cases import generate
    from ..fixture import Fixture

    path = os.path.join(call_dir, "golden.h5")
    if os.path.isfile(path):
        return Fixture(path)
    if keep_golden:
        def fill(tmp):
            generate(case, path=tmp, inputs=inputs, allow_nonfinite=True).close()
        try:
            _folder.write_new(path, fill)
        except FileExistsError:
            pass
        return Fixture(path)
    return generate(case, inputs=inputs, allow_nonfinite=True)


def reproduce_command(call_dir, record):
    """The commands that check a joined call with the cpgold binary."""
    options = []
    if record.get("tensors") and record["tensors"] != ["o", "lse", "dq", "dk", "dv"]:
        options.append(f"--tensors {','.join(record['tensors'])}")
    if record.get("pad_rows", "zero") != "zero":
        options.append(f"--pad-rows {record['pad_rows']}")
    if record.get("empty_row_lse", "neg-inf") != "neg-inf":
        options.append(f"--empty-row-lse {record['empty_row_lse']}")
    case = os.path.join(call_dir, "case.json")
    return (f"cpgold gen --case \"$(cat {case})\" --inputs {os.path.join(call_dir, 'inputs.h5')} -o golden.h5 && "
            f"cpgold check golden.h5 {os.path.join(call_dir, 'candidate.h5')}" + "".join(" " + o for o in options))


def check_call(call_dir, diagnosis=True, keep_golden=False, pad_rows=None):
    """The check report of one joined call folder (a cpgold check report dict) and its join record. pad_rows: the
    convention for pad and tail rows ("zero" or "unwritten"), instead of the one the call recorded."""
    from ..check import check as check_files

    record, case, inputs = load_joined(call_dir)
    if pad_rows is not None:
        record = dict(record, pad_rows=pad_rows)
    nonfinite = None
    fixture = _golden(call_dir, case, inputs, keep_golden)
    try:
        if fixture.inputs_nonfinite_valid:
            nonfinite = fixture.inputs_nonfinite_valid
        report = check_files(fixture, os.path.join(call_dir, "candidate.h5"), tensors=record["tensors"],
                             empty_row_lse=record.get("empty_row_lse"), pad_rows=record.get("pad_rows"),
                             diagnosis=diagnosis)
    finally:
        fixture.close()
    return report, record, nonfinite


def check(folder, diagnosis=True, keep_golden=False, progress=None, pad_rows=None):
    """Joins the folder's calls not joined yet, then checks every joined call (see the module docstring). Returns a
    CaptureReport; its `text` is what `python3 -m cpgold.capture check FOLDER` prints and its `exit_code` what the
    command exits with. InputError when the folder is not a capture folder (exit 2).
    diagnosis: as cpgold.check (False skips it, seconds bound its replay). keep_golden: write each call's golden
    fixture as golden.h5 in its folder (kept, and used by later checks). progress: True prints a line per call on
    stderr as it is checked; a callable gets each call's entry. pad_rows: "unwritten" checks every call under the
    convention of `cpgold check --pad-rows unwritten` (TransformerEngine's FlashAttention path, like FlashAttention-3/4
    with seqused, leaves pad and tail rows unwritten, which a capture of TransformerEngine cannot tell); "zero" the
    contract; None (default) what each call recorded."""
    if pad_rows not in (None, "zero", "unwritten"):
        raise InputError(f"pad_rows: expected None, 'zero' or 'unwritten', got {pad_rows!r}", "pad_rows")
    folder = _folder.require_capture_folder(os.fspath(folder))
    joined = join(folder)
    calls = []
    for entry in joined:
        e = {k: entry.get(k) for k in ("call", "dir", "step", "layer", "order", "source", "cp_size", "group")}
        call_dir = os.path.join(folder, entry["dir"])
        e["path"] = call_dir
        if entry["status"] == "unusable":
            e.update(status="unusable", reason=entry["reason"], ranks=[])
        else:
            try:
                report, record, nonfinite = check_call(call_dir, diagnosis, keep_golden, pad_rows)
            except (InputError, OSError, ValueError, KeyError) as err:
                e.update(status="unusable", reason=f"{type(err).__name__}: {err}", ranks=[])
            else:
                cp = int(record["case"]["cp_size"])
                e.update(status="pass" if report["pass"] else "fail", ranks=_rank_lines(report, cp),
                         tensors=record["tensors"], notes=record.get("notes", []), missing=record.get("missing", []),
                         diagnosis=report.get("diagnosis", []), reproduce=reproduce_command(call_dir, record),
                         pad_rows=record.get("pad_rows"), empty_row_lse=record.get("empty_row_lse"),
                         comm=record["case"]["comm"], text=report.text)
                from ..check import failures, summary
                e["summary"] = summary(report) if not report["pass"] else ""
                e["failures"] = failures(report) if not report["pass"] else []
                if nonfinite:
                    e.setdefault("notes", []).append(f"{nonfinite} NaN/Inf value(s) in valid rows of the captured "
                                                     "inputs (the fixture is flagged)")
        calls.append(e)
        if progress:
            if callable(progress):
                progress(e)
            else:
                print(f"cpgold.capture check: {e['call']}: {e['status']}", file=sys.stderr, flush=True)
    report = CaptureReport(calls=calls, not_captured=list(joined.not_captured))
    failing = [c for c in calls if c["status"] == "fail"]
    unusable = [c for c in calls if c["status"] == "unusable"]
    report["first_failure"] = failing[0]["call"] if failing else None
    report["exit_code"] = 1 if failing else (2 if unusable or not calls else 0)
    report["lines"] = _lines(report)
    return report


def _lines(report):
    lines = []
    calls = report["calls"]
    p99_missing = False
    for c in calls:
        step = "-" if c.get("step", -1) < 0 else c["step"]
        head = f"step {step}  {c['layer']}"
        if c["status"] == "unusable":
            lines.append(f"{head}  UNUSABLE  {c['reason']}")
            continue
        for r in c["ranks"]:
            verdict = "pass" if r["pass"] else "FAIL"
            worst = f"worst {_fmt(r['worst'])}" + (f" ({r['worst_tensor']})" if r["worst_tensor"] else "")
            if r["p99"] is None:
                p99_missing = True
            lines.append(f"{head}  rank {r['rank']}  {verdict}  {worst}  p99 {_fmt(r['p99'])}" +
                         (f"  failed: {', '.join(r['failed'])}" if r["failed"] else ""))
        if c["status"] == "fail" and c.get("diagnosis"):
            lines.append(f"{head}  diagnosis {', '.join(x['kind'] for x in c['diagnosis'])}")
    if p99_missing:
        lines.append("p99 n/a: this cpgold's check reports no p99_ratio")
    for r in report["not_captured"][:20]:
        step = "-" if r.get("step", -1) < 0 else r["step"]
        lines.append(f"step {step}  {r.get('layer')}  rank {r.get('rank')}  NOT CAPTURED ({r['status']})  "
                     f"{r.get('reason', '')}")
    if len(report["not_captured"]) > 20:
        lines.append(f"... {len(report['not_captured']) - 20} more calls not captured (index.rank*.jsonl)")
    first = next((c for c in calls if c["status"] == "fail"), None)
    if first is not None:
        lines.append("")
        lines.append(f"first failing call: step {first['step']} {first['layer']} ({first['path']}; {first['source']}, "
                     f"cp_size {first['cp_size']}, {first['comm']})")
        lines.append(f"  {first['summary']}")
        for line in first["failures"]:
            lines.append(f"  {line}")
        for note in first.get("notes", []):
            lines.append(f"  note: {note}")
        lines.append(f"  reproduce: {first['reproduce']}")
    n = len(calls)
    counts = {s: sum(1 for c in calls if c["status"] == s) for s in ("pass", "fail", "unusable")}
    lines.append("")
    lines.append(f"{n} call(s) checked: {counts['pass']} pass, {counts['fail']} fail, {counts['unusable']} unusable; "
                 f"{len(report['not_captured'])} not captured")
    verdict = {0: "PASS", 1: "FAIL"}.get(report["exit_code"], "UNUSABLE")
    lines.append(f"verdict: {verdict}")
    return lines


def _plain(node):
    """JSON has no inf or NaN: such numbers become the strings "inf", "-inf", "nan"."""
    if isinstance(node, float) and node != node:
        return "nan"
    if isinstance(node, float) and node in (float("inf"), float("-inf")):
        return "inf" if node > 0 else "-inf"
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    return node


def report_json(report):
    """The report as JSON text (the command's --format json); numbers JSON cannot hold are strings."""
    out = {k: v for k, v in report.items() if k != "lines"}
    out["calls"] = [{k: v for k, v in c.items() if k != "text"} for c in report["calls"]]
    return json.dumps(_plain(out), indent=1, default=str, allow_nan=False)
