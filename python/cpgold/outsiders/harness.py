"""The one harness of the outsiders: what every way of running an implementation shares (docs/outsiders.md).

An implementation runs in this process or in an isolated child process (runner.py, `python3 -m cpgold.outsiders`),
or one process per rank (ranks.py, `torchrun ... -m cpgold.outsiders.ranks`). All of them:
- list their fixtures the same way (fixture_list) and describe each in its summary entry (describe_entry);
- reach the verdict of a fixture with one routine (judge): its candidate files checked by cpgold's engine with the
  adapter's pad-row convention, a failure under the contract ("zero") checked again with pad rows left out, so that
  a failure on pad rows only reads as a convention ("valid rows pass"), and "empty" when nothing was compared;
- follow one fault policy: an error whose text says the CUDA context is lost (context_lost) ends the process that
  met it with CONTEXT_LOST, the fixture recorded first (crash_entry when the process died without recording it),
  and the run goes on in a fresh process (isolated child) or stops naming the failing rank (ranks);
- follow one time policy: a fixture may run FIXTURE_TIMEOUT seconds on a rank, a rank may stay PEER_GRACE seconds
  inside a fixture after a peer failed, and the process groups' own timeout (backstop) lies beyond both;
- tabulate their verdicts with the same tables (markdown, counts).
"""
import argparse
import json
import os
import signal
from dataclasses import dataclass

import numpy as np

STATUSES = ("pass", "fail", "empty", "error", "unsupported")

# ------------------------------------------------------------------ faults
# A process that met an error which leaves the CUDA context unusable (a device-side assert, an illegal address)
# records the fixture and exits with this code: an isolated run starts a fresh child at the next fixture, a run of
# ranks stops, so one crash does not turn every later fixture into an error.
CONTEXT_LOST = 75
# A rank stopped because another rank failed.
EXIT_STOPPED = 4
# A CUDA context that raised one of these is unusable for the rest of the process: torch's wording, then the CUDA
# runtime's error names, which the CuTe DSL (FlashAttention-4) reports instead ("cudaErrorAssert (error code: 710)")
CONTEXT_ERRORS = ("device-side assert", "illegal memory access", "an illegal instruction", "unspecified launch failure",
                  "CUDA error: misaligned address", "cudaErrorAssert", "cudaErrorIllegalAddress",
                  "cudaErrorIllegalInstruction", "cudaErrorLaunchFailure", "cudaErrorMisalignedAddress")


def context_lost(text):
    """Whether an error's text says the CUDA context is lost (CONTEXT_ERRORS)."""
    return any(t in text for t in CONTEXT_ERRORS)


def exit_code(status):
    """The exit code of a process that stops on a fixture with this status of its own: CONTEXT_LOST after a lost
    CUDA context, 1 after an error of its own, EXIT_STOPPED when a peer's failure stopped it."""
    return {"context_lost": CONTEXT_LOST, "error": 1}.get(status, EXIT_STOPPED)


def exit_text(code):
    """How a child ended: "exit N", or "signal SIGSEGV (11)" for one killed by a signal (a negative return code)."""
    if code >= 0:
        return f"exit {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"killed by signal {name} ({-code})"


def crash_entry(suite, fixture, reason):
    """The error entry of a fixture whose process ended while running it, without recording it."""
    return {"fixture": fixture, "suite": suite, "status": "error", "reason": reason}


# ------------------------------------------------------------------ time
FIXTURE_TIMEOUT = 600.0   # seconds one fixture (run, exchange and check) may take on a rank
PEER_GRACE = 10.0         # seconds a rank may stay inside a fixture after a peer failed


def backstop(timeout, grace):
    """Seconds of the process groups' own timeout: beyond the fixture's timeout and the grace, so that the
    harness's watchdog acts first and the groups' timeout only ends what the watchdog could not."""
    return timeout + grace + 60


