"""cpgold from Python: read golden fixtures, write candidate outputs, run `cpgold check` (docs/python.md)."""
from .candidate import lse_to_ht, read_candidate, write_global, write_rank, write_ranks
from .check import CheckInputError, check, failures, find_cpgold, ratios
from .fixture import Fixture, FixtureError, INPUT_NAMES, OUTPUT_NAMES

__version__ = "0.1.0"
__all__ = ["Fixture", "FixtureError", "INPUT_NAMES", "OUTPUT_NAMES", "write_global", "write_rank", "write_ranks",
           "read_candidate", "lse_to_ht", "check", "failures", "ratios", "find_cpgold", "CheckInputError"]
