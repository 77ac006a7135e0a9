"""Assertions for tests of attention implementations (pytest or unittest).

    import cpgold.testing
    cpgold.testing.assert_close(fixture, {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv})
    cpgold.testing.assert_close(fixture, local_outputs, rank=r)                    # one CP rank, rank-local layout
    cpgold.testing.assert_rank_close(fixture, local_outputs)                       # this process's rank (dist.get_rank)

The check is `cpgold check`'s engine run in process on the arrays (numpy, or torch on any device). On failure the
AssertionError's first line sums it up, as torch.testing's do: which tensors failed on which ranks, the diagnosis kind
and its evidence (docs/diagnosis.md). The text report of `cpgold check` follows: the per-tensor table (error, limit
and their ratio against the deciding and the other budget), every broken exact rule with the first elements that
break it, the worst element and the first divergence in the terms of CP (rank, step, sequence, row in the sequence or
pad row, head, dim, candidate / oracle / peer), the diagnosis lines and the `cpgold gen --case ...` line that
reproduces the fixture. Under pytest the traceback stops at the caller: cpgold's own frames are hidden.

A fixture whose batch holds no token (seqlens_q [0]) has nothing to compare: its check rests on the exact rules (pad
rows 0, shapes, LSE of rows without keys) and passes on them, the report saying "no valid element". A check of ranks
that hold only padding while the fixture holds tokens elsewhere compares nothing and fails, except in
`assert_rank_close`, where each process answers for its own rank and the ranks together cover the tokens.
"""
from .check import check_outputs, summary
from .fixture import Fixture

__all__ = ["assert_close", "assert_rank_close", "failure_message"]


def failure_message(report, header, msg=None):
    """The AssertionError text of a failed report: the summary line first, then the header and the text report."""
    first = f"cpgold: {summary(report)}"
    return (f"{msg}\n" if msg else "") + first + "\n\n" + header + "\n\n" + (report.text or "")


def assert_close(fixture, outputs, rank=None, tensors=None, empty_row_lse="neg-inf", scope="global",
                 lse_layout=None, msg=None, diagnosis=True, pad_rows="zero"):
    """Raises AssertionError unless `outputs` pass the fixture's check; returns the report (a dict) when they do.

    fixture: a cpgold.Fixture or a fixture's path. outputs: a dict of some of o, lse, dq, dk, dv in the global layout;
    with rank=r one rank's outputs in the rank-local layout (only that rank is checked); or a list of every rank's
    dicts. tensors: the outputs checked, e.g. ("o", "lse") or "o,lse" (default: all five; a missing one fails; a
    forward-only check is tensors="o,lse").
    empty_row_lse: "pos-inf" accepts FlashAttention-2's LSE +inf on rows with no visible key. scope: "cp_gathered" for
    CP outputs gathered to the global layout. lse_layout: "ht" or "th" where an LSE of t rows and h heads is ambiguous.
    diagnosis: False leaves the diagnosis of a failure out of the message (and its cost out of the check).
    pad_rows: "unwritten" leaves pad and tail rows out of the comparison (FlashAttention-3/4 never write them).
    Unusable input (a tensor of the wrong shape, an unknown name) raises cpgold.InputError, not AssertionError."""
    __tracebackhide__ = True
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
        raise AssertionError(failure_message(report, header, msg))
    return report


def assert_rank_close(fixture, outputs, group=None, tensors=None, empty_row_lse="neg-inf", lse_layout=None, msg=None,
                      diagnosis=True):
    """assert_close for a distributed test (TransformerEngine's style, one process per rank): the rank is read from
    the process group (`torch.distributed.get_rank(group)`, whose size must be the fixture's cp_size) and `outputs` are
    that rank's, in the rank-local layout. A rank whose rows are all padding compares nothing under the budget rule
    and passes on its exact rules (pad rows exactly 0); the other ranks' checks compare the fixture's tokens."""
    __tracebackhide__ = True
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("assert_rank_close: torch.distributed is not initialized (no process group to read the "
                           "rank from): call it inside a distributed run, or use assert_close(..., rank=r)")
    if not isinstance(fixture, Fixture):
        with Fixture(fixture) as opened:
            return assert_rank_close(opened, outputs, group, tensors, empty_row_lse, lse_layout, msg, diagnosis)
    rank = dist.get_rank(group) if group is not None else dist.get_rank()
    size = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if size != fixture.cp_size:
        raise ValueError(f"group: the process group has {size} ranks, the fixture {fixture.path} has cp_size "
                         f"{fixture.cp_size}: pass the CP group (group=) or a fixture of {size} ranks")
    report = check_outputs(fixture, outputs, rank=rank, tensors=tensors, empty_row_lse=empty_row_lse,
                           lse_layout=lse_layout, diagnosis=diagnosis)
    if not report["pass"] and _only_padding(report):
        report["rank_holds_only_padding"] = True
        return report
    if not report["pass"]:
        header = f"cpgold: rank {rank} of {size}: its outputs do not pass the fixture {fixture.path} (rank-local layout)"
        raise AssertionError(failure_message(report, header, msg))
    return report


def _only_padding(report):
    """Failed only because the checked rank holds no token: every result within its rules, nothing compared."""
    return (not report.get("compared") and all(r.get("pass") for r in report.get("results", []))
            and all(c["matches"] for c in report.get("inputs", {}).get("candidates", [])))
