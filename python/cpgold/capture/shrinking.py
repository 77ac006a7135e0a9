"""shrink: from a captured call whose attention fails, the smallest case cut out of the captured tensors on which the
user's attention still fails the same way (docs/capture.md, "shrink").

cpgold.shrink searches over seeded cases; a captured failure lives in its captured values, so here every cut keeps
them: a cut drops sequences, shortens sequences (keeping their first tokens, K/V with Q where they are laid out
alike), drops KV heads with their query heads (GQA groups stay whole) or query heads of every group alike, or runs on
fewer CP ranks (the captured rows re-laid for W' ranks: padded lengths rounded to 2W', pad and tail rows filled from
the captured pad rows, so NaN pads stay NaN). After each cut the golden is made from the cut inputs
(cpgold.generate(case, inputs=...)), the user's function runs on that fixture (as cpgold.shrink's fn: it returns
global outputs or every rank's) and the cut is kept only while the check still fails with every diagnosis kind of the
original failure. Cuts are tried greedily, biggest first, until none is kept, the budget is spent or max_runs is
reached. The smallest case is saved as case.json and inputs.h5, which
`cpgold gen --case "$(cat case.json)" --inputs inputs.h5 -o X.h5` turns into its fixture.
"""
import json
import os
import time

import h5py
import numpy as np

from ..errors import CheckInputError, InputError
from . import _folder
from .joining import load_joined


def _rows(case, side):
    lens = [int(x) for x in case[f"seqlens_{side}"]]
    padded = [int(x) for x in case[f"padded_{side}"]]
    offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    return lens, padded, offsets, int(case[f"total_tokens_{side}"])


def _round(n, m):
    return (n + m - 1) // m * m


def _pad_pool(x, lens, offsets, total):
    """The captured pad and tail rows of a tensor, in order (what new pad rows are filled from)."""
    idx = []
    for b, n in enumerate(lens):
        idx.extend(range(offsets[b] + n, offsets[b + 1]))
    idx.extend(range(offsets[-1], total))
    return x[np.asarray(idx, dtype=np.int64)] if idx else None


