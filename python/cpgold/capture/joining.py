"""join: the per-rank shards of every captured call made into one cpgold case, its global inputs and a candidate
file of the ranks' outputs (docs/capture.md, "join").

For each call (and each CP group of it: with data or tensor parallelism several groups run the same layer), the
ranks' files are read, their layouts compared, the case built from the global cu_seqlens, the padded offsets, the
rows every rank holds times cp_size, heads, dims, dtype, mask, window, scale, CP size and comm type; each rank's
local rows are put at their global rows by the case's partition (TransformerEngine's thd_get_partitioned_indices,
the core's rank_rows). Written to joined/<call>/ (a new folder, never over an existing one): case.json, inputs.h5
(q, k, v, dout in the global layout, as `cpgold gen --inputs` reads them), candidate.h5 (every rank's outputs in its
rank-local layout, cpgold.write_ranks; a call without CP: the global outputs, cpgold.write_global), and join.json (what
the check needs: tensors, pad-row and LSE conventions), written last.
"""
import json
import os
import sys

import h5py
import numpy as np

from ..errors import InputError
from . import _folder, _layout
from ._layout import SIDE, Unusable

OUTPUTS = ("o", "lse", "dq", "dk", "dv")


class JoinResult(list):
    """One dict per joined call (call, dir, status "joined" / "unusable" / "exists", reason, step, layer, order,
    source, cp_size, ranks), in run order; plus `not_captured`: the index records of calls that were not captured.
    exit_code: 0 when every call is joined (or was already), 2 otherwise (as the command)."""

    not_captured = ()

    @property
    def exit_code(self):
        return 0 if self and all(e["status"] in ("joined", "exists") for e in self) else 2

    def lines(self):
        out = []
        for e in self:
            where = f"{e['call']}" + (f" (CP group {e['group']})" if e.get("group") else "")
            if e["status"] == "unusable":
                out.append(f"{where}: unusable: {e['reason']}")
            elif e["status"] == "exists":
                out.append(f"{where}: joined before ({e['dir']})")
            else:
                out.append(f"{where}: joined {e['cp_size']} rank(s) -> {e['dir']}")
        for r in self.not_captured:
            out.append(f"{r['call']} rank {r['rank']}: not captured ({r['status']}): {r.get('reason', '')}")
        if not self:
            out.append("no captured call in the folder")
        return out


def read_index(folder):
    """Every record of every index.rank<G>.jsonl of the folder, with "index_rank" and "line" added, in file order.
    InputError naming the file and line for a line that is not a record."""
    records = []
    names = sorted((n for n in os.listdir(folder) if n.startswith("index.rank") and n.endswith(".jsonl")),
                   key=lambda n: int(n[len("index.rank"):-len(".jsonl")]))
    for name in names:
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            data = f.read()
        for i, raw in enumerate(data.split(b"\n")):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
                if not isinstance(rec, dict) or "call" not in rec or "status" not in rec:
                    raise ValueError("not a record")
            except ValueError as e:
                if i == len(data.split(b"\n")) - 1:
                    continue  # the last line of a process that stopped while writing it
                raise InputError(f"{path}: line {i + 1} is not a capture record ({e})", path) from None
            rec["index_rank"] = int(name[len("index.rank"):-len(".jsonl")])
            rec["line"] = i
            records.append(rec)
    return records


def read_call_file(path):
    """(meta dict, {name: numpy array}) of one call file."""
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != "cpgold-capture-call":
            raise InputError(f"{path}: not a capture call file (attribute format {f.attrs.get('format')!r})", path)
        meta = json.loads(f.attrs["meta_json"])
        arrays = {name: np.asarray(f[name][()]) for name in f.keys()}
    _layout.check_meta(meta, path)
    return meta, arrays


def groups_of(records):
    """Captured records grouped per call and CP group, in run order: [(call, group key, [records])]. The group key is
    the CP group's global ranks, or ("rank", first global rank) when the records do not name them."""
    groups = {}
    order = {}
    for rec in records:
        if rec["status"] != "captured":
            continue
        ranks = rec.get("cp_group")
        group = tuple(ranks) if ranks else ("rank", int(rec["rank"]) - int(rec.get("cp_rank", 0)))
        key = (rec["call"], group)
        groups.setdefault(key, []).append(rec)
        order[key] = min(order.get(key, (1 << 62,)), (rec.get("step", -1), rec.get("order", 0), rec["index_rank"]))
    keys = sorted(groups, key=lambda k: (order[k], k[0], str(k[1])))
    return [(k[0], k[1], groups[k]) for k in keys]


