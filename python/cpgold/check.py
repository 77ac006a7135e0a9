"""Checks against a golden fixture, in process: candidate files (`cpgold check`), or outputs held as numpy arrays or
torch tensors (no candidate file, no subprocess). Both go through the C++ engine of `cpgold check` (the extension
cpgold._core), so their verdicts are the command's. `check(..., cpgold=BINARY)` runs the command instead, for those
who have the binary and not the extension.

A report is a dict: the JSON report of `cpgold check --format json` (docs/cli.md), with numbers that JSON cannot
hold (inf, NaN) given back as floats, plus `exit_code` (0 pass, 1 fail, 5 undecided: a fixture of the GPU engine whose
budgets cannot decide, docs/scale.md); `report.text` is the command's text report
(in process only). A failed check's report carries its diagnosis (`report["diagnosis"]`: what kind of CP bug the
failures fit, docs/diagnosis.md) unless `diagnosis=False` asks to skip it (`cpgold check --no-diagnosis`).
"""
import json
import os
import shutil
import subprocess

from . import _arrays
from ._core_loader import available as _core_available
from ._core_loader import core
from .errors import CheckInputError, InputError
from .fixture import OUTPUT_NAMES, Fixture

EMPTY_ROW_LSE = ("neg-inf", "pos-inf")
PAD_ROWS = ("zero", "unwritten")  # pad and tail rows of o/dq/dk/dv: exactly 0 (the contract), or not compared
SCOPES = ("global", "cp_gathered")


class Report(dict):
    """The JSON report as a dict; `text` is the text report of `cpgold check`, `passed` its verdict."""

    text = None

    @property
    def passed(self):
        return bool(self.get("pass"))

    @property
    def undecided(self):
        """Neither passed nor failed: a fixture of another engine than the CPU reference cannot decide (the CPU
        reference's fixture of the case does)."""
        return bool(self.get("undecided"))


def find_cpgold(cpgold=None):
    """The cpgold binary: the argument, else $CPGOLD_BIN, else `cpgold` on PATH."""
    candidate = cpgold or os.environ.get("CPGOLD_BIN") or shutil.which("cpgold")
    if not candidate or not os.path.isfile(candidate) or not os.access(candidate, os.X_OK):
        raise FileNotFoundError(f"cpgold binary not found (argument {cpgold!r}, CPGOLD_BIN "
                                f"{os.environ.get('CPGOLD_BIN')!r}, PATH): build it with "
                                "`cmake --preset default && cmake --build --preset cli` and set "
                                "CPGOLD_BIN=build/bin/cpgold, or install the package (pip install ./python) to check "
                                "in process")
    return candidate


def tensor_names(tensors):
    """("o", "lse") from a list, a tuple or a comma-separated string ("o,lse"); None for all five. Read by the parser
    of `cpgold check --tensors` (an empty item, an unknown name or a name given twice is an InputError naming
    "tensors")."""
    if tensors is None:
        return None
    if isinstance(tensors, str):
        text = tensors
    elif isinstance(tensors, (list, tuple)) and all(isinstance(t, str) for t in tensors):
        text = ",".join(tensors)
    else:
        raise InputError(f"tensors: expected names of o, lse, dq, dk, dv as a list or a comma-separated string, got "
                         f"{tensors!r}", "tensors")
    if _core_available():
        core().check_options_text(text, None)  # the command's parser and messages
    else:
        names = text.split(",")
        for i, name in enumerate(names):
            if name not in OUTPUT_NAMES:
                raise InputError(f"tensors: item {i} {name!r} is not one of {', '.join(OUTPUT_NAMES)}", "tensors")
            if names.count(name) > 1:
                raise InputError(f"tensors: tensor {name!r} is given twice in {text!r}", "tensors")
    return tuple(text.split(","))


def rank_index(rank, field="rank"):
    """A rank given from Python: an int (numpy's integers too), never a bool, a float or a string."""
    import operator

    if isinstance(rank, bool) or isinstance(rank, (str, bytes, float)):
        raise InputError(f"{field}: expected a rank as an integer >= 0, got {rank!r}", field)
    try:
        value = operator.index(rank)
    except TypeError:
        raise InputError(f"{field}: expected a rank as an integer >= 0, got {rank!r}", field) from None
    if value < 0:
        raise InputError(f"{field}: expected a rank as an integer >= 0, got {value}", field)
    return value


