#!/usr/bin/env python3
"""TE-2: in TransformerEngine's p2p context parallelism, a ring step that holds a query row's sequence but none of
its keys scales the row's output by S / (S + 1), with torch and TransformerEngine alone
(docs/findings/te-2-p2p-keyless-step.md).

    python3 te2_p2p_keyless_step.py [--case NAME ...] [--timeout S]      2 GPUs: the CP forward
    python3 te2_p2p_keyless_step.py --stats                              1 GPU: the softmax statistics it merges

CP (2 GPUs): TE's DotProductAttention with cp_comm_type p2p on 2 ranks, one process per GPU over NCCL, cuDNN
FusedAttention, no mask. Each process holds its rank's rows (tex.thd_get_partitioned_indices) and the global
cu_seqlens. O of every valid row is compared with a plain attention in float64 on the CPU (written below), and with
the value the finding predicts: O * exp(LSE) / (exp(LSE) + n), n the ring steps that hold none of the row's keys.
Cases (bf16, no mask, 2 ranks):
  one_token      1 token in 4 rows, 1 head, head dims 64 (Q/K) and 256 (V): rank 0's second step holds only pad rows
  keyless_step   sequences of 4 queries with 1 and 4 keys, 2 heads, head dim 64: sequence 0's key is on rank 0 only
Expected: O within a few bf16 ulps of the reference. Exit 1 when O is wrong, 0 when it is right, 2 when it cannot run.

--stats (1 GPU, no CP): the softmax statistics cuDNN returns through TE for query rows whose sequence has no key
(sequences of 4 queries with 0 and 4 keys). TE's p2p merge reads them as the step's log-sum-exp. Expected -inf (the
step contributes nothing). Exit 1 when a row without keys has a finite value (what the merge turns into exp(value)),
0 when every such row is -inf, 2 when it cannot run.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402 - after the path
    cp_launcher_start, cu_seqlens, offsets, rank_results, rank_start, run_ranks, versions)

LIMIT_ULPS = 32
WORLD = 2
CASES = {
    "one_token": dict(seqlens_q=[1], seqlens_kv=[1], padded_q=[4], padded_kv=[4], heads=(1, 1), dims=(64, 256)),
    "keyless_step": dict(seqlens_q=[4, 4], seqlens_kv=[1, 4], padded_q=[4, 4], padded_kv=[4, 4], heads=(2, 2),
                         dims=(64, 64)),
}
STATS_CASE = dict(seqlens_q=[4, 4], seqlens_kv=[0, 4], padded_q=[4, 4], padded_kv=[4, 4], heads=(2, 2),
                  dims=(64, 64))


# ---------------------------------------------------------------- the expected result: float64 on the CPU
def reference(q, k, v, scale):
    """Plain attention without a mask in float64: O [n_q, hq, dv] and LSE [n_q, hq] (log of the sum of
    exp(scale * q.k) over the row's keys; -inf and O = 0 without a key). Query head h reads KV head h // (hq / hkv)."""
    import torch
    g = q.shape[1] // k.shape[1]
    if k.shape[0] == 0:
        return torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64), \
            torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float64)
    ke, ve = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->qhk", q, ke) * scale
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("qhk,khd->qhd", torch.softmax(s, dim=-1), ve)
    return o, lse


def dual_chunk_rows(padded, world, rank):
    """The global rows a CP rank holds, TE's dual-chunk split: each sequence's padded range in 2W chunks, rank r takes
    chunks r and 2W-1-r (what tex.thd_get_partitioned_indices returns when no row follows the last sequence)."""
    rows, off = [], offsets(padded)
    for b, n in enumerate(padded):
        c = n // (2 * world)
        for chunk in (rank, 2 * world - 1 - rank):
            rows.extend(range(off[b] + chunk * c, off[b] + (chunk + 1) * c))
    return rows


