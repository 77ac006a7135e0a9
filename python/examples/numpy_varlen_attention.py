"""A varlen attention in plain numpy (float32 arithmetic), written the way a user's kernel is called: valid tokens
compacted sequence after sequence, cu_seqlens of the actual lengths, FlashAttention's bottom-right mask alignment.
It stands for "your attention" in test_my_attention.py, and the tests use its deliberate mistakes to show that
`cpgold check` fails a wrong implementation.

MISTAKES (each a bug seen in real CP/varlen code):
  top_left      causal/window diagonal aligned top-left (row i sees keys <= i) instead of bottom-right
  gqa_modulo    query head h reads kv head h % hkv instead of h // (hq / hkv)
  lse_log2      LSE returned in log2 units (the exp2-domain value a kernel keeps internally)
"""
import numpy as np

MISTAKES = ("top_left", "gqa_modulo", "lse_log2")


def visible(lq, lkv, causal, window, mistake=None):
    """[lq, lkv] bool: key j visible to query i of one sequence (window (left, right), -1 unbounded)."""
    i = np.arange(lq)[:, None]
    j = np.arange(lkv)[None, :]
    delta = 0 if mistake == "top_left" else lkv - lq
    ok = np.ones((lq, lkv), dtype=bool)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        ok &= j >= i + delta - left
    if right >= 0:
        ok &= j <= i + delta + right
    return ok


def round_to(x, dtype):
    """float32 -> values of bf16/fp16/fp32 (round to nearest even), kept as float32: what a kernel stores."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "fp32":
        return x
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float32)
    if dtype != "bf16":
        raise ValueError(f"dtype: expected bf16, fp16 or fp32, got {dtype!r}")
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def varlen_attention(q, k, v, dout, cu_seqlens_q, cu_seqlens_kv, scale, causal, window, mistake=None):
    """Forward and backward on compacted tokens.
    q [tq, hq, dqk], k [tkv, hkv, dqk], v [tkv, hkv, dv], dout [tq, hq, dv]; cu_seqlens [B+1].
    Returns float32 o [tq, hq, dv], lse [hq, tq] (-inf on rows with no visible key), dq, dk, dv."""
    if mistake is not None and mistake not in MISTAKES:
        raise ValueError(f"mistake: expected one of {MISTAKES}, got {mistake!r}")
    q, k, v, dout = (np.asarray(x, dtype=np.float32) for x in (q, k, v, dout))
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    o = np.zeros((q.shape[0], hq, v.shape[2]), np.float32)
    lse = np.full((hq, q.shape[0]), -np.inf, np.float32)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(len(cu_seqlens_q) - 1):
        rq = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        rk = slice(int(cu_seqlens_kv[b]), int(cu_seqlens_kv[b + 1]))
        lq, lkv = rq.stop - rq.start, rk.stop - rk.start
        if lq == 0:
            continue
        mask = visible(lq, lkv, causal, window, mistake)
        seen = mask.any(axis=1)
        for h in range(hq):
            g = h % hkv if mistake == "gqa_modulo" else h // group
            s = np.where(mask, np.float32(scale) * (q[rq, h] @ k[rk, g].T), np.float32(-np.inf))
            m = np.where(seen, s.max(axis=1, initial=-np.inf), 0).astype(np.float32)
            p = np.where(mask, np.exp(s - m[:, None]), 0).astype(np.float32)
            row_lse = np.where(seen, m + np.log(np.where(seen, p.sum(axis=1), 1)), -np.inf).astype(np.float32)
            p = np.where(mask, np.exp(s - np.where(seen, row_lse, 0)[:, None]), 0).astype(np.float32)
            oh = p @ v[rk, g]
            o[rq, h] = oh
            lse[h, rq] = row_lse / np.float32(np.log(2)) if mistake == "lse_log2" else row_lse
            dp = dout[rq, h] @ v[rk, g].T
            ds = p * (dp - (dout[rq, h] * oh).sum(axis=1)[:, None])
            dq[rq, h] = np.float32(scale) * (ds @ k[rk, g])
            dk[rk, g] += np.float32(scale) * (ds.T @ q[rq, h])
            dv[rk, g] += p.T @ dout[rq, h]
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def attention_on_fixture(fixture, mistake=None):
    """Runs varlen_attention on a cpgold.Fixture's inputs and returns global-layout outputs: O, dQ, dK, dV rounded
    to the case dtype (as a kernel stores them), zero on pad and tail rows; LSE [hq, Tq] float32."""
    x = fixture.inputs()
    compact = {n: fixture.compact(x[n], "q" if n in ("q", "dout") else "kv") for n in x}
    out = varlen_attention(compact["q"], compact["k"], compact["v"], compact["dout"], fixture.cu_seqlens("q"),
                           fixture.cu_seqlens("kv"), fixture.softmax_scale, fixture.causal, fixture.window, mistake)
    result = {"lse": fixture.expand(out["lse"], "q", axis=1, fill=-np.inf)}
    for name, side in (("o", "q"), ("dq", "q"), ("dk", "kv"), ("dv", "kv")):
        result[name] = fixture.expand(round_to(out[name], fixture.dtype), side)
    return result
