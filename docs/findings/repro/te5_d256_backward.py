#!/usr/bin/env python3
"""TE-5: TransformerEngine's cuDNN FusedAttention backward at head dim 256 leaves head dims 128-255 of dK and dV (and,
with the default backward, of dQ) unwritten, with torch and TransformerEngine alone
(docs/findings/te-5-d256-backward.md).

    python3 te5_d256_backward.py [--deterministic]

One GPU, no context parallelism, bf16, THD. Layouts:
  two_tokens   one sequence of 2 tokens, 1 head, no mask (the smallest case: one token cannot show it, since with a
               single key dQ and dK are exactly 0)
  gqa_causal   causal, sequences of 70, 1 and 13 tokens in slots of 72, 8 and 16 rows (padding between sequences,
               zero-filled), 4 query heads and 2, 4 or 1 KV heads
each at head dims 256/256, and 128/128 as the control. Forward and backward through DotProductAttention; O, dQ, dK,
dV of every valid row against a plain masked attention in float64 on the CPU (in _common.py). The worst error is
printed in bf16 ulps of the reference's largest magnitude, separately for head dims 0-127 and 128-255.

Expected: a few ulps in both halves. Exit 1 when a tensor is off by more than 64 ulps (a wrong result, not rounding),
0 when none is, 2 when it cannot run. --deterministic sets NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 before TE is imported.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402 - after the path
    gqa_reference as reference, offsets, padded_bf16_inputs, te_one_gpu_end, te_one_gpu_start)

LIMIT_ULPS = 64
LAYOUTS = {
    "two_tokens": dict(seqlens=[2], slots=[2], causal=False, heads=[(1, 1)]),
    "gqa_causal": dict(seqlens=[70, 1, 13], slots=[72, 8, 16], causal=True, heads=[(4, 2), (4, 4), (4, 1)]),
}
DIMS = [(256, 256), (128, 128)]


def run(te, torch, layout, heads_q, heads_kv, dim_qk, dim_v, seed=40):
    """{tensor: (worst error in dims < 128, worst in dims >= 128, largest |reference|)} of one forward and backward."""
    x, off = padded_bf16_inputs(torch, seed, layout["slots"], layout["seqlens"], heads_q, heads_kv, dim_qk, dim_v)
    i32 = dict(dtype=torch.int32, device="cuda")
    cu_s, cu_p = torch.tensor(offsets(layout["seqlens"]), **i32), torch.tensor(off, **i32)
    scale = dim_qk ** -0.5
    dpa = te.DotProductAttention(heads_q, (dim_qk, dim_v), num_gqa_groups=heads_kv, attention_dropout=0.0,
                                 qkv_format="thd", attn_mask_type="padding_causal" if layout["causal"] else "padding",
                                 softmax_scale=scale)
    q, k, v = (x[n].cuda().requires_grad_() for n in ("q", "k", "v"))
    o = dpa(q, k, v, cu_seqlens_q=cu_s, cu_seqlens_kv=cu_s, cu_seqlens_q_padded=cu_p, cu_seqlens_kv_padded=cu_p)
    o.backward(x["dout"].cuda().reshape(o.shape))
    torch.cuda.synchronize()
    got = {"o": o.detach().view(off[-1], heads_q, dim_v).double().cpu(), "dq": q.grad.double().cpu(),
           "dk": k.grad.double().cpu(), "dv": v.grad.double().cpu()}
    worst = {n: [0.0, 0.0, 0.0] for n in got}
    for b, n in enumerate(layout["seqlens"]):
        s = slice(off[b], off[b] + n)
        ref = reference(*(x[t][s].double() for t in ("q", "k", "v", "dout")), scale, layout["causal"])
        for name, r in ref.items():
            e = (got[name][s] - r).abs().nan_to_num(float("inf"))
            w = worst[name]
            w[0] = max(w[0], float(e[..., :128].max()))
            w[1] = max(w[1], float(e[..., 128:].max()) if e.shape[-1] > 128 else 0.0)
            w[2] = max(w[2], float(r.abs().max()))
    return worst


def main():
    _, libs, mode = te_one_gpu_start(__doc__)
    torch, _, te = libs
    print(f"TE-5: TransformerEngine non-CP, cuDNN FusedAttention, {mode} backward, bf16; worst |error| in bf16 ulps "
          f"of the reference's largest magnitude, head dims 0-127 / 128-255; wrong above {LIMIT_ULPS}")
    bad = 0
    for name, layout in LAYOUTS.items():
        for heads_q, heads_kv in layout["heads"]:
            for dim_qk, dim_v in DIMS:
                label = f"{name:10} heads {heads_q}/{heads_kv} d {dim_qk}/{dim_v}"
                try:
                    worst = run(te, torch, layout, heads_q, heads_kv, dim_qk, dim_v)
                except Exception as e:  # noqa: BLE001 - TE refusing a layout is a line of the table
                    print(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                cells, marks = [], []
                for t, (lo, hi, mag) in worst.items():
                    ulp = max(mag, 1e-30) * 2.0 ** -8
                    cells.append(f"{t} {lo / ulp:7.1f} / {hi / ulp:7.1f}")
                    if not max(lo, hi) <= LIMIT_ULPS * ulp:
                        marks.append(t)
                bad += len(marks)
                print(f"{label}: " + "  ".join(cells) + (f"   <-- wrong: {', '.join(marks)}" if marks else ""))
    return te_one_gpu_end(libs, f"tensors over {LIMIT_ULPS} ulps", bad)


if __name__ == "__main__":
    sys.exit(main())
