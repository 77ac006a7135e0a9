#!/usr/bin/env python3
"""TE-1: TransformerEngine's context parallelism computes the wrong (query, key) pairs in two layouts, with torch and
TransformerEngine alone (docs/findings/te-1-cp-wrong-pairs.md).

    python3 te1_cp_wrong_pairs.py [--case NAME ...] [--backend fused|flash] [--timeout S]

Needs 2 GPUs: every case runs TE's DotProductAttention under context parallelism (CP) with 2 ranks, one process per
GPU over NCCL, the way TE's users run it. Each process holds its rank's share of the rows (TE's own split,
tex.thd_get_partitioned_indices) and the global cu_seqlens. Forward and backward run; every valid row of O, dQ, dK
and dV is compared with a plain masked attention in float64 on the CPU, written below.

Cases (2 tokens unless said otherwise, bf16):
  p2p_causal_padded_q_ne_kv  cp_comm_type p2p, causal, Q padded to 8 rows and K/V to 4 (2 heads, head dim 64)
  all_gather_window_0_3      cp_comm_type all_gather, no causal mask, sliding window (0, 3) (2 heads, head dim 64)
  all_gather_window_2_0      all_gather, no causal mask, window (2, 0), 5 tokens in 8 rows (1 head, head dim 32)

Expected: every tensor within a few bf16 ulps of the reference. Exit 1 when a case is wrong (the finding
reproduces), 0 when every case is right, 2 when it cannot run (fewer than 2 GPUs, TransformerEngine missing, a
rank failing to start).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402 - after the path
    FUSED_ONLY, cp_launcher_start, cu_seqlens, offsets, rank_results, rank_start, run_ranks, versions)

LIMIT_ULPS = 32   # an error above this many ulps of the tensor's largest reference value is a wrong result
CASES = {
    "p2p_causal_padded_q_ne_kv": dict(seqlens_q=[2], seqlens_kv=[2], padded_q=[8], padded_kv=[4], causal=True,
                                      window=None, comm="p2p", heads=(2, 2), dims=(64, 64)),
    "all_gather_window_0_3": dict(seqlens_q=[2], seqlens_kv=[2], padded_q=[4], padded_kv=[4], causal=False,
                                  window=(0, 3), comm="all_gather", heads=(2, 2), dims=(64, 64)),
    "all_gather_window_2_0": dict(seqlens_q=[5], seqlens_kv=[5], padded_q=[8], padded_kv=[8], causal=False,
                                  window=(2, 0), comm="all_gather", heads=(1, 1), dims=(32, 32)),
}
WORLD = 2


# ---------------------------------------------------------------- the expected result: float64 on the CPU
def visible(n_q, n_k, causal, window):
    """[n_q, n_k] bool: key j is visible to query i (the diagonal bottom-right aligned, i + n_k - n_q)."""
    import torch
    i = torch.arange(n_q).view(-1, 1) + (n_k - n_q)
    j = torch.arange(n_k).view(1, -1)
    ok = torch.ones(n_q, n_k, dtype=torch.bool)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def reference(q, k, v, dout, scale, ok):
    """Plain masked attention and its gradients in float64. q: [n_q, hq, d], k: [n_k, hkv, d], v: [n_k, hkv, dv],
    dout: [n_q, hq, dv]; query head h reads KV head h // (hq / hkv). A row without a visible key has O = 0."""
    import torch
    n_k, hkv, hq = k.shape[0], k.shape[1], q.shape[1]
    g = hq // hkv
    ke, ve = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, ke) * scale
    s = s.masked_fill(~ok, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    o = torch.einsum("hqk,khd->qhd", p, ve)
    dp = torch.einsum("qhd,khd->hqk", dout, ve)
    delta = (dout * o).sum(-1).transpose(0, 1).unsqueeze(-1)
    ds = p * (dp - delta)
    dq = torch.einsum("hqk,khd->qhd", ds, ke) * scale
    dk = (torch.einsum("hqk,qhd->khd", ds, q) * scale).reshape(n_k, hkv, g, -1).sum(2)
    dv = torch.einsum("hqk,qhd->khd", p, dout).reshape(n_k, hkv, g, -1).sum(2)
    return {"o": o, "dq": dq, "dk": dk, "dv": dv}


def make_inputs(case, dtype_name="bf16", seed=0):
    """Global THD inputs on the CPU in the case dtype: q, dout [rows_q, hq, d], k, v [rows_kv, hkv, d]; pad rows 0."""
    import torch
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    g = torch.Generator().manual_seed(seed)
    (hq, hkv), (dqk, dv) = case["heads"], case["dims"]
    rows_q, rows_kv = sum(case["padded_q"]), sum(case["padded_kv"])
    x = {"q": torch.randn(rows_q, hq, dqk, generator=g), "k": torch.randn(rows_kv, hkv, dqk, generator=g),
         "v": torch.randn(rows_kv, hkv, dv, generator=g), "dout": torch.randn(rows_q, hq, dv, generator=g)}
    for name, side in (("q", "q"), ("dout", "q"), ("k", "kv"), ("v", "kv")):
        off = offsets(case[f"padded_{side}"])
        for b, n in enumerate(case[f"seqlens_{side}"]):
            x[name][off[b] + n:off[b + 1]] = 0
    return {n: t.to(dtype) for n, t in x.items()}


def expected(case, x):
    """The reference's O, dQ, dK, dV in the global row layout (float64; pad rows 0)."""
    import torch
    scale = case["dims"][0] ** -0.5
    out = {"o": torch.zeros(x["dout"].shape, dtype=torch.float64), "dq": torch.zeros(x["q"].shape, dtype=torch.float64),
           "dk": torch.zeros(x["k"].shape, dtype=torch.float64), "dv": torch.zeros(x["v"].shape, dtype=torch.float64)}
    oq, ok_ = offsets(case["padded_q"]), offsets(case["padded_kv"])
    for b, (nq, nk) in enumerate(zip(case["seqlens_q"], case["seqlens_kv"])):
        sq, sk = slice(oq[b], oq[b] + nq), slice(ok_[b], ok_[b] + nk)
        r = reference(x["q"][sq].double(), x["k"][sk].double(), x["v"][sk].double(), x["dout"][sq].double(), scale,
                      visible(nq, nk, case["causal"], case["window"]))
        out["o"][sq], out["dq"][sq], out["dk"][sk], out["dv"][sk] = r["o"], r["dq"], r["dk"], r["dv"]
    return out


def valid_rows(case, side):
    off = offsets(case[f"padded_{side}"])
    return [r for b, n in enumerate(case[f"seqlens_{side}"]) for r in range(off[b], off[b] + n)]


def compare(name, got, want, global_rows, valid, ulp_bits):
    """Worst error of one rank's rows of a tensor: in ulps of the global reference's largest magnitude."""
    import torch
    scale = max(float(want.abs().max()), 1e-30) * 2.0 ** -ulp_bits
    worst = {"tensor": name, "ulps": 0.0, "nonfinite": 0}
    for local, row in enumerate(global_rows):
        if row not in valid:
            continue
        g, w = got[local].double(), want[row]
        worst["nonfinite"] += int((~torch.isfinite(g)).sum())
        err = (g - w).abs().nan_to_num(float("inf"))
        e = float(err.max())
        if e / scale > worst["ulps"] or "row" not in worst:
            flat = int(err.argmax())
            h, d = divmod(flat, err.shape[-1])
            worst.update(ulps=e / scale, row=row, head=h, dim=d, expected=float(w[h, d]), observed=float(g[h, d]))
    return worst


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
    want = expected(case, x)
    dev = torch.device("cuda", rank)
    cu = cu_seqlens(torch, dev, case["seqlens_q"], case["seqlens_kv"], case["padded_q"], case["padded_kv"])
    idx_q = tex.thd_get_partitioned_indices(cu["cu_seqlens_q_padded"], x["q"].shape[0], world, rank).long().cpu()
    idx_kv = tex.thd_get_partitioned_indices(cu["cu_seqlens_kv_padded"], x["k"].shape[0], world, rank).long().cpu()
    (hq, hkv), (dqk, dv) = case["heads"], case["dims"]
    kwargs = dict(num_gqa_groups=hkv, attention_dropout=0.0, qkv_format="thd",
                  attn_mask_type="padding_causal" if case["causal"] else "padding", softmax_scale=dqk ** -0.5)
    if case["window"] is not None:
        kwargs["window_size"] = case["window"]
    dpa = te.DotProductAttention(hq, (dqk, dv), **kwargs)
    dpa.set_context_parallel_group(dist.new_group(list(range(world))), list(range(world)), torch.cuda.Stream(),
                                   case["comm"])
    q, k, v = (x[n][idx].to(dev).requires_grad_() for n, idx in (("q", idx_q), ("k", idx_kv), ("v", idx_kv)))
    o = dpa(q, k, v, **cu)
    o.backward(x["dout"][idx_q].to(dev).reshape(o.shape))
    torch.cuda.synchronize()
    got = {"o": o.detach().view(-1, hq, dv).cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()}
    rows = {"o": idx_q.tolist(), "dq": idx_q.tolist(), "dk": idx_kv.tolist(), "dv": idx_kv.tolist()}
    valid = {"q": set(valid_rows(case, "q")), "kv": set(valid_rows(case, "kv"))}
    report = [compare(n, got[n], want[n], rows[n], valid["q" if n in ("o", "dq") else "kv"], 8) for n in got]
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as te_dpa
    b = te_dpa._attention_backends
    chosen = (f"FusedAttention (sub-backend {int(b['fused_attention_backend'])})" if b.get("use_fused_attention")
              else f"FlashAttention ({b.get('flash_attention_backend')})" if b.get("use_flash_attention") else "other")
    print("RESULT " + json.dumps({"rank": rank, "tensors": report, "backend": chosen,
                                  "versions": versions(torch, transformer_engine, te)}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------- the launcher
def launch(case_name, backend, timeout):
    """Runs the case on WORLD processes; returns (per-rank results, per-rank (exit, stderr tail)), or raises
    RuntimeError when a rank did not finish."""
    return rank_results(run_ranks(__file__, [case_name, "--backend", backend], WORLD, timeout))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="a case (repeatable; default every case)")
    ap.add_argument("--backend", choices=("fused", "flash"), default="fused",
                    help="TE's backend: fused (cuDNN FusedAttention, default) or flash (FlashAttention-3 or -4)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a case may take (default 300)")
    ap.add_argument("--rank-worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    backends = {"fused": FUSED_ONLY, "flash": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0"}}[a.backend]
    done, libs = cp_launcher_start(a.rank_worker, lambda: rank_main(a.rank_worker), backends)
    if done is not None:
        return done
    torch, _ = libs
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        print(f"cannot run: {WORLD} GPUs needed, {torch.cuda.device_count() if torch.cuda.is_available() else 0} "
              "visible")
        return 2
    print(f"TE-1: TransformerEngine CP with {WORLD} ranks (one process per GPU, NCCL), backend {a.backend}; "
          f"every valid row against float64 on the CPU; wrong above {LIMIT_ULPS} ulps of the tensor's largest value")
    wrong, printed = 0, False
    for name in a.case or list(CASES):
        try:
            results = launch(name, a.backend, a.timeout)
        except RuntimeError as e:
            print(f"cannot run: case {name}: {e}")
            return 2
        if not printed:
            print("versions: " + json.dumps(results[0]["versions"]))
            printed = True
        print(f"{name}: {json.dumps({k: v for k, v in CASES[name].items()})}; TE ran {results[0]['backend']}")
        bad = False
        for t in ("o", "dq", "dk", "dv"):
            w = max((r for res in results for r in res["tensors"] if r["tensor"] == t), key=lambda r: r["ulps"])
            is_bad = w["ulps"] > LIMIT_ULPS or w["nonfinite"] > 0
            bad |= is_bad
            where = (f"row {w['row']} head {w['head']} dim {w['dim']}: expected {w['expected']:.6g}, observed "
                     f"{w['observed']:.6g}") if "row" in w else "no valid row"
            print(f"  {t:2}: worst {w['ulps']:9.1f} ulps at {where}" + ("   <-- wrong" if is_bad else ""))
        wrong += bad
    print(f"cases wrong: {wrong} of {len(a.case or CASES)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
