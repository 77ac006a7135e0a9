"""Runs `cpgold check GOLDEN CANDIDATE... --format json` and returns its report as a dict."""
import json
import os
import shutil
import subprocess

EMPTY_ROW_LSE = ("neg-inf", "pos-inf")


class CheckInputError(RuntimeError):
    """`cpgold check` refused its input (exit 2): the message is its error text."""


def find_cpgold(cpgold=None):
    """The cpgold binary: the argument, else $CPGOLD_BIN, else `cpgold` on PATH."""
    candidate = cpgold or os.environ.get("CPGOLD_BIN") or shutil.which("cpgold")
    if not candidate or not os.path.isfile(candidate) or not os.access(candidate, os.X_OK):
        raise FileNotFoundError(f"cpgold binary not found (argument {cpgold!r}, CPGOLD_BIN "
                                f"{os.environ.get('CPGOLD_BIN')!r}, PATH): build it with "
                                "`cmake --build build --target cpgold` and set CPGOLD_BIN=build/bin/cpgold")
    return candidate


def check(golden, *candidates, tensors=None, empty_row_lse=None, cpgold=None, timeout=None):
    """Checks candidate file(s) against a golden fixture. Returns the JSON report (a dict) with two keys added:
    'exit_code' (0 pass, 1 fail) and 'command'. `tensors`: e.g. ('o', 'lse') for a forward-only candidate.
    `empty_row_lse`: 'pos-inf' accepts FlashAttention-2's LSE +inf on rows with no visible key (the contract,
    and the default, is 'neg-inf'). Raises CheckInputError on exit 2 (unusable input) with cpgold's message."""
    if not candidates:
        raise ValueError("check: give at least one candidate file")
    cmd = [find_cpgold(cpgold), "check", str(golden), *(str(c) for c in candidates), "--format", "json"]
    if tensors:
        cmd += ["--tensors", ",".join(tensors)]
    if empty_row_lse is not None:
        if empty_row_lse not in EMPTY_ROW_LSE:
            raise ValueError(f"empty_row_lse: expected one of {EMPTY_ROW_LSE}, got {empty_row_lse!r}")
        cmd += ["--empty-row-lse", empty_row_lse]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode not in (0, 1):
        raise CheckInputError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise CheckInputError(f"{' '.join(cmd)}: exit {proc.returncode} without a JSON report: "
                              f"{proc.stderr.strip()[:2000]}") from None
    report["exit_code"] = proc.returncode
    report["command"] = cmd
    if report.get("pass") != (proc.returncode == 0):
        raise CheckInputError(f"{' '.join(cmd)}: exit {proc.returncode} disagrees with report pass={report.get('pass')}")
    return report


def _number(x):
    """A report's number: JSON has no inf/NaN, so cpgold writes them as the strings "inf" and "nan"."""
    return float(x)


def failures(report):
    """One line per failed result of a report: tensor, rank, step, errors and limits."""
    lines = []
    for r in report.get("results", []):
        if r.get("pass"):
            continue
        where = r["tensor"] + (f"@r{r['rank']}" if r.get("rank", -1) >= 0 else "")
        where += f"/s{r['step']}" if r.get("step", -1) >= 0 else ""
        if r.get("missing"):
            lines.append(f"{where}: missing in the candidate")
            continue
        mx, mx_lim, mn, mn_lim = (_number(r[k]) for k in ("max_err", "max_limit", "mean_err", "mean_limit"))
        lines.append(f"{where}: max err {mx:.3e} (limit {mx_lim:.3e}), mean err {mn:.3e} (limit {mn_lim:.3e}), "
                     f"exact violations "
                     f"{r['exact_violations']}, compared {r['compared']}"
                     + (f" [{r['pass_kind']}]" if r.get("pass_kind") else ""))
    return lines


def ratios(report):
    """(tensor, rank, max_err/max_limit, mean_err/mean_limit) of every compared result of a report; rank -1 is
    the global level. Results with nothing compared (no valid rows) are left out."""
    out = []
    for r in report.get("results", []):
        if r.get("missing") or not r.get("compared"):
            continue
        out.append((r["tensor"], r.get("rank", -1), _number(r["max_ratio"]), _number(r["mean_ratio"])))
    return out
