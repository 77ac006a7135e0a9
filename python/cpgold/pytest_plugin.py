"""pytest plugin (entry point pytest11 "cpgold"): the `cpgold_case` fixture, one test per cpgold case.

    def test_my_attention(cpgold_case):              # cpgold_case: a cpgold.Fixture, opened on a cached file
        out = my_attention(cpgold_case)               # your kernel on cpgold_case.inputs(...)
        cpgold.testing.assert_close(cpgold_case, out)

    pytest --cpgold-suite te                          # TransformerEngine's CP configurations (default: quick)
    pytest --cpgold-suite quick,edge                  # several suites
    pytest --cpgold-random 50 --cpgold-seed 7         # 50 random cases drawn from seed 7
    pytest --cpgold-case '{"seqlens_q":[300,5],"cp_size":2,"mask":"causal"}'

Test ids name the case (test_my_attention[p2p_w2_causal_bf16]). Fixtures are generated once, by cpgold's C++ core
in this process, into --cpgold-cache (default $CPGOLD_CACHE or ~/.cache/cpgold/fixtures) under a name keyed by the
case, the schema version and the generator version, and reused by later runs.
"""
import json

import pytest

from .cache import FixtureCache

DEFAULT_SUITE = "quick"


def pytest_addoption(parser):
    group = parser.getgroup("cpgold", "cpgold golden fixtures")
    group.addoption("--cpgold-suite", default=None,
                    help="cpgold suites for the cpgold_case fixture, comma separated: quick, edge, te, full, golden "
                         f"(default {DEFAULT_SUITE} unless --cpgold-random or --cpgold-case is given)")
    group.addoption("--cpgold-random", type=int, default=0, metavar="N",
                    help="N random cases (needs --cpgold-seed: the same N and seed give the same cases)")
    group.addoption("--cpgold-seed", type=int, default=None, metavar="S", help="seed of --cpgold-random")
    group.addoption("--cpgold-case", action="append", default=[], metavar="JSON",
                    help="a case as JSON (repeatable), named case0, case1, ...")
    group.addoption("--cpgold-trace", action="store_true", help="generate the fixtures with their per-step partials")
    group.addoption("--cpgold-cache", default=None, metavar="DIR",
                    help="folder of the generated fixtures (default $CPGOLD_CACHE or ~/.cache/cpgold/fixtures)")


class CaseParam:
    """What a cpgold_case test is parametrized with: the case's name (the test id), its JSON and whether traced."""

    def __init__(self, name, json_text, trace):
        self.name, self.json, self.trace = name, json_text, trace

    def __repr__(self):
        return self.name


def selected_cases(config):
    """The cases the command line asks for, in order, without duplicate names."""
    from . import cases

    suites = config.getoption("--cpgold-suite")
    count = config.getoption("--cpgold-random")
    seed = config.getoption("--cpgold-seed")
    given = config.getoption("--cpgold-case")
    trace = config.getoption("--cpgold-trace")
    if count and seed is None:
        raise pytest.UsageError("--cpgold-random N needs --cpgold-seed S (the same N and S give the same cases)")
    if count < 0:
        raise pytest.UsageError(f"--cpgold-random: expected a number of cases >= 0, got {count}")
    if suites is None and not count and not given:
        suites = DEFAULT_SUITE
    out = []
    for name in [s.strip() for s in (suites or "").split(",") if s.strip()]:
        if name == "random":
            raise pytest.UsageError("--cpgold-suite random: use --cpgold-random N --cpgold-seed S")
        try:
            out += [CaseParam(c.name, c.json, trace or c.trace) for c in cases.suite(name)]
        except ValueError as e:
            raise pytest.UsageError(f"--cpgold-suite: {e}") from None
    if count:
        out += [CaseParam(c.name, c.json, trace) for c in cases.random_suite(count, seed)]
    for i, text in enumerate(given):
        try:
            normalized = json.dumps(cases.normalize_case(text))
        except ValueError as e:
            raise pytest.UsageError(f"--cpgold-case {text}: {e}") from None
        out.append(CaseParam(f"case{i}", normalized, trace))
    seen, unique = set(), []
    for c in out:
        if c.name not in seen:
            seen.add(c.name)
            unique.append(c)
    return unique


def _options_given(config):
    return bool(config.getoption("--cpgold-suite") or config.getoption("--cpgold-random") or
                config.getoption("--cpgold-case") or config.getoption("--cpgold-seed") is not None)


def pytest_configure(config):
    # Options given on the command line are checked now, so that a mistake is a usage error before collection.
    if _options_given(config):
        config._cpgold_cases = selected_cases(config)


def _cases(config):
    if not hasattr(config, "_cpgold_cases"):
        config._cpgold_cases = selected_cases(config)
    return config._cpgold_cases


def _cache(config):
    if not hasattr(config, "_cpgold_cache"):
        config._cpgold_cache = FixtureCache(config.getoption("--cpgold-cache"))
    return config._cpgold_cache


def pytest_report_header(config):
    if not _options_given(config):
        return None
    return f"cpgold: {len(_cases(config))} case(s), fixtures cached in {_cache(config).folder}"


def pytest_generate_tests(metafunc):
    if "cpgold_case" not in metafunc.fixturenames:
        return
    params = _cases(metafunc.config)
    metafunc.parametrize("cpgold_case", params, ids=[p.name for p in params], indirect=True)


@pytest.fixture
def cpgold_case(request):
    """A cpgold.Fixture of one case of the suites chosen on the command line (generated once, then cached)."""
    from .fixture import Fixture

    param = request.param
    path = _cache(request.config).fixture_path(param.name, param.json, param.trace)
    with Fixture(path) as fixture:
        yield fixture
