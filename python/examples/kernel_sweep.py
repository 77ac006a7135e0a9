"""Runs one attention kernel over folders of cpgold fixtures, global and per rank, and summarises the verdicts.

A kernel is an object with `name`, `unsupported(fixture) -> str | None` (why the fixture is not expressible, or
None) and `__call__(fixture) -> outputs` (global layout: o, lse, dq, dk, dv; numpy or torch). It may raise
`Unsupported` when the library refuses a configuration at run time. Without "lse" in its outputs the other
tensors are checked. For every expressible fixture the sweep writes
one candidate file holding the global outputs at the root and their shards by the partition under /ranks/<r>/
(what each CP rank would hold), runs `cpgold check` on it, and records the verdict and every result's
error/limit. Rows with no visible key: where the kernel wrote LSE +inf (FlashAttention-2's convention) the check
runs with `--empty-row-lse pos-inf` when the cpgold binary offers it, and the summary says so per fixture.
"""
import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np

import cpgold

LEVELS = ("global", "rank")


class Unsupported(Exception):
    """The kernel's library refuses this configuration (not a wrong result)."""


def offers_empty_row_lse(cpgold_bin):
    text = subprocess.run([cpgold_bin, "check", "--help"], capture_output=True, text=True).stdout
    return "--empty-row-lse" in text


def has_pos_inf_rows(fixture, lse_ht):
    """True if the global LSE [h, Tq] holds +inf on a valid row."""
    valid = fixture.valid_rows("q")
    return bool(np.isposinf(lse_ht[:, valid]).any())


def run_fixture(kernel, path, suite, workdir, cpgold_bin, pos_inf_option):
    entry = {"fixture": os.path.basename(path), "suite": suite}
    with cpgold.Fixture(path) as fx:
        entry["case"] = fx.case
        reason = kernel.unsupported(fx)
        if reason:
            entry.update(status="unsupported", reason=reason)
            return entry
        try:
            outputs = kernel(fx)
        except Unsupported as e:
            entry.update(status="unsupported", reason=str(e).splitlines()[0][:300])
            return entry
        except Exception as e:  # a crash of the kernel on an expressible case counts as a failure
            entry.update(status="error", reason=f"{type(e).__name__}: {e}"[:2000], trace=traceback.format_exc()[-3000:])
            return entry
        tensors = None
        if "lse" in outputs:
            lse_ht = cpgold.lse_to_ht(outputs["lse"], fx.heads_q,
                                      "ht" if outputs["lse"].shape[0] == fx.heads_q else None)
            outputs = dict(outputs, lse=lse_ht)
            convention = "pos-inf" if has_pos_inf_rows(fx, lse_ht) else "neg-inf"
        else:  # a kernel whose API gives no LSE: the other tensors are checked, and the summary says so
            tensors, convention = ("o", "dq", "dk", "dv"), "no lse"
        candidate = os.path.join(workdir, f"{kernel.name}_candidate.h5")
        cpgold.write_ranks(candidate, fx.shard_outputs(outputs), outputs, scope="global", fixture=fx,
                           lse_layout="ht")
    empty_row = "pos-inf" if convention == "pos-inf" and pos_inf_option else None
    report = cpgold.check(path, candidate, tensors=tensors, empty_row_lse=empty_row, cpgold=cpgold_bin)
    os.remove(candidate)
    entry.update(status="pass" if report["pass"] else "fail", empty_row_lse_written=convention,
                 empty_row_lse_option=empty_row, failures=cpgold.failures(report),
                 ratios=[[t, r, mx, mn] for t, r, mx, mn in cpgold.ratios(report)])
    return entry


def distribution(values):
    if not values:
        return None
    v = np.sort(np.asarray(values, dtype=np.float64))
    return {"n": int(v.size), "median": float(np.median(v)), "p99": float(np.quantile(v, 0.99)),
            "max": float(v[-1])}


