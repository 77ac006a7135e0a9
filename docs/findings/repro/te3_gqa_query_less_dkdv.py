#!/usr/bin/env python3
"""TE-3: TransformerEngine's cuDNN FusedAttention backward with fewer KV heads than query heads (GQA/MQA) returns
non-zero dK and dV for a sequence that has keys and no queries, with torch and TransformerEngine alone
(docs/findings/te-3-gqa-query-less-dkdv.md).

    python3 te3_gqa_query_less_dkdv.py [--deterministic] [--dtype fp16|bf16|both]

One GPU, no context parallelism. The batch (THD, padding between sequences as TE takes it): sequence 0 with 4 queries
and 4 keys, sequence 1 with 0 queries and 6 keys; 4 query heads and 1 KV head (MQA), head dim 64, no mask; and the
same with 4 KV heads (MHA) as the control. Forward and backward through DotProductAttention. Each layout runs on a
fresh cache and again after the CUDA caching allocator's free memory was filled with 0xFF bytes (NaN in fp16, bf16
and fp32), so that memory the kernel returns without writing shows as NaN.

Expected: dK and dV of sequence 1 exactly 0 (no query, so no probability involves its keys); dK and dV of sequence 0
within a few ulps of a plain attention in float64 on the CPU (in _common.py). Exit 1 when a query-less sequence gets
a non-zero or non-finite dK/dV, 0 when none does, 2 when it cannot run. --deterministic sets
NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 before TE is imported (TE reads it then).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import gqa_reference, offsets, te_one_gpu_end, te_one_gpu_start  # noqa: E402 - after the path

SEQLENS_Q, SEQLENS_KV = [4, 0], [4, 6]
PADDED_Q, PADDED_KV = [4, 0], [4, 6]
DIM = 64
LIMIT_ULPS = 32   # an error above this many ulps of the largest expected value is a wrong result


def reference_dkdv(q, k, v, dout, scale):
    """dK, dV of plain attention without a mask, float64. q, dout: [n_q, hq, d]; k, v: [n_k, hkv, d]; query head h
    reads KV head h // (hq / hkv). With no query, dK = dV = 0."""
    import torch
    if q.shape[0] == 0:
        return torch.zeros_like(k), torch.zeros_like(v)
    r = gqa_reference(q, k, v, dout, scale, False)
    return r["dk"], r["dv"]


def poison_cache(torch):
    """Fill the caching allocator's free memory with 0xFF (NaN in fp16, bf16 and fp32), small and large blocks."""
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xFF) for n in [1 << 16] * 256 + [1 << 24] * 16]
    torch.cuda.synchronize()
    del keep


def run(te, torch, dtype, heads_kv, poison, heads_q=4, seed=1):
    """One forward and backward; per sequence with keys: (queries, keys, max |dK - expected|, max |dV - expected|,
    largest |expected|)."""
    g = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(sum(PADDED_Q), heads_q, DIM, generator=g),
         "k": torch.randn(sum(PADDED_KV), heads_kv, DIM, generator=g),
         "v": torch.randn(sum(PADDED_KV), heads_kv, DIM, generator=g),
         "dout": torch.randn(sum(PADDED_Q), heads_q, DIM, generator=g)}
    x = {n: t.to(dtype) for n, t in x.items()}
    i32 = dict(dtype=torch.int32, device="cuda")
    cu = {"cu_seqlens_q": torch.tensor(offsets(SEQLENS_Q), **i32),
          "cu_seqlens_kv": torch.tensor(offsets(SEQLENS_KV), **i32),
          "cu_seqlens_q_padded": torch.tensor(offsets(PADDED_Q), **i32),
          "cu_seqlens_kv_padded": torch.tensor(offsets(PADDED_KV), **i32)}
    scale = DIM ** -0.5
    if poison:
        poison_cache(torch)
    dpa = te.DotProductAttention(heads_q, DIM, num_gqa_groups=heads_kv, attention_dropout=0.0, qkv_format="thd",
                                 attn_mask_type="padding", softmax_scale=scale)
    q, k, v = (x[n].cuda().requires_grad_() for n in ("q", "k", "v"))
    o = dpa(q, k, v, **cu)
    o.backward(x["dout"].cuda().reshape(o.shape))
    torch.cuda.synchronize()
    dk, dv = k.grad.double().cpu(), v.grad.double().cpu()
    oq, okv = offsets(PADDED_Q), offsets(PADDED_KV)
    out = []
    for b, (nq, nk) in enumerate(zip(SEQLENS_Q, SEQLENS_KV)):
        sq, sk = slice(oq[b], oq[b] + nq), slice(okv[b], okv[b] + nk)
        rk, rv = reference_dkdv(x["q"][sq].double(), x["k"][sk].double(), x["v"][sk].double(),
                                x["dout"][sq].double(), scale)
        ek = float((dk[sk] - rk).abs().nan_to_num(float("inf")).max())
        ev = float((dv[sk] - rv).abs().nan_to_num(float("inf")).max())
        out.append((nq, nk, ek, ev, float(max(rk.abs().max(), rv.abs().max())), int((~dk[sk].isfinite()).sum()
                                                                                      + (~dv[sk].isfinite()).sum())))
    return out


def main():
    a, libs, mode = te_one_gpu_start(
        __doc__, lambda ap: ap.add_argument("--dtype", choices=("fp16", "bf16", "both"), default="both"))
    torch, _, te = libs
    print(f"TE-3: TransformerEngine non-CP, cuDNN FusedAttention, {mode} backward; seqlens_q {SEQLENS_Q}, "
          f"seqlens_kv {SEQLENS_KV}, padded {PADDED_Q}/{PADDED_KV}, head dim {DIM}, no mask")
    dtypes = {"fp16": [torch.float16], "bf16": [torch.bfloat16], "both": [torch.float16, torch.bfloat16]}[a.dtype]
    wrong = 0
    for dtype in dtypes:
        for heads_kv in (1, 4):
            for poison in (False, True):
                try:
                    seqs = run(te, torch, dtype, heads_kv, poison)
                except Exception as e:  # noqa: BLE001 - TE refusing the layout is a line, not a crash
                    print(f"  {str(dtype)[6:]:8} heads 4/{heads_kv}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160]}")
                    continue
                for b, (nq, nk, ek, ev, mag, nonfinite) in enumerate(seqs):
                    if nq == 0:
                        bad = ek != 0 or ev != 0
                        wrong += bad
                        what = (f"expected dK = dV = 0, observed max |dK| {ek:.3g}, max |dV| {ev:.3g}"
                                + (f" ({nonfinite} non-finite)" if nonfinite else "") + ("  <-- not 0" if bad else ""))
                    else:
                        ulps = max(ek, ev) / (max(mag, 1e-30) * 2.0 ** -(11 if dtype == torch.float16 else 8))
                        what = (f"max |dK - expected| {ek:.3g}, max |dV - expected| {ev:.3g} (largest |expected| "
                                f"{mag:.3g}: {ulps:.1f} ulps)" + ("  <-- wrong too (not this finding)"
                                                                   if ulps > LIMIT_ULPS else ""))
                    print(f"  {str(dtype)[6:]:8} heads 4/{heads_kv} {'poisoned cache' if poison else 'fresh cache   '}:"
                          f" sequence {b} ({nq} queries, {nk} keys): {what}")
    return te_one_gpu_end(libs, "query-less sequences with non-zero dK/dV", wrong)


if __name__ == "__main__":
    sys.exit(main())
