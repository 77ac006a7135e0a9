"""The pytest plugin: cpgold_case parametrized over the suites or random cases of the command line, ids that name the
cases, fixtures generated once into a cache keyed by case, schema and generator version, and a failing test that
shows cpgold check's report."""
import os

import pytest

import cpgold
from cpgold.cache import FixtureCache, cache_key

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")

TESTS = f"""
import sys
sys.path.insert(0, {EXAMPLES!r})
import cpgold.testing
from numpy_varlen_attention import attention_on_fixture

def test_correct(cpgold_case):
    cpgold.testing.assert_close(cpgold_case, attention_on_fixture(cpgold_case), lse_layout="ht")

def test_top_left(cpgold_case):
    cpgold.testing.assert_close(cpgold_case, attention_on_fixture(cpgold_case, "top_left"), lse_layout="ht")
"""


def plugin_installed():
    """True where pip installed the package: pytest then loads the plugin from its entry point by itself."""
    from importlib.metadata import entry_points

    found = entry_points()
    group = found.select(group="pytest11") if hasattr(found, "select") else found.get("pytest11", [])
    return any(e.value == "cpgold.pytest_plugin" for e in group)


@pytest.fixture
def run(pytester, tmp_path, core):
    pytester.makepyfile(test_inner=TESTS)
    cache = tmp_path / "cache"
    load = [] if plugin_installed() else ["-p", "cpgold.pytest_plugin"]

    def run_inner(*args):
        return pytester.runpytest_inprocess(*load, "-p", "no:cacheprovider", f"--cpgold-cache={cache}", *args)

    run_inner.cache = cache
    return run_inner


def test_quick_suite_ids_name_the_cases_and_failures_show_the_report(run):
    # top_left aligns the mask's diagonal top-left: wrong where L_q != L_kv, as in the cross-attention case.
    result = run("-v", "-k", "correct or nocp_cross_window_bf16", "--cpgold-suite", "quick")
    names = [c.name for c in cpgold.suite("quick")]
    result.assert_outcomes(passed=len(names), failed=1, deselected=len(names) - 1)
    for name in names:
        result.stdout.fnmatch_lines([f"*test_correct?{name}? PASSED*"])
    result.stdout.fnmatch_lines(["*test_top_left?nocp_cross_window_bf16? FAILED*"])
    text = result.stdout.str()
    # The first line sums the failure up (tensors, diagnosis); the report follows; cpgold's frames are hidden.
    result.stdout.fnmatch_lines(["E * AssertionError: cpgold: o, lse, dq, dk, dv failed; diagnosis mask_edge: *"])
    assert "cpgold: the outputs do not pass the fixture" in text and "def assert_close" not in text
    for needed in ("max/lim", "first divergence:", "sequence ", "diagnosis: mask_edge: ", "reproduce: cpgold gen --case '",
                   "verdict: FAIL"):
        assert needed in text, needed
    assert len(os.listdir(run.cache)) == len(names)


def test_fixtures_are_generated_once_and_reused(run):
    run("-k", "correct", "--cpgold-suite", "quick").assert_outcomes(passed=12)
    stamps = {p: os.stat(os.path.join(run.cache, p)).st_mtime_ns for p in os.listdir(run.cache)}
    run("-k", "correct", "--cpgold-suite", "quick").assert_outcomes(passed=12)
    assert {p: os.stat(os.path.join(run.cache, p)).st_mtime_ns for p in os.listdir(run.cache)} == stamps


def test_random_cases_need_a_seed_and_are_reproducible(run):
    result = run("-k", "correct", "--cpgold-random", "3")
    assert result.ret != 0 and "--cpgold-random N needs --cpgold-seed S" in result.stderr.str()
    result = run("-v", "-k", "correct", "--cpgold-random", "3", "--cpgold-seed", "11")
    result.assert_outcomes(passed=3)
    for c in cpgold.random_suite(3, 11):
        result.stdout.fnmatch_lines([f"*test_correct?{c.name}? PASSED*"])


def test_an_empty_batch_passes_under_the_plugin(run):
    """seqlens_q [0]: nothing to compare, the exact rules hold: a pass, as in the command and check_outputs."""
    run("-k", "correct", "--cpgold-case", '{"seqlens_q":[0],"cp_size":2,"heads_q":2,"dim_qk":64}',
        "--cpgold-case", '{"seqlens_q":[0,0],"padded_q":[4,8],"cp_size":2,"heads_q":2,"dim_qk":16}').assert_outcomes(
        passed=2)


def test_a_case_given_as_json_and_a_bad_one(run):
    run("-k", "correct", "--cpgold-case", '{"seqlens_q":[9,4],"cp_size":2,"heads_q":2,"dim_qk":16}').assert_outcomes(
        passed=1)
    result = run("-k", "correct", "--cpgold-case", '{"seqlens_q":[9],"cp_size":0}')
    assert result.ret != 0 and "cp_size" in result.stderr.str()
    result = run("--cpgold-suite", "nope")
    assert result.ret != 0 and "--cpgold-suite" in result.stderr.str()


def test_cache_key_follows_case_trace_schema_and_generator(core, tmp_path, monkeypatch):
    case = '{"seqlens_q":[5,8],"cp_size":2}'
    key = cache_key(case)
    assert key == cache_key('{"cp_size":2,"seqlens_q":[5,8],"seed":0}')  # the normalised case
    assert key != cache_key('{"seqlens_q":[5,8],"cp_size":2,"seed":1}')
    assert key != cache_key(case, trace=True)
    monkeypatch.setattr(core, "generator_version", lambda: "cpgold 9.9.9")
    assert key != cache_key(case)
    monkeypatch.setattr(core, "schema_version", 99)
    monkeypatch.undo()
    cache = FixtureCache(tmp_path)
    path = cache.fixture_path("five_eight", case)
    assert os.path.basename(path) == f"five_eight-{key}.h5" and cache.generated == 1
    open(path, "wb").write(b"damaged")  # an entry that is not a fixture is made again
    assert cache.fixture_path("five_eight", case) == path and cache.generated == 2
    with cpgold.Fixture(path) as fx:
        assert fx.case["seqlens_q"] == [5, 8]
