#!/usr/bin/env python3
"""Standalone reproduction: TransformerEngine's DotProductAttention (THD, FusedAttention, no CP) at head dim 256,
forward and backward, against a float64 PyTorch reference: the errors of O, dQ, dK and dV, split into head dims
0-127 and 128-255, so that a part of the head dim that is not written shows as its own column.

The layout is that of cpgold's fixture edge/d256_p2p_w2_gqa without CP: causal, sequences of 70, 1 and 13 tokens in
slots of 72, 8 and 16 rows (padding between sequences, zero-filled), bf16. Each row of the table is one head layout
(GQA 4/2, MHA 4/4, MQA 4/1) and head dims (256, and 128 and 192/128 for contrast); the worst error of each tensor is
printed in units of the bf16 ulp at the reference's largest magnitude. Needs only torch and transformer_engine:

    NVTE_FLASH_ATTN=0 NVTE_FUSED_ATTN=1 python3 te_repro_d256.py [--deterministic]

Expected: every error a few ulps at most, the same in both halves of the head dim. Exit 1 when any tensor's worst
error exceeds 64 ulps (a wrong result, not rounding).
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

SEQLENS, SLOTS = [70, 1, 13], [72, 8, 16]


def reference(q, k, v, do, scale):
    """float64 causal attention of one sequence (GQA: query head h reads KV head h // group) and its gradients."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.double().detach().requires_grad_() for x in (q, k, v))
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, ke) * scale
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), ve)
    o.backward(do.double())
    return o.detach(), q.grad, k.grad, v.grad


def run(heads_q, heads_kv, dim_qk, dim_v, seed=40):
    torch.manual_seed(seed)
    dev, dtype = "cuda", torch.bfloat16
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)  # noqa
    cu_s, cu_p = cu(SEQLENS), cu(SLOTS)
    rows = int(cu_p[-1])
    q = torch.randn(rows, heads_q, dim_qk, device=dev, dtype=dtype)
    k = torch.randn(rows, heads_kv, dim_qk, device=dev, dtype=dtype)
    v = torch.randn(rows, heads_kv, dim_v, device=dev, dtype=dtype)
    do = torch.randn(rows, heads_q, dim_v, device=dev, dtype=dtype)
    for x in (q, k, v, do):  # zero-filled padding between sequences
        for b, n in enumerate(SEQLENS):
            x[int(cu_p[b]) + n:int(cu_p[b + 1])] = 0
    scale = dim_qk ** -0.5
    dpa = te.DotProductAttention(heads_q, (dim_qk, dim_v), num_gqa_groups=heads_kv, attention_dropout=0.0,
                                 qkv_format="thd", attn_mask_type="padding_causal", softmax_scale=scale)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o = dpa(qq, kk, vv, cu_seqlens_q=cu_s, cu_seqlens_kv=cu_s, cu_seqlens_q_padded=cu_p, cu_seqlens_kv_padded=cu_p,
            max_seqlen_q=max(SLOTS), max_seqlen_kv=max(SLOTS))
    o.backward(do.reshape(o.shape))
    torch.cuda.synchronize()
    got = {"o": o.reshape(rows, heads_q, dim_v), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
    worst = {name: [0.0, 0.0, 0.0] for name in got}  # error in dims < 128, in dims >= 128, reference magnitude
    for b, n in enumerate(SEQLENS):
        s = slice(int(cu_p[b]), int(cu_p[b]) + n)
        ref = dict(zip(("o", "dq", "dk", "dv"), reference(q[s], k[s], v[s], do[s], scale)))
        for name, r in ref.items():
            e = (got[name][s].double() - r).abs()
            w = worst[name]
            w[0] = max(w[0], e[..., :128].max().item())
            w[1] = max(w[1], e[..., 128:].max().item() if e.shape[-1] > 128 else 0.0)
            w[2] = max(w[2], r.abs().max().item())
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deterministic", action="store_true", help="NVTE_ALLOW_NONDETERMINISTIC_ALGO=0")
    ap.parse_args()
    print("transformer_engine", transformer_engine.__version__, "torch", torch.__version__,
          torch.cuda.get_device_name(0), "deterministic" if "--deterministic" in sys.argv else "default backward")
    print("worst |error| in bf16 ulps of the reference's largest magnitude: dims 0-127 / dims 128-255")
    bad = 0
    for heads_q, heads_kv in ((4, 2), (4, 4), (4, 1)):
        for dim_qk, dim_v in ((256, 256), (128, 128), (192, 128)):
            try:
                worst = run(heads_q, heads_kv, dim_qk, dim_v)
            except Exception as e:  # noqa: BLE001 - TE refusing a layout is a line of the table, not a crash
                print(f"heads {heads_q}/{heads_kv} d {dim_qk}/{dim_v}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            cells = []
            for name, (lo, hi, mag) in worst.items():
                ulp = max(mag, 1e-30) * 2.0 ** -8
                cells.append(f"{name} {lo / ulp:7.1f} / {hi / ulp:7.1f}")
                bad += max(lo, hi) > 64 * ulp
            print(f"heads {heads_q}/{heads_kv} d {dim_qk:3}/{dim_v:3}: " + "  ".join(cells))
    print(f"tensors over 64 ulps: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
