"""Your own CP partition against the fixture's: which chunks each rank holds, and where they differ.

    diffs = cpgold.compare_partition(fx, [my_rows(r) for r in range(fx.cp_size)], side="q")
    assert not diffs, "\\n".join(diffs)

The fixture splits every sequence's padded range into 2W chunks of padded_length / (2W) rows and gives rank r chunks r
and 2W-1-r (TransformerEngine's dual-chunk split, `thd_get_partitioned_indices`); under comm p2p, tail rows past the
last sequence are split evenly, after them. A rank's row indices are the global rows of its local rows, in local order
(`Fixture.partitioned_indices(r, side)`).
"""
import numpy as np

from .fixture import Fixture

__all__ = ["compare_partition", "chunk_of_rows"]


def chunk_of_rows(fixture, rows, side="q"):
    """Per global row: "s<b>/c<c>" (sequence b, chunk c of its 2W chunks) or "tail"; "row <x> (outside [0, T))" for an
    index past the layout."""
    w = fixture.cp_size
    offsets = fixture.cu_seqlens(side, padded=True).astype(np.int64)
    total = fixture.total_rows(side)
    names = []
    for x in np.asarray(rows, dtype=np.int64).ravel():
        if x < 0 or x >= total:
            names.append(f"row {int(x)} (outside [0, {total}))")
            continue
        b = int(np.searchsorted(offsets, x, side="right")) - 1
        if b >= len(offsets) - 1:
            names.append("tail")
            continue
        chunk = (offsets[b + 1] - offsets[b]) // (2 * w)
        names.append(f"s{b}/c{int((x - offsets[b]) // chunk)}")
    return names


def _runs(names, rows):
    """Consecutive local rows of one chunk: [(name, first local row, end, first global row, last global row)]."""
    out = []
    for i, (name, row) in enumerate(zip(names, rows)):
        if out and out[-1][0] == name and out[-1][2] == i:
            out[-1][2] = i + 1
            out[-1][4] = int(row)
        else:
            out.append([name, i, i + 1, int(row), int(row)])
    return out


def _chunks_text(runs):
    return ", ".join(f"{name} (global rows {first}..{last})" for name, _, _, first, last in runs) or "no rows"


def compare_partition(fixture, rows_per_rank, side="q"):
    """Compares your row indices per rank (a list of W arrays: the global row of each local row, numpy or torch) with
    the fixture's partition. Returns a list of lines, one per rank that differs, naming the chunks it holds against
    the chunks it should hold (empty when they agree)."""
    if not isinstance(fixture, Fixture):
        with Fixture(fixture) as opened:
            return compare_partition(opened, rows_per_rank, side)
    if side not in ("q", "kv"):
        raise ValueError(f"side: expected 'q' or 'kv', got {side!r}")
    if len(rows_per_rank) != fixture.cp_size:
        raise ValueError(f"rows_per_rank: {len(rows_per_rank)} ranks given, the fixture has cp_size {fixture.cp_size}")
    lines = []
    for r, given in enumerate(rows_per_rank):
        if hasattr(given, "detach"):
            given = given.detach().cpu().numpy()
        given = np.asarray(given, dtype=np.int64).ravel()
        expected = fixture.partitioned_indices(r, side)
        if given.shape == expected.shape and np.array_equal(given, expected):
            continue
        got_runs = _runs(chunk_of_rows(fixture, given, side), given)
        want_runs = _runs(chunk_of_rows(fixture, expected, side), expected)
        got_chunks = [x[0] for x in got_runs]
        want_chunks = [x[0] for x in want_runs]
        where = f"{side} rank {r}"
        if got_chunks == want_chunks and len(given) == len(expected):
            first = int(np.flatnonzero(given != expected)[0])
            lines.append(f"{where}: the chunks are right ({', '.join(want_chunks)}) but their rows differ: local row "
                         f"{first} holds global row {given[first]}, expected {expected[first]} "
                         f"({chunk_of_rows(fixture, [expected[first]], side)[0]})")
            continue
        missing = [c for c in dict.fromkeys(want_chunks) if c not in got_chunks]
        extra = [c for c in dict.fromkeys(got_chunks) if c not in want_chunks]
        text = f"{where}: holds {_chunks_text(got_runs)}; the fixture's partition gives {_chunks_text(want_runs)}"
        if missing or extra:
            text += (f" (missing {', '.join(missing) or 'none'}; not its own {', '.join(extra) or 'none'})")
        elif len(given) != len(expected):
            text += f" ({len(given)} rows, expected {len(expected)})"
        else:
            text += " (the same chunks in another order)"
        lines.append(text)
    return lines
