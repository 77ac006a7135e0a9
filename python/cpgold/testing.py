"""Assertions for tests of attention implementations (pytest or unittest).

    import cpgold.testing
    cpgold.testing.assert_close(fixture, {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv})
    cpgold.testing.assert_close(fixture, local_outputs, rank=dist.get_rank())      # one CP rank, rank-local layout

The check is `cpgold check`'s engine run in process on the arrays (numpy, or torch on any device). On failure the
AssertionError carries the text report of `cpgold check`: the per-tensor table (error, limit and their ratio against
the deciding and the other budget), every broken exact rule with the first elements that break it, the worst element
and the first divergence in the terms of CP (rank, step, sequence, row in the sequence or pad row, head, dim,
candidate / oracle / peer), the diagnosis (one line `diagnosis: <kind>: <evidence>` per kind of CP bug the failures
fit, docs/diagnosis.md) and the `cpgold gen --case ...` line that reproduces the fixture.
"""
from .check import check_outputs
from .fixture import Fixture

__all__ = ["assert_close"]


def assert_close(fixture, outputs, rank=None, tensors=None, empty_row_lse="neg-inf", scope="global",
                 lse_layout=None, msg=None, diagnosis=True, pad_rows="zero"):
    """Raises AssertionError unless `outputs` pass the fixture's check; returns the report (a dict) when they do.

    fixture: a cpgold.Fixture or a fixture's path. outputs: a dict of some of o, lse, dq, dk, dv in the global layout;
    with rank=r one rank's outputs in the rank-local layout (only that rank is checked); or a list of every rank's
    dicts. tensors: the outputs checked, e.g. ("o", "lse") or "o,lse" (default: all five; a missing one fails).
    empty_row_lse: "pos-inf" accepts FlashAttention-2's LSE +inf on rows with no visible key. scope: "cp_gathered" for
    CP outputs gathered to the global layout. lse_layout: "ht" or "th" where an LSE of t rows and h heads is ambiguous.
    diagnosis: False leaves the diagnosis of a failure out of the message (and its cost out of the check).
    pad_rows: "unwritten" leaves pad and tail rows out of the comparison (FlashAttention-3/4 never write them).
    Unusable input (a tensor of the wrong shape, an unknown name) raises cpgold.InputError, not AssertionError."""
    if not isinstance(fixture, Fixture):
        with Fixture(fixture) as opened:
            return assert_close(opened, outputs, rank, tensors, empty_row_lse, scope, lse_layout, msg, diagnosis,
                                pad_rows)
    report = check_outputs(fixture, outputs, rank=rank, scope=scope, tensors=tensors, empty_row_lse=empty_row_lse,
                           lse_layout=lse_layout, diagnosis=diagnosis, pad_rows=pad_rows)
    if not report["pass"]:
        header = f"cpgold: the outputs do not pass the fixture {fixture.path}"
        if rank is not None:
            header += f" (rank {rank}, rank-local layout)"
        raise AssertionError((f"{msg}\n" if msg else "") + header + "\n\n" + report.text)
    return report