def summarise(entries):
    """Per tensor and level (global, rank): the distribution of max_err/max_limit and mean_err/mean_limit."""
    table = {}
    for e in entries:
        for tensor, rank, max_ratio, mean_ratio in e.get("ratios", []):
            key = f"{tensor}/{'global' if rank < 0 else 'rank'}"
            table.setdefault(key, {"max": [], "mean": []})
            table[key]["max"].append(max_ratio)
            table[key]["mean"].append(mean_ratio)
    return {k: {"max_ratio": distribution(v["max"]), "mean_ratio": distribution(v["mean"])}
            for k, v in sorted(table.items())}


def counts(entries):
    out = {}
    for e in entries:
        c = out.setdefault(e["suite"], {"pass": 0, "fail": 0, "error": 0, "unsupported": 0})
        c[e["status"]] += 1
    return out


def sweep(kernel, folders, cpgold_bin, summary_path, workdir="/tmp", extra=None, first=None):
    pos_inf_option = offers_empty_row_lse(cpgold_bin)
    entries, t0 = [], time.time()
    for folder in folders:
        suite = os.path.basename(os.path.normpath(folder))
        names = sorted(n for n in os.listdir(folder) if n.endswith(".h5"))
        for name in names[:first.get(suite)] if first else names:
            e = run_fixture(kernel, os.path.join(folder, name), suite, workdir, cpgold_bin, pos_inf_option)
            entries.append(e)
            line = f"{kernel.name:8} {suite:6} {e['fixture']:48} {e['status']}"
            if e["status"] in ("unsupported", "error"):
                line += f": {e['reason'][:160]}"
            elif e.get("empty_row_lse_option"):
                line += " (--empty-row-lse pos-inf)"
            print(line, flush=True)
            for f in e.get("failures", []):
                print(f"    {f}", flush=True)
    summary = {"kernel": kernel.name, "cpgold": cpgold_bin, "empty_row_lse_option_available": pos_inf_option,
               "seconds": round(time.time() - t0, 1), "counts": counts(entries), "distributions": summarise(entries),
               "fixtures": entries}
    if extra:  # a dict, or a function giving one once the kernel has run (what it saw on the way)
        summary.update(extra() if callable(extra) else extra)
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    print_summary(summary)
    return summary


def print_summary(summary):
    print(f"== {summary['kernel']}: {json.dumps(summary['counts'])}")
    print(f"{'tensor/level':14} {'n':>5} {'max/lim med':>12} {'p99':>8} {'max':>8} {'mean/lim med':>13} {'p99':>8} "
          f"{'max':>8}")
    for key, d in summary["distributions"].items():
        a, b = d["max_ratio"], d["mean_ratio"]
        print(f"{key:14} {a['n']:5} {a['median']:12.3f} {a['p99']:8.3f} {a['max']:8.3f} {b['median']:13.3f} "
              f"{b['p99']:8.3f} {b['max']:8.3f}")
    sys.stdout.flush()


def main(make_kernel, description, extra=None):
    """Command line of a kernel's sweep: FOLDERS... --cpgold BIN --summary JSON; exit 1 if any fixture failed."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("folders", nargs="+", help="folders of fixtures (cpgold gen --suite NAME -o DIR)")
    ap.add_argument("--cpgold", required=True, help="the cpgold binary")
    ap.add_argument("--summary", required=True, help="JSON summary to write")
    ap.add_argument("--first", action="append", default=[], metavar="SUITE=N",
                    help="only the first N fixtures (sorted by name) of the folder named SUITE")
    args = ap.parse_args()
    first = {}
    for item in args.first:
        suite, _, n = item.partition("=")
        if not n.isdigit():
            ap.error(f"--first: expected SUITE=N, got {item!r}")
        first[suite] = int(n)
    kernel = make_kernel()
    summary = sweep(kernel, args.folders, args.cpgold, args.summary, extra=lambda: extra(kernel) if extra else {},
                    first=first)
    return 1 if sum(c["fail"] + c["error"] for c in summary["counts"].values()) else 0
