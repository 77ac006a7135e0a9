#!/usr/bin/env python3
"""TransformerEngine's context parallelism (p2p, a2a, all_gather, a2a+p2p) with W ranks on one GPU, checked against
cpgold fixtures rank by rank and gathered.

    python3 python/examples/te/check_te_cp.py --cpgold build/bin/cpgold --summary te_cp.json DIR...

Every fixture with cp_size W > 1 runs its own comm type: W thread ranks of cpgold.thread_ranks (one process, one
GPU, messages as device copies) each build a DotProductAttention from the case, call
set_context_parallel_group(group, ranks, stream, comm) as TE's own CP tests do (a2a+p2p: [a2a group, p2p group],
a2a groups of consecutive ranks), and run forward and backward on the fixture's rank-local inputs (/ranks/<r>/:
TE's dual-chunk layout, what thd_get_partitioned_indices selects) with the global cu_seqlens. Each rank's O, dQ, dK,
dV is its candidate; the gathered outputs are checked too (scope cp_gathered). TE's CP API returns no LSE, so LSE is
not checked here (check_te_dpa.py checks TE's non-CP LSE). A fixture without a single token is `empty` (cpgold's check
calls a comparison of nothing neither pass nor fail).

Attributing a failure (docs/outsiders.md, run T2): --trace records every fused-attention call per rank (the
arguments, and where each q and k row it reads as a token comes from), for compare_te_calls.py to hold against
cpgold's replay of TE; --repeat N reruns and compares the bits; --poison fills the CUDA cache's free memory with NaN
bytes before every run, so reading memory nobody wrote shows as NaN; --only runs named fixtures. TE's torch.compile'd
helpers run eagerly here (NVTE_TORCH_COMPILE=0: dynamo refuses to be traced from several threads).
"""
import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np