def joined_name(call, group, several):
    """The joined folder of a call: its name, with "@g<first global rank>" when several CP groups ran it."""
    if not several:
        return call
    first = group[1] if group and group[0] == "rank" else group[0]
    return f"{call}@g{first}"


def _arrays_by_rank(folder, recs):
    metas, arrays = {}, {}
    for rec in recs:
        meta, arr = read_call_file(os.path.join(folder, rec["file"]))
        r = int(meta["cp_rank"])
        if r in metas:
            raise Unusable(f"CP rank {r} is recorded twice (global ranks {metas[r]['rank']} and {meta['rank']})")
        metas[r], arrays[r] = meta, arr
    return metas, arrays


def assemble(metas, arrays):
    """(case dict (normalised), inputs {q, k, v, dout} global numpy, rank outputs [ {name: local array} ] or the
    global outputs for one rank, info dict). Unusable when the shards do not make a case."""
    w = int(next(iter(metas.values()))["cp_size"])
    missing = [r for r in range(w) if r not in metas]
    if missing:
        raise Unusable(f"CP rank(s) {', '.join(map(str, missing))} of {w} not captured (only "
                       f"{', '.join(map(str, sorted(metas)))})")
    first = _layout.layout_keys(metas[0])
    for r in range(1, w):
        other = _layout.layout_keys(metas[r])
        diff = [k for k in first if first[k] != other[k]]
        if diff:
            k = diff[0]
            raise Unusable(f"the ranks disagree on {k}: rank 0 {first[k]!r}, rank {r} {other[k]!r}")
    rows_q = {r: metas[r]["rows_q"] for r in range(w)}
    rows_kv = {r: metas[r]["rows_kv"] for r in range(w)}
    if len(set(rows_q.values())) != 1 or len(set(rows_kv.values())) != 1:
        raise Unusable(f"the ranks hold different numbers of rows (q {rows_q}, kv {rows_kv}): TransformerEngine's "
                       "dual-chunk split gives every rank total/cp_size rows")
    meta = metas[0]
    notes = list(meta.get("notes") or [])
    relayout = False
    case, rows = _layout.case_of(meta)
    try:
        case = _layout.normalized(case)
    except InputError as e:
        if w == 1:
            relayout = True
            case, rows = _layout.case_of(meta, relayout=True)
            case = _layout.normalized(case)
            notes.append(f"rows moved to a layout cpgold has a case for ({e}): every sequence at its own offset, "
                         "padded to a multiple of 2; the pad rows of the outputs as captured are not checked")
        elif case["comm"] != "p2p":
            try:
                fallback = dict(case, comm="p2p")
                fallback.pop("a2a_size", None)
                case = _layout.normalized(fallback)
            except InputError:
                raise Unusable(f"case: {e}") from None
            notes.append(f"recorded comm {meta['comm']!r} does not fit the case ({e}); the golden uses p2p, whose "
                         "rows per rank are the same (the partition does not depend on the comm type)")
        else:
            raise Unusable(f"case: {e}") from None
    total = {"q": case["total_tokens_q"], "kv": case["total_tokens_kv"]}
    tensors = sorted(set.intersection(*[set(a) for a in arrays.values()]))
    if relayout:
        part = None
    else:
        part = _layout.partition(case)
        for side in ("q", "kv"):
            for r in range(w):
                if len(part[side][r]) != metas[r][f"rows_{side}"]:
                    raise Unusable(f"rank {r} holds {metas[r][f'rows_{side}']} {side} rows, the case's partition "
                                   f"gives it {len(part[side][r])}")
    inputs = {}
    for name in ("q", "k", "v", "dout"):
        if name not in tensors:
            continue
        side = SIDE[name]
        local = [arrays[r][name] for r in range(w)]
        dtype = np.float16 if case["dtype"] == "fp16" else np.float32
        if relayout:
            g = _layout.relayout_rows(local[0].astype(dtype, copy=False), rows, side, total[side], 0.0)
        else:
            g = np.zeros((total[side],) + local[0].shape[1:], dtype=dtype)
            for r in range(w):
                g[part[side][r]] = local[r]
        inputs[name] = g
    if "dout" not in inputs:
        shape = (total["q"], case["heads_q"], case["dim_v"])
        inputs["dout"] = np.zeros(shape, dtype=np.float16 if case["dtype"] == "fp16" else np.float32)
        notes.append("no dout recorded (no backward): dout is zero and only o and lse are checked")
    outputs = []
    for r in range(w):
        out = {}
        for name in OUTPUTS:
            if name not in tensors:
                continue
            a = arrays[r][name]
            if a.dtype == np.float16:
                a = a.astype(np.float32)
            if relayout:
                side = SIDE[name]
                if name == "lse":
                    a = _layout.relayout_rows(a, rows, side, total[side], fill=-np.inf, axis=1)
                else:
                    a = _layout.relayout_rows(a, rows, side, total[side], fill=0.0)
            out[name] = a
        outputs.append(out)
    checked = [n for n in OUTPUTS if n in outputs[0]]
    if "dout" not in tensors:
        checked = [n for n in checked if n in ("o", "lse")]
    info = {"tensors": checked, "pad_rows": meta.get("pad_rows", "zero") if not relayout else "zero",
            "empty_row_lse": meta.get("empty_row_lse", "neg-inf"), "relayout": relayout, "notes": notes,
            "missing": sorted({m for mm in metas.values() for m in mm.get("missing", [])})}
    return case, inputs, outputs, info


