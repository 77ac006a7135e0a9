"""A ring (p2p) context-parallel attention in numpy, forward and backward, with CP mistakes that can be planted by name.

    PYTHONPATH=python:build/python python3 python/examples/planted_ring_attention.py

Written from TransformerEngine's p2p semantics on THD, not from cpgold's simulator: the partition, the masks, the
ring steps, the LSE merge and the backward are this file's own code (float64 arithmetic). The partition is checked
against the fixture's with cpgold.compare_partition by the tests; nothing else of the fixture's layout is used
except the cu_seqlens.

Every rank r holds chunks r and 2W-1-r of each sequence (padded length P_b split into 2W chunks of C_b = P_b / 2W
rows) and its share of the tail rows. At ring step s it computes its local Q against the K/V shard of rank
(r - s) mod W; with a causal mask the steps follow TE's sections (step 0 the diagonal, full Q against its own K/V;
owner < r: full Q against the owner's first chunk; owner > r: only the second half of Q, against the whole owner's
shard), masks evaluated on the global positions the rank believes its rows hold. Each step gives a partial O_s and
LSE_s; the merge is LSE = logaddexp over steps, O = sum_s O_s exp(LSE_s - LSE). The backward recomputes every step
with the merged O and LSE (dQ on the rank's rows, dK/dV accumulated on the owner's rows).

MISTAKES (`mistake=` of ring_attention):
  none                       the correct ring: passes `cpgold check` with no diagnosis
  contiguous_chunks          each rank holds chunks 2r and 2r+1 (no load balancing) but evaluates the masks (and
                             which rows hold tokens) as if it held chunks r and 2W-1-r; outputs come back in the
                             rank's contiguous order, and gathered globally through the contiguous layout
  counts_cu_div_w            a rank takes the first cu[b+1]//W - cu[b]//W rows of its 2 C_b rows of sequence b as
                             its tokens (TE's pad_between_seqs=False shortcut; cu the actual cumulative lengths),
                             each row at the position it holds in its chunk: pad rows inside that count are read
                             as tokens (NaN pads enter the arithmetic), real tokens past it are dropped (all their
                             outputs 0, LSE 0 as in a zeroed buffer)
  keyless_step_lse_0         the merge takes LSE_s = 0 (and O_s = 0) for a row of a computed step that saw no key,
                             instead of -inf: exp(0) is added to the row's sum
  running_o_not_rescaled     an online merge in step order that adds O_s exp(LSE_s - LSE_new) to the running O
                             without rescaling the running O by exp(LSE_old - LSE_new)
  right_edge_plus1_diagonal  in the diagonal step only (forward and backward) the causal edge lets the query at
                             position i see the key at position i + 1
  last_row_dropped           a rank's query count of each sequence is one short: its last valid query row is never
                             computed (O, dQ 0, LSE -inf), the row stays a key

REPLAY_NAME maps each mistake to the name `cpgold check`'s replay gives it.
"""
import sys

import numpy as np

import cpgold

MISTAKES = ("none", "contiguous_chunks", "counts_cu_div_w", "keyless_step_lse_0", "running_o_not_rescaled",
            "right_edge_plus1_diagonal", "last_row_dropped")
REPLAY_NAME = {"contiguous_chunks": "contiguous_chunks", "counts_cu_div_w": "counts_cu_div_w",
               "keyless_step_lse_0": "keyless_step_lse_0", "running_o_not_rescaled": "running_o_not_rescaled",
               "right_edge_plus1_diagonal": "right_edge+1:diagonal", "last_row_dropped": "last_row_dropped"}


class Shard:
    """One rank's rows of one side (q or kv), in the rank-local order.
    rows: the global row each local row is read from and written to; seq, pos: the sequence and position the rank
    believes the row holds (-1 on tail rows); token: the rank treats the row as a token; real: the global row holds a
    token; half: 0 for the rank's first chunk of a sequence, 1 for its second (-1 on tail rows)."""

    def __init__(self, rows, seq, pos, token, real, half):
        self.rows, self.seq, self.pos, self.token, self.real, self.half = (
            np.asarray(a) for a in (rows, seq, pos, token, real, half))


