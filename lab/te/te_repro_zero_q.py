#!/usr/bin/env python3
"""Standalone reproduction: TransformerEngine's DotProductAttention (THD, FusedAttention) backward and the keys and
values of a sequence that has keys but no queries (L_q = 0 < L_kv).

With no query, no attention probability involves those keys, so every gradient of that sequence's K and V rows is
exactly 0. The script builds small packed batches, runs TE's forward and backward, and prints per sequence the
largest |dK| and |dV| error: against 0 on the query-less sequence, against a float64 PyTorch reference elsewhere.
Each layout runs with MHA and GQA (fewer KV heads), with random or NaN padding rows, and three times: twice on a
fresh cache and once after the CUDA caching allocator's free memory was filled with 0xFF bytes (NaN in every float
type), so a kernel that reads memory nobody wrote shows NaN there. Needs only torch and transformer_engine:

    NVTE_FLASH_ATTN=0 NVTE_FUSED_ATTN=1 python3 te_repro_zero_q.py [--deterministic]
"""
import argparse
import os
import sys

for k, v in {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"}.items():
    os.environ.setdefault(k, v)
if "--deterministic" in sys.argv:
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
import torch  # noqa: E402
import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402


def reference(q, k, v, do, scale):
    """float64 attention of one sequence (GQA: each query head reads KV head h // group) and its K/V gradients."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.double().detach().requires_grad_() for x in (q, k, v))
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, ke) * scale
    o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), ve)
    o.backward(do.double())
    return k.grad, v.grad


def poison_cache():
    """Fill the caching allocator's free memory with 0xFF (NaN for fp16, bf16 and fp32) in small and large blocks."""
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xFF) for n in [1 << 16] * 256 + [1 << 24] * 16]
    torch.cuda.synchronize()
    del keep


def run(seqlens_q, seqlens_kv, padded_q, padded_kv, dtype, heads_q, heads_kv, pad, poison, dim=64, seed=1):
    torch.manual_seed(seed)
    dev = "cuda"

    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)

    cu_q, cu_kv, cu_qp, cu_kvp = cu(seqlens_q), cu(seqlens_kv), cu(padded_q), cu(padded_kv)
    tq, tkv = int(cu_qp[-1]), int(cu_kvp[-1])
    q = torch.randn(tq, heads_q, dim, device=dev, dtype=dtype)
    k = torch.randn(tkv, heads_kv, dim, device=dev, dtype=dtype)
    v = torch.randn(tkv, heads_kv, dim, device=dev, dtype=dtype)
    do = torch.randn(tq, heads_q, dim, device=dev, dtype=dtype)
    if pad == "nan":
        for x, lens, off in ((q, seqlens_q, cu_qp), (k, seqlens_kv, cu_kvp), (v, seqlens_kv, cu_kvp),
                             (do, seqlens_q, cu_qp)):
            for b, n in enumerate(lens):
                x[int(off[b]) + n:int(off[b + 1])] = float("nan")
    scale = dim ** -0.5
    if poison:
        poison_cache()
    dpa = te.DotProductAttention(heads_q, dim, num_gqa_groups=heads_kv, attention_dropout=0.0, qkv_format="thd",
                                 attn_mask_type="padding", softmax_scale=scale)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o = dpa(qq, kk, vv, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=cu_qp,
            cu_seqlens_kv_padded=cu_kvp)
    o.backward(do.reshape(o.shape))
    torch.cuda.synchronize()
    errs = []
    for b, (lq, lkv) in enumerate(zip(seqlens_q, seqlens_kv)):
        qs, ks = int(cu_qp[b]), int(cu_kvp[b])
        if lkv == 0:
            continue
        dk, dv = kk.grad[ks:ks + lkv].double(), vv.grad[ks:ks + lkv].double()
        if lq == 0:
            rk, rv = torch.zeros_like(dk), torch.zeros_like(dv)
        else:
            rk, rv = reference(q[qs:qs + lq], k[ks:ks + lkv], v[ks:ks + lkv], do[qs:qs + lq], scale)
        ek, ev = (dk - rk).abs().max().item(), (dv - rv).abs().max().item()
        errs.append((b, lq, lkv, ek, ev))
    return errs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deterministic", action="store_true", help="NVTE_ALLOW_NONDETERMINISTIC_ALGO=0")
    args = ap.parse_args()
    print("transformer_engine", transformer_engine.__version__, "torch", torch.__version__,
          torch.cuda.get_device_name(0), "deterministic" if args.deterministic else "default (non-deterministic)")
    layouts = [([4, 0], [4, 6], [4, 0], [4, 6]), ([0, 4], [6, 4], [0, 4], [6, 4]),
               ([4, 0, 5], [4, 6, 5], [4, 0, 5], [4, 6, 5]), ([14, 0], [1, 6], [24, 0], [12, 12]),
               ([0, 158, 291, 1], [7, 0, 0, 2], [0, 162, 294, 6], [12, 0, 0, 6])]
    bad = 0
    for dtype in (torch.bfloat16, torch.float16):
        for heads_q, heads_kv in ((4, 4), (4, 1), (24, 6)):
            for pad in ("random", "nan"):
                for lay in layouts:
                    runs = [run(*lay, dtype, heads_q, heads_kv, pad, poison) for poison in (False, False, True)]
                    for i, (b, lq, lkv, _, _) in enumerate(runs[0]):
                        ks = [r[i][3] for r in runs]
                        vs = [r[i][4] for r in runs]
                        zero_q = lq == 0
                        wrong = zero_q and any(x != 0 for x in ks + vs)
                        bad += wrong
                        if zero_q or any(x != x for x in ks + vs):
                            print(f"{str(dtype)[6:]:8} hq {heads_q:2} hkv {heads_kv} pads {pad:6} seqlens_q {lay[0]} "
                                  f"seqlens_kv {lay[1]} padded_q {lay[2]} padded_kv {lay[3]}: sequence {b} "
                                  f"(L_q {lq}, L_kv {lkv}) max|dK - expected| runs {['%.3g' % x for x in ks]} "
                                  f"max|dV - expected| {['%.3g' % x for x in vs]}" + ("  <-- not 0" if wrong else ""))
    print(f"query-less sequences with non-zero dK/dV: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