def _write_joined(target, case, inputs, outputs, info, entry):
    from ..candidate import write_global, write_ranks

    os.mkdir(target)   # FileExistsError: joined before (never replaced)
    _folder.write_case(target, case, inputs)
    candidate = os.path.join(target, "candidate.h5")
    if case["cp_size"] == 1:
        write_global(candidate, outputs[0], scope="global", lse_layout="ht")
    else:
        write_ranks(candidate, outputs, lse_layout="ht")
    record = dict(entry, **info, case=case)
    _folder.write_new_json(os.path.join(target, "join.json"), record)


def join(folder, progress=None):
    """Joins every captured call of a capture folder (see the module docstring); calls joined before are kept as they
    are. Returns a JoinResult (one entry per call). InputError (exit 2 of the command) when the folder is not a
    capture folder or holds files a capture does not write. progress: a callable taking each entry, or True for a
    line per call on stderr."""
    folder = _folder.require_capture_folder(os.fspath(folder))
    records = read_index(folder)
    result = JoinResult()
    result.not_captured = [r for r in records if r["status"] != "captured"]
    groups = groups_of(records)
    per_call = {}
    for call, key, _ in groups:
        per_call[call] = per_call.get(call, 0) + 1
    joined_root = os.path.join(folder, "joined")
    os.makedirs(joined_root, exist_ok=True)
    for call, key, recs in groups:
        name = joined_name(call, key, per_call[call] > 1)
        target = os.path.join(joined_root, name)
        first = min(recs, key=lambda r: r["index_rank"])
        entry = {"call": call, "dir": os.path.relpath(target, folder), "step": first.get("step", -1),
                 "layer": first.get("layer"), "order": first.get("order", 0), "source": first.get("source"),
                 "cp_size": first.get("cp_size", 1), "ranks": sorted(r["rank"] for r in recs),
                 "group": list(key) if per_call[call] > 1 else None}
        if os.path.lexists(target):
            if os.path.isfile(os.path.join(target, "join.json")):
                entry.update(status="exists")
            else:
                entry.update(status="unusable", reason=f"{entry['dir']} exists without join.json (a join that "
                                                        "stopped): remove that folder to join the call again")
        else:
            try:
                metas, arrays = _arrays_by_rank(folder, recs)
                case, inputs, outputs, info = assemble(metas, arrays)
                entry["status"] = "joined"
                _write_joined(target, case, inputs, outputs, info, entry)
            except Unusable as e:
                entry.update(status="unusable", reason=str(e))
            except (InputError, OSError, KeyError, ValueError) as e:
                entry.update(status="unusable", reason=f"{type(e).__name__}: {e}")
        result.append(entry)
        _progress(progress, entry)
    return result


def _progress(progress, entry):
    if progress is None or progress is False:
        return
    if callable(progress):
        progress(entry)
        return
    print(f"cpgold.capture join: {entry['call']}: {entry['status']}" +
          (f" ({entry['reason']})" if entry.get("reason") else ""), file=sys.stderr, flush=True)


def load_joined(call_dir):
    """(join record, case dict, inputs {q, k, v, dout}) of a joined call folder; InputError naming what is missing."""
    call_dir = os.fspath(call_dir)
    path = os.path.join(call_dir, "join.json")
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"{call_dir}: not a joined call ({path}: {e}); run `python3 -m cpgold.capture join "
                         "FOLDER` first", path) from None
    with open(os.path.join(call_dir, "case.json")) as f:
        case = json.load(f)
    with h5py.File(os.path.join(call_dir, "inputs.h5"), "r") as f:
        inputs = {n: np.asarray(f[n][()]) for n in ("q", "k", "v", "dout")}
    return record, case, inputs
