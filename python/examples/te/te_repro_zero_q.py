#!/usr/bin/env python3
"""Standalone reproduction: TransformerEngine's DotProductAttention (THD, FusedAttention) backward gives non-zero
dK/dV for the keys and values of a sequence that has keys but no queries (L_q = 0 < L_kv).

With no query, no attention probability involves those keys, so every gradient of that sequence's K and V rows is
exactly 0. The script builds one small packed batch, runs TE's forward and backward, and prints, per sequence and
dtype, the largest |dK| and |dV| on the rows of the query-less sequence next to a float64 PyTorch reference of the
other sequences. Needs only torch and transformer_engine (no cpgold):

    NVTE_FLASH_ATTN=0 NVTE_FUSED_ATTN=1 python3 te_repro_zero_q.py
"""
import os

for k, v in {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"}.items():
    os.environ.setdefault(k, v)
import torch  # noqa: E402
import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402


def reference(q, k, v, do, scale):
    """float64 attention of one sequence and its gradients."""
    q, k, v = (x.double().detach().requires_grad_() for x in (q, k, v))
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    o.backward(do.double())
    return q.grad, k.grad, v.grad


def run(seqlens_q, seqlens_kv, padded_q, padded_kv, dtype, heads=2, dim=64, seed=1):
    torch.manual_seed(seed)
    dev = "cuda"
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    cu_q, cu_kv, cu_qp, cu_kvp = cu(seqlens_q), cu(seqlens_kv), cu(padded_q), cu(padded_kv)
    tq, tkv = int(cu_qp[-1]), int(cu_kvp[-1])
    q = torch.randn(tq, heads, dim, device=dev, dtype=dtype)
    k = torch.randn(tkv, heads, dim, device=dev, dtype=dtype)
    v = torch.randn(tkv, heads, dim, device=dev, dtype=dtype)
    do = torch.randn(tq, heads, dim, device=dev, dtype=dtype)
    scale = dim ** -0.5
    dpa = te.DotProductAttention(heads, dim, attention_dropout=0.0, qkv_format="thd", attn_mask_type="padding",
                                 softmax_scale=scale)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o = dpa(qq, kk, vv, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=cu_qp,
            cu_seqlens_kv_padded=cu_kvp)
    o.backward(do.reshape(o.shape))
    torch.cuda.synchronize()
    print(f"\n{dtype} seqlens_q {seqlens_q} seqlens_kv {seqlens_kv} padded_q {padded_q} padded_kv {padded_kv}")
    for b, (lq, lkv) in enumerate(zip(seqlens_q, seqlens_kv)):
        qs, ks = int(cu_qp[b]), int(cu_kvp[b])
        dk, dv = kk.grad[ks:ks + lkv].float(), vv.grad[ks:ks + lkv].float()
        if lq == 0:
            expect = "0 (no query)"
            err_k, err_v = dk.abs().max().item() if lkv else 0.0, dv.abs().max().item() if lkv else 0.0
        else:
            expect = "float64 reference"
            _, rk, rv = reference(q[qs:qs + lq], k[ks:ks + lkv], v[ks:ks + lkv], do[qs:qs + lq], scale)
            err_k = (dk.double() - rk).abs().max().item() if lkv else 0.0
            err_v = (dv.double() - rv).abs().max().item() if lkv else 0.0
        print(f"  sequence {b}: L_q {lq}, L_kv {lkv}: expected {expect}; max |dK - expected| {err_k:.4g}, "
              f"max |dV - expected| {err_v:.4g}")


if __name__ == "__main__":
    print("transformer_engine", transformer_engine.__version__, "torch", torch.__version__,
          torch.cuda.get_device_name(0))
    for dtype in (torch.bfloat16, torch.float16):
        run([4, 0], [4, 6], [4, 0], [4, 6], dtype)
        run([0, 4], [6, 4], [0, 4], [6, 4], dtype)
        run([4, 0, 5], [4, 6, 5], [4, 0, 5], [4, 6, 5], dtype)
        run([4, 0], [4, 6], [8, 8], [8, 8], dtype)
        run([14, 0], [1, 6], [14, 0], [1, 6], dtype)