def _fill(pool, n, like):
    if n == 0:
        return np.zeros((0,) + like.shape[1:], dtype=like.dtype)
    if pool is None or len(pool) == 0:
        return np.zeros((n,) + like.shape[1:], dtype=like.dtype)
    reps = -(-n // len(pool))
    return np.concatenate([pool] * reps)[:n]


def cut(case, inputs, keep=None, lengths=None, cp_size=None, kv_heads=None, group=None):
    """A new (case, inputs) cut out of (case, inputs): keep (sequences kept, in order), lengths ({side: [new length per
    kept sequence]}), cp_size (W'), kv_heads (KV heads kept), group (query heads kept per KV head: the first ones).
    The case is not validated here."""
    w_old = int(case["cp_size"])
    w = int(cp_size or w_old)
    b_all = len(case["seqlens_q"])
    keep = list(range(b_all)) if keep is None else list(keep)
    hkv, hq = int(case["heads_kv"]), int(case["heads_q"])
    g_old = hq // hkv
    kv_heads = list(range(hkv)) if kv_heads is None else list(kv_heads)
    g = g_old if group is None else int(group)
    q_heads = [h * g_old + j for h in kv_heads for j in range(g)]
    new_case = {k: v for k, v in case.items() if k not in ("padded_q", "padded_kv", "total_tokens_q",
                                                           "total_tokens_kv", "seqlens_q", "seqlens_kv")}
    new_inputs = {}
    for side, names in (("q", ("q", "dout")), ("kv", ("k", "v"))):
        lens, padded, offsets, total = _rows(case, side)
        new_lens = [lens[b] for b in keep] if lengths is None or side not in lengths else list(lengths[side])
        extra = [max(padded[b] - _round(lens[b], 2 * w_old), 0) for b in keep]
        new_padded = [_round(n, 2 * w) + _round(e, 2 * w) if e else _round(n, 2 * w)
                      for n, e in zip(new_lens, extra)]
        tail = total - int(offsets[-1])
        if tail and case.get("comm", "p2p") == "p2p":
            new_tail = max(tail // w, 1) * w
        else:
            new_tail = 0
        new_case[f"seqlens_{side}"] = new_lens
        new_case[f"padded_{side}"] = new_padded
        new_case[f"total_tokens_{side}"] = int(sum(new_padded) + new_tail)
        for name in names:
            x = inputs[name]
            heads = q_heads if side == "q" else kv_heads
            x = x[:, heads]
            pool = _pad_pool(x, lens, offsets, total)
            parts = []
            for b, n, p in zip(keep, new_lens, new_padded):
                parts.append(x[offsets[b]:offsets[b] + n])
                parts.append(_fill(pool, p - n, x))
            parts.append(_fill(pool, new_tail, x))
            new_inputs[name] = np.ascontiguousarray(np.concatenate(parts))
    new_case.update(cp_size=w, heads_kv=len(kv_heads), heads_q=len(q_heads))
    if w == 1 or new_case.get("comm") in ("p2p", "all_gather"):
        new_case.pop("a2a_size", None)
    if w == 1:
        new_case["comm"] = "p2p"
    return new_case, new_inputs


def _candidates(case):
    """Cuts of a case, biggest first: [(description, keyword arguments of cut)]."""
    out = []
    b = len(case["seqlens_q"])
    w = int(case["cp_size"])
    same = case["seqlens_q"] == case["seqlens_kv"]
    if b > 1:
        out.append((f"keep sequences 0..{b // 2 - 1} of {b}", dict(keep=list(range(b // 2)))) if b > 2 else None)
        for i in range(b):
            out.append((f"drop sequence {i}", dict(keep=[j for j in range(b) if j != i])))
    for w2 in sorted({1, 2, w // 2, w - 1}):
        if 1 <= w2 < w:
            out.append((f"cp_size {w} -> {w2}", dict(cp_size=w2)))
    lq, lkv = list(case["seqlens_q"]), list(case["seqlens_kv"])
    for i in range(b):
        for side_lens, sides in (((lq, lkv), ("q", "kv")),) if same else (((lq,), ("q",)), ((lkv,), ("kv",))):
            n = side_lens[0][i]
            for m in sorted({n // 2, n - max(1, n // 4), n - 1}):
                if 0 < m < n:
                    lengths = {}
                    for s, ls in zip(sides, side_lens):
                        new = list(ls)
                        new[i] = m
                        lengths[s] = new
                    out.append((f"sequence {i}: {'/'.join(sides)} length {n} -> {m}", dict(lengths=lengths)))
    hkv, hq = int(case["heads_kv"]), int(case["heads_q"])
    g = hq // hkv
    if hkv > 1:
        out.append((f"KV heads {hkv} -> {hkv // 2} (with their query heads)", dict(kv_heads=list(range(hkv // 2)))))
        for h in range(hkv):
            out.append((f"drop KV head {h} (with its {g} query heads)",
                        dict(kv_heads=[x for x in range(hkv) if x != h])))
    for g2 in sorted({1, g // 2, g - 1}):
        if 1 <= g2 < g:
            out.append((f"query heads per KV head {g} -> {g2}", dict(group=g2)))
    return [c for c in out if c is not None]


def _save(out, case, inputs):
    _folder.write_new_bytes(os.path.join(out, "case.json"), (json.dumps(case) + "\n").encode())

    def fill(tmp):
        with h5py.File(tmp, "x") as f:
            for name in ("q", "k", "v", "dout"):
                f.create_dataset(name, data=inputs[name])
    _folder.write_new(os.path.join(out, "inputs.h5"), fill)


def shrink(call_dir, fn, *, budget=None, max_runs=None, out=None, scope="global", lse_layout=None, progress=None,
           diagnosis=True):
    """The smallest case cut out of a joined call's captured tensors on which fn still fails with the original
    failure's diagnosis kinds (see the module docstring).

    call_dir: a joined call folder (FOLDER/joined/<call>). fn(fixture) -> outputs, as for cpgold.shrink: a dict of
    o, lse, dq, dk, dv in the global layout (checked with `scope`), or a list of every rank's dicts in the rank-local
    layout; an exception or None counts as "no candidate" (the cut is not kept). budget (seconds) and max_runs bound
    the search. out: the folder for case.json, inputs.h5 and shrink.json (default call_dir/shrunk; a new or empty
    folder). progress: called with a dict after every run. Returns a dict: original and smallest (cases), kinds,
    steps (the cuts kept), runs, seconds, stopped, report (the check report of fn on the smallest case), case_path,
    inputs_path, reproduce. InputError when fn's outputs on the captured case pass (nothing to shrink)."""
    from ..cases import generate, normalize_case
    from ..check import check_outputs

    record, case, inputs = load_joined(call_dir)
    options = dict(tensors=record.get("tensors"), empty_row_lse=record.get("empty_row_lse"),
                   pad_rows=record.get("pad_rows"), lse_layout=lse_layout, diagnosis=diagnosis)
    for name, value in (("budget", budget), ("max_runs", max_runs)):
        if value is not None and not value >= 0:
            raise InputError(f"{name}: expected a value >= 0 (None: no bound), got {value!r}", name)
    out = os.fspath(out) if out is not None else os.path.join(os.fspath(call_dir), "shrunk")
    if os.path.lexists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise InputError(f"out: {out!r} exists and is not an empty folder: shrink never writes over files", "out")
    start = time.monotonic()
    runs = 0

    def run(c, x):
        nonlocal runs
        runs += 1
        try:
            c = normalize_case(c)
        except InputError as e:
            return "invalid", None, str(e)
        fixture = generate(c, inputs=x, allow_nonfinite=True)
        try:
            try:
                outputs = fn(fixture)
            except Exception as e:  # noqa: BLE001 - the implementation under test failed: no candidate
                return "no_candidate", None, f"fn raised {type(e).__name__}: {e}"
            if outputs is None:
                return "no_candidate", None, "fn returned None"
            try:
                report = check_outputs(fixture, outputs, scope=scope, **options)
            except (InputError, CheckInputError) as e:
                return "no_candidate", None, f"the outputs are unusable: {e}"
            return ("passes" if report.passed else "fails"), report, ""
        finally:
            fixture.close()

    status, report, detail = run(case, inputs)
    if status != "fails":
        raise InputError(f"fn: on the captured case fn's outputs {'pass their check' if status == 'passes' else detail}"
                         ": there is no failure to shrink", "fn")
    kinds = {d["kind"] for d in report.get("diagnosis", [])}
    best_case, best_inputs, best_report = case, inputs, report
    steps = []
    stopped = "minimal"
    progress_fn = progress if callable(progress) else None
    changed = True
    while changed:
        changed = False
        for label, cut_args in _candidates(best_case):
            if budget is not None and time.monotonic() - start >= budget:
                stopped = "budget"
                break
            if max_runs is not None and runs >= max_runs:
                stopped = "max_runs"
                break
            try:
                c, x = cut(best_case, best_inputs, **cut_args)
            except (ValueError, IndexError) as e:
                status, rep, detail = "invalid", None, str(e)
            else:
                status, rep, detail = run(c, x)
            kept = status == "fails" and kinds <= {d["kind"] for d in rep.get("diagnosis", [])}
            if progress_fn is not None:
                progress_fn({"run": runs, "seconds": time.monotonic() - start, "change": label, "verdict": status,
                             "kept": kept, "detail": detail})
            if kept:
                best_case, best_inputs, best_report = normalize_case(c), x, rep
                steps.append(label)
                changed = True
                break
        else:
            continue
        if stopped != "minimal":
            break
    os.makedirs(out, exist_ok=True)
    _save(out, best_case, best_inputs)
    case_path, inputs_path = os.path.join(out, "case.json"), os.path.join(out, "inputs.h5")
    result = {"original": json.dumps(case), "smallest": json.dumps(best_case), "kinds": sorted(kinds),
              "steps": steps, "runs": runs, "seconds": time.monotonic() - start, "stopped": stopped,
              "case_path": case_path, "inputs_path": inputs_path,
              "reproduce": f"cpgold gen --case \"$(cat {case_path})\" --inputs {inputs_path} -o case.h5",
              "summary": [f"diagnosis: {d['kind']}: {d['evidence']}" for d in best_report.get("diagnosis", [])]}
    _folder.write_new_json(os.path.join(out, "shrink.json"), result)
    result["report"] = best_report
    return result