def _convention(value, field, allowed):
    """A convention option: parsed by the engine's parser when the extension is here (the one place `check`'s options
    are validated); without it, the same rule and message here, since the binary would name its flag instead."""
    value = allowed[0] if value is None else value
    if not isinstance(value, str):
        raise InputError(f"{field}: expected {' or '.join(allowed)}, got {value!r}", field)
    if _core_available():
        core().check_options_text(None, None, **{field: value})
    elif value not in allowed:
        raise InputError(f'{field}: expected {" or ".join(allowed)}, got "{value}"', field)
    return value


def _empty_row_lse(value):
    return _convention(value, "empty_row_lse", EMPTY_ROW_LSE)


def _pad_rows(value):
    return _convention(value, "pad_rows", PAD_ROWS)


def _ranks(ranks):
    """ranks= as the text of `cpgold check --ranks` ("0,2"): an int, a list of ints, or that text; "" for every rank."""
    if ranks is None:
        return ""
    if isinstance(ranks, str):
        text = ranks
    elif isinstance(ranks, (list, tuple)):
        text = ",".join(str(rank_index(r, "ranks")) for r in ranks)
    else:
        text = str(rank_index(ranks, "ranks"))
    if _core_available():
        core().check_options_text(None, text)  # the command's parser and messages (a rank twice, "0,", "-1")
    return text


def _restore_nonfinite(node):
    """JSON has no inf/NaN: cpgold writes null and names the value in the object's "nonfinite" map."""
    if isinstance(node, dict):
        for value in node.values():
            _restore_nonfinite(value)
        for key, text in node.get("nonfinite", {}).items():
            node[key] = float(text)
    elif isinstance(node, list):
        for value in node:
            _restore_nonfinite(value)
    return node


def _report(core_report):
    report = Report(_restore_nonfinite(json.loads(core_report.json())))
    report.text = core_report.text()
    report["exit_code"] = 0 if report["pass"] else 5 if report.get("undecided") else 1
    return report


def _source(golden):
    return golden.source if isinstance(golden, Fixture) else os.fspath(golden)


def _diagnosis(diagnosis):
    """(diagnose, replay budget in seconds) of diagnosis=: True (the replay's default 30 s), False, or seconds."""
    if isinstance(diagnosis, bool) or diagnosis is None:
        return bool(diagnosis), 30.0
    try:
        seconds = float(diagnosis)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not 0 <= seconds <= 86400:  # NaN fails too
        raise InputError(f"diagnosis: expected True, False or seconds from 0 to 86400 for the replay of modelled "
                         f"mistakes, got {diagnosis!r}", "diagnosis")
    return True, seconds


def check(golden, *candidates, tensors=None, empty_row_lse=None, ranks=None, allow_same_file=False, cpgold=None,
          timeout=None, diagnosis=True, pad_rows=None):
    """Checks candidate file(s) against a golden fixture (a path or a Fixture) as `cpgold check` does.
    tensors: e.g. ("o", "lse") or "o,lse" for a forward-only candidate. empty_row_lse: "pos-inf" accepts
    FlashAttention-2's LSE +inf on rows with no visible key (the contract, and the default, is "neg-inf").
    ranks: check the per-rank outputs of these ranks only. allow_same_file: accept the golden itself as candidate (its
    stored simulator outputs are then checked). diagnosis: False skips the diagnosis of a failure (report["diagnosis"]
    stays empty); a number of seconds bounds its replay of modelled CP mistakes (`--diagnosis-budget`; True: 30 s,
    0: no replay). pad_rows: "unwritten" leaves the pad and tail rows of o/dq/dk/dv out of the comparison (FlashAttention-3/4
    with seqused_q/k never write them; their non-zero counts are reported); the contract, and the default, is "zero".
    Raises CheckInputError (an InputError) on unusable input.
    cpgold: a cpgold binary to run instead of the in-process engine (also used when the extension is missing)."""
    if not candidates:
        raise InputError("check: give at least one candidate file", "candidates")
    names = tensor_names(tensors)
    convention = _empty_row_lse(empty_row_lse)
    pads = _pad_rows(pad_rows)
    rank_list = _ranks(ranks)
    diagnose, budget = _diagnosis(diagnosis)
    files = [os.fspath(c) for c in candidates]
    if cpgold is not None or not _core_available():
        if isinstance(golden, Fixture) and not isinstance(golden.source, str):
            raise InputError("check: a fixture in memory needs the in-process engine (pip install ./python)", "golden")
        return _check_with_binary(_source(golden), files, names, convention, rank_list, allow_same_file, cpgold,
                                  timeout, diagnose, pads, budget)
    try:
        result = core().check_files(_source(golden), files, ",".join(names or ()), convention, rank_list,
                                    allow_same_file, diagnose, pads, budget)
    except InputError as e:
        raise CheckInputError(str(e), e.field) from None
    return _report(result)