def shard(fx, rank, side, mistake="none"):
    """The Shard of `rank` on `side` ("q" or "kv") as the ring with `mistake` lays it out."""
    w = fx.cp_size
    offsets = fx.cu_seqlens(side, padded=True).astype(np.int64)
    cu = fx.cu_seqlens(side).astype(np.int64)
    lens = np.diff(cu)
    rows, seq, pos, token, real, half = [], [], [], [], [], []
    for b in range(len(lens)):
        c = (offsets[b + 1] - offsets[b]) // (2 * w)
        dual = (rank, 2 * w - 1 - rank)
        held = (2 * rank, 2 * rank + 1) if mistake == "contiguous_chunks" else dual
        block_pos = []
        for k in range(2):
            rows.append(offsets[b] + held[k] * c + np.arange(c))
            block_pos.append(dual[k] * c + np.arange(c))
            real.append(held[k] * c + np.arange(c) < lens[b])
            half.append(np.full(c, k))
        block_pos = np.concatenate(block_pos)
        pos.append(block_pos)
        seq.append(np.full(2 * c, b))
        if mistake == "counts_cu_div_w":
            token.append(np.arange(2 * c) < cu[b + 1] // w - cu[b] // w)
        elif mistake == "last_row_dropped" and side == "q":
            # the rank's query count of the sequence one short: its last valid row is never computed (as a key it
            # stays)
            t = block_pos < lens[b]
            if t.any():
                t[np.flatnonzero(t)[np.argmax(block_pos[t])]] = False
            token.append(t)
        else:
            token.append(block_pos < lens[b])
    tail = fx.total_rows(side) - offsets[-1]
    share = tail // w
    rows.append(offsets[-1] + rank * share + np.arange(share))
    for a, fill in ((seq, -1), (pos, -1), (half, -1)):
        a.append(np.full(share, fill))
    token.append(np.zeros(share, dtype=bool))
    real.append(np.zeros(share, dtype=bool))
    cat = [np.concatenate(a) if a else np.zeros(0) for a in (rows, seq, pos, token, real, half)]
    return Shard(cat[0].astype(np.int64), cat[1].astype(np.int64), cat[2].astype(np.int64), cat[3].astype(bool),
                 cat[4].astype(bool), cat[5].astype(np.int64))


def _visible(fx, q, kv, diagonal, mistake):
    """[Lq, Lkv] bool: key j visible to query i by the positions the rank believes (bottom-right alignment)."""
    lq = np.diff(fx.cu_seqlens("q"))
    lkv = np.diff(fx.cu_seqlens("kv"))
    same = (q.seq[:, None] == kv.seq[None, :]) & q.token[:, None] & kv.token[None, :] & (q.seq[:, None] >= 0)
    delta = (lkv - lq)[np.maximum(q.seq, 0)]
    d = kv.pos[None, :] - q.pos[:, None] - delta[:, None]  # key - query, aligned bottom-right
    wl, wr = fx.window
    if fx.causal:
        wr = 1 if diagonal and mistake == "right_edge_plus1_diagonal" else 0
    ok = same
    if wl >= 0:
        ok = ok & (d >= -wl)
    if wr >= 0:
        ok = ok & (d <= wr)
    return ok


def _mm(mask, a, b):
    """sum over j with mask[i, j] of a[i, j] * b[j]: a product over the visible pairs alone, so a NaN or Inf row of b
    that no row sees never reaches the result (0 x NaN is NaN in a plain matmul)."""
    a = np.where(mask, a, 0.0)
    if np.isfinite(b).all() and np.isfinite(a).all():
        return a @ b
    return np.where(mask[:, :, None], a[:, :, None] * b[None, :, :], 0.0).sum(axis=1)


def _load(x, sh):
    """The shard's rows of a global input, float64; rows the rank does not treat as tokens are never read."""
    out = np.zeros((len(sh.rows),) + x.shape[1:])
    out[sh.token] = x[sh.rows[sh.token]]
    return out


def _steps(fx, r, mistake):
    """[(step, owner, rows computed [Lq] bool or None for all)] of rank r, TE's causal sections."""
    w = fx.cp_size
    out = []
    for s in range(w):
        owner = (r - s) % w
        computed = None
        if fx.causal and s > 0 and owner > r:
            computed = "second_half"  # the "upper" section: only the rank's second chunk of Q runs
        out.append((s, owner, computed))
    return out


def ring_attention(fx, mistake="none", backward=True):
    """Every rank's outputs in its rank-local order: [{"o", "lse" [hq, Lq], "dq", "dk", "dv"}] (float32).
    mistake: one of MISTAKES (or a REPLAY_NAME value)."""
    names = {v: k for k, v in REPLAY_NAME.items()}
    mistake = names.get(mistake, mistake)
    if mistake not in MISTAKES:
        raise ValueError(f"mistake: expected one of {MISTAKES}, got {mistake!r}")
    w = fx.cp_size
    x = {k: np.asarray(v, dtype=np.float64) for k, v in fx.inputs().items()}
    hq, hkv = fx.heads_q, fx.heads_kv
    group = hq // hkv
    scale = fx.softmax_scale
    qs = [shard(fx, r, "q", mistake) for r in range(w)]
    kvs = [shard(fx, r, "kv", mistake) for r in range(w)]
    k_of = [_load(x["k"], s) for s in kvs]
    v_of = [_load(x["v"], s) for s in kvs]
    dk_of = [np.zeros_like(a) for a in k_of]
    dv_of = [np.zeros_like(a) for a in v_of]
    outputs = []
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for r in range(w):
            qsh = qs[r]
            q, dout = _load(x["q"], qsh), _load(x["dout"], qsh)
            n = len(qsh.rows)
            plan = []
            for s, owner, computed in _steps(fx, r, mistake):
                vis = _visible(fx, qsh, kvs[owner], s == 0, mistake)
                rows = np.ones(n, dtype=bool) if computed is None else qsh.half == 1
                vis &= rows[:, None]
                plan.append((s, owner, vis, rows))
            # forward: per-step partials, merged
            o = np.zeros((n, hq, x["v"].shape[2]))
            lse = np.full((hq, n), -np.inf)
            for h in range(hq):
                g = h // group
                partials = []
                for s, owner, vis, rows in plan:
                    scores = np.where(vis, scale * (q[:, h, :] @ k_of[owner][:, g, :].T), -np.inf)
                    seen = vis.any(axis=1)
                    m = np.where(seen, scores.max(axis=1, initial=-np.inf), 0.0)
                    p = np.where(vis, np.exp(scores - m[:, None]), 0.0)
                    total = p.sum(axis=1)
                    lse_s = np.where(seen, m + np.log(np.where(seen, total, 1.0)), -np.inf)
                    o_s = np.where(seen[:, None], _mm(vis, p, v_of[owner][:, g, :]) /
                                   np.where(seen, total, 1.0)[:, None], 0.0)
                    if mistake == "keyless_step_lse_0":
                        lse_s = np.where(rows & ~seen & qsh.token, 0.0, lse_s)
                    partials.append((o_s, lse_s))
                if mistake == "running_o_not_rescaled":
                    run_o = np.zeros_like(o[:, h, :])
                    run_lse = np.full(n, -np.inf)
                    for o_s, lse_s in partials:
                        new = np.logaddexp(run_lse, lse_s)
                        step = np.where(np.isfinite(lse_s), np.exp(lse_s - new), 0.0)
                        run_o = run_o + o_s * step[:, None]  # the mistake: run_o * exp(run_lse - new) is left out
                        run_lse = new
                    o[:, h, :], lse[h] = run_o, run_lse
                else:
                    all_lse = np.stack([l for _, l in partials])
                    merged = np.logaddexp.reduce(all_lse, axis=0)
                    acc = np.zeros_like(o[:, h, :])
                    for o_s, lse_s in partials:
                        acc += o_s * np.where(np.isfinite(lse_s), np.exp(lse_s - merged), 0.0)[:, None]
                    o[:, h, :], lse[h] = acc, merged
            o[~qsh.token] = 0.0
            lse[:, ~qsh.token] = np.where(qsh.real[~qsh.token], 0.0 if mistake == "counts_cu_div_w" else -np.inf,
                                          -np.inf)
            out = {"o": o, "lse": lse}
            if backward:
                dq = np.zeros_like(q)
                d = np.einsum("thd,thd->ht", dout, o)
                for s, owner, vis, rows in plan:
                    kk, vv = k_of[owner], v_of[owner]
                    for h in range(hq):
                        g = h // group
                        scores = scale * (q[:, h, :] @ kk[:, g, :].T)
                        p = np.where(vis, np.exp(scores - np.where(np.isfinite(lse[h]), lse[h], 0.0)[:, None]), 0.0)
                        dv_of[owner][:, g, :] += _mm(vis.T, p.T, dout[:, h, :])
                        dp = dout[:, h, :] @ vv[:, g, :].T
                        ds = np.where(vis, p * (dp - d[h][:, None]), 0.0)
                        dq[:, h, :] += scale * _mm(vis, ds, kk[:, g, :])
                        dk_of[owner][:, g, :] += scale * _mm(vis.T, ds.T, q[:, h, :])
                out["dq"] = dq
            outputs.append(out)
    if backward:
        for r in range(w):
            outputs[r]["dk"], outputs[r]["dv"] = dk_of[r], dv_of[r]
    return [{name: a.astype(np.float32) for name, a in out.items()} for out in outputs]


OUTPUT_SIDE = {"o": "q", "lse": "q", "dq": "q", "dk": "kv", "dv": "kv"}   # whose rows each output has


def scatter(outputs, total_rows, rows_of):
    """Every rank's outputs (float32; lse [h, t]) scattered to a global layout of total_rows(side) rows, rank r's
    local rows of a side landing on the global rows rows_of(r, side). Rows no rank holds stay 0 (LSE -inf)."""
    result = {}
    for name, local in outputs[0].items():
        t = total_rows(OUTPUT_SIDE[name])
        if name == "lse":
            result[name] = np.full((local.shape[0], t), -np.inf, dtype=np.float32)
        else:
            result[name] = np.zeros((t,) + local.shape[1:], dtype=np.float32)
    for r, out in enumerate(outputs):
        for name, local in out.items():
            rows = rows_of(r, OUTPUT_SIDE[name])
            if name == "lse":
                result[name][:, rows] = local
            else:
                result[name][rows] = local
    return result


def gather(fx, outputs, mistake="none"):
    """Every rank's outputs scattered to the global layout through the rows the rank really holds (the contiguous
    layout under contiguous_chunks). Rows no rank holds stay 0 (LSE -inf)."""
    names = {v: k for k, v in REPLAY_NAME.items()}
    mistake = names.get(mistake, mistake)
    return scatter(outputs, fx.total_rows, lambda r, side: shard(fx, r, side, mistake).rows)


CASES = {
    "none": {"seqlens_q": [57, 13, 30], "cp_size": 3, "mask": "causal", "heads_q": 4, "heads_kv": 2, "dim_qk": 32,
             "pad_fill": "nan", "total_tokens_q": 138},
    "contiguous_chunks": {"seqlens_q": [48, 16, 32], "cp_size": 2, "mask": "causal", "heads_q": 4, "heads_kv": 2,
                          "dim_qk": 32},
    "counts_cu_div_w": {"seqlens_q": [57, 13, 30], "cp_size": 2, "mask": "causal", "heads_q": 4, "heads_kv": 2,
                        "dim_qk": 32, "pad_fill": "nan"},
    "keyless_step_lse_0": {"seqlens_q": [1, 2, 37, 5, 3], "cp_size": 3, "mask": "none", "heads_q": 4, "heads_kv": 2,
                           "dim_qk": 32, "dtype": "fp32"},
    "running_o_not_rescaled": {"seqlens_q": [57, 13, 30], "cp_size": 3, "mask": "causal", "heads_q": 4,
                               "heads_kv": 2, "dim_qk": 32},
    "right_edge_plus1_diagonal": {"seqlens_q": [57, 13, 30], "cp_size": 2, "mask": "causal", "heads_q": 4,
                                  "heads_kv": 2, "dim_qk": 32},
    "last_row_dropped": {"seqlens_q": [57, 13, 30], "cp_size": 2, "mask": "causal", "heads_q": 4, "heads_kv": 2,
                         "dim_qk": 32},
}


def _replay_mistake(finding):
    replay = (finding.get("where") or {}).get("replay")
    return replay.get("mistake") if isinstance(replay, dict) else None


def first_line(report):
    if report["pass"]:
        return "PASS" + (" (diagnosis: " + ", ".join(d["kind"] for d in report["diagnosis"]) + ")"
                         if report["diagnosis"] else "")
    if not report["diagnosis"]:
        return "FAIL (no diagnosis)"
    d = report["diagnosis"][0]
    return f"FAIL diagnosis: {d['kind']}: {d['evidence']}"


def main():
    failed = 0
    for mistake in MISTAKES:
        fx = cpgold.generate(CASES[mistake])
        outputs = ring_attention(fx, mistake)
        print(f"{mistake} (replay name {REPLAY_NAME.get(mistake, '-')}): {fx.case_json}")
        for form, tensors in (("o,lse", "o,lse"), ("all", None)):
            picked = [{n: a for n, a in out.items() if tensors is None or n in ("o", "lse")} for out in outputs]
            every = cpgold.check_outputs(fx, picked, tensors=tensors, lse_layout="ht")
            glob = cpgold.check_outputs(fx, gather(fx, picked, mistake), scope="cp_gathered", tensors=tensors,
                                        lse_layout="ht")
            for label, report in (("every rank", every), ("gathered,  ", glob)):
                print(f"  {label} {form}: {first_line(report)}")
                named = [d for d in report["diagnosis"][1:] if _replay_mistake(d) == REPLAY_NAME.get(mistake)]
                if named and _replay_mistake(report["diagnosis"][0]) != REPLAY_NAME.get(mistake):
                    print(f"      also {named[0]['kind']}: {named[0]['evidence']}")
            if (mistake == "none") != (every["pass"] and glob["pass"]):
                failed += 1
        fx.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
