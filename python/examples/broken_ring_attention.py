"""A ring (p2p) CP attention forward in numpy with a deliberate bug, shrunk to its smallest failing case.

    PYTHONPATH=python:build/python python3 python/examples/broken_ring_attention.py

Each rank holds its two chunks of every sequence (fx.partitioned_indices), receives every other rank's K/V shard
over W ring steps and merges the partial results by their LSE. The bug: a rank takes its number of valid rows of
sequence b as cu_seqlens[b+1] // W - cu_seqlens[b] // W (a shortcut that holds only when every length splits evenly
over the 2W chunks) and leaves its rows past that count unwritten. `cpgold.shrink` starts from a case of 1,700 tokens
in 5 sequences with GQA, a window and NaN pads, and reaches one sequence of a few tokens that fails the same way
(diagnosis tail_rows_missing). docs/shrink.md shows the output; python/tests/test_shrink.py runs this file and the
Hypothesis test below.
"""
import sys

import numpy as np

import cpgold


def _positions(fx, side):
    """Sequence and position of every global row (-1 on pad and tail rows)."""
    cu = fx.cu_seqlens(side, padded=True)
    lens = fx.seqlens(side)
    seq = np.full(fx.total_rows(side), -1)
    pos = np.full(fx.total_rows(side), -1)
    for b, n in enumerate(lens):
        seq[cu[b]:cu[b] + n] = b
        pos[cu[b]:cu[b] + n] = np.arange(n)
    return seq, pos


def ring_attention(fx, bug=True):
    """Forward outputs (o, lse [h, t]) of every rank in its rank-local layout, as a ring of fx.cp_size ranks."""
    w = fx.cp_size
    x = {k: v.astype(np.float32) for k, v in fx.inputs().items()}
    for name, side in (("q", "q"), ("k", "kv"), ("v", "kv")):
        x[name][~fx.valid_rows(side)] = 0.0  # pad and tail rows hold garbage (NaN, inf) on purpose
    hq, hkv = fx.heads_q, fx.heads_kv
    group = hq // hkv
    wl, wr = fx.window
    sq, pq = _positions(fx, "q")
    sk, pk = _positions(fx, "kv")
    delta = fx.seqlens("kv").astype(np.int64) - fx.seqlens("q").astype(np.int64)  # bottom-right alignment
    cu = fx.cu_seqlens("q")
    outputs = []
    for r in range(w):
        qi = fx.partitioned_indices(r, "q")
        rows = sq[qi] >= 0  # the local rows that hold a token
        if bug:
            # The shortcut: the first cu[b+1] // W - cu[b] // W local rows of sequence b are taken as its valid rows.
            local = fx.rank_cu_seqlens(r, "q", padded=True)
            for b in range(len(cu) - 1):
                first = local[b] + (cu[b + 1] // w - cu[b] // w)
                rows[first:local[b + 1]] = False
        q = x["q"][qi]
        m = np.full((hq, len(qi)), -np.inf)
        s = np.zeros((hq, len(qi)))
        acc = np.zeros((len(qi), hq, x["v"].shape[2]))
        for step in range(w):
            ki = fx.partitioned_indices((r - step) % w, "kv")  # the K/V shard that reaches rank r at this step
            k, v = x["k"][ki], x["v"][ki]
            same = (sq[qi][:, None] == sk[ki][None, :]) & rows[:, None] & (sk[ki][None, :] >= 0)
            d = pk[ki][None, :] - pq[qi][:, None] - delta[np.maximum(sq[qi], 0)][:, None]  # key - query, aligned
            visible = same.copy()
            if fx.causal:
                visible &= d <= 0
            if wl >= 0:
                visible &= d >= -wl
            if wr >= 0:
                visible &= d <= wr
            for h in range(hq):
                scores = fx.softmax_scale * (q[:, h, :] @ k[:, h // group, :].T)
                scores = np.where(visible, scores, -np.inf)
                step_max = scores.max(axis=1, initial=-np.inf)
                new_m = np.maximum(m[h], step_max)
                safe = np.where(np.isfinite(new_m), new_m, 0.0)
                p = np.exp(scores - safe[:, None])
                keep = np.where(np.isfinite(m[h]), np.exp(m[h] - safe), 0.0)
                s[h] = s[h] * keep + p.sum(axis=1)
                acc[:, h, :] = acc[:, h, :] * keep[:, None] + p @ v[:, h // group, :]
                m[h] = new_m
        with np.errstate(divide="ignore", invalid="ignore"):
            o = np.where(s.T[:, :, None] > 0, acc / s.T[:, :, None], 0.0)
            lse = np.where(s > 0, m + np.log(s), -np.inf)
        o[~rows] = 0.0
        lse[:, ~rows] = np.where(sq[qi][~rows] >= 0, 0.0, -np.inf)  # unwritten rows of the bug hold 0
        outputs.append({"o": o.astype(np.float32), "lse": lse.astype(np.float32)})
    return outputs


START = {"seqlens_q": [700, 3, 0, 512, 401], "padded_q": [712, 16, 8, 520, 408], "heads_q": 8, "heads_kv": 2,
         "dim_qk": 64, "mask": "causal", "window": [300, 0], "cp_size": 4, "comm": "p2p", "pad_fill": "nan", "seed": 7}


def main():
    result = cpgold.shrink(START, ring_attention, tensors=("o", "lse"), lse_layout="ht",
                           progress=lambda p: print(f"run {p['run']} ({p['seconds']:.1f} s): {p['change']}: "
                                                    f"{p['verdict']['status']}{', kept' if p['kept'] else ''}",
                                                    file=sys.stderr))
    print(result)
    fixed = cpgold.generate(result.case)
    report = cpgold.check_outputs(fixed, ring_attention(fixed, bug=False), tensors=("o", "lse"), lse_layout="ht")
    print(f"the same case without the bug: {'PASS' if report.passed else 'FAIL'}")
    return 0 if result.smaller and report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