# ------------------------------------------------------------------ command line
def argument_parser(prog, doc, adapters):
    """The command line every way of running starts with: the adapter (a name of `adapters`, each (module, class,
    description), described in the epilog) and the fixtures; each way adds its own options."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0],
                                 epilog="adapters: " + "; ".join(f"{k}: {v[2]}" for k, v in adapters.items()))
    ap.add_argument("adapter", choices=sorted(adapters))
    ap.add_argument("fixtures", nargs="+", help="fixture folders (the folder's name is the suite) or files")
    return ap


def add_selection_arguments(ap):
    """--set KEY=VALUE (another adapter option, repeatable) and --only (the fixtures to run), as every way takes
    them."""
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another adapter option")
    ap.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], help="comma-separated fixtures to run")


# ------------------------------------------------------------------ fixtures
def fixture_list(paths, only=None, first=None):
    """(suite, path) of every .h5 in the folders (suite: the folder's name) and of the files given; `only`: names
    (file or suite/file) to keep; `first`: {suite: N}, only the first N fixtures (by name) of that suite."""
    items = []
    for p in paths:
        if os.path.isdir(p):
            suite = os.path.basename(os.path.normpath(p))
            items += [(suite, os.path.join(p, n)) for n in sorted(os.listdir(p)) if n.endswith(".h5")]
        elif os.path.isfile(p):
            items.append((os.path.basename(os.path.dirname(os.path.abspath(p))), p))
        else:
            raise FileNotFoundError(f"fixtures: {p!r} is neither a folder nor a file")
    if only:
        wanted = set(only)
        items = [(s, p) for s, p in items if os.path.basename(p) in wanted or f"{s}/{os.path.basename(p)}" in wanted]
    if first:
        seen = {}
        kept = []
        for s, p in items:
            seen[s] = seen.get(s, 0) + 1
            if s not in first or seen[s] <= first[s]:
                kept.append((s, p))
        items = kept
    return items


def mask_class(case):
    """none, causal, window, causal+window: the mask family of a case (a window is any bounded side beyond causal)."""
    left, right = (int(w) for w in case.get("window", [-1, -1]))
    causal = case.get("mask") == "causal"
    windowed = left >= 0 or (right >= 0 and not causal)
    return ("causal+window" if windowed else "causal") if causal else ("window" if windowed else "none")


def describe_entry(entry, fx):
    """The fixture's case, comm type, W, mask family, pad fill and dtype, added to its summary entry."""
    entry.update(case=fx.case, comm=fx.comm, cp_size=fx.cp_size, mask_class=mask_class(fx.case),
                 pad_fill=fx.case.get("pad_fill", "random"), dtype=fx.dtype)


def read_results(results):
    """The entries of a JSON-lines results file, in order."""
    with open(results) as f:
        return [json.loads(x) for x in f if x.strip()]


# ------------------------------------------------------------------ the verdict
def lse_convention(fx, lse_ht):
    """pos-inf where the implementation wrote +inf on a valid row without keys (FlashAttention-2's convention)."""
    return "pos-inf" if bool(np.isposinf(lse_ht[:, fx.valid_rows("q")]).any()) else "neg-inf"


@dataclass
class Verdict:
    """status: pass, fail or empty. reports: {label: the check's report} in the order checked. valid_rows_pass:
    whether every check passes with pad rows left out, where a check under the contract failed (else None)."""
    status: str
    reports: dict
    valid_rows_pass: bool = None


def judge(fixture, candidates, tensors, empty_row_lse, pad_rows, cpgold=None, diagnosis=None):
    """The verdict of one fixture. candidates: {label: [candidate files]}, each list checked by one `check` (one
    file of global outputs, or every rank's file together). A failure under the contract (pad_rows "zero") is
    checked again with pad rows left out (no diagnosis): valid_rows_pass. Empty when no check compared anything.
    diagnosis: as check() takes it (None: its default)."""
    from ..check import check

    options = dict(tensors=list(tensors), empty_row_lse=empty_row_lse, pad_rows=pad_rows, cpgold=cpgold)
    if diagnosis is not None:
        options["diagnosis"] = diagnosis
    reports = {label: check(fixture, *files, **options) for label, files in candidates.items()}
    passed = all(r["pass"] for r in reports.values())
    verdict = Verdict("pass" if passed else "fail", reports)
    if not passed:
        if pad_rows == "zero":
            again = dict(options, pad_rows="unwritten", diagnosis=False)
            verdict.valid_rows_pass = all(check(fixture, *files, **again)["pass"] for files in candidates.values())
        if not any(r.get("compared", 1) for r in reports.values()):
            verdict.status = "empty"
    return verdict


# ------------------------------------------------------------------ tables
def worst_ratio(e):
    return max((max(r[2], r[3]) for r in e.get("ratios", [])), default=None)


def table(entries, key):
    """Rows of (value of key, counts per status, worst ratio over the passes) in sorted order."""
    rows = {}
    for e in entries:
        k = key(e)
        row = rows.setdefault(k, {s: 0 for s in STATUSES} | {"worst_pass": None, "pads_only": 0})
        row[e["status"]] += 1
        if e["status"] == "fail" and e.get("valid_rows_pass"):
            row["pads_only"] += 1
        if e["status"] == "pass":
            w = worst_ratio(e)
            if w is not None and (row["worst_pass"] is None or w > row["worst_pass"]):
                row["worst_pass"] = w
    return sorted(rows.items(), key=lambda kv: str(kv[0]))


def markdown(entries, title, keys=None):
    keys = keys or [("suite", lambda e: e["suite"]), ("comm, W", lambda e: f"{e.get('comm')} W={e.get('cp_size')}"),
                    ("mask", lambda e: e.get("mask_class", "?")), ("pad fill", lambda e: e.get("pad_fill", "?"))]
    out = [f"### {title}", ""]
    for label, key in keys:
        out += [f"| {label} | pass | fail (pad rows only) | empty | error | refused or not expressible | worst ratio of "
                "the passes |", "|---|---|---|---|---|---|---|"]
        for k, r in table(entries, key):
            w = "-" if r["worst_pass"] is None else f"{r['worst_pass']:.3f}"
            out.append(f"| {k} | {r['pass']} | {r['fail']} ({r['pads_only']}) | {r['empty']} | {r['error']} | "
                       f"{r['unsupported']} | {w} |")
        out.append("")
    return "\n".join(out)


def counts(entries, statuses=STATUSES):
    c = {s: 0 for s in statuses}
    for e in entries:
        c[e["status"]] += 1
    return c