def _arrays_of(fixture, outputs, rank, lse_layout):
    """(rank or -1, name, array, element, lse layout) tuples for the engine, which compares every shape with the
    fixture's before it copies anything and takes float32, fp16 and bf16 (float64 refused, as in candidate files)."""
    if not isinstance(outputs, dict) or not outputs:
        raise InputError(f"outputs: expected a dict of tensors (some of {', '.join(OUTPUT_NAMES)}), got "
                         f"{type(outputs).__name__}", "outputs")
    if lse_layout not in (None, "ht", "th"):
        raise InputError(f"lse_layout: expected 'ht' or 'th', got {lse_layout!r}", "lse_layout")
    where = "outputs" if rank < 0 else f"outputs of rank {rank}"
    out = []
    for name, x in outputs.items():
        if name not in OUTPUT_NAMES:
            raise InputError(f"{where}: tensor {name!r} is not one of {', '.join(OUTPUT_NAMES)}", "outputs")
        try:
            array, element = _arrays.host_array(x, f"{where}: {name}")
        except ValueError as e:
            raise InputError(str(e), name) from None
        out.append((rank, name, array, element, (lse_layout or "") if name == "lse" else ""))
    return out


def check_outputs(fixture, outputs, rank=None, scope="global", tensors=None, empty_row_lse=None, lse_layout=None,
                  diagnosis=True, pad_rows=None):
    """Checks outputs held in memory (numpy arrays or torch tensors on any device; float32, bf16, fp16) against the
    fixture, in process, with the engine of `cpgold check`. No candidate file is written.

    outputs: a dict of some of o [t, h, d], lse, dq, dk, dv, in the global layout (rank None); or one rank's outputs
    in the rank-local layout (rank=r, that rank alone is checked); or a list of every rank's dicts (rank None).
    LSE may be [h, t], [t, h] or [t, h, 1] (lse_layout "ht"/"th" where t can equal h).
    scope (global outputs): "global" for a non-CP implementation (the larger of the CP and non-CP budgets decides),
    "cp_gathered" for CP outputs gathered to the global layout (the CP budget decides).
    A failure's report carries its diagnosis (report["diagnosis"], the "diagnosis:" lines of report.text); diagnosis=False
    skips it, diagnosis=SECONDS bounds its replay of modelled CP mistakes (see check()). pad_rows: "unwritten" for implementations that leave pad rows unwritten (see check())."""
    if not isinstance(fixture, Fixture):
        with Fixture(fixture) as opened:
            return check_outputs(opened, outputs, rank, scope, tensors, empty_row_lse, lse_layout, diagnosis, pad_rows)
    if scope not in SCOPES:
        raise InputError(f"scope: expected one of {SCOPES}, got {scope!r}", "scope")
    names = tensor_names(tensors)
    convention = _empty_row_lse(empty_row_lse)
    pads = _pad_rows(pad_rows)
    diagnose, budget = _diagnosis(diagnosis)
    if isinstance(outputs, (list, tuple)):
        if rank is not None:
            raise InputError("rank: give either one rank's outputs with rank=r, or a list of every rank's outputs",
                             "rank")
        if len(outputs) != fixture.cp_size:
            raise InputError(f"outputs: a list of {len(outputs)} ranks' outputs, the fixture has cp_size "
                             f"{fixture.cp_size}", "outputs")
        arrays = [a for r, o in enumerate(outputs) for a in _arrays_of(fixture, o, r, lse_layout)]
        ranks, source = "", f"arrays of ranks 0..{fixture.cp_size - 1}"
    elif rank is not None:
        rank = rank_index(rank)
        if not rank < fixture.cp_size:
            raise InputError(f"rank: {rank} is outside [0, {fixture.cp_size}) (cp_size {fixture.cp_size})", "rank")
        arrays = _arrays_of(fixture, outputs, rank, lse_layout)
        ranks, source = str(rank), f"arrays of rank {rank}"
    else:
        arrays = _arrays_of(fixture, outputs, -1, lse_layout)
        ranks, source = "", f"arrays ({scope})"
    try:
        result = core().check_arrays(fixture.source, arrays, scope, source, "", ",".join(names or ()), convention,
                                     ranks, diagnose, pads, budget)
    except InputError as e:
        raise CheckInputError(str(e), e.field) from None
    return _report(result)


