"""Fixtures generated once and kept on disk, keyed by what determines their bytes: the normalised case, whether the
step partials are stored, the schema version and the generator version. A newer cpgold, or another case, gets a file
of its own; an entry that does not open as a fixture is generated again."""
import hashlib
import json
import os

from ._core_loader import core
from .errors import InputError


def default_folder():
    """$CPGOLD_CACHE, else $XDG_CACHE_HOME/cpgold/fixtures, else ~/.cache/cpgold/fixtures."""
    if os.environ.get("CPGOLD_CACHE"):
        return os.environ["CPGOLD_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cpgold", "fixtures")


def cache_key(case_json, trace=False):
    """16 hex digits over the normalised case, trace, schema version and generator version."""
    c = core()
    normalized = c.normalize_case(case_json if isinstance(case_json, str) else json.dumps(case_json))
    text = "\n".join([normalized, f"trace={bool(trace)}", f"schema={c.schema_version}", c.generator_version()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class FixtureCache:
    """fixture_path(name, case) -> a path holding the fixture of `case`, generated on first use."""

    def __init__(self, folder=None):
        self.folder = os.fspath(folder) if folder is not None else default_folder()
        self.generated = 0

    def path_of(self, name, case_json, trace=False):
        return os.path.join(self.folder, f"{name}-{cache_key(case_json, trace)}.h5")

    def fixture_path(self, name, case_json, trace=False):
        c = core()
        text = case_json if isinstance(case_json, str) else json.dumps(case_json)
        path = self.path_of(name, text, trace)
        if os.path.exists(path):
            try:
                c.open_fixture(path, False)
                return path
            except InputError:  # a damaged entry (a crash mid-copy, a disk error): made again below
                pass
        os.makedirs(self.folder, exist_ok=True)
        try:
            c.generate(text, path, bool(trace), os.path.exists(path))
            self.generated += 1
        except InputError:
            # Another process (pytest-xdist worker) wrote it meanwhile: the writer never replaces a file without
            # force, so what is there is a whole fixture if it opens.
            c.open_fixture(path, False)
        return path