def make_inputs(case, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    (hq, hkv), (dqk, dv) = case["heads"], case["dims"]
    x = {"q": torch.randn(sum(case["padded_q"]), hq, dqk, generator=g),
         "k": torch.randn(sum(case["padded_kv"]), hkv, dqk, generator=g),
         "v": torch.randn(sum(case["padded_kv"]), hkv, dv, generator=g)}
    for name, side in (("q", "q"), ("k", "kv"), ("v", "kv")):
        off = offsets(case[f"padded_{side}"])
        for b, n in enumerate(case[f"seqlens_{side}"]):
            x[name][off[b] + n:off[b + 1]] = 0
    return {n: t.to(torch.bfloat16) for n, t in x.items()}


def expected_and_predicted(case, x, world):
    """Per global Q row of a valid token: (sequence, expected O [hq, dv], predicted O [hq, dv], keyless steps).
    Predicted: the expected O scaled by exp(LSE) / (exp(LSE) + n), n the ring steps of the row's rank whose K/V shard
    holds none of the row's keys (step s of rank r holds rank (r - s) mod W's shard); what a merge that takes such a
    step's log-sum-exp as 0 instead of -inf computes."""
    oq, okv = offsets(case["padded_q"]), offsets(case["padded_kv"])
    owner = {}
    for r in range(world):
        for row in dual_chunk_rows(case["padded_q"], world, r):
            owner[row] = r
    shard = [set(dual_chunk_rows(case["padded_kv"], world, r)) for r in range(world)]
    scale = case["dims"][0] ** -0.5
    out = {}
    for b, (nq, nk) in enumerate(zip(case["seqlens_q"], case["seqlens_kv"])):
        keys = set(range(okv[b], okv[b] + nk))
        o, lse = reference(x["q"][oq[b]:oq[b] + nq].double(), x["k"][okv[b]:okv[b] + nk].double(),
                           x["v"][okv[b]:okv[b] + nk].double(), scale)
        for i in range(nq):
            row = oq[b] + i
            r = owner[row]
            n = sum(1 for s in range(world) if not keys & shard[(r - s) % world])
            factor = (lse[i].exp() / (lse[i].exp() + n)).unsqueeze(-1)
            out[row] = (b, o[i], o[i] * factor, n)
    return out


# ---------------------------------------------------------------- one rank (a child process)
def rank_main(case_name):
    import torch
    import torch.distributed as dist
    rank, world = rank_start()
    import transformer_engine
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    case = CASES[case_name]
    x = make_inputs(case)
    dev = torch.device("cuda", rank)
    cu = cu_seqlens(torch, dev, case["seqlens_q"], case["seqlens_kv"], case["padded_q"], case["padded_kv"])
    idx_q = tex.thd_get_partitioned_indices(cu["cu_seqlens_q_padded"], x["q"].shape[0], world, rank).long().cpu()
    idx_kv = tex.thd_get_partitioned_indices(cu["cu_seqlens_kv_padded"], x["k"].shape[0], world, rank).long().cpu()
    for side, idx in (("q", idx_q), ("kv", idx_kv)):
        if idx.tolist() != dual_chunk_rows(case[f"padded_{side}"], world, rank):
            raise RuntimeError(f"TE's partition of {side} on rank {rank} is {idx.tolist()}, not the dual-chunk split "
                               f"{dual_chunk_rows(case[f'padded_{side}'], world, rank)} the prediction assumes")
    (hq, hkv), (dqk, dv) = case["heads"], case["dims"]
    dpa = te.DotProductAttention(hq, (dqk, dv), num_gqa_groups=hkv, attention_dropout=0.0, qkv_format="thd",
                                 attn_mask_type="padding", softmax_scale=dqk ** -0.5)
    dpa.set_context_parallel_group(dist.new_group(list(range(world))), list(range(world)), torch.cuda.Stream(), "p2p")
    with torch.no_grad():
        o = dpa(x["q"][idx_q].to(dev), x["k"][idx_kv].to(dev), x["v"][idx_kv].to(dev), **cu)
    torch.cuda.synchronize()
    o = o.view(-1, hq, dv).double().cpu()
    want = expected_and_predicted(case, x, world)
    rows = []
    for local, row in enumerate(idx_q.tolist()):
        if row not in want:
            continue
        b, e, p, n = want[row]
        rows.append({"row": row, "sequence": b, "keyless_steps": n, "expected": e[0, :4].tolist(),
                     "observed": o[local][0, :4].tolist(), "predicted": p[0, :4].tolist(),
                     "max_err_expected": float((o[local] - e).abs().max().nan_to_num(float("inf"))),
                     "max_err_predicted": float((o[local] - p).abs().max().nan_to_num(float("inf"))),
                     "scale": float(max(e.abs().max(), 1e-30))})
    print("RESULT " + json.dumps({"rank": rank, "rows": rows, "backend": backend_chosen(),
                                  "versions": versions(torch, transformer_engine, te)}), flush=True)
    dist.destroy_process_group()


def backend_chosen():
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as te_dpa
    b = te_dpa._attention_backends
    if b.get("use_fused_attention"):
        return f"FusedAttention (sub-backend {int(b['fused_attention_backend'])})"
    if b.get("use_flash_attention"):
        return f"FlashAttention ({b.get('flash_attention_backend')})"
    return "UnfusedDotProductAttention" if b.get("use_unfused_attention") else "none"


# ---------------------------------------------------------------- --stats: one GPU, no CP
def stats_main():
    import torch
    import transformer_engine
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention.dot_product_attention import backends
    case = STATS_CASE
    x = make_inputs(case)
    (hq, hkv), (dqk, dv) = case["heads"], case["dims"]
    cu = cu_seqlens(torch, "cuda", case["seqlens_q"], case["seqlens_kv"], case["padded_q"], case["padded_kv"])
    seen = []
    original = backends.fused_attn_fwd

    def spy(*args, **kwargs):   # keeps the softmax statistics (aux_ctx_tensors[0]) of the forward call
        result = original(*args, **kwargs)
        seen.append(result[1][0] if result[1] else None)
        return result

    backends.fused_attn_fwd = spy
    try:
        dpa = te.DotProductAttention(hq, (dqk, dv), num_gqa_groups=hkv, attention_dropout=0.0, qkv_format="thd",
                                     attn_mask_type="padding", softmax_scale=dqk ** -0.5)
        with torch.no_grad():
            o = dpa(*(x[n].cuda() for n in ("q", "k", "v")), **cu)
        torch.cuda.synchronize()
    finally:
        backends.fused_attn_fwd = original
    print(f"TE-2 --stats: TransformerEngine non-CP, cuDNN FusedAttention; {json.dumps(case)}; TE ran "
          f"{backend_chosen()}")
    print("versions: " + json.dumps(versions(torch, transformer_engine, te)))
    stats = [s for s in seen if s is not None]
    if len(stats) != 1:
        print(f"cannot run: {len(seen)} fused_attn_fwd calls seen, {len(stats)} with softmax statistics (1 expected)")
        return 2
    s = stats[0].detach().float().cpu()
    rows_q, oq = sum(case["padded_q"]), offsets(case["padded_q"])
    if s.dim() == 3 and s.shape[0] >= rows_q and s.shape[1] == hq:
        layout, per_seq = "[t, h, 1] at the padded row", [s[oq[b]:oq[b] + n, :, 0] for b, n in
                                                          enumerate(case["seqlens_q"])]
    elif s.dim() == 4 and s.shape[1] == hq:
        layout, per_seq = "[B, h, S, 1]", [s[b, :, :n, 0].T for b, n in enumerate(case["seqlens_q"])]
    else:
        print(f"cannot run: softmax statistics of shape {tuple(s.shape)}, a layout this script does not know")
        return 2
    o = o.view(-1, hq, dv).float().cpu()
    finite = 0
    for b, (nq, nk) in enumerate(zip(case["seqlens_q"], case["seqlens_kv"])):
        _, lse = reference(x["q"][oq[b]:oq[b] + nq].double(),
                           x["k"][offsets(case["padded_kv"])[b]:offsets(case["padded_kv"])[b] + nk].double(),
                           x["v"][offsets(case["padded_kv"])[b]:offsets(case["padded_kv"])[b] + nk].double(),
                           dqk ** -0.5)
        got = per_seq[b]
        print(f"sequence {b} ({nq} queries, {nk} keys), head 0, statistics ({layout}): expected "
              f"{[round(float(v), 4) for v in lse[:, 0]]}, observed {[round(float(v), 4) for v in got[:, 0]]}")
        if nk == 0:
            finite += int(torch.isfinite(got).sum())
            print(f"  its O rows: max |O| {float(o[oq[b]:oq[b] + nq].abs().max()):.3g} (expected 0)")
    print(f"statistics of rows without a key that are finite: {finite} (expected 0: -inf, no contribution to a merge)")
    return 1 if finite else 0


# ---------------------------------------------------------------- the launcher
def launch(case_name, timeout):
    return rank_results(run_ranks(__file__, [case_name], WORLD, timeout))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="a case (repeatable; default both)")
    ap.add_argument("--stats", action="store_true", help="one GPU, no CP: the statistics of rows without keys")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a case may take (default 300)")
    ap.add_argument("--rank-worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    done, libs = cp_launcher_start(a.rank_worker, lambda: rank_main(a.rank_worker))
    if done is not None:
        return done
    torch, _ = libs
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if a.stats:
        if gpus < 1:
            print("cannot run: no GPU visible")
            return 2
        return stats_main()
    if gpus < WORLD:
        print(f"cannot run: {WORLD} GPUs needed for the CP part, {gpus} visible (--stats needs one)")
        return 2
    ulp = 2.0 ** -8
    print(f"TE-2: TransformerEngine CP p2p with {WORLD} ranks (one process per GPU, NCCL), cuDNN FusedAttention, no "
          f"mask; O of every valid row against float64 on the CPU; wrong above {LIMIT_ULPS} bf16 ulps")
    wrong = 0
    for name in a.case or list(CASES):
        try:
            results = launch(name, a.timeout)
        except RuntimeError as e:
            print(f"cannot run: case {name}: {e}")
            return 2
        if name == (a.case or list(CASES))[0]:
            print("versions: " + json.dumps(results[0]["versions"]))
        print(f"{name}: {json.dumps(CASES[name])}; TE ran {results[0]['backend']}")
        rows = sorted((r for res in results for r in res["rows"]), key=lambda r: r["row"])
        scale = max(r["scale"] for r in rows)
        bad = 0
        for r in rows:
            ulps = r["max_err_expected"] / (scale * ulp)
            is_bad = not math.isfinite(ulps) or ulps > LIMIT_ULPS
            bad += is_bad
            print(f"  row {r['row']:2} (sequence {r['sequence']}, {r['keyless_steps']} step(s) without its keys), head "
                  f"0, dims 0-3: expected {[round(v, 4) for v in r['expected']]}, observed "
                  f"{[round(v, 4) for v in r['observed']]}, predicted with exp(0) added "
                  f"{[round(v, 4) for v in r['predicted']]}; error {ulps:.1f} ulps" + ("  <-- wrong" if is_bad else ""))
        wrong += bad > 0
    print(f"cases wrong: {wrong} of {len(a.case or CASES)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