def self_check(golden, tensors=None, empty_row_lse=None, diagnosis=True):
    """`cpgold check --self`: an independent CPU path (the CP simulator with another order of operations) checked
    against the fixture."""
    names = tensor_names(tensors)
    try:
        result = core().self_check(_source(golden), ",".join(names or ()), _empty_row_lse(empty_row_lse),
                                   bool(diagnosis))
    except InputError as e:
        raise CheckInputError(str(e), e.field) from None
    return _report(result)


def _check_with_binary(golden, files, names, convention, ranks, allow_same_file, cpgold, timeout, diagnosis=True,
                       pad_rows="zero", diagnosis_budget=30.0):
    cmd = [find_cpgold(cpgold), "check", golden, *files, "--format", "json", "--empty-row-lse", convention]
    if pad_rows != "zero":
        cmd += ["--pad-rows", pad_rows]
    if names:
        cmd += ["--tensors", ",".join(names)]
    if ranks:
        cmd += ["--ranks", ranks]
    if allow_same_file:
        cmd += ["--allow-same-file"]
    if not diagnosis:
        cmd += ["--no-diagnosis"]
    elif diagnosis_budget != 30.0:
        cmd += ["--diagnosis-budget", repr(float(diagnosis_budget))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode not in (0, 1, 5):
        raise CheckInputError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    try:
        report = Report(_restore_nonfinite(json.loads(proc.stdout)))
    except json.JSONDecodeError:
        raise CheckInputError(f"{' '.join(cmd)}: exit {proc.returncode} without a JSON report: "
                              f"{proc.stderr.strip()[:2000]}") from None
    report["exit_code"] = proc.returncode
    report["command"] = cmd
    if report.get("pass") != (proc.returncode == 0) or bool(report.get("undecided")) != (proc.returncode == 5):
        raise CheckInputError(f"{' '.join(cmd)}: exit {proc.returncode} disagrees with report pass={report.get('pass')}")
    return report


def describe(location, has_dim=True):
    """A report location (worst element, first divergence, exact violation) in words, as the text report says it;
    has_dim False for LSE (its elements are rows and heads)."""
    loc = location
    parts = []
    if loc["rank"] >= 0:
        parts.append(f"rank {loc['rank']}")
    if loc["step"] >= 0:
        parts.append(f"step {loc['step']}")
    kind = loc.get("row_kind")
    if kind == "token":
        where = f"sequence {loc['sequence']}, row {loc['row_in_sequence']} of the sequence"
    elif kind == "pad":
        where = f"sequence {loc['sequence']}, pad row (row {loc['row_in_sequence']} of its padded range)"
    elif kind == "tail":
        where = "tail row (past the last sequence)"
    else:
        where = "a row outside every sequence of the call"
    parts.append(where)
    text = ", ".join(parts) + f" (tensor row {loc['row']}"
    if loc["rank"] >= 0 and loc["global_row"] >= 0:
        text += f", global row {loc['global_row']}"
    text += f"), head {loc['head']}" + (f", dim {loc['dim']}" if has_dim else "")
    text += f": candidate {loc['candidate']:.6g}, oracle {loc['oracle']:.6g}"
    if loc.get("peer") is not None:
        text += f", peer {loc['peer']:.6g}"
    return text


def failures(report):
    """What failed, in lines: per failed result its errors and limits, the exact rule broken and where, the worst
    element and the first divergence; lines on inputs computed from another fixture; then one line per finding of the
    report's diagnosis, "diagnosis: <kind>: <evidence>" (docs/diagnosis.md)."""
    lines = []
    for claim in report.get("inputs", {}).get("candidates", []):
        if not claim["matches"]:
            lines.append(f"inputs: {claim['source']} was computed from the inputs of another fixture "
                         f"(inputs_sha256 {claim['sha256'][:16]}..., this fixture's "
                         f"{(report['inputs']['fixture_sha256'] or '')[:16]}...)")
    for r in report.get("results", []):
        if r.get("pass"):
            continue
        where = _result_name(r)
        if r.get("missing"):
            lines.append(f"{where}: missing in the candidate")
            continue
        lines.append(f"{where}: max err {float(r['max_err']):.3e} (limit {r['max_limit']:.3e}, ratio "
                     f"{float(r['max_ratio']):.3f}), mean err {float(r['mean_err']):.3e} (limit {r['mean_limit']:.3e}), "
                     f"exact violations {r['exact_violations']}, compared {r['compared']}")
        if r["exact_violations"]:
            lines.append(f"  exact rule: {r['exact_rule']} ({r['exact_violations']} element(s))")
        if r.get("worst") is not None and (float(r["max_ratio"]) > 1 or float(r["mean_ratio"]) > 1):
            lines.append(f"  worst element: {describe(r['worst'], r['tensor'] != 'lse')}")
        if r.get("first_divergence") is not None:
            lines.append(f"  first divergence: {describe(r['first_divergence'], r['tensor'] != 'lse')}")
    if report.get("results") and not report.get("compared") and not report.get("no_valid_element"):
        lines.append("nothing was compared (every selected row is padding)")
    if report.get("hint"):
        lines.append(report["hint"])
    lines += [f"diagnosis: {d['kind']}: {d['evidence']}" for d in report.get("diagnosis", [])]
    return lines


def _result_name(r):
    """A result's name: "o@r1", "dq", "lse@r0/s1f"."""
    name = r["tensor"] + (f"@r{r['rank']}" if r.get("rank", -1) >= 0 else "")
    if r.get("step", -1) >= 0:
        name += f"/s{r['step']}" + ("f" if r.get("pass_kind") == "forward" else "b")
    return name


def failed_names(report):
    """Names of the failed results ("o@r1", "dq", "lse@r0/s1f"), in report order."""
    return [_result_name(r) + (" (missing)" if r.get("missing") else "")
            for r in report.get("results", []) if not r.get("pass")]


def summary(report, limit=300):
    """One line on a failed report, for the first line of an assertion: which tensors on which ranks failed, then the
    diagnosis kind and its evidence (the first, most specific one), or what else decided the verdict."""
    names = failed_names(report)
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    parts = [f"{shown} failed" if names else "no tensor failed"]
    if any(not c["matches"] for c in report.get("inputs", {}).get("candidates", [])):
        parts.append("computed from the inputs of another fixture")
    if report.get("results") and not report.get("compared") and not report.get("no_valid_element"):
        parts.append("nothing was compared (every selected row is padding)")
    if report.get("hint"):
        parts.append(report["hint"])
    diagnosis = report.get("diagnosis") or []
    if diagnosis:
        evidence = diagnosis[0]["evidence"]
        evidence = evidence if len(evidence) <= limit else evidence[:limit - 3] + "..."
        more = f" (+{len(diagnosis) - 1} more kind(s) below)" if len(diagnosis) > 1 else ""
        parts.append(f"diagnosis {diagnosis[0]['kind']}: {evidence}{more}")
    return "; ".join(parts)


def ratios(report):
    """(tensor, rank, max_err/max_limit, mean_err/mean_limit) of every compared result of a report; rank -1 is
    the global level. Results with nothing compared (no valid rows) are left out."""
    out = []
    for r in report.get("results", []):
        if r.get("missing") or not r.get("compared"):
            continue
        out.append((r["tensor"], r.get("rank", -1), float(r["max_ratio"]), float(r["mean_ratio"])))
    return out
