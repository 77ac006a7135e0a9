"""Candidate files (fixtures/SCHEMA.md, "Candidate files") written from numpy arrays or torch tensors.

Every tensor is stored as float32 (bf16/fp16 convert exactly); LSE is stored as [h, t] whatever it came as:
[h, t] (FlashAttention's varlen layout), [t, h] or TransformerEngine's [t, h, 1]. Everything is validated before
the file is opened, so bad input leaves an existing file untouched. With `fixture=` the file also records the inputs
it was computed from (root attributes inputs_sha256 and inputs_case_json), so that `check` can tell a candidate
computed from the inputs of another fixture.
"""
import os
import stat

import h5py
import numpy as np

from . import _arrays
from ._core_loader import available as _core_available
from ._core_loader import core
from .check import rank_index
from .errors import InputError
from .fixture import OUTPUT_NAMES, SIDE

SCOPES = ("global", "cp_gathered")


def lse_to_ht(lse, heads=None, layout=None):
    """LSE [h, t] float32 numpy from [h, t], [t, h] or [t, h, 1] (numpy or torch).
    layout: 'ht' or 'th' for a 2-D LSE; None takes [h, t] unless only [t, h] fits `heads`: where both fit (a rank
    holding as many rows as there are heads) it is [h, t], the rule of candidate files, which `cpgold check` reads as
    [h, t] unless the dataset's lse_layout says "th" (pass lse_layout="th" for a [t, h] LSE whenever t can equal h)."""
    x = _arrays.to_float32(lse, "lse")
    if x.ndim == 3:
        if x.shape[2] != 1:
            raise ValueError(f"lse: a 3-D LSE must be [t, h, 1], got shape {x.shape}")
        if layout not in (None, "th"):
            raise ValueError(f"lse_layout: {layout!r} does not fit a [t, h, 1] LSE")
        return np.ascontiguousarray(x[:, :, 0].T)
    if x.ndim != 2:
        raise ValueError(f"lse: expected [h, t], [t, h] or [t, h, 1], got shape {x.shape}")
    if layout is None:
        if heads is None:
            raise ValueError(f"lse: shape {x.shape} is ambiguous without heads; pass lse_layout='ht' or 'th'")
        fits_ht, fits_th = x.shape[0] == heads, x.shape[1] == heads
        if not (fits_ht or fits_th):
            raise ValueError(f"lse: shape {x.shape} has no axis of {heads} heads")
        layout = "ht" if fits_ht else "th"
    if layout == "ht":
        return x
    if layout == "th":
        return np.ascontiguousarray(x.T)
    raise ValueError(f"lse_layout: expected 'ht' or 'th', got {layout!r}")


def _prepared(outputs, fixture, rank, lse_layout, what):
    """{name: float32 numpy} with LSE as [h, t], shapes checked against the fixture when one is given: the THD tensors
    first, so that a wrong O is named as such before LSE's heads axis is looked for."""
    if not outputs:
        raise ValueError(f"{what}: no tensors given (expected some of {OUTPUT_NAMES})")
    for name in outputs:
        if name not in OUTPUT_NAMES:
            raise ValueError(f"{what}: tensor {name!r} is not one of {OUTPUT_NAMES}")
    where = "global" if rank is None else f"rank {rank}"
    out = {}
    for name, x in outputs.items():
        if name == "lse":
            continue
        shape = tuple(int(n) for n in getattr(x, "shape", np.shape(x)))  # before any copy or conversion
        if len(shape) != 3:
            raise ValueError(f"{what}: {name} must be [t, h, d], got shape {shape}")
        if fixture is not None and shape != _expected_shape(fixture, name, rank):
            raise ValueError(f"{what}: {name} has shape {shape}, the fixture's {where} layout needs "
                             f"{_expected_shape(fixture, name, rank)}")
        out[name] = _arrays.to_float32(x, f"{what}: {name}")
    if "lse" in outputs:
        if fixture is not None:
            heads, source = fixture.heads_q, f"the fixture's heads_q"
        elif "o" in out:
            heads, source = int(out["o"].shape[1]), f"the heads of o (shape {tuple(out['o'].shape)})"
        elif "dq" in out:
            heads, source = int(out["dq"].shape[1]), f"the heads of dq (shape {tuple(out['dq'].shape)})"
        else:
            heads, source = None, None
        try:
            out["lse"] = lse_to_ht(outputs["lse"], heads, lse_layout)
        except ValueError as e:
            if source is None or "has no axis of" not in str(e):
                raise
            raise ValueError(f"{what}: lse has shape {tuple(_arrays.to_float32(outputs['lse'], 'lse').shape)} and no "
                             f"axis of {heads} heads, {source}: lse and the other outputs disagree on the number of "
                             "heads (pass fixture= to have every shape checked against the fixture's layout)") from None
        if fixture is not None and tuple(out["lse"].shape) != _expected_shape(fixture, "lse", rank):
            raise ValueError(f"{what}: lse has shape {tuple(out['lse'].shape)} (as [h, t]), the fixture's {where} "
                             f"layout needs {_expected_shape(fixture, 'lse', rank)} (LSE stored as [h, t])")
    return {name: out[name] for name in outputs}


def _record_inputs(f, fixture):
    """The inputs a candidate was computed from: the fixture's inputs digest and its case (SCHEMA.md)."""
    if fixture is not None:
        f.attrs["inputs_sha256"] = fixture.inputs_sha256
        f.attrs["inputs_case_json"] = fixture.case_json


