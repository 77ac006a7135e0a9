"""python3 -m cpgold.outsiders ADAPTER FIXTURES... : run an implementation on fixtures, check it, write the tables.

Exit 0 when every fixture passed (or was refused / not expressible), 1 when one failed or errored, 2 on bad input.
With --write-candidate PATH and one fixture it only runs the implementation and writes its candidate file (for
`cpgold check`, or as the COMMAND of `cpgold shrink FIXTURE --run "python3 -m cpgold.outsiders fa3 {fixture}
--write-candidate {candidate}"`): exit 0 written, 3 refused or not expressible, 1 on an error."""
import argparse
import faulthandler
import importlib
import json
import os
import sys
import tempfile
import time

from . import ADAPTERS, make
from .environment import describe, differences, digest, process_versions
from .harness import add_selection_arguments, argument_parser, counts, fixture_list, markdown, read_results
from .runner import isolated, run_and_write, worker


def _isolates(name):
    """Whether the adapter runs its fixtures in a child process by default (its class's `isolate`), read without
    importing the implementation."""
    module, cls, _ = ADAPTERS[name]
    try:
        return bool(getattr(getattr(importlib.import_module(f"cpgold.outsiders.{module}"), cls), "isolate", False))
    except ImportError:   # an adapter module that imports its implementation at once (not installed here)
        return False


def parse_sets(items):
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set: expected KEY=VALUE, got {item!r}")
        options[key] = value
    return options


def resume(ap, wanted, results, run_file, identity, versions, any_versions=False):
    """(recorded, record): {(suite, fixture)} that a stopped run recorded in RESULTS when --resume goes on from it,
    and RUN_FILE's record of that run. Its adapter and options must be this run's, and so must the versions it
    started with (environment.differences), unless any_versions: then the differences are named and the run goes on.
    Otherwise RESULTS starts empty, the set is empty and the record None."""
    if not wanted or not os.path.exists(results):
        if wanted:
            print(f"--resume: no {results} yet: nothing to go on from, every fixture runs", file=sys.stderr)
        open(results, "w").close()
        return set(), None
    try:
        with open(run_file) as f:
            before = json.load(f)
        if not isinstance(before, dict):
            raise ValueError(f"a JSON {type(before).__name__}, not an object")
    except (OSError, ValueError) as e:
        ap.error(f"--resume: {run_file} does not say which run {results} belongs to ({e}); nothing was run")
    for key in ("adapter", "options"):
        if before.get(key) != identity[key]:
            ap.error(f"--resume: {key} {json.dumps(identity[key])} is not the stopped run's {json.dumps(before.get(key))} "
                     f"({run_file}); nothing was run")
    then = before.get("versions")
    differ = differences(then, versions) if isinstance(then, dict) else \
        [f"{run_file} records no versions of the stopped run"]
    if differ and not any_versions:
        ap.error(f"--resume: the versions are not those the stopped run started with ({run_file}): "
                 f"{'; '.join(differ)}; nothing was run (--resume-any-versions goes on, recording both)")
    if differ:
        print(f"--resume-any-versions: going on with other versions than the stopped run's: {'; '.join(differ)}",
              file=sys.stderr)
    with open(results) as f:
        text = f.read()
    if text and not text.endswith("\n"):   # a run killed while writing its last line: that fixture runs again
        kept = text[:text.rfind("\n") + 1]
        print(f"--resume: {results} ends in an unfinished line ({len(text) - len(kept)} bytes); dropped, and its "
              f"fixture runs again", file=sys.stderr)
        with open(results, "w") as f:
            f.write(kept)
    try:
        done = {(e["suite"], e["fixture"]) for e in read_results(results)}
    except (ValueError, KeyError, TypeError) as e:
        ap.error(f"--resume: {results} is not a results file of this command ({type(e).__name__}: {e}); nothing was run")
    resumes = before.get("resumes") if isinstance(before.get("resumes"), list) else []
    record = dict(before, resumes=resumes + [{"resumed_with": len(done), "versions": versions,
                                              "versions_digest": digest(versions), "differences": differ}])
    return done, record


