#!/usr/bin/env python3
"""FlashAttention-4's causal attention with a window side of -1 (lab/records/outsiders-flash.md, FA-3), with torch and
flash-attn-4 alone (no cpgold, no TransformerEngine):

    python3 lab/outsiders/fa4_window_repro.py

TransformerEngine 2.20.2 hands FA4 the window of a causal mask as (-1, 0), the "unbounded" -1 of FlashAttention-2/3
(context_parallel.py: window_size_left = -1, window_size_right = 0 if causal; backends.py: window_size=(-1, 0) for
flash_attn_varlen_func). FA4 4.0.0b36 (flash_attn/cute/interface.py, _resolve_causal_local_window) reads -1 as
unbounded only when both sides are negative; with causal=True and (-1, 0) it runs a local window whose left side is
-1. This script runs one varlen batch (two sequences of 16 and 32 tokens, 2 heads, d 64, bf16) three ways, causal
with window (None, None), causal with (-1, 0), causal with (-1, -1), and compares each with a float32 reference.
Expected: every max error near bf16 rounding (< 1e-2). Exit 1 if one is not.
"""
import sys

import torch


def reference(q, k, v, cu, scale):
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(len(cu) - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        qs, ks, vs = (x[s:e].float().transpose(0, 1) for x in (q, k, v))   # [h, n, d]
        scores = qs @ ks.transpose(1, 2) * scale
        n = e - s
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def main():
    from flash_attn.cute import flash_attn_varlen_func

    torch.manual_seed(0)
    lens = [16, 32]
    cu = torch.tensor([0, 16, 48], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 64 ** -0.5
    ref = reference(q, k, v, cu, scale)
    bad = 0
    for window in ((None, None), (-1, 0), (-1, -1)):
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=32, max_seqlen_k=32,
                                     softmax_scale=scale, causal=True, window_size=window)
        out = out[0] if isinstance(out, (tuple, list)) else out
        err = (out.float() - ref).abs()
        row0 = out[0, 0, :4].float().tolist()
        print(f"causal=True window_size={window}: max |error| {err.max().item():.4g}; sequence 0, row 0, head 0: "
              f"{[round(x, 4) for x in row0]} (reference {[round(x, 4) for x in ref[0, 0, :4].tolist()]})")
        bad += err.max().item() > 1e-2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