# TE's jit_fuser helpers (torch.compile) cannot be traced from several threads at once ("Detected that you are
# using FX to symbolically trace a dynamo-optimized function"): under thread ranks they run eagerly, a setting TE
# supports (transformer_engine/pytorch/jit.py).
os.environ.setdefault("NVTE_TORCH_COMPILE", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import te_harness as th  # noqa: E402
import torch  # noqa: E402

import cpgold  # noqa: E402
from cpgold.thread_ranks import ThreadRankError, ThreadRanks  # noqa: E402

TENSORS = ("o", "dq", "dk", "dv")


def cp_groups(fx, ranks):
    w = fx.cp_size
    if fx.comm != "a2a+p2p":
        return ranks.group()
    a = int(fx.case.get("a2a_size") or 0)
    if a < 1 or w % a:
        raise th.Refused(f"a2a_size {a} does not divide cp_size {w}")
    r = ranks.rank()
    a2a = ranks.new_group(range(r - r % a, r - r % a + a))
    p2p = ranks.new_group(range(r % a, w, a))
    return [a2a, p2p]


def run_rank(rank, ranks, fx, cu, spy=None):
    group = cp_groups(fx, ranks)
    dpa = th.make_dpa(fx)
    dpa.set_context_parallel_group(group, list(range(fx.cp_size)), torch.cuda.Stream(), fx.comm)
    x = fx.rank_inputs(rank, "torch", "cuda")
    if spy is not None:
        spy.take()
    out, log, backend = th.run_dpa(dpa, fx, x["q"], x["k"], x["v"], x["dout"], cu)
    torch.cuda.current_stream().synchronize()
    calls = spy.take() if spy is not None else None
    return {n: out[n].float().cpu().numpy() for n in TENSORS}, th.debug_summary(log), backend, calls


def gather(fx, rank_outputs):
    """Global-layout outputs from the ranks' shards (every global row belongs to exactly one rank)."""
    result = {}
    for name in TENSORS:
        side = "q" if name in ("o", "dq") else "kv"
        first = rank_outputs[0][name]
        g = np.zeros((fx.total_rows(side),) + first.shape[1:], dtype=np.float32)
        for r, out in enumerate(rank_outputs):
            g[fx.partitioned_indices(r, side)] = out[name]
        result[name] = g
    return result


def run_ranks(fx, cu, timeout, spy, poison=False):
    if poison:
        th.poison_cuda_cache()
    return ThreadRanks(fx.cp_size, device="cuda", timeout=timeout).run(
        lambda r, ranks: run_rank(r, ranks, fx, cu, spy))


def run_fixture(path, suite, workdir, cpgold_bin, timeout, trace=False, repeat=1, poison=False):
    entry = {"fixture": os.path.basename(path), "suite": suite}
    with cpgold.Fixture(path) as fx:
        entry["case"] = fx.case
        entry["comm"], entry["cp_size"] = fx.comm, fx.cp_size
        if fx.cp_size < 2:
            entry.update(status="not_cp")
            return entry
        entry["arguments"] = th.te_arguments(fx)
        cu = th.cu_tensors(fx)
        spy = th.CallSpy(th.RowIndex(fx)) if trace else None
        try:
            if spy is not None:
                with spy:
                    results = run_ranks(fx, cu, timeout, spy, poison)
            else:
                results = run_ranks(fx, cu, timeout, None, poison)
            # reruns of the same fixture: identical bits say the result does not depend on timing between ranks
            differing = []
            for k in range(1, repeat):
                again = run_ranks(fx, cu, timeout, None, poison)
                for r, (a, b) in enumerate(zip(results, again)):
                    for n in TENSORS:
                        if not np.array_equal(a[0][n], b[0][n], equal_nan=True):
                            d = np.abs(a[0][n].astype(np.float64) - b[0][n])
                            differing.append(f"run {k + 1} rank {r} {n}: max |difference| "
                                             f"{np.nanmax(d) if np.isfinite(d).any() else float('nan'):.3g}, "
                                             f"NaN in run 1 {int(np.isnan(a[0][n]).sum())} run {k + 1} "
                                             f"{int(np.isnan(b[0][n]).sum())}")
        except ThreadRankError as e:
            cause = e.__cause__
            if isinstance(cause, (th.Refused, AssertionError)):
                entry.update(status="unsupported", reason=f"TE refuses: {cause}"[:1500],
                             nvte_debug=th.debug_summary(th.TE_LOG.take()))
            else:
                entry.update(status="error", reason=str(e)[:2000],
                             trace="".join(traceback.format_exception(cause or e))[-4000:])
            return entry
        outs = [r[0] for r in results]
        entry["backend"] = sorted({r[2] for r in results})
        entry["nvte_debug"] = results[0][1]
        if repeat > 1:
            entry["repeats"] = repeat
            entry["repeat_differences"] = differing
        if trace:
            entry["calls"] = {str(r): res[3] for r, res in enumerate(results)}
        candidate = os.path.join(workdir, "te_cp_candidate.h5")
        cpgold.write_ranks(candidate, outs, fixture=fx)
        gathered = os.path.join(workdir, "te_cp_gathered.h5")
        cpgold.write_global(gathered, gather(fx, outs), scope="cp_gathered", fixture=fx)
    per_rank = cpgold.check(path, candidate, tensors=TENSORS, cpgold=cpgold_bin)
    whole = cpgold.check(path, gathered, tensors=TENSORS, cpgold=cpgold_bin)
    failures = cpgold.failures(per_rank) + cpgold.failures(whole)
    empty = bool(failures) and all(f.startswith("nothing was compared") for f in failures)
    entry.update(status="pass" if per_rank["pass"] and whole["pass"] else "empty" if empty else "fail",
                 ranks_pass=per_rank["pass"], gathered_pass=whole["pass"],
                 failures=failures,
                 ratios=[[t, r, mx, mn] for t, r, mx, mn in cpgold.ratios(per_rank) + cpgold.ratios(whole)],
                 first_divergence=[x.get("first_divergence") for x in per_rank["results"] + whole["results"]
                                   if not x["pass"] and x.get("first_divergence")][:3])
    for p in (candidate, gathered):
        os.remove(p)
    return entry


def fixture_list(folders, only=None):
    items = []
    for folder in folders:
        suite = os.path.basename(os.path.normpath(folder))
        items += [(suite, os.path.join(folder, n)) for n in sorted(os.listdir(folder)) if n.endswith(".h5")]
    if only:
        wanted = set(only)
        items = [(s, p) for s, p in items if os.path.basename(p) in wanted or f"{s}/{os.path.basename(p)}" in wanted]
    return items


def worker(args, items):
    """Runs fixtures from --skip on, one JSON line each, flushed: a device-side assert that kills this process
    loses only the fixture it was running."""
    with open(args.results, "a") as out:
        for suite, path in items[args.skip:]:
            t1 = time.time()
            e = run_fixture(path, suite, "/tmp", args.cpgold, args.timeout, args.trace, args.repeat, args.poison)
            if args.poison:
                e["poisoned"] = True
            e["seconds"] = round(time.time() - t1, 2)
            out.write(json.dumps(e, default=str) + "\n")
            out.flush()
    return 0


def report_line(e):
    worst = max((x[2] for x in e.get("ratios", [])), default=float("nan"))
    line = f"te_cp {e['suite']:10} {e['fixture']:48} {e.get('comm', '?'):9} W={e.get('cp_size', '?')} {e['status']}"
    if e["status"] in ("pass", "fail"):
        line += f" worst max/limit {worst:.3f}"
        if e.get("repeats"):
            n = len(e.get("repeat_differences", []))
            line += f"; {e['repeats']} runs " + ("bit-identical" if n == 0 else f"differ in {n} rank tensors")
    else:
        line += f": {e.get('reason', '')[:300]}"
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--cpgold", required=True)
    ap.add_argument("--summary", required=True)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a rank waits for a peer (default 60)")
    ap.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=None,
                    help="comma-separated fixtures to run (file names or suite/file), the rest skipped")
    ap.add_argument("--trace", action="store_true",
                    help="record every fused-attention call per rank (arguments, where its q and k rows come from)")
    ap.add_argument("--repeat", type=int, default=1, help="run each fixture this many times and compare the bits")
    ap.add_argument("--poison", action="store_true",
                    help="fill the CUDA cache's free memory with NaN bytes before every run (unwritten memory shows)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--results", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    items = fixture_list(args.folders, args.only)
    if args.worker:
        return worker(args, items)
    print(", ".join(f"{k} {v}" for k, v in th.versions().items()), flush=True)
    results = args.summary + ".jsonl"
    open(results, "w").close()
    t0, done = time.time(), 0
    entries = []
    while done < len(items):
        cmd = [sys.executable, os.path.abspath(__file__), *args.folders, "--cpgold", args.cpgold, "--summary",
               args.summary, "--timeout", str(args.timeout), "--worker", "--skip", str(done), "--results", results,
               "--repeat", str(args.repeat)] + (["--trace"] if args.trace else []) + \
              (["--poison"] if args.poison else []) + \
              (["--only", ",".join(args.only)] if args.only else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        with open(results) as f:
            entries = [json.loads(x) for x in f if x.strip()]
        for e in entries[done:]:
            if e["status"] != "not_cp":
                print(report_line(e), flush=True)
                for fl in e.get("failures", []):
                    print(f"    {fl}", flush=True)
        done = len(entries)
        if proc.returncode != 0 and done < len(items):  # the process died inside this fixture
            suite, path = items[done]
            tail = "\n".join(ln for ln in proc.stderr.splitlines() if "Warning" not in ln and "warnings.warn" not in ln)
            e = {"fixture": os.path.basename(path), "suite": suite, "status": "error",
                 "reason": f"the process died (exit {proc.returncode}) running this fixture: {tail[-1500:]}"}
            with cpgold.Fixture(path) as fx:
                e.update(case=fx.case, comm=fx.comm, cp_size=fx.cp_size)
            with open(results, "a") as f:
                f.write(json.dumps(e, default=str) + "\n")
            print(report_line(e), flush=True)
            done += 1
    with open(results) as f:
        entries = [json.loads(x) for x in f if x.strip()]
    counts = {}
    for e in entries:
        if e["status"] != "not_cp":
            c = counts.setdefault(f"{e['comm']} W={e['cp_size']}", {})
            c[e["status"]] = c.get(e["status"], 0) + 1
    summary = {"versions": th.versions(), "te_environment": {**th.TE_ENV, "NVTE_TORCH_COMPILE":
                                                                  os.environ["NVTE_TORCH_COMPILE"]}, "seconds": round(time.time() - t0, 1),
               "counts": counts, "fixtures": entries}
    with open(args.summary, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print("== te_cp:", json.dumps(counts))
    return 1 if any(e["status"] in ("fail", "error") for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
