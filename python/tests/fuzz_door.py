"""The Python door of the seeded fuzz (tests/fixtures/fuzz.cpp): every mutated fixture and candidate given on the
command line goes through cpgold.Fixture, read_candidate, check and check_outputs. Each must end in a result or an
InputError (FixtureError and CheckInputError included); anything else (another exception) is printed with the file
and makes the exit code 3. The fuzz runs this under its time and address-space limits, so a hang or a crash fails too.
    fuzz_door.py GOLDEN CANDIDATE --fixtures F... --candidates C..."""
import sys

import cpgold


def main(argv):
    golden, candidate = argv[0], argv[1]
    split = argv.index("--candidates")
    fixtures, candidates = argv[3:split], argv[split + 1:]
    unexpected = 0
    counts = {"ok": 0, "refused": 0}

    def attempt(what, path, call):
        nonlocal unexpected
        print(f"start {what} {path}", flush=True)
        try:
            call()
            counts["ok"] += 1
        except cpgold.InputError:
            counts["refused"] += 1
        except Exception as e:  # noqa: BLE001 - the point: nothing else may come out
            unexpected += 1
            print(f"UNEXPECTED {what} {path}: {type(e).__name__}: {str(e)[:300]}", flush=True)

    def open_fixture(path):
        with cpgold.Fixture(path) as fx:
            fx.inputs(), fx.golden("o"), fx.budget("o")

    def outputs_of(path):
        return cpgold.check_outputs(golden, cpgold.read_candidate(path))

    for path in fixtures:
        attempt("Fixture", path, lambda: open_fixture(path))
        attempt("check", path, lambda: cpgold.check(path, candidate))
    for path in candidates:
        attempt("read_candidate", path, lambda: cpgold.read_candidate(path))
        attempt("check", path, lambda: cpgold.check(golden, path))
        attempt("check_outputs", path, lambda: outputs_of(path))
    print(f"python door: {counts['ok']} results, {counts['refused']} InputError, {unexpected} other", flush=True)
    return 3 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
