"""What one recorded call says about its layout (the `meta` of a call file), and how the calls of the CP ranks of one
attention become one cpgold case in the global padded THD layout.

A call's meta (JSON, attribute `meta_json` of calls/<call>/rank<G>.h5):
    call, step, layer, occurrence, source ("te", "fa3", "fa4", "varlen", "user"), rank (global rank G),
    cp_rank, cp_size, cp_group (global ranks of the CP group, in CP-rank order, or null), comm, a2a_size,
    cu_seqlens_q, cu_seqlens_kv (global cumulative token counts), cu_seqlens_q_padded, cu_seqlens_kv_padded (global
    row offsets of the sequences, or null: the rows are packed at cu_seqlens), rows_q, rows_kv (this rank's rows),
    causal, window [left, right] (-1 unbounded, bottom-right aligned), softmax_scale, dtype ("bf16", "fp16", "fp32"),
    heads_q, heads_kv, dim_qk, dim_v (as stored), heads_total_q, heads_total_kv and kv_heads (the KV heads kept when
    heads= selects some), lse (whether LSE was recorded), pad_rows ("zero" or "unwritten": what the implementation
    writes on pad rows), empty_row_lse ("neg-inf" or "pos-inf"), tensors (datasets stored), missing (gradients
    expected but never seen), notes.
"""
import json

import numpy as np

from ..errors import InputError

INPUTS = ("q", "k", "v", "dout")
SIDE = {"q": "q", "dout": "q", "o": "q", "lse": "q", "dq": "q", "k": "kv", "v": "kv", "dk": "kv", "dv": "kv"}


class Unusable(Exception):
    """The shards of a call do not make a cpgold case (the message says why)."""


def _lengths(cu, what):
    cu = [int(x) for x in cu]
    if len(cu) < 2:
        raise Unusable(f"{what}: {cu}: needs at least one sequence ([0, n])")
    d = np.diff(np.asarray(cu, dtype=np.int64))
    if (d < 0).any():
        raise Unusable(f"{what}: {cu} is not non-decreasing")
    return cu, [int(x) for x in d]


def layout_keys(meta):
    """The layout keys every rank of a call must agree on."""
    keys = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "causal", "window",
            "softmax_scale", "dtype", "heads_q", "heads_kv", "dim_qk", "dim_v", "cp_size", "comm", "a2a_size",
            "lse", "pad_rows", "empty_row_lse", "source", "kv_heads")
    return {k: meta.get(k) for k in keys}


def case_of(meta, relayout=False):
    """(case dict, rows) for the call: rows = {"q": (offsets, lengths), "kv": ...} of the layout the captured tensors
    are in (relayout False) or of a new layout where every sequence starts at a row of its own, padded to a multiple of
    2 (relayout True, one rank only)."""
    w = int(meta["cp_size"])
    case = {}
    rows = {}
    for side in ("q", "kv"):
        cu, lengths = _lengths(meta[f"cu_seqlens_{side}"], f"cu_seqlens_{side}")
        if cu[0] != 0:
            raise Unusable(f"cu_seqlens_{side}: {cu} does not start at 0")
        padded = meta.get(f"cu_seqlens_{side}_padded")
        total = int(meta[f"rows_{side}"]) * w
        if relayout:
            starts_old = [int(x) for x in (padded if padded is not None else cu)[:-1]]
            plens = [n + (n % 2) for n in lengths]
            offsets = np.concatenate([[0], np.cumsum(plens)]).astype(np.int64).tolist()
            rows[side] = (starts_old, offsets, lengths)
            case[f"padded_{side}"] = plens
            case[f"total_tokens_{side}"] = int(offsets[-1])
        else:
            if padded is not None:
                pcu, plens = _lengths(padded, f"cu_seqlens_{side}_padded")
            else:
                pcu, plens = cu, lengths
            if pcu[0] != 0:
                raise Unusable(f"cu_seqlens_{side}_padded: {pcu} does not start at 0 (rows before the first sequence)")
            if len(pcu) != len(cu):
                raise Unusable(f"cu_seqlens_{side}_padded has {len(pcu) - 1} sequences, cu_seqlens_{side} "
                               f"{len(cu) - 1}")
            short = [b for b in range(len(lengths)) if plens[b] < lengths[b]]
            if short:
                b = short[0]
                raise Unusable(f"sequence {b}: {lengths[b]} {side} tokens in a padded range of {plens[b]} rows "
                               f"(cu_seqlens_{side} {cu}, padded {pcu})")
            if pcu[-1] > total:
                raise Unusable(f"{side}: the sequences end at row {pcu[-1]}, the ranks hold {total} rows in all")
            rows[side] = (pcu[:-1], pcu, lengths)
            case[f"padded_{side}"] = plens
            case[f"total_tokens_{side}"] = total
        case[f"seqlens_{side}"] = lengths
    case.update(heads_q=int(meta["heads_q"]), heads_kv=int(meta["heads_kv"]), dim_qk=int(meta["dim_qk"]),
                dim_v=int(meta["dim_v"]), dtype=meta["dtype"], mask="causal" if meta["causal"] else "none",
                window=[int(x) for x in meta["window"]], cp_size=w, comm=meta["comm"] if w > 1 else "p2p",
                softmax_scale=float(meta["softmax_scale"]), seed=0)
    if case["comm"] == "a2a+p2p":
        case["a2a_size"] = int(meta["a2a_size"])
    return case, rows


def normalized(case):
    """The case as the core normalises it (InputError naming the key otherwise)."""
    from ..cases import normalize_case

    return normalize_case(case)


def relayout_rows(x, rows, side, total, fill=0.0, axis=0):
    """A tensor of the captured layout moved to the new layout of case_of(relayout=True): each sequence's valid rows
    copied, every other row `fill`."""
    starts_old, offsets, lengths = rows[side]
    shape = list(x.shape)
    shape[axis] = total
    out = np.full(shape, fill, dtype=x.dtype)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        src = [slice(None)] * x.ndim
        dst = [slice(None)] * x.ndim
        src[axis] = slice(starts_old[b], starts_old[b] + n)
        dst[axis] = slice(offsets[b], offsets[b] + n)
        out[tuple(dst)] = x[tuple(src)]
    return out


def partition(case):
    """{"q": [rows of rank 0, ...], "kv": [...]}: the global row of every rank-local row (the core's partition,
    TransformerEngine's thd_get_partitioned_indices)."""
    from .._core_loader import core

    result = core().rank_rows(json.dumps(case))
    return {side: [np.asarray(r, dtype=np.int64) for r in result[side]] for side in ("q", "kv")}


def check_meta(meta, field="meta"):
    """InputError naming the key when a call's meta lacks what join needs."""
    need = ("call", "step", "layer", "source", "rank", "cp_rank", "cp_size", "cu_seqlens_q", "cu_seqlens_kv",
            "rows_q", "rows_kv", "causal", "window", "softmax_scale", "dtype", "heads_q", "heads_kv", "dim_qk",
            "dim_v", "tensors")
    missing = [k for k in need if k not in meta]
    if missing:
        raise InputError(f"{field}: the call's layout lacks {', '.join(missing)}", field)
