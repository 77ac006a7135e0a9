"""cpgold.strategies.cases draws only valid cases for every comm type, with or without cp_size (docs/case-spec.md:
a2a+p2p splits W ranks into a2a groups of a2a_size >= 2 dividing W, so it takes W >= 2); a bound no comm type can
meet is refused when the strategy is made, not while drawing."""
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="Hypothesis is not installed (pip install hypothesis; Debian: "
                                                      "python3-hypothesis): the strategies tests did not run")
from hypothesis import HealthCheck, given, settings  # noqa: E402

import cpgold  # noqa: E402
import cpgold.strategies  # noqa: E402

COMMS = [("p2p",), ("a2a",), ("all_gather",), ("a2a+p2p",), ("p2p", "a2a+p2p"), cpgold.strategies.COMMS]
SETTINGS = dict(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def draw_all(strategy, check):
    @settings(**SETTINGS)
    @given(case=strategy)
    def run(case):
        check(case)

    run()


def w_fits_the_comm(case, max_cp_size):
    w, comm = case["cp_size"], case["comm"]
    assert 1 <= w <= max_cp_size
    if comm == "a2a+p2p":
        a = case["a2a_size"]
        assert w >= 2 and a >= 2 and w % a == 0, case
        assert case["heads_q"] % a == 0 and case.get("heads_kv", case["heads_q"]) % a == 0, case
    if comm == "a2a":
        assert case["heads_q"] % w == 0 and case.get("heads_kv", case["heads_q"]) % w == 0, case


@pytest.mark.parametrize("comm", COMMS, ids="+".join)
@pytest.mark.parametrize("max_cp_size", [2, 4, 8])
def test_every_comm_type_draws_without_cp_size(comm, max_cp_size):
    seen = set()

    def check(case):
        assert case["comm"] in comm
        w_fits_the_comm(case, max_cp_size)
        seen.add(case["cp_size"])

    draw_all(cpgold.strategies.cases(comm=comm, max_cp_size=max_cp_size), check)
    assert max(seen) > 1 and (min(seen) == 1) == (comm != ("a2a+p2p",)), seen   # W = 1 whenever a comm type takes it


@pytest.mark.parametrize("comm", COMMS, ids="+".join)
def test_every_case_drawn_without_cp_size_is_valid(comm, core):
    # the case parser of `cpgold gen` (C++ core): InputError on an invalid case
    draw_all(cpgold.strategies.cases(comm=comm, max_cp_size=6), lambda case: cpgold.normalize_case(case))


def test_a_bound_no_comm_type_meets_is_refused_when_the_strategy_is_made():
    with pytest.raises(cpgold.InputError, match=r"^max_cp_size: comm a2a\+p2p .* cp_size >= 2, got max_cp_size 1$"):
        cpgold.strategies.cases(comm="a2a+p2p", max_cp_size=1)
    with pytest.raises(cpgold.InputError, match=r"^comm: a2a\+p2p .* needs cp_size >= 2, got cp_size 1$"):
        cpgold.strategies.cases(comm="a2a+p2p", cp_size=1)
    cpgold.strategies.cases(comm=("p2p", "a2a+p2p"), cp_size=1)      # p2p takes W = 1: drawn as p2p


def test_an_empty_batch_passes_its_check_comparing_nothing(core):
    """The docstring's word on empty_batch: the golden outputs of a case whose every sequence is empty pass `check`,
    the report saying no_valid_element."""
    cases = []
    draw_all(cpgold.strategies.cases(cp_size=2, comm="p2p", empty_batch=True, max_seqlen=0, zero_length=True,
                                     max_sequences=2, dims=(8,), max_heads_q=2),
             cases.append)
    case = cases[0]
    assert not any(case["seqlens_q"])
    fx = cpgold.generate(case)
    report = cpgold.check_outputs(fx, {n: fx.golden(n) for n in ("o", "lse", "dq", "dk", "dv")}, lse_layout="ht")
    assert report["pass"] and report["exit_code"] == 0, report.text
    assert report["no_valid_element"] is True and report["compared"] == 0, report.text