def _expected_shape(fixture, name, rank):
    side = SIDE[name]
    rows = fixture.total_rows(side) if rank is None else len(fixture.partitioned_indices(rank, side))
    if name == "lse":
        return (fixture.heads_q, rows)
    heads = fixture.heads_q if side == "q" else fixture.heads_kv
    dim = fixture.dim_v if name in ("o", "dv") else fixture.dim_qk
    return (rows, heads, dim)


def _write_group(group, tensors):
    for name, x in tensors.items():
        group.create_dataset(name, data=x)
        if name == "lse":
            group[name].attrs["lse_layout"] = "ht"  # stated, whatever t and h are (SCHEMA.md)


def _write_file(path, force, fill):
    """A candidate file by the rules of every file cpgold writes: an existing path is never replaced unless force,
    and then only a regular file (never a symlink, a folder or a pipe); written to a hidden temporary file and moved
    into place, so that a failed or interrupted write leaves nothing behind. With the C++ core these are its rules
    (the destination checks and the move of `cpgold gen`)."""
    path = os.fspath(path)
    if _core_available():
        partial = core().PartialFile(path, bool(force))
        try:
            with h5py.File(partial.path, "x") as f:
                fill(f)
            partial.commit()
        finally:
            partial.release()
        return
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None and not force:
        raise InputError(f"{path}: exists already; pass force=True to replace it", path)
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise InputError(f"{path}: is not a regular file: force=True replaces regular files only", path)
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f".{name}.partial-{os.getpid()}")
    try:
        with h5py.File(temporary, "x") as f:
            fill(f)
        if force:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)  # never replaces
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)


def write_global(path, outputs, scope="global", fixture=None, lse_layout=None, force=False):
    """Global outputs at the root. scope 'global': a non-CP implementation (the larger of the CP and non-CP
    budgets decides); 'cp_gathered': CP outputs gathered to the global layout (the CP budget decides).
    An existing file is replaced only with force=True (a regular file only)."""
    if scope not in SCOPES:
        raise ValueError(f"scope: expected one of {SCOPES}, got {scope!r}")
    tensors = _prepared(outputs, fixture, None, lse_layout, "write_global")

    def fill(f):
        _write_group(f, tensors)
        _record_inputs(f, fixture)
        if scope == "cp_gathered":
            f.attrs["scope"] = "cp_gathered"

    _write_file(path, force, fill)


def write_rank(path, rank, outputs, fixture=None, lse_layout=None, force=False):
    """One rank's outputs at the root of its own file (root attribute `rank`), in the rank-local layout.
    An existing file is replaced only with force=True (a regular file only)."""
    rank = rank_index(rank)
    if fixture is not None:
        fixture._check_rank(rank)
    tensors = _prepared(outputs, fixture, rank, lse_layout, f"write_rank({rank})")

    def fill(f):
        _write_group(f, tensors)
        _record_inputs(f, fixture)
        f.attrs["rank"] = np.int64(rank)

    _write_file(path, force, fill)


def write_ranks(path, rank_outputs, global_outputs=None, scope="global", fixture=None, lse_layout=None, force=False):
    """All ranks in one file under /ranks/<r>/ (rank_outputs: a list indexed by rank, or a dict rank -> outputs with
    integer ranks >= 0, none twice), optionally with global outputs at the root (checked as their own level).
    An existing file is replaced only with force=True (a regular file only)."""
    items = rank_outputs.items() if isinstance(rank_outputs, dict) else enumerate(rank_outputs)
    prepared = {}
    for r, outputs in items:
        rank = rank_index(r, "rank_outputs")
        if rank in prepared:
            raise InputError(f"rank_outputs: rank {rank} is given twice (as {r!r})", "rank_outputs")
        if fixture is not None:
            fixture._check_rank(rank)
        prepared[rank] = _prepared(outputs, fixture, rank, lse_layout, f"write_ranks: rank {rank}")
    if not prepared:
        raise ValueError("write_ranks: no ranks given")
    if scope not in SCOPES:
        raise ValueError(f"scope: expected one of {SCOPES}, got {scope!r}")
    root = _prepared(global_outputs, fixture, None, lse_layout, "write_ranks: global") if global_outputs else {}

    def fill(f):
        _write_group(f, root)
        _record_inputs(f, fixture)
        if root and scope == "cp_gathered":
            f.attrs["scope"] = "cp_gathered"
        for r, tensors in sorted(prepared.items()):
            _write_group(f.create_group(f"ranks/{r}"), tensors)

    _write_file(path, force, fill)


def read_candidate(path, rank=None):
    """float32 tensors of a candidate file: the root's (rank None) or those under /ranks/<rank>/. LSE as stored.
    With the C++ core the file is read by `cpgold check`'s reader and rules (a pipe, a link to another file, a
    declared but unwritten dataset or a float64 one are refused naming it)."""
    path = os.fspath(path)
    if rank is not None:
        rank = rank_index(rank)
    if _core_available():
        return dict(core().read_candidate(path, -1 if rank is None else rank))
    from .fixture import _require_regular_file

    _require_regular_file(path)
    with h5py.File(path, "r") as f:
        group = f if rank is None else f[f"ranks/{rank}"]
        return {n: np.asarray(group[n][()], dtype=np.float32) for n in OUTPUT_NAMES if n in group}
