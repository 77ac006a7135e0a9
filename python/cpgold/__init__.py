"""cpgold from Python: golden fixtures for context-parallel attention and checks against them (docs/python.md).

In process, through cpgold's C++ core (the extension cpgold._core, built by `pip install ./python`):
cases and suites (`normalize_case`, `suite`, `random_suite`), `explain`, fixture generation (`generate`), and the
check engine of `cpgold check` on candidate files (`check`) or on numpy arrays and torch tensors (`check_outputs`,
`testing.assert_close`). Without the extension, reading fixtures and writing candidates need only numpy and h5py, and
`check(..., cpgold=BINARY)` runs the command.
"""
# The extension of an in-tree CMake build lives in build/python/cpgold/: with build/python on PYTHONPATH next to
# python/, this package finds it there.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

from .candidate import lse_to_ht, read_candidate, write_global, write_rank, write_ranks  # noqa: E402
from .cases import (explain, explain_text, generate, merge, normalize_case, random_suite, suite,  # noqa: E402
                    suite_names)
from .check import (Report, check, check_outputs, describe, failures, find_cpgold, ratios,  # noqa: E402
                    self_check, summary)
from .partition import compare_partition  # noqa: E402
from .errors import CheckInputError, InputError  # noqa: E402
from .fixture import INPUT_NAMES, OUTPUT_NAMES, Fixture, FixtureError  # noqa: E402
from . import testing  # noqa: E402
from .shrink import ShrinkResult, shrink  # noqa: E402


def run_cp(fn, fixture, **options):
    """Your torch CP attention on every rank of a fixture, every rank and the gathered outputs checked
    (cpgold.cp_driver.run_cp; needs torch)."""
    __tracebackhide__ = True
    from .cp_driver import run_cp as run

    return run(fn, fixture, **options)


__version__ = "0.1.0"
__all__ = ["Fixture", "FixtureError", "INPUT_NAMES", "OUTPUT_NAMES", "write_global", "write_rank", "write_ranks",
           "read_candidate", "lse_to_ht", "check", "check_outputs", "self_check", "failures", "ratios", "describe",
           "find_cpgold", "Report", "InputError", "CheckInputError", "normalize_case", "suite", "suite_names",
           "random_suite", "explain", "explain_text", "generate", "merge", "testing", "shrink", "ShrinkResult",
           "run_cp", "summary", "compare_partition"]


def __getattr__(name):
    # cpgold.strategies needs Hypothesis: imported on first use, so the package works without it.
    # cpgold.capture (docs/capture.md) is imported on first use as well.
    if name in ("strategies", "capture"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
