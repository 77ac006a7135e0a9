"""python3 -m cpgold.capture join FOLDER | check FOLDER | shrink CALL_DIR --run COMMAND (docs/capture.md).

Exit codes: join: 0 every captured call joined, 2 a call could not be joined or the folder is unusable; check: 0 every
call passes, 1 a call fails, 2 a call could not be checked (none failing) or the folder is unusable; shrink (those of
`cpgold shrink`, docs/shrink.md): 0 a smaller failing case was found (confirmed, with --confirm above 0), 1 nothing
smaller fails the same way, 2 bad input (the captured case passing or giving no candidate included), 4 the failure
does not reproduce, 130 or 143 ended by SIGINT or SIGTERM.
"""
import argparse
import json
import sys

from ..errors import InputError


def _parser():
    p = argparse.ArgumentParser(prog="python3 -m cpgold.capture",
                                description="Join and check the attention calls recorded by cpgold.capture.Capture.")
    sub = p.add_subparsers(dest="command", required=True)
    j = sub.add_parser("join", help="make every captured call one case, its global inputs and a candidate file")
    j.add_argument("folder")
    c = sub.add_parser("check", help="join, then check every call against a golden made from its captured inputs")
    c.add_argument("folder")
    c.add_argument("--no-diagnosis", action="store_true", help="skip the diagnosis of failed calls")
    c.add_argument("--diagnosis-budget", type=float, default=None, metavar="SECONDS",
                   help="bound the diagnosis replay of each failed call (default 30)")
    c.add_argument("--keep-golden", action="store_true", help="write each call's golden fixture as golden.h5")
    c.add_argument("--format", choices=("text", "json"), default="text")
    c.add_argument("--progress", action="store_true", help="a line per call on stderr as it is checked")
    c.add_argument("--pad-rows", choices=("zero", "unwritten"), default=None,
                   help="the convention for pad and tail rows of every call (default: what each call recorded; "
                        "unwritten for TransformerEngine's FlashAttention path, which leaves them unwritten)")
    s = sub.add_parser("shrink", help="the smallest case cut out of a failing captured call's tensors (values kept) "
                                      "on which COMMAND still fails the same way")
    s.add_argument("call_dir", metavar="CALL_DIR", help="a joined call: FOLDER/joined/<call>")
    s.add_argument("--run", required=True, metavar="COMMAND",
                   help="shell command that reads {fixture} and writes {candidate}; with {rank}: one process per rank, "
                        "all at once, each writing its rank's candidate (the paths are absolute, of letters, digits "
                        "and ._/- only)")
    s.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="seconds the search may take (default: no bound); the smallest so far is the answer")
    s.add_argument("--max-runs", type=int, default=None, metavar="N",
                   help="stop after this many runs of COMMAND, the original's included (default: no bound)")
    s.add_argument("--run-timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds one run of COMMAND may take (default 300; 0: no limit); past it, no candidate")
    s.add_argument("--confirm", type=int, default=2, metavar="N",
                   help="run the answer again this many times (default 2; 0: none); a case that does not fail the "
                        "same way every time gives way to the one before it")
    s.add_argument("-o", "--out", default=None, metavar="OUT",
                   help="folder for case.json, inputs.h5 and shrink.json (default CALL_DIR/shrunk; new or empty)")
    s.add_argument("--format", choices=("text", "json"), default="text")
    return p


def _progress(p):
    verdict = p["verdict"]
    if verdict == "fails":
        verdict = f"fails ({', '.join(p['kinds']) or 'no diagnosis'})"
    elif p["detail"] and verdict != "passes":
        verdict = f"{verdict} ({p['detail']})"
    kept = "kept" if p["kept"] else ""
    if p["change"].startswith("confirmation"):
        kept = "the same way" if p["kept"] else "not the same way"
    print(f"shrink: run {p['run']} ({p['seconds']:.1f} s): {p['change']}: {verdict}" + (f", {kept}" if kept else "") +
          f"; smallest {p['smallest_rows_q']} q rows", file=sys.stderr, flush=True)


def _shrink_text(r):
    from ..shrink import headline

    lines = [f"original: {r['original_size']}; fails: {', '.join(r['original_diagnosis']) or 'no diagnosis'}",
             f"kept when: the diagnosis names {', '.join(r['kinds'])}" if r["kinds"] else "kept when: any failure",
             f"{headline(r)}: {r['smallest_size']} ({len(r['steps'])} steps kept; stopped: {r['stopped']})",
             r["smallest"]]
    lines += [f"note: {n}" for n in r["notes"]]
    if r["steps"]:
        lines += ["steps kept:"] + [f"  {step}" for step in r["steps"]]
    if r["confirmations"]:
        lines.append(f"confirmation ({r['confirm']} reruns of each case):")
        for c in r["confirmations"]:
            lines.append(f"  {c['which']} ({c['rows_q']} q rows) failed the same way in {c['failed_same_way']} of "
                         f"{c['reruns']} reruns")
    if r.get("report") is not None:
        from ..check import failures

        lines.append("its check:")
        lines += [f"  {line}" for line in failures(r["report"])]
    lines.append(f"saved: {r['case_path']}, {r['inputs_path']}")
    lines.append("reproduce:")
    lines += [f"  {line}" for line in r["reproduce"]]
    lines.append(f"runs: {r['runs']} ({r['passed']} passed, {r['failed_otherwise']} failed otherwise, "
                 f"{r['no_candidate']} without a candidate)" +
                 (f" and {r['confirmation_runs']} confirmation runs" if r["confirmation_runs"] else "") +
                 f" in {r['seconds']:.1f} s")
    return "\n".join(lines) + "\n"


def _shrink_main(args):
    from .checking import _plain
    from .shrinking import _Interrupted, _shrink

    try:
        result = _shrink(args.call_dir, None, command=args.run, budget=args.budget, max_runs=args.max_runs,
                         run_timeout=args.run_timeout, confirm=args.confirm, out=args.out, scope=None,
                         lse_layout=None, progress=_progress, diagnosis=True, deliver_signal=False)
    except _Interrupted as e:
        print(f"cpgold.capture shrink: {e}", file=sys.stderr)
        return 128 + e.signum
    except OSError as e:  # the answer could not be saved (a full disk, a folder that became unwritable)
        print(f"cpgold.capture: error: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        out = dict(result)
        out["report"] = _plain(dict(result["report"])) if result.get("report") is not None else None
        print(json.dumps(out, indent=1, default=str, allow_nan=False))
    else:
        print(_shrink_text(result), end="")
    return result["exit_code"]


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        if args.command == "shrink":
            return _shrink_main(args)
        if args.command == "join":
            from .joining import join

            result = join(args.folder)
            print("\n".join(result.lines()))
            return result.exit_code
        from .checking import check, report_json

        diagnosis = False if args.no_diagnosis else (args.diagnosis_budget if args.diagnosis_budget is not None
                                                     else True)
        report = check(args.folder, diagnosis=diagnosis, keep_golden=args.keep_golden, progress=args.progress,
                       pad_rows=args.pad_rows)
        print(report_json(report) if args.format == "json" else report.text, end="" if args.format == "text" else "\n")
        return report.exit_code
    except InputError as e:
        print(f"cpgold.capture: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
