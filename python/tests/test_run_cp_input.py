"""run_cp's refusals of unusable input (python/cpgold/cp_driver.py): what a rank's function returns and the timeout
are InputErrors naming the rank, the key and what was expected, raised before any check runs."""
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run_cp needs it")

import cpgold  # noqa: E402
from conftest import golden_path  # noqa: E402

FIXTURE = golden_path("p2p_w2_causal_gqa_bf16")


def shaped(q, ctx):
    """(o, lse) of the right shapes for the rank (values do not matter: every case here is refused before a check)."""
    fx = ctx.fixture
    return torch.zeros(q.shape[0], fx.heads_q, fx.dim_v), torch.zeros(fx.heads_q, q.shape[0])


def refused(fn, **kwargs):
    with pytest.raises(cpgold.InputError) as raised:
        cpgold.run_cp(fn, FIXTURE, backward=False, device="cpu", **kwargs)
    return raised.value


def test_a_rank_without_lse_is_named():
    e = refused(lambda q, k, v, ctx: shaped(q, ctx) if ctx.rank == 0 else {"o": shaped(q, ctx)[0]})
    assert str(e).startswith("rank 1: the function returned no 'lse' (it returned o), rank 0 did") and e.field == "lse"
    e = refused(lambda q, k, v, ctx: {"o": shaped(q, ctx)[0]})           # no rank returns it, tensors o,lse
    assert str(e).startswith("ranks 0 to 1: the function returned no 'lse'") and "tensors=" in str(e)
    assert e.field == "lse"


def test_meta_tensors_are_named():
    e = refused(lambda q, k, v, ctx: tuple(t.to("meta") for t in shaped(q, ctx)))
    assert str(e).startswith("rank 0: 'o' is a meta tensor") and "holds values" in str(e) and e.field == "o"


@pytest.mark.parametrize("returned,says", [
    ({}, "rank 1: the function returned an empty dict: expected (o, lse) or a dict of some of o, lse, dq, dk, dv"),
    ({"out": 1}, "rank 1: the function returned the key(s) 'out': expected (o, lse)"),
    ((1, 2, 3), "rank 1: the function must return (o, lse) or a dict of some of o, lse, dq, dk, dv, got a tuple of 3"),
    (None, "rank 1: the function must return (o, lse) or a dict of some of o, lse, dq, dk, dv, got NoneType"),
])
def test_an_unusable_return_of_one_rank_is_named(returned, says):
    e = refused(lambda q, k, v, ctx: shaped(q, ctx) if ctx.rank == 0 else returned)
    assert str(e).startswith(says), str(e)
    assert "got dict" not in str(e)


def test_a_tensor_that_is_none_is_named():
    e = refused(lambda q, k, v, ctx: (shaped(q, ctx)[0], None if ctx.rank == 1 else shaped(q, ctx)[1]))
    assert str(e).startswith("rank 1: 'lse' is None: expected a torch tensor or a numpy array") and e.field == "lse"


@pytest.mark.parametrize("timeout", [-1, 0, float("nan"), float("inf"), "5", True])
def test_timeout_must_be_none_or_positive_and_finite(timeout):
    called = []
    e = refused(lambda q, k, v, ctx: called.append(1), timeout=timeout)
    assert str(e) == f"timeout: expected None or a positive finite number of seconds, got {timeout!r}"
    assert e.field == "timeout" and not called


def test_timeout_none_is_no_bound():
    seen = []

    def fn(q, k, v, ctx):
        seen.append(ctx.rank)
        return {}          # refused after the ranks ran: timeout=None itself was taken
    e = refused(fn, timeout=None)
    assert "empty dict" in str(e) and sorted(seen) == [0, 1]