def write_run_file(run_file, record):
    """RUN_FILE replaced at once (a file of this process's beside it, then renamed): a run killed meanwhile leaves
    the old record or the new, never half of one."""
    tmp = f"{run_file}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(tmp, run_file)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argument_parser("python3 -m cpgold.outsiders", __doc__, ADAPTERS)
    ap.add_argument("--summary", help="JSON summary to write (default: ADAPTER.json)")
    ap.add_argument("--table", help="markdown verdict tables to write (default: printed only)")
    ap.add_argument("--cpgold", help="cpgold binary to check with (default: the in-process engine, else PATH)")
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic backward (FA3/FA4 deterministic=True; TE NVTE_ALLOW_NONDETERMINISTIC_ALGO=0)")
    ap.add_argument("--backend", choices=("fused", "flash"), help="TE adapters: the backend TE's variables select")
    add_selection_arguments(ap)
    ap.add_argument("--first", action="append", default=[], metavar="SUITE=N",
                    help="only the first N fixtures (by name) of the folder named SUITE")
    ap.add_argument("--isolate", action="store_true",
                    help="run the fixtures in a child process, started again after a fixture that crashed it (a "
                         "signal such as SIGSEGV, a device-side assert), so that a crash loses only that fixture; "
                         "the default for " + ", ".join(sorted(n for n in ADAPTERS if _isolates(n))))
    ap.add_argument("--in-process", action="store_true",
                    help="run the fixtures in this process even where isolation is the default (a crash of the "
                         "implementation then ends the whole run, without its summary)")
    ap.add_argument("--title", help="title of the tables (default: adapter and options)")
    ap.add_argument("--resume", action="store_true",
                    help="go on from a run that stopped: the fixtures recorded in SUMMARY.jsonl (beside --summary) are "
                         "not run again; the adapter, its options and the versions (SUMMARY.run.json) must be the "
                         "stopped run's")
    ap.add_argument("--resume-any-versions", action="store_true",
                    help="with --resume: go on even where the versions differ from those the stopped run started "
                         "with; SUMMARY.run.json keeps both, and every line of SUMMARY.jsonl names its process's "
                         "versions by their digest")
    ap.add_argument("--write-candidate", metavar="PATH",
                    help="one fixture: write the implementation's candidate file to PATH, no check, no tables")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    ap.add_argument("--versions-digest", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.isolate and args.in_process:
        ap.error("--isolate and --in-process: give one of them")
    if args.resume_any_versions and not args.resume:
        ap.error("--resume-any-versions: only with --resume")
    options = parse_sets(args.set)
    if args.deterministic:
        options["deterministic"] = True
    if args.backend:
        if not args.adapter.startswith("te"):
            ap.error(f"--backend: the adapter {args.adapter} has no backend choice (TE adapters only)")
        options["backend"] = args.backend
    first = {}
    for item in args.first:
        suite, _, n = item.partition("=")
        if not suite or not n.isdigit():
            ap.error(f"--first: expected SUITE=N, got {item!r}")
        first[suite] = int(n)
    try:
        items = fixture_list(args.fixtures, args.only, first)
    except FileNotFoundError as e:
        ap.error(str(e))
    if not items:
        ap.error("fixtures: no .h5 file found")
    workdir = tempfile.gettempdir()
    if args.write_candidate:
        if args.resume:
            ap.error("--resume: not with --write-candidate, which runs one fixture and keeps no results to go on from")
        if len(items) != 1:
            ap.error(f"--write-candidate: give exactly one fixture, got {len(items)}")
        if os.path.lexists(args.write_candidate):
            ap.error(f"--write-candidate: {args.write_candidate} exists; nothing was written")
        adapter = make(args.adapter, **options)
        print(f"{args.adapter}: versions {json.dumps(process_versions(adapter), sort_keys=True)}", flush=True)
        entry = run_and_write(adapter, items[0][1], items[0][0], args.write_candidate)
        status = entry.get("status")
        if status:
            print(f"{args.adapter}: {status}: {entry.get('reason', '')}", file=sys.stderr)
            return 3 if status == "unsupported" else 1
        print(f"{args.adapter}: wrote {args.write_candidate} ({entry.get('backend', '')}; check it with pad rows "
              f"{entry['pad_rows']}, tensors {','.join(entry['tensors'])})")
        return 0
    if args.worker:
        faulthandler.enable()   # a crash (SIGSEGV, SIGABRT) leaves the Python stack on stderr, which the parent records
        worker(make(args.adapter, **options), items, args.results, workdir, args.cpgold, args.skip, child=True,
               expected=args.versions_digest)
        return 0
    summary_path = args.summary or f"{args.adapter}.json"
    results, run_file = summary_path + ".jsonl", summary_path + ".run.json"
    t0 = time.time()
    adapter = make(args.adapter, **options)  # in the parent too: versions, and an import error before any child
    identity = json.loads(json.dumps({"adapter": args.adapter, "options": adapter.options()}, default=str))
    versions = process_versions(adapter)
    tag = digest(versions)
    recorded, run = resume(ap, args.resume, results, run_file, identity, versions, args.resume_any_versions)
    if recorded:
        items = [(s, p) for s, p in items if (s, os.path.basename(p)) not in recorded]
        print(f"{args.adapter}: resuming from {results}: {len(recorded)} fixtures recorded, {len(items)} to run",
              flush=True)
    if run is None:   # a run that starts: what it runs on is recorded before any fixture runs
        run = dict(identity, versions=versions, versions_digest=tag, resumes=[])
    write_run_file(run_file, run)
    print(f"{args.adapter}: {describe(versions)} ({tag})", flush=True)
    if not items:
        print(f"{args.adapter}: every fixture is recorded already", flush=True)
    elif (args.isolate or adapter.isolate) and not args.in_process:
        only = [f"{s}/{os.path.basename(p)}" for s, p in items] if recorded else args.only
        child = [sys.executable, "-m", "cpgold.outsiders", args.adapter, *args.fixtures] + \
                sum((["--set", s] for s in args.set), []) + (["--deterministic"] if args.deterministic else []) + \
                (["--backend", args.backend] if args.backend else []) + (["--cpgold", args.cpgold] if args.cpgold else []) + \
                (["--only", ",".join(only)] if only else []) + \
                ([] if recorded else sum((["--first", f] for f in args.first), [])) + \
                ["--versions-digest", tag]   # the list says it all
        isolated(child, items, results, tag)
    else:
        worker(adapter, items, results, workdir, args.cpgold, versions=versions, expected=tag)
    entries = read_results(results)
    title = args.title or f"{args.adapter} {json.dumps(adapter.options())}"
    text = markdown(entries, title)
    summary = {"adapter": args.adapter, "options": adapter.options(), "pad_rows": adapter.pad_rows,
               "versions": run.get("versions"), "versions_digest": run.get("versions_digest"),
               "resumes": run["resumes"], "seconds": round(time.time() - t0, 1), "counts": counts(entries),
               "resumed_with": len(recorded), "fixtures": entries}
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n")
    print(text)
    print(f"== {args.adapter}: {json.dumps(summary['counts'])} ({summary['seconds']} s)", flush=True)
    return 1 if summary["counts"]["fail"] + summary["counts"]["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
