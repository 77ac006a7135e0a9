"""python3 -m cpgold.capture join FOLDER | check FOLDER (docs/capture.md).

Exit codes: join: 0 every captured call joined, 2 a call could not be joined or the folder is unusable; check: 0 every
call passes, 1 a call fails, 2 a call could not be checked (none failing) or the folder is unusable.
"""
import argparse
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
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
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
